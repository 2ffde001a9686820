/* Fork-join worker threads for the kernels (cpu_pool.c). */
#ifndef AGENTRT_CPU_POOL_H
#define AGENTRT_CPU_POOL_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

/* A per-thread buffer reused across calls (64-byte aligned, grown on demand, never shrunk):
 * per-call malloc of buffers above glibc's mmap threshold costs page faults and zeroing. */
typedef struct {
  void *ptr;
  size_t size;
} scratch_buf;

/* b->ptr with at least `size` bytes; NULL when out of memory. */
static inline void *scratch_get(scratch_buf *b, size_t size) {
  if (size > b->size) {
    free(b->ptr);
    b->size = (size + 4095) & ~(size_t)4095;
    b->ptr = aligned_alloc(64, b->size);
    if (!b->ptr) b->size = 0;
  }
  return b->ptr;
}

typedef void (*pool_fn)(void *ctx, int tid, int nthreads);

/* Runs fn(ctx, 0, n) on the caller and fn(ctx, tid, n) on up to n-1 workers that join in time;
 * returns when every call that started has returned. fn must split the work dynamically
 * (pool_claim on a counter in ctx) and be harmless when it finds nothing left. */
void pool_run(pool_fn fn, void *ctx, int n);

#define POOL_MAX_THREADS 64

/* A job's chunks 0..n-1 in one contiguous range per thread (each thread streams its own part of
 * the weights, as a static split would); a thread done with its range takes chunks from the
 * others' ranges, so one that is descheduled or never joins delays nobody. */
/* Each thread's counter on a cache line of its own: with the counters side by side every claim
 * moved the line between the cores (false sharing), ~20% of a Q4_1 linear's time from cache
 * and 8-10% of the 30 layers' linears streamed from DRAM (2 threads, this 2-core EPYC). */
typedef struct {
  _Alignas(64) _Atomic int64_t next;
} pool_counter;

typedef struct {
  int64_t n;
  int nt;
  pool_counter next[POOL_MAX_THREADS];
} pool_chunks;

static inline void pool_chunks_init(pool_chunks *c, int64_t n, int nt) {
  c->n = n;
  c->nt = nt < 1 ? 1 : (nt > POOL_MAX_THREADS ? POOL_MAX_THREADS : nt);
  for (int t = 0; t < c->nt; t++) atomic_init(&c->next[t].next, n * t / c->nt);
}

/* The next chunk for thread tid, or -1 when none is left. */
static inline int64_t pool_claim(pool_chunks *c, int tid) {
  for (int k = 0; k < c->nt; k++) {
    const int r = (tid + k) % c->nt;
    const int64_t end = c->n * (r + 1) / c->nt;
    if (atomic_load_explicit(&c->next[r].next, memory_order_relaxed) >= end) continue;
    const int64_t i = atomic_fetch_add_explicit(&c->next[r].next, 1, memory_order_relaxed);
    if (i < end) return i;
  }
  return -1;
}

#endif
