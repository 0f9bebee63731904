/* The deterministic numerics' exponential and logarithm: each a fixed sequence of float32 operations (one
 * IEEE rounding each, no fused multiply-add), the same in scalar C, 8-lane AVX2 and 16-lane AVX-512 code, so
 * that every build gives the same bits (forge.kernels.det_math is the same in numpy, and the tests hold every
 * build to it). Include only from files compiled without -ffast-math and with -ffp-contract=off
 * (forge.kernels.compiled's FILE_FLAGS).
 *
 *   det_exp(x): x clamped to [-87.33654, 88.72283] (a NaN to the lower bound); n = nearest-even(x * log2(e)); r = (x - n * C1) - n * C2
 *     (C1 + C2 = ln 2, C1 with 9 significant bits: n * C1 exact); p = Cephes' degree-5 polynomial in r by
 *     Horner's rule; y = ((p * r) * r + r) + 1; the result y * 2^n (2^n made from its exponent bits: exact).
 *     Within 2 ulp of exp; exp(0) = 1 exactly.
 *   det_log(x), for normal x > 0: x = m * 2^e with m in (sqrt(1/2), sqrt(2)]; f = m - 1 (exact); z = f * f;
 *     y = ((f * z) * P(f) + e * L2) - 0.5 * z; the result (f + y) + e * L1 (L1 + L2 = ln 2). Within 2 ulp.
 */
#ifndef FORGE_DET_MATH_H
#define FORGE_DET_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define DET_EXP_LO -87.33654f
#define DET_EXP_HI 88.72283f
#define DET_LOG2E 1.44269504088896341f
#define DET_C1 0.693359375f
#define DET_C2 -2.12194440e-4f
#define DET_P0 1.9875691500e-4f
#define DET_P1 1.3981999507e-3f
#define DET_P2 8.3334519073e-3f
#define DET_P3 4.1665795894e-2f
#define DET_P4 1.6666665459e-1f
#define DET_P5 5.0000001201e-1f

static inline float det_pow2i(int32_t n) {          /* 2^n for -126 <= n <= 127 */
    const uint32_t bits = (uint32_t)(n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float det_exp(float x) {
    x = x > DET_EXP_LO ? x : DET_EXP_LO;             /* as VMAXPS and VMINPS: a NaN becomes the bound */
    x = x < DET_EXP_HI ? x : DET_EXP_HI;
    const float n = nearbyintf(x * DET_LOG2E);
    float r = x - n * DET_C1;
    r = r - n * DET_C2;
    float p = DET_P0;
    p = p * r + DET_P1;
    p = p * r + DET_P2;
    p = p * r + DET_P3;
    p = p * r + DET_P4;
    p = p * r + DET_P5;
    const float y = ((p * r) * r + r) + 1.0f;
    return y * det_pow2i((int32_t)n);
}

#define DET_L1 0.693359375f
#define DET_L2 -2.12194440e-4f

static inline float det_log(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    int32_t e = (int32_t)((bits >> 23) & 255) - 127;
    bits = (bits & 0x007fffffu) | 0x3f800000u;       /* m in [1, 2) */
    float m;
    memcpy(&m, &bits, 4);
    if (m > 1.41421356f) {
        m = m * 0.5f;                                 /* exact */
        e += 1;
    }
    const float f = m - 1.0f, z = f * f, fe = (float)e;
    float p = 7.0376836292e-2f;
    p = p * f - 1.1514610310e-1f;
    p = p * f + 1.1676998740e-1f;
    p = p * f - 1.2420140846e-1f;
    p = p * f + 1.4249322787e-1f;
    p = p * f - 1.6668057665e-1f;
    p = p * f + 2.0000714765e-1f;
    p = p * f - 2.4999993993e-1f;
    p = p * f + 3.3333331174e-1f;
    float y = (f * z) * p + fe * DET_L2;
    y = y - 0.5f * z;
    return (f + y) + fe * DET_L1;
}

#if defined(__AVX2__)
/* det_exp of 8 lanes: the same operations lane by lane. */
static inline __m256 det_exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(DET_EXP_LO));
    x = _mm256_min_ps(x, _mm256_set1_ps(DET_EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(DET_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(DET_C1)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(DET_C2)));
    __m256 p = _mm256_set1_ps(DET_P0);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(DET_P1));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(DET_P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(DET_P3));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(DET_P4));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(DET_P5));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
/* det_exp of 16 lanes. */
static inline __m512 det_exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(DET_EXP_LO));
    x = _mm512_min_ps(x, _mm512_set1_ps(DET_EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(DET_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(DET_C1)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(DET_C2)));
    __m512 p = _mm512_set1_ps(DET_P0);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(DET_P1));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(DET_P2));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(DET_P3));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(DET_P4));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(DET_P5));
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

#endif
