/* Row-wise argmax of a float32 matrix (greedy decoding's last op), optionally under a token
 * bitmask per row: per row the index of the first maximal value, a NaN counting as larger than
 * everything, as torch.argmax does; with a mask, exactly what setting the disallowed entries to
 * -inf and then taking torch.argmax returns (so a row with nothing allowed above -inf gives the
 * first -inf entry, allowed or not), without writing the row.
 *
 * Two vector passes per row, the maximum then the first index equal to it, rows claimed over
 * the kernels' workers. torch.argmax's CPU loop tracks an index per element (~0.06 ms per
 * 49k-wide row) and joins OpenMP threads, which stall when the other core is busy; masking a
 * copy of the row first (xgrammar's CPU apply_token_bitmask_inplace) costs ~0.4 ms a row. */
#include <immintrin.h>
#include <math.h>

#include "cpu_pool.h"

typedef struct {
  const float *x;
  int64_t cols, ld;
  const int32_t *mask; /* [*, words] bitmask rows (bit j of word w: token 32 w + j allowed) */
  int64_t words;
  const int64_t *mask_row; /* per x row: its mask row, or -1 for none */
  int64_t *out;
  pool_chunks rows;
} argmax_job;

/* Allowed bits of columns c..c+15 (c a multiple of 16); columns past the mask are not allowed. */
static inline __mmask16 allowed16(const int32_t *m, int64_t words, int64_t c) {
  const int64_t w = c >> 5;
  if (!m) return 0xffff;
  if (w >= words) return 0;
  return (__mmask16)(((uint32_t)m[w] >> (c & 31)) & 0xffffu);
}

static inline int allowed1(const int32_t *m, int64_t words, int64_t c) {
  return !m || ((c >> 5) < words && (((uint32_t)m[c >> 5] >> (c & 31)) & 1u));
}

static int64_t row_argmax(const float *r, int64_t n, const int32_t *m, int64_t words) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __mmask16 ok = allowed16(m, words, i);
    const __m512 v = _mm512_loadu_ps(r + i);
    nan |= _mm512_mask_cmp_ps_mask(ok, v, v, _CMP_UNORD_Q);
    vmax = _mm512_mask_max_ps(vmax, ok, vmax, v);
  }
  float mx = _mm512_reduce_max_ps(vmax);
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
  const __m512 vm = _mm512_set1_ps(mx);
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 ok = allowed16(m, words, i);
    __mmask16 eq = _mm512_mask_cmp_ps_mask(ok, _mm512_loadu_ps(r + i), vm, _CMP_EQ_OQ);
    if (all_ninf) eq |= (__mmask16)~ok;
    if (eq) return i + __builtin_ctz(eq);
  }
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
