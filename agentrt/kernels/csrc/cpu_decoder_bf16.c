/* A stack of Llama decoder layers over a small ragged batch, one call for all layers: the five
 * kernels of a layer (agentrt/engine/models/kernel_forward.py) without a Python round trip
 * between them (~8 us each, ~150 per step).
 *
 * layers: num_layers rows of LAYER_FIELDS int64, the addresses and sizes the kernels take:
 *   wqkv, qkv_units, bqkv (0: none), wo, o_units, wgate_up, gate_up_units, wdown, down_units,
 *   attn_norm, mlp_norm, k_cache, v_cache. */
#include "cpu_common.h"

#define LAYER_FIELDS 13
#define EPI_NONE 0
#define EPI_RESIDUAL 1

void agentrt_linear_bf16(const bf16 *w, int64_t units, int64_t N, int64_t K, const bf16 *x, int64_t M,
                         int64_t ldx, const bf16 *norm_w, float eps, const bf16 *bias, int epilogue,
                         const bf16 *res, int64_t ldr, void *y, int64_t ldy, int out_f32, int num_threads);
void agentrt_rotary_kv_write_bf16(bf16 *qkv, int64_t T, int64_t ld, int nq, int nkv, int d,
                                  const int64_t *positions, const float *cos, const float *sin,
                                  const int64_t *slots, bf16 *k_cache, bf16 *v_cache, int num_threads);
void agentrt_paged_attention_bf16(const bf16 *q, int64_t ldq, int64_t B, const int64_t *cu_q,
                                  const int64_t *positions, const int64_t *block_tables, int64_t bt_stride,
                                  int64_t block_size, const bf16 *k_cache, const bf16 *v_cache, int nq,
                                  int nkv, int d, float scale, bf16 *out, int64_t ldo, int num_threads,
                                  int prefetch_rows);

#define PTR(type, v) ((type)(intptr_t)(v))

/* h [T, hidden] is updated in place; qkv [T, (nq + 2 nkv) d], attn [T, nq d], act [T, inter]
 * are scratch. The caches of layer i receive the K/V of every token at slots[t]. */
void agentrt_decoder_layers_bf16(const int64_t *layers, int64_t num_layers, bf16 *h, bf16 *qkv,
                                 bf16 *attn, bf16 *act, int64_t T, int64_t hidden, int64_t inter, int nq,
                                 int nkv, int d, float eps, float scale, const int64_t *positions,
                                 const float *cos, const float *sin, const int64_t *slots, int64_t B,
                                 const int64_t *cu_q, const int64_t *block_tables, int64_t bt_stride,
                                 int64_t block_size, int num_threads, int prefetch_rows) {
  const int64_t qkv_w = (int64_t)(nq + 2 * nkv) * d, q_w = (int64_t)nq * d;
  for (int64_t i = 0; i < num_layers; i++) {
    const int64_t *L = layers + i * LAYER_FIELDS;
    bf16 *kc = PTR(bf16 *, L[11]), *vc = PTR(bf16 *, L[12]);
    agentrt_linear_bf16(PTR(const bf16 *, L[0]), L[1], qkv_w, hidden, h, T, hidden, PTR(const bf16 *, L[9]), eps,
                        PTR(const bf16 *, L[2]), EPI_NONE, NULL, 0, qkv, qkv_w, 0, num_threads);
    agentrt_rotary_kv_write_bf16(qkv, T, qkv_w, nq, nkv, d, positions, cos, sin, slots, kc, vc, num_threads);
    agentrt_paged_attention_bf16(qkv, qkv_w, B, cu_q, positions, block_tables, bt_stride, block_size, kc, vc, nq,
                                 nkv, d, scale, attn, q_w, num_threads, prefetch_rows);
    agentrt_linear_bf16(PTR(const bf16 *, L[3]), L[4], hidden, q_w, attn, T, q_w, NULL, 0.f, NULL, EPI_RESIDUAL, h,
                        hidden, h, hidden, 0, num_threads);
    agentrt_linear_bf16(PTR(const bf16 *, L[5]), L[6], inter, hidden, h, T, hidden, PTR(const bf16 *, L[10]), eps,
                        NULL, 2 /* silu-gated */, NULL, 0, act, inter, 0, num_threads);
    agentrt_linear_bf16(PTR(const bf16 *, L[7]), L[8], hidden, inter, act, T, inter, NULL, 0.f, NULL, EPI_RESIDUAL, h,
                        hidden, h, hidden, 0, num_threads);
  }
}
