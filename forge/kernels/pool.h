/* The thread pool of forge's compiled kernels (pool.c): the library's one set of worker threads, on
 * which the products (qmatmul.c) and decode attention (paged_attention.c) split their work, so that
 * two pools never compete for the same cores. Python sizes it (forge.kernels.products.pool_threads)
 * and parks it between steps (pool_park). */
#ifndef FORGE_POOL_H
#define FORGE_POOL_H

#include <stdint.h>

/* fn(ctx, i, n) for i < n on the pool's n threads (the caller is i = 0), or fn(ctx, 0, 1) alone when
 * `parallel` is false or another caller holds the pool. Within the library only. */
__attribute__((visibility("hidden"))) void forge_run_parallel(void (*fn)(const void *, int, int), const void *ctx,
                                                              int parallel);

/* Resize the pool to num_threads (the caller counted; spin >= 0: the pause loops a worker spins before it
 * sleeps); returns the count in force. */
int forge_pool_threads(int num_threads, int64_t spin);

/* The workers stop spinning and sleep until the next job. */
void forge_pool_park(void);

/* dst = src (n bytes) on the pool's threads: the benchmarks' measure of memory bandwidth. */
void forge_parallel_copy(uint8_t *dst, const uint8_t *src, int64_t n);

#endif
