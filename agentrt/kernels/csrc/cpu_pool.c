/* The kernels' worker threads: fork-join with work claimed chunk by chunk, a short spin, then
 * sleep.
 *
 * Why not OpenMP: libgomp's default wait policy spins for ~300k iterations at every join and
 * splits work statically. On a CPU shared with other busy processes a spinning thread keeps
 * its core while its partner, descheduled, holds half the work: a 13 ms decode step took 1.3 s
 * (150 joins, each waiting out a scheduler slice). OMP_WAIT_POLICY=PASSIVE helps but costs ~10%
 * on an idle machine and must be set before PyTorch loads.
 *
 * Here every thread, the caller included, claims chunks from a shared counter (the job's
 * business, see pool_claim), so a descheduled worker holds at most one chunk, and a worker that
 * has not entered the job when the caller runs out of chunks is shut out of it: the caller
 * never waits for a thread that has not started. Waiting threads spin ~SPIN_US (back-to-back
 * kernels of a step join within that), then sleep on a futex.
 */
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "cpu_pool.h"

#define MAX_WORKERS 63
#ifndef SPIN_US
#define SPIN_US 50
#endif
#define CLOSED (1u << 31)

static struct {
  pthread_mutex_t start_lock, run_lock;
  int nworkers;
  _Atomic uint32_t generation; /* bumped per job: the futex word idle workers sleep on */
  _Atomic uint32_t gate;       /* CLOSED | workers inside the current job: the caller sleeps on it */
  _Atomic int sleepers;        /* workers asleep on `generation` */
  pool_fn fn;
  void *ctx;
  int nthreads;
} P = {.start_lock = PTHREAD_MUTEX_INITIALIZER, .run_lock = PTHREAD_MUTEX_INITIALIZER, .gate = CLOSED};

static long futex(_Atomic uint32_t *addr, int op, uint32_t val) {
  return syscall(SYS_futex, (uint32_t *)addr, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

static inline uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spin while *addr == val for up to SPIN_US; returns 1 if it changed. */
static int spin_while_equal(_Atomic uint32_t *addr, uint32_t val) {
  const uint64_t end = now_ns() + SPIN_US * 1000u;
  for (int i = 0;; i++) {
    if (atomic_load_explicit(addr, memory_order_acquire) != val) return 1;
    __builtin_ia32_pause();
    if ((i & 63) == 63 && now_ns() > end) return 0;
  }
}

/* Enter the open job (1), or find it closed (0). */
static int enter(void) {
  uint32_t g = atomic_load(&P.gate);
  while (!(g & CLOSED))
    if (atomic_compare_exchange_weak(&P.gate, &g, g + 1)) return 1;
  return 0;
}

static void *worker_main(void *arg) {
  const int id = (int)(intptr_t)arg; /* thread index in a job: 1.. */
  uint32_t seen = 0;
  for (;;) {
    if (!spin_while_equal(&P.generation, seen)) {
      atomic_fetch_add(&P.sleepers, 1);
      while (atomic_load(&P.generation) == seen) futex(&P.generation, FUTEX_WAIT, seen);
      atomic_fetch_sub(&P.sleepers, 1);
    }
    seen = atomic_load(&P.generation);
    /* The gate opens after fn/ctx are set and closes before the caller returns: a worker inside
     * sees the job it entered, one shut out touches nothing. */
    if (!enter()) continue;
    if (id < P.nthreads) P.fn(P.ctx, id, P.nthreads);
    if (atomic_fetch_sub(&P.gate, 1) == (CLOSED | 1u)) futex(&P.gate, FUTEX_WAKE, 1);
  }
  return NULL;
}

/* A forked child has none of the parent's threads: start afresh. */
static void forget_workers(void) {
  P.nworkers = 0;
  atomic_store(&P.sleepers, 0);
  atomic_store(&P.gate, CLOSED);
  pthread_mutex_init(&P.start_lock, NULL);
  pthread_mutex_init(&P.run_lock, NULL);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

static void ensure_workers(int n) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, register_fork_handler);
  if (P.nworkers >= n) return;
  pthread_mutex_lock(&P.start_lock);
  while (P.nworkers < n && P.nworkers < MAX_WORKERS) {
    pthread_t t;
    if (pthread_create(&t, NULL, worker_main, (void *)(intptr_t)(P.nworkers + 1)) != 0) break;
    pthread_detach(t);
    P.nworkers++;
  }
  pthread_mutex_unlock(&P.start_lock);
}

void pool_run(pool_fn fn, void *ctx, int n) {
  if (n > 1) ensure_workers(n - 1);
  if (n > P.nworkers + 1) n = P.nworkers + 1;
  if (n <= 1) {
    fn(ctx, 0, 1);
    return;
  }
  pthread_mutex_lock(&P.run_lock);
  P.fn = fn;
  P.ctx = ctx;
  P.nthreads = n;
  atomic_store(&P.gate, 0); /* open */
  atomic_fetch_add(&P.generation, 1);
  if (atomic_load(&P.sleepers) > 0) futex(&P.generation, FUTEX_WAKE, MAX_WORKERS);
  fn(ctx, 0, n); /* returns once no chunk is left to claim */
  uint32_t g = atomic_fetch_or(&P.gate, CLOSED) | CLOSED;
  while (g != CLOSED) { /* workers still finishing a chunk */
    if (!spin_while_equal(&P.gate, g)) futex(&P.gate, FUTEX_WAIT, g);
    g = atomic_load(&P.gate);
  }
  pthread_mutex_unlock(&P.run_lock);
}
