/* The fastest plain read of a buffer on the kernels' threads: the read floor a memory-bound
 * decode step is measured against (agentrt bench decode, floor_ratio).
 *
 *   sum = sum of the n bytes at p (mod 2^64)
 *
 * The buffer is cut into one contiguous part per thread (at 64-byte lines), as the linears'
 * threads each stream their own range of a weight (interleaving the threads' parts by 1-64 KB
 * read 4-87% slower on the 2-core EPYC); a thread claims its own part first, then any part no
 * thread has started (pool_claim), so a worker that never joins delays nothing. Per 32 bytes one load and one _mm256_sad_epu8 (4 partial byte sums
 * into 64-bit lanes), two accumulators: far below what the memory delivers, so the time is the
 * memory's. The sum is returned so that no compiler drops the reads, and tests check it. */
#include <stdint.h>

#include "cpu_pool.h"

#if defined(__AVX2__) && !defined(AGENTRT_QUANT_SCALAR)
#include <immintrin.h>
#define STREAM_AVX2 1
#else
#define STREAM_AVX2 0
#endif

typedef struct {
  const uint8_t *p;
  int64_t n;
  int parts;
  pool_chunks claims;
  uint64_t sum[POOL_MAX_THREADS][8]; /* part i's sum in sum[i][0]: a cache line each */
} read_job;

static uint64_t sum_bytes(const uint8_t *p, int64_t n) {
  uint64_t s = 0;
  int64_t i = 0;
#if STREAM_AVX2
  const __m256i zero = _mm256_setzero_si256();
  __m256i a = zero, b = zero;
  for (; i + 64 <= n; i += 64) {
    a = _mm256_add_epi64(a, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i)), zero));
    b = _mm256_add_epi64(b, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + i + 32)), zero));
  }
  uint64_t lanes[4];
  _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a, b));
  s = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
  for (; i < n; i++) s += p[i];
  return s;
}

/* Where part i of the buffer starts: its share of n, moved down to a 64-byte line. */
static int64_t part_start(const read_job *j, int64_t i) {
  if (i == 0) return 0;
  if (i == j->parts) return j->n;
  const uintptr_t base = (uintptr_t)j->p, at = (base + (uintptr_t)(j->n * i / j->parts)) & ~(uintptr_t)63;
  return at < base ? 0 : (int64_t)(at - base);
}

static void read_run(void *ctx, int tid, int nt) {
  (void)nt;
  read_job *j = ctx;
  for (int64_t i; (i = pool_claim(&j->claims, tid)) >= 0;) {
    const int64_t lo = part_start(j, i), hi = part_start(j, i + 1);
    j->sum[i][0] = sum_bytes(j->p + lo, hi - lo);
  }
}

/* The sum of the n bytes at p, read by `threads` threads (each a contiguous part). */
uint64_t agentrt_stream_read(const uint8_t *p, int64_t n, int threads) {
  if (n <= 0) return 0;
  const int nt = threads < 1 ? 1 : threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : threads;
  read_job j = {.p = p, .n = n, .parts = nt};
  pool_chunks_init(&j.claims, nt, nt);
  pool_run(read_run, &j, nt);
  uint64_t s = 0;
  for (int i = 0; i < nt; i++) s += j.sum[i][0];
  return s;
}
