"""The kernels compile for an H100 (sm_90: TTIR, TTGIR, LLVM IR, PTX and a cubin) on this CPU-only
machine: Triton's compiler and ptxas run without a device, so front-end mistakes the interpreter
lets through (types of loop-carried values, non-constexpr globals, unsupported ops) fail here."""
import os
import subprocess
import sys

COMPILE_EVERY_KERNEL = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from agentrt.kernels.triton import INTERPRETED, masked_sample, rmsnorm, silu_gate, verify
assert not INTERPRETED
C, P32, P16, I32, PI32, PI64 = "constexpr", "*fp32", "*fp16", "i32", "*i32", "*i64"
VERIFY = dict(target_ptr=P32, t_stride=I32, draft_ptr=PI32, cu_ptr=PI32, q_ptr=P32, q_stride=I32, u_accept_ptr=P32,
              u_sample_ptr=P32, out_ptr=PI64, out_stride=I32, num_accepted_ptr=PI64, total_ptr=P32, vocab=I32,
              HAS_Q=C, BLOCK_K=C, BLOCK_V=C)
MASK = dict(mask_ptr=PI32, mask_stride=I32, n_words=I32, mask_rows_ptr=PI32)
KERNELS = [
    (verify._verify_kernel, VERIFY, dict(HAS_Q=True, BLOCK_K=16, BLOCK_V=1024)),
    (verify._verify_kernel, VERIFY, dict(HAS_Q=False, BLOCK_K=16, BLOCK_V=1024)),
    (verify._verify_greedy_kernel, dict(best_ptr=PI64, draft_ptr=PI32, cu_ptr=PI32, out_ptr=PI64, out_stride=I32,
                                        num_accepted_ptr=PI64, BLOCK_K=C), dict(BLOCK_K=8)),
    (masked_sample._masked_argmax_kernel, dict(x_ptr=P16, x_stride=I32, **MASK, out_ptr=PI64, vocab=I32, HAS_MASK=C,
                                               BLOCK=C), dict(HAS_MASK=True, BLOCK=1024)),
    (masked_sample._masked_sample_kernel, dict(p_ptr=P32, p_stride=I32, **MASK, uniform_ptr=P32, out_ptr=PI64,
                                               total_ptr=P32, vocab=I32, HAS_MASK=C, BLOCK=C),
     dict(HAS_MASK=True, BLOCK=1024)),
    (rmsnorm._rmsnorm_residual_kernel, dict(x_ptr=P16, x_stride=I32, res_ptr=P16, res_stride=I32, w_ptr=P16, out_ptr=P16,
                                            out_stride=I32, res_out_ptr=P16, res_out_stride=I32, hidden=I32, eps="fp32",
                                            HAS_RESIDUAL=C, BLOCK=C), dict(HAS_RESIDUAL=True, BLOCK=4096)),
    (silu_gate._silu_gate_kernel, dict(gate_up_ptr=P16, in_stride=I32, out_ptr=P16, out_stride=I32, inter=I32, BLOCK=C),
     dict(BLOCK=1024)),
]
for fn, signature, constexprs in KERNELS:
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], fn.__name__
print("compiled", len(KERNELS))
'''


def test_every_kernel_compiles_for_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", COMPILE_EVERY_KERNEL], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 7" in done.stdout
