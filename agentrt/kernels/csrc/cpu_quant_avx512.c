/* Quantized linears on AVX512-VNNI and AMX-INT8, for weights whose rows are interleaved by 8
 * (ROWS8: Q4_0, Q4_1, Q8_0; see cpu_quant_avx2.c): 16 weight rows (two groups of 8) at a time,
 * one output row per 32-bit lane of a 512-bit vector.
 *
 * Why: a verification or prefill step feeds M rows past each weight. The AVX2 path unpacks a
 * weight block once per 4 rows and spends 8 multiply-add instructions per 8 weight rows, 32
 * values and activation row, so its cost grows almost linearly with M (16 rows ~6x one row).
 * VPDPBUSD does 4 u8 x s8 products and their sum per lane in one instruction (16 weight rows x
 * 4 values), and an AMX tile multiply (TDPBSUD / TDPBSSD) takes 16 activation rows x 32 values
 * x 16 weight rows at once, so what grows with M here is mostly the float epilogue.
 *
 * Exactness and batch invariance: the integer dot product of a weight block with an activation
 * block is exact on every path, and the float epilogue is, per output and block, the AVX2
 * path's two steps in the same order:
 *
 *   acc = fma(dw * dx, (float)isum, acc);  acc = fma(mw, xs, acc)   (Q4_1: mw = m; Q4_0: -8 dw)
 *
 * (Q8_0: the first step only), blocks in order from 0. So an output's bits are the same on
 * AVX2, VNNI and AMX, for any M, any tile of rows and any thread count: the instruction set can
 * be chosen per call (agentrt_quant_linear picks VNNI for few rows, AMX for many) without a
 * token of greedy output changing.
 *
 * VNNI's unsigned x signed product: Q4 nibbles are the unsigned side. Q8_0's signed weights
 * are shifted to unsigned (w + 128, a byte XOR as a block is unpacked) and the sum starts from
 * -128 * sum(q), each activation row's block sum computed once per call (qjob.xsw), so the
 * result is sum(q * w) exactly. (Shifting the activations instead and starting from
 * -128 * sum(w) took 8 more VPDPBUSD per block and 8 rows for the weights' sum, and registers
 * that kept Q8_0's rows one by one: this way, rows interleaved as Q4's, SmolLM2's head, 49152 x
 * 576 Q8_0, takes 0.82-0.86x the time at 2-32 rows on a Zen 4 EPYC, the same at 1.)
 */
#include "cpu_quant.h"

#if QUANT_AVX512

/* How far ahead of the block being unpacked each group's weights are fetched, into the L2 cache:
 * ~1.5 us of the kernel's reading at the call's row count, so the distance shrinks as more rows
 * make each byte slower to consume. Whole SmolLM2-135M Q4_1 forwards, two builds timed in turn in
 * one process (Xeon, AVX-512/VNNI/AMX, 2 threads): against 4 KB ahead into L1 at every row count,
 * this took 0.89x the time at 1 row and 0.91x at 4 rows with the weights in the last-level cache
 * (as in back-to-back steps), 0.95x at 4 rows and 0.97x at 16 from DRAM (a 200 MB read between
 * forwards), the rest even. Into L1 (prefetcht0) it was 1.12x at 1 row from cache; twice these
 * distances 1.10x at 1 row from DRAM; no software prefetch 1.13x prefetcht0's at 1 row from DRAM. */
static inline int64_t prefetch_ahead(int64_t M) { return M == 1 ? 24576 : M < 4 ? 16384 : M < 8 ? 12288 : 8192; }
#define NO_GROUP_BYTES 288 /* >= a group block of any ROWS8 format: zeros for a missing 2nd group */
static const uint8_t no_group[NO_GROUP_BYTES] __attribute__((aligned(64)));

static inline int group_block_bytes(int fmt) { return 8 * (fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_1 ? 20 : 18); }
static inline int group_head_bytes(int fmt) { return fmt == FMT_Q4_1 ? 32 : 16; }

/* The two groups of weight rows n0 .. n0+15 (n0 a multiple of 16): block b of the first at
 * g0 + b * s0, of the second at g1 + b * s1 (the zero block, s1 = 0, when rows n0+8.. do not
 * exist). */
typedef struct {
  const uint8_t *g0, *g1;
  int64_t s0, s1;
  int64_t ahead; /* prefetch distance, bytes (prefetch_ahead) */
} row_pair;

static inline row_pair rows16(const qjob *j, int64_t n0) {
  const int64_t gbb = group_block_bytes(j->fmt);
  row_pair p = {j->w + n0 / 8 * j->row_bytes, no_group, gbb, 0, prefetch_ahead(j->M)};
  if (n0 + 8 < j->N) p.g1 = p.g0 + j->row_bytes, p.s1 = gbb;
  return p;
}

/* 32 bytes at a, then 32 at b */
static inline __m512i join256(const uint8_t *a, const uint8_t *b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                            _mm256_loadu_si256((const __m256i *)b), 1);
}

/* 8 f16 at a, then 8 at b, as 16 floats */
static inline __m512 f16x16(const uint8_t *a, const uint8_t *b) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                 _mm_loadu_si128((const __m128i *)b), 1));
}

/* Block b of the 16 rows: their scales dw, offsets mw (Q4), and value chunks v[8], chunk c
 * holding 4 values of each row as a dot-product operand: Q4 c < 4 values 4c..4c+3 (low
 * nibbles), c >= 4 values 16+4(c-4).. (high nibbles); Q8_0 values 4c..4c+3. */
static inline __attribute__((always_inline)) void block16(const row_pair *p, int64_t b, const int fmt, __m512 *dw,
                                                          __m512 *mw, __m512i v[8]) {
  const uint8_t *a = p->g0 + b * p->s0, *c1 = p->g1 + b * p->s1;
  const int head = group_head_bytes(fmt);
  /* each group's rows are contiguous: fetch ahead in both, every line of the block */
  for (int c = 0; c < group_block_bytes(fmt); c += 64) {
    _mm_prefetch((const char *)a + p->ahead + c, _MM_HINT_T1);
    _mm_prefetch((const char *)c1 + p->ahead + c, _MM_HINT_T1);
  }
  *dw = f16x16(a, c1);
  *mw = fmt == FMT_Q4_1 ? f16x16(a + 16, c1 + 16) : _mm512_mul_ps(*dw, _mm512_set1_ps(-8.0f));
  if (fmt == FMT_Q8_0) {
    for (int c = 0; c < 8; c++) v[c] = join256(a + head + 32 * c, c1 + head + 32 * c);
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; c++) {
    const __m512i t = join256(a + head + 32 * c, c1 + head + 32 * c);
    v[c] = _mm512_and_si512(t, low4);
    v[4 + c] = _mm512_and_si512(_mm512_srli_epi16(t, 4), low4);
  }
}

/* Activation bytes at p[0..3] in every lane */
static inline __m512i bcast4x16(const uint8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

/* The epilogue of one block for one output row (see the top of the file): 16 outputs. sd, ss:
 * the block's scales at the row group's first row (scales_at), r: the row's place after it. */
static inline __attribute__((always_inline)) __m512 fold_block(__m512 acc, __m512 dw, __m512 mw, __m512i isum,
                                                               const float *sd, const float *ss, int r,
                                                               const int fmt) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(sd[r])), _mm512_cvtepi32_ps(isum), acc);
  if (fmt != FMT_Q8_0) acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(ss[r]), acc);
  return acc;
}

static inline void store_rows16(const qjob *j, int64_t m, int64_t n0, int nr, __m512 v) {
  float *o = j->out + m * j->out_stride + n0;
  if (nr == 16) _mm512_storeu_ps(o, v);
  else _mm512_mask_storeu_ps(o, (__mmask16)((1u << nr) - 1), v);
}

/* ---- VNNI: activation rows m0 .. m0+mr-1 share each unpacked block ---- */

#define MR_VNNI 8

static inline __attribute__((always_inline)) void vnni_rows(const qjob *j, const row_pair *p, int64_t n0, int nr,
                                                            int64_t m0, const int mr, const int fmt) {
  __m512 acc[MR_VNNI];
  for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
  /* block b's row m0 + r: activations at xv + 32 (vg b + r), scales at sd[vg b + r], ss[vg b + r],
   * Q8_0's product start at xsw[at + vg b + r] */
  const int64_t at = vg_at(j, m0, 0), vg = j->vg;
  const uint8_t *xv = j->xv + at * QK;
  const float *sd = j->xdt + at, *ss = j->xst + at;
  for (int64_t b = 0; b < j->nb; b++, xv += vg * QK, sd += vg, ss += vg) {
    __m512 dw, mw;
    __m512i v[8];
    block16(p, b, fmt, &dw, &mw, v);
    if (fmt == FMT_Q8_0) /* + 128: unsigned bytes (qjob.xsw) */
      for (int c = 0; c < 8; c++) v[c] = _mm512_xor_si512(v[c], _mm512_set1_epi8((char)0x80));
    /* value chunk by chunk across the rows: the rows' product chains interleave in program
     * order, so each dpbusd's latency hides behind the other rows'. 576 x 1536 Q4_1 from cache,
     * one thread, AMD EPYC (Zen 4: AVX-512 VNNI, no AMX): 0.89-0.94x the time of row by row at
     * 2-16 rows. Q8_0's chains start from the rows' -128 sum(q) (see the top of the file). */
    __m512i s[MR_VNNI];
    for (int r = 0; r < mr; r++) {
      const __m512i start = fmt == FMT_Q8_0 ? _mm512_set1_epi32(j->xsw[at + b * vg + r]) : _mm512_setzero_si512();
      s[r] = _mm512_dpbusd_epi32(start, v[0], bcast4x16(xv + QK * r));
    }
    for (int c = 1; c < 8; c++) /* chunk c's values: Q8_0 4c.., Q4 as block16 unpacks them */
      for (int r = 0; r < mr; r++)
        s[r] = _mm512_dpbusd_epi32(s[r], v[c],
                                   bcast4x16(xv + QK * r + (fmt == FMT_Q8_0 || c < 4 ? 4 * c : 16 + 4 * (c - 4))));
    for (int r = 0; r < mr; r++) acc[r] = fold_block(acc[r], dw, mw, s[r], sd, ss, r, fmt);
  }
  for (int r = 0; r < mr; r++) store_rows16(j, m0 + r, n0, nr, acc[r]);
}

static inline __attribute__((always_inline)) void vnni_chunk_fmt(const qjob *j, int64_t n0, int64_t n1,
                                                                 const int fmt) {
  for (int64_t n = n0; n < n1; n += 16) {
    const row_pair p = rows16(j, n);
    const int nr = n1 - n < 16 ? (int)(n1 - n) : 16;
    for (int64_t m0 = 0; m0 < j->M; m0 += MR_VNNI) {
      switch (j->M - m0 < MR_VNNI ? (int)(j->M - m0) : MR_VNNI) {
#define ROWS(R) case R: vnni_rows(j, &p, n, nr, m0, R, fmt); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        default: break;
      }
    }
  }
}

/* ---- AMX: tiles of 16 activation rows x 32 values (one block) times 32 values x 16 weight
 * rows; the weight tiles of a chunk are unpacked once into a per-thread buffer and serve every
 * 16 activation rows ---- */

#if QUANT_AMX

/* tile numbers: the intrinsics take them as literal immediates */
#define TILE_C0 0
#define TILE_C1 1
#define TILE_A0 2
#define TILE_A1 3
#define TILE_B0 4
#define TILE_B1 5
#define B_TILE_BYTES 512 /* 8 rows of 64 bytes: 32 values of 16 weight rows */

/* One block's tile multiply: activations at xa (row stride K) times the B tile at bt, the int32
 * sums stored at c (rows of 16); A, B, C: literal tile numbers */
#define TILE_BLOCK(A, B, C, xa, K, bt, c, fmt)  \
  do {                                          \
    _tile_loadd(A, xa, K);                      \
    _tile_loadd(B, bt, 64);                     \
    _tile_zero(C);                              \
    if ((fmt) == FMT_Q8_0) _tile_dpbssd(C, A, B); \
    else _tile_dpbsud(C, A, B);                 \
    _tile_stored(C, c, 64);                     \
  } while (0)

__thread int quant_tile_shape;

void quant_amx_begin(int rows) {
  amx_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = TILE_C0; t <= TILE_C1; t++) cfg.rows[t] = rows, cfg.colsb[t] = 64; /* int32 [rows x 16] */
  for (int t = TILE_A0; t <= TILE_A1; t++) cfg.rows[t] = rows, cfg.colsb[t] = 32; /* int8 [rows x 32] */
  for (int t = TILE_B0; t <= TILE_B1; t++) cfg.rows[t] = 8, cfg.colsb[t] = 64;  /* [8 x 16 x 4] */
  /* not _tile_loadconfig: GCC's macro declares that it reads 8 bytes, and the compiler then
   * drops the stores of the rest of the configuration */
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  quant_tile_shape = -1;
}

void quant_amx_end(void) {
  _tile_release();
  quant_tile_shape = 0;
}

static __thread scratch_buf amx_weights; /* a chunk's B tiles, dw [nb][16] and mw [nb][16] */

#define AMX_BLOCKS 8 /* blocks multiplied before their fold: the folds read tiles stored long before */

/* Activation rows m0 .. m0+15 against the chunk's unpacked tiles: mt rows folded (the rows
 * there are, rounded up to 4), `stored` rows written. Per AMX_BLOCKS blocks, the tile
 * multiplies store their int32 sums, then the folds read them. */
static inline __attribute__((always_inline)) void amx_rows(const qjob *j, const uint8_t *bt, const float *dws,
                                                           const float *mws, int64_t n0, int nr, int64_t m0,
                                                           int stored, const int mt, const int fmt) {
  __m512 acc[16];
  int32_t c[AMX_BLOCKS][256] __attribute__((aligned(64)));
  /* loops over acc unrolled to the constant mt (as amx_one_tile's) */
#pragma GCC unroll 16
  for (int r = 0; r < mt; r++) acc[r] = _mm512_setzero_ps();
  const int8_t *xa = j->xq + m0 * j->K;
  const int64_t nb = j->nb;
  for (int64_t b0 = 0; b0 < nb; b0 += AMX_BLOCKS) {
    const int n = nb - b0 < AMX_BLOCKS ? (int)(nb - b0) : AMX_BLOCKS;
    for (int i = 0; i < n; i++) { /* two sets of tiles alternate */
      const int64_t b = b0 + i;
      if (i & 1) TILE_BLOCK(TILE_A1, TILE_B1, TILE_C1, xa + b * QK, j->K, bt + b * B_TILE_BYTES, c[i], fmt);
      else TILE_BLOCK(TILE_A0, TILE_B0, TILE_C0, xa + b * QK, j->K, bt + b * B_TILE_BYTES, c[i], fmt);
    }
    for (int i = 0; i < n; i++) {
      const int64_t b = b0 + i;
      const __m512 d = _mm512_load_ps(dws + 16 * b), m = _mm512_load_ps(mws + 16 * b);
      const int64_t at = scales_at(j->nb, m0, b); /* rows m0 .. m0 + 15 from here */
      const float *sd = j->xdt + at, *ss = j->xst + at;
#pragma GCC unroll 16
      for (int r = 0; r < mt; r++)
        acc[r] = fold_block(acc[r], d, m, _mm512_load_si512((const __m512i *)(c[i] + 16 * r)), sd, ss, r, fmt);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < mt; r++)
    if (r < stored) store_rows16(j, m0 + r, n0, nr, acc[r]);
}

/* The one-tile case (M <= 16: decode with drafts, verification). Three stages run in one loop,
 * each on a block a few blocks behind the one before: the unpack into a B tile (vector units),
 * the tile multiply (the tile unit; two sets of tiles alternate), the fold (vector units). A
 * tile load right after the vector stores of its bytes, or a fold right after the tile store,
 * would wait for those stores to reach the cache; apart, the three overlap. */
#define TILE_LAG 2 /* blocks between a block's unpack and its tile multiply */
#define FOLD_LAG 2 /* blocks between a block's tile multiply and its fold */
#define SLOTS 8    /* > TILE_LAG + FOLD_LAG: a slot is rewritten only after its fold */

static inline __attribute__((always_inline)) void amx_one_tile(const qjob *j, const row_pair *p, int64_t n0,
                                                               int nr, const int mt, const int fmt) {
  __m512 acc[16];
  uint8_t bt[SLOTS][B_TILE_BYTES] __attribute__((aligned(64)));
  int32_t c[SLOTS][256] __attribute__((aligned(64)));
  float dws[SLOTS][16] __attribute__((aligned(64))), mws[SLOTS][16] __attribute__((aligned(64)));
  /* every loop over acc runs to mt (here M, a constant of this instantiation) and is unrolled:
   * an index known only at run time would keep the accumulators in memory */
#pragma GCC unroll 16
  for (int r = 0; r < mt; r++) acc[r] = _mm512_setzero_ps();
  const int64_t nb = j->nb;
  for (int64_t b = 0; b < nb + TILE_LAG + FOLD_LAG; b++) {
    if (b < nb) {
      const int s = (int)(b % SLOTS);
      __m512 dw, mw;
      __m512i v[8];
      block16(p, b, fmt, &dw, &mw, v);
      for (int i = 0; i < 8; i++) _mm512_store_si512((__m512i *)(bt[s] + 64 * i), v[i]);
      _mm512_store_ps(dws[s], dw);
      _mm512_store_ps(mws[s], mw);
    }
    const int64_t t = b - TILE_LAG;
    if (t >= 0 && t < nb) {
      const int s = (int)(t % SLOTS);
      if (t & 1) TILE_BLOCK(TILE_A1, TILE_B1, TILE_C1, j->xq + t * QK, j->K, bt[s], c[s], fmt);
      else TILE_BLOCK(TILE_A0, TILE_B0, TILE_C0, j->xq + t * QK, j->K, bt[s], c[s], fmt);
    }
    const int64_t f = t - FOLD_LAG;
    if (f >= 0) {
      const int s = (int)(f % SLOTS);
      const __m512 d = _mm512_load_ps(dws[s]), m = _mm512_load_ps(mws[s]);
      const int64_t at = scales_at(j->nb, 0, f);
      const float *sd = j->xdt + at, *ss = j->xst + at;
#pragma GCC unroll 16
      for (int r = 0; r < mt; r++)
        acc[r] = fold_block(acc[r], d, m, _mm512_load_si512((const __m512i *)(c[s] + 16 * r)), sd, ss, r, fmt);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < mt; r++) store_rows16(j, r, n0, nr, acc[r]);
}

static inline __attribute__((always_inline)) void amx_chunk_fmt(const qjob *j, int64_t n0, int64_t n1,
                                                                const int fmt) {
  if (j->M <= 16) {
    for (int64_t n = n0; n < n1; n += 16) {
      const row_pair p = rows16(j, n);
      const int nr = n1 - n < 16 ? (int)(n1 - n) : 16;
      switch (j->M) { /* the tile's rows: M; fewer than 5 never come here (call_isa), VNNI runs them */
#define ROWS(R) case R: amx_one_tile(j, &p, n, nr, R, fmt); break;
        ROWS(5) ROWS(6) ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
        default: vnni_chunk_fmt(j, n, n + nr, fmt); break;
      }
    }
    return;
  }
  const int64_t nb = j->nb;
  uint8_t *bt = scratch_get(&amx_weights, (size_t)nb * (B_TILE_BYTES + 2 * 64));
  if (!bt) { /* out of memory for 25 KB: the VNNI path needs no buffer */
    vnni_chunk_fmt(j, n0, n1, fmt);
    return;
  }
  float *dws = (float *)(bt + nb * B_TILE_BYTES), *mws = dws + 16 * nb;
  for (int64_t n = n0; n < n1; n += 16) {
    const row_pair p = rows16(j, n);
    for (int64_t b = 0; b < nb; b++) {
      __m512 dw, mw;
      __m512i v[8];
      block16(&p, b, fmt, &dw, &mw, v);
      for (int c = 0; c < 8; c++) _mm512_store_si512((__m512i *)(bt + b * B_TILE_BYTES + 64 * c), v[c]);
      _mm512_store_ps(dws + 16 * b, dw);
      _mm512_store_ps(mws + 16 * b, mw);
    }
    const int nr = n1 - n < 16 ? (int)(n1 - n) : 16;
    for (int64_t m0 = 0; m0 < j->M; m0 += 16) {
      /* the tile multiply reads 16 rows (the activations are padded to 16 rows); the fold runs
       * on the rows there are, rounded up to 4, and the rows there are are stored */
      const int rows = j->M - m0 < 16 ? (int)(j->M - m0) : 16;
      switch ((rows + 3) / 4) {
#define ROWS(Q) case Q: amx_rows(j, bt, dws, mws, n, nr, m0, rows, 4 * Q, fmt); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#undef ROWS
        default: break;
      }
    }
  }
}

#endif /* QUANT_AMX */

void quant_rows16_chunk(const qjob *j, int64_t n0, int64_t n1) {
#if QUANT_AMX
  if (j->isa == QUANT_ISA_AMX) {
    switch (j->fmt) {
      case FMT_Q4_0: amx_chunk_fmt(j, n0, n1, FMT_Q4_0); return;
      case FMT_Q4_1: amx_chunk_fmt(j, n0, n1, FMT_Q4_1); return;
      default: amx_chunk_fmt(j, n0, n1, FMT_Q8_0); return;
    }
  }
#endif
  switch (j->fmt) {
    case FMT_Q4_0: vnni_chunk_fmt(j, n0, n1, FMT_Q4_0); return;
    case FMT_Q4_1: vnni_chunk_fmt(j, n0, n1, FMT_Q4_1); return;
    default: vnni_chunk_fmt(j, n0, n1, FMT_Q8_0); return;
  }
}

#endif /* QUANT_AVX512 */
