/* The quantized decoder's attention (cpu_quant_decoder.c) over the paged bf16 caches (kv_t), for a
 * ragged batch: each query token t sees its own sequence's positions lo..p (lo: its sliding
 * window's first position, else 0; a token-tree node: its path's rows past the tree's base).
 *
 * Chunks. A token's positions are cut into chunks of ATTN_CHUNK fixed by the position alone;
 * chunk c's partial for query head h is, over the chunk's positions j,
 *   m = max_j s_j,   p_j = kv(e^(s_j - m)),   s = sum_j p_j,   acc = sum_j p_j V_j     (s_j = scale q.K_j)
 * with q and the numerators p_j rounded as the caches are (kv = f32_to_kv: bf16, tiny values
 * flushed), so that P.V is a bf16 dot product too (see P.V below);
 * and a token's chunks are folded in order, (m, s, acc) (+) (m', s', acc') =
 *   (M, s e^(m - M) + s' e^(m' - M), acc e^(m - M) + acc' e^(m' - M)),  M = max(m, m'),
 * then out = acc * (1 / s).
 *
 * Groups. The rows of one sequence in a step (a verification's k + 1 rows, a prefill chunk) read
 * the same key and value rows, so up to GROUP_ROWS of them are taken together: per chunk and KV
 * head, each key row is read once for all the group's queries (g query heads x rows), two queries
 * share each 512-bit multiply-add (from KEY_PAIRS_QUERIES queries on, where the CPU has VDPBF16PS,
 * the chunk's keys are transposed into pairs by position first, and an instruction takes one
 * pair of 16 positions: no horizontal sums), and each pair of value rows serves up to PV_QUERIES queries,
 * laid out once for all of them where more share it (the 256-bit loops: a key row's values split
 * once for up to 3 queries, a value row converted for 6). Tasks
 * are (group, KV head), or with few rows and long contexts (group, chunk, KV head), whose
 * partials a merge folds per token.
 *
 * Scores. A score is a bf16 dot product with fp32 sums, as VDPBF16PS computes it: 8 lane sums,
 * lane l taking the pairs of values 16 b + 2 l + {1, 0} for b = 0 .. d/16 - 1 in turn, each
 * pair as VDPBF16PS does, l += q[c+1] K[c+1] then l += q[c] K[c] (each rounded to fp32; the
 * products of bf16 values are exact), then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), times the scale.
 * Where the CPU has no VDPBF16PS, two fp32 FMAs per pair give the same bits (no subnormal can
 * arise: see kv_t).
 *
 * P.V. Column c of acc sums the chunk's positions in pairs (2i, 2i+1) counted from the chunk's
 * start, in order, each as VDPBF16PS does: acc += p[2i+1] V[2i+1][c], then += p[2i] V[2i][c]
 * (products of bf16 values, exact; a position outside the query's range adds nothing). AVX-512
 * lays two value rows side by side (value_pairs) and takes 16 columns of a pair in one VDPBF16PS,
 * half the instructions of fp32 FMAs on converted rows; elsewhere the FMAs run in that order
 * (positions 1, 0, 3, 2, ...), the same bits. Against fp32 numerators and FMAs on fp32 rows:
 * whole SmolLM2-135M forwards at 1024 cached tokens, 1 / 2 / 4 / 16 rows 0.99 / 0.95 / 0.98 / 0.96x
 * the time, 64 rows at 300 tokens 0.93x (AMD EPYC Zen 4, 2 threads, two builds in turn).
 *
 * AMX tiles (agentrt_quant_attention_tiles, off by default; AMX-BF16 and heads a multiple of 32
 * deep). The scores and P.V are TDPBF16PS tile multiplies, up to 16 queries a tile: a score is the
 * tile unit's sum of q.K over the head's 32-value slices in turn, a P.V column its sum over 16
 * pairs of positions at a time (the same value pairs and bf16 numerators as above). The unit sums
 * a tile multiply's products in its own order (neither VDPBF16PS's nor an FMA chain's: measured),
 * so these bits differ from the vector paths' by rounding; an element depends only on its own row
 * and column and on the rows' count (tested: 0 differences in 20000 random tiles), and swapping
 * the operands' roles leaves it the same (0 in 12.8 million), so more than 16 queries of a chunk
 * take key tiles (key_tiles: 16 positions' keys transposed into pairs by position) and fewer take
 * the keys as they lie in the cache against the queries transposed (scores_by_position), the same
 * bits. Every row of a process takes the one path, so batch invariance holds as below. Against the
 * vector paths on a 2-core Xeon (whole SmolLM2-135M forwards, in turn): at 1024 cached tokens 1 /
 * 4 / 16 rows 1.03 / 0.92 / 0.78x the time, at 300 tokens 1 row 1.03x, 8 sequences of 1 row 1.01x.
 *
 * Batch invariance. Whatever the group, the task or the instruction set, each number is computed
 * by the same operations in the same order as a token alone: a score's lane sums and their
 * reduction (two queries side by side in a 512-bit vector keep those lanes), the max and the exp sums over
 * each query's own scores, each output column's sum over position pairs in order, the chunk folds in
 * order. So a token's attention bits depend neither on the other rows, nor on the thread count,
 * nor on whether the CPU has AVX-512 (tiles off), and speculation (k+1 verify rows) cannot change
 * greedy output. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_quant.h"

#define ATTN_CHUNK 64          /* positions per chunk (a multiple of 8) */
#define OFF_ENTRIES (ATTN_CHUNK + 8) /* a chunk's row offsets, padded for the last batch of 8 */
#define GROUP_ROWS 16          /* rows of one sequence sharing each key and value row read: a verify
                                * of up to 15 drafts in one group, its keys read once (against
                                * 8: 30 layers at 1024 cached tokens, 9 rows 0.84x the time, 16 rows
                                * 0.89x, 128 rows 0.95x; 32 gained only at 128 rows) */
#define KEY_PAIRS_QUERIES 8     /* queries of a task from which the AVX-512 scores transpose its keys */
#define PV_QUERIES 6           /* queries sharing a value pair row: 4 accumulators each in registers */
#define PAIRS_STRIDE (ATTN_CHUNK / 2) /* a query's probability pairs (32-bit words) in a chunk */
#define MAX_SPLIT_CHUNKS 4096  /* split into chunk tasks: this many partials at most */
#define SERIAL_ATTN_MACS 32768 /* less work runs on the caller: cheaper than a join (~5 us) */
#define PART_STRIDE(d) ((d) + 8) /* a partial: acc[d], m, s, padding */
#define TILE_FLOATS 256        /* a stored C tile: 16 rows of 16 fp32 */

/* One query of a chunk: its scores s[lo .. lo + n) (indexed from the chunk's start, as off) and
 * where its partial goes (out[0..d) acc, out[d] m, out[d+1] s). */
typedef struct {
  const kv_t *q; /* rounded (f32_to_kv) */
  float *s, *out;
  int64_t lo, n;
} query;

/* ---- the per-ISA inner loops: scores and P.V for a set of queries sharing key/value rows ---- */

#if QUANT_AVX2

static float max_row(const float *s, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  if (j < n) { /* the tail, the other lanes -inf (a max is the same in any order) */
    const __m256i k = lanes_below(n - j);
    m = _mm256_max_ps(m, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(s + j, k), _mm256_castsi256_ps(k)));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* f32_to_kv on 8 lanes, back as fp32 (exact) */
static inline __m256 kv_round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(f32x8_to_kv32(v), 16)); }

/* s[j] = e^(s[j] - m) rounded as a K/V value (f32_to_kv: the probabilities enter P.V as bf16) for
 * j < n; returns their sum (lane sums in order, then the lanes) */
#if QUANT_AVX512
/* f32_to_kv on 16 lanes, back as fp32 (exact) */
static inline __m512 kv_round16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v), ax = _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff));
  const __m512i hi = _mm512_srli_epi32(x, 16);
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(ax, _mm512_set1_epi32(0x7f800000)),
                            _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(_mm512_set1_epi32((int)KV_FLUSH_BITS), ax),
                            _mm512_and_si512(hi, _mm512_set1_epi32(0x8000)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
}

/* kv_round16(exp16(x)) for x <= 0 (or NaN), the same bits in fewer operations: below -40 the
 * value is flushed either way (e^-40 < 2^-50), so one clamp, and VSCALEFPS for 2^n (exact: the
 * results are normal), replace exp16's two clamps, two-step 2^n and underflow mask; where the CPU
 * has VCVTNEPS2BF16, it rounds (ties to even, a NaN quieted as f32_to_kv does) */
static inline __m512 exp_kv16(__m512 x) {
  __m512 n;
  const __m512 p = exp_poly16(_mm512_max_ps(_mm512_set1_ps(-40.0f), x), &n);
  const __m512 y = _mm512_scalef_ps(p, n);
#if QUANT_AVX512BF16
  const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(y));
  const __mmask16 kept = _mm512_cmp_ps_mask(y, _mm512_castsi512_ps(_mm512_set1_epi32((int)KV_FLUSH_BITS)), _CMP_NLT_UQ);
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kept, h, 16));
#else
  return kv_round16(y);
#endif
}

static float exp_shift(float *s, int64_t n, float m) { /* 16 at a time, added to the 8 lane sums in order */
  const __m512 mv = _mm512_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp_kv16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    acc = _mm256_add_ps(acc, _mm512_extractf32x8_ps(e, 1));
  }
  if (j < n) { /* the lanes past n: zeros, as the 8-wide tail adds */
    const __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp_kv16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv)));
    _mm512_mask_storeu_ps(s + j, k, e);
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
    if (n - j > 8) acc = _mm256_add_ps(acc, _mm512_extractf32x8_ps(e, 1));
  }
  return hsum8(acc);
}
#else
/* kv_round8(exp8(x)) for x <= 0 (or NaN), the same bits in fewer operations, as exp_kv16: below
 * -40 the value is flushed either way, so one clamp, and 2^n (n >= -58) is one normal power of
 * two, by which the product is exact as exp8's two steps are, with no underflow mask */
static inline __m256 exp_kv8(__m256 x) {
  __m256 n;
  const __m256 p = exp_poly8(_mm256_max_ps(_mm256_set1_ps(-40.0f), x), &n);
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  return kv_round8(_mm256_mul_ps(p, scale));
}

static float exp_shift(float *s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_kv8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (j < n) {
    const __m256i k = lanes_below(n - j);
    const __m256 e = _mm256_and_ps(exp_kv8(_mm256_sub_ps(_mm256_maskload_ps(s + j, k), mv)), _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(s + j, k, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum8(acc);
}
#endif

/* The bf16 values at even (k_even) and odd (k_odd) places of 16, as fp32 (exact): lane l holds
 * element 2 l, resp. 2 l + 1 */
static inline __m256 k_even(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
static inline __m256 k_odd(__m256i x) { return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u))); }

/* lane l += q[c+1] k[c+1], then += q[c] k[c], c = 2 l (16 bf16 values of each): VDPBF16PS's
 * operations, by the instruction where the CPU has it, else by two FMAs (the same bits) */
static inline __m256 dot_pairs8(__m256 acc, __m256i qx, __m256i kx) {
#if QUANT_AVX512BF16
  return _mm256_dpbf16_ps(acc, (__m256bh)qx, (__m256bh)kx);
#else
  return _mm256_fmadd_ps(k_even(qx), k_even(kx), _mm256_fmadd_ps(k_odd(qx), k_odd(kx), acc));
#endif
}

/* s[j] = scale * (q . K_j) for j < n, K_j = K + off[j] (off: n rounded up to 8 entries), as the
 * file's head says. Eight positions at a time, then one transposing reduction gives the eight
 * dots as one vector, each summed in the same order whichever slot it had. */
static void scores(const kv_t *q, const kv_t *K, const int64_t *off, int64_t n, float scale, float *s, int d) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const kv_t *row[8];
    for (int r = 0; r < 8; r++) row[r] = K + off[j0 + r];
    __m256 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 16) {
      const __m256i qx = _mm256_loadu_si256((const __m256i *)(q + c));
      for (int r = 0; r < 8; r++) acc[r] = dot_pairs8(acc[r], qx, _mm256_loadu_si256((const __m256i *)(row[r] + c)));
    }
    const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    /* h0123 = [a0 a1 a2 a3 | b0 b1 b2 b3], a: the sum of lanes 0-3 of acc[r], b: of lanes 4-7 */
    const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    const __m256 v = _mm256_mul_ps(_mm256_add_ps(lo, hi), sv);
    if (j0 + 8 <= n) _mm256_storeu_ps(s + j0, v);
    else _mm256_maskstore_ps(s + j0, lanes_below(n - j0), v);
  }
}

/* out[c] = sum_j p[j] V_j[c] for c < 8 nv over the positions j in [lo, lo + n) in pair order
 * (PAIR_ORDER), V_j = V + off[j] */
static inline __attribute__((always_inline)) void pv_cols(const float *p, int64_t lo, int64_t n, const kv_t *V,
                                                          const int64_t *off, float *out, const int nv) {
  __m256 acc[8];
  for (int v = 0; v < nv; v++) acc[v] = _mm256_setzero_ps();
  for (int64_t k = lo & ~(int64_t)1; k < ((lo + n + 1) & ~(int64_t)1); k++) {
    const int64_t j = k ^ 1;
    if (j < lo || j >= lo + n) continue;
    const __m256 e = _mm256_set1_ps(p[j]);
    const kv_t *vr = V + off[j];
    for (int v = 0; v < nv; v++) acc[v] = _mm256_fmadd_ps(e, kv_load8(vr + 8 * v), acc[v]);
  }
  for (int v = 0; v < nv; v++) _mm256_storeu_ps(out + 8 * v, acc[v]);
}

static void pv(const float *p, int64_t lo, int64_t n, const kv_t *V, const int64_t *off, float *out, int d) {
  for (int c0 = 0; c0 < d; c0 += 64) { /* d % 8 == 0 (checked): up to 8 accumulators in registers */
    switch ((d - c0) / 8 < 8 ? (d - c0) / 8 : 8) {
#define PV(NV) case NV: pv_cols(p, lo, n, V + c0, off, out + c0, NV); break;
      PV(1) PV(2) PV(3) PV(4) PV(5) PV(6) PV(7) default: pv_cols(p, lo, n, V + c0, off, out + c0, 8);
#undef PV
    }
  }
}

#else /* scalar */

static float max_row(const float *s, int64_t n) {
  float r = -INFINITY;
  for (int64_t j = 0; j < n; j++) r = fmaxf(r, s[j]);
  return r;
}

static float exp_shift(float *s, int64_t n, float m) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; j++) sum += s[j] = kv_to_f32(f32_to_kv(expf(s[j] - m)));
  return sum;
}

static void scores(const kv_t *q, const kv_t *K, const int64_t *off, int64_t n, float scale, float *s, int d) {
  for (int64_t j = 0; j < n; j++) {
    const kv_t *k = K + off[j];
    float l[8] = {0};
    for (int c = 0; c < d; c += 16)
      for (int i = 0; i < 8; i++) {
        l[i] = fmaf(kv_load1(q + c + 2 * i + 1), kv_load1(k + c + 2 * i + 1), l[i]);
        l[i] = fmaf(kv_load1(q + c + 2 * i), kv_load1(k + c + 2 * i), l[i]);
      }
    s[j] = (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) * scale;
  }
}

static void pv(const float *p, int64_t lo, int64_t n, const kv_t *V, const int64_t *off, float *out, int d) {
  for (int c = 0; c < d; c++) out[c] = 0.0f;
  for (int64_t k = lo & ~(int64_t)1; k < ((lo + n + 1) & ~(int64_t)1); k++) { /* pair order; a product of bf16 values is exact */
    const int64_t j = k ^ 1;
    if (j < lo || j >= lo + n) continue;
    for (int c = 0; c < d; c++) out[c] += p[j] * kv_load1(V + off[j] + c);
  }
}

#endif

#if QUANT_AVX2 && !QUANT_AVX512

/* The 256-bit loops for queries sharing key and value rows (the AVX-512 ones are below): each
 * key row's values split once for up to 3 queries, whose values are split once per chunk (qp),
 * and each value row converted once for up to PV_QUERIES_256. Every number is computed as
 * scores() and pv_cols() compute it for a query alone: the same lane sums in the same order and
 * the same reduction, each output column's sum over positions in pair order. */
#define SCORE_QUERIES 3
#define PV_QUERIES_256 6 /* 16 columns of 6 queries: 12 accumulators in AVX2's 16 registers */

/* Query q's scores at positions j .. j+3 (v): those in its range stored */
static inline void store4(const query *q, int64_t j, __m128 v) {
  const int64_t e = q->lo + q->n;
  unsigned m = j + 4 <= e ? 0xfu : e > j ? (1u << (e - j)) - 1 : 0u;
  if (q->lo > j) m &= q->lo - j < 4 ? ~((1u << (q->lo - j)) - 1) : 0u;
  if ((m & 0xf) == 0xf) _mm_storeu_ps(q->s + j, v);
  else if (m & 0xf)
    _mm_maskstore_ps(q->s + j, _mm_setr_epi32(m & 1 ? -1 : 0, m & 2 ? -1 : 0, m & 4 ? -1 : 0, m & 8 ? -1 : 0), v);
}

/* The Q queries qs (Q <= SCORE_QUERIES), scores over the union of their ranges, four positions
 * at a time: lanes as scores() sums them, then ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) as it
 * reduces them. qp (3 d floats): per query and 16 values, its odd places then its even ones as
 * fp32, split once here rather than per key row (FMAs then read them from L1) */
static inline __attribute__((always_inline)) void scores_queries(const query *qs, const int Q, const kv_t *K,
                                                                 const int64_t *off, float scale, int d, float *qp) {
  int64_t j0 = qs[0].lo, j1 = 0;
  for (int i = 0; i < Q; i++) {
    j0 = qs[i].lo < j0 ? qs[i].lo : j0;
    j1 = qs[i].lo + qs[i].n > j1 ? qs[i].lo + qs[i].n : j1;
  }
  for (int i = 0; i < Q; i++)
    for (int c = 0; c < d; c += 16) {
      const __m256i qx = _mm256_loadu_si256((const __m256i *)(qs[i].q + c));
      _mm256_storeu_ps(qp + (int64_t)i * d + c, k_odd(qx));
      _mm256_storeu_ps(qp + (int64_t)i * d + c + 8, k_even(qx));
    }
  const __m128 sv = _mm_set1_ps(scale);
  for (int64_t j = j0; j < j1; j += 4) {
    const kv_t *row[4];
    for (int r = 0; r < 4; r++) row[r] = K + off[j + r];
    __m256 acc[SCORE_QUERIES][4];
    for (int i = 0; i < Q; i++)
      for (int r = 0; r < 4; r++) acc[i][r] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 16)
      for (int r = 0; r < 4; r++) {
        const __m256i kx = _mm256_loadu_si256((const __m256i *)(row[r] + c));
        const __m256 ko = k_odd(kx), ke = k_even(kx);
        for (int i = 0; i < Q; i++) {
          const float *qo = qp + (int64_t)i * d + c;
          acc[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(qo + 8), ke, _mm256_fmadd_ps(_mm256_loadu_ps(qo), ko, acc[i][r]));
        }
      }
    for (int i = 0; i < Q; i++) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
      store4(&qs[i], j, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), sv));
    }
  }
}

/* out_q[c] = sum_j p_q[j] V_j[c] for the Q queries qs (Q <= PV_QUERIES_256), columns c0 .. c0+15,
 * as pv_cols sums it: over [lo, hi), the union of their ranges, in pair order, one value row
 * converted for all of them. A query's probabilities outside its own range are zeros there
 * (pv_set), whose products add exactly nothing, as on AVX-512: no branch per position and query.
 * The queries' score rows lie ATTN_CHUNK floats apart (group_chunk's layout), so all are read
 * through one pointer. */
static inline __attribute__((always_inline)) void pv_queries(const query *qs, const int Q, const kv_t *V,
                                                             const int64_t *off, int64_t lo, int64_t hi, int c0) {
  __m256 acc[PV_QUERIES_256][2];
  const float *s = qs[0].s;
  for (int q = 0; q < Q; q++) acc[q][0] = acc[q][1] = _mm256_setzero_ps();
  for (int64_t k = lo & ~(int64_t)1; k < ((hi + 1) & ~(int64_t)1); k++) {
    const int64_t j = k ^ 1;
    if (j < lo || j >= hi) continue;
    const kv_t *vr = V + off[j] + c0;
    const __m256 x0 = kv_load8(vr), x1 = kv_load8(vr + 8);
    for (int q = 0; q < Q; q++) {
      const __m256 p = _mm256_broadcast_ss(s + q * ATTN_CHUNK + j);
      acc[q][0] = _mm256_fmadd_ps(p, x0, acc[q][0]);
      acc[q][1] = _mm256_fmadd_ps(p, x1, acc[q][1]);
    }
  }
  for (int q = 0; q < Q; q++) {
    _mm256_storeu_ps(qs[q].out + c0, acc[q][0]);
    _mm256_storeu_ps(qs[q].out + c0 + 8, acc[q][1]);
  }
}

#endif

#if QUANT_AVX512

/* hadd_ps in each 256-bit half: per 128-bit lane [a0+a1, a2+a3, b0+b1, b2+b3] */
static inline __m512 hadd512(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* Query q's scores at positions j .. j+7 (lanes half*8 .. half*8+7 of v): those in its range stored */
static inline void store_half(const query *q, int64_t j, __m512 v, int half) {
  const int64_t e = q->lo + q->n;
  unsigned m = j + 8 <= e ? 0xffu : e > j ? (1u << (e - j)) - 1 : 0u;
  if (q->lo > j) m &= q->lo - j < 8 ? ~((1u << (q->lo - j)) - 1) : 0u;
  _mm512_mask_storeu_ps(q->s + j - 8 * half, (__mmask16)((m & 0xff) << (8 * half)), v);
}

/* Query q's scores at positions j .. j+15 (v): those in its range stored */
static inline void store16(const query *q, int64_t j, __m512 v) {
  const int64_t a = q->lo > j ? q->lo - j : 0, e = q->lo + q->n - j; /* in range: a <= n < e */
  if (e <= a || a >= 16) return;
  const uint32_t m = (e >= 16 ? 0xffffu : (1u << e) - 1) & ~((1u << a) - 1);
  _mm512_mask_storeu_ps(q->s + j, (__mmask16)m, v);
}

/* The 2 NP queries qs (pair i: query 2i in lanes 0-7, 2i+1 in lanes 8-15), scores over the union
 * of their ranges, eight positions at a time, each lane and reduction as scores(): the same
 * bits. A key row read serves all of them. qp: per pair and 16 values, the two queries' values
 * side by side (bf16, 32 of them, for VDPBF16PS), else as fp32 their odd places then their even
 * ones (16 floats each); 64-byte aligned, 4 d floats. */
static inline __attribute__((always_inline)) void scores_pairs(const query *qs, const int NP, const kv_t *K,
                                                               const int64_t *off, float scale, int d, float *qp) {
  int64_t j0 = qs[0].lo, j1 = 0;
  for (int i = 0; i < 2 * NP; i++) {
    j0 = qs[i].lo < j0 ? qs[i].lo : j0;
    j1 = qs[i].lo + qs[i].n > j1 ? qs[i].lo + qs[i].n : j1;
  }
  const int nb = d / 16;
  for (int i = 0; i < NP; i++)
    for (int b = 0; b < nb; b++) {
      const __m256i a = _mm256_loadu_si256((const __m256i *)(qs[2 * i].q + 16 * b));
      const __m256i c = _mm256_loadu_si256((const __m256i *)(qs[2 * i + 1].q + 16 * b));
#if QUANT_AVX512BF16
      _mm512_store_si512(qp + (int64_t)(i * nb + b) * 16, _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1));
#else
      float *dst = qp + (int64_t)(i * nb + b) * 32;
      _mm256_store_ps(dst, k_odd(a));
      _mm256_store_ps(dst + 8, k_odd(c));
      _mm256_store_ps(dst + 16, k_even(a));
      _mm256_store_ps(dst + 24, k_even(c));
#endif
    }
  const __m512 sv = _mm512_set1_ps(scale);
  const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i hi_idx = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t j = j0; j < j1; j += 8) {
    const kv_t *row[8];
    for (int r = 0; r < 8; r++) row[r] = K + off[j + r];
    __m512 acc[2][8];
    for (int i = 0; i < NP; i++)
      for (int r = 0; r < 8; r++) acc[i][r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
#if QUANT_AVX512BF16
      __m512i qv[2];
      for (int i = 0; i < NP; i++) qv[i] = _mm512_load_si512(qp + (int64_t)(i * nb + b) * 16);
      for (int r = 0; r < 8; r++) {
        const __m512i k = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row[r] + 16 * b)));
        for (int i = 0; i < NP; i++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)qv[i], (__m512bh)k);
      }
#else
      __m512 qo[2], qe[2];
      for (int i = 0; i < NP; i++) {
        qo[i] = _mm512_load_ps(qp + (int64_t)(i * nb + b) * 32);
        qe[i] = _mm512_load_ps(qp + (int64_t)(i * nb + b) * 32 + 16);
      }
      for (int r = 0; r < 8; r++) {
        const __m512i k = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row[r] + 16 * b)));
        const __m512 ko = _mm512_castsi512_ps(_mm512_and_si512(k, _mm512_set1_epi32((int)0xffff0000u)));
        const __m512 ke = _mm512_castsi512_ps(_mm512_slli_epi32(k, 16));
        for (int i = 0; i < NP; i++) acc[i][r] = _mm512_fmadd_ps(qe[i], ke, _mm512_fmadd_ps(qo[i], ko, acc[i][r]));
      }
#endif
    }
    for (int i = 0; i < NP; i++) {
      const __m512 h0123 = hadd512(hadd512(acc[i][0], acc[i][1]), hadd512(acc[i][2], acc[i][3]));
      const __m512 h4567 = hadd512(hadd512(acc[i][4], acc[i][5]), hadd512(acc[i][6], acc[i][7]));
      const __m512 lo = _mm512_permutex2var_ps(h0123, lo_idx, h4567), hi = _mm512_permutex2var_ps(h0123, hi_idx, h4567);
      const __m512 v = _mm512_mul_ps(_mm512_add_ps(lo, hi), sv); /* lanes 0-7: query 2i's positions j.., 8-15: 2i+1's */
      store_half(&qs[2 * i], j, v, 0);
      store_half(&qs[2 * i + 1], j, v, 1);
    }
  }
}

/* lane l += a[2l+1] b[2l+1], then += a[2l] b[2l] (32 bf16 values of each): VDPBF16PS's
 * operations, by the instruction where the CPU has it, else by two FMAs (the same bits) */
static inline __m512 dot_pairs16(__m512 acc, __m512i a, __m512i b) {
#if QUANT_AVX512BF16
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
  const __m512 ao = _mm512_castsi512_ps(_mm512_and_si512(a, odd)), bo = _mm512_castsi512_ps(_mm512_and_si512(b, odd));
  const __m512 ae = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), be = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  return _mm512_fmadd_ps(ae, be, _mm512_fmadd_ps(ao, bo, acc));
#endif
}

/* r[k] word n = r[n] word k before (a 16 x 16 matrix of 32-bit words) */
static inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

/* The chunk's keys at positions [16 g0, 16 g1) transposed into pairs by position (d a multiple of
 * 32): for 16 positions G, pair p (values 2p, 2p + 1) of each at kt + (G d / 2 + p) 16, position
 * 16 G + n in word n; a position outside [lo, hi) zero. These are AMX's B tiles (tile (G, s) at
 * kt + (G ns + s) 256, ns = d / 32, its row k pair 16 s + k) and scores_by_pairs' operands. */
static void key_tiles(const kv_t *K, const int64_t *off, int64_t lo, int64_t hi, int64_t g0, int64_t g1, int d,
                      uint32_t *kt) {
  const int ns = d / 32;
  for (int64_t G = g0; G < g1; G++)
    for (int s = 0; s < ns; s++) {
      __m512i r[16];
      for (int n = 0; n < 16; n++) {
        const int64_t j = 16 * G + n;
        r[n] = j >= lo && j < hi ? _mm512_loadu_si512(K + off[j] + 32 * s) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t *t = kt + (G * ns + s) * 256;
      for (int k = 0; k < 16; k++) _mm512_store_si512(t + 16 * k, r[k]);
    }
}

/* Scores of the Q queries qs from the chunk's keys transposed (key_tiles), over position
 * groups [g0, g1). Query q's lane sum l of 16 positions is one vector, acc[q][l], taking pairs
 * 8 b + l (values 16 b + 2 l + {1, 0}) for b = 0 .. d / 16 - 1 in turn, each by dot_pairs16 with the
 * query's pair in every lane: per position, scores()' lane sums exactly. Their reduction
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) is then vertical adds, and 16 scores go out
 * in one store, where scores_pairs spends shuffles on every 8 positions and 2 queries: the same
 * bits. The keys' transposition pays once many queries read them (a verification's or a
 * prefill's rows; KEY_PAIRS_QUERIES), and where VDPBF16PS takes a pair in one instruction: with
 * two FMAs a pair, splitting each broadcast query pair, 16 rows at 1024 cached tokens took 1.045x
 * scores_pairs' time (AMD EPYC Zen 4, an icelake-server build). */
#if QUANT_AVX512BF16
static inline __attribute__((always_inline)) void scores_by_pairs(const query *qs, const int Q, const uint32_t *kt,
                                                                  int64_t g0, int64_t g1, float scale, int d) {
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t G = g0; G < g1; G++) {
    const int64_t j = 16 * G;
    __m512 acc[3][8];
    for (int q = 0; q < Q; q++)
      for (int l = 0; l < 8; l++) acc[q][l] = _mm512_setzero_ps();
    const uint32_t *kg = kt + G * d / 2 * 16;
    for (int b = 0; b < d / 16; b++)
      for (int l = 0; l < 8; l++) {
        const __m512i k = _mm512_load_si512(kg + (8 * b + l) * 16);
        for (int q = 0; q < Q; q++)
          acc[q][l] = dot_pairs16(acc[q][l], _mm512_set1_epi32(((const int32_t *)qs[q].q)[8 * b + l]), k);
      }
    for (int q = 0; q < Q; q++) {
      const __m512 *l = acc[q];
      const __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(l[0], l[1]), _mm512_add_ps(l[2], l[3])),
                                     _mm512_add_ps(_mm512_add_ps(l[4], l[5]), _mm512_add_ps(l[6], l[7])));
      store16(&qs[q], j, _mm512_mul_ps(v, sv));
    }
  }
}
#endif

/* word w of pair row (a, b): a's value 16 h + w (low half), b's (high half); h = 0, 1 */
static inline __m512i pair_index(int h) {
  int16_t idx[32];
  for (int e = 0; e < 32; e++) idx[e] = (int16_t)((e & 1) * 32 + 16 * h + e / 2);
  return _mm512_loadu_si512(idx);
}

/* Columns c .. c+31 (fewer at d's end: d % 16 == 0) of the value rows at positions 2i and 2i+1
 * as two pair vectors (value_pairs), a position outside [lo, hi) zero */
static inline __attribute__((always_inline)) void pair_cols(const kv_t *V, const int64_t *off, int64_t lo, int64_t hi,
                                                            int64_t i, int c, int d, const __m512i idx[2], __m512i x[2]) {
  const int64_t j = 2 * i;
  const __mmask32 m = d - c >= 32 ? 0xffffffffu : 0xffffu;
  const __m512i a = j >= lo ? _mm512_maskz_loadu_epi16(m, V + off[j] + c) : _mm512_setzero_si512();
  const __m512i b = j + 1 < hi ? _mm512_maskz_loadu_epi16(m, V + off[j + 1] + c) : _mm512_setzero_si512();
  x[0] = _mm512_permutex2var_epi16(a, idx[0], b);
  x[1] = _mm512_permutex2var_epi16(a, idx[1], b);
}

/* The chunk's value rows at positions 2i, 2i+1 side by side, for the pairs i of [lo, hi): pair
 * i at vp + i d, column c's two values in its 32-bit word c (position 2i's in the low half), a
 * position outside [lo, hi) zero. One VDPBF16PS then takes two positions of 16 columns. */
static void value_pairs(const kv_t *V, const int64_t *off, int64_t lo, int64_t hi, int d, uint32_t *vp) {
  const __m512i idx[2] = {pair_index(0), pair_index(1)};
  for (int64_t i = lo / 2; i < (hi + 1) / 2; i++)
    for (int c = 0; c < d; c += 32) {
      __m512i x[2];
      pair_cols(V, off, lo, hi, i, c, d, idx, x);
      _mm512_storeu_si512(vp + i * d + c, x[0]);
      if (d - c > 16) _mm512_storeu_si512(vp + i * d + c + 16, x[1]);
    }
}

/* Query q's probabilities (rounded to bf16 by exp_shift) as pairs for [i0, i1): word i holds
 * p[2i] (low half) and p[2i+1], a position outside the query's range zero */
static void prob_pairs(const query *q, int64_t i0, int64_t i1, uint32_t *pp) {
  for (int64_t i = i0; i < i1; i += 16) {
    const int64_t j = 2 * i, e = q->lo + q->n, t = e < 2 * i1 ? e : 2 * i1;
    /* bit b: position j + b in [lo, t) */
    const int64_t b0 = q->lo > j ? (q->lo - j < 32 ? q->lo - j : 32) : 0, b1 = t - j < 32 ? (t - j > 0 ? t - j : 0) : 32;
    const uint64_t m = b1 > b0 ? ((1ull << b1) - 1) & ~((1ull << b0) - 1) : 0;
    const __m512i a = _mm512_srli_epi32(_mm512_castps_si512(_mm512_maskz_loadu_ps((__mmask16)m, q->s + j)), 16);
    const __m512i b = _mm512_srli_epi32(_mm512_castps_si512(_mm512_maskz_loadu_ps((__mmask16)(m >> 16), q->s + j + 16)), 16);
    const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(a)), _mm512_cvtepi32_epi16(b), 1);
    _mm512_mask_storeu_epi32(pp + i, (__mmask16)(i1 - i >= 16 ? 0xffffu : (1u << (i1 - i)) - 1), w);
  }
}

/* out_q[c] = P.V for the K queries qs (pairs pp + q PAIRS_STRIDE), columns c0 .. c0 + 16 nv: the
 * pairs [lo / 2, (hi + 1) / 2) in order, each one VDPBF16PS per 16 columns, one pair row for all K:
 * read from vp (value_pairs) where it was made, else made from the rows here. A query's pairs
 * outside its range hold zeros, whose products add exactly nothing. */
static inline __attribute__((always_inline)) void pv_pairs(const query *qs, const int K, const uint32_t *pp,
                                                           const kv_t *V, const int64_t *off, const uint32_t *vp,
                                                           int64_t lo, int64_t hi, int d, int c0, const int nv) {
  __m512 acc[PV_QUERIES][4];
  const __m512i idx[2] = {pair_index(0), pair_index(1)};
  for (int q = 0; q < K; q++)
    for (int v = 0; v < nv; v++) acc[q][v] = _mm512_setzero_ps();
  for (int64_t i = lo / 2; i < (hi + 1) / 2; i++) {
    __m512i x[4];
    if (vp)
      for (int v = 0; v < nv; v++) x[v] = _mm512_loadu_si512(vp + i * d + c0 + 16 * v);
    else
      for (int v = 0; v < nv; v += 2) pair_cols(V, off, lo, hi, i, c0 + 16 * v, d, idx, x + v);
    for (int q = 0; q < K; q++) {
      const __m512i e = _mm512_set1_epi32((int)pp[q * PAIRS_STRIDE + i]);
      for (int v = 0; v < nv; v++) acc[q][v] = dot_pairs16(acc[q][v], e, x[v]);
    }
  }
  for (int q = 0; q < K; q++)
    for (int v = 0; v < nv; v++) _mm512_storeu_ps(qs[q].out + c0 + 16 * v, acc[q][v]);
}

#endif

/* Scores of queries sharing one KV head's key rows (K: that head's column).
 * qp: 4 d floats, 64-byte aligned. */
static void scores_set(const query *qs, int n, const kv_t *K, const int64_t *off, float scale, int d, float *qp) {
  int i = 0;
#if QUANT_AVX512
  for (; i + 4 <= n; i += 4) scores_pairs(qs + i, 2, K, off, scale, d, qp);
  for (; i + 2 <= n; i += 2) scores_pairs(qs + i, 1, K, off, scale, d, qp);
#elif QUANT_AVX2
  for (; i + SCORE_QUERIES <= n; i += SCORE_QUERIES) scores_queries(qs + i, SCORE_QUERIES, K, off, scale, d, qp);
  for (; i + 2 <= n; i += 2) scores_queries(qs + i, 2, K, off, scale, d, qp);
#else
  (void)qp;
#endif
  for (; i < n; i++) scores(qs[i].q, K, off + qs[i].lo, qs[i].n, scale, qs[i].s + qs[i].lo, d);
}

#if QUANT_AVX512BF16
/* Scores of queries sharing one KV head's key rows over [lo, hi) by scores_by_pairs, the keys
 * transposed into kt first (ATTN_CHUNK d / 2 words, 64-byte aligned); d a multiple of 32 */
static void scores_set_by_pairs(const query *qs, int n, const kv_t *K, const int64_t *off, int64_t lo, int64_t hi,
                                float scale, int d, uint32_t *kt) {
  const int64_t g0 = lo / 16, g1 = (hi + 15) / 16;
  key_tiles(K, off, lo, hi, g0, g1, d, kt);
  int i = 0;
  for (; i + 3 <= n; i += 3) scores_by_pairs(qs + i, 3, kt, g0, g1, scale, d);
  if (n - i == 2) scores_by_pairs(qs + i, 2, kt, g0, g1, scale, d);
  if (n - i == 1) scores_by_pairs(qs + i, 1, kt, g0, g1, scale, d);
}
#endif

/* P.V of queries sharing one KV head's value rows (V: that head's column), their union [lo, hi);
 * on AVX-512 from the pair rows vp (NULL: made as they are read) and the probability pairs pp */
static void pv_set(const query *qs, int n, const kv_t *V, const int64_t *off, const uint32_t *vp, const uint32_t *pp,
                   int64_t lo, int64_t hi, int d) {
  int i = 0;
#if QUANT_AVX512
  for (; i < n; i += PV_QUERIES)
    for (int c0 = 0; c0 < d; c0 += 64) {
      const int K = n - i < PV_QUERIES ? n - i : PV_QUERIES, nv = (d - c0) / 16 < 4 ? (d - c0) / 16 : 4;
      const uint32_t *pq = pp + (int64_t)i * PAIRS_STRIDE;
      switch (K * 4 + nv - 1) { /* literal K and nv in each call: its loops unrolled for them */
#define PVQ(K)                                                                  \
  case 4 * K: pv_pairs(qs + i, K, pq, V, off, vp, lo, hi, d, c0, 1); break;     \
  case 4 * K + 1: pv_pairs(qs + i, K, pq, V, off, vp, lo, hi, d, c0, 2); break; \
  case 4 * K + 2: pv_pairs(qs + i, K, pq, V, off, vp, lo, hi, d, c0, 3); break; \
  case 4 * K + 3: pv_pairs(qs + i, K, pq, V, off, vp, lo, hi, d, c0, 4); break;
        PVQ(1) PVQ(2) PVQ(3) PVQ(4) PVQ(5) PVQ(6)
#undef PVQ
        default: break;
      }
    }
#else
  (void)vp, (void)pp, (void)lo, (void)hi;
#if QUANT_AVX2
  if (d % 16 == 0) {
    for (int q = 0; q < n; q++) { /* zeros at the union's positions outside the query's own range */
      for (int64_t j = lo; j < qs[q].lo; j++) qs[q].s[j] = 0.0f;
      for (int64_t j = qs[q].lo + qs[q].n; j < hi; j++) qs[q].s[j] = 0.0f;
    }
    for (; i < n; i += PV_QUERIES_256)
      for (int c0 = 0; c0 < d; c0 += 16) {
        switch (n - i < PV_QUERIES_256 ? n - i : PV_QUERIES_256) { /* a literal count: loops unrolled */
#define PVQ(Q) case Q: pv_queries(qs + i, Q, V, off, lo, hi, c0); break;
          PVQ(1) PVQ(2) PVQ(3) PVQ(4) PVQ(5) default: pv_queries(qs + i, PV_QUERIES_256, V, off, lo, hi, c0);
#undef PVQ
        }
      }
  }
#endif
  for (; i < n; i++) pv(qs[i].s, qs[i].lo, qs[i].n, V, off, qs[i].out, d);
#endif
}

#if QUANT_AMX_BF16
/* ---- AMX: scores and P.V of up to 16 queries a tile multiply ---- */

/* tile numbers: the intrinsics take them as literal immediates. C: rows x 16 fp32 (scores of 16
 * positions, or P.V of 16 columns); A: rows x 32 bf16 (queries' values, or their probability
 * pairs); B: 16 x 32 bf16 (key pairs by position, value pairs by column, or queries transposed).
 * scores_tiles and pv_tiles run one chain of tile multiplies at a time: four side by side (two B
 * tiles taking turns) were 1.13x the time for a decode row and 4 rows, even at 16 (30 layers'
 * attention alone at 1024 cached tokens); scores_by_position alternates two (0.97-0.99x). */
#define AT_C 0
#define AT_A 1
#define AT_B 2
#define AT_CP0 3 /* 16 x 16 fp32: scores by position (scores_by_position), a row per position */
#define AT_AP0 4 /* 16 x 32 bf16: the keys of 16 positions as they lie in the cache */
#define AT_CP1 5 /* the same two for the next 16 positions, while the tile unit works on these */
#define AT_AP1 6
#define TILE_SHAPE_ATTN 100 /* quant_tile_shape: TILE_SHAPE_ATTN + the tiles' query rows */

static void attn_tiles(int rows) {
  if (quant_tile_shape == TILE_SHAPE_ATTN + rows) return;
  amx_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  cfg.rows[AT_C] = cfg.rows[AT_A] = (uint8_t)rows;
  for (int t = AT_B; t <= AT_AP1; t++) cfg.rows[t] = 16;
  for (int t = AT_C; t <= AT_AP1; t++) cfg.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  quant_tile_shape = TILE_SHAPE_ATTN + rows;
}

/* The queries' values in rows of d at qa, zero rows after them up to a multiple of `rows` */
static void pack_queries(const query *qs, int nqs, int rows, int d, kv_t *qa) {
  for (int r = 0; r < (nqs + rows - 1) / rows * rows; r++) {
    if (r < nqs) memcpy(qa + (int64_t)r * d, qs[r].q, sizeof(kv_t) * (size_t)d);
    else memset(qa + (int64_t)r * d, 0, sizeof(kv_t) * (size_t)d);
  }
}

/* The value pairs a task's P.V reads (value_pairs; [p0, p1) outside [lo, hi) zero): made while
 * the tile unit computes the task's first scores */
typedef struct {
  const kv_t *V;
  const int64_t *off;
  int64_t lo, hi, p0, p1;
  int d;
  uint32_t *vp;
} pairs_job;

static void make_pairs(const pairs_job *P) {
  value_pairs(P->V, P->off, P->lo, P->hi, P->d, P->vp);
  for (int64_t i = P->p0; i < P->p1; i++)
    if (i < P->lo / 2 || i >= (P->hi + 1) / 2) memset(P->vp + i * P->d, 0, sizeof(uint32_t) * (size_t)P->d);
}

/* Scores of the queries qs[0 .. nqs) over position groups [g0, g1) from the key tiles kt, `rows`
 * queries a tile multiply: per 16 positions, C = sum over the d / 32 slices in turn of TDPBF16PS,
 * times the scale, stored at each query's positions in its range. qa: the queries' values packed
 * (pack_queries); ct: a stored C tile. The pairs job P runs between the first tile multiplies and
 * their result (the vector units work while the tile unit does). */
static void scores_tiles(const query *qs, int nqs, int rows, const uint32_t *kt, int64_t g0, int64_t g1, int d,
                         float scale, const kv_t *qa, float *ct, const pairs_job *P) {
  const int ns = d / 32;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i0 = 0; i0 < nqs; i0 += rows) {
    const int R = nqs - i0 < rows ? nqs - i0 : rows;
    for (int64_t G = g0; G < g1; G++) {
      _tile_zero(AT_C);
      for (int s = 0; s < ns; s++) {
        _tile_loadd(AT_A, qa + (int64_t)i0 * d + 32 * s, (int64_t)sizeof(kv_t) * d);
        _tile_loadd(AT_B, kt + (G * ns + s) * 256, 64);
        _tile_dpbf16ps(AT_C, AT_A, AT_B);
      }
      if (P) make_pairs(P), P = NULL;
      _tile_stored(AT_C, ct, 64);
      const int64_t j = 16 * G;
      for (int r = 0; r < R; r++) {
        store16(&qs[i0 + r], j, _mm512_mul_ps(_mm512_load_ps(ct + 16 * r), sv));
      }
    }
  }
}

/* Scores of up to 16 queries qs[0 .. nqs) over position groups [g0, g1), the keys taken as the A
 * tile as they lie in the cache (16 positions of a block are rows evenly apart) and the queries as
 * the B tile, qt[s][k][n] = the pair 2k, 2k+1 of query n's slice s: C[position][query], whose
 * elements are the bits of scores_tiles' C[query][position] (TDPBF16PS computes an element the same
 * with its operands' roles swapped: 0 of 12.8 million random elements differed, Xeon), read back
 * by query. No key tile is made, which is most of a few queries' cost. direct: the group's 16 rows
 * evenly apart in one block (else they are copied into kb, d values a row). Positions outside
 * [lo, hi) give elements never read. qt: 8 d words, kb: 16 d; ct: a stored C tile. */
static void scores_by_position(const qattn *A, const query *qs, int nqs, const kv_t *K, const int64_t *off, int64_t lo,
                               int64_t hi, int64_t g0, int64_t g1, int direct, uint32_t *qt, kv_t *kb, float *ct,
                               const pairs_job *P) {
  const int d = A->d, ns = d / 32;
  const int64_t rs = (int64_t)A->nkv * d; /* a cache row */
  for (int s = 0; s < ns; s++) /* only the nqs columns are read back: the rest may hold anything */
    for (int k = 0; k < 16; k++)
      for (int n = 0; n < nqs; n++) qt[s * 256 + k * 16 + n] = ((const uint32_t *)qs[n].q)[16 * s + k];
  const __m512 sv = _mm512_set1_ps(A->scale);
  const __m512i col = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  /* group G's tile multiplies are issued, then group G - 1's result read: the tile unit works on
   * the one while the vector units read the other */
  for (int64_t G = g0; G <= g1; G++) {
    if (G < g1) {
      const int64_t j0 = 16 * G, a = lo > j0 ? lo : j0, b = hi < j0 + 16 ? hi : j0 + 16;
      const kv_t *rows;
      int64_t stride;
      if (direct) {
        rows = K + off[a] - (a - j0) * rs, stride = rs;
      } else {
        kv_t *kg = kb + (G & 1) * 16 * (int64_t)d;
        for (int64_t j = a; j < b; j++) memcpy(kg + (j - j0) * d, K + off[j], sizeof(kv_t) * (size_t)d);
        rows = kg, stride = d;
      }
#define SCORES_BY_POSITION(CP, AP)                                                 \
  do {                                                                             \
    _tile_zero(CP);                                                                \
    for (int s = 0; s < ns; s++) {                                                 \
      _tile_loadd(AP, rows + 32 * s, (int64_t)sizeof(kv_t) * stride);              \
      _tile_loadd(AT_B, qt + s * 256, 64);                                         \
      _tile_dpbf16ps(CP, AP, AT_B);                                                \
    }                                                                              \
  } while (0)
      if (G & 1) SCORES_BY_POSITION(AT_CP1, AT_AP1);
      else SCORES_BY_POSITION(AT_CP0, AT_AP0);
#undef SCORES_BY_POSITION
      if (P) make_pairs(P), P = NULL;
    }
    if (G == g0) continue;
    const int64_t j0 = 16 * (G - 1);
    if ((G - 1) & 1) _tile_stored(AT_CP1, ct, 64);
    else _tile_stored(AT_CP0, ct, 64);
    for (int r = 0; r < nqs; r++) {
      const query *q = &qs[r];
      const int64_t qa = q->lo > j0 ? q->lo - j0 : 0, e = q->lo + q->n - j0; /* in range: qa <= n < e */
      if (e <= qa || qa >= 16) continue;
      const uint32_t m = (e >= 16 ? 0xffffu : (1u << e) - 1) & ~((1u << qa) - 1);
      const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(r)), ct, 4);
      _mm512_mask_storeu_ps(q->s + j0, (__mmask16)m, _mm512_mul_ps(v, sv));
    }
  }
}

/* P.V of the queries qs[0 .. nqs) over the chunk's pairs [p0, p1) (multiples of 16), `rows`
 * queries a tile multiply: per 16 columns, C = sum over 16 pairs at a time, in turn, of TDPBF16PS
 * on the probability pairs pp (rows PAIRS_STRIDE words apart, rows past nqs zero) and the value
 * pairs vp (value_pairs); pairs outside a query's range hold zeros. */
static void pv_tiles(const query *qs, int nqs, int rows, const uint32_t *pp, const uint32_t *vp, int64_t p0,
                     int64_t p1, int d, float *ct) {
  for (int i0 = 0; i0 < nqs; i0 += rows) {
    const int R = nqs - i0 < rows ? nqs - i0 : rows;
    for (int c0 = 0; c0 < d; c0 += 16) {
      _tile_zero(AT_C);
      for (int64_t i = p0; i < p1; i += 16) {
        _tile_loadd(AT_A, pp + (int64_t)i0 * PAIRS_STRIDE + i, PAIRS_STRIDE * 4);
        _tile_loadd(AT_B, vp + i * d + c0, (int64_t)d * 4);
        _tile_dpbf16ps(AT_C, AT_A, AT_B);
      }
      _tile_stored(AT_C, ct, 64);
      for (int r = 0; r < R; r++) _mm512_storeu_ps(qs[i0 + r].out + c0, _mm512_load_ps(ct + 16 * r));
    }
  }
}
#endif

/* ---- chunks, groups and tasks ---- */

typedef struct {
  const qattn *A;
  int g;                    /* query heads per KV head */
  const int64_t *group;     /* group i: rows group[i] .. group[i+1]-1, one sequence's */
  const int64_t *cu_chunks; /* split: group i's chunk tasks from cu_chunks[i] (times nkv) */
  const int64_t *cu_parts;  /* split: token t's chunk partials from cu_parts[t] */
  const kv_t *qb;           /* the queries rounded (f32_to_kv): token t's head h at qb + (t nq + h) d */
  float *parts;             /* split: partial (t, chunk c, head h) at parts + ((cu_parts[t] + c) nq + h) PART_STRIDE */
  float *work;
  int64_t work_floats;      /* per thread */
  int tiles;                /* scores and P.V on AMX tiles (use_tiles) */
  pool_chunks chunks;
} actx;

static int64_t first_key(const qattn *A, int64_t t) {
  return A->window && A->positions[t] >= A->window ? A->positions[t] - A->window + 1 : 0;
}

static int64_t first_chunk(const qattn *A, int64_t t) { return first_key(A, t) / ATTN_CHUNK; }
static int64_t last_chunk(const qattn *A, int64_t t) { return A->positions[t] / ATTN_CHUNK; }

/* Row t's positions in chunk c, as [lo, lo + n) from the chunk's start; n = 0 outside its range */
static int64_t chunk_range(const qattn *A, int64_t t, int64_t c, int64_t *lo) {
  const int64_t base = c * ATTN_CHUNK, first = first_key(A, t), end = A->positions[t] + 1;
  const int64_t j0 = base > first ? base : first, j1 = end < base + ATTN_CHUNK ? end : base + ATTN_CHUNK;
  *lo = j0 - base;
  return j1 > j0 ? j1 - j0 : 0;
}

/* off[j] = the cache row (times the row stride) of position base + j of row t's keys, for j in
 * [lo, hi), then hi .. hi + 7 repeating the last: the batches of 8 read past a range's end. */
static void chunk_offsets(const qattn *A, int64_t t, int64_t c, int64_t lo, int64_t hi, int64_t *off) {
  const int64_t bs = A->block_size, stride = (int64_t)A->nkv * A->d, base = c * ATTN_CHUNK;
  const int64_t *bt = A->block_tables + A->seq[t] * A->bt_stride;
  const int64_t tb = A->tree_base ? A->tree_base[t] : INT64_MAX;
  const int64_t *path = A->tree_base ? A->path_slots + t * A->path_stride : NULL;
  for (int64_t j = lo, p = base + lo, b = p / bs, jj = p % bs; j < hi; j++, p++) {
    /* a tree node's keys past the tree's base are its path's rows */
    off[j] = p >= tb ? path[p - tb] * stride : (bt[b] * bs + jj) * stride;
    if (++jj == bs) jj = 0, b++;
  }
  for (int64_t j = hi; j < hi + 8 && j < OFF_ENTRIES; j++) off[j] = off[hi - 1];
}

/* Where chunk c's partial of (row t, head h) goes: split, its slot in parts (merged later); else
 * the (group, KV head) task's buffer at run, per query a running partial and the chunk's one
 * ((2 i + {0, 1}) PART_STRIDE, i = (t - t0) g + h mod g), the query's first chunk the running one. */
typedef struct {
  float *run;
  int64_t t0;
} dst_spec;

static float *query_dst(const actx *X, const dst_spec *D, int64_t t, int h, int64_t c) {
  const qattn *A = X->A;
  if (!D->run) return X->parts + ((X->cu_parts[t] + c) * A->nq + h) * PART_STRIDE(A->d);
  const int64_t i = (t - D->t0) * X->g + h % X->g;
  return D->run + (2 * i + (c == first_chunk(A, t) ? 0 : 1)) * PART_STRIDE(A->d);
}

/* Rows [lo, hi) of one KV head's keys and values (K, V: that head's column) fetched into the L2
 * cache: the rows a task reads next, while it computes on the ones before. A decode row's few
 * queries per KV head (3 on SmolLM2) spend little time on each row, and waited on their arrival:
 * whole SmolLM2-135M forwards at 1024 cached tokens a sequence, two builds timed in turn (Xeon,
 * 2 threads), 1 sequence 0.90x the time, 8 sequences 0.87x, 24 sequences 0.82x; 30 layers'
 * attention alone at 4096 tokens 0.86x. Tasks of a verification's rows (4+ queries, their value
 * rows converted) waited too on the AMD EPYC (Zen 4, 2 threads): whole forwards of one sequence at
 * 1024 cached tokens fed 2 / 4 / 8 / 16 rows took 0.90 / 0.93 / 0.95 / 0.97x the time with the
 * fetch than without; attention alone at 4096 tokens 0.71-0.87x, at 300 tokens within 3%. */
static void prefetch_rows(const kv_t *K, const kv_t *V, const int64_t *off, int64_t lo, int64_t hi, int d) {
  for (int64_t j = lo; j < hi; j++)
    for (int c = 0; c < d * (int)sizeof(kv_t); c += 64) {
      __builtin_prefetch((const char *)(K + off[j]) + c, 0, 2); /* prefetcht1 */
      __builtin_prefetch((const char *)(V + off[j]) + c, 0, 2);
    }
}

/* Chunk c's partials of rows t0..t1-1 (one group) for KV heads k0..k1-1. work: OFF_ENTRIES
 * int64, then GROUP_ROWS g ATTN_CHUNK scores, 4 d floats of query pairs, the chunk's value rows
 * as position pairs (value_pairs: ATTN_CHUNK / 2 pairs of d words, on AVX-512), GROUP_ROWS g
 * queries' probability pairs (PAIRS_STRIDE words each), GROUP_ROWS g queries. The value pairs
 * are made once per KV head for all the queries; the scores read the bf16 key rows as they are. */
static void group_chunk(const actx *X, int64_t t0, int64_t t1, int k0, int k1, int64_t c, const dst_spec *D,
                        float *work) {
  const qattn *A = X->A;
  const int d = A->d, g = X->g;
  int64_t *off = (int64_t *)work;
  float *sc = work + 2 * OFF_ENTRIES;
  float *qp = sc + (int64_t)GROUP_ROWS * g * ATTN_CHUNK; /* 64-byte aligned: see quant_attention */
  uint32_t *vp = (uint32_t *)(qp + 4 * d), *pp = vp + (int64_t)PAIRS_STRIDE * d;
  query *qs = (query *)(pp + (int64_t)GROUP_ROWS * g * PAIRS_STRIDE);
  /* AMX: the chunk's key tiles (or, for scores_by_position, the queries transposed and copied
   * key rows), the queries packed, a stored C tile (TILE_FLOATS) */
  uint32_t *kt = (uint32_t *)(((uintptr_t)(qs + (int64_t)GROUP_ROWS * g) + 63) & ~(uintptr_t)63);
  kv_t *qa = (kv_t *)(kt + (int64_t)ATTN_CHUNK * d / 2);
  float *ct = (float *)(qa + (int64_t)GROUP_ROWS * g * d);
  int64_t lo = ATTN_CHUNK, hi = 0, first = -1;
  for (int64_t t = t0; t < t1; t++) {
    int64_t l;
    const int64_t n = chunk_range(A, t, c, &l);
    if (!n) continue;
    if (first < 0) first = t;
    lo = l < lo ? l : lo;
    hi = l + n > hi ? l + n : hi;
  }
  if (first < 0) return;
  chunk_offsets(A, first, c, lo, hi, off); /* a group's rows share their keys (one sequence, no tree) */
  for (int k = k0; k < k1; k++) {
    int nqs = 0;
    for (int64_t t = t0; t < t1; t++) {
      int64_t l;
      const int64_t n = chunk_range(A, t, c, &l);
      if (!n) continue;
      for (int h = k * g; h < (k + 1) * g; h++, nqs++)
        qs[nqs] = (query){X->qb + (t * A->nq + h) * (int64_t)d, sc + (int64_t)nqs * ATTN_CHUNK,
                          query_dst(X, D, t, h, c), l, n};
    }
    const int64_t kv = (int64_t)k * d;
    /* the next task's rows fetched meanwhile (prefetch_rows): a split task's successor is the
     * chunk's next head, the token path's this head's next chunk */
    if (!D->run && k + 1 < A->nkv) {
      prefetch_rows(A->kc + kv + d, A->vc + kv + d, off, lo, hi, d);
    } else if (c < last_chunk(A, first)) {
      int64_t next[OFF_ENTRIES], l;
      const int64_t n = chunk_range(A, first, c + 1, &l), head = D->run ? kv : 0;
      if (n) {
        chunk_offsets(A, first, c + 1, l, l + n, next);
        prefetch_rows(A->kc + head, A->vc + head, next, l, l + n, d);
      }
    }
#if QUANT_AMX_BF16
    if (X->tiles) {
      /* positions in groups of 16 (a key tile), pairs of them in groups of 16 (a value tile) */
      const int rows = nqs < 16 ? nqs : 16;
      const int64_t g0 = lo / 16, g1 = (hi + 15) / 16, p0 = lo / 32 * 16, p1 = (hi + 31) / 32 * 16;
      attn_tiles(rows);
      const pairs_job P = {A->vc + kv, off, lo, hi, p0, p1, d, vp};
      if (nqs <= 16) { /* a key tile would serve too few queries to pay for its making */
        /* a block's 16 positions from 16 G lie evenly apart, unless a token tree's path is among them */
        const int direct = A->block_size % 16 == 0 &&
                           (!A->tree_base || A->tree_base[first] >= c * ATTN_CHUNK + ATTN_CHUNK);
        scores_by_position(A, qs, nqs, A->kc + kv, off, lo, hi, g0, g1, direct, kt, (kv_t *)(kt + 8 * d), ct, &P);
      } else {
        pack_queries(qs, nqs, rows, d, qa);
        key_tiles(A->kc + kv, off, lo, hi, g0, g1, d, kt);
        scores_tiles(qs, nqs, rows, kt, g0, g1, d, A->scale, qa, ct, &P);
      }
      for (int i = 0; i < nqs; i++) {
        const float m = max_row(qs[i].s + qs[i].lo, qs[i].n), sum = exp_shift(qs[i].s + qs[i].lo, qs[i].n, m);
        qs[i].out[d] = m;
        qs[i].out[d + 1] = sum;
        prob_pairs(&qs[i], p0, p1, pp + (int64_t)i * PAIRS_STRIDE);
      }
      for (int i = nqs; i < (nqs + rows - 1) / rows * rows; i++)
        memset(pp + (int64_t)i * PAIRS_STRIDE + p0, 0, sizeof(uint32_t) * (size_t)(p1 - p0));
      pv_tiles(qs, nqs, rows, pp, vp, p0, p1, d, ct);
      continue;
    }
#else
    (void)kt, (void)qa, (void)ct;
#endif
    const int pairs_made = QUANT_AVX512 && nqs > PV_QUERIES; /* more than one set of queries reads them */
#if QUANT_AVX512
    if (pairs_made) value_pairs(A->vc + kv, off, lo, hi, d, vp);
#endif
#if QUANT_AVX512BF16
    if (d % 32 == 0 && nqs >= KEY_PAIRS_QUERIES)
      scores_set_by_pairs(qs, nqs, A->kc + kv, off, lo, hi, A->scale, d, kt);
    else
#endif
      scores_set(qs, nqs, A->kc + kv, off, A->scale, d, qp);
    for (int i = 0; i < nqs; i++) {
      const float m = max_row(qs[i].s + qs[i].lo, qs[i].n), sum = exp_shift(qs[i].s + qs[i].lo, qs[i].n, m);
      qs[i].out[d] = m;
      qs[i].out[d + 1] = sum;
#if QUANT_AVX512
      prob_pairs(&qs[i], lo / 2, (hi + 1) / 2, pp + (int64_t)i * PAIRS_STRIDE);
#endif
    }
    pv_set(qs, nqs, A->vc + kv, off, pairs_made ? vp : NULL, pp, lo, hi, d);
  }
}

/* run (+)= part (the fold above) */
static void fold(float *run, const float *part, int d) {
  const float m = run[d] >= part[d] ? run[d] : part[d], a = expf(run[d] - m), b = expf(part[d] - m);
  for (int c = 0; c < d + 2; c++) run[c] = run[c] * a + part[c] * b; /* acc and s */
  run[d] = m;
}

static void finish(const float *run, int d, float *out) {
  const float inv = 1.0f / run[d + 1];
  for (int c = 0; c < d; c++) out[c] = run[c] * inv;
}

static float *thread_work(const actx *X, int tid) { return X->work + (int64_t)tid * X->work_floats; }

/* a thread's tiles handed back at the end of its share of a job (as the linears do) */
static void release_tiles(const actx *X) {
#if QUANT_AMX_BF16
  if (X->tiles) quant_amx_end();
#else
  (void)X;
#endif
}

/* Token path: task i is group i / nkv's KV head i mod nkv, its chunks in turn, each folded into
 * the running partials as it comes, then the attention rows. */
static void groups_job(void *ctx, int tid, int nt) {
  (void)nt;
  const actx *X = ctx;
  const qattn *A = X->A;
  float *work = thread_work(X, tid), *run = work + X->work_floats - 2 * (int64_t)GROUP_ROWS * X->g * PART_STRIDE(A->d);
  for (int64_t i; (i = pool_claim((pool_chunks *)&X->chunks, tid)) >= 0;) {
    const int64_t t0 = X->group[i / A->nkv], t1 = X->group[i / A->nkv + 1];
    const int k = (int)(i % A->nkv);
    int64_t c0 = INT64_MAX, c1 = -1;
    for (int64_t t = t0; t < t1; t++) {
      c0 = first_chunk(A, t) < c0 ? first_chunk(A, t) : c0;
      c1 = last_chunk(A, t) > c1 ? last_chunk(A, t) : c1;
    }
    const dst_spec D = {run, t0};
    for (int64_t c = c0; c <= c1; c++) {
      group_chunk(X, t0, t1, k, k + 1, c, &D, work);
      for (int64_t t = t0; t < t1; t++)
        if (c > first_chunk(A, t) && c <= last_chunk(A, t))
          for (int h = k * X->g; h < (k + 1) * X->g; h++) {
            float *r = query_dst(X, &D, t, h, first_chunk(A, t));
            fold(r, r + PART_STRIDE(A->d), A->d);
          }
    }
    for (int64_t t = t0; t < t1; t++)
      for (int h = k * X->g; h < (k + 1) * X->g; h++)
        finish(query_dst(X, &D, t, h, first_chunk(A, t)), A->d, A->attn + t * A->q_w + (int64_t)h * A->d);
  }
  release_tiles(X);
}

/* Split path: task i is (group, chunk, KV head); a token's partials are merged afterwards. */
static void chunks_job(void *ctx, int tid, int nt) {
  (void)nt;
  const actx *X = ctx;
  const qattn *A = X->A;
  float *work = thread_work(X, tid);
  const dst_spec D = {NULL, 0};
  for (int64_t i, gi = 0; (i = pool_claim((pool_chunks *)&X->chunks, tid)) >= 0;) {
    while (i >= X->cu_chunks[gi + 1] * A->nkv) gi++; /* a thread's claims ascend */
    while (i < X->cu_chunks[gi] * A->nkv) gi--;      /* except after taking over another's range */
    const int64_t r = i - X->cu_chunks[gi] * A->nkv;
    group_chunk(X, X->group[gi], X->group[gi + 1], (int)(r % A->nkv), (int)(r % A->nkv) + 1, r / A->nkv, &D, work);
  }
  release_tiles(X);
}

static void merge_job(void *ctx, int tid, int nt) {
  (void)nt;
  const actx *X = ctx;
  const qattn *A = X->A;
  const int64_t ps = (int64_t)A->nq * PART_STRIDE(A->d);
  for (int64_t t; (t = pool_claim((pool_chunks *)&X->chunks, tid)) >= 0;) {
    float *run = X->parts + (X->cu_parts[t] + first_chunk(A, t)) * ps;
    for (int64_t c = first_chunk(A, t) + 1; c <= last_chunk(A, t); c++)
      for (int h = 0; h < A->nq; h++)
        fold(run + h * PART_STRIDE(A->d), X->parts + (X->cu_parts[t] + c) * ps + h * PART_STRIDE(A->d), A->d);
    for (int h = 0; h < A->nq; h++) finish(run + h * PART_STRIDE(A->d), A->d, A->attn + t * A->q_w + (int64_t)h * A->d);
  }
}

static void run_job(pool_fn fn, actx *X, int64_t tasks, int threads) {
  const int nt = threads > tasks ? (int)tasks : threads;
  pool_chunks_init(&X->chunks, tasks, nt);
  if (nt <= 1) fn(X, 0, 1);
  else pool_run(fn, X, nt);
}

static __thread scratch_buf scratch;

static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

static _Atomic int tiles_wanted; /* agentrt_quant_attention_tiles; off by default (see the top) */

/* Scores and P.V on AMX tiles: asked for, where the build and the CPU have AMX-BF16, the process
 * was given the tile state, and heads are whole tiles deep (d a multiple of 32). Every row of
 * every step of the process then takes them, so a row's bits still depend on nothing but the row. */
static int use_tiles(int d) {
#if QUANT_AMX_BF16
  return d % 32 == 0 && atomic_load(&tiles_wanted) && quant_tiles_granted();
#else
  (void)d;
  return 0;
#endif
}

/* on = 0 / 1: the attention's dot products off / on AMX tiles where it can use them; -1: leaves
 * it. Set once, before the first step (quant_build applies $AGENTRT_QUANT_ATTENTION_TILES), or by
 * tests and benches around their calls: a process that switched between steps would compute one
 * row two ways. Returns 1 where attention of 32-deep heads runs on tiles now. */
int agentrt_quant_attention_tiles(int on) {
  if (on >= 0) atomic_store(&tiles_wanted, on != 0);
  return use_tiles(32);
}

int quant_attention(const qattn *A, int threads) {
  const int64_t T = A->T;
  const int g = A->nq / A->nkv;
  int64_t macs = 0, n_parts = 0;
  for (int64_t t = 0; t < T; t++) {
    macs += (A->positions[t] + 1) * (int64_t)A->nq * A->d;
    n_parts += last_chunk(A, t) + 1;
  }
  if (macs < SERIAL_ATTN_MACS) threads = 1;
  /* Few rows over many chunks: tasks are (group, chunk, KV head), merged per token afterwards.
   * Groups: each run of rows of one sequence (a token-tree node alone: its keys are its own), cut
   * into near-equal groups of at most `rows`: as many as share a key read, split; else small
   * enough to give each thread two tasks. */
  const int split = threads > 1 && T <= 8 * threads && n_parts > T && n_parts <= MAX_SPLIT_CHUNKS;
  int64_t rows = split ? GROUP_ROWS : T * A->nkv / (2 * threads);
  rows = rows < 1 ? 1 : rows > GROUP_ROWS ? GROUP_ROWS : rows;
  const int64_t work_floats = up16(2 * OFF_ENTRIES + (int64_t)GROUP_ROWS * g * ATTN_CHUNK + 4 * (int64_t)A->d +
                                   (int64_t)PAIRS_STRIDE * A->d + (int64_t)GROUP_ROWS * g * PAIRS_STRIDE +
                                   (int64_t)GROUP_ROWS * g * (sizeof(query) / sizeof(float) + 1) +
                                   (int64_t)(ATTN_CHUNK + GROUP_ROWS * g) * A->d / 2 + TILE_FLOATS + 16 +
                                   2 * (int64_t)GROUP_ROWS * g * PART_STRIDE(A->d));
  const int64_t n_part_floats = split ? n_parts * A->nq * PART_STRIDE(A->d) : 0;
  /* per-thread work (64-byte aligned: the query pairs), the split's partials, 3 (T + 1) int64, then
   * the rounded queries */
  float *buf = scratch_get(&scratch, sizeof(float) * (size_t)(threads * work_floats + n_part_floats) +
                                         sizeof(int64_t) * 3 * (size_t)(T + 1) + sizeof(kv_t) * (size_t)(T * A->nq * A->d));
  if (!buf) return -3;
  int64_t *group = (int64_t *)(buf + threads * work_floats + n_part_floats), *cu_chunks = group + (T + 1),
          *cu_parts = cu_chunks + (T + 1);
  kv_t *qb = (kv_t *)(cu_parts + (T + 1));
  for (int64_t t = 0; t < T; t++) kv_store(qb + t * A->nq * A->d, A->qkv + t * A->qkv_w, (int64_t)A->nq * A->d);
  actx X = {.A = A, .g = g, .group = group, .cu_chunks = cu_chunks, .cu_parts = cu_parts, .qb = qb, .work = buf,
            .work_floats = work_floats, .parts = buf + threads * work_floats, .tiles = use_tiles(A->d)};
  int64_t n_groups = 0;
  cu_chunks[0] = cu_parts[0] = 0;
  for (int64_t t = 0; t < T;) {
    int64_t e = t + 1; /* the run t .. e-1 */
    const int tree = A->tree_base && A->tree_base[t] <= A->positions[t];
    if (!tree)
      while (e < T && A->seq[e] == A->seq[t] && !(A->tree_base && A->tree_base[e] <= A->positions[e])) e++;
    const int64_t pieces = (e - t + rows - 1) / rows;
    for (int64_t p = 0; p < pieces; p++) {
      const int64_t a = t + (e - t) * p / pieces, b = t + (e - t) * (p + 1) / pieces;
      int64_t c1 = 0;
      for (int64_t u = a; u < b; u++) c1 = last_chunk(A, u) > c1 ? last_chunk(A, u) : c1;
      group[n_groups] = a;
      cu_chunks[n_groups + 1] = cu_chunks[n_groups] + c1 + 1;
      n_groups++;
    }
    t = e;
  }
  group[n_groups] = T;
  for (int64_t t = 0; t < T; t++) cu_parts[t + 1] = cu_parts[t] + last_chunk(A, t) + 1;
  if (split) {
    run_job(chunks_job, &X, cu_chunks[n_groups] * A->nkv, threads);
    run_job(merge_job, &X, T, threads);
  } else {
    run_job(groups_job, &X, n_groups * A->nkv, threads);
  }
  return 0;
}

/* A ragged batch's sequences against their block tables: cu_q a partition of 0..T, positions >= 0,
 * every block a sequence's positions reach inside its table row and the cache. Fills seq[t],
 * token t's sequence. Returns 0, or -2 (nothing else written). */
int quant_check_tables(int64_t T, const int64_t *positions, int64_t B, const int64_t *cu_q, const int64_t *block_tables,
                       int64_t bt_stride, int64_t bt_cols, int64_t block_size, int64_t num_slots, int64_t *seq) {
  if (B < 1 || cu_q[0] != 0 || cu_q[B] != T || block_size < 1) return -2;
  for (int64_t b = 0; b < B; b++) {
    if (cu_q[b + 1] < cu_q[b]) return -2;
    int64_t pmax = -1;
    for (int64_t t = cu_q[b]; t < cu_q[b + 1]; t++) {
      if (positions[t] < 0) return -2;
      pmax = positions[t] > pmax ? positions[t] : pmax;
      seq[t] = b;
    }
    if (pmax / block_size >= bt_cols) return -2;
    for (int64_t i = 0; i <= pmax / block_size; i++) {
      const int64_t blk = block_tables[b * bt_stride + i];
      if (blk < 0 || (blk + 1) * block_size > num_slots) return -2;
    }
  }
  return 0;
}

/* The attention alone (tests, benches): q [T, nq d] rows q_stride apart, out [T, nq d]; the
 * bf16 caches [num_slots, nkv, d]; sequence b's tokens cu_q[b] .. cu_q[b+1]-1. Returns 0; -1 for a
 * bad dimension; -2 for an index out of range (nothing written); -3 when out of memory. */
int agentrt_quant_attention(const float *q, int64_t q_stride, int64_t T, int nq, int nkv, int d, float scale,
                            const int64_t *positions, int64_t B, const int64_t *cu_q, const int64_t *block_tables,
                            int64_t bt_stride, int64_t bt_cols, int64_t block_size, int64_t num_slots,
                            const kv_t *kc, const kv_t *vc, int64_t window, float *out, int threads) {
  if (nq < 1 || nkv < 1 || nq % nkv || d < 16 || d % 16 || q_stride < (int64_t)nq * d ||
      window < 0)
    return -1;
  if (T <= 0) return 0;
  int64_t *seq = malloc(sizeof(int64_t) * (size_t)T);
  if (!seq) return -3;
  if (quant_check_tables(T, positions, B, cu_q, block_tables, bt_stride, bt_cols, block_size, num_slots, seq)) {
    free(seq);
    return -2;
  }
  const qattn A = {.T = T, .qkv_w = q_stride, .q_w = (int64_t)nq * d, .nq = nq, .nkv = nkv, .d = d, .scale = scale,
                   .positions = positions, .seq = seq, .block_tables = block_tables, .bt_stride = bt_stride,
                   .block_size = block_size, .window = window, .qkv = q, .kc = kc, .vc = vc, .attn = out};
  const int rc = quant_attention(&A, threads < 1 ? 1 : threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : threads);
  free(seq);
  return rc;
}

/* dst[i] = f32_to_kv(src[i]), i < n: the rounding of every K/V value the decoder writes and of
 * the queries (tests hold both builds to torch's bfloat16 rounding, tiny values flushed) */
void agentrt_quant_kv_store(const float *src, int64_t n, kv_t *dst) { kv_store(dst, src, n); }
