/* Shared helpers of the CPU kernels: bf16 <-> fp32 with PyTorch's rounding (nearest-even). */
#ifndef AGENTRT_CPU_COMMON_H
#define AGENTRT_CPU_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_pool.h"

typedef uint16_t bf16;

static inline float bf2f(bf16 v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* c10::BFloat16's conversion: NaN -> 0x7fc0, otherwise round to nearest, ties to even. */
static inline bf16 f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}

typedef struct {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* Every tile 16 rows x 64 bytes: an fp32 [16 x 16] accumulator, 16 x-rows of 32 bf16 k-values,
 * or 16 k-pairs of 16 weight rows. */
static inline void configure_tiles(void) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; t++) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

/* bf16 rounding (nearest-even, as c10::BFloat16) of 16 floats, kept as floats. */
static inline __m512 round_bf16(__m512 v) {
  __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load_bf16x16(const bf16 *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 load_bf16(const bf16 *p, __mmask16 k) {
  __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void store_bf16(bf16 *p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, (__m256i)_mm512_cvtneps_pbh(v));
}

/* exp(x) as 2^n * p(r), |r| <= ln2/2 (Cephes' polynomial, ~1 ulp); 0 below -87.3 (where the
 * true value is denormal) and for -inf, saturating at exp(88.37) above. */
static inline __m512 exp_ps(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365478515625f), _CMP_GE_OQ);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365478515625f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* The references' rms-norms of one K-wide row, 16 lanes at a time (a scalar loop cost ~1.1 us
 * per 576-wide row: 1 ms of a 16-token step). w_f32 = 0: Llama's, w bf16:
 * bf16(w * bf16(x * rsqrt(mean(x^2) + eps))). w_f32 = 1: Gemma's, w the fp32 (1 + weight):
 * bf16((x * rsqrt(mean(x^2) + eps)) * w), scaled in fp32 before the one rounding. out may be x
 * (each element is read before it is written). */
static inline void norm_row(const bf16 *x, const void *w, int w_f32, int64_t K, float eps, bf16 *out) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
    const __m512 v = load_bf16(x + k, m);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)K + eps));
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
    const __m512 xn = _mm512_mul_ps(load_bf16(x + k, m), r);
    if (w_f32)
      store_bf16(out + k, _mm512_mul_ps(xn, _mm512_maskz_loadu_ps(m, (const float *)w + k)), m);
    else
      store_bf16(out + k, _mm512_mul_ps(load_bf16((const bf16 *)w + k, m), round_bf16(xn)), m);
  }
}

#endif
