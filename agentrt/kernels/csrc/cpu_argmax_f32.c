/* Row-wise argmax of a float32 matrix (greedy decoding's last op), optionally under a token
 * bitmask per row: per row the index of the first maximal value, a NaN counting as larger than
 * everything, as torch.argmax does; with a mask, exactly what setting the disallowed entries to
 * -inf and then taking torch.argmax returns (so a row with nothing allowed above -inf gives the
 * first -inf entry, allowed or not), without writing the row.
 *
 * Two vector passes per row, the maximum then the first index equal to it, rows claimed over
 * the kernels' workers: 16 lanes with AVX-512 (the AMX library, cpu_build.py), 8 with AVX2 (also
 * built into the quantized kernels' library, quant_build.py, which runs without AVX-512), scalar
 * elsewhere. torch.argmax's CPU loop tracks an index per element (~0.06 ms per 49k-wide row;
 * 0.13 ms on the 2-core AVX2 EPYC) and joins OpenMP threads, which stall when the other core is
 * busy; masking a copy of the row first (xgrammar's CPU apply_token_bitmask_inplace) costs
 * ~0.4 ms a row. */
#include <math.h>
#include <stdint.h>

#include "cpu_pool.h"

#if defined(__AVX512F__) && !defined(AGENTRT_QUANT_SCALAR)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
#elif defined(__AVX2__) && !defined(AGENTRT_QUANT_SCALAR)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
#else
#define LANES 1
#endif

typedef struct {
  const float *x;
  int64_t cols, ld;
  const int32_t *mask; /* [*, words] bitmask rows (bit j of word w: token 32 w + j allowed) */
  int64_t words;
  const int64_t *mask_row; /* per x row: its mask row, or -1 for none */
  int64_t *out;
  pool_chunks rows;
} argmax_job;

/* Allowed bits of columns c..c+LANES-1 (c a multiple of LANES); columns past the mask are not
 * allowed. */
static inline uint32_t allowed_bits(const int32_t *m, int64_t words, int64_t c) {
  const uint32_t all = LANES == 32 ? 0xffffffffu : (1u << LANES) - 1u;
  const int64_t w = c >> 5;
  if (!m) return all;
  if (w >= words) return 0;
  return ((uint32_t)m[w] >> (c & 31)) & all;
}

static inline int allowed1(const int32_t *m, int64_t words, int64_t c) {
  return !m || ((c >> 5) < words && (((uint32_t)m[c >> 5] >> (c & 31)) & 1u));
}

#if LANES > 1
/* Per lane of LANES floats: the lanes' max (masked: ok lanes only), NaNs seen (ok lanes),
 * lanes equal to v; each as a bit mask. */
#if LANES == 16
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vset(float x) { return _mm512_set1_ps(x); }
static inline vec vmax_ok(vec acc, vec v, uint32_t ok) { return _mm512_mask_max_ps(acc, (__mmask16)ok, acc, v); }
static inline uint32_t vnan(vec v, uint32_t ok) { return _mm512_mask_cmp_ps_mask((__mmask16)ok, v, v, _CMP_UNORD_Q); }
static inline uint32_t veq(vec v, vec m, uint32_t ok) { return _mm512_mask_cmp_ps_mask((__mmask16)ok, v, m, _CMP_EQ_OQ); }
static inline float vreduce_max(vec v) { return _mm512_reduce_max_ps(v); }
#else
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vset(float x) { return _mm256_set1_ps(x); }
static inline __m256 lanes_of(uint32_t ok) { /* bit i -> lane i all ones */
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)ok), bit), bit));
}
/* max_ps returns its second operand when either is NaN: NaNs (counted apart) never enter acc */
static inline vec vmax_ok(vec acc, vec v, uint32_t ok) {
  return _mm256_max_ps(_mm256_blendv_ps(acc, v, lanes_of(ok)), acc);
}
static inline uint32_t vnan(vec v, uint32_t ok) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) & ok; }
static inline uint32_t veq(vec v, vec m, uint32_t ok) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, m, _CMP_EQ_OQ)) & ok; }
static inline float vreduce_max(vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif
#endif

static int64_t row_argmax(const float *r, int64_t n, const int32_t *m, int64_t words) {
  float mx = -INFINITY;
  uint32_t nan = 0;
  int64_t i = 0;
#if LANES > 1
  vec vmx = vset(-INFINITY);
  for (; i + LANES <= n; i += LANES) {
    const uint32_t ok = allowed_bits(m, words, i);
    const vec v = vload(r + i);
    nan |= vnan(v, ok);
    vmx = vmax_ok(vmx, v, ok);
  }
  mx = vreduce_max(vmx);
#endif
  for (; i < n; i++) {
    if (!allowed1(m, words, i)) continue;
    if (isnan(r[i])) nan = 1;
    else if (r[i] > mx) mx = r[i];
  }
  if (nan) {
    for (int64_t j = 0; j < n; j++)
      if (allowed1(m, words, j) && isnan(r[j])) return j;
  }
  /* The first j whose masked value equals mx: an allowed r[j] == mx, or, when mx is -inf, also
   * any disallowed j (masked to -inf). */
  const int all_ninf = mx == -INFINITY;
  i = 0;
#if LANES > 1
  const vec vm = vset(mx);
  for (; i + LANES <= n; i += LANES) {
    const uint32_t ok = allowed_bits(m, words, i);
    uint32_t eq = veq(vload(r + i), vm, ok);
    if (all_ninf) eq |= ~ok & ((1u << LANES) - 1u);
    if (eq) return i + __builtin_ctz(eq);
  }
#endif
  for (; i < n; i++) {
    const int ok = allowed1(m, words, i);
    if ((ok && r[i] == mx) || (!ok && all_ninf)) return i;
  }
  return 0; /* unreachable: mx is a masked value of the row */
}

static void argmax_part(void *ctx, int tid, int nt) {
  (void)nt;
  argmax_job *job = ctx;
  for (int64_t row; (row = pool_claim(&job->rows, tid)) >= 0;) {
    const int64_t mr = job->mask_row ? job->mask_row[row] : -1;
    const int32_t *m = mr >= 0 ? job->mask + mr * job->words : NULL;
    job->out[row] = row_argmax(job->x + row * job->ld, job->cols, m, job->words);
  }
}

/* x [rows, cols] with row stride ld (cols >= 1); out [rows] int64. mask: NULL, or bitmask rows
 * of `words` int32 with mask_row[r] the one row r obeys (-1: unmasked). */
void agentrt_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t ld, const int32_t *mask,
                        int64_t words, const int64_t *mask_row, int64_t *out, int num_threads) {
  if (rows <= 0) return;
  argmax_job job = {.x = x, .cols = cols, .ld = ld, .mask = mask, .words = words,
                    .mask_row = mask ? mask_row : NULL, .out = out};
  int nt = rows < 4 || num_threads < 1 ? 1 : num_threads; /* a row takes ~10 us: few are not worth a join */
  if (nt > rows) nt = (int)rows;
  pool_chunks_init(&job.rows, rows, nt);
  pool_run(argmax_part, &job, nt);
}
