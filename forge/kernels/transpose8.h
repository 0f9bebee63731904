/* An 8 x 8 transposition of float32 lanes in AVX registers: out[j] lane i = in[i] lane j. Moves only (no
 * arithmetic), so any file may use it whatever its float flags; the deterministic numerics' kernels do
 * (qmatmul_det_unpack.h, det_attention.c). */
#ifndef FORGE_TRANSPOSE8_H
#define FORGE_TRANSPOSE8_H

#if defined(__AVX2__)
#include <immintrin.h>

static inline void transpose8v(const __m256 *in, __m256 *out) {
    __m256 r[8], t[8];
    for (int c = 0; c < 8; c++) r[c] = in[c];
    for (int c = 0; c < 8; c += 2) {
        t[c] = _mm256_unpacklo_ps(r[c], r[c + 1]);
        t[c + 1] = _mm256_unpackhi_ps(r[c], r[c + 1]);
    }
    for (int c = 0; c < 8; c += 4) {
        r[c] = _mm256_shuffle_ps(t[c], t[c + 2], 0x44);
        r[c + 1] = _mm256_shuffle_ps(t[c], t[c + 2], 0xEE);
        r[c + 2] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0x44);
        r[c + 3] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        out[j] = _mm256_permute2f128_ps(r[j], r[j + 4], 0x20);
        out[j + 4] = _mm256_permute2f128_ps(r[j], r[j + 4], 0x31);
    }
}
#endif

#endif
