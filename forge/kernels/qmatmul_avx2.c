/* The product's AVX2 forms (builds with AVX2 and FMA, without AVX-512): the widening of the common
 * types eight values at a time, the SIMD form of dequant() (the tiled path's widening), and the fused
 * path of small steps in float32 (two rows of x at a time, the registers being 16). The AVX-512 forms
 * are qmatmul_avx512.c; their shared declarations, qmatmul.h; the overview, qmatmul.c.
 */
#include "qmatmul.h"
#include "qmatmul_lowbit.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The AVX2 forms, eight values at a time: codes widened to 32 bits, converted and scaled with
 * one FMA (one set of helpers for the fused and the tiled path, as qmatmul_avx512.c's). */
static inline __m256i zx8(const uint8_t *q) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)); }

static inline __m256 scaled(__m256i q, float scale, float offset) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(scale), _mm256_set1_ps(offset));
}

/* 16 bytes of nibbles: values 0..15 (low nibbles, w[0..1]) and 16..31 (high, w[2..3]). */
static inline void nibbles16_avx2(const uint8_t *q, float scale, float offset, __m256 *w) {
    const __m256i m = _mm256_set1_epi32(15), b0 = zx8(q), b1 = zx8(q + 8);
    w[0] = scaled(_mm256_and_si256(b0, m), scale, offset);
    w[1] = scaled(_mm256_and_si256(b1, m), scale, offset);
    w[2] = scaled(_mm256_srli_epi32(b0, 4), scale, offset);
    w[3] = scaled(_mm256_srli_epi32(b1, 4), scale, offset);
}

/* Q4_K's 64 values of code bytes j (32 bytes: sub-block 2j low nibbles, 2j+1 high), in order. */
static inline void q4k_pair_avx2(const uint8_t *b, int j, __m256 *w) {
    const float d = f16(b), dmin = f16(b + 2);
    uint8_t sc0, mn0, sc1, mn1;
    k_scale_min(b + 4, 2 * j, &sc0, &mn0);
    k_scale_min(b + 4, 2 * j + 1, &sc1, &mn1);
    const float s0 = d * sc0, o0 = -(dmin * mn0), s1 = d * sc1, o1 = -(dmin * mn1);
    const uint8_t *q = b + 16 + 32 * j;
    const __m256i m = _mm256_set1_epi32(15);
    for (int v = 0; v < 4; v++) {
        const __m256i bv = zx8(q + 8 * v);
        w[v] = scaled(_mm256_and_si256(bv, m), s0, o0);
        w[4 + v] = scaled(_mm256_srli_epi32(bv, 4), s1, o1);
    }
}

/* Q6_K's values 32 i .. 32 i + 31 of half h (i: the quarter), in order, a = d * the scales. */
static inline void q6k_quarter_avx2(const uint8_t *b, int h, int i, __m256 *w) {
    const uint8_t *ql = b + 64 * h + 32 * (i & 1), *qh = b + 128 + 32 * h;
    const int lshift = i < 2 ? 0 : 4, hshift = 2 * i;
    const float d = f16(b + 208);
    const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * i;
    for (int v = 0; v < 4; v++) {
        const __m256i l = _mm256_and_si256(_mm256_srli_epi32(zx8(ql + 8 * v), lshift), _mm256_set1_epi32(15));
        const __m256i hb = _mm256_and_si256(_mm256_srli_epi32(zx8(qh + 8 * v), hshift), _mm256_set1_epi32(3));
        const float a = d * sc[v / 2];
        w[v] = scaled(_mm256_or_si256(l, _mm256_slli_epi32(hb, 4)), a, -32.0f * a);
    }
}

static inline void q8_0_avx2(const uint8_t *b, __m256 *w) {
    const float d = f16(b);
    for (int v = 0; v < 4; v++)
        w[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * v)))),
                             _mm256_set1_ps(d));
}

/* 16 bytes of 4-bit indices (low nibbles values 0..15, high 16..31) into the 16 int8 `values`, times d:
 * each product exact. */
static inline void lut32_avx2(const uint8_t *q, const int8_t *values, float d, __m256 *w) {
    const __m128i t = _mm_load_si128((const __m128i *)values), b = _mm_loadu_si128((const __m128i *)q);
    const __m128i m = _mm_set1_epi8(15);
    const __m128i v[2] = {_mm_shuffle_epi8(t, _mm_and_si128(b, m)),
                          _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(b, 4), m))};
    for (int i = 0; i < 4; i++) {
        const __m128i part = i % 2 ? _mm_srli_si128(v[i / 2], 8) : v[i / 2];
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)), _mm256_set1_ps(d));
    }
}

/* Q2_K's or Q3_K's scale and offset of each group of 16 values of super-block b: a[g] and a[16 + g]
 * (Q2_K: d sc, -dmin mn; Q3_K: d (sc - 32), -4 times that). */
static inline void k23_scales_avx2(const uint8_t *b, int three, float *a) {
    const float d = f16(b + (three ? 108 : 80)), dmin = three ? 0.0f : f16(b + 82);
    for (int g = 0; g < 16; g++) {
        a[g] = d * (float)(three ? q3k_scale(b + 96, g) : b[g] & 15);
        a[16 + g] = three ? -4.0f * a[g] : -(dmin * (float)(b[g] >> 4));
    }
}

/* Q2_K's or Q3_K's values 32 s .. 32 s + 31 of half h of super-block b (a: its k23_scales_avx2), in
 * order: 2-bit codes (byte 32 h + l, bits 2 s), Q3_K's third bit (bit 4 h + s of hmask byte l),
 * code * a[g] + a[16 + g]. */
static inline void k23_quarter_avx2(const uint8_t *b, int three, const float *a, int h, int s, __m256 *w) {
    const uint8_t *q = b + (three ? 32 : 16) + 32 * h;
    for (int v = 0; v < 4; v++) {
        __m256i c = _mm256_and_si256(_mm256_srli_epi32(zx8(q + 8 * v), 2 * s), _mm256_set1_epi32(3));
        if (three)
            c = _mm256_or_si256(c, _mm256_slli_epi32(
                _mm256_and_si256(_mm256_srli_epi32(zx8(b + 8 * v), 4 * h + s), _mm256_set1_epi32(1)), 2));
        const int g = 8 * h + 2 * s + v / 2;
        w[v] = scaled(c, a[g], a[16 + g]);
    }
}

/* One 32-value block (Q4_0, Q4_1, Q8_0, IQ4_NL, MXFP4; or 32 values of F16, BF16: 64 bytes) of b into
 * w[0..3], in order. */
static inline void block32_avx2(int64_t type, const uint8_t *b, __m256 *w) {
    __m256 t[4];
    if (type == T_F16 || type == T_BF16) {
        for (int v = 0; v < 4; v++) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(b + 16 * v));
#if defined(__F16C__)
            if (type == T_F16) {
                w[v] = _mm256_cvtph_ps(h);
                continue;
            }
#else
            if (type == T_F16) {
                float f[8];
                for (int i = 0; i < 8; i++) f[i] = f16(b + 16 * v + 2 * i);
                w[v] = _mm256_loadu_ps(f);
                continue;
            }
#endif
            w[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        return;
    }
    if (type == T_Q8_0) {
        q8_0_avx2(b, w);
        return;
    }
    if (type == T_IQ4_NL || type == T_MXFP4) {
        if (type == T_IQ4_NL) lut32_avx2(b + 2, IQ4_VALUES, f16(b), w);
        else lut32_avx2(b + 1, MXFP4_VALUES, e8m0_half(b[0]), w);
        return;
    }
    const float d = f16(b), o = type == T_Q4_0 ? -8.0f * d : f16(b + 2);
    nibbles16_avx2(b + (type == T_Q4_0 ? 2 : 4), d, o, t);
    w[0] = t[0], w[1] = t[1], w[2] = t[2], w[3] = t[3];
}

int dequant_simd(int64_t type, const uint8_t *b, int64_t n, float *restrict dst) {
    __m256 w[8];
    switch (type) {
    case T_Q4_0:
    case T_Q4_1:
    case T_IQ4_NL:
    case T_MXFP4:
    case T_F16:
    case T_BF16:
    case T_Q8_0: {
        const int64_t bb = 32 / block_values(type) * block_bytes(type);       /* 32 values' bytes */
        for (int64_t blk = 0; blk < n / 32; blk++, b += bb, dst += 32) {
            block32_avx2(type, b, w);
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(dst + 8 * v, w[v]);
        }
        return 1;
    }
    case T_IQ4_XS:
        for (int64_t blk = 0; blk < n / 256; blk++, b += 136)
            for (int j = 0; j < 8; j++, dst += 32) {
                lut32_avx2(b + 8 + 16 * j, IQ4_VALUES, iq4xs_scale(b, j), w);
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(dst + 8 * v, w[v]);
            }
        return 1;
    case T_Q2_K:
    case T_Q3_K: {
        const int three = type == T_Q3_K;
        for (int64_t blk = 0; blk < n / 256; blk++, b += block_bytes(type), dst += 256) {
            float a[32];
            k23_scales_avx2(b, three, a);
            for (int h = 0; h < 2; h++)
                for (int s = 0; s < 4; s++) {
                    k23_quarter_avx2(b, three, a, h, s, w);
                    for (int v = 0; v < 4; v++) _mm256_storeu_ps(dst + 128 * h + 32 * s + 8 * v, w[v]);
                }
        }
        return 1;
    }
    case T_Q4_K:
        for (int64_t blk = 0; blk < n / 256; blk++, b += 144, dst += 256)
            for (int j = 0; j < 4; j++) {
                q4k_pair_avx2(b, j, w);
                for (int v = 0; v < 8; v++) _mm256_storeu_ps(dst + 64 * j + 8 * v, w[v]);
            }
        return 1;
    case T_Q6_K:
        for (int64_t blk = 0; blk < n / 256; blk++, b += 210, dst += 256)
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 4; i++) {
                    q6k_quarter_avx2(b, h, i, w);
                    for (int v = 0; v < 4; v++) _mm256_storeu_ps(dst + 128 * h + 32 * i + 8 * v, w[v]);
                }
        return 1;
    default:
        return 0;
    }
}

#define FMA_ROWS2(mr, c, kpos, wv)                                                                 \
    for (int t = 0; t < (mr); t++)                                                                 \
        acc[t][c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * ldx + (kpos)), (wv), acc[t][c]);

#define FUSED2(mr)                                                                                 \
    static void fused##mr(const float *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,      \
                          const uint8_t *const *rows, float *acc_io) {                             \
        __m256 acc[mr][NR], w[8];                                                                  \
        for (int t = 0; t < (mr); t++)                                                             \
            for (int c = 0; c < NR; c++) acc[t][c] = _mm256_loadu_ps(acc_io + (t * NR + c) * VN);  \
        if (block_values(type) == 256) {      /* Q4_K, Q6_K, Q2_K, Q3_K, IQ4_XS */                \
            const int64_t bb = block_bytes(type);                                                  \
            for (int64_t sb = k0 / 256; sb < k1 / 256; sb++)                                       \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + sb * bb;                                          \
                    for (int l = 0; l < 4; l++) PREFETCH(b + PF_AHEAD + 64 * l);                   \
                    if (type == T_Q4_K) {                                                          \
                        for (int j = 0; j < 4; j++) {                                              \
                            q4k_pair_avx2(b, j, w);                                                \
                            for (int v = 0; v < 8; v++) { FMA_ROWS2(mr, c, sb * 256 + 64 * j + 8 * v, w[v]) } \
                        }                                                                          \
                    } else if (type == T_IQ4_XS) {                                                 \
                        for (int j = 0; j < 8; j++) {                                              \
                            lut32_avx2(b + 8 + 16 * j, IQ4_VALUES, iq4xs_scale(b, j), w);          \
                            for (int v = 0; v < 4; v++) { FMA_ROWS2(mr, c, sb * 256 + 32 * j + 8 * v, w[v]) } \
                        }                                                                          \
                    } else {                                                                       \
                        float a[32];                                                               \
                        if (type != T_Q6_K) k23_scales_avx2(b, type == T_Q3_K, a);                 \
                        for (int h = 0; h < 2; h++)                                                \
                            for (int i = 0; i < 4; i++) {                                          \
                                if (type == T_Q6_K) q6k_quarter_avx2(b, h, i, w);                  \
                                else k23_quarter_avx2(b, type == T_Q3_K, a, h, i, w);              \
                                for (int v = 0; v < 4; v++) {                                      \
                                    FMA_ROWS2(mr, c, sb * 256 + 128 * h + 32 * i + 8 * v, w[v])    \
                                }                                                                  \
                            }                                                                      \
                    }                                                                              \
                }                                                                                  \
        } else {                                                                                   \
            const int64_t bb = 32 / block_values(type) * block_bytes(type);                        \
            for (int64_t blk = k0 / 32; blk < k1 / 32; blk++)                                      \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + blk * bb;                                         \
                    if ((blk & 1) == 0) PREFETCH(b + PF_AHEAD);                                    \
                    block32_avx2(type, b, w);                                                      \
                    for (int v = 0; v < 4; v++) { FMA_ROWS2(mr, c, blk * 32 + 8 * v, w[v]) }       \
                }                                                                                  \
        }                                                                                          \
        for (int t = 0; t < (mr); t++)                                                             \
            for (int c = 0; c < NR; c++) _mm256_storeu_ps(acc_io + (t * NR + c) * VN, acc[t][c]);  \
    }
FUSED2(1)
FUSED2(2)

void fused_rows(int mr, const float *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,
                const uint8_t *const *rows, float *acc) {
    if (mr == 1) fused1(x, ldx, k0, k1, type, rows, acc);
    else fused2(x, ldx, k0, k1, type, rows, acc);
}

#endif
