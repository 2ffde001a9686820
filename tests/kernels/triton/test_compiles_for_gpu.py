"""The sampling, verification, norm, gate and attention kernels compile for an H100 (sm_90: Triton IR, PTX,
then ptxas to a cubin; model tensors in bf16, the GPU engine's dtype) on this CPU-only machine.
Triton's compiler and ptxas need no device, so mistakes the interpreter lets through (types of
loop-carried values, non-constexpr globals, unsupported ops) fail here. A subprocess, since the
interpreter is chosen once per process; TRITON_INTERPRET=0 keeps the kernels compiled there."""
import os
import subprocess
import sys

COMPILE_EVERY_KERNEL = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from agentrt.kernels.triton import INTERPRETED, masked_sample, paged_attention, rmsnorm, rotary_kv_write, silu_gate, verify
assert not INTERPRETED

def compile_sm90(fn, pointers, constexprs, scalars={}):
    # Arguments named *_ptr are pointers (bf16 unless named), the rest i32 unless named.
    signature = {n: pointers.get(n, "*bf16") if n.endswith("_ptr") else scalars.get(n, "i32") for n in fn.arg_names}
    signature.update({n: "constexpr" for n in constexprs})
    assert triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32)).asm["cubin"]
    print(fn.__name__, "compiled")

ints = {n: "*i32" for n in ("draft_ptr", "cu_ptr", "mask_ptr", "mask_rows_ptr")}
ints.update({n: "*i64" for n in ("out_ptr", "num_accepted_ptr", "best_ptr")})
fp32 = {n: "*fp32" for n in ("u_accept_ptr", "u_sample_ptr", "uniform_ptr", "total_ptr")}
for has_q in (True, False):
    compile_sm90(verify._verify_kernel, {**ints, **fp32}, dict(HAS_Q=has_q, BLOCK_K=16, BLOCK_V=1024))
compile_sm90(verify._verify_greedy_kernel, ints, dict(BLOCK_K=8))
compile_sm90(masked_sample._masked_argmax_kernel, ints, dict(HAS_MASK=True, BLOCK=1024))
compile_sm90(masked_sample._masked_sample_kernel, {**ints, **fp32, "p_ptr": "*fp32"}, dict(HAS_MASK=True, BLOCK=1024))
compile_sm90(rmsnorm._rmsnorm_residual_kernel, {}, dict(HAS_RESIDUAL=True, BLOCK=4096), {"eps": "fp32"})
compile_sm90(silu_gate._silu_gate_kernel, {}, dict(BLOCK=1024))
attention = {**{n: "*fp32" for n in ("part_m_ptr", "part_l_ptr", "part_acc_ptr", "cos_ptr", "sin_ptr")},
             **{n: "*i64" for n in ("cu_q_ptr", "pos_ptr", "table_ptr", "slot_ptr")}}
for split in (False, True):  # 32 query heads over 8 KV heads of 128
    compile_sm90(paged_attention._paged_attention_kernel, attention,
                 dict(GROUP=4, GROUP_P=4, BLOCK_Q=16, BLOCK_N=paged_attention.BLOCK_N, HEAD_DIM=128, BLOCK_SIZE=16,
                      SPLIT=split, DOT_PRECISION="tf32"), {"qk_scale": "fp32"})
compile_sm90(paged_attention._combine_splits_kernel, attention, dict(NUM_Q_HEADS=32, HEADS_P=32, HEAD_DIM=128))
compile_sm90(rotary_kv_write._rotary_kv_write_kernel, attention, dict(NQ=9, NKV=3, HEAD_DIM=64, QK_HEADS_P=16, KV_HEADS_P=4))
'''


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", COMPILE_EVERY_KERNEL], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled") == 11
