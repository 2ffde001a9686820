/* bf16 rotary + KV-cache write and paged attention for a ragged batch of few queries per
 * sequence (decode and draft verification), on AMX and AVX512.
 *
 * Why: the PyTorch path gathers every sequence's context into a padded grid, masks it and runs
 * two batched matmuls plus permute copies, about 20 small ops per layer; here one call per layer
 * reads K/V straight from the paged cache through the block table.
 *
 * The rounding mirrors the PyTorch reference (agentrt/kernels/attention.py): rotary in bf16 ops
 * (each product and the sum rounded), q.k rounded to bf16 then scaled in fp32, softmax in fp32,
 * probabilities rounded to bf16, p.v accumulated in fp32 and rounded once. Dot-product
 * summation order and exp() differ from ATen's by float rounding only.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "cpu_common.h"

/* Rotate-half rotary on `heads` heads of one token, in place: x*c + rot(x)*s in bf16 ops, 16
 * pairs at a time (with the KV copies ~25% faster than the scalar loop: 8.5 against 11.1 ms for
 * 1000 tokens over 30 layers). Negation flips the sign bit, as the reference's -x does, so -0
 * stays -0: bit-identical for finite values (a NaN stays NaN, with another payload). */
static void rotary_token(bf16 *x, int heads, int d, const float *cos, const float *sin) {
  const int half = d / 2;
  const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
  for (int j = 0; j < half; j += 16) {
    const __mmask16 m = half - j >= 16 ? 0xffff : (__mmask16)((1u << (half - j)) - 1);
    const __m512 c = round_bf16(_mm512_maskz_loadu_ps(m, cos + j)), s = round_bf16(_mm512_maskz_loadu_ps(m, sin + j));
    for (int h = 0; h < heads; h++) {
      bf16 *v = x + h * d;
      const __m512 a = load_bf16(v + j, m), b = load_bf16(v + half + j, m);
      const __m512 nb = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(b), sign));
      const __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(a, c)), round_bf16(_mm512_mul_ps(nb, s)));
      const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(b, c)), round_bf16(_mm512_mul_ps(a, s)));
      store_bf16(v + j, lo, m);
      store_bf16(v + half + j, hi, m);
    }
  }
}

/* qkv [T, ld]: q (nq heads), k (nkv heads), v (nkv heads), each head d wide, contiguous.
 * Norms each q and k head in place with q_norm, k_norm (QK-norm: Qwen3, Gemma 3; NULL: none;
 * norm_row's weights, norm_f32 as there), rotates q and k in place by positions[t] (cos/sin:
 * [P, d/2] fp32), then copies k and v of token t into row slots[t] of the caches
 * [num_slots, nkv, d]. */
typedef struct {
  bf16 *qkv;
  int64_t T, ld;
  int nq, nkv, d;
  const int64_t *positions, *slots;
  const float *cos, *sin;
  bf16 *k_cache, *v_cache;
  const void *q_norm, *k_norm;
  int norm_f32;
  float eps;
  pool_chunks chunks; /* of tokens */
} rotary_job;

static void rotary_part(void *arg, int tid, int nt) {
  (void)nt;
  rotary_job *J = (rotary_job *)arg;
  const int64_t kv_row = (int64_t)J->nkv * J->d, half = J->d / 2;
  for (int64_t t; (t = pool_claim(&J->chunks, tid)) >= 0;) {
    bf16 *row = J->qkv + t * J->ld;
    if (J->q_norm)
      for (int h = 0; h < J->nq + J->nkv; h++)
        norm_row(row + (int64_t)h * J->d, h < J->nq ? J->q_norm : J->k_norm, J->norm_f32, J->d, J->eps,
                 row + (int64_t)h * J->d);
    rotary_token(row, J->nq + J->nkv, J->d, J->cos + J->positions[t] * half, J->sin + J->positions[t] * half);
    memcpy(J->k_cache + J->slots[t] * kv_row, row + (int64_t)J->nq * J->d, (size_t)kv_row * sizeof(bf16));
    memcpy(J->v_cache + J->slots[t] * kv_row, row + (int64_t)(J->nq + J->nkv) * J->d, (size_t)kv_row * sizeof(bf16));
  }
}

/* See rotary_job. */
void agentrt_rotary_kv_write_bf16(bf16 *qkv, int64_t T, int64_t ld, int nq, int nkv, int d,
                                  const int64_t *positions, const float *cos, const float *sin,
                                  const int64_t *slots, bf16 *k_cache, bf16 *v_cache, const void *q_norm,
                                  const void *k_norm, int norm_f32, float eps, int num_threads) {
  rotary_job job = {qkv, T, ld, nq, nkv, d, positions, slots, cos, sin, k_cache, v_cache,
                    q_norm, k_norm, norm_f32, eps, {0}};
  const int nt = T >= 64 ? num_threads : 1; /* a few tokens: not worth a join */
  pool_chunks_init(&job.chunks, T, nt);
  pool_run(rotary_part, &job, nt);
}

#define MAX_D 256
#define QB 16 /* queries per block: the rows of an AMX tile */

static inline void prefetch_row(const bf16 *p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}

/* In-register transpose of a 16 x 16 fp32 block (r[i] = row i -> r[j] = column j). */
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; j++) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

/* Scratch of one (sequence, kv head) task, sized for its context. */
typedef struct {
  int64_t *slots;  /* [lpad] cache slot of each context position */
  float *scores;   /* [QB][lpad] */
  uint32_t *probs; /* [2 QB][lpad]: query j's probabilities as A-tile rows 2j (p, 0) and 2j+1 (0, p) */
  bf16 *kbuf;      /* [16][MAX_D] K rows copied when the cache cannot be tiled in place */
  bf16 *vbuf;      /* [16][MAX_D] V rows likewise, zero past the context */
  int64_t lpad;    /* context rounded up to 32 */
  int prefetch;    /* software prefetch distance in context rows (0: none) */
} scratch;

/* 16 context rows l0.. of one head as a tile: straight from the cache when they are 16
 * consecutive slots of one block, all in the context, and whole 64-byte tile rows exist;
 * else copied into buf (zero beyond the context, so stale slots never meet a probability). */
static const bf16 *context_rows(const scratch *S, const bf16 *cache, int64_t l0, int64_t ctx, int direct, int d,
                                int64_t kv_row, int64_t head_off, bf16 *buf, int64_t *stride) {
  if (direct && l0 + 16 <= ctx) {
    *stride = kv_row * 2;
    return cache + S->slots[l0] * kv_row + head_off;
  }
  const int dpad = (d + 31) / 32 * 32;
  for (int l = 0; l < 16; l++) {
    bf16 *row = buf + l * dpad;
    memset(row, 0, (size_t)dpad * sizeof(bf16));
    if (l0 + l < ctx) memcpy(row, cache + S->slots[l0 + l] * kv_row + head_off, (size_t)d * sizeof(bf16));
  }
  *stride = dpad * 2;
  return buf;
}

/* One block of up to QB queries of one (sequence, kv head) against the sequence's context:
 *   scores = Q . K^T on AMX: K tiles come straight from the paged cache (16 consecutive slots of
 *     a block; copied when blocks are shorter), Q^T is packed once, each 16 x 16 result is
 *     transposed so a zmm holds 16 keys of one query;
 *   softmax per query in fp32 (bf16(q.k) * scale, -inf past its position, probabilities rounded
 *     to bf16 as the reference does);
 *   out = P . V on AMX with V tiles read straight from the cache as well: a B tile row is one
 *     key's 32 d-values, taken by TDPBF16PS as 16 pairs (d 2n, 2n+1). Query j's probabilities
 *     go in two A rows, 2j = (p_l, 0) pairs and 2j+1 = (0, p_l): row 2j sums p_l * V[l][2n]
 *     (output d 2n), row 2j+1 sums p_l * V[l][2n+1]. Half the multiplies are by zero, which AMX
 *     has to spare, and V is never repacked.
 * Batch invariance: every query's arithmetic is the same whatever else is in the block, the
 * task or the batch. An AMX row depends only on its own A row and the B tiles; each query's
 * scores, softmax and P.V run over 16-key chunks from position 0 in increasing order, and the
 * chunks past its own position add exact zeros (its probabilities there are 0 and V rows past
 * the block's context are zero-filled, never stale). Mixing two P.V paths (AVX512 for a few
 * queries, AMX for many) changed last bits between decode and draft verification: TDPBF16PS
 * does not round like a chain of FMAs.
 * A sliding window (window > 0: a query at p sees p - window + 1 .. p) masks the keys before it
 * as well, and the block starts at the 16-key chunk of its earliest visible key: the chunks
 * before it would add exact zeros to every query's max, sum and P.V, so skipping them keeps
 * each query's bits whatever block it is in. */
static void attend_block(const scratch *S, const bf16 *const *qrows, const int64_t *qpos, int qb, int d, int64_t ctx,
                         int64_t block_size, const bf16 *k_cache, const bf16 *v_cache, int64_t kv_row,
                         int64_t head_off, float scale, int64_t window, bf16 *const *orows) {
  const int dpad = (d + 31) / 32 * 32;
  const int64_t lpad = S->lpad;
  int64_t l_lo = 0; /* the first 16-key chunk any query of the block sees */
  if (window > 0) {
    int64_t first = qpos[0];
    for (int j = 1; j < qb; j++) first = qpos[j] < first ? qpos[j] : first;
    first -= window - 1;
    l_lo = first > 0 ? first / 16 * 16 : 0;
  }
  /* Q^T as B tiles, per 32-wide d chunk: [16 d-pairs][QB queries][2]. */
  uint32_t qt[MAX_D / 32][16][QB] __attribute__((aligned(64)));
  memset(qt, 0, sizeof(uint32_t) * (dpad / 32) * 16 * QB);
  for (int j = 0; j < qb; j++)
    for (int p = 0; p < d / 2; p++) memcpy(&qt[p / 16][p % 16][j], qrows[j] + 2 * p, 4);
  const int direct = block_size % 16 == 0 && d % 32 == 0;
  float tile[16 * QB] __attribute__((aligned(64)));
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  for (int64_t l0 = l_lo; l0 < ctx; l0 += 16) {
    int64_t stride;
    /* stale K rows past the context are fine here: their scores are masked to -inf below */
    const bf16 *a = context_rows(S, k_cache, l0, direct ? ctx + 16 : ctx, direct, d, kv_row, head_off, S->kbuf,
                                 &stride);
    for (int64_t l = l0 + S->prefetch; S->prefetch && l < l0 + S->prefetch + 16 && l < ctx; l++)
      prefetch_row(k_cache + S->slots[l] * kv_row + head_off, 2 * d);
    _tile_zero(0);
    for (int c = 0; c < dpad / 32; c++) {
      _tile_loadd(1, a + c * 32, stride);
      _tile_loadd(2, qt[c], 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, tile, QB * 4); /* [16 keys][QB queries] */
    __m512 r[16];
    for (int l = 0; l < 16; l++) r[l] = _mm512_load_ps(tile + l * QB);
    transpose16(r); /* r[j]: query j, lanes = keys l0.. */
    const __m512 keys = _mm512_add_ps(lane, _mm512_set1_ps((float)l0));
    for (int j = 0; j < qb; j++) {
      __m512 sj = _mm512_mul_ps(round_bf16(r[j]), vscale);
      __mmask16 hidden = _mm512_cmp_ps_mask(keys, _mm512_set1_ps((float)qpos[j]), _CMP_GT_OQ);
      if (window > 0) hidden |= _mm512_cmp_ps_mask(keys, _mm512_set1_ps((float)(qpos[j] - window + 1)), _CMP_LT_OQ);
      _mm512_storeu_ps(S->scores + j * lpad + l0, _mm512_mask_blend_ps(hidden, sj, ninf));
    }
  }
  const int64_t lctx = (ctx + 15) / 16 * 16;
  const int rows = qb > 8 ? 2 * QB : QB; /* whole A tiles: rows of absent queries are zero */
  for (int j = 0; j < rows / 2; j++) {
    uint32_t *even = S->probs + 2 * j * lpad, *odd = even + lpad;
    int64_t n = 0; /* keys in 16-key groups with a visible key */
    if (j < qb) {
      float *row = S->scores + j * lpad;
      n = (qpos[j] / 16 + 1) * 16;
      __m512 mx = ninf;
      for (int64_t l = l_lo; l < n; l += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + l));
      const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t l = l_lo; l < n; l += 16) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + l), vmax));
        _mm512_storeu_ps(row + l, e);
        sum = _mm512_add_ps(sum, e);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
      for (int64_t l = l_lo; l < n; l += 16) {
        const __m256i p = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(row + l), inv));
        const __m512i pairs = _mm512_cvtepu16_epi32(p); /* (p, 0) */
        _mm512_storeu_si512(even + l, pairs);
        _mm512_storeu_si512(odd + l, _mm512_slli_epi32(pairs, 16)); /* (0, p) */
      }
    }
    if (lctx > n) {
      memset(even + n, 0, sizeof(uint32_t) * (lctx - n));
      memset(odd + n, 0, sizeof(uint32_t) * (lctx - n));
    }
  }
  /* out = P . V: per half of the block (8 queries, 16 A rows), output d in groups of up to 4
   * 32-wide chunks (C tiles 3..6), the context in 16-key chunks. */
  const int chunks = dpad / 32;
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  float otile[16 * 16] __attribute__((aligned(64)));
  for (int half = 0; half * 8 < qb; half++) {
    const uint32_t *arows = S->probs + 2 * half * 8 * lpad;
    for (int c0 = 0; c0 < chunks; c0 += 4) {
      const int nc = chunks - c0 < 4 ? chunks - c0 : 4;
      _tile_zero(3);
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      for (int64_t l0 = l_lo; l0 < ctx; l0 += 16) {
        int64_t stride;
        const bf16 *vb = context_rows(S, v_cache, l0, ctx, direct, d, kv_row, head_off, S->vbuf, &stride);
        for (int64_t l = l0 + S->prefetch; S->prefetch && l < l0 + S->prefetch + 16 && l < ctx; l++)
          prefetch_row(v_cache + S->slots[l] * kv_row + head_off + 32 * c0, 2 * (d - 32 * c0 < 128 ? d - 32 * c0 : 128));
        _tile_loadd(1, arows + l0, lpad * 4);
        _tile_loadd(2, vb + 32 * c0, stride);
        _tile_dpbf16ps(3, 1, 2);
        if (nc > 1) {
          _tile_loadd(2, vb + 32 * (c0 + 1), stride);
          _tile_dpbf16ps(4, 1, 2);
        }
        if (nc > 2) {
          _tile_loadd(2, vb + 32 * (c0 + 2), stride);
          _tile_dpbf16ps(5, 1, 2);
        }
        if (nc > 3) {
          _tile_loadd(2, vb + 32 * (c0 + 3), stride);
          _tile_dpbf16ps(6, 1, 2);
        }
      }
      for (int c = 0; c < nc; c++) {
        switch (c) {
          case 0: _tile_stored(3, otile, 64); break;
          case 1: _tile_stored(4, otile, 64); break;
          case 2: _tile_stored(5, otile, 64); break;
          default: _tile_stored(6, otile, 64); break;
        }
        const int dc = 32 * (c0 + c), width = d - dc < 32 ? d - dc : 32;
        for (int j = half * 8; j < qb && j < half * 8 + 8; j++) {
          const __m512 ev = _mm512_load_ps(otile + 2 * (j - half * 8) * 16), od = _mm512_load_ps(otile + (2 * (j - half * 8) + 1) * 16);
          store_bf16(orows[j] + dc, _mm512_permutex2var_ps(ev, lo, od), 0xffff);
          if (width > 16) store_bf16(orows[j] + dc + 16, _mm512_permutex2var_ps(ev, hi, od), 0xffff);
        }
      }
    }
  }
}

/* Queries i0..i1 of one (sequence, kv head), query i being token t0 + i / g, head kvh * g + i % g,
 * in blocks of QB queries. */
static void attend_group(const bf16 *q, int64_t ldq, bf16 *out, int64_t ldo, int64_t t0, int64_t i_begin,
                         int64_t i_end, const int64_t *positions, int kvh, int g, int nkv, int d,
                         const int64_t *table, int64_t block_size, const bf16 *k_cache, const bf16 *v_cache,
                         float scale, int64_t window, int prefetch_rows) {
  const int64_t kv_row = (int64_t)nkv * d, head_off = (int64_t)kvh * d;
  int64_t ctx = 0;
  for (int64_t i = i_begin / g; i <= (i_end - 1) / g; i++)
    if (positions[t0 + i] + 1 > ctx) ctx = positions[t0 + i] + 1;
  static __thread scratch_buf bufs[5];
  scratch S;
  S.lpad = (ctx + 31) / 32 * 32;
  S.slots = (int64_t *)scratch_get(&bufs[0], (size_t)S.lpad * sizeof(int64_t));
  S.scores = (float *)scratch_get(&bufs[1], (size_t)QB * S.lpad * sizeof(float));
  S.probs = (uint32_t *)scratch_get(&bufs[2], (size_t)2 * QB * S.lpad * sizeof(uint32_t));
  S.kbuf = (bf16 *)scratch_get(&bufs[3], 16 * MAX_D * sizeof(bf16));
  S.vbuf = (bf16 *)scratch_get(&bufs[4], 16 * MAX_D * sizeof(bf16));
  S.prefetch = prefetch_rows;
  /* Positions past ctx up to the block's end are still this sequence's slots (K tiles read
   * whole 16-slot runs); past the last block they are never read. */
  const int64_t nblocks = (ctx + block_size - 1) / block_size;
  for (int64_t l = 0, blk = 0; l < S.lpad; blk++) {
    const int64_t base = blk < nblocks ? table[blk] * block_size : 0;
    for (int64_t o = 0; o < block_size && l < S.lpad; o++, l++) S.slots[l] = blk < nblocks ? base + o : 0;
  }
  for (int64_t i0 = i_begin; i0 < i_end; i0 += QB) {
    const int qb = (int)(i_end - i0 < QB ? i_end - i0 : QB);
    const bf16 *qrows[QB];
    bf16 *orows[QB];
    int64_t qpos[QB];
    int64_t bctx = 0;
    for (int j = 0; j < qb; j++) {
      const int64_t i = i0 + j;
      const int64_t head = (int64_t)kvh * g + i % g;
      qrows[j] = q + (t0 + i / g) * ldq + head * d;
      orows[j] = out + (t0 + i / g) * ldo + head * d;
      qpos[j] = positions[t0 + i / g];
      if (qpos[j] + 1 > bctx) bctx = qpos[j] + 1;
    }
    attend_block(&S, qrows, qpos, qb, d, bctx, block_size, k_cache, v_cache, kv_row, head_off, scale, window,
                 orows);
  }
}

typedef struct {
  const bf16 *q, *k_cache, *v_cache;
  int64_t ldq, ldo, B, bt_stride, block_size;
  const int64_t *cu_q, *positions, *block_tables;
  int nq, nkv, d;
  float scale;
  int64_t window;
  bf16 *out;
  int prefetch_rows;
  const int64_t *tasks; /* [n][4]: sequence, kv head, first and end query */
  pool_chunks chunks;   /* of tasks */
} attention_job;

/* Queries per task: a long prefill splits into many tasks so both threads share it (one task
 * per (sequence, kv head) left a 3-kv-head model's prefill 2:1 between two threads). How the
 * queries split into tasks and blocks changes no query's result (see attend_block). */
#define QCHUNK 64

static void attention_part(void *arg, int tid, int nt) {
  (void)nt;
  attention_job *J = (attention_job *)arg;
  configure_tiles();
  for (int64_t task; (task = pool_claim(&J->chunks, tid)) >= 0;) {
    const int64_t *T = J->tasks + 4 * task, b = T[0];
    attend_group(J->q, J->ldq, J->out, J->ldo, J->cu_q[b], T[2], T[3], J->positions, (int)T[1], J->nq / J->nkv,
                 J->nkv, J->d, J->block_tables + b * J->bt_stride, J->block_size, J->k_cache, J->v_cache,
                 J->scale, J->window, J->prefetch_rows);
  }
  _tile_release();
}

/* out[t, nq*d] = attention of q[t] (rows of stride ldq, head h at h*d) over its sequence's
 * cached context. Sequence b owns tokens cu_q[b]..cu_q[b+1] and block table row b
 * (block_tables + b*bt_stride); a token at position p attends to positions 0..p, or with
 * window > 0 (a sliding layer) to p - window + 1 .. p. d % 16 == 0.
 * prefetch_rows: the software prefetch distance (0: none); the engine's setting, and why:
 * agentrt/kernels/paged_attention.py. A query's output is bit-identical whatever else is in the
 * call: alone in decode, one of many in draft verification or a (chunked) prefill. */
void agentrt_paged_attention_bf16(const bf16 *q, int64_t ldq, int64_t B, const int64_t *cu_q,
                                  const int64_t *positions, const int64_t *block_tables,
                                  int64_t bt_stride, int64_t block_size, const bf16 *k_cache,
                                  const bf16 *v_cache, int nq, int nkv, int d, float scale, int64_t window,
                                  bf16 *out, int64_t ldo, int num_threads, int prefetch_rows) {
  const int g = nq / nkv;
  int64_t tasks = 0;
  for (int64_t b = 0; b < B; b++) tasks += nkv * (((cu_q[b + 1] - cu_q[b]) * g + QCHUNK - 1) / QCHUNK);
  static __thread scratch_buf task_buf;
  int64_t *list = (int64_t *)scratch_get(&task_buf, (size_t)(4 * tasks + 4) * sizeof(int64_t)), *t = list;
  /* The latest queries of each sequence first: they see the longest context. */
  for (int64_t b = 0; b < B; b++) {
    const int64_t qn = (cu_q[b + 1] - cu_q[b]) * g;
    for (int64_t i1 = qn; i1 > 0; i1 -= QCHUNK)
      for (int h = 0; h < nkv; h++, t += 4) {
        t[0] = b, t[1] = h, t[2] = i1 > QCHUNK ? i1 - QCHUNK : 0, t[3] = i1;
      }
  }
  attention_job job = {q, k_cache, v_cache, ldq, ldo, B, bt_stride, block_size, cu_q, positions, block_tables,
                       nq, nkv, d, scale, window, out, prefetch_rows, list, {0}};
  const int nt = tasks < num_threads ? (int)tasks : num_threads;
  pool_chunks_init(&job.chunks, tasks, nt);
  pool_run(attention_part, &job, nt);
}
