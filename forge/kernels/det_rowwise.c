/* The deterministic numerics' row-wise operations (compiled without -ffast-math and with -ffp-contract=off:
 * forge.kernels.compiled's FILE_FLAGS), on det_math.h's exponential and logarithm. forge.kernels.det_math
 * is their definition in numpy; every build gives its bits.
 */
#include <stdint.h>

#include "det_math.h"

/* out[i] = det_exp(x[i]), 16, 8 or 1 lanes at a time (the same bits). */
void forge_det_exp(const float *x, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, det_exp16(_mm512_loadu_ps(x + i)));
#endif
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, det_exp8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = det_exp(x[i]);
}

/* out[i] = det_log(x[i]) for normal x[i] > 0. */
void forge_det_log(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = det_log(x[i]);
}
