/* The product's AVX-512 forms: the widening of the common types sixteen values at a time, the SIMD
 * form of dequant() (the tiled path's widening), the fused path of small steps (float32, and bfloat16
 * for the `fast` numerics), and the `fast` numerics' bigger steps: 32 rows of W in the lanes
 * (widen_pairs, bg_rows) and, where the CPU and Linux allow, the AMX tiles. The AVX2 forms are
 * qmatmul_avx2.c; the K-quants' int8 products on AVX-512, qmatmul_int8_avx512.c; their shared
 * declarations, qmatmul.h; the overview, qmatmul.c.
 */
#include <stdatomic.h>

#include "qmatmul.h"
#include "qmatmul_lowbit.h"

#if defined(__AVX512F__)
/* AVX-512 widening of the common types, one set of helpers for both paths (so that the fused
 * small-step path and the tiled path see the very same weights): a 4-bit code picks its value
 * from a 16-entry table (scale * i + offset, i < 16) with one permute; 6- and 8-bit codes are
 * converted and scaled. */
static inline __m512i zx16(const uint8_t *q) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)); }

static inline __m512 table(float scale, float offset) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
}

/* The same from scales already in every lane. */
static inline __m512 table_v(__m512 scale, __m512 offset) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(iota, scale, offset);
}

/* 16 bytes of nibbles: values 0..15 (low nibbles) and 16..31 (high), both from table t. */
static inline void nibbles16(const uint8_t *q, __m512 t, __m512 *w) {
    const __m512i b = zx16(q);
    w[0] = _mm512_permutexvar_ps(b, t);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);
}

/* Q4_K's scales of one super-block b into s[16]: s[j] = d * sc_j, s[8 + j] = -(dmin * mn_j), j < 8. They
 * go through memory so that each table below takes its two from broadcast loads, not a permute per lane
 * (one operation fewer per 16 values: the one-row decode's float32 path is compute-bound on Zen 4). */
static inline void q4k_scales(const uint8_t *b, float *s) {
    uint32_t u[3];
    memcpy(u, b + 4, 12);
    const uint32_t sc_lo = u[0] & 0x3f3f3f3fu, mn_lo = u[1] & 0x3f3f3f3fu;
    const uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_setr_epi32((int)sc_lo, (int)sc_hi, (int)mn_lo,
                                                                            (int)mn_hi)));
    const __m512 m = _mm512_mask_mov_ps(_mm512_set1_ps(f16(b)), 0xFF00, _mm512_set1_ps(-f16(b + 2)));
    _mm512_storeu_ps(s, _mm512_mul_ps(v, m));
}

/* Q4_K's values 64 j .. 64 j + 63 of a super-block (q = its 32 code bytes j, s its q4k_scales), in order. */
static inline void q4k_pair(const uint8_t *q, const float *s, int j, __m512 *w) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i b0 = zx16(q), b1 = zx16(q + 16);
    const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[2 * j]), _mm512_set1_ps(s[8 + 2 * j]));
    const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[2 * j + 1]), _mm512_set1_ps(s[9 + 2 * j]));
    w[0] = _mm512_permutexvar_ps(b0, t0);
    w[1] = _mm512_permutexvar_ps(b1, t0);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), t1);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), t1);
}

/* Q6_K's scales of one super-block: a[i] = d * sc_i and a[16 + i] = -32 a[i], i < 16. */
static inline void q6k_scales(const uint8_t *b, float *a) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192))));
    const __m512 d = _mm512_mul_ps(v, _mm512_set1_ps(f16(b + 208)));
    _mm512_storeu_ps(a, d);
    _mm512_storeu_ps(a + 16, _mm512_mul_ps(d, _mm512_set1_ps(-32.0f)));
}

/* 16 six-bit codes from 16 bytes of low bits l (the high nibbles when lshift) and 16 bytes of high bit
 * pairs h (bits hshift, hshift + 1), put together in bytes, then q * a[0] + a[16] (= (q - 32) a,
 * one rounding). In bytes, 16 codes at a time, they take fewer operations than in 32-bit lanes. */
static inline __m512 six16(__m128i l, int lshift, __m128i h, int hshift, const float *a) {
    const __m128i lo = lshift ? _mm_srli_epi16(l, 4) : l;
    const __m128i hi = hshift <= 4 ? _mm_slli_epi16(h, 4 - hshift) : _mm_srli_epi16(h, hshift - 4);
    const __m128i q = _mm_ternarylogic_epi32(lo, _mm_and_si128(hi, _mm_set1_epi8(0x30)), _mm_set1_epi8(0x0F),
                                             0xEC);                   /* (lo & 0x0F) | hi */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(a[0]), _mm512_set1_ps(a[16]));
}

/* Q6_K's values 128 h .. 128 h + 127 of a super-block b (a: its q6k_scales), in order. */
static inline void q6k_half(const uint8_t *b, const float *a, int h, __m512 *w) {
    const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
    const float *s = a + 8 * h;
    for (int g = 0; g < 2; g++) {                   /* values 16 g .. 16 g + 15 of each quarter */
        const __m128i l0 = _mm_loadu_si128((const __m128i *)(ql + 16 * g));
        const __m128i l1 = _mm_loadu_si128((const __m128i *)(ql + 32 + 16 * g));
        const __m128i hb = _mm_loadu_si128((const __m128i *)(qh + 16 * g));
        w[g] = six16(l0, 0, hb, 0, s + g);
        w[2 + g] = six16(l1, 0, hb, 2, s + 2 + g);
        w[4 + g] = six16(l0, 4, hb, 4, s + 4 + g);
        w[6 + g] = six16(l1, 4, hb, 6, s + 6 + g);
    }
}


/* The table types' 16 values (IQ4_VALUES, MXFP4_VALUES) times a block's scale: each product exact. */
static inline __m512 lut_v(const int8_t *values, __m512 scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)values))), scale);
}

static inline __m512 lut(const int8_t *values, float scale) { return lut_v(values, _mm512_set1_ps(scale)); }

/* The float16 at p in every lane, converted in a vector: no scalar conversion, which merges into its
 * destination register's upper lanes and so waits on that register's last writer. */
static inline __m512 f16_all(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
}

static inline void q8_0_block(const uint8_t *b, __m512 *w) {
    const __m512 d = f16_all(b);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
}

/* 16 bfloat16 at p as float32: their bits, shifted into the high half. */
static inline __m512 bf16x16(const uint8_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 32 values of F16 or BF16 at b (64 bytes), in order, into w[0] and w[1]. */
static inline void half32(int64_t type, const uint8_t *b, __m512 *w) {
    if (type == T_F16) {
        w[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        w[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
    } else {
        w[0] = bf16x16(b);
        w[1] = bf16x16(b + 32);
    }
}

/* One block of 32 values of Q4_0, Q4_1, Q8_0, IQ4_NL or MXFP4 at b, in order, into w[0] and w[1]: every
 * path's widening of these types (dequant, the fused path, widen_pairs). */
static inline void block32(int64_t type, const uint8_t *b, __m512 *w) {
    if (type == T_Q4_0) {          /* the scales converted in vectors: f16_all */
        const __m512 d = f16_all(b);
        nibbles16(b + 2, table_v(d, _mm512_mul_ps(d, _mm512_set1_ps(-8.0f))), w);
    } else if (type == T_Q4_1) {
        nibbles16(b + 4, table_v(f16_all(b), f16_all(b + 2)), w);
    } else if (type == T_IQ4_NL) {
        nibbles16(b + 2, lut_v(IQ4_VALUES, f16_all(b)), w);
    } else if (type == T_MXFP4) {
        nibbles16(b + 1, lut(MXFP4_VALUES, e8m0_half(b[0])), w);
    } else {
        q8_0_block(b, w);
    }
}

/* Q2_K's scales of one super-block: a[g] = d * sc_g, a[16 + g] = -(dmin * mn_g), per group g of 16. */
static inline void q2k_scales(const uint8_t *b, float *a) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), f16_all(b + 80)));
    _mm512_storeu_ps(a + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)),
                                           _mm512_xor_ps(f16_all(b + 82), _mm512_set1_ps(-0.0f))));
}

/* Q3_K's scales of one super-block: a[g] = d * (sc_g - 32) (q3k_scale's, sixteen lanes at once). */
static inline void q3k_scales(const uint8_t *b, float *a) {
    int64_t low;
    int32_t high;
    memcpy(&low, b + 96, 8);
    memcpy(&high, b + 104, 4);
    const __m512i lo = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(low)),      /* group g: byte g % 8 */
                                         _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4));
    const __m512i hi = _mm512_srlv_epi32(_mm512_set1_epi32(high),                          /* byte 8 + g % 4 */
                                         _mm512_setr_epi32(0, 8, 16, 24, 2, 10, 18, 26, 4, 12, 20, 28, 6, 14, 22, 30));
    /* bits 0-3 lo's, 4-5 hi's (0xE4: the third operand's bits pick the first, the others the second) */
    const __m512i both = _mm512_ternarylogic_epi32(lo, _mm512_slli_epi32(hi, 4), _mm512_set1_epi32(15), 0xE4);
    const __m512i sc = _mm512_sub_epi32(_mm512_and_si512(both, _mm512_set1_epi32(63)), _mm512_set1_epi32(32));
    _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_cvtepi32_ps(sc), f16_all(b + 108)));
}

/* Q2_K's (hm NULL) or Q3_K's values 128 h .. 128 h + 127 of a super-block (a: its scales), in order:
 * 2-bit codes (byte 32 h + l, bits 2 s: value 32 s + l), Q3_K's third bit from hm (bit 4 h + s of
 * byte l). Each group's values are a table of 16 lanes, q * a[g] + a[16 + g] (one rounding: Q2_K) or
 * (q - 4) a[g] (exact: Q3_K), repeating every 4 (or 8) lanes, so that one permute takes the code
 * from an index's low bits whatever lies above them: no masking, no conversion per value. */
static inline void k23_half(const uint8_t *q, const uint8_t *hm, const float *a, int h, __m512 *w) {
    const __m512 codes = hm ? _mm512_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3)
                            : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    for (int k = 0; k < 2; k++) {
        const __m512i lo = zx16(q + 32 * h + 16 * k), hi = hm ? zx16(hm + 16 * k) : _mm512_setzero_si512();
        for (int s = 0; s < 4; s++) {
            const int g = 8 * h + 2 * s + k, at = 4 * h + s;     /* at: the third bit's place in hm */
            __m512i idx = _mm512_srli_epi32(lo, 2 * s);
            __m512 t;
            if (hm) {
                const __m512i third = at >= 2 ? _mm512_srli_epi32(hi, at - 2) : _mm512_slli_epi32(hi, 2 - at);
                idx = _mm512_ternarylogic_epi32(idx, third, _mm512_set1_epi32(3), 0xE4);   /* bits 0-1: idx's */
                t = _mm512_mul_ps(codes, _mm512_set1_ps(a[g]));
            } else {
                t = _mm512_fmadd_ps(codes, _mm512_set1_ps(a[g]), _mm512_set1_ps(a[16 + g]));
            }
            w[2 * s + k] = _mm512_permutexvar_ps(idx, t);
        }
    }
}

/* IQ4_XS's eight sub-block scales of super-block b into s[8]. */
static inline void iq4xs_scales(const uint8_t *b, float *s) {
    for (int j = 0; j < 8; j++) s[j] = iq4xs_scale(b, j);
}

/* The AVX-512 form of dequant() for the types it covers; 0 when it does not cover `type`. */
int dequant_simd(int64_t type, const uint8_t *b, int64_t n, float *restrict dst) {
    __m512 w[8];
    for (int64_t off = 0; off < n / block_values(type) * block_bytes(type); off += 64) PREFETCH(b + PF_AHEAD + off);
    switch (type) {
    case T_Q4_0:
    case T_Q4_1:
    case T_Q8_0:
        for (int64_t blk = 0, bb = block_bytes(type); blk < n / 32; blk++, b += bb, dst += 32) {
            block32(type, b, w);
            _mm512_storeu_ps(dst, w[0]);
            _mm512_storeu_ps(dst + 16, w[1]);
        }
        return 1;
    case T_Q4_K:
        for (int64_t blk = 0; blk < n / 256; blk++, b += 144, dst += 256) {
            float s[16];
            q4k_scales(b, s);
            for (int j = 0; j < 4; j++) {
                q4k_pair(b + 16 + 32 * j, s, j, w);
                for (int v = 0; v < 4; v++) _mm512_storeu_ps(dst + 64 * j + 16 * v, w[v]);
            }
        }
        return 1;
    case T_Q6_K:
        for (int64_t blk = 0; blk < n / 256; blk++, b += 210, dst += 256) {
            float a[32];
            q6k_scales(b, a);
            for (int h = 0; h < 2; h++) {
                q6k_half(b, a, h, w);
                for (int v = 0; v < 8; v++) _mm512_storeu_ps(dst + 128 * h + 16 * v, w[v]);
            }
        }
        return 1;
    case T_Q2_K:
    case T_Q3_K: {
        const int three = type == T_Q3_K, bb = three ? 110 : 84;
        for (int64_t blk = 0; blk < n / 256; blk++, b += bb, dst += 256) {
            float a[32];
            if (three) q3k_scales(b, a);
            else q2k_scales(b, a);
            for (int h = 0; h < 2; h++) {
                k23_half(b + (three ? 32 : 16), three ? b : NULL, a, h, w);
                for (int v = 0; v < 8; v++) _mm512_storeu_ps(dst + 128 * h + 16 * v, w[v]);
            }
        }
        return 1;
    }
    case T_IQ4_NL:
    case T_MXFP4:
    case T_F16:
    case T_BF16:
        for (int64_t blk = 0, bb = 32 / block_values(type) * block_bytes(type); blk < n / 32; blk++) {
            if (block_values(type) == 1) half32(type, b + blk * bb, w);
            else block32(type, b + blk * bb, w);
            _mm512_storeu_ps(dst + 32 * blk, w[0]);
            _mm512_storeu_ps(dst + 32 * blk + 16, w[1]);
        }
        return 1;
    case T_IQ4_XS:
        for (int64_t blk = 0; blk < n / 256; blk++, b += 136) {
            float s[8];
            iq4xs_scales(b, s);
            for (int j = 0; j < 8; j++, dst += 32) {
                nibbles16(b + 8 + 16 * j, lut(IQ4_VALUES, s[j]), w);
                _mm512_storeu_ps(dst, w[0]);
                _mm512_storeu_ps(dst + 16, w[1]);
            }
        }
        return 1;
    default:
        return 0;
    }
}

/* The fused path (steps of up to FUSED_MAX_ROWS rows, FR at a time): each panel's weights widened
 * in registers and multiplied at once (no round trip through a buffer), every out[t][c] the same
 * running sum as the tiled path's. */
#define FMA_ROWS(mr, c, kpos, wv)                                                                  \
    for (int t = 0; t < (mr); t++)                                                                 \
        acc[t][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * ldx + (kpos)), (wv), acc[t][c]);

/* The fused body, once per numerics: `name`##mr over x of type xt, PAIR(mr, c, kpos, w0, w1) adding
 * the products of 32 widened weights (w0: values kpos .. kpos + 15, w1: the next 16) for rows
 * t < mr into acc[t][c]. */
#define FUSED_OF(name, xt, PAIR, mr)                                                              \
    static void name##mr(const xt *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,          \
                          const uint8_t *const *rows, float *acc_io) {                             \
        __m512 acc[mr][NR], w[8];                                                                  \
        for (int t = 0; t < (mr); t++)                                                             \
            for (int c = 0; c < NR; c++) acc[t][c] = _mm512_loadu_ps(acc_io + (t * NR + c) * VN);  \
        switch (type) {                                                                            \
        case T_Q4_K:                                                                               \
            for (int64_t sb = k0 / 256; sb < k1 / 256; sb++) {                                     \
                float s[NR][16];                                                                   \
                for (int c = 0; c < NR; c++) {                                                     \
                    PREFETCH(rows[c] + sb * 144 + PF_AHEAD);                                       \
                    PREFETCH(rows[c] + sb * 144 + PF_AHEAD + 64);                                  \
                    PREFETCH(rows[c] + sb * 144 + PF_AHEAD + 128);                                 \
                    q4k_scales(rows[c] + sb * 144, s[c]);                                          \
                }                                                                                  \
                for (int j = 0; j < 4; j++)                                                        \
                    for (int c = 0; c < NR; c++) {                                                 \
                        q4k_pair(rows[c] + sb * 144 + 16 + 32 * j, s[c], j, w);                    \
                        PAIR(mr, c, sb * 256 + 64 * j, w[0], w[1]) PAIR(mr, c, sb * 256 + 64 * j + 32, w[2], w[3]) \
                    }                                                                              \
            }                                                                                      \
            break;                                                                                 \
        case T_Q6_K:                                                                               \
            for (int64_t sb = k0 / 256; sb < k1 / 256; sb++)                                       \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + sb * 210;                                         \
                    for (int l = 0; l < 4; l++) PREFETCH(b + PF_AHEAD + 64 * l);                   \
                    float a[32];                                                                   \
                    q6k_scales(b, a);                                                              \
                    for (int h = 0; h < 2; h++) {                                                  \
                        q6k_half(b, a, h, w);                                                      \
                        for (int v = 0; v < 8; v += 2) { PAIR(mr, c, sb * 256 + 128 * h + 16 * v, w[v], w[v + 1]) } \
                    }                                                                              \
                }                                                                                  \
            break;                                                                                 \
        case T_Q2_K:                                                                               \
        case T_Q3_K: {                                                                             \
            const int three = type == T_Q3_K, bb = three ? 110 : 84;                               \
            for (int64_t sb = k0 / 256; sb < k1 / 256; sb++)                                       \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + sb * bb;                                          \
                    PREFETCH(b + PF_AHEAD);                                                        \
                    PREFETCH(b + PF_AHEAD + 64);                                                   \
                    PREFETCH(b + PF_AHEAD + bb - 1);                                               \
                    float a[32];                                                                   \
                    if (three) q3k_scales(b, a);                                                   \
                    else q2k_scales(b, a);                                                         \
                    for (int h = 0; h < 2; h++) {                                                  \
                        k23_half(b + (three ? 32 : 16), three ? b : NULL, a, h, w);                \
                        for (int v = 0; v < 8; v += 2) { PAIR(mr, c, sb * 256 + 128 * h + 16 * v, w[v], w[v + 1]) } \
                    }                                                                              \
                }                                                                                  \
            break;                                                                                 \
        }                                                                                          \
        case T_IQ4_XS:                                                                             \
            for (int64_t sb = k0 / 256; sb < k1 / 256; sb++) {                                     \
                float s[NR][8];                                                                    \
                for (int c = 0; c < NR; c++) {                                                     \
                    PREFETCH(rows[c] + sb * 136 + PF_AHEAD);                                       \
                    PREFETCH(rows[c] + sb * 136 + PF_AHEAD + 64);                                  \
                    PREFETCH(rows[c] + sb * 136 + PF_AHEAD + 128);                                 \
                    iq4xs_scales(rows[c] + sb * 136, s[c]);                                        \
                }                                                                                  \
                for (int j = 0; j < 8; j++)                                                        \
                    for (int c = 0; c < NR; c++) {                                                 \
                        nibbles16(rows[c] + sb * 136 + 8 + 16 * j, lut(IQ4_VALUES, s[c][j]), w);   \
                        PAIR(mr, c, sb * 256 + 32 * j, w[0], w[1])                                 \
                    }                                                                              \
            }                                                                                      \
            break;                                                                                 \
        case T_F16:                                                                                \
        case T_BF16:                                                                               \
            for (int64_t blk = k0 / 32; blk < k1 / 32; blk++)                                      \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + blk * 64;                                         \
                    PREFETCH(b + PF_AHEAD);                                                        \
                    half32(type, b, w);                                                            \
                    PAIR(mr, c, blk * 32, w[0], w[1])                                              \
                }                                                                                  \
            break;                                                                                 \
        case T_Q4_0:                                                                               \
        case T_Q4_1:                                                                               \
        case T_IQ4_NL:                                                                             \
        case T_MXFP4:                                                                              \
        case T_Q8_0: {                                                                             \
            const int64_t bb = block_bytes(type);                                                  \
            for (int64_t blk = k0 / 32; blk < k1 / 32; blk++)                                      \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + blk * bb;                                         \
                    if ((blk & 1) == 0) PREFETCH(b + PF_AHEAD);                                    \
                    block32(type, b, w);                                                           \
                    PAIR(mr, c, blk * 32, w[0], w[1])                                              \
                }                                                                                  \
            break;                                                                                 \
        }                                                                                          \
        }                                                                                          \
        for (int t = 0; t < (mr); t++)                                                             \
            for (int c = 0; c < NR; c++) _mm512_storeu_ps(acc_io + (t * NR + c) * VN, acc[t][c]);  \
    }
#define FMA_PAIR(mr, c, kpos, w0, w1) FMA_ROWS(mr, c, kpos, w0) FMA_ROWS(mr, c, (kpos) + 16, w1)
#define FUSED(mr) FUSED_OF(fused, float, FMA_PAIR, mr)
FUSED(1)
FUSED(2)
FUSED(3)
FUSED(4)

void fused_rows(int mr, const float *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,
                const uint8_t *const *rows, float *acc) {
    switch (mr) {
    case 1: fused1(x, ldx, k0, k1, type, rows, acc); break;
    case 2: fused2(x, ldx, k0, k1, type, rows, acc); break;
    case 3: fused3(x, ldx, k0, k1, type, rows, acc); break;
    case 4: fused4(x, ldx, k0, k1, type, rows, acc); break;
    }
}

#if defined(HAVE_BF16)
/* The `fast` numerics (forge_qmatmul's bf16 flag): x and the widened weights rounded to bfloat16
 * (round to nearest even), each pair of products added into a float32 lane by one VDPBF16PS,
 * twice the multiplies of an FMA. Every weight is widened exactly as above first, then rounded,
 * the same in both paths; lane l of a 32-value group sums values 2 l and 2 l + 1, the lanes
 * added by reduce_row's tree: the same bits for a row in every step of up to FUSED_MAX_ROWS_BF16
 * rows (bigger ones put weight rows in the lanes: bg_rows, below). */
#define DP_ROWS(mr, c, kpos, wv)                                                                   \
    for (int t = 0; t < (mr); t++) acc[t][c] = _mm512_dpbf16_ps(acc[t][c], bh_load(x + t * ldx + (kpos)), (wv));

#define DP_PAIR(mr, c, kpos, w0, w1) DP_ROWS(mr, c, kpos, bh_pair(w0, w1))
#define FUSED_BF16(mr) FUSED_OF(fusedb, bf16_t, DP_PAIR, mr)
FUSED_BF16(1)
FUSED_BF16(2)
FUSED_BF16(3)
FUSED_BF16(4)

void fused_rows_bf16(int mr, const bf16_t *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,
                     const uint8_t *const *rows, float *acc) {
    switch (mr) {
    case 1: fusedb1(x, ldx, k0, k1, type, rows, acc); break;
    case 2: fusedb2(x, ldx, k0, k1, type, rows, acc); break;
    case 3: fusedb3(x, ldx, k0, k1, type, rows, acc); break;
    case 4: fusedb4(x, ldx, k0, k1, type, rows, acc); break;
    }
}

/* rows r0 .. r0 + n (n <= 32) of part pt as pairs of bfloat16 in the lanes (the AMX tiles' layout, and
 * bg_rows'): for 32 values of K (chunk ks) and 16 rows of W (cb), 16 vectors of 16 pairs:
 * panel[((ks * 2 + cb) * 16 + p) * 16 + c] = values 2p and 2p + 1 of chunk ks of row 16 cb + c, as one
 * 32-bit unit (rows past n are zero). rows_bf [16][256] bfloat16 and row [256] float32: scratch. */
static void widen_pairs(const qpart *pt, int64_t K, int64_t row_bytes, int64_t r0, int64_t n, float *row,
                        bf16_t *rows_bf, uint32_t *panel) {
    const int64_t halves = 2;
    const int64_t type = pt->type;
    if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_IQ4_NL || type == T_MXFP4) {
        /* a block a chunk: widened in registers */
        const int64_t bb = block_bytes(type);
        for (int64_t cb = 0; cb < halves; cb++)
            for (int64_t ks = 0; ks < K / 32; ks++) {
                __m512i r[16];
                for (int64_t c = 0; c < 16; c++) {
                    if (cb * 16 + c >= n) {
                        r[c] = _mm512_setzero_si512();
                        continue;
                    }
                    const uint8_t *b = pt->data + (r0 + cb * 16 + c) * row_bytes + ks * bb;
                    PREFETCH(b + PF_AHEAD);             /* the next groups' rows, on their way */
                    __m512 w[2];
                    block32(type, b, w);
                    r[c] = (__m512i)bh_pair(w[0], w[1]);
                }
                transpose16(r);
                uint32_t *tile = panel + (ks * halves + cb) * 256;
                for (int q = 0; q < 16; q++) _mm512_storeu_si512(tile + q * 16, r[q]);
            }
        return;
    }
    /* 16 rows at a time, 256 values of K at a time: widened, rounded and transposed in L1 */
    for (int64_t cb = 0; cb < halves; cb++)
        for (int64_t k0 = 0; k0 < K; k0 += 256) {
            const int64_t len = K - k0 < 256 ? K - k0 : 256;
            for (int64_t c = 0; c < 16; c++) {
                bf16_t *dst = rows_bf + c * 256;
                if (cb * 16 + c < n) {
                    dequant(pt->type, pt->data + (r0 + cb * 16 + c) * row_bytes, k0, len, row);
                    to_bf16(row, len, dst);
                } else {
                    memset(dst, 0, (size_t)len * sizeof *dst);
                }
            }
            for (int64_t ks = k0 / 32; ks < (k0 + len) / 32; ks++) {
                __m512i r[16];
                for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_si512(rows_bf + c * 256 + (ks * 32 - k0));
                transpose16(r);
                uint32_t *tile = panel + (ks * halves + cb) * 256;
                for (int q = 0; q < 16; q++) _mm512_storeu_si512(tile + q * 16, r[q]);
            }
        }
}


/* ---- bigger `fast` steps of the other types on AVX-512 BF16: weight rows in the lanes ----------------
 * Steps of more than FUSED_MAX_ROWS_BF16 rows put 32 rows of W in two vectors' lanes as the AMX tiles
 * read them (widen_pairs, once per step; the types of 32-value blocks widened in registers, a block a chunk),
 * and each pair of values of a row of x, broadcast, multiplies both by VDPBF16PS. No sums across lanes
 * at the end, where the tiled path's reduce_row of every 4 x 4 outputs weighed on products of the
 * default model's K of 576, and each broadcast serves 32 weight rows. The broadcast is its own
 * instruction: as VDPBF16PS's {1to16} memory operand the products were slower on Zen 4 (ad hoc).
 * The default model's products at 32 rows, 2 threads, Zen 4: 29.4 against 30.6-35.2 ms a step
 * (docs/benchmarks.md). A row's bits are the same in every step of this size, and differ from smaller
 * steps' (forge_qmatmul_bf16_split). */
#define BG 12                   /* rows of x at a time: 2 x BG of the 32 registers */

/* out[t][0 .. n) for rows t0 .. t0 + mr of x (bfloat16, [T, K]) against a panel of widen_pairs (two
 * halves: 32 rows of W, n <= 32), each broadcast pair of x serving both. */
#define BG_ROWS(mr)                                                                                \
    static void bg_rows##mr(const uint32_t *panel, int64_t K, const bf16_t *xb, int64_t t0, float *out, \
                            int64_t ldo, int64_t n) {                                              \
        const int64_t pairs = K / 2;                                                               \
        const uint32_t *x = (const uint32_t *)(xb + t0 * K);                                       \
        __m512 f[mr], g[mr];                                                                       \
        for (int t = 0; t < (mr); t++) f[t] = g[t] = _mm512_setzero_ps();                          \
        for (int64_t ks = 0; ks < pairs / 16; ks++)                                                \
            for (int q = 0; q < 16; q++) {                                                         \
                const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(panel + ks * 512 + q * 16)); \
                const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(panel + ks * 512 + 256 + q * 16)); \
                for (int t = 0; t < (mr); t++) {                                                   \
                    uint32_t v;                                                                    \
                    memcpy(&v, x + t * pairs + ks * 16 + q, 4);                                    \
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)v);                       \
                    f[t] = _mm512_dpbf16_ps(f[t], xv, w0);                                         \
                    g[t] = _mm512_dpbf16_ps(g[t], xv, w1);                                         \
                }                                                                                  \
            }                                                                                      \
        const __mmask16 m0 = (__mmask16)(n >= 16 ? 0xFFFFu : (1u << n) - 1);                       \
        const __mmask16 m1 = (__mmask16)(n >= 32 ? 0xFFFFu : n <= 16 ? 0u : (1u << (n - 16)) - 1);  \
        for (int t = 0; t < (mr); t++) {                                                           \
            _mm512_mask_storeu_ps(out + (t0 + t) * ldo, m0, f[t]);                                 \
            _mm512_mask_storeu_ps(out + (t0 + t) * ldo + 16, m1, g[t]);                            \
        }                                                                                          \
    }
BG_ROWS(1)
BG_ROWS(2)
BG_ROWS(3)
BG_ROWS(4)
BG_ROWS(5)
BG_ROWS(6)
BG_ROWS(7)
BG_ROWS(8)
BG_ROWS(9)
BG_ROWS(10)
BG_ROWS(11)
BG_ROWS(12)

static void bg_rows(int mr, const uint32_t *panel, int64_t K, const bf16_t *xb, int64_t t0, float *out, int64_t ldo,
                    int64_t n) {
    switch (mr) {
    case 1: bg_rows1(panel, K, xb, t0, out, ldo, n); break;
    case 2: bg_rows2(panel, K, xb, t0, out, ldo, n); break;
    case 3: bg_rows3(panel, K, xb, t0, out, ldo, n); break;
    case 4: bg_rows4(panel, K, xb, t0, out, ldo, n); break;
    case 5: bg_rows5(panel, K, xb, t0, out, ldo, n); break;
    case 6: bg_rows6(panel, K, xb, t0, out, ldo, n); break;
    case 7: bg_rows7(panel, K, xb, t0, out, ldo, n); break;
    case 8: bg_rows8(panel, K, xb, t0, out, ldo, n); break;
    case 9: bg_rows9(panel, K, xb, t0, out, ldo, n); break;
    case 10: bg_rows10(panel, K, xb, t0, out, ldo, n); break;
    case 11: bg_rows11(panel, K, xb, t0, out, ldo, n); break;
    default: bg_rows12(panel, K, xb, t0, out, ldo, n); break;
    }
}

/* Up to 32 rows of W from panel p (within [p, p_hi) and p's part), widened by widen_pairs into a thread's
 * buffer: the AMX tiles' and bg_rows' groups. */
typedef struct {
    const uint32_t *panel;
    placed at;
    int64_t n, end;             /* the rows, and the panel after them */
} pairs_group;

static pairs_group widen_group(const job *jb, int64_t p, int64_t p_hi) {
    static __thread void *buf = NULL;
    static __thread int64_t size = 0;
    const int64_t K = jb->K;
    uint8_t *mem = grown(&buf, &size, 32 * K * 2 + 16 * 256 * 2 + 256 * 4);
    if (mem == NULL) abort();                  /* a few hundred KiB: the process is out of memory */
    uint32_t *panel = (uint32_t *)mem;
    const placed at = place(jb, p);
    int64_t end = p + 32 / NR;
    if (end > p_hi) end = p_hi;
    if (end > at.part_end) end = at.part_end;
    const int64_t n = (end - p) * NR < at.pt->rows - at.r0 ? (end - p) * NR : at.pt->rows - at.r0;
    widen_pairs(at.pt, K, at.row_bytes, at.r0, n, (float *)(mem + 32 * K * 2 + 16 * 256 * 2),
                (bf16_t *)(mem + 32 * K * 2), panel);
    return (pairs_group){panel, at, n, end};
}

/* The group from panel p through bg_rows, every row of x; returns the panel after it. */
int64_t bg_group(const job *jb, int64_t p, int64_t p_hi) {
    const pairs_group gp = widen_group(jb, p, p_hi);
    for (int64_t t0 = 0; t0 < jb->T; t0 += BG)
        bg_rows((int)(jb->T - t0 < BG ? jb->T - t0 : BG), gp.panel, jb->K, jb->xb, t0,
                jb->out + gp.at.col0 + gp.at.r0, jb->ldo, gp.n);
    return gp.end;
}

#endif

/* ---- big `fast` steps on the AMX tiles ------------------------------------------------------------
 * Where the CPU has AMX (Intel Sapphire Rapids and later) and Linux lets the process use it, `fast`
 * steps of AMX_MIN_ROWS rows or more multiply the same bfloat16 values (x and every weight widened
 * exactly, then rounded) on the tiles: TDPBF16PS adds a tile row's 32 products into each float32
 * output in K order. Smaller `fast` steps there take the float32 path (faster at decode on the
 * Intel host than the bfloat16 vectors, and exact), so on such a host a row's bits in the fast
 * numerics depend on whether its step had AMX_MIN_ROWS rows (the reference numerics never use the
 * tiles). Per thread: its run of panels in groups of up to 32 rows of W
 * (within a part), each group widened into bfloat16 and laid out as the tiles read it, then every
 * 32 rows of x of the current tile of x multiplied by it in 2 x 2 tiles of 16 x 16 outputs.
 * A build without the AMX flags (FORGE_KERNEL_ISA=avx512 and lower) has none of this. */
#if defined(HAVE_AMX)
int amx_enable(void);                       /* amx_gemm.c: Linux's permission, once per process */
void amx_load_config(void);                 /* amx_gemm.c: the tiles' shapes, on this thread */

int amx_usable(void) {
    static _Atomic int state = 0;           /* 0 not asked yet, 1 usable, -1 not */
    int s = atomic_load(&state);
    if (s == 0) {
        s = amx_enable() == 0 ? 1 : -1;
        atomic_store(&state, s);
    }
    return s == 1;
}

/* out rows [t_lo, t_hi) of x (xb, zero past T), columns [0, n) = x @ the group's rows. */
static void amx_group(const job *jb, const uint32_t *panel, int64_t n, float *out, int64_t t_lo, int64_t t_hi) {
    const int64_t K = jb->K, ldo = jb->ldo, sa = K * 2;
    float tail[32 * 32];
    for (int64_t i = t_lo; i < t_hi; i += 32) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t *a0 = jb->xb + i * K, *a1 = a0 + 16 * K;
        for (int64_t ks = 0; ks < K / 32; ks++) {
            _tile_loadd(4, a0 + ks * 32, sa);
            _tile_loadd(5, a1 + ks * 32, sa);
            _tile_loadd(6, panel + ks * 512, 64);
            _tile_loadd(7, panel + ks * 512 + 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        const int64_t rows = jb->T - i < 32 ? jb->T - i : 32;
        if (rows == 32 && n == 32) {
            float *o = out + i * ldo;
            _tile_stored(0, o, ldo * 4);
            _tile_stored(1, o + 16, ldo * 4);
            _tile_stored(2, o + 16 * ldo, ldo * 4);
            _tile_stored(3, o + 16 * ldo + 16, ldo * 4);
            continue;
        }
        _tile_stored(0, tail, 128);
        _tile_stored(1, tail + 16, 128);
        _tile_stored(2, tail + 16 * 32, 128);
        _tile_stored(3, tail + 16 * 32 + 16, 128);
        for (int64_t r = 0; r < rows; r++) memcpy(out + (i + r) * ldo, tail + r * 32, (size_t)n * sizeof(float));
    }
}

/* Panels [p_lo, p_hi) of the job on the tiles (jb->amx). */
void amx_panels(const job *jb, int64_t p_lo, int64_t p_hi) {
    const int64_t K = jb->K;
    amx_load_config();
    int64_t tb = AMX_X_BYTES / (K * 2) / 32 * 32;
    tb = tb < 32 ? 32 : tb;
    for (int64_t t0 = 0; t0 < jb->T; t0 += tb) {
        const int64_t t1 = jb->T - t0 < tb ? jb->T : t0 + tb;
        for (int64_t p = p_lo; p < p_hi;) {            /* up to 32 rows of W, within the part */
            const pairs_group gp = widen_group(jb, p, p_hi);
            amx_group(jb, gp.panel, gp.n, jb->out + gp.at.col0 + gp.at.r0, t0, t1);
            p = gp.end;
        }
    }
    _tile_release();
}
#endif

#endif
