/* A stack of Llama decoder layers on GGUF-quantized weights with fp32 activations, all layers in
 * one call (agentrt/engine/models/quant_forward.py): the PyTorch forward of a quantized model
 * spends two thirds of a decode step in ~400 small ops (norms, rotary, attention's gathers,
 * residual adds), which here are a few loops between the linears.
 *
 * Per layer, for the T tokens of a ragged batch (h [T, hidden] updated in place):
 *
 *   x    = rms_norm(h, attn_norm)                  x * (1 / sqrt(mean(x^2) + eps)), then * w
 *   qkv  = quant_linear(x, Wqkv) (+ bias)          cpu_quant_avx2.c, int8 activation blocks
 *   q, k = rotate_half(q, k) by positions          x*cos + rot(x)*sin, cos/sin [P, d/2]
 *   K/V of every token -> cache row slots[t]       caches [num_slots, nkv, d] fp32
 *   attn = softmax(q . K[0..p] * scale) . V[0..p]  per query, its own sequence's positions 0..p
 *   h   += quant_linear(attn, Wo)
 *   x    = rms_norm(h, mlp_norm)
 *   h   += quant_linear(silu(gate) * up, Wdown),   [gate | up] = quant_linear(x, Wgate_up)
 *
 * and the later families' features, each a layer field (0: absent): QK-norm (q_norm, k_norm:
 * RMSNorm over each head's q and k before rotary: Qwen3, Gemma 3), post-norms of the attention and
 * MLP outputs before their residual adds (Gemma 3), GeGLU (gelu_tanh(gate) * up), the layer's own
 * rotary tables (Gemma 3's sliding layers) and a sliding window (a query at p sees positions
 * max(0, p - window + 1) .. p). Gemma's (1 + w) norm weights come as such (the model keeps them so).
 *
 * then the final norm of the requested rows into `out`. The elementwise ops are the PyTorch
 * path's, op for op (rotary and the norm's scaling bit for bit under -ffp-contract=off); only the
 * sums (mean of squares, q.k, softmax's denominator, p.v) and exp() round differently.
 *
 * Batch invariance: a query's attention is cut into chunks of its positions fixed by the position
 * alone, each computed with the same vector lanes and folded in order whichever task runs them
 * (see chunk_partial); the per-token ops touch one token's row; the linears compute each row
 * alone. So a token's bits depend neither on the other tokens nor on the thread count, and
 * speculation (k+1 verify rows) cannot change greedy output.
 *
 * layers: num_layers rows of LAYER_FIELDS int64:
 *   wqkv, fmt_qkv, bqkv (0: none), wo, fmt_o, wgate_up, fmt_gate_up, wdown, fmt_down,
 *   attn_norm, mlp_norm, k_cache, v_cache, q_norm, k_norm, attn_out_norm, mlp_out_norm, cos, sin
 *   (the layer's rotary tables, 0: the model's), window (0: none), gelu (1: GeGLU, 0: SwiGLU),
 *   qkv_rows (rows of wqkv; 0: all), wqkv2, fmt_qkv2, qkv2_rows, wqkv3, fmt_qkv3, qkv3_rows: q, k and
 *   v in up to three row blocks of their own formats (GGUF mixes them: q, k Q5_0 and v Q8_0).
 */
#include <stdlib.h>

#include "cpu_quant.h"

#define LAYER_FIELDS 28
#define SERIAL_TOKENS 32        /* per-token phases on fewer tokens: cheaper than a join (~5 us) */
#define SERIAL_ATTN_MACS 32768  /* attention with less work runs on the caller, for the same reason */
#define ATTN_CHUNK 64           /* positions per attention chunk (a multiple of 8) */
#define MAX_SPLIT_CHUNKS 4096   /* attention split into chunk tasks keeps this many partials at most */
#define PTR(type, v) ((type)(intptr_t)(v))

enum { PH_NORM, PH_ROTARY, PH_RESIDUAL, PH_SILU, PH_MERGE };

typedef struct {
  int64_t T, hidden, inter, qkv_w, q_w;
  int nq, nkv, d, g;
  float eps, scale;
  const int64_t *positions, *slots, *seq, *block_tables;
  int64_t bt_stride, block_size;
  /* token trees (NULL: none): a token's keys at positions >= tree_base[t] are the cache rows
   * path_slots[t * path_stride + (j - tree_base[t])], its ancestors' and its own, in depth order */
  const int64_t *tree_base, *path_slots;
  int64_t path_stride;
  const float *cos, *sin;
  /* the layer being run; norm: the RMSNorm weight PH_NORM / PH_RESIDUAL apply (NULL: none);
   * post_norm: PH_RESIDUAL's norm of the sublayer output before the add (NULL: none) */
  const float *bqkv, *norm, *post_norm, *q_norm, *k_norm;
  int64_t window; /* a query at p sees positions p - window + 1 .. p (0: all) */
  int gelu;
  float *kc, *vc;
  float *h, *x, *qkv, *attn, *gu, *tmp;
  float *work;      /* per thread: WORK_FLOATS(nq, d) floats for one token's attention */
  float *parts;     /* split attention: chunk task i's partials at parts + i * nq * PART_STRIDE(d) */
  int64_t *cu_chunks; /* split attention: token t's chunk tasks are cu_chunks[t] .. cu_chunks[t+1]-1 */
  int phase;
  pool_chunks chunks;
} dec;

/* ---- vector helpers: AVX2, and the scalar path computing the same values in order ---- */

#if QUANT_AVX2

/* e^x, ~1 ulp (Cephes' polynomial on x - n ln2, |x - n ln2| <= ln2/2). 2^n is applied in two
 * halves so that n = 128 (x up to 88.72) stays finite; x < -87.5 gives 0 (the true value is
 * below FLT_MIN: nothing a softmax or SiLU can tell from 0). NaN stays NaN (min/max return
 * their second operand on NaN). */
static inline __m256 exp8(__m256 x) {
  const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-88.0f), _mm256_min_ps(_mm256_set1_ps(88.75f), x));
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
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.5f), _CMP_LT_OQ), y);
}

/* sum_i a[i] b[i]: 8 lanes (lane l sums i = l mod 8, in order), then the lanes, then the tail */
static inline float dotf(const float *a, const float *b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

static float max_row(const float *s, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float r = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  for (; j < n; j++) r = fmaxf(r, s[j]);
  return r;
}

/* s[j] = e^(s[j] - m) for j < n; returns their sum (lane sums in order, then the lanes) */
static float exp_shift(float *s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (j < n) {
    const __m256i k = lanes_below(n - j);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, k), mv)), _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(s + j, k, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum8(acc);
}

/* g[i] = g[i] / (1 + e^-g[i]) * u[i], torch's silu(gate) * up */
static void silu_mul(float *g, const float *u, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg))));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
  }
  if (i < n) {
    const __m256i k = lanes_below(n - i);
    const __m256 x = _mm256_maskload_ps(g + i, k);
    const __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, neg))));
    _mm256_maskstore_ps(g + i, k, _mm256_mul_ps(y, _mm256_maskload_ps(u + i, k)));
  }
}

/* gelu_tanh(x) = x / (1 + e^(-2y)), y = sqrt(2/pi) (x + 0.044715 x^3): 0.5 x (1 + tanh(y)) written
 * with exp8 */
static inline __m256 gelu8(__m256 x) {
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f), /* -2 sqrt(2/pi) */
                                 _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f),
                                                                _mm256_mul_ps(x, _mm256_mul_ps(x, x)))));
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(y)));
}

/* g[i] = gelu_tanh(g[i]) * u[i], torch's gelu(gate, approximate="tanh") * up */
static void gelu_mul(float *g, const float *u, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(g + i, _mm256_mul_ps(gelu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
  if (i < n) {
    const __m256i k = lanes_below(n - i);
    _mm256_maskstore_ps(g + i, k, _mm256_mul_ps(gelu8(_mm256_maskload_ps(g + i, k)), _mm256_maskload_ps(u + i, k)));
  }
}

/* out[c] = sum_j p[j] V_j[c] for c < 8 nv, the positions j in order (V_j = V + off[j]) */
static inline __attribute__((always_inline)) void pv_cols(const float *p, int64_t L, const float *V,
                                                          const int64_t *off, float *out, const int nv) {
  __m256 acc[8];
  for (int v = 0; v < nv; v++) acc[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < L; j++) {
    const __m256 e = _mm256_set1_ps(p[j]);
    const float *vr = V + off[j];
    for (int v = 0; v < nv; v++) acc[v] = _mm256_fmadd_ps(e, _mm256_loadu_ps(vr + 8 * v), acc[v]);
  }
  for (int v = 0; v < nv; v++) _mm256_storeu_ps(out + 8 * v, acc[v]);
}

static void pv(const float *p, int64_t L, const float *V, const int64_t *off, float *out, int d) {
  for (int c0 = 0; c0 < d; c0 += 64) { /* d % 8 == 0 (checked): up to 8 accumulators in registers */
    switch ((d - c0) / 8 < 8 ? (d - c0) / 8 : 8) {
#define PV(NV) case NV: pv_cols(p, L, V + c0, off, out + c0, NV); break;
      PV(1) PV(2) PV(3) PV(4) PV(5) PV(6) PV(7) default: pv_cols(p, L, V + c0, off, out + c0, 8);
#undef PV
    }
  }
}

#else /* scalar */

static inline float dotf(const float *a, const float *b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

static float max_row(const float *s, int64_t n) {
  float r = -INFINITY;
  for (int64_t j = 0; j < n; j++) r = fmaxf(r, s[j]);
  return r;
}

static float exp_shift(float *s, int64_t n, float m) {
  float sum = 0.0f;
  for (int64_t j = 0; j < n; j++) sum += s[j] = expf(s[j] - m);
  return sum;
}

static void silu_mul(float *g, const float *u, int64_t n) {
  for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void gelu_mul(float *g, const float *u, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float x = g[i], y = -1.5957691216057308f * (x + 0.044715f * (x * (x * x)));
    g[i] = x / (1.0f + expf(y)) * u[i];
  }
}

static void pv(const float *p, int64_t L, const float *V, const int64_t *off, float *out, int d) {
  for (int c = 0; c < d; c++) out[c] = 0.0f;
  for (int64_t j = 0; j < L; j++)
    for (int c = 0; c < d; c++) out[c] += p[j] * V[off[j] + c];
}

#endif

/* out = w * (x * (1 / sqrt(mean(x^2) + eps))), as the model's rms_norm with fp32 x */
static void rms_row(const float *x, const float *w, int64_t n, float eps, float *out) {
  const float r = 1.0f / sqrtf(dotf(x, x, n) / (float)n + eps);
  for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* rotate_half on `heads` heads of d values: (a, b) -> (a c - b s, b c + a s) */
static void rotary(float *x, int heads, int d, const float *cos, const float *sin) {
  const int half = d / 2;
  for (int h = 0; h < heads; h++, x += d)
    for (int i = 0; i < half; i++) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = b * cos[i] + a * sin[i];
    }
}

static void merge_chunks(const dec *D, int64_t t);

static void token_phase(const dec *D, int64_t t) {
  switch (D->phase) {
    case PH_NORM:
      rms_row(D->h + t * D->hidden, D->norm, D->hidden, D->eps, D->x + t * D->hidden);
      break;
    case PH_ROTARY: {
      float *row = D->qkv + t * D->qkv_w;
      if (D->bqkv)
        for (int64_t i = 0; i < D->qkv_w; i++) row[i] += D->bqkv[i];
      if (D->q_norm) /* QK-norm: each head's q and k (in place: rms_row reads x before writing) */
        for (int h = 0; h < D->nq + D->nkv; h++)
          rms_row(row + (int64_t)h * D->d, h < D->nq ? D->q_norm : D->k_norm, D->d, D->eps, row + (int64_t)h * D->d);
      const int64_t half = D->d / 2, kv_row = (int64_t)D->nkv * D->d;
      rotary(row, D->nq + D->nkv, D->d, D->cos + D->positions[t] * half, D->sin + D->positions[t] * half);
      memcpy(D->kc + D->slots[t] * kv_row, row + D->q_w, sizeof(float) * (size_t)kv_row);
      memcpy(D->vc + D->slots[t] * kv_row, row + D->q_w + kv_row, sizeof(float) * (size_t)kv_row);
      break;
    }
    case PH_RESIDUAL: {
      float *hr = D->h + t * D->hidden, *y = D->tmp + t * D->hidden;
      if (D->post_norm) rms_row(y, D->post_norm, D->hidden, D->eps, y);
      for (int64_t i = 0; i < D->hidden; i++) hr[i] = hr[i] + y[i];
      if (D->norm) rms_row(hr, D->norm, D->hidden, D->eps, D->x + t * D->hidden);
      break;
    }
    case PH_SILU: {
      float *g = D->gu + t * 2 * D->inter;
      (D->gelu ? gelu_mul : silu_mul)(g, g + D->inter, D->inter);
      break;
    }
    default:
      merge_chunks(D, t);
  }
}

static void tokens_job(void *ctx, int tid, int nt) {
  (void)nt;
  dec *D = ctx;
  for (int64_t t; (t = pool_claim(&D->chunks, tid)) >= 0;) token_phase(D, t);
}

static void run_tokens(dec *D, int phase, int threads) {
  D->phase = phase;
  if (D->T < SERIAL_TOKENS || threads <= 1) {
    for (int64_t t = 0; t < D->T; t++) token_phase(D, t);
    return;
  }
  const int nt = threads > D->T ? (int)D->T : threads;
  pool_chunks_init(&D->chunks, D->T, nt);
  pool_run(tokens_job, D, nt);
}

/* s[j] = scale * (q . K_j) for j < n, K_j = K + off[j] (off: n rounded up to 8 entries). Eight
 * positions at a time: lane l of acc[r] sums q[c] K_j+r[c] over c = l mod 8, then one transposing
 * reduction gives the eight dots as one vector, each summed in the same order
 * ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) whichever slot it had, so the padding entries (repeats of
 * a real row, their dots dropped) change nothing. */
static void scores(const float *q, const float *K, const int64_t *off, int64_t n, float scale, float *s, int d) {
#if QUANT_AVX2
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const float *row[8];
    for (int r = 0; r < 8; r++) row[r] = K + off[j0 + r];
    __m256 acc[8];
    for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
    for (int c = 0; c < d; c += 8) {
      const __m256 qv = _mm256_loadu_ps(q + c);
      for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(row[r] + c), acc[r]);
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
#else
  for (int64_t j = 0; j < n; j++) s[j] = dotf(q, K + off[j], d) * scale;
#endif
}

static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

/* Attention in chunks of ATTN_CHUNK positions. Chunk c of a token covers its positions
 * c*ATTN_CHUNK .. up to p; its partial for query head h is, over the chunk's positions j,
 *   m = max_j s_j,   s = sum_j e^(s_j - m),   acc = sum_j e^(s_j - m) V_j       (s_j = scale q.K_j)
 * and a token's chunks are folded in order, (m, s, acc) (+) (m', s', acc') =
 *   (M, s e^(m - M) + s' e^(m' - M), acc e^(m - M) + acc' e^(m' - M)),  M = max(m, m'),
 * then out = acc * (1 / s). The chunks depend on the position only, so whether one task runs a
 * token's chunks in turn (many tokens) or each chunk is a task of its own and a merge folds them
 * (few tokens, long contexts: both threads read the cache), the bits are the same. A chunk reads
 * whole cache rows (every kv head's d values, side by side) for all its query heads. One decode
 * token's attention over 1000 positions takes ~70 us a layer on the 2-core EPYC (SmolLM2, caches
 * cold after the layer's weights went past), near the time to read its 1.5 MB of K and V. */
#define PART_STRIDE(d) ((d) + 8)        /* a partial: acc[d], m, s, padding */
#define WORK_FLOATS(nq, d) (2 * (int64_t)(nq) * PART_STRIDE(d) + (int64_t)(nq) * ATTN_CHUNK + 2 * ATTN_CHUNK)

static int64_t num_chunks(int64_t position) { return position / ATTN_CHUNK + 1; }

/* The first position token t's query sees in the layer being run (its window's, else 0); its
 * chunks before first_key / ATTN_CHUNK are empty: no task computes or folds them. */
static int64_t first_key(const dec *D, int64_t t) {
  return D->window && D->positions[t] >= D->window ? D->positions[t] - D->window + 1 : 0;
}

/* Token t's chunk c into part [nq][PART_STRIDE]; work: ATTN_CHUNK int64 row offsets, then
 * nq * ATTN_CHUNK floats of scores. */
static void chunk_partial(const dec *D, int64_t t, int64_t c, float *part, float *work) {
  const int d = D->d;
  /* the chunk's positions from its start (or the window's first position) up to p */
  const int64_t L = D->positions[t] + 1, lo = first_key(D, t), j0 = c * ATTN_CHUNK > lo ? c * ATTN_CHUNK : lo;
  const int64_t n = L - c * ATTN_CHUNK < ATTN_CHUNK ? L - j0 : (c + 1) * ATTN_CHUNK - j0;
  const int64_t bs = D->block_size, stride = (int64_t)D->nkv * d;
  const int64_t *bt = D->block_tables + D->seq[t] * D->bt_stride;
  const int64_t tb = D->tree_base ? D->tree_base[t] : L, *path = D->tree_base ? D->path_slots + t * D->path_stride : NULL;
  int64_t *off = (int64_t *)work;
  float *sc = work + 2 * ATTN_CHUNK;
  for (int64_t j = 0, b = j0 / bs, jj = j0 % bs; j < ATTN_CHUNK; j++) {
    /* a tree node's keys past the tree's base are its path's rows: the chain's keys, in order */
    off[j] = j >= n ? off[n - 1] : j0 + j >= tb ? path[j0 + j - tb] * stride : (bt[b] * bs + jj) * stride;
    if (++jj == bs) jj = 0, b++;
  }
  const float *q = D->qkv + t * D->qkv_w;
  for (int h = 0; h < D->nq; h++) {
    const int64_t kv = (int64_t)(h / D->g) * d;
    float *s = sc + (int64_t)h * ATTN_CHUNK, *ph = part + (int64_t)h * PART_STRIDE(d);
    scores(q + (int64_t)h * d, D->kc + kv, off, n, D->scale, s, d);
    const float m = max_row(s, n), sum = exp_shift(s, n, m);
    pv(s, n, D->vc + kv, off, ph, d);
    ph[d] = m;
    ph[d + 1] = sum;
  }
}

/* run (+)= part, per query head (the fold above) */
static void fold(float *run, const float *part, int nq, int d) {
  for (int h = 0; h < nq; h++, run += PART_STRIDE(d), part += PART_STRIDE(d)) {
    const float m = fmaxf(run[d], part[d]), a = expf(run[d] - m), b = expf(part[d] - m);
    for (int c = 0; c < d + 2; c++) run[c] = run[c] * a + part[c] * b; /* acc and s */
    run[d] = m;
  }
}

static void finish(const float *run, int nq, int d, float *out) {
  for (int h = 0; h < nq; h++, run += PART_STRIDE(d), out += d) {
    const float inv = 1.0f / run[d + 1];
    for (int c = 0; c < d; c++) out[c] = run[c] * inv;
  }
}

/* Token t's attention in one task: its chunks in turn. */
static void attend(const dec *D, int64_t t, float *work) {
  const int64_t ps = (int64_t)D->nq * PART_STRIDE(D->d), nc = num_chunks(D->positions[t]);
  const int64_t c0 = first_key(D, t) / ATTN_CHUNK;
  float *run = work, *part = work + ps, *scratch = work + 2 * ps;
  chunk_partial(D, t, c0, run, scratch);
  for (int64_t c = c0 + 1; c < nc; c++) {
    chunk_partial(D, t, c, part, scratch);
    fold(run, part, D->nq, D->d);
  }
  finish(run, D->nq, D->d, D->attn + t * D->q_w);
}

/* Token t's chunk partials (computed by chunks_job) folded in order, into its attention row. */
static void merge_chunks(const dec *D, int64_t t) {
  const int64_t ps = (int64_t)D->nq * PART_STRIDE(D->d);
  const int64_t i0 = D->cu_chunks[t] + first_key(D, t) / ATTN_CHUNK; /* the chunks in its window */
  float *run = D->parts + i0 * ps;
  for (int64_t i = i0 + 1; i < D->cu_chunks[t + 1]; i++) fold(run, D->parts + i * ps, D->nq, D->d);
  finish(run, D->nq, D->d, D->attn + t * D->q_w);
}

static void tokens_attention_job(void *ctx, int tid, int nt) {
  (void)nt;
  dec *D = ctx;
  float *work = D->work + (int64_t)tid * WORK_FLOATS(D->nq, D->d);
  for (int64_t t; (t = pool_claim(&D->chunks, tid)) >= 0;) attend(D, t, work);
}

static void chunks_job(void *ctx, int tid, int nt) {
  (void)nt;
  dec *D = ctx;
  float *work = D->work + (int64_t)tid * WORK_FLOATS(D->nq, D->d) + 2 * (int64_t)D->nq * PART_STRIDE(D->d);
  for (int64_t i, t = 0; (i = pool_claim(&D->chunks, tid)) >= 0;) {
    while (i >= D->cu_chunks[t + 1]) t++; /* a thread's claims ascend */
    while (i < D->cu_chunks[t]) t--;      /* except after taking over another's range */
    if (i - D->cu_chunks[t] >= first_key(D, t) / ATTN_CHUNK) /* outside the window: empty, never folded */
      chunk_partial(D, t, i - D->cu_chunks[t], D->parts + i * (int64_t)D->nq * PART_STRIDE(D->d), work);
  }
}

/* The caller's buffers for the layers' activations (the linears have their own). */
static __thread scratch_buf scratch;

/* Inputs the loops index by: positions in [0, rope_rows), slots in [0, num_slots), cu_q a
 * partition of 0..T, every block a token's context reaches inside the table and the cache,
 * rows in [0, T). Fills seq[t], token t's sequence. */
static int check_batch(int64_t T, const int64_t *positions, int64_t rope_rows, const int64_t *slots, int64_t num_slots,
                       int64_t B, const int64_t *cu_q, const int64_t *block_tables, int64_t bt_stride, int64_t bt_cols,
                       int64_t block_size, const int64_t *rows, int64_t n_rows, int64_t *seq) {
  if (B < 1 || cu_q[0] != 0 || cu_q[B] != T || block_size < 1) return -2;
  for (int64_t b = 0; b < B; b++) {
    if (cu_q[b + 1] < cu_q[b]) return -2;
    int64_t pmax = -1;
    for (int64_t t = cu_q[b]; t < cu_q[b + 1]; t++) {
      if (positions[t] < 0 || positions[t] >= rope_rows || slots[t] < 0 || slots[t] >= num_slots) return -2;
      pmax = positions[t] > pmax ? positions[t] : pmax;
      seq[t] = b;
    }
    if (pmax / block_size >= bt_cols) return -2;
    for (int64_t i = 0; i <= pmax / block_size; i++) {
      const int64_t blk = block_tables[b * bt_stride + i];
      if (blk < 0 || (blk + 1) * block_size > num_slots) return -2;
    }
  }
  for (int64_t i = 0; i < n_rows; i++)
    if (rows && (rows[i] < 0 || rows[i] >= T)) return -2;
  return 0;
}

/* Token trees: each path (positions tree_base[t]..p) fits its row of path_slots, inside the cache. */
static int check_tree(int64_t T, const int64_t *positions, const int64_t *tree_base, const int64_t *path_slots,
                      int64_t path_stride, int64_t num_slots) {
  if (!path_slots || path_stride < 0) return -2;
  for (int64_t t = 0; t < T; t++) {
    if (tree_base[t] > positions[t]) continue; /* no tree node: the table's keys */
    if (tree_base[t] < 0 || positions[t] - tree_base[t] >= path_stride) return -2;
    for (int64_t i = 0; i <= positions[t] - tree_base[t]; i++)
      if (path_slots[t * path_stride + i] < 0 || path_slots[t * path_stride + i] >= num_slots) return -2;
  }
  return 0;
}

/* h [T, hidden] fp32 in place through layers 0..num_layers-1, then out [n_rows, hidden] = the
 * final norm of rows `rows` of h (rows NULL: rows 0..n_rows-1; final_norm NULL: no output).
 * cos/sin [rope_rows, d/2]; caches [num_slots, nkv, d] fp32; block_tables [B, bt_cols] (row
 * stride bt_stride); tree_base [T] and path_slots [T, path_stride] (NULL: no token trees, see
 * dec.tree_base). Returns 0; -1 for a bad format or dimension; -2 for an index out of range
 * (nothing is written then); -3 when out of memory. */
int agentrt_quant_decoder(const int64_t *layers, int64_t num_layers, float *h, int64_t T, int64_t hidden,
                          int64_t inter, int nq, int nkv, int d, float eps, float scale, const int64_t *positions,
                          const float *cos, const float *sin, int64_t rope_rows, const int64_t *slots,
                          int64_t num_slots, int64_t B, const int64_t *cu_q, const int64_t *block_tables,
                          int64_t bt_stride, int64_t bt_cols, int64_t block_size, const float *final_norm,
                          const int64_t *rows, int64_t n_rows, float *out, int threads, const int64_t *tree_base,
                          const int64_t *path_slots, int64_t path_stride) {
  if (nq < 1 || nkv < 1 || nq % nkv || d < 2 || d % 2 || (QUANT_AVX2 && d % 8) || hidden < 1 || inter < 1) return -1;
  if (T <= 0) return 0;
  threads = threads < 1 ? 1 : threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : threads;
  dec D = {.T = T, .hidden = hidden, .inter = inter, .qkv_w = (int64_t)(nq + 2 * nkv) * d, .q_w = (int64_t)nq * d,
           .nq = nq, .nkv = nkv, .d = d, .g = nq / nkv, .eps = eps, .scale = scale, .positions = positions,
           .slots = slots, .block_tables = block_tables, .bt_stride = bt_stride, .block_size = block_size,
           .cos = cos, .sin = sin, .h = h, .tree_base = tree_base, .path_slots = path_slots,
           .path_stride = path_stride};
  int64_t macs = 0, n_chunks = 0;
  for (int64_t t = 0; t < T; t++) { /* sizes only: check_batch refuses positions out of range */
    const int64_t p = positions[t] < 0 ? 0 : positions[t] < rope_rows ? positions[t] : rope_rows - 1;
    macs += (p + 1) * D.q_w;
    n_chunks += num_chunks(p);
  }
  /* Attention's tasks: a token each, or with few tokens a chunk each (see chunk_partial) */
  const int serial_attn = macs < SERIAL_ATTN_MACS || threads == 1;
  const int split = !serial_attn && T < 4 * threads && n_chunks > T && n_chunks <= MAX_SPLIT_CHUNKS;
  const int64_t attn_tasks = split ? n_chunks : T;
  const int attn_nt = serial_attn ? 1 : (threads > attn_tasks ? (int)attn_tasks : threads);
  const int64_t n_x = up16(T * hidden), n_qkv = up16(T * D.qkv_w), n_attn = up16(T * D.q_w);
  const int64_t n_gu = up16(T * 2 * inter), n_work = up16(WORK_FLOATS(nq, d));
  const int64_t n_parts = split ? n_chunks * nq * PART_STRIDE(d) : 0, n_seq = up16(T + 1);
  /* floats, then two int64 arrays (seq, cu_chunks: two floats per entry) */
  float *buf = scratch_get(&scratch, sizeof(float) * (size_t)(2 * n_x + n_qkv + n_attn + n_gu + attn_nt * n_work +
                                                              n_parts + 4 * n_seq));
  if (!buf) return -3;
  D.x = buf;
  D.tmp = D.x + n_x;
  D.qkv = D.tmp + n_x;
  D.attn = D.qkv + n_qkv;
  D.gu = D.attn + n_attn;
  D.work = D.gu + n_gu;
  D.parts = D.work + attn_nt * n_work;
  int64_t *seq = (int64_t *)(D.parts + n_parts);
  D.seq = seq;
  D.cu_chunks = seq + n_seq;
  int rc = check_batch(T, positions, rope_rows, slots, num_slots, B, cu_q, block_tables, bt_stride, bt_cols,
                       block_size, rows, n_rows, seq);
  if (!rc && tree_base) rc = check_tree(T, positions, tree_base, path_slots, path_stride, num_slots);
  if (rc) return rc;
  D.cu_chunks[0] = 0;
  for (int64_t t = 0; t < T; t++) D.cu_chunks[t + 1] = D.cu_chunks[t] + num_chunks(positions[t]);
  for (int64_t li = 0; li < num_layers; li++) {
    const int64_t *L = layers + li * LAYER_FIELDS;
    D.bqkv = PTR(const float *, L[2]);
    D.kc = PTR(float *, L[11]);
    D.vc = PTR(float *, L[12]);
    D.q_norm = PTR(const float *, L[13]);
    D.k_norm = L[14] ? PTR(const float *, L[14]) : D.q_norm;
    D.cos = L[17] ? PTR(const float *, L[17]) : cos;
    D.sin = L[18] ? PTR(const float *, L[18]) : sin;
    D.window = L[19] > 0 ? L[19] : 0;
    D.gelu = L[20] != 0;
    if (li == 0) { /* later layers get their norm from the previous layer's last residual pass */
      D.norm = PTR(const float *, L[9]);
      run_tokens(&D, PH_NORM, threads);
    }
    const int64_t qkv_parts[3][3] = {{L[0], L[1], L[21] ? L[21] : D.qkv_w}, {L[22], L[23], L[24]}, {L[25], L[26], L[27]}};
    int64_t r0 = 0;
    for (int p = 0; p < 3 && qkv_parts[p][2] > 0 && !rc; r0 += qkv_parts[p++][2])
      rc = r0 + qkv_parts[p][2] > D.qkv_w ? -1
           : agentrt_quant_linear(D.x, hidden, T, PTR(const uint8_t *, qkv_parts[p][0]), (int)qkv_parts[p][1],
                                  qkv_parts[p][2], hidden, D.qkv + r0, D.qkv_w, threads);
    if (rc || r0 != D.qkv_w) return rc ? rc : -1;
    run_tokens(&D, PH_ROTARY, threads);
    pool_chunks_init(&D.chunks, attn_tasks, attn_nt);
    pool_run(split ? chunks_job : tokens_attention_job, &D, attn_nt);
    if (split) run_tokens(&D, PH_MERGE, threads);
    rc = agentrt_quant_linear(D.attn, D.q_w, T, PTR(const uint8_t *, L[3]), (int)L[4], hidden, D.q_w, D.tmp, hidden,
                              threads);
    if (rc) return rc;
    D.norm = PTR(const float *, L[10]);
    D.post_norm = PTR(const float *, L[15]);
    run_tokens(&D, PH_RESIDUAL, threads);
    rc = agentrt_quant_linear(D.x, hidden, T, PTR(const uint8_t *, L[5]), (int)L[6], 2 * inter, hidden, D.gu,
                              2 * inter, threads);
    if (rc) return rc;
    run_tokens(&D, PH_SILU, threads);
    rc = agentrt_quant_linear(D.gu, 2 * inter, T, PTR(const uint8_t *, L[7]), (int)L[8], hidden, inter, D.tmp, hidden,
                              threads);
    if (rc) return rc;
    D.norm = li + 1 < num_layers ? PTR(const float *, L[LAYER_FIELDS + 9]) : NULL;
    D.post_norm = PTR(const float *, L[16]);
    run_tokens(&D, PH_RESIDUAL, threads);
  }
  if (final_norm)
    for (int64_t i = 0; i < n_rows; i++)
      rms_row(h + (rows ? rows[i] : i) * hidden, final_norm, hidden, eps, out + i * hidden);
  return 0;
}

/* The fields of agentrt_quant_forward's model table (int64; eps and scale as float bits). */
enum {
  M_LAYERS, M_HIDDEN, M_INTER, M_NQ, M_NKV, M_D, M_EPS, M_SCALE, M_COS, M_SIN, M_ROPE_ROWS, M_NUM_SLOTS, M_BLOCK_SIZE,
  M_FINAL_NORM, M_EMBED, M_EMBED_FMT, M_VOCAB, M_HEAD, M_HEAD_FMT, M_HEAD_ROWS,
  M_EMBED_SCALE, /* the embedding rows times this (float bits; 0: none; Gemma: sqrt(hidden)) */
  M_SOFTCAP,     /* logits = cap * tanh(logits / cap) (float bits; 0: none) */
  MODEL_FIELDS
};

static float float_bits(int64_t v) {
  const int32_t b = (int32_t)v;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

/* A quantized Llama's whole forward in one call (a decode step's Python between its kernel calls
 * costs more than the calls: the caches are cold after the weights went past):
 *   h      [T, hidden]      = embedding rows of ids (agentrt_quant_embedding), times M_EMBED_SCALE
 *   h                       = layers 0..num_layers-1 (agentrt_quant_decoder)
 *   hidden [n_rows, hidden] = final norm of rows `rows` of h (NULL: rows 0..n_rows-1)
 *   logits [n_rows, head]   = hidden W_head^T (agentrt_quant_linear), soft-capped by M_SOFTCAP
 * model: MODEL_FIELDS int64 (agentrt/engine/models/quant_forward.py builds it). Returns 0, or
 * as agentrt_quant_decoder (-2 also for an id outside the embedding; the caches are written
 * only when every index is in range). */
int agentrt_quant_forward(const int64_t *model, int64_t num_layers, const int64_t *ids, int64_t T,
                          const int64_t *positions, const int64_t *slots, int64_t B, const int64_t *cu_q,
                          const int64_t *block_tables, int64_t bt_stride, int64_t bt_cols, const int64_t *rows,
                          int64_t n_rows, float *h, float *hidden, float *logits, int threads,
                          const int64_t *tree_base, const int64_t *path_slots, int64_t path_stride) {
  const int64_t dim = model[M_HIDDEN];
  int rc = agentrt_quant_embedding(ids, T, PTR(const uint8_t *, model[M_EMBED]), (int)model[M_EMBED_FMT],
                                   model[M_VOCAB], dim, h, dim);
  if (rc) return rc;
  const float embed_scale = float_bits(model[M_EMBED_SCALE]), cap = float_bits(model[M_SOFTCAP]);
  if (embed_scale != 0.0f)
    for (int64_t i = 0; i < T * dim; i++) h[i] = h[i] * embed_scale;
  rc = agentrt_quant_decoder(PTR(const int64_t *, model[M_LAYERS]), num_layers, h, T, dim, model[M_INTER],
                             (int)model[M_NQ], (int)model[M_NKV], (int)model[M_D], float_bits(model[M_EPS]),
                             float_bits(model[M_SCALE]), positions, PTR(const float *, model[M_COS]),
                             PTR(const float *, model[M_SIN]), model[M_ROPE_ROWS], slots, model[M_NUM_SLOTS], B, cu_q,
                             block_tables, bt_stride, bt_cols, model[M_BLOCK_SIZE],
                             PTR(const float *, model[M_FINAL_NORM]), rows, n_rows, hidden, threads, tree_base,
                             path_slots, path_stride);
  if (rc || n_rows == 0) return rc;
  rc = agentrt_quant_linear(hidden, dim, n_rows, PTR(const uint8_t *, model[M_HEAD]), (int)model[M_HEAD_FMT],
                            model[M_HEAD_ROWS], dim, logits, model[M_HEAD_ROWS], threads);
  if (!rc && cap != 0.0f)
    for (int64_t i = 0; i < n_rows * model[M_HEAD_ROWS]; i++) logits[i] = tanhf(logits[i] / cap) * cap;
  return rc;
}
