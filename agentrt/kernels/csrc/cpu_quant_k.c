/* The K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256) and the 5-bit blocks of 32 (Q5_0, Q5_1)
 * behind cpu_quant_avx2.c's entry points, which quantize the activations and split the weight
 * rows into chunks (agentrt/kernels/quant_formats.py has the layouts and the references).
 *
 * Activations as for the other formats: int8 blocks of 32 with an fp32 scale dx, and xs = dx *
 * sum(qx) per block. That is finer than llama.cpp's Q8_K (one scale per 256 values), so nothing
 * is lost against it; the price is one fp32 multiply-add per activation block rather than one
 * per super-block. A super-block spans 8 activation blocks; block t contributes, with exact
 * integer sums:
 *
 *   Q4_K, Q5_K: (d * sc[t]) * dx * sum(q * qx) - (dmin * m[t]) * xs[t]
 *   Q6_K:       d * dx * (sc[2t] * sum_{l<16}((q - 32) * qx) + sc[2t+1] * sum_{l>=16}((q - 32) * qx))
 *   Q5_0:       d * dx * sum((q - 16) * qx)         (a block of 32 is one activation block)
 *   Q5_1:       d * dx * sum(q * qx) + m * xs
 *
 * AVX2: a super-block's scales are decoded once per weight row, d * sc[0..7] (Q6_K: d) times an
 * activation row's 8 dx into a small table, and the 8 min terms are one FMA on 8 lanes (dmin *
 * m[0..7] times xs[0..7]) into the accumulator the products go to. Values (nibbles, | high bits
 * << 4) are unpacked in registers once per weight row and shared by the MR activation rows.
 * Q6_K takes q * qx - 32 * qx (the second term once per activation row, for every weight row)
 * and multiplies its int8 scales into the int16 pair sums with _mm256_madd_epi16 ([sc[2t] x 8 |
 * sc[2t+1] x 8]: the 16 values of each sub-block are one 128-bit lane). Int16 pair sums stay
 * within 2 * 63 * 127 (no saturation); int32 lanes within 2^22 (exact as fp32).
 *
 * As in cpu_quant_avx2.c, every (weight row, activation row) pair runs the same ops in the same
 * order whatever the tile shape, the batch or the thread count (batch invariance).
 */
#include "cpu_quant.h"

#define MRK 4 /* activation rows sharing one unpacked weight block */

QUANT_INTERNAL int quant_k_block_bytes(int fmt, int *block_size) {
  switch (fmt) {
    case FMT_Q5_0: *block_size = QK; return 22;
    case FMT_Q5_1: *block_size = QK; return 24;
    case FMT_Q4_K: *block_size = QK_K; return 144;
    case FMT_Q5_K: *block_size = QK_K; return 176;
    case FMT_Q6_K: *block_size = QK_K; return 210;
    default: return 0;
  }
}

/* Q4_K/Q5_K's 12 scale bytes -> u: bytes 0..7 sc[0..7], bytes 8..15 m[0..7] (6 bits each). Byte
 * j + 8 holds the low nibbles of sc[j + 4] and m[j + 4], whose top 2 bits are those of bytes j
 * and j + 4; the masks keep each byte's own bits through the 32-bit shifts. */
static inline void k_scales(const uint8_t *s, uint32_t u[4]) {
  uint32_t a[3];
  memcpy(a, s, 12);
  u[0] = a[0] & 0x3f3f3f3fu;
  u[1] = (a[2] & 0x0f0f0f0fu) | ((a[0] >> 2) & 0x30303030u);
  u[2] = a[1] & 0x3f3f3f3fu;
  u[3] = ((a[2] >> 4) & 0x0f0f0f0fu) | ((a[1] >> 2) & 0x30303030u);
}

/* Q4_K/Q5_K: sub-block t's scale dl[t] = d * sc[t] and offset ml[t] = dmin * m[t] (the weight is
 * dl * q - ml), with the reference's fp32 ops */
static inline void k_sub_scales(const uint8_t *blk, float dl[8], float ml[8]) {
  uint32_t u[4];
  uint8_t scm[16];
  k_scales(blk + 4, u);
  memcpy(scm, u, 16);
  const float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
  for (int t = 0; t < 8; t++) {
    dl[t] = d * (float)scm[t];
    ml[t] = dmin * (float)scm[8 + t];
  }
}

/* Q4_K/Q5_K: the quant of value l of sub-block t (0..15; Q5_K 0..31) */
static inline int k_quant(const uint8_t *blk, int fmt, int t, int l) {
  const uint8_t *qs = blk + (fmt == FMT_Q5_K ? 48 : 16);
  const int nib = t & 1 ? qs[32 * (t >> 1) + l] >> 4 : qs[32 * (t >> 1) + l] & 0x0f;
  return nib | (fmt == FMT_Q5_K ? ((blk[16 + l] >> t) & 1) << 4 : 0);
}

#if QUANT_AVX2

/* Activation block t (0..7) of a super-block: its 32 values 0..63 as bytes. */
static inline __m256i unpack_k(const uint8_t *blk, const int t, const int fmt) {
  const __m256i lo4 = _mm256_set1_epi8(0x0f);
  if (fmt == FMT_Q6_K) { /* half h = t/4; group g = t%4: nibble g/2 of ql[32 (g&1) + l], bits 2g of qh[l] */
    const int h = t >> 2, g = t & 3;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (g & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
    const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(ql, 4) : ql, lo4);
    const __m256i hi = g < 2 ? _mm256_slli_epi16(qh, 4 - 2 * g) : _mm256_srli_epi16(qh, 2 * g - 4);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
  }
  const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (fmt == FMT_Q5_K ? 48 : 16) + 32 * (t >> 1)));
  const __m256i lo = _mm256_and_si256(t & 1 ? _mm256_srli_epi16(qs, 4) : qs, lo4);
  if (fmt == FMT_Q4_K) return lo;
  const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16)); /* bit t of qh[l]: value l's fifth */
  const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, t), _mm256_set1_epi8(1));
  return _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
}

static inline __attribute__((always_inline)) void tile_k(const qjob *j, int64_t n, int64_t m0, const int nr,
                                                         const int mr, const int fmt) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int bb = fmt == FMT_Q4_K ? 144 : fmt == FMT_Q5_K ? 176 : 210;
  __m256 acc[2][MRK];
  for (int i = 0; i < nr; i++)
    for (int r = 0; r < mr; r++) acc[i][r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < j->K / QK_K; sb++) {
    const uint8_t *blk[2];
    float sx[2][MRK][8] __attribute__((aligned(32))); /* d * sc[t] * dx[t] (Q6_K: d * dx[t]) */
    __m256i s6[2]; /* Q6_K: the scales as int16, even sub-blocks in the low lane, odd in the high */
    for (int i = 0; i < nr; i++) {
      blk[i] = j->w + (n + i) * j->row_bytes + sb * bb;
      __m256 ds, dm = _mm256_setzero_ps();
      if (fmt == FMT_Q6_K) {
        const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        s6[i] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk[i] + 192)), evens_odds));
        ds = _mm256_set1_ps(f16_to_f32(blk[i] + 208));
      } else {
        uint32_t u[4];
        int32_t dd;
        k_scales(blk[i] + 4, u);
        memcpy(&dd, blk[i], 4);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dd)); /* d, dmin */
        const __m128i sm = _mm_loadu_si128((const __m128i *)u);
        ds = _mm256_mul_ps(_mm256_broadcastss_ps(f), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        dm = _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(f)),
                           _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
      }
      for (int r = 0; r < mr; r++) {
        _mm256_store_ps(sx[i][r], _mm256_mul_ps(ds, _mm256_loadu_ps(j->xd + (m0 + r) * j->nb + sb * 8)));
        if (fmt != FMT_Q6_K)
          acc[i][r] = _mm256_fnmadd_ps(dm, _mm256_load_ps(j->xs + (m0 + r) * j->nb8 + sb * 8), acc[i][r]);
      }
    }
#pragma GCC unroll 8 /* constant shifts and offsets in unpack_k */
    for (int t = 0; t < 8; t++) {
      __m256i wq[2], wsc[2];
      for (int i = 0; i < nr; i++) {
        wq[i] = unpack_k(blk[i], t, fmt);
        if (fmt == FMT_Q6_K) wsc[i] = _mm256_shuffle_epi8(s6[i], _mm256_set1_epi16((short)((2 * t + 1) << 8 | 2 * t)));
      }
      for (int r = 0; r < mr; r++) {
        const __m256i xq = _mm256_load_si256((const __m256i *)(j->xq + (m0 + r) * j->K + sb * QK_K + t * QK));
        const __m256i x32 = fmt == FMT_Q6_K ? _mm256_maddubs_epi16(_mm256_set1_epi8(32), xq) : xq;
        for (int i = 0; i < nr; i++) {
          __m256i p = _mm256_maddubs_epi16(wq[i], xq);
          p = fmt == FMT_Q6_K ? _mm256_madd_epi16(_mm256_sub_epi16(p, x32), wsc[i]) : _mm256_madd_epi16(p, ones);
          acc[i][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&sx[i][r][t]), _mm256_cvtepi32_ps(p), acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < nr; i++)
    for (int r = 0; r < mr; r++) j->out[(m0 + r) * j->out_stride + n + i] = hsum8(acc[i][r]);
}

/* 32 bits -> 32 bytes, 0xff where the bit is set (byte l: bit l). */
static inline __m256i bytes_from_bits(const uint8_t *p) {
  uint32_t b;
  memcpy(&b, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i v = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)b), shuf),
                                    _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)); /* all bits but bit l%8 */
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
}

/* Q5_0/Q5_1, as cpu_quant_avx2.c's tile for Q4_0/Q4_1 with the fifth bit or-ed in. */
static inline __attribute__((always_inline)) void tile_q5(const qjob *j, int64_t n, int64_t m0, const int nr,
                                                          const int mr, const int fmt) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int bb = fmt == FMT_Q5_1 ? 24 : 22, hdr = fmt == FMT_Q5_1 ? 4 : 2;
  __m256 acc[2][MRK];
  for (int i = 0; i < nr; i++)
    for (int r = 0; r < mr; r++) acc[i][r] = _mm256_setzero_ps();
  float mw[2][fmt == FMT_Q5_1 ? j->nb8 : 1]; /* Q5_1's m, summed against xs after the blocks */
  if (fmt == FMT_Q5_1)
    for (int i = 0; i < nr; i++)
      for (int64_t b = j->nb; b < j->nb8; b++) mw[i][b] = 0.0f;
  for (int64_t b = 0; b < j->nb; b++) {
    __m256i wq[2];
    float dw[2];
    for (int i = 0; i < nr; i++) {
      const uint8_t *blk = j->w + (n + i) * j->row_bytes + b * bb;
      dw[i] = f16_to_f32(blk);
      if (fmt == FMT_Q5_1) mw[i][b] = f16_to_f32(blk + 2);
      const __m128i t = _mm_loadu_si128((const __m128i *)(blk + hdr + 4));
      const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
      wq[i] = _mm256_or_si256(lo, _mm256_and_si256(bytes_from_bits(blk + hdr), _mm256_set1_epi8(0x10)));
      if (fmt == FMT_Q5_0) wq[i] = _mm256_sub_epi8(wq[i], _mm256_set1_epi8(16));
    }
    for (int r = 0; r < mr; r++) {
      const __m256i xq = _mm256_load_si256((const __m256i *)(j->xq + (m0 + r) * j->K + b * QK));
      const float dx = j->xd[(m0 + r) * j->nb + b];
      for (int i = 0; i < nr; i++) {
        __m256i p;
        if (fmt == FMT_Q5_1) /* unsigned: pairs <= 2 * 31 * 127 */
          p = _mm256_maddubs_epi16(wq[i], xq);
        else /* |w| times x carrying w's sign */
          p = _mm256_maddubs_epi16(_mm256_sign_epi8(wq[i], wq[i]), _mm256_sign_epi8(xq, wq[i]));
        p = _mm256_madd_epi16(p, ones);
        acc[i][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[i] * dx), _mm256_cvtepi32_ps(p), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < nr; i++)
    for (int r = 0; r < mr; r++) {
      float off = 0.0f;
      if (fmt == FMT_Q5_1) {
        const float *sx = j->xs + (m0 + r) * j->nb8;
        __m256 o = _mm256_setzero_ps();
        for (int64_t b = 0; b < j->nb8; b += 8)
          o = _mm256_fmadd_ps(_mm256_loadu_ps(mw[i] + b), _mm256_load_ps(sx + b), o);
        off = hsum8(o);
      }
      j->out[(m0 + r) * j->out_stride + n + i] = hsum8(acc[i][r]) + off;
    }
}

static inline __attribute__((always_inline)) void chunk_k(const qjob *j, int64_t n0, int64_t n1, const int fmt) {
  for (int64_t m0 = 0; m0 < j->M; m0 += MRK) {
    const int64_t mr = j->M - m0 < MRK ? j->M - m0 : MRK;
    int64_t n = n0;
#define TILE(NR, MRC) \
  if (fmt == FMT_Q5_0 || fmt == FMT_Q5_1) tile_q5(j, n, m0, NR, MRC, fmt); else tile_k(j, n, m0, NR, MRC, fmt);
#define TILES(MRC)                            \
  for (; n + 2 <= n1; n += 2) { TILE(2, MRC) } \
  if (n < n1) { TILE(1, MRC) }
    switch (mr) {
      case 4: TILES(4) break;
      case 3: TILES(3) break;
      case 2: TILES(2) break;
      default: TILES(1) break;
    }
#undef TILES
#undef TILE
  }
}

QUANT_INTERNAL void quant_k_chunk(const qjob *j, int64_t n0, int64_t n1) {
  switch (j->fmt) {
    case FMT_Q4_K: chunk_k(j, n0, n1, FMT_Q4_K); break;
    case FMT_Q5_K: chunk_k(j, n0, n1, FMT_Q5_K); break;
    case FMT_Q6_K: chunk_k(j, n0, n1, FMT_Q6_K); break;
    case FMT_Q5_0: chunk_k(j, n0, n1, FMT_Q5_0); break;
    default: chunk_k(j, n0, n1, FMT_Q5_1); break;
  }
}

#else /* scalar */

/* One block (bs values: 32, or 256 for a K-quant) -> its integers wq [bs] (Q5_0: q - 16, Q6_K:
 * q - 32, else q) and per activation block t its fp32 scale ds[t] and offset dm[t] (the weight
 * is ds * wq - dm; Q6_K: ds = d, and the int8 scales in isc [16]). */
static void unpack_block(const uint8_t *blk, int fmt, int8_t *wq, float *ds, float *dm, int *isc) {
  if (fmt == FMT_Q5_0 || fmt == FMT_Q5_1) {
    const int hdr = fmt == FMT_Q5_1 ? 4 : 2, zero = fmt == FMT_Q5_1 ? 0 : 16;
    uint32_t qh;
    memcpy(&qh, blk + hdr, 4);
    for (int l = 0; l < QK / 2; l++) {
      wq[l] = (int8_t)(((blk[hdr + 4 + l] & 0x0f) | ((qh >> l) & 1) << 4) - zero);
      wq[l + QK / 2] = (int8_t)(((blk[hdr + 4 + l] >> 4) | ((qh >> (l + 16)) & 1) << 4) - zero);
    }
    ds[0] = f16_to_f32(blk);
    dm[0] = fmt == FMT_Q5_1 ? -f16_to_f32(blk + 2) : 0.0f;
    return;
  }
  if (fmt == FMT_Q6_K) {
    for (int h = 0; h < 2; h++)
      for (int l = 0; l < 32; l++) {
        const uint8_t *ql = blk + 64 * h, qh = blk[128 + 32 * h + l];
        int8_t *q = wq + 128 * h + l;
        q[0] = (int8_t)(((ql[l] & 0x0f) | (qh & 3) << 4) - 32);
        q[32] = (int8_t)(((ql[l + 32] & 0x0f) | ((qh >> 2) & 3) << 4) - 32);
        q[64] = (int8_t)(((ql[l] >> 4) | ((qh >> 4) & 3) << 4) - 32);
        q[96] = (int8_t)(((ql[l + 32] >> 4) | ((qh >> 6) & 3) << 4) - 32);
      }
    for (int s = 0; s < 16; s++) isc[s] = (int8_t)blk[192 + s];
    for (int t = 0; t < 8; t++) ds[t] = f16_to_f32(blk + 208);
    return;
  }
  k_sub_scales(blk, ds, dm);
  for (int t = 0; t < 8; t++)
    for (int l = 0; l < QK; l++) wq[QK * t + l] = (int8_t)k_quant(blk, fmt, t, l);
}

QUANT_INTERNAL void quant_k_chunk(const qjob *j, int64_t n0, int64_t n1) {
  int bs = QK;
  const int fmt = j->fmt, bb = quant_k_block_bytes(fmt, &bs), nt = bs / QK; /* activation blocks per block */
  for (int64_t m0 = 0; m0 < j->M; m0 += MRK) {
    const int mr = j->M - m0 < MRK ? (int)(j->M - m0) : MRK;
    for (int64_t n = n0; n < n1; n++) {
      float acc[MRK] = {0}, off[MRK] = {0};
      for (int64_t b = 0; b < j->K / bs; b++) {
        int8_t wq[QK_K]; /* the block's weights once, for the mr activation rows */
        float ds[8], dm[8];
        int isc[16];
        unpack_block(j->w + n * j->row_bytes + b * bb, fmt, wq, ds, dm, isc);
        for (int r = 0; r < mr; r++)
          for (int t = 0; t < nt; t++) {
            const int64_t a = b * nt + t; /* the activation block */
            const int8_t *xq = j->xq + (m0 + r) * j->K + a * QK, *w = wq + t * QK;
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < QK / 2; l++) s0 += w[l] * xq[l];
            for (int l = QK / 2; l < QK; l++) s1 += w[l] * xq[l];
            const int32_t isum = fmt == FMT_Q6_K ? isc[2 * t] * s0 + isc[2 * t + 1] * s1 : s0 + s1;
            acc[r] += ds[t] * j->xd[(m0 + r) * j->nb + a] * (float)isum;
            if (fmt != FMT_Q5_0 && fmt != FMT_Q6_K) off[r] -= dm[t] * j->xs[(m0 + r) * j->nb8 + a];
          }
      }
      for (int r = 0; r < mr; r++) j->out[(m0 + r) * j->out_stride + n] = acc[r] + off[r];
    }
  }
}

#endif

QUANT_INTERNAL void quant_k_embed_row(const uint8_t *row, int fmt, int64_t K, float *o) {
  if (fmt == FMT_Q5_0 || fmt == FMT_Q5_1) { /* (q - 16) * d; q * d then + m (not fused) */
    const int bb = fmt == FMT_Q5_1 ? 24 : 22, hdr = fmt == FMT_Q5_1 ? 4 : 2;
    for (int64_t b = 0; b < K / QK; b++, o += QK) {
      const uint8_t *blk = row + b * bb, *qs = blk + hdr + 4;
      const float d = f16_to_f32(blk), m = fmt == FMT_Q5_1 ? f16_to_f32(blk + 2) : 0.0f;
      uint32_t qh;
      memcpy(&qh, blk + hdr, 4);
      for (int l = 0; l < QK / 2; l++) {
        const int q0 = (qs[l] & 0x0f) | ((qh >> l) & 1) << 4, q1 = (qs[l] >> 4) | ((qh >> (l + 16)) & 1) << 4;
        o[l] = fmt == FMT_Q5_1 ? (float)q0 * d + m : (float)(q0 - 16) * d;
        o[l + QK / 2] = fmt == FMT_Q5_1 ? (float)q1 * d + m : (float)(q1 - 16) * d;
      }
    }
    return;
  }
  const int bb = fmt == FMT_Q4_K ? 144 : fmt == FMT_Q5_K ? 176 : 210;
  for (int64_t b = 0; b < K / QK_K; b++, o += QK_K) {
    const uint8_t *blk = row + b * bb;
    if (fmt == FMT_Q6_K) { /* (d * sc[s]) * (q - 32) */
      const float d = f16_to_f32(blk + 208);
      for (int v = 0; v < QK_K; v++) {
        const int h = v >> 7, g = (v >> 5) & 3, l = v & 31;
        const int ql = blk[64 * h + 32 * (g & 1) + l], qh = blk[128 + 32 * h + l];
        const int q = ((g >> 1 ? ql >> 4 : ql & 0x0f) | ((qh >> (2 * g)) & 3) << 4) - 32;
        o[v] = d * (float)(int8_t)blk[192 + v / 16] * (float)q;
      }
      continue;
    }
    float dl[8], ml[8]; /* (d * sc[t]) * q - (dmin * m[t]) */
    k_sub_scales(blk, dl, ml);
    for (int t = 0; t < 8; t++)
      for (int l = 0; l < QK; l++) o[QK * t + l] = dl[t] * (float)k_quant(blk, fmt, t, l) - ml[t];
  }
}
