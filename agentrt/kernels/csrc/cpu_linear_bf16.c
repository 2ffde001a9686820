/* bf16 linear layers on Intel AMX: y = epilogue(norm(x) W^T + bias).
 *
 * Why: a decode or verification step multiplies a few rows by every weight once, so it is
 * bound by reading the weights. oneDNN's packed GEMV reaches ~16 GB/s here with a large fixed
 * cost per call, and AVX512 vdpbf16ps issues only every other cycle on this CPU. An AMX tile
 * multiply takes 16 rows of x and 1 KB of weights at once: a step reads each weight once at
 * memory speed whether it feeds 1 row or 16, which keeps verifying drafts nearly free.
 *
 * The rounding mirrors the PyTorch reference path (agentrt/kernels/linear.py) step by step:
 * accumulate in fp32, round to bf16, then each epilogue op in fp32 followed by a bf16 rounding,
 * as the separate bf16 torch ops do. Only the summation order of the dot products differs.
 *
 * Packed weight layout (agentrt/kernels/linear.py:pack_weight): [units][K32 / 2][16][2] bf16,
 * K32 = K rounded up to 32, one unit = 16 output rows (zero padded): each 1 KB run of 16 k-pairs
 * is an AMX B tile. For the gated epilogues, units alternate gate/up (unit 2i: gate rows
 * 16i.., unit 2i+1: the matching up rows).
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_common.h"

#define EPI_NONE 0
#define EPI_RESIDUAL 1 /* y = bf16(res + bf16(acc)) */
#define EPI_SILU_MUL 2 /* y = bf16(bf16(silu(bf16(acc_gate))) * bf16(acc_up)) */
#define EPI_GELU_MUL 3 /* y = bf16(bf16(gelu_tanh(bf16(acc_gate))) * bf16(acc_up)): GeGLU */

#define NB 4 /* units (C tiles) per pass over a k range */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out AMX state only to processes that ask. Returns 0 when AMX may be used. */
int agentrt_amx_init(void) {
  return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
}

/* gelu_tanh(x) = 0.5 x (1 + tanh(y)) = x / (1 + e^(-2y)), y = sqrt(2/pi) (x + 0.044715 x^3): the
 * second form never subtracts nearly equal numbers (torch's formula, rounded the same way but for
 * exp's last bits), as the fused quantized decoder computes it. */
static inline __m512 gelu_tanh_ps(__m512 x) {
  const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
  const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
  const __m512 e = exp_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), y));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* Write rows [0, mt) of the accumulators acc[b][16 rows][16] for units u0..u0+nb. */
static void store_tile(const float *acc, int mt, int64_t u0, int nb, int64_t N, const bf16 *bias,
                       int epilogue, const bf16 *res, int64_t ldr, void *y, int64_t ldy, int out_f32) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int m = 0; m < mt; m++) {
    if (epilogue == EPI_SILU_MUL || epilogue == EPI_GELU_MUL) {
      for (int b = 0; b + 1 < nb; b += 2) {
        int64_t n0 = ((u0 + b) / 2) * 16;
        __mmask16 k = N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
        __m512 g = round_bf16(_mm512_loadu_ps(acc + (b * 16 + m) * 16));
        __m512 u = round_bf16(_mm512_loadu_ps(acc + ((b + 1) * 16 + m) * 16));
        __m512 s = epilogue == EPI_GELU_MUL
                       ? gelu_tanh_ps(g)
                       : _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        store_bf16((bf16 *)y + m * ldy + n0, _mm512_mul_ps(round_bf16(s), u), k);
      }
      continue;
    }
    for (int b = 0; b < nb; b++) {
      int64_t n0 = (u0 + b) * 16;
      if (n0 >= N) break;
      __mmask16 k = N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
      __m512 v = _mm512_loadu_ps(acc + (b * 16 + m) * 16);
      if (bias) v = _mm512_add_ps(v, load_bf16(bias + n0, k));
      if (epilogue == EPI_RESIDUAL) v = _mm512_add_ps(load_bf16(res + m * ldr + n0, k), round_bf16(v));
      if (out_f32)
        _mm512_mask_storeu_ps((float *)y + m * ldy + n0, k, round_bf16(v));
      else
        store_bf16((bf16 *)y + m * ldy + n0, v, k);
    }
  }
}

/* Accumulator tiles 0..3 (the macros take tile numbers as immediates, hence no loop). */
static inline void zero_acc_tiles(void) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

/* acc[t][16 rows][16] <- tile t, t = 0..3. */
static inline void store_acc_tiles(float *acc) {
  _tile_stored(0, acc, 64);
  _tile_stored(1, acc + 256, 64);
  _tile_stored(2, acc + 512, 64);
  _tile_stored(3, acc + 768, 64);
}

typedef struct {
  const bf16 *w, *xp, *bias, *res;
  int64_t N, K32, M, units, ldr, ldy;
  int epilogue, out_f32;
  void *y;
  pool_chunks chunks; /* of NB units */
} linear_job;

/* Chunks of NB units (NB even: a gated pair never splits) until none is left. */
static void linear_part(void *arg, int tid, int nt) {
  (void)nt;
  linear_job *J = (linear_job *)arg;
  const bf16 *w = J->w, *xp = J->xp, *bias = J->bias, *res = J->res;
  const int64_t N = J->N, K32 = J->K32, M = J->M, units = J->units, ldr = J->ldr, ldy = J->ldy;
  const int epilogue = J->epilogue, out_f32 = J->out_f32;
  void *y = J->y;
  const int64_t kchunks = K32 / 32, unit_elems = K32 * 16;
  float acc[NB * 16 * 16] __attribute__((aligned(64)));
  configure_tiles();
  for (int64_t c; (c = pool_claim(&J->chunks, tid)) >= 0;) {
    const int64_t u = c * NB;
    int nb = (int)(units - u < NB ? units - u : NB);
    const bf16 *wu = w + u * unit_elems;
    int64_t m0 = 0;
    /* Pairs of 16-row blocks against 2 units at a time: each weight tile loaded once feeds 32 rows. */
    for (; M - m0 > 16; m0 += 32) {
      const bf16 *xa = xp + m0 * K32;
      for (int b0 = 0; b0 < nb; b0 += 2) {
        int two = nb - b0 > 1;
        const bf16 *wb = wu + b0 * unit_elems;
        zero_acc_tiles();
        for (int64_t kc = 0; kc < kchunks; kc++) {
          _tile_loadd(4, xa + kc * 32, K32 * 2);
          _tile_loadd(5, xa + 16 * K32 + kc * 32, K32 * 2);
          _tile_loadd(6, wb + kc * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(2, 5, 6);
          if (two) {
            _tile_loadd(7, wb + unit_elems + kc * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        /* acc[b][row][16]: rows 0..15 of block 0 in units b0, b0+1, then block 1. */
        store_acc_tiles(acc);
        int mt = (int)(M - m0 - 16 < 16 ? M - m0 - 16 : 16);
        for (int half = 0; half < 2; half++) {
          int64_t r0 = m0 + 16 * half;
          char *yrow = (char *)y + r0 * ldy * (out_f32 ? 4 : 2);
          store_tile(acc + half * 512, half ? mt : 16, u + b0, two ? 2 : 1, N, bias, epilogue,
                     res ? res + r0 * ldr : NULL, ldr, yrow, ldy, out_f32);
        }
      }
    }
    /* At most 16 rows left: one x tile against up to 4 units. */
    if (m0 < M) {
      const bf16 *xa = xp + m0 * K32;
      zero_acc_tiles();
      for (int64_t kc = 0; kc < kchunks; kc++) {
        _tile_loadd(4, xa + kc * 32, K32 * 2);
        const bf16 *wk = wu + kc * 512;
        _tile_loadd(5, wk, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) {
          _tile_loadd(6, wk + unit_elems, 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (nb > 2) {
          _tile_loadd(7, wk + 2 * unit_elems, 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (nb > 3) {
          _tile_loadd(5, wk + 3 * unit_elems, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      store_acc_tiles(acc);
      int mt = (int)(M - m0 < 16 ? M - m0 : 16);
      char *yrow = (char *)y + m0 * ldy * (out_f32 ? 4 : 2);
      store_tile(acc, mt, u, nb, N, bias, epilogue, res ? res + m0 * ldr : NULL, ldr, yrow, ldy,
                 out_f32);
    }
  }
  _tile_release();
}

/* y[M, N] = epilogue(norm(x)[M, K] W^T + bias).
 * w: packed weight of `units` 16-row units; N: output columns (for EPI_SILU_MUL and EPI_GELU_MUL
 * the gated width, half the packed rows). norm_w: rms-norm weight applied to x first, or NULL:
 * bf16 (Llama's norm), or with norm_f32 Gemma's fp32 (1 + weight) (norm_row). res may alias y
 * (each element is read, then written, by one thread). out_f32: write fp32 (bf16-rounded) values. */
void agentrt_linear_bf16(const bf16 *w, int64_t units, int64_t N, int64_t K, const bf16 *x,
                         int64_t M, int64_t ldx, const void *norm_w, int norm_f32, float eps,
                         const bf16 *bias, int epilogue, const bf16 *res, int64_t ldr, void *y, int64_t ldy,
                         int out_f32, int num_threads) {
  /* x, normed or not, copied into zero-padded [M16, K32] so every A tile load is full. */
  const int64_t K32 = (K + 31) / 32 * 32, M16 = (M + 15) / 16 * 16;
  static __thread scratch_buf xbuf;
  bf16 *xp = (bf16 *)scratch_get(&xbuf, (size_t)(M16 * K32) * sizeof(bf16));
  memset(xp, 0, (size_t)(M16 * K32) * sizeof(bf16));
  for (int64_t m = 0; m < M; m++) {
    if (norm_w)
      norm_row(x + m * ldx, norm_w, norm_f32, K, eps, xp + m * K32);
    else
      memcpy(xp + m * K32, x + m * ldx, (size_t)K * sizeof(bf16));
  }
  linear_job job = {w, xp, bias, res, N, K32, M, units, ldr, ldy, epilogue, out_f32, y, {0}};
  pool_chunks_init(&job.chunks, (units + NB - 1) / NB, num_threads);
  pool_run(linear_part, &job, num_threads);
}

/* Pack w ([n, K] bf16, row stride ldw) into the layout above: its 16-row units (rows padded to
 * a multiple of 16, K to K32 = ceil32(K), padding zero) go to dst units 0, unit_stride,
 * 2 * unit_stride, ... of K32 * 16 elements each (stride 2 interleaves a gate and an up weight). */
typedef struct {
  const bf16 *w;
  int64_t ldw, n, K, unit_stride;
  bf16 *dst;
  pool_chunks chunks; /* of units */
} pack_job;

static void pack_part(void *arg, int tid, int nt) {
  (void)nt;
  pack_job *J = (pack_job *)arg;
  const int64_t K32 = (J->K + 31) / 32 * 32;
  for (int64_t u; (u = pool_claim(&J->chunks, tid)) >= 0;) {
    bf16 *out = J->dst + u * J->unit_stride * K32 * 16;
    for (int r = 0; r < 16; r++) {
      const int64_t row = u * 16 + r;
      for (int64_t kp = 0; kp < K32 / 2; kp++)
        for (int i = 0; i < 2; i++) {
          const int64_t k = 2 * kp + i;
          out[(kp * 16 + r) * 2 + i] = row < J->n && k < J->K ? J->w[row * J->ldw + k] : 0;
        }
    }
  }
}

void agentrt_pack_weight_bf16(const bf16 *w, int64_t ldw, int64_t n, int64_t K, bf16 *dst, int64_t unit_stride,
                              int num_threads) {
  pack_job job = {w, ldw, n, K, unit_stride, dst, {0}};
  pool_chunks_init(&job.chunks, (n + 15) / 16, num_threads);
  pool_run(pack_part, &job, num_threads);
}
