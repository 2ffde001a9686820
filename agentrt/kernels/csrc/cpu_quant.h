/* What the quantized kernels' files share: cpu_quant_avx2.c (activations, the blocks of 32 of
 * Q8_0/Q4_0/Q4_1, threads, the entry points), cpu_quant_k.c (Q4_K/Q5_K/Q6_K, Q5_0/Q5_1) and
 * cpu_quant_decoder.c (whole decoder layers over those linears). */
#ifndef AGENTRT_CPU_QUANT_H
#define AGENTRT_CPU_QUANT_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_pool.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(AGENTRT_QUANT_SCALAR)
#define QUANT_AVX2 1
#include <immintrin.h>
#else
#define QUANT_AVX2 0
#endif

/* The 512-bit paths of cpu_quant_avx512.c, where the compiler targets them (-march=native) */
#if QUANT_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QUANT_AVX512 1
#else
#define QUANT_AVX512 0
#endif
/* VDPBF16PS, where the compiler targets it: the attention's scores in one instruction per 16 bf16
 * pairs (elsewhere two fp32 FMAs per pair give the same bits) */
#if QUANT_AVX512 && defined(__AVX512BF16__)
#define QUANT_AVX512BF16 1
#else
#define QUANT_AVX512BF16 0
#endif
#if QUANT_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define QUANT_AMX 1
#else
#define QUANT_AMX 0
#endif
/* TDPBF16PS, where the compiler targets it: the attention's scores and P.V on AMX tiles */
#if QUANT_AMX && QUANT_AVX512BF16 && defined(__AMX_BF16__)
#define QUANT_AMX_BF16 1
#else
#define QUANT_AMX_BF16 0
#endif

/* The instruction sets a linear can run on, in order: agentrt_quant_isa names the best this
 * build and CPU allow; each runs ROWS8 weights to the same bits. */
enum { QUANT_ISA_SCALAR = 0, QUANT_ISA_AVX2 = 1, QUANT_ISA_VNNI = 2, QUANT_ISA_AMX = 3 };

enum { /* gguf.GGMLQuantizationType values */
  FMT_Q4_0 = 2, FMT_Q4_1 = 3, FMT_Q5_0 = 6, FMT_Q5_1 = 7, FMT_Q8_0 = 8, FMT_Q4_K = 12, FMT_Q5_K = 13, FMT_Q6_K = 14
};
/* A format code with ROWS8 set: the weight's rows interleaved in groups of 8
 * (agentrt_quant_interleave; Q4_0, Q4_1, Q8_0) */
#define ROWS8 0x100
#define QK 32    /* values per activation block (and per block of the small formats) */
#define QK_K 256 /* values per K-quant super-block */

typedef struct {
  const uint8_t *w;
  int fmt, rows8; /* fmt without the ROWS8 bit; rows8: it was set */
  int64_t N, K, nb, row_bytes; /* nb: activation blocks per row, K/32; ROWS8: bytes per group of 8 rows */
  const int8_t *xq; /* [M][K] (rows past M up to a multiple of 16: zeros) */
  /* ROWS8 weights on AVX2, VNNI and AMX: the activations by group of vg rows, block and row,
   * [ceil(M / vg)][nb][vg][32], else NULL. A block's
   * rows lie at constant offsets from one pointer, where by row each row's address takes a
   * register of its own and they spill. */
  const uint8_t *xv;
  int64_t vg; /* 16, or 1 for a one-row call: its rows as quantized, no copy (vg_at) */
  int isa;           /* QUANT_ISA_*: the path this call runs ROWS8 weights on */
  const float *xd; /* [M][nb] */
  const float *xs;  /* [M][nb8]: nb rounded up to 8, zero-padded */
  /* xd and xs by group of vg rows, block and row, [ceil(M / vg)][nb][vg], where xv is (else
   * NULL), for the same reason (AMX runs 5+ rows: vg 16, scales_at; it reads xq, not xv, whose
   * copy, ~50 us a layer at 512 rows timed alone on a Zen 4, is ~0.5% of the Xeon's prefill) */
  const float *xdt, *xst;
  /* Q8_0 where VNNI may run the call (AMX hands it chunks it cannot buffer): -128 times each
   * row's sum of a block's quantized activations, laid out as xdt. VPDPBUSD multiplies unsigned
   * by signed bytes; the weights + 128 times the activations, started from this, is the signed
   * product exactly. Else NULL */
  const int32_t *xsw;
  int64_t nb8;
  int64_t M;
  float *out;
  int64_t out_stride;
  pool_chunks chunks;
} qjob;

/* Where row m's block b lies in xv (in 32-byte blocks), xdt and xst: rows of a group consecutive */
static inline int64_t vg_at(const qjob *j, int64_t m, int64_t b) {
  return ((m / j->vg) * j->nb + b) * j->vg + m % j->vg;
}

/* vg_at for 16-row groups (AMX, and the copy that writes them) */
static inline int64_t scales_at(int64_t nb, int64_t m, int64_t b) {
  return ((m >> 4) * nb + b) * 16 + (m & 15);
}

#if QUANT_AVX2
/* the 8 lanes added: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* int32 lanes 0..n-1 set (n <= 8) */
static inline __m256i lanes_below(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Cephes' polynomial for e^x: *n = round(xc log2 e), returns e^(xc - n ln2), ~1 ulp
 * (|xc - n ln2| <= ln2/2) */
static inline __m256 exp_poly8(__m256 xc, __m256 *n_out) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  *n_out = n;
  return _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
}

/* e^x, ~1 ulp (exp_poly8 times 2^n). 2^n is applied in two halves so that n = 128 (x up to
 * 88.72) stays finite; x < -87.5 gives 0 (the true value is below FLT_MIN: nothing a softmax or
 * SiLU can tell from 0). NaN stays NaN (min/max return their second operand on NaN). */
static inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-88.0f), _mm256_min_ps(_mm256_set1_ps(88.75f), x));
  __m256 n;
  const __m256 p = exp_poly8(xc, &n);
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.5f), _CMP_LT_OQ), y);
}

#if QUANT_AVX512
/* exp_poly8 on 16 lanes (the same operations per lane, so the same bits) */
static inline __m512 exp_poly16(__m512 xc, __m512 *n_out) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  *n_out = n;
  return _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
}

/* exp8 on 16 lanes: the same operations per lane, so the same bits */
static inline __m512 exp16(__m512 x) {
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-88.0f), _mm512_min_ps(_mm512_set1_ps(88.75f), x));
  __m512 n;
  const __m512 p = exp_poly16(xc, &n);
  const __m512i ni = _mm512_cvtps_epi32(n), n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  const __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
  return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.5f), _CMP_LT_OQ), y);
}
#endif
#endif

static inline float f16_to_f32(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
#if QUANT_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t u;
  if (e == 0) { /* zero or subnormal: man * 2^-24, exact */
    const float v = (float)man * 0x1p-24f;
    return sign ? -v : v;
  }
  u = sign | (e == 0x1f ? 0x7f800000u | (man << 13) : ((e + 112) << 23) | (man << 13));
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

/* The quantized decoder's K/V caches hold bf16 (as GPU attention kernels keep them): half the
 * bytes of fp32 to read per cached token and to keep resident, and the operand of one-instruction
 * bf16 dot products (VDPBF16PS). A value is rounded once, when its token's K/V is written (to
 * nearest even), and read back exactly. Magnitudes below KV_FLUSH (2^-50) are stored as a signed
 * zero: then a product of two stored values is 0 or at least 2^-100 in magnitude and a multiple of
 * 2^-114, so no sum of them is ever subnormal, and VDPBF16PS (which flushes subnormal inputs and
 * results) and the fp32 FMAs that stand in for it elsewhere give the same bits. */
typedef uint16_t kv_t;
#define KV_FLUSH_BITS 0x26800000u /* 2^-50 as fp32 bits */

static inline uint16_t f32_to_kv(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* NaN stays a (quiet) NaN */
  if (ax < KV_FLUSH_BITS) return (uint16_t)((x >> 16) & 0x8000u);
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16); /* ties to even; past the top, inf */
}

static inline float kv_to_f32(kv_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#if QUANT_AVX2
/* f32_to_kv on 8 lanes, the results in the low 16 bits of each 32-bit lane */
static inline __m256i f32x8_to_kv32(__m256 v) {
  const __m256i x = _mm256_castps_si256(v), ax = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
  const __m256i hi = _mm256_srli_epi32(x, 16);
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(hi, _mm256_set1_epi32(1)))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(ax, _mm256_set1_epi32(0x7f800000));
  const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)KV_FLUSH_BITS), ax);
  __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  return _mm256_blendv_epi8(r, _mm256_and_si256(hi, _mm256_set1_epi32(0x8000)), tiny);
}

static inline __m256 kv_load8(const kv_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif
static inline float kv_load1(const kv_t *p) { return kv_to_f32(*p); }

/* dst[i] = f32_to_kv(src[i]) for i < n */
static inline void kv_store(kv_t *dst, const float *src, int64_t n) {
  int64_t i = 0;
#if QUANT_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256i r = f32x8_to_kv32(_mm256_loadu_ps(src + i));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* lanes 0-7 in the low half */
    _mm_storeu_si128((__m128i *)(dst + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < n; i++) dst[i] = f32_to_kv(src[i]);
}

#define QUANT_INTERNAL __attribute__((visibility("hidden")))

/* cpu_quant_k.c. Bytes per block of a format it runs (its block size in *block_size), else 0. */
QUANT_INTERNAL int quant_k_block_bytes(int fmt, int *block_size);
/* out rows n0 .. n1-1 of the job (a format quant_k_block_bytes knows), every activation row. */
QUANT_INTERNAL void quant_k_chunk(const qjob *j, int64_t n0, int64_t n1);
/* One weight row of K values dequantized into out [K], with the reference's fp32 ops. */
QUANT_INTERNAL void quant_k_embed_row(const uint8_t *row, int fmt, int64_t K, float *out);

/* cpu_quant_avx512.c: out rows n0 .. n1-1 (n0 a multiple of 16) of a ROWS8 job on j->isa
 * (VNNI or AMX); with AMX, each thread brackets its chunks by quant_amx_begin / _end. */
#if QUANT_AVX512
QUANT_INTERNAL void quant_rows16_chunk(const qjob *j, int64_t n0, int64_t n1);
#endif
#if QUANT_AMX
QUANT_INTERNAL void quant_amx_begin(int rows); /* activation tiles of `rows` rows (<= 16) */
QUANT_INTERNAL void quant_amx_end(void);
QUANT_INTERNAL int quant_tiles_granted(void); /* Linux gave this process AMX tile state (asked once) */
/* ldtilecfg's 64 bytes */
typedef struct {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} amx_config;
/* The tile configuration the calling thread has loaded: 0 none (released), -1 a linear's, else
 * an attention's (cpu_quant_attention.c), which reloads its own where this is not it. */
QUANT_INTERNAL extern __thread int quant_tile_shape;
#endif

/* cpu_quant_avx2.c's linear and embedding entry points, also run by cpu_quant_decoder.c. */
int agentrt_quant_linear(const float *x, int64_t x_stride, int64_t M, const uint8_t *w, int fmt, int64_t N,
                         int64_t K, float *out, int64_t out_stride, int threads);
int agentrt_quant_embedding(const int64_t *ids, int64_t T, const uint8_t *w, int fmt, int64_t N, int64_t K,
                            float *out, int64_t out_stride);

/* The attention of a decoder layer (cpu_quant_attention.c): attn[t] = softmax(q_t . K * scale) V
 * over token t's own positions, for the T tokens of a ragged batch; see the file. */
typedef struct {
  int64_t T, qkv_w, q_w;  /* q of token t at qkv + t qkv_w, heads side by side; attn rows q_w apart */
  int nq, nkv, d;
  float scale;
  const int64_t *positions, *seq, *block_tables, *tree_base, *path_slots; /* tree_base NULL: no trees */
  int64_t bt_stride, block_size, path_stride, window; /* window 0: all positions */
  const float *qkv;
  const kv_t *kc, *vc; /* caches [num_slots, nkv, d] bf16 */
  float *attn;
} qattn;

/* 0, or -3 when out of memory */
int quant_attention(const qattn *A, int threads);

/* cu_q, positions and block tables checked, seq[t] filled; 0 or -2 (cpu_quant_attention.c) */
int quant_check_tables(int64_t T, const int64_t *positions, int64_t B, const int64_t *cu_q, const int64_t *block_tables,
                       int64_t bt_stride, int64_t bt_cols, int64_t block_size, int64_t num_slots, int64_t *seq);

/* The calling thread's buffers touched for a step of T tokens (cpu_quant_avx2.c, _decoder.c) */
int quant_linear_reserve(int64_t M, int64_t K);

#endif
