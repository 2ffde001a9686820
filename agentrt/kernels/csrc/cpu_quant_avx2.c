/* Linear layers and embedding lookups on GGUF block-quantized weights (Q8_0, Q4_0, Q4_1 here;
 * Q4_K, Q5_K, Q6_K, Q5_0, Q5_1 in cpu_quant_k.c, reached through the same entry points), read
 * in their file layout and never dequantized to memory (agentrt/kernels/quant_formats.py has the
 * formats and the PyTorch references).
 *
 *   out[m, n] = sum_k x[m, k] * W[n, k],  x fp32 [M, K], W [N, K] in blocks of 32 along K
 *
 * As llama.cpp does, each activation row is first quantized to int8 blocks of 32 with an fp32
 * scale dx (round-half-even of x * 127/amax), keeping the block's dx * sum(q) for the weights'
 * offset term. A weight block then contributes, with exact integer dot products:
 *
 *   Q8_0: dw * dx * sum(qw * qx)
 *   Q4_0: dw * dx * sum(qw * qx) - 8 dw * dx * sum(qx)     (qw the nibble 0..15)
 *   Q4_1: dw * dx * sum(qw * qx) + m * dx * sum(qx)
 *
 * AVX2 path (AVX2 + FMA + F16C): the nibbles are unpacked in registers; _mm256_maddubs_epi16
 * multiplies unsigned weight bytes by signed activation bytes (Q8_0's signed weights first move
 * their sign onto the activation, as ggml_vec_dot_q8_0_q8_0) and _mm256_madd_epi16 widens to 8
 * int32 partial sums. Eight blocks' partial sums are then added into the 8 lanes of one vector
 * (a tree of _mm256_hadd_epi32, exact), converted once and multiplied by the 8 blocks' dw * dx
 * (scales gathered as f16 and converted 8 at a time), and the offset terms are one more FMA per
 * 8 blocks; 8 weight rows' lane sums are reduced together into one store. Against one
 * convert-broadcast-FMA per block this halves the float work per block (Q8_0's head: 1.9x).
 * Without AVX2 (or with -DAGENTRT_QUANT_SCALAR) a scalar path computes the same sums in another
 * order (Q4_0 as sum((qw - 8) * qx)).
 *
 * Rows interleaved by 8 (ROWS8, the layout the loader gives Q4_0/Q4_1/Q8_0; see below): 8
 * weight rows' outputs accumulate in the 8 lanes of one vector, block after block, with no
 * horizontal sums and the 8 rows' scales loaded as one vector. Q4's 8 products per lane stay in
 * int16 (|sum| <= 8 * 2 * 15 * 127) and widen once per block. Against the file's layout: 2.0-2.5x
 * per Q4_1 block from cache, 1.4x streaming from DRAM, 1.3x for the Q8_0 head (2 threads).
 *
 * Loop order: a chunk of CHUNK_N weight rows stays in L1 while every activation row goes past
 * it, MR rows at a time, each weight block unpacked once per MR rows: k+1 verification rows
 * cost about one read of the weights. Threads split N (never K), so each output is computed by
 * one thread in one fixed order: a row's bits depend neither on the other rows, nor on M, nor
 * on the thread count (batch invariance; built with -ffp-contract=off so that the compiler does
 * not fuse some multiply-adds in one tile shape and not in another).
 */
#include <float.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "cpu_quant.h" /* QUANT_AVX2, the format codes, qjob, f16_to_f32 */
#define CHUNK_N 16 /* weight rows per unit of work: 16 x 960 bytes (Q4_1, K=1536) stay in L1 */
#define MR 4       /* activation rows sharing one unpacked weight block */
#define PREFETCH_AHEAD 4096 /* bytes */

static int block_bytes(int fmt) {
  switch (fmt) {
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q8_0: return 34;
    default: return 0;
  }
}

/* ---- ROWS8: 8 weight rows interleaved (agentrt_quant_interleave) ----
 * Rows 8g .. 8g+7 form group g; its block b is one "group block" of 8 x block_bytes: the 8
 * rows' f16 d [8], Q4_1's f16 m [8], then the values in 32-byte chunks whose 4-byte lane r
 * holds row r's value bytes 4i .. 4i+3 (chunk i). A chunk is thus 4 consecutive bytes of each
 * of the 8 rows: multiplied by 4 activation bytes broadcast to every lane, it leaves row r's
 * partial dot product in lane r, so a group's 8 outputs come out in one vector's lanes with no
 * horizontal sums, and the 8 rows' scales load as one vector (llama.cpp's Q4_0_8x8 repacking
 * idea). The rows of a last, partial group are zero blocks. */
static int rows8_head(int fmt) { return fmt == FMT_Q4_1 ? 32 : 16; }
static int value_offset(int fmt) { return fmt == FMT_Q4_1 ? 4 : 2; }

/* Where row r's block sits in a group block: n pieces {offset in the group block, offset in the
 * file's block, bytes}; returns n (<= 10). */
static int rows8_pieces(int fmt, int r, int pieces[10][3]) {
  int n = 0;
  pieces[n][0] = 2 * r, pieces[n][1] = 0, pieces[n++][2] = 2; /* d */
  if (fmt == FMT_Q4_1) pieces[n][0] = 16 + 2 * r, pieces[n][1] = 2, pieces[n++][2] = 2; /* m */
  for (int c = 0; c < (block_bytes(fmt) - value_offset(fmt)) / 4; c++) /* value bytes 4c .. 4c+3 */
    pieces[n][0] = rows8_head(fmt) + 32 * c + 4 * r, pieces[n][1] = value_offset(fmt) + 4 * c, pieces[n++][2] = 4;
  return n;
}

/* Row r (of 8) of the group block gb, in the file's block layout, into blk. */
static void rows8_block(const uint8_t *gb, int fmt, int r, uint8_t *blk) {
  int p[10][3];
  for (int i = 0, n = rows8_pieces(fmt, r, p); i < n; i++) memcpy(blk + p[i][1], gb + p[i][0], (size_t)p[i][2]);
}

/* ---- activations: int8 blocks, per row ---- */

/* x [K] -> q [K] int8, d [K/32] = amax/127, s [K/32] = d * sum(q); quantize_activations in
 * quant_formats.py mirrors it. The AVX2 version below runs the same fp32 ops per value (a max,
 * one multiply, a round half to even, exact integer sums), so both paths quantize identically. */
static inline void quantize_row_scalar(const float *x, int64_t K, int8_t *q, float *d, float *s) {
  for (int64_t b = 0; b < K / QK; b++) {
    const float *xb = x + b * QK;
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < QK; i++) {
      const float a = fabsf(xb[i]);
      finite &= isfinite(a);
      amax = fmaxf(amax, a);
    }
    if (!finite) { /* NaN or Inf in the block: the outputs it feeds are NaN, never plausible numbers */
      for (int i = 0; i < QK; i++) q[b * QK + i] = 0;
      d[b] = s[b] = NAN;
      continue;
    }
    const float inv127 = 127.0f / amax;
    /* amax 0, or so small (< 127/FLT_MAX) that its inverse overflows: the block is zeros */
    const float inv = amax != 0.0f && isfinite(inv127) ? inv127 : 0.0f;
    int sum = 0;
    for (int i = 0; i < QK; i++) {
      const int v = (int)nearbyintf(xb[i] * inv); /* the default rounding: half to even */
      q[b * QK + i] = (int8_t)v;
      sum += v;
    }
    d[b] = amax / 127.0f;
    s[b] = d[b] * (float)sum;
  }
}

#if QUANT_AVX2

static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(FLT_MAX);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes packs' lane interleave */
  for (int64_t b = 0; b < K / QK; b++) {
    const float *xb = x + b * QK;
    __m256 v[4], mx = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 a = _mm256_and_ps(v[i], abs_mask);
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(a, big, _CMP_LE_OQ)); /* false for NaN and Inf */
      mx = _mm256_max_ps(mx, a);
    }
    if (_mm256_movemask_ps(ok) != 0xff) {
      memset(q + b * QK, 0, QK);
      d[b] = s[b] = NAN;
      continue;
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float inv127 = 127.0f / amax;
    const __m256 inv = _mm256_set1_ps(amax != 0.0f && isfinite(inv127) ? inv127 : 0.0f);
    __m256i iv[4];
    for (int i = 0; i < 4; i++)
      iv[i] = _mm256_cvtps_epi32(
          _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
    _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(q8, order));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
    d[b] = amax / 127.0f;
    s[b] = d[b] * (float)_mm_cvtsi128_si32(t4);
  }
}

/* 16 bytes of nibbles -> 32 bytes 0..15: values 0..15 (low nibbles) in the low lane. */
static inline __m256i unpack_nibbles(const uint8_t *qs) {
  const __m128i t = _mm_loadu_si128((const __m128i *)qs);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
}

/* The f16 at byte `off` of blocks 0..n-1 (bb bytes apart) as 8 floats, lanes >= n zero. */
static inline __attribute__((always_inline)) __m256 f16x8(const uint8_t *blk, int bb, int off, const int n) {
  __m128i v = _mm_setzero_si128();
  uint16_t h;
#define LANE(I)                                     \
  if (n > I) {                                      \
    memcpy(&h, blk + (I) * bb + off, 2);            \
    v = _mm_insert_epi16(v, h, I);                  \
  }
  LANE(0) LANE(1) LANE(2) LANE(3) LANE(4) LANE(5) LANE(6) LANE(7)
#undef LANE
  return _mm256_cvtph_ps(v);
}

/* [sum(p0), ..., sum(p7)]: each p's 8 int32 lanes added (exact) */
static inline __m256i sums8(__m256i p0, __m256i p1, __m256i p2, __m256i p3, __m256i p4, __m256i p5, __m256i p6,
                            __m256i p7) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(p4, p5), _mm256_hadd_epi32(p6, p7));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* A weight block's 32 values as bytes: Q4_1 0..15, Q4_0 0..15 (the - 8 is taken as an offset
 * of -8 dw, as Q4_1's m), Q8_0 signed. */
static inline __attribute__((always_inline)) __m256i weight_bytes(const uint8_t *blk, const int fmt) {
  return fmt == FMT_Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2))
                         : unpack_nibbles(blk + (fmt == FMT_Q4_1 ? 4 : 2));
}

/* The integer dot product of one weight block with one activation block, as 8 int32 lanes. */
static inline __attribute__((always_inline)) __m256i block_dot(__m256i w, __m256i x, const int fmt) {
  const __m256i p = fmt == FMT_Q8_0 /* |w| (unsigned; -128 -> 128) times x carrying w's sign */
                        ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                        : _mm256_maddubs_epi16(w, x); /* unsigned nibbles: pairs <= 2 * 15 * 127 */
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* Weight row n against activation rows m0 .. m0+mr-1, blocks b0 .. b0+n_blk-1 (n_blk <= 8):
 * the 8 blocks' integer sums in the lanes of one vector, times dw * dx per lane, then the
 * offsets (Q4_1's m, Q4_0's -8 dw) times xs = dx sum(qx), into acc[r]. Every (weight row,
 * activation row) pair runs the same ops in the same order whatever mr is. */
static inline __attribute__((always_inline)) void group(const qjob *j, int64_t n, int64_t m0, int64_t b0,
                                                        const int mr, const int fmt, const int n_blk, __m256 *acc) {
  const int bb = fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_1 ? 20 : 18;
  const uint8_t *blk = j->w + n * j->row_bytes + b0 * bb;
  /* a thread's rows are contiguous: fetch 4 KB ahead of them. At M = 1 a linear streams its
   * weights from DRAM once, and the hardware prefetchers alone left ~20% of the time waiting
   * (Q8_0 head, 2 threads: 1.7 -> 1.2 ms); harmless past the end (prefetches do not fault) */
  for (int c = 0; c < 8 * bb; c += 64) _mm_prefetch((const char *)blk + PREFETCH_AHEAD + c, _MM_HINT_T0);
  __m256i w[8];
  for (int i = 0; i < 8; i++) w[i] = i < n_blk ? weight_bytes(blk + i * bb, fmt) : _mm256_setzero_si256();
  const __m256 dw = f16x8(blk, bb, 0, n_blk);
  const __m256 mw = fmt == FMT_Q4_1 ? f16x8(blk, bb, 2, n_blk)
                    : fmt == FMT_Q4_0 ? _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f)) : _mm256_setzero_ps();
  for (int r = 0; r < mr; r++) {
    const int8_t *xq = j->xq + (m0 + r) * j->K + b0 * QK;
    __m256i p[8];
    for (int i = 0; i < 8; i++)
      p[i] = i < n_blk ? block_dot(w[i], _mm256_load_si256((const __m256i *)(xq + i * QK)), fmt) : _mm256_setzero_si256();
    const float *xd = j->xd + (m0 + r) * j->nb + b0;
    const __m256 dx = n_blk == 8 ? _mm256_loadu_ps(xd) : _mm256_maskload_ps(xd, lanes_below(n_blk));
    const __m256 sums = _mm256_cvtepi32_ps(sums8(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]));
    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), sums, acc[r]);
    if (fmt != FMT_Q8_0) /* xs rows are zero-padded to nb8: no mask */
      acc[r] = _mm256_fmadd_ps(mw, _mm256_load_ps(j->xs + (m0 + r) * j->nb8 + b0), acc[r]);
  }
}

/* acc[r]: weight row n against activation row m0 + r, in 8 lanes to be added */
static inline __attribute__((always_inline)) void row_lanes(const qjob *j, int64_t n, int64_t m0, const int mr,
                                                            const int fmt, __m256 *acc) {
  for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
  int64_t b0 = 0;
  for (; b0 + 8 <= j->nb; b0 += 8) group(j, n, m0, b0, mr, fmt, 8, acc);
  switch (j->nb - b0) {
#define TAIL(T) case T: group(j, n, m0, b0, mr, fmt, T, acc); break;
    TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#undef TAIL
    default: break;
  }
}

/* [hsum8(v[0]), ..., hsum8(v[7])], each as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) */
static inline __m256 hsums8(const __m256 *v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* The file's layout: weight rows n .. n+nr-1 (nr <= 8) against activation rows m0 .. m0+mr-1,
 * a row's lanes added in the same order wherever it sits among the 8. */
static inline __attribute__((always_inline)) void file_rows8(const qjob *j, int64_t n, int nr, int64_t m0,
                                                             const int mr, const int fmt) {
  __m256 v[MR][8], acc[MR];
  for (int i = 0; i < 8; i++) {
    if (i < nr) row_lanes(j, n + i, m0, mr, fmt, acc);
    for (int r = 0; r < mr; r++) v[r][i] = i < nr ? acc[r] : _mm256_setzero_ps();
  }
  for (int r = 0; r < mr; r++) {
    float *o = j->out + (m0 + r) * j->out_stride + n;
    const __m256 sums = hsums8(v[r]);
    if (nr == 8) _mm256_storeu_ps(o, sums);
    else _mm256_maskstore_ps(o, lanes_below(nr), sums);
  }
}

static inline __attribute__((always_inline)) void chunk_fmt(const qjob *j, int64_t n0, int64_t n1, const int fmt) {
  for (int64_t m0 = 0; m0 < j->M; m0 += MR) {
    const int64_t mr = j->M - m0 < MR ? j->M - m0 : MR;
    for (int64_t n = n0; n < n1; n += 8) {
      const int nr = n1 - n < 8 ? (int)(n1 - n) : 8;
      switch (mr) {
        case 4: file_rows8(j, n, nr, m0, 4, fmt); break;
        case 3: file_rows8(j, n, nr, m0, 3, fmt); break;
        case 2: file_rows8(j, n, nr, m0, 2, fmt); break;
        default: file_rows8(j, n, nr, m0, 1, fmt); break;
      }
    }
  }
}

/* 4 activation bytes in every 32-bit lane */
static inline __m256i bcast4(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

/* Group gw (its blocks from gw on) against activation rows m0 .. m0+mr-1: acc[r] lane i is
 * weight row 8g+i against activation row m0+r. Per block and lane, the same two FMAs in the
 * same order as group() uses per block: the integer sum times dw * dx, then the offset m * xs. */
static inline __attribute__((always_inline)) void group_rows8(const qjob *j, const uint8_t *gw, int64_t m0,
                                                              const int mr, const int fmt, __m256 *acc) {
  const int gbb = 8 * (fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_1 ? 20 : 18), head = fmt == FMT_Q4_1 ? 32 : 16;
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f);
  for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
  /* block b's row m0 + r: xv + 32 (vg b + r), sd[vg b + r] (qjob.vg) */
  const int64_t at = vg_at(j, m0, 0), vg = j->vg;
  const int8_t *xv = (const int8_t *)j->xv + at * QK;
  const float *sd = j->xdt + at, *ss = j->xst + at;
  for (int64_t b = 0; b < j->nb; b++, xv += vg * QK, sd += vg, ss += vg) {
    const uint8_t *blk = gw + b * gbb;
    for (int c = 0; c < gbb; c += 64) _mm_prefetch((const char *)blk + PREFETCH_AHEAD + c, _MM_HINT_T0);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256 mw = fmt == FMT_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)))
                                      : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
    if (fmt == FMT_Q8_0) {
      /* two chunks at a time against every row, as the nibbles below: registers for the rows */
      __m256i s[MR]; /* pairs reach 2 * 128 * 127: widened per chunk */
      for (int c0 = 0; c0 < 8; c0 += 2) {
        __m256i w[2], aw[2];
        for (int c = 0; c < 2; c++) {
          w[c] = _mm256_loadu_si256((const __m256i *)(blk + head + 32 * (c0 + c)));
          aw[c] = _mm256_abs_epi8(w[c]); /* -128 -> 0x80, 128 as unsigned */
        }
        for (int r = 0; r < mr; r++) {
          const int8_t *xq = xv + QK * r + 4 * c0;
          for (int c = 0; c < 2; c++) {
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(bcast4(xq + 4 * c), w[c])), ones);
            s[r] = c0 || c ? _mm256_add_epi32(s[r], p) : p;
            __asm__("" : "+x"(s[r]));
          }
        }
      }
      for (int r = 0; r < mr; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(sd[r])), _mm256_cvtepi32_ps(s[r]), acc[r]);
    } else {
      /* the low nibbles' 4 chunks against every row, then the high nibbles': 4 weight vectors
       * live, not 8, so that the rows' sums and accumulators stay in AVX2's 16 registers (with
       * 8, and row addresses by row, the accumulators went through the stack every block).
       * x86-64-v3 build on a Zen 4 EPYC, SmolLM2-135M forwards of 4 and 16 rows: 0.86x and 0.88x
       * the time of those 8 vectors by row; 576 x 1536 Q4_1 alone at 16 rows, one thread, the
       * three steps (by group, sums in order, 4 vectors) timed one against the next: 0.95, 0.92 and
       * 0.88x, ~0.77x together */
      __m256i wv[4], s16[MR]; /* int16 lanes: 8 pairs of nibble (<= 15) x activation (|q| <= 127) products, |sum| <= 30480 */
      for (int half = 0; half < 2; half++) {
        for (int c = 0; c < 4; c++) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + head + 32 * c));
          wv[c] = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, low4);
        }
        for (int r = 0; r < mr; r++) {
          const int8_t *xq = xv + QK * r + 16 * half;
          for (int c = 0; c < 4; c++) {
            const __m256i p = _mm256_maddubs_epi16(wv[c], bcast4(xq + 4 * c));
            s16[r] = half || c ? _mm256_add_epi16(s16[r], p) : p;
            __asm__("" : "+x"(s16[r])); /* added in order: a tree of sums would take registers */
          }
        }
      }
      for (int r = 0; r < mr; r++) {
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(sd[r])), _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones)), acc[r]);
        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(ss[r]), acc[r]);
      }
    }
  }
}

static inline __attribute__((always_inline)) void chunk_rows8(const qjob *j, int64_t n0, int64_t n1, const int fmt) {
  for (int64_t m0 = 0; m0 < j->M; m0 += MR) {
    const int64_t mr = j->M - m0 < MR ? j->M - m0 : MR;
    for (int64_t n = n0; n < n1; n += 8) {
      const uint8_t *gw = j->w + n / 8 * j->row_bytes;
      __m256 acc[MR];
      switch (mr) {
        case 4: group_rows8(j, gw, m0, 4, fmt, acc); break;
        case 3: group_rows8(j, gw, m0, 3, fmt, acc); break;
        case 2: group_rows8(j, gw, m0, 2, fmt, acc); break;
        default: group_rows8(j, gw, m0, 1, fmt, acc); break;
      }
      const int nr = n1 - n < 8 ? (int)(n1 - n) : 8;
      for (int r = 0; r < mr; r++) {
        float *o = j->out + (m0 + r) * j->out_stride + n;
        if (nr == 8) _mm256_storeu_ps(o, acc[r]);
        else _mm256_maskstore_ps(o, lanes_below(nr), acc[r]);
      }
    }
  }
}

#else /* scalar */

static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
  quantize_row_scalar(x, K, q, d, s);
}

static void chunk_scalar(const qjob *j, int64_t n0, int64_t n1) {
  const int fmt = j->fmt, bb = block_bytes(fmt);
  for (int64_t m0 = 0; m0 < j->M; m0 += MR) {
    const int mr = j->M - m0 < MR ? (int)(j->M - m0) : MR;
    for (int64_t n = n0; n < n1; n++) {
      float acc[MR] = {0}, off[MR] = {0};
      for (int64_t b = 0; b < j->nb; b++) {
        uint8_t tmp[34];
        const uint8_t *blk = j->w + n * j->row_bytes + b * bb;
        if (j->rows8) {
          rows8_block(j->w + n / 8 * j->row_bytes + b * 8 * bb, fmt, (int)(n % 8), tmp);
          blk = tmp;
        }
        const float dw = f16_to_f32(blk), mw = fmt == FMT_Q4_1 ? f16_to_f32(blk + 2) : 0.0f;
        int8_t wq[QK]; /* the block's weights once, for the mr activation rows */
        if (fmt == FMT_Q8_0) {
          memcpy(wq, blk + 2, QK);
        } else {
          const uint8_t *qs = blk + (fmt == FMT_Q4_1 ? 4 : 2);
          const int zero = fmt == FMT_Q4_1 ? 0 : 8;
          for (int i = 0; i < QK / 2; i++) {
            wq[i] = (int8_t)((qs[i] & 0x0f) - zero);
            wq[i + QK / 2] = (int8_t)((qs[i] >> 4) - zero);
          }
        }
        for (int r = 0; r < mr; r++) {
          const int8_t *xq = j->xq + (m0 + r) * j->K + b * QK;
          int32_t isum = 0;
          for (int i = 0; i < QK; i++) isum += wq[i] * xq[i];
          acc[r] += dw * j->xd[(m0 + r) * j->nb + b] * (float)isum;
          if (fmt == FMT_Q4_1) off[r] += mw * j->xs[(m0 + r) * j->nb8 + b];
        }
      }
      for (int r = 0; r < mr; r++) j->out[(m0 + r) * j->out_stride + n] = acc[r] + off[r];
    }
  }
}

#endif

static void qjob_run(void *ctx, int tid, int nthreads) {
  (void)nthreads;
  qjob *j = ctx;
#if QUANT_AMX
  int amx = 0; /* tiles configured on this thread */
#endif
  for (int64_t c; (c = pool_claim(&j->chunks, tid)) >= 0;) {
    const int64_t n0 = c * CHUNK_N, n1 = n0 + CHUNK_N < j->N ? n0 + CHUNK_N : j->N;
    if (block_bytes(j->fmt) == 0) {
      quant_k_chunk(j, n0, n1);
      continue;
    }
#if QUANT_AVX512
    if (j->rows8 && j->isa >= QUANT_ISA_VNNI) {
#if QUANT_AMX
      if (j->isa == QUANT_ISA_AMX && !amx) quant_amx_begin(j->M < 16 ? (int)j->M : 16), amx = 1;
#endif
      quant_rows16_chunk(j, n0, n1);
      continue;
    }
#endif
#if QUANT_AVX2
    if (j->rows8) {
      switch (j->fmt) {
        case FMT_Q4_0: chunk_rows8(j, n0, n1, FMT_Q4_0); break;
        case FMT_Q4_1: chunk_rows8(j, n0, n1, FMT_Q4_1); break;
        default: chunk_rows8(j, n0, n1, FMT_Q8_0); break;
      }
      continue;
    }
    switch (j->fmt) {
      case FMT_Q4_0: chunk_fmt(j, n0, n1, FMT_Q4_0); break;
      case FMT_Q4_1: chunk_fmt(j, n0, n1, FMT_Q4_1); break;
      default: chunk_fmt(j, n0, n1, FMT_Q8_0); break;
    }
#else
    chunk_scalar(j, n0, n1);
#endif
  }
#if QUANT_AMX
  if (amx) quant_amx_end();
#endif
}

/* ---- which instruction set runs a ROWS8 linear ---- */

/* Fewer activation rows than this run on VNNI: below it the tile path's fixed cost per weight
 * block (its unpack into a tile, the tile loads and stores) outweighs the fold it saves
 * (576 x 1536 Q4_1 and 4096 x 576 Q8_0, one thread, from cache). */
#define AMX_MIN_ROWS_Q4 8
#define AMX_MIN_ROWS_Q8 5

#if QUANT_AMX
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#endif

/* The best instruction set this build and this process may use. */
static int best_isa(void) {
  static _Atomic int best = -1;
  int b = atomic_load(&best);
  if (b >= 0) return b;
#if QUANT_AMX
  /* Linux hands out AMX tile state only to a process that asks for it */
  b = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? QUANT_ISA_AMX : QUANT_ISA_VNNI;
#elif QUANT_AVX512
  b = QUANT_ISA_VNNI;
#elif QUANT_AVX2
  b = QUANT_ISA_AVX2;
#else
  b = QUANT_ISA_SCALAR;
#endif
  atomic_store(&best, b);
  return b;
}

#if QUANT_AMX
int quant_tiles_granted(void) { return best_isa() == QUANT_ISA_AMX; }
#endif

static _Atomic int isa_cap = QUANT_ISA_AMX; /* agentrt_quant_set_isa's limit */

/* The instruction set ROWS8 linears run on now (QUANT_ISA_*: 0 scalar, 1 AVX2, 2 AVX512-VNNI,
 * 3 AMX-INT8; with AMX, calls of few rows run on VNNI: call_isa). */
int agentrt_quant_isa(void) {
  const int b = best_isa(), cap = atomic_load(&isa_cap);
  return b < cap ? b : cap;
}

/* Caps the instruction set at isa (tests and benches compare the paths). Returns the one in
 * effect, or -1 when isa is not one this build and CPU can run (then nothing changes). */
int agentrt_quant_set_isa(int isa) {
  if (isa < QUANT_ISA_SCALAR || isa > best_isa() || (isa == QUANT_ISA_SCALAR && QUANT_AVX2)) return -1;
  atomic_store(&isa_cap, isa);
  return agentrt_quant_isa();
}

static int call_isa(int64_t M, int fmt) {
  const int isa = agentrt_quant_isa();
  return isa == QUANT_ISA_AMX && M < (fmt == FMT_Q8_0 ? AMX_MIN_ROWS_Q8 : AMX_MIN_ROWS_Q4) ? QUANT_ISA_VNNI : isa;
}

/* The calling thread's buffer for the quantized activations. */
static __thread scratch_buf scratch;

/* 1 when built with the AVX2 path, 0 for the scalar one. */
int agentrt_quant_avx2(void) { return QUANT_AVX2; }

/* x fp32 [M, K] (row stride x_stride) -> q int8 [M, K], d fp32 [M, K/32]: for tests. */
int agentrt_quant_activations(const float *x, int64_t x_stride, int64_t M, int64_t K, int8_t *q, float *d) {
  if (K % QK) return -1;
  float *s = malloc(sizeof(float) * (size_t)(K / QK));
  if (!s) return -3;
  for (int64_t m = 0; m < M; m++) quantize_row(x + m * x_stride, K, q + m * K, d + m * (K / QK), s);
  free(s);
  return 0;
}

/* W [N, K] in fmt (Q4_0, Q4_1, Q8_0; rows contiguous) -> out, its ROWS8 layout: ceil(N/8)
 * groups of K/32 group blocks (see ROWS8 above), the last group's missing rows zero. Returns 0,
 * or -1 for a format without that layout or a bad K. */
int agentrt_quant_interleave(const uint8_t *w, int fmt, int64_t N, int64_t K, uint8_t *out) {
  const int bb = block_bytes(fmt);
  if (bb == 0 || K % QK || K <= 0 || N < 0) return -1;
  const int64_t nb = K / QK, groups = (N + 7) / 8;
  memset(out, 0, (size_t)(groups * nb * 8 * bb));
  int p[8][10][3], np = 0;
  for (int r = 0; r < 8; r++) np = rows8_pieces(fmt, r, p[r]);
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < nb; b++) {
      uint8_t *gb = out + (n / 8 * nb + b) * 8 * bb;
      const uint8_t *blk = w + (n * nb + b) * bb;
      for (int i = 0; i < np; i++) memcpy(gb + p[n % 8][i][0], blk + p[n % 8][i][1], (size_t)p[n % 8][i][2]);
    }
  return 0;
}

/* The calling thread's activation buffer sized and touched for M rows of K values (any format):
 * a step's first call at a new largest size then neither grows it nor faults its pages in.
 * Returns 0, -3 when out of memory. */
int quant_linear_reserve(int64_t M, int64_t K) {
  const int64_t M16 = (M + 15) / 16 * 16, nb = K / QK, nb8 = (nb + 7) / 8 * 8;
  const size_t size = (size_t)(M16 * K) * 2 + sizeof(float) * (size_t)(M16 * (nb8 + 4 * nb));
  void *p = scratch_get(&scratch, size);
  if (!p) return -3;
  memset(p, 0, size);
  return 0;
}

/* out fp32 [M, N] (row stride out_stride) = x fp32 [M, K] (row stride x_stride) @ W.T, W [N, K]
 * in format fmt (rows of K/bs blocks of bs values, contiguous; or, with ROWS8 set, as
 * agentrt_quant_interleave lays them out). Returns 0, or -1 for a bad format or K, -3 when out
 * of memory. */
int agentrt_quant_linear(const float *x, int64_t x_stride, int64_t M, const uint8_t *w, int fmt, int64_t N,
                         int64_t K, float *out, int64_t out_stride, int threads) {
  const int rows8 = (fmt & ROWS8) != 0;
  fmt &= ~ROWS8;
  int bs = QK;
  const int bb = block_bytes(fmt) ? block_bytes(fmt) : quant_k_block_bytes(fmt, &bs);
  if (bb == 0 || K % bs || K <= 0 || (rows8 && !block_bytes(fmt))) return -1;
  if (M <= 0 || N <= 0) return 0;
  const int64_t nb = K / QK;
  const int64_t nb8 = (nb + 7) / 8 * 8;
  const int isa = rows8 ? call_isa(M, fmt) : QUANT_ISA_AVX2, by_group = rows8 && QUANT_AVX2;
  /* one row: its activations as quantized (a group of 16 with one row cost 1.05x the time of a
   * decode step's forward on the x86-64-v3 build, Zen 4) */
  const int64_t vg = M == 1 ? 1 : 16;
  const int signed_weights = by_group && fmt == FMT_Q8_0 && isa >= QUANT_ISA_VNNI; /* qjob.xsw */
  /* rows padded to 16 (AMX reads activations 16 rows at a time; the padding is zeros) */
  const int64_t M16 = (M + 15) / 16 * 16;
  /* q rows first (each K bytes: 32-byte aligned), then s (rows of nb8: 32-byte aligned), then
   * (by_group) q by group (qjob.xv), then d, then (by_group) d and s by group (xdt), then
   * (signed_weights) xsw */
  int8_t *xq = scratch_get(&scratch, (size_t)(M16 * K) * (1 + by_group)
                                         + sizeof(float) * (size_t)(M16 * (nb8 + nb * (by_group ? 3 + signed_weights : 1))));
  if (!xq) return -3;
  float *xs = (float *)(xq + M16 * K);
  uint8_t *xv = by_group ? (uint8_t *)(xs + M16 * nb8) : NULL;
  float *xd = (float *)((int8_t *)(xs + M16 * nb8) + (by_group ? M16 * K : 0));
  memset(xs, 0, sizeof(float) * (size_t)(M16 * nb8));
  for (int64_t m = 0; m < M; m++) quantize_row(x + m * x_stride, K, xq + m * K, xd + m * nb, xs + m * nb8);
  if (M16 > M) {
    memset(xq + M * K, 0, (size_t)((M16 - M) * K));
    memset(xd + M * nb, 0, sizeof(float) * (size_t)((M16 - M) * nb));
  }
  float *xdt = by_group ? xd + M16 * nb : NULL, *xst = by_group ? xdt + M16 * nb : NULL;
  int32_t *xsw = signed_weights ? (int32_t *)(xd + M16 * nb * 3) : NULL;
  if (by_group && vg == 1) { /* the row as quantized is its own group */
    xdt = xd, xst = xs;
    xv = (uint8_t *)xq;
  } else if (by_group) { /* the rows there are; AMX folds 4 rows at a time: zeros up to a multiple of 4 */
    for (int64_t m = 0; m < (isa == QUANT_ISA_AMX ? (M + 3) / 4 * 4 : M); m++)
      for (int64_t b = 0; b < nb; b++) {
        xdt[scales_at(nb, m, b)] = xd[m * nb + b];
        xst[scales_at(nb, m, b)] = xs[m * nb8 + b];
      }
    for (int64_t m = 0; m < M; m++)
      for (int64_t b = 0; b < nb; b++) memcpy(xv + scales_at(nb, m, b) * QK, xq + m * K + b * QK, QK);
  }
  if (xsw) /* the sums in xdt's layout, which for one row is the row's own */
    for (int64_t m = 0; m < M; m++)
      for (int64_t b = 0; b < nb; b++) {
        const int8_t *q = xq + m * K + b * QK;
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) sum += q[i];
        xsw[vg == 1 ? b : scales_at(nb, m, b)] = -128 * sum;
      }
  qjob j = {.w = w, .fmt = fmt, .rows8 = rows8, .N = N, .K = K, .nb = nb, .nb8 = nb8,
            .row_bytes = K / bs * bb * (rows8 ? 8 : 1), .xq = xq, .xv = xv, .vg = vg, .isa = isa, .xd = xd, .xs = xs,
            .xdt = xdt, .xst = xst, .xsw = xsw, .M = M, .out = out, .out_stride = out_stride};
  const int64_t chunks = (N + CHUNK_N - 1) / CHUNK_N;
  const int nt = threads < 1 ? 1 : (threads > chunks ? (int)chunks : threads);
  pool_chunks_init(&j.chunks, chunks, nt);
  pool_run(qjob_run, &j, nt);
  return 0;
}

/* out fp32 [T, K] (row stride out_stride) = rows ids [T] of W [N, K] (ROWS8: interleaved),
 * dequantized with the reference's fp32 ops (q * d; (q - 8) * d; q * d then + m): equal to it
 * bit for bit. Returns 0, -1 for a bad format or K, -2 for an id outside [0, N), -3 when out
 * of memory. */
int agentrt_quant_embedding(const int64_t *ids, int64_t T, const uint8_t *w, int fmt, int64_t N, int64_t K,
                            float *out, int64_t out_stride) {
  const int rows8 = (fmt & ROWS8) != 0;
  fmt &= ~ROWS8;
  int bs = QK;
  const int bb = block_bytes(fmt) ? block_bytes(fmt) : quant_k_block_bytes(fmt, &bs);
  if (bb == 0 || K % bs || K <= 0 || (rows8 && !block_bytes(fmt))) return -1;
  for (int64_t t = 0; t < T; t++)
    if (ids[t] < 0 || ids[t] >= N) return -2;
  const int64_t nb = K / QK;
  uint8_t *file_row = NULL; /* a ROWS8 row back in the file's layout */
  if (rows8 && !(file_row = malloc((size_t)(nb * bb)))) return -3;
  for (int64_t t = 0; t < T; t++) {
    const uint8_t *row = w + ids[t] * (K / bs) * bb;
    if (rows8) {
      for (int64_t b = 0; b < nb; b++)
        rows8_block(w + (ids[t] / 8 * nb + b) * 8 * bb, fmt, (int)(ids[t] % 8), file_row + b * bb);
      row = file_row;
    }
    float *o = out + t * out_stride;
    if (block_bytes(fmt) == 0) {
      quant_k_embed_row(row, fmt, K, o);
      continue;
    }
    for (int64_t b = 0; b < nb; b++, o += QK) {
      const uint8_t *blk = row + b * bb;
      const float d = f16_to_f32(blk);
      if (fmt == FMT_Q8_0) {
        for (int i = 0; i < QK; i++) o[i] = (float)(int8_t)blk[2 + i] * d;
      } else if (fmt == FMT_Q4_0) {
        for (int i = 0; i < QK / 2; i++) {
          o[i] = (float)((blk[2 + i] & 0x0f) - 8) * d;
          o[i + QK / 2] = (float)((blk[2 + i] >> 4) - 8) * d;
        }
      } else {
        const float m = f16_to_f32(blk + 2);
        for (int i = 0; i < QK / 2; i++) {
          o[i] = (float)(blk[4 + i] & 0x0f) * d + m; /* not fused: -ffp-contract=off */
          o[i + QK / 2] = (float)(blk[4 + i] >> 4) * d + m;
        }
      }
    }
  }
  free(file_row);
  return 0;
}
