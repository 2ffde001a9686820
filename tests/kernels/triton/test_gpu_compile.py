"""The attention kernels compile for an H100 (sm_90: Triton IR, PTX, then ptxas to a cubin) in
bf16, the GPU engine's dtype, with no GPU present. The interpreter runs kernels as numpy and
accepts code the compiler rejects, so this is the check that the tested kernels are also GPU
kernels. It runs in a subprocess because the interpreter is chosen once per process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

COMPILE_FOR_SM90 = r"""
import torch
torch.cuda.is_available = lambda: True  # decorate for a GPU; nothing here touches a device
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from agentrt.kernels.triton import paged_attention as pa, rotary_kv_write as rk

def compile_sm90(fn, pointers, floats, constexprs):
    signature = {name: pointers.get(name, floats.get(name, "i32")) for name in fn.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"], fn.__name__
    print(fn.__name__, "compiled")

bf16 = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "qkv_ptr", "k_cache_ptr", "v_cache_ptr")}
fp32 = {n: "*fp32" for n in ("part_m_ptr", "part_l_ptr", "part_acc_ptr", "cos_ptr", "sin_ptr")}
i64 = {n: "*i64" for n in ("cu_q_ptr", "pos_ptr", "table_ptr", "slot_ptr")}
pointers = {**bf16, **fp32, **i64}
for split in (False, True):
    compile_sm90(pa._paged_attention_kernel, pointers, {"qk_scale": "fp32"},
                 dict(GROUP=4, GROUP_P=4, BLOCK_Q=16, BLOCK_N=pa.BLOCK_N, HEAD_DIM=128, BLOCK_SIZE=16, SPLIT=split,
                      DOT_PRECISION="tf32"))
compile_sm90(pa._combine_splits_kernel, pointers, {}, dict(NUM_Q_HEADS=32, HEADS_P=32, HEAD_DIM=128))
compile_sm90(rk._rotary_kv_write_kernel, pointers, {}, dict(NQ=9, NKV=3, HEAD_DIM=64, QK_HEADS_P=16, KV_HEADS_P=4))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU runs the kernels themselves")
def test_attention_kernels_compile_for_sm90_in_bf16():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated to silence its warning
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 4
