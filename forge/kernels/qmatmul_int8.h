/* What the `fast` numerics' int8 products share (qmatmul_int8.c; the K-quants' on AVX-512:
 * qmatmul_int8_avx512.c): their loads and the guard of their float arithmetic, and the K-quants'
 * scales and x's codes as both builds take them. The build's paths (HAVE_I8K, ...): qmatmul.h.
 */
#ifndef FORGE_QMATMUL_INT8_H
#define FORGE_QMATMUL_INT8_H

#include "qmatmul.h"

#if defined(HAVE_I8K)
static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* v as computed, hidden from -ffast-math's reassociation: a product of three factors would otherwise be
 * free to be regrouped differently in the one-row and two-row bodies, and a row's bits with it. */
#define OPAQUE(v) __asm__("" : "+x"(v))

/* The quantizers of x (qmatmul_int8.c) keep exact IEEE arithmetic (not -ffast-math's), so that the tests can
 * quantize x the same way: v * id rounded to nearest even (the default rounding, as nearbyintf), then
 * clamped to +-127. Eight lanes at a time, on both AVX2 and AVX-512 builds. */
#define EXACT __attribute__((optimize("no-fast-math")))

/* ---- K-quants in the int8 numerics: x per superblock of 256 values -------------------------------
 * For Q4_K, Q5_K and Q6_K, x is quantized per superblock of 256 values as llama.cpp's Q8_K (one
 * scale dx = max|x| / 127 per superblock), so that a superblock's products stay integers to its end:
 * each 32 codes' products with x (VPMADDUBSW) times their integer scale (VPMADDWD) added into
 * eight int32 sums, then one float scale d * dx per superblock. Q4_K's and Q5_K's mins add
 * -dmin * mn[j] times dx * the sum of x's codes in sub-block j; Q6_K's codes go in unsigned
 * (0..63) and 32 * scale_j * the sum of x's codes in group j of 16 values comes off the sums.
 * On AVX2 every step size takes this path: a panel's superblocks unpacked once into a thread's buffer
 * (codes, scales, mins) for a tile of rows of x, then each group of up to KR rows of x multiplied
 * with one weight row's records in registers. A row's bits are the same in every step: the same
 * records and the same sums in the same order (batch invariance, as in the reference numerics).
 * AVX-512 builds take the same x, codes and sums through kernels of their own (k_direct for decode
 * steps, kg_panels for bigger ones: qmatmul_int8_avx512.c). */

/* Byte shuffles that spread sub-block j's scales from a record's sv over a vector as VPMADDWD takes
 * them: group 2j's scale in the low 16 values' lane, group 2j + 1's in the high one. */
static const uint8_t K_SPREAD[8][32] __attribute__((aligned(64))) = {
#define K_SPREAD_ROW(j) {2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, \
                         2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, \
                         2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, \
                         2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1}
    K_SPREAD_ROW(0), K_SPREAD_ROW(1), K_SPREAD_ROW(2), K_SPREAD_ROW(3),
    K_SPREAD_ROW(4), K_SPREAD_ROW(5), K_SPREAD_ROW(6), K_SPREAD_ROW(7),
#undef K_SPREAD_ROW
};

/* Q6_K's sixteen int8 scales (at sc) as a record's sv: int16, the even groups' then the odd ones'. */
static inline __m256i q6k_sv(const int8_t *sc) {
    const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)sc), evens_odds));
}

/* Q4_K's and Q5_K's superblock b: the twelve bytes of six-bit scales and mins as eight scale bytes
 * (u[0], u[1]), then eight min bytes (u[2], u[3]). */
static inline void k4_bytes(const uint8_t *b, uint32_t *u) {
    memcpy(u, b + 4, 12);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
    const uint32_t mins_lo = u[1] & low6;
    u[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
    u[2] = mins_lo;
    u[0] &= low6;
}

/* Q4_K's and Q5_K's superblock b: its scales as a record's sv (sc[j] for groups 2j and 2j + 1),
 * -dmin * mn[j] of each sub-block into *mins, and the bytes they came from into u[4] (k4_bytes). */
static inline __m256i k4_sv(const uint8_t *b, uint32_t *u, __m256 *mins) {
    const float dmin = f16(b + 2);
    k4_bytes(b, u);
    const __m128i sc16 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)u));
    __m256 m = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2)))),
                             _mm256_set1_ps(-dmin));
    OPAQUE(m);
    *mins = m;
    return _mm256_set_m128i(sc16, sc16);
}

/* Q6_K's offset of 32 in a superblock's sums: 32 * sv[g] * (the sum of x's codes in group g), the groups
 * added in pairs into eight int32 (sv and the sums b in the same even-then-odd order). */
static inline __m256i q6_offset(__m256i sv, const int16_t *b) {
    return _mm256_slli_epi32(_mm256_madd_epi16(sv, load32((const uint8_t *)b)), 5);
}

/* Rows of x as int8 codes per superblock: codes [T, K], dx [T, K/256], s [T, K/32] (dx * the sum
 * of each 32 codes), sums [T, K/16] (each 16 codes' sum). */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int16_t *b;
    const int32_t *p;       /* AVX-512's big steps: per superblock, the sums per 32 in pairs (4), then per 16 (8) */
} xk;

#endif

#endif
