/* The thread pool of forge's compiled kernels (declared in pool.h).
 *
 * One caller at a time runs a job on it: the caller takes part 0 and the workers the others
 * (forge_run_parallel). Workers spin for a while after a job (the next matmul of a step comes within
 * microseconds, a futex wake-up costs tens of them) and then sleep on a futex; forge_pool_park sends
 * them to sleep at once. A second concurrent caller does not wait: it computes its job alone.
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "pool.h"

#define MAX_THREADS 64

static struct {
    pthread_mutex_t busy;                 /* held by the one caller whose job the workers run */
    pthread_t threads[MAX_THREADS];
    int num_threads;                      /* the caller included */
    _Atomic uint32_t generation;          /* bumped for each job; workers wait for it to change */
    _Atomic int pending;                  /* workers still on the current job */
    void (*fn)(const void *ctx, int index, int count);   /* the current job: NULL shuts down */
    const void *ctx;
    int64_t spin;                         /* pause loops a worker spins before it sleeps */
    _Atomic int parked;                   /* set: sleep now, no spin, until the next job */
    uint32_t created_at;                  /* the generation new workers start from */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .num_threads = 1, .spin = 20000};

static void futex_wait(_Atomic uint32_t *addr, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    /* The generation when it was created (under `busy`, so no job has started since). */
    uint32_t seen = pool.created_at;
    for (;;) {
        uint32_t now;
        int64_t spins = 0;
        while ((now = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            if (spins++ < pool.spin && !atomic_load_explicit(&pool.parked, memory_order_relaxed)) cpu_relax();
            else futex_wait(&pool.generation, seen);
        }
        seen = now;
        if (pool.fn == NULL) return NULL;                      /* shut down */
        pool.fn(pool.ctx, index, pool.num_threads);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
}

/* Resize the pool to num_threads (the caller counted); returns the count in force. */
int forge_pool_threads(int num_threads, int64_t spin) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    pthread_mutex_lock(&pool.busy);
    if (spin >= 0) pool.spin = spin;
    if (num_threads != pool.num_threads) {
        if (pool.num_threads > 1) {                            /* stop the old workers */
            pool.fn = NULL;
            atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
            futex_wake_all(&pool.generation);
            for (int i = 1; i < pool.num_threads; i++) pthread_join(pool.threads[i], NULL);
        }
        pool.num_threads = 1;
        pool.created_at = atomic_load(&pool.generation);
        for (int i = 1; i < num_threads; i++) {
            if (pthread_create(&pool.threads[i], NULL, worker_main, (void *)(intptr_t)i) != 0) break;
            pool.num_threads = i + 1;
        }
    }
    const int n = pool.num_threads;
    pthread_mutex_unlock(&pool.busy);
    return n;
}

/* fn(ctx, i, n) for i < n on the pool's n threads (the caller is i = 0), or fn(ctx, 0, 1) alone
 * when `parallel` is false or another caller holds the pool. */
void forge_run_parallel(void (*fn)(const void *, int, int), const void *ctx, int parallel) {
    if (parallel && pool.num_threads > 1 && pthread_mutex_trylock(&pool.busy) == 0) {
        const int n = pool.num_threads;
        if (n > 1) {
            pool.fn = fn;
            pool.ctx = ctx;
            atomic_store_explicit(&pool.pending, n - 1, memory_order_relaxed);
            atomic_store_explicit(&pool.parked, 0, memory_order_relaxed);
            atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
            futex_wake_all(&pool.generation);
            fn(ctx, 0, n);
            while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) cpu_relax();
        } else {
            fn(ctx, 0, 1);
        }
        pthread_mutex_unlock(&pool.busy);
        return;
    }
    fn(ctx, 0, 1);
}

/* The workers stop spinning and sleep until the next job: the caller is about to run other threads
 * (Python's), or Python work while the server's own threads want the cores, and a spinning worker
 * would take one of them for up to its spin (a third of a millisecond). */
void forge_pool_park(void) {
    atomic_store_explicit(&pool.parked, 1, memory_order_relaxed);
}

typedef struct { uint8_t *dst; const uint8_t *src; int64_t n; } copy_job;

static void copy_part(const void *ctx, int index, int count) {
    const copy_job *c = ctx;
    const int64_t lo = c->n * index / count / 64 * 64, hi = index + 1 == count ? c->n : c->n * (index + 1) / count / 64 * 64;
    memcpy(c->dst + lo, c->src + lo, (size_t)(hi - lo));
}

/* dst = src (n bytes) on the pool's threads: the benchmarks' measure of memory bandwidth. */
void forge_parallel_copy(uint8_t *dst, const uint8_t *src, int64_t n) {
    const copy_job c = {dst, src, n};
    forge_run_parallel(copy_part, &c, 1);
}
