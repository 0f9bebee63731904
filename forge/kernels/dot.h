/* The float32 dot product forge's C kernels share: 16 partial sums, so the compiler vectorises the
 * loop (it may not reorder a single running sum); the lanes are added at the end. */
#ifndef FORGE_DOT_H
#define FORGE_DOT_H

#include <stdint.h>

#define LANES 16

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++)
            acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++)
        s += acc[j];
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

#endif
