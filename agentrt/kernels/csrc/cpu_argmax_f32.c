/* Row-wise argmax of a float32 matrix (greedy decoding's last op): per row the index of the
 * first maximal value, a NaN counting as larger than everything, as torch.argmax does.
 *
 * Two vector passes per row, the maximum then the first index equal to it, rows claimed over
 * the kernels' workers. torch.argmax's CPU loop tracks an index per element (~0.06 ms per
 * 49k-wide row) and joins OpenMP threads, which stall when the other core is busy. */
#include <immintrin.h>
#include <math.h>

#include "cpu_pool.h"

typedef struct {
  const float *x;
  int64_t cols, ld;
  int64_t *out;
  pool_chunks rows;
} argmax_job;

static int64_t row_argmax(const float *r, int64_t n) {
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(r + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  float m = _mm512_reduce_max_ps(vmax);
  for (; i < n; i++) {
    if (isnan(r[i])) nan = 1;
    else if (r[i] > m) m = r[i];
  }
  if (nan) {
    for (int64_t j = 0; j < n; j++)
      if (isnan(r[j])) return j;
  }
  const __m512 vm = _mm512_set1_ps(m);
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), vm, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
  for (; i < n; i++)
    if (r[i] == m) return i;
  return 0; /* unreachable: m is one of the row's values */
}

static void argmax_part(void *ctx, int tid, int nt) {
  (void)nt;
  argmax_job *job = ctx;
  for (int64_t row; (row = pool_claim(&job->rows, tid)) >= 0;)
    job->out[row] = row_argmax(job->x + row * job->ld, job->cols);
}

/* x [rows, cols] with row stride ld (cols >= 1); out [rows] int64. */
void agentrt_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t ld, int64_t *out, int num_threads) {
  if (rows <= 0) return;
  argmax_job job = {.x = x, .cols = cols, .ld = ld, .out = out};
  int nt = rows < 4 || num_threads < 1 ? 1 : num_threads; /* a row takes ~10 us: few are not worth a join */
  if (nt > rows) nt = (int)rows;
  pool_chunks_init(&job.rows, rows, nt);
  pool_run(argmax_part, &job, nt);
}
