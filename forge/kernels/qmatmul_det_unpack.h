/* The deterministic product's vector unpacking (qmatmul_det.c includes it where its vector form is built: AVX2
 * or AVX-512, with Q8_SHIFT and DET_VNNI decided there): a block's codes of one weight row as a vector, 8 rows'
 * constants lane by lane, and the sums and transpositions both of its paths use. Moves and exact integer
 * operations only, besides the constants' products (d * sc: exact, and the same one operation as the
 * definition's). Compiled with qmatmul_det.c's flags (no -ffast-math).
 */
#ifndef FORGE_QMATMUL_DET_H
#define FORGE_QMATMUL_DET_H

#include "transpose8.h"

static inline __m256i lane_sums(const __m256i *v) {
    const __m256i a01 = _mm256_hadd_epi32(v[0], v[1]), a23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a45 = _mm256_hadd_epi32(v[4], v[5]), a67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a01, a23), b1 = _mm256_hadd_epi32(a45, a67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

#if defined(DET_VNNI)
#if defined(__AVXVNNI__)
#define DOT8(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x)
#else
#define DOT8(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
#endif
#else
#define DOT8(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
#endif

static inline __m256i load_b32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes of nibbles as 32 codes: the low nibbles (values 0..15), then the high ones. */
static inline __m256i nibbles_32(const uint8_t *q) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

/* 32 bits (bit i for value i) as 32 bytes of 0 or 16. */
static inline __m256i bits_x16(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                               _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                  0x0303030303030303LL));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

/* Block b's 32 codes of a row of `type` (unsigned; Q8_0's as the dot takes them: + Q8_SHIFT). */
static inline __attribute__((always_inline)) __m256i codes_of(int64_t type, const uint8_t *row, int64_t b) {
    switch (type) {
    case T_Q4_0: return nibbles_32(row + b * 18 + 2);
    case T_Q4_1: return nibbles_32(row + b * 20 + 4);
    case T_Q5_0: return _mm256_or_si256(nibbles_32(row + b * 22 + 6), bits_x16(row + b * 22 + 2));
    case T_Q5_1: return _mm256_or_si256(nibbles_32(row + b * 24 + 8), bits_x16(row + b * 24 + 4));
    case T_Q8_0: {
        const __m256i w = load_b32(row + b * 34 + 2);
        return Q8_SHIFT ? _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)) : w;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int j = (int)(b % 8);
        const uint8_t *sb = row + b / 8 * (type == T_Q4_K ? 144 : 176);
        const __m256i q = load_b32(sb + (type == T_Q4_K ? 16 : 48) + 32 * (j / 2));
        __m256i c = _mm256_and_si256(_mm256_srli_epi16(q, 4 * (j & 1)), _mm256_set1_epi8(15));
        if (type == T_Q5_K) {
            const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(load_b32(sb + 16), j), _mm256_set1_epi8(1));
            c = _mm256_or_si256(c, _mm256_slli_epi16(qh, 4));
        }
        return c;
    }
    default: {    /* T_Q6_K */
        const int j = (int)(b % 8), half = j / 4, r = j % 4;
        const uint8_t *sb = row + b / 8 * 210;
        const __m256i ql = load_b32(sb + 64 * half + 32 * (r & 1)), qh = load_b32(sb + 128 + 32 * half);
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (r >> 1)), _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), _mm256_set1_epi8(3));
        return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
    }
}

/* out[j] lane c = in[c][j]: an 8 x 8 transposition (moves only). */

static inline void transpose8(const float in[8][8], __m256 *out) {
    __m256 r[8];
    for (int c = 0; c < 8; c++) r[c] = _mm256_load_ps(in[c]);
    transpose8v(r, out);
}

/* The 8 weight rows' constants of blocks [b0, b0 + 8) (K-quants: one superblock; 32-blocks: 8 of
 * them), lanes = weight rows: A[j], M[j], and Q6_K's group scales S0[j], S1[j]. */
static inline __attribute__((always_inline)) void consts8(int64_t type, const uint8_t *const *rows, int64_t b0, int64_t n, __m256 *A, __m256 *M,
                    __m256i *S0, __m256i *S1) {
    float tA[8][8] __attribute__((aligned(32))), tM[8][8] __attribute__((aligned(32)));
    if (type == T_Q4_K || type == T_Q5_K) {
        for (int c = 0; c < 8; c++) {
            const uint8_t *sb = rows[c] + b0 / 8 * (type == T_Q4_K ? 144 : 176);
            uint32_t u[3];
            memcpy(u, sb + 4, 12);
            const uint32_t sc[2] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4)};
            const uint32_t mn[2] = {u[1] & 0x3f3f3f3fu, ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4)};
            long long scb, mnb;
            memcpy(&scb, sc, 8);
            memcpy(&mnb, mn, 8);
            const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(scb)));
            const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mnb)));
            _mm256_store_ps(tA[c], _mm256_mul_ps(_mm256_set1_ps(f16(sb)), scf));
            /* -(dmin * mn): the negation is exact */
            _mm256_store_ps(tM[c], _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16(sb + 2)), mnf), _mm256_set1_ps(-0.0f)));
        }
        transpose8(tA, A);
        transpose8(tM, M);
        return;
    }
    if (type == T_Q6_K) {
        __m256 lo[8], hi[8], glo[8], ghi[8];      /* each row's 16 group scales, then a vector per group */
        float d[8];
        for (int c = 0; c < 8; c++) {
            const uint8_t *sb = rows[c] + b0 / 8 * 210;
            const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 192));
            lo[c] = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(sc));
            hi[c] = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)));
            d[c] = f16(sb + 208);
        }
        transpose8v(lo, glo);
        transpose8v(hi, ghi);
        const __m256 dv = _mm256_loadu_ps(d);
        for (int j = 0; j < 8; j++) {
            A[j] = dv;
            M[j] = _mm256_setzero_ps();
            S0[j] = _mm256_castps_si256(j < 4 ? glo[2 * j] : ghi[2 * j - 8]);
            S1[j] = _mm256_castps_si256(j < 4 ? glo[2 * j + 1] : ghi[2 * j - 7]);
        }
        return;
    }
    const int64_t bb = block_bytes(type);
    const int has_m = type == T_Q4_1 || type == T_Q5_1;
    for (int64_t j = 0; j < n; j++) {
        uint16_t hd[8], hm[8];
        for (int c = 0; c < 8; c++) {
            const uint8_t *blk = rows[c] + (b0 + j) * bb;
            memcpy(&hd[c], blk, 2);
            memcpy(&hm[c], blk + 2, 2);
        }
        A[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hd));
        M[j] = has_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)hm)) : _mm256_setzero_ps();
    }
}

#endif
