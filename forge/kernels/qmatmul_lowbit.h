/* What every widening of the low-bit types shares (their type ids and block sizes: qmatmul.h): the
 * 2- and 3-bit K-quants Q2_K and Q3_K, and the table types IQ4_NL, IQ4_XS and MXFP4, whose 4-bit index
 * per value picks one of 16 int8 values, times a block's scale. Each value is widened exactly as
 * ggml means it (forge.kernels.quant_blocks, the reference): every product here is exact in float32.
 * Included by qmatmul.c (the portable widening), qmatmul_avx512.c and qmatmul_avx2.c (the SIMD one and
 * the fused path), qmatmul_int8.c (AVX2's int8 products of the table types).
 */
#ifndef FORGE_QMATMUL_LOWBIT_H
#define FORGE_QMATMUL_LOWBIT_H

#include "qmatmul.h"

/* IQ4_NL's and IQ4_XS's table, and MXFP4's: E2M1's values doubled, its E8M0 scale halved to match. */
static const int8_t IQ4_VALUES[16] __attribute__((aligned(16))) =
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t MXFP4_VALUES[16] __attribute__((aligned(16))) =
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* MXFP4's scale byte e as the float 2^(e - 128), exactly (e of 0 and 1: subnormals). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Q3_K's scale of group i (0..15, 16 values each) from its 12 bytes s: six bits, less 32. */
static inline int q3k_scale(const uint8_t *s, int i) {
    const int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* IQ4_XS's scale of sub-block j (0..7) of super-block b: d * (ls - 32), ls six bits (exact in float). */
static inline float iq4xs_scale(const uint8_t *b, int j) {
    const int high = (int)((b[2] | b[3] << 8) >> (2 * j)) & 3, low = (b[4 + j / 2] >> (4 * (j % 2))) & 15;
    return f16(b) * (float)((low | high << 4) - 32);
}

#endif
