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
 *   K/V of every token -> cache row slots[t]       caches [num_slots, nkv, d] bf16 (kv_t)
 *   attn = softmax(q . K[0..p] * scale) . V[0..p]  per query, its own sequence's positions 0..p
 *                                                  (cpu_quant_attention.c)
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
 * Batch invariance: a query's attention is computed by the same operations in the same order
 * whatever rows share its step (cpu_quant_attention.c); the per-token ops touch one token's row;
 * the linears compute each row alone. So a token's bits depend neither on the other tokens nor on the thread count, and
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
#define SERIAL_VALUES 16384     /* per-token phases over fewer values (tokens x row width) run on the
                                 * caller: cheaper than a join (~5 us) */
#define PTR(type, v) ((type)(intptr_t)(v))

enum { PH_NORM, PH_ROTARY, PH_RESIDUAL, PH_SILU };

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
  kv_t *kc, *vc; /* bf16 */
  float *h, *x, *qkv, *attn, *gu, *tmp;
  int phase;
  pool_chunks chunks;
} dec;

/* ---- vector helpers: AVX2, and the scalar path computing the same values in order ---- */

#if QUANT_AVX2

/* sum_i a[i] b[i]: 8 lanes (lane l sums i = l mod 8, in order), then the lanes, then the tail */
static inline float dotf(const float *a, const float *b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum8(acc);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
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

#else /* scalar */

static inline float dotf(const float *a, const float *b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
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
      kv_store(D->kc + D->slots[t] * kv_row, row + D->q_w, kv_row);
      kv_store(D->vc + D->slots[t] * kv_row, row + D->q_w + kv_row, kv_row);
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
  }
}

static void tokens_job(void *ctx, int tid, int nt) {
  (void)nt;
  dec *D = ctx;
  for (int64_t t; (t = pool_claim(&D->chunks, tid)) >= 0;) token_phase(D, t);
}

static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

static void run_tokens(dec *D, int phase, int threads) {
  D->phase = phase;
  /* the SiLU phase reads 2 inter values a token, with an exp each: worth threads from fewer tokens */
  const int64_t width = phase == PH_SILU ? 2 * D->inter : D->hidden;
  if (D->T * width < SERIAL_VALUES || threads <= 1) {
    for (int64_t t = 0; t < D->T; t++) token_phase(D, t);
    return;
  }
  const int nt = threads > D->T ? (int)D->T : threads;
  pool_chunks_init(&D->chunks, D->T, nt);
  pool_run(tokens_job, D, nt);
}

/* The caller's buffers for the layers' activations (the linears have their own). */
static __thread scratch_buf scratch;

static size_t decoder_scratch_bytes(int64_t T, int64_t hidden, int64_t inter, int64_t qkv_w, int64_t q_w) {
  return sizeof(float) * (size_t)(2 * up16(T * hidden) + up16(T * qkv_w) + up16(T * q_w) + up16(T * 2 * inter) +
                                  2 * up16(T + 1));
}

/* Inputs the loops index by: positions in [0, rope_rows), slots in [0, num_slots), cu_q a
 * partition of 0..T, every block a token's context reaches inside the table and the cache,
 * rows in [0, T). Fills seq[t], token t's sequence. */
static int check_batch(int64_t T, const int64_t *positions, int64_t rope_rows, const int64_t *slots, int64_t num_slots,
                       int64_t B, const int64_t *cu_q, const int64_t *block_tables, int64_t bt_stride, int64_t bt_cols,
                       int64_t block_size, const int64_t *rows, int64_t n_rows, int64_t *seq) {
  for (int64_t t = 0; t < T; t++)
    if (positions[t] >= rope_rows || slots[t] < 0 || slots[t] >= num_slots) return -2;
  for (int64_t i = 0; i < n_rows; i++)
    if (rows && (rows[i] < 0 || rows[i] >= T)) return -2;
  return quant_check_tables(T, positions, B, cu_q, block_tables, bt_stride, bt_cols, block_size, num_slots, seq);
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
  if (nq < 1 || nkv < 1 || nq % nkv || d < 16 || d % 16 || hidden < 1 || inter < 1) return -1;
  if (T <= 0) return 0;
  threads = threads < 1 ? 1 : threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : threads;
  dec D = {.T = T, .hidden = hidden, .inter = inter, .qkv_w = (int64_t)(nq + 2 * nkv) * d, .q_w = (int64_t)nq * d,
           .nq = nq, .nkv = nkv, .d = d, .g = nq / nkv, .eps = eps, .scale = scale, .positions = positions,
           .slots = slots, .block_tables = block_tables, .bt_stride = bt_stride, .block_size = block_size,
           .cos = cos, .sin = sin, .h = h, .tree_base = tree_base, .path_slots = path_slots,
           .path_stride = path_stride};
  const int64_t n_x = up16(T * hidden), n_qkv = up16(T * D.qkv_w), n_attn = up16(T * D.q_w);
  const int64_t n_gu = up16(T * 2 * inter), n_seq = up16(T + 1);
  /* floats, then seq (int64: two floats per entry) */
  float *buf = scratch_get(&scratch, decoder_scratch_bytes(T, hidden, inter, D.qkv_w, D.q_w));
  if (!buf) return -3;
  D.x = buf;
  D.tmp = D.x + n_x;
  D.qkv = D.tmp + n_x;
  D.attn = D.qkv + n_qkv;
  D.gu = D.attn + n_attn;
  int64_t *seq = (int64_t *)(D.gu + n_gu);
  D.seq = seq;
  int rc = check_batch(T, positions, rope_rows, slots, num_slots, B, cu_q, block_tables, bt_stride, bt_cols,
                       block_size, rows, n_rows, seq);
  if (!rc && tree_base) rc = check_tree(T, positions, tree_base, path_slots, path_stride, num_slots);
  if (rc) return rc;
  qattn A = {.T = T, .qkv_w = D.qkv_w, .q_w = D.q_w, .nq = nq, .nkv = nkv, .d = d, .scale = scale,
             .positions = positions, .seq = seq, .block_tables = block_tables, .tree_base = tree_base,
             .path_slots = path_slots, .bt_stride = bt_stride, .block_size = block_size, .path_stride = path_stride,
             .qkv = D.qkv, .attn = D.attn};
  for (int64_t li = 0; li < num_layers; li++) {
    const int64_t *L = layers + li * LAYER_FIELDS;
    D.bqkv = PTR(const float *, L[2]);
    D.kc = PTR(kv_t *, L[11]);
    D.vc = PTR(kv_t *, L[12]);
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
    A.kc = D.kc, A.vc = D.vc, A.window = D.window;
    rc = quant_attention(&A, threads);
    if (rc) return rc;
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

/* The calling thread's buffers sized and touched for a step of up to T tokens of a model of these
 * dimensions (the decoder's activations, the linears' int8 rows): they grow at a new largest step,
 * once, which a long-running server would otherwise see as its memory growing late, and that
 * step would pay the page faults. Returns 0, -1 for a bad dimension, -3 when out of memory. */
int agentrt_quant_reserve(int64_t T, int64_t hidden, int64_t inter, int nq, int nkv, int d) {
  if (T < 0 || hidden < 1 || inter < 1 || nq < 1 || nkv < 1 || d < 1) return -1;
  const int64_t q_w = (int64_t)nq * d, qkv_w = (int64_t)(nq + 2 * nkv) * d;
  const size_t size = decoder_scratch_bytes(T, hidden, inter, qkv_w, q_w);
  void *p = scratch_get(&scratch, size);
  if (!p) return -3;
  memset(p, 0, size);
  const int64_t widest = inter > q_w ? inter : q_w; /* the linears' K: hidden, q_w and inter */
  return quant_linear_reserve(T, widest > hidden ? widest : hidden);
}
