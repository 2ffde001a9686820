/* A stack of decoder layers over a small ragged batch, one call for all layers: the kernels of a
 * layer (agentrt/engine/models/kernel_forward.py) without a Python round trip between them
 * (~8 us each, ~150 per step). Llama-layout layers, and the later families' features, each a
 * layer field (0: absent), as the fused quantized decoder (cpu_quant_decoder.c) has them:
 * QK-norm (Qwen3, Gemma 3), norms of the attention and MLP outputs before their residual adds,
 * GeGLU, the layer's own rotary tables and a sliding window (Gemma 3), and Gemma's norms (fp32
 * (1 + w) weights, norm_row).
 *
 * layers: num_layers rows of LAYER_FIELDS int64, the addresses and sizes the kernels take:
 *   wqkv, qkv_units, bqkv (0: none), wo, o_units, wgate_up, gate_up_units, wdown, down_units,
 *   attn_norm, mlp_norm, k_cache, v_cache, q_norm, k_norm, attn_out_norm, mlp_out_norm, cos, sin
 *   (the layer's rotary tables, 0: the model's), window (0: none), gelu (1: GeGLU, 0: SwiGLU),
 *   norm_f32 (1: every norm weight of the layer is Gemma's fp32 (1 + w), 0: Llama's bf16). */
#include "cpu_common.h"

#define LAYER_FIELDS 22
#define EPI_NONE 0
#define EPI_RESIDUAL 1
#define EPI_SILU_MUL 2
#define EPI_GELU_MUL 3

void agentrt_linear_bf16(const bf16 *w, int64_t units, int64_t N, int64_t K, const bf16 *x, int64_t M,
                         int64_t ldx, const void *norm_w, int norm_f32, float eps, const bf16 *bias, int epilogue,
                         const bf16 *res, int64_t ldr, void *y, int64_t ldy, int out_f32, int num_threads);
void agentrt_rotary_kv_write_bf16(bf16 *qkv, int64_t T, int64_t ld, int nq, int nkv, int d,
                                  const int64_t *positions, const float *cos, const float *sin,
                                  const int64_t *slots, bf16 *k_cache, bf16 *v_cache, const void *q_norm,
                                  const void *k_norm, int norm_f32, float eps, int num_threads);
void agentrt_paged_attention_bf16(const bf16 *q, int64_t ldq, int64_t B, const int64_t *cu_q,
                                  const int64_t *positions, const int64_t *block_tables, int64_t bt_stride,
                                  int64_t block_size, const bf16 *k_cache, const bf16 *v_cache, int nq,
                                  int nkv, int d, float scale, int64_t window, bf16 *out, int64_t ldo,
                                  int num_threads, int prefetch_rows);

#define PTR(type, v) ((type)(intptr_t)(v))

/* h = bf16(h + norm(y)) row by row, y [T, hidden] normed in place: a post-norm and the residual
 * add after it, rounded as the PyTorch path's separate norm and add. */
typedef struct {
  bf16 *h, *y;
  const void *w;
  int norm_f32;
  int64_t hidden;
  float eps;
  pool_chunks chunks; /* of rows */
} norm_add_job;

static void norm_add_part(void *arg, int tid, int nt) {
  (void)nt;
  norm_add_job *J = (norm_add_job *)arg;
  for (int64_t t; (t = pool_claim(&J->chunks, tid)) >= 0;) {
    bf16 *y = J->y + t * J->hidden, *h = J->h + t * J->hidden;
    norm_row(y, J->w, J->norm_f32, J->hidden, J->eps, y);
    for (int64_t k = 0; k < J->hidden; k += 16) {
      const __mmask16 m = J->hidden - k >= 16 ? 0xffff : (__mmask16)((1u << (J->hidden - k)) - 1);
      store_bf16(h + k, _mm512_add_ps(load_bf16(h + k, m), load_bf16(y + k, m)), m);
    }
  }
}

static void norm_add(bf16 *h, bf16 *y, const void *w, int norm_f32, int64_t T, int64_t hidden, float eps,
                     int num_threads) {
  norm_add_job job = {h, y, w, norm_f32, hidden, eps, {0}};
  const int nt = T >= 64 ? num_threads : 1; /* a few rows: not worth a join */
  pool_chunks_init(&job.chunks, T, nt);
  pool_run(norm_add_part, &job, nt);
}

/* A linear whose output is added to h: fused into its epilogue, or with a post-norm (out_norm
 * not 0) through y [T, hidden], normed, then added. */
static void linear_add(const int64_t *L, int w_field, int out_norm_field, const bf16 *x, int64_t K, bf16 *h,
                       bf16 *y, int64_t T, int64_t hidden, float eps, int num_threads) {
  const bf16 *w = PTR(const bf16 *, L[w_field]);
  if (!L[out_norm_field]) {
    agentrt_linear_bf16(w, L[w_field + 1], hidden, K, x, T, K, NULL, 0, 0.f, NULL, EPI_RESIDUAL, h, hidden, h,
                        hidden, 0, num_threads);
    return;
  }
  agentrt_linear_bf16(w, L[w_field + 1], hidden, K, x, T, K, NULL, 0, 0.f, NULL, EPI_NONE, NULL, 0, y, hidden, 0,
                      num_threads);
  norm_add(h, y, PTR(const void *, L[out_norm_field]), (int)L[21], T, hidden, eps, num_threads);
}

/* h [T, hidden] is updated in place; qkv [T, (nq + 2 nkv) d], attn [T, nq d], act [T, inter]
 * and y [T, hidden] (used by layers with post-norms) are scratch. The caches of layer i receive
 * the K/V of every token at slots[t]. */
void agentrt_decoder_layers_bf16(const int64_t *layers, int64_t num_layers, bf16 *h, bf16 *qkv,
                                 bf16 *attn, bf16 *act, bf16 *y, int64_t T, int64_t hidden, int64_t inter, int nq,
                                 int nkv, int d, float eps, float scale, const int64_t *positions,
                                 const float *cos, const float *sin, const int64_t *slots, int64_t B,
                                 const int64_t *cu_q, const int64_t *block_tables, int64_t bt_stride,
                                 int64_t block_size, int num_threads, int prefetch_rows) {
  const int64_t qkv_w = (int64_t)(nq + 2 * nkv) * d, q_w = (int64_t)nq * d;
  for (int64_t i = 0; i < num_layers; i++) {
    const int64_t *L = layers + i * LAYER_FIELDS;
    bf16 *kc = PTR(bf16 *, L[11]), *vc = PTR(bf16 *, L[12]);
    const int norm_f32 = (int)L[21];
    const float *lcos = L[17] ? PTR(const float *, L[17]) : cos, *lsin = L[18] ? PTR(const float *, L[18]) : sin;
    agentrt_linear_bf16(PTR(const bf16 *, L[0]), L[1], qkv_w, hidden, h, T, hidden, PTR(const void *, L[9]),
                        norm_f32, eps, PTR(const bf16 *, L[2]), EPI_NONE, NULL, 0, qkv, qkv_w, 0, num_threads);
    agentrt_rotary_kv_write_bf16(qkv, T, qkv_w, nq, nkv, d, positions, lcos, lsin, slots, kc, vc,
                                 PTR(const void *, L[13]), PTR(const void *, L[14]), norm_f32, eps, num_threads);
    agentrt_paged_attention_bf16(qkv, qkv_w, B, cu_q, positions, block_tables, bt_stride, block_size, kc, vc, nq,
                                 nkv, d, scale, L[19], attn, q_w, num_threads, prefetch_rows);
    linear_add(L, 3, 15, attn, q_w, h, y, T, hidden, eps, num_threads);
    agentrt_linear_bf16(PTR(const bf16 *, L[5]), L[6], inter, hidden, h, T, hidden, PTR(const void *, L[10]),
                        norm_f32, eps, NULL, L[20] ? EPI_GELU_MUL : EPI_SILU_MUL, NULL, 0, act, inter, 0,
                        num_threads);
    linear_add(L, 7, 16, act, inter, h, y, T, hidden, eps, num_threads);
  }
}
