/* y = x @ W.T straight from a GGUF file's blocks, float32 activations and accumulation.
 *
 * W [N, K] is one or more parts stacked along N (q, k and v of a layer; gate and up), each part
 * the file's own bytes (a view of its mapping: nothing is copied at load) in any of the types
 * below. Every weight is widened exactly as the file means it (w = scale * q + offset per block,
 * forge.kernels.quant_blocks being the reference), in panels of NR rows of W that the threads take in
 * contiguous runs:
 *
 *   steps of up to 16 rows (decoding): each panel widened in registers, block by block, and
 *     multiplied at once with FR rows of x at a time (the fused path; AVX-512), the weights
 *     prefetched ahead, so a step reads each weight once at memory speed;
 *   bigger steps (prefill): x in tiles of rows that stay in L2; for each tile and panel, the
 *     panel's rows widened whole into a thread's buffer (L1/L2), then MR x NR register tiles of
 *     dot products over all of K.
 *
 * Each out[t][n] is one VN-lane running sum over K in order, its lanes added by one fixed tree at
 * the end (reduce_row): the result for a row does not depend on how many rows the step has, which
 * path took it, nor on the thread split (batch invariance).
 *
 * The `fast` numerics (asked per call) trade that exactness for speed: with AVX-512 BF16, x and the
 * widened weights rounded to bfloat16 (pair dot products, on the AMX tiles for big steps where
 * there are tiles), except that with VNNI too the K-quants take int8 products (x per superblock of
 * 256, as below: decode steps straight from the blocks, bigger ones with 16 weight rows in the lanes
 * of VPDPBUSD); on AVX2 alone, x as int8 codes multiplied with the file's integer codes in
 * int32 (VPMADDUBSW/VPMADDWD): for the K-quants x per superblock of 256 and one float scale per
 * superblock, in every step; for Q4_0, Q4_1, Q8_0 x per block of 32 and a float scale per block, in
 * steps of up to I8_MAX_ROWS rows (forge_qmatmul_fast says which numerics this build has).
 *
 * Threads: the library's pool (pool.c, forge_pool_threads), the caller taking the first run of panels.
 * One caller at a time: a second concurrent caller computes alone.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "pool.h"

/* ---- ggml type ids (gguf.constants.GGMLQuantizationType) ------------------------------------- */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

typedef struct {
    const uint8_t *data;    /* rows * row_bytes bytes, the file's blocks row after row */
    int64_t rows;           /* output features of this part */
    int64_t type;           /* ggml type id */
} qpart;

#if defined(__AVX512F__)
#define VN 16
#define MR 4                /* against 5 and 6: 15-40% faster at 8-32 rows (docs/benchmarks.md) */
#else
#define VN 8
#define MR 3
#endif
#define NR 4                /* rows of W widened together */
/* Steps of up to FUSED_MAX_ROWS rows take the fused path (AVX-512 or AVX2), FR rows at a time, which
 * widens each weight once per FR rows; bigger ones the tiled path, which widens it once per tile. Where
 * K is 2,048 or more, the tiled path wins from 5 rows on in float32 (1.7B-shaped layers on a 2-core EPYC
 * Zen 5, 2 threads, scripts/ab/ab_ggml.py: AVX-512 65 against 80 ms at 8 rows, 110 against 145 at 16, the
 * fused path ahead at 2 rows; the AVX2 build 110 against 187 ms at 8 rows, 176 against 410 at 16); with
 * the default model's K of 576 and 1,536 the fused path stays ahead up to 16 rows (`ab_kernels.py products
 * --kernels blocks`: 672 against 540 tok/s at 8 rows, 627 against 556 at 16). */
#if defined(__AVX512F__)
#define FR 4
#else
#define FR 2                /* AVX2's 16 registers: 2 x NR accumulators and the widened weights */
#endif
#ifndef FUSED_MAX_ROWS
#define FUSED_MAX_ROWS 16
#endif
#ifndef FUSED_MAX_ROWS_WIDE
#define FUSED_MAX_ROWS_WIDE 4   /* K of WIDE_K or more */
#endif
#define WIDE_K 2048
#define MAX_PARTS 8

typedef float vf __attribute__((vector_size(VN * 4)));

#if defined(__AVX512F__)
#define FMA(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif defined(__FMA__)
#define FMA(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

static inline vf vload(const float *p) { vf r; memcpy(&r, p, sizeof r); return r; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline float f16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, sizeof h);
    return (float)h;
}

static inline float bf16(const uint8_t *p) {
    uint32_t bits = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 24;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The K-quants: superblocks of 256 values. */
static inline int k_type(int64_t type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* Bytes per row and values per block of each type; 0: not a type this kernel reads. */
static int64_t block_values(int64_t type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 0;
    }
}

static int64_t block_bytes(int64_t type) {
    switch (type) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

/* Q4_K's and Q5_K's six-bit scales and mins of sub-block j (0..7) from their 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *mn = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

#if defined(__AVX512F__)
/* Weights are read this many bytes ahead of their use (software prefetch: each thread streams
 * NR rows at once, more than the hardware prefetcher follows at full speed; measured on a 2-core
 * EPYC, one decoding row: 9 GB/s without, 20 GB/s with 16 KiB; docs/benchmarks.md). */
#ifndef PF_AHEAD
#define PF_AHEAD 16384
#endif
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

/* AVX-512 widening of the common types, one set of helpers for both paths (so that the fused
 * small-step path and the tiled path see the very same weights): a 4-bit code picks its value
 * from a 16-entry table (scale * i + offset, i < 16) with one permute; 6- and 8-bit codes are
 * converted and scaled. */
static inline __m512i zx16(const uint8_t *q) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)); }

static inline __m512 table(float scale, float offset) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(iota, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
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

static inline void q8_0_block(const uint8_t *b, __m512 *w) {
    const __m512 d = _mm512_set1_ps(f16(b));
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))), d);
}

/* One block of 32 values of Q4_0, Q4_1 or Q8_0 at b, in order, into w[0] and w[1]: every path's widening
 * of these types (dequant, the fused path, widen_pairs). */
static inline void block32(int64_t type, const uint8_t *b, __m512 *w) {
    if (type == T_Q4_0) {
        const float d = f16(b);
        nibbles16(b + 2, table(d, -8.0f * d), w);
    } else if (type == T_Q4_1) {
        nibbles16(b + 4, table(f16(b), f16(b + 2)), w);
    } else {
        q8_0_block(b, w);
    }
}

/* The AVX-512 form of dequant() for the types it covers; 0 when it does not cover `type`. */
static int dequant_avx512(int64_t type, const uint8_t *b, int64_t n, float *restrict dst) {
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
    default:
        return 0;
    }
}

/* The fused path (steps of up to FUSED_MAX_ROWS rows, FR at a time): each panel's weights widened
 * in registers and multiplied at once (no round trip through a buffer), every out[t][c] the same
 * running sum as the tiled path's. */
static int fused_type(int64_t type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_Q4_K || type == T_Q6_K;
}

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
        case T_Q4_0:                                                                               \
        case T_Q4_1:                                                                               \
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

static void fused_rows(int mr, const float *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,
                       const uint8_t *const *rows, float *acc) {
    switch (mr) {
    case 1: fused1(x, ldx, k0, k1, type, rows, acc); break;
    case 2: fused2(x, ldx, k0, k1, type, rows, acc); break;
    case 3: fused3(x, ldx, k0, k1, type, rows, acc); break;
    case 4: fused4(x, ldx, k0, k1, type, rows, acc); break;
    }
}

#if defined(__AVX512BF16__)
/* The `fast` numerics (forge_qmatmul's bf16 flag): x and the widened weights rounded to bfloat16
 * (round to nearest even), each pair of products added into a float32 lane by one VDPBF16PS,
 * twice the multiplies of an FMA. Every weight is widened exactly as above first, then rounded,
 * the same in both paths; lane l of a 32-value group sums values 2 l and 2 l + 1, the lanes
 * added by reduce_row's tree: the same bits for a row in every step of up to FUSED_MAX_ROWS_BF16
 * rows (bigger ones put weight rows in the lanes: bg_rows, below). */
#define HAVE_BF16 1
#ifndef FUSED_MAX_ROWS_BF16
#define FUSED_MAX_ROWS_BF16 4
#endif
typedef uint16_t bf16_t;

static inline __m512bh bh_load(const bf16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline __m512bh bh_pair(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }

#define DP_ROWS(mr, c, kpos, wv)                                                                   \
    for (int t = 0; t < (mr); t++) acc[t][c] = _mm512_dpbf16_ps(acc[t][c], bh_load(x + t * ldx + (kpos)), (wv));

#define DP_PAIR(mr, c, kpos, w0, w1) DP_ROWS(mr, c, kpos, bh_pair(w0, w1))
#define FUSED_BF16(mr) FUSED_OF(fusedb, bf16_t, DP_PAIR, mr)
FUSED_BF16(1)
FUSED_BF16(2)
FUSED_BF16(3)
FUSED_BF16(4)

static void fused_rows_bf16(int mr, const bf16_t *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,
                            const uint8_t *const *rows, float *acc) {
    switch (mr) {
    case 1: fusedb1(x, ldx, k0, k1, type, rows, acc); break;
    case 2: fusedb2(x, ldx, k0, k1, type, rows, acc); break;
    case 3: fusedb3(x, ldx, k0, k1, type, rows, acc); break;
    case 4: fusedb4(x, ldx, k0, k1, type, rows, acc); break;
    }
}

/* acc[r][c] += the bf16 dot products of x's rows r < mr with the bf16 panel's rows c < NR. */
#define TILE_BF16(mr)                                                                              \
    static inline void tileb##mr(const bf16_t *restrict x, int64_t ldx, const bf16_t *restrict w, \
                                 int64_t k, float *restrict acc) {                                 \
        __m512 a[mr][NR];                                                                          \
        for (int r = 0; r < mr; r++)                                                               \
            for (int c = 0; c < NR; c++) a[r][c] = _mm512_setzero_ps();                            \
        for (int64_t i = 0; i < k; i += 32) {                                                      \
            __m512bh wv[NR];                                                                       \
            for (int c = 0; c < NR; c++) wv[c] = bh_load(w + c * k + i);                           \
            for (int r = 0; r < mr; r++) {                                                         \
                const __m512bh xv = bh_load(x + r * ldx + i);                                      \
                for (int c = 0; c < NR; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], xv, wv[c]);       \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < mr; r++)                                                               \
            for (int c = 0; c < NR; c++) _mm512_storeu_ps(acc + (r * NR + c) * VN, a[r][c]);       \
    }
TILE_BF16(1)
TILE_BF16(2)
TILE_BF16(3)
TILE_BF16(4)

static inline void tile_rows_bf16(int mr, const bf16_t *x, int64_t ldx, const bf16_t *w, int64_t kc, float *acc) {
    switch (mr) {
    case 1: tileb1(x, ldx, w, kc, acc); break;
    case 2: tileb2(x, ldx, w, kc, acc); break;
    case 3: tileb3(x, ldx, w, kc, acc); break;
    case 4: tileb4(x, ldx, w, kc, acc); break;
    }
}

/* n floats (n a multiple of 32) rounded to bfloat16, in order. */
static void to_bf16(const float *src, int64_t n, bf16_t *dst) {
    for (int64_t i = 0; i < n; i += 32)
        _mm512_storeu_si512((void *)(dst + i), (__m512i)bh_pair(_mm512_loadu_ps(src + i), _mm512_loadu_ps(src + i + 16)));
}
#endif
#endif

#if defined(__AVX512F__)
#define HAVE_FUSED 1
#define dequant_simd dequant_avx512
#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX2 forms, eight values at a time: codes widened to 32 bits, converted and scaled with
 * one FMA (one set of helpers for the fused and the tiled path, as above). */
#define HAVE_FUSED 1
#ifndef PF_AHEAD
#define PF_AHEAD 16384
#endif
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

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

/* One 32-value block (Q4_0, Q4_1, Q8_0) of b into w[0..3], in order. */
static inline void block32_avx2(int64_t type, const uint8_t *b, __m256 *w) {
    __m256 t[4];
    if (type == T_Q8_0) {
        q8_0_avx2(b, w);
        return;
    }
    const float d = f16(b), o = type == T_Q4_0 ? -8.0f * d : f16(b + 2);
    nibbles16_avx2(b + (type == T_Q4_0 ? 2 : 4), d, o, t);
    w[0] = t[0], w[1] = t[1], w[2] = t[2], w[3] = t[3];
}

static int dequant_simd(int64_t type, const uint8_t *b, int64_t n, float *restrict dst) {
    __m256 w[8];
    switch (type) {
    case T_Q4_0:
    case T_Q4_1:
    case T_Q8_0: {
        const int64_t bb = block_bytes(type);
        for (int64_t blk = 0; blk < n / 32; blk++, b += bb, dst += 32) {
            block32_avx2(type, b, w);
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(dst + 8 * v, w[v]);
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

static int fused_type(int64_t type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_Q4_K || type == T_Q6_K;
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
        if (type == T_Q4_K || type == T_Q6_K) {                                                    \
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
                    } else {                                                                       \
                        for (int h = 0; h < 2; h++)                                                \
                            for (int i = 0; i < 4; i++) {                                          \
                                q6k_quarter_avx2(b, h, i, w);                                      \
                                for (int v = 0; v < 4; v++) {                                      \
                                    FMA_ROWS2(mr, c, sb * 256 + 128 * h + 32 * i + 8 * v, w[v])    \
                                }                                                                  \
                            }                                                                      \
                    }                                                                              \
                }                                                                                  \
        } else {                                                                                   \
            const int64_t bb = block_bytes(type);                                                  \
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

static void fused_rows(int mr, const float *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,
                       const uint8_t *const *rows, float *acc) {
    if (mr == 1) fused1(x, ldx, k0, k1, type, rows, acc);
    else fused2(x, ldx, k0, k1, type, rows, acc);
}

#endif

/* ---- the `fast` numerics' int8 products ------------------------------------------------------------
 * AVX2 builds (no AVX-512): int8 activations for Q4_0, Q4_1, Q8_0 (per block of 32, decode steps) and
 * the K-quants (per superblock of 256, every step). AVX-512 builds with BW, VNNI and BF16 (AMD Zen 4
 * and later, Intel Sapphire Rapids and later): the K-quants' int8 products in 64-byte vectors, the
 * other types' `fast` numerics staying bfloat16 (int8 adds nothing at decode, where both read at memory
 * speed, and prefill of those types keeps the bfloat16 tiles). */
#if defined(__AVX2__) && defined(__FMA__) && \
    (!defined(__AVX512F__) || (defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)))
#define HAVE_I8K 1
/* On AVX-512, the most rows of a K-quant step taken straight from the blocks (k_direct); bigger steps go
 * to the lanes-as-rows kernel (kg_panels), about as fast from 9 to 16 rows and faster beyond (1.7B-shaped
 * layers, 2 threads, Zen 4: 37.5 ms at 8 rows, twice that at 16 either way). A row's bits differ between
 * steps of up to I8K_MAX_ROWS rows and bigger ones, as across the AMX tiles' bound. AVX2 takes every step
 * through its records. */
#ifndef I8K_MAX_ROWS
#if defined(__AVX512F__)
#define I8K_MAX_ROWS 8
#else
#define I8K_MAX_ROWS INT64_MAX
#endif
#endif
static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* v as computed, hidden from -ffast-math's reassociation: a product of three factors would otherwise be
 * free to be regrouped differently in the one-row and two-row bodies, and a row's bits with it. */
#define OPAQUE(v) __asm__("" : "+x"(v))

/* The quantizers of x below keep exact IEEE arithmetic (not -ffast-math's), so that the tests can
 * quantize x the same way: v * id rounded to nearest even (the default rounding, as nearbyintf), then
 * clamped to +-127. Eight lanes at a time, on both AVX2 and AVX-512 builds. */
#define EXACT __attribute__((optimize("no-fast-math")))

/* max |v| over n values (n a multiple of 16). */
EXACT static inline float amax_of(const float *v, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8)                   /* a NaN drops out, as in fmaxf */
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* 16 values' codes into q; returns their sum. */
EXACT static inline int codes16(const float *v, __m256 id, int8_t *q) {
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    __m256i c0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), id));
    __m256i c1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), id));
    c0 = _mm256_max_epi32(_mm256_min_epi32(c0, hi), lo);
    c1 = _mm256_max_epi32(_mm256_min_epi32(c1, hi), lo);
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8);    /* int16, in order */
    _mm_storeu_si128((__m128i *)q, _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(c0, c1)),
                              _mm256_extracti128_si256(_mm256_add_epi32(c0, c1), 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

#endif

#if defined(HAVE_I8K) && !defined(__AVX512F__)
/* ---- the `fast` numerics on AVX2 (no AVX-512 BF16): int8 activations -------------------------
 * Q4_0, Q4_1, Q8_0 (the K-quants' way is further below):
 * x quantized per block of 32 values as llama.cpp's Q8_0 (dx = max|x| / 127, codes x * (127 / max|x|)
 * rounded to nearest even), each weight block's codes multiplied with them as integers (VPMADDUBSW,
 * VPMADDWD: exact; a signed code goes in as |w| against x with w's sign), each block's eight int32
 * sums then scaled by the weight block's scale times dx into float32 lanes, and Q4_1's offset m
 * times dx * the sum of the block's codes. Every row of x is quantized alone and
 * added in one order whatever the step: a row's bits do not depend on the batch. */
#define HAVE_I8 1

/* The types whose int8 products take x per block of 32 (steps of up to I8_MAX_ROWS rows). */
static inline int i8_type(int64_t type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0; }

#define FR8 2
/* Q4_0, Q4_1 and Q8_0: steps of up to I8_MAX_ROWS rows take the int8 products; bigger ones
 * (prefill) the float32 path, faster there: the int8 rows go FR8 at a time through each panel,
 * widening its codes again for each pair, where the float32 tiles widen a panel once for a whole tile of x (1.7B-shaped layers,
 * AVX2 host, ms int8 against float32: 21.3 / 45.2 at 1 row, 66.8 / 97.4 at 4, 144.1 / 123.5 at 5,
 * 172.7 / 146.9 at 8, 8,122 / 4,918 at 512; docs/benchmarks.md). A row's bits then differ
 * between steps of up to I8_MAX_ROWS rows and bigger ones, as with the AMX tiles. */
#ifndef I8_MAX_ROWS
#define I8_MAX_ROWS 4
#endif

/* The 8 int32 sums of 4 products each of unsigned codes u with signed x codes s. */
static inline __m256i dot_us(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* The same for signed codes v (|v| in -128..127 fits VPMADDUBSW's unsigned side, x takes v's sign). */
static inline __m256i dot_ss(__m256i v, __m256i s) { return dot_us(_mm256_abs_epi8(v), _mm256_sign_epi8(s, v)); }

/* 16 bytes of nibbles as 32 codes in order: the low nibbles (values 0..15), then the high ones. */
static inline __m256i nibbles32(const uint8_t *q) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

/* acc[t][c] += I (eight int32 sums: an expression of xv, row t's codes of x block blk) as float times
 * (scale * dx[t][blk]), for t < mr. */
#define I8_ROWS(mr, c, blk, I, scale)                                                              \
    for (int t = 0; t < (mr); t++) {                                                               \
        const __m256i xv = load32((const uint8_t *)(xq + t * K + 32 * (blk)));                     \
        float sx = (scale) * xd[t * nb + (blk)];                                                   \
        OPAQUE(sx);                                                                                \
        acc[t][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_set1_ps(sx), acc[t][c]);        \
    }

#define FUSED_I8(mr)                                                                               \
    static void fusedq##mr(const int8_t *xq, const float *xd, const float *xs, int64_t K, int64_t type, \
                           const uint8_t *const *rows, float *acc_io) {                            \
        const int64_t nb = K / 32;                                                                 \
        __m256 acc[mr][NR];                                                                        \
        for (int t = 0; t < (mr); t++)                                                             \
            for (int c = 0; c < NR; c++) acc[t][c] = _mm256_loadu_ps(acc_io + (t * NR + c) * VN);  \
        switch (type) {                                                                            \
        case T_Q4_0:                                                                               \
        case T_Q4_1:                                                                               \
        case T_Q8_0: {                                                                             \
            const int64_t bb = block_bytes(type);                                                  \
            for (int64_t blk = 0; blk < nb; blk++)                                                 \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + blk * bb;                                         \
                    if ((blk & 1) == 0) PREFETCH(b + PF_AHEAD);                                    \
                    const float d = f16(b);                                                        \
                    if (type == T_Q8_0) {                                                          \
                        const __m256i w = load32(b + 2);                                           \
                        I8_ROWS(mr, c, blk, dot_ss(w, xv), d)                                      \
                    } else if (type == T_Q4_0) {                                                   \
                        const __m256i w = _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));  \
                        I8_ROWS(mr, c, blk, dot_ss(w, xv), d)                                      \
                    } else {                                                                       \
                        const __m256i w = nibbles32(b + 4);                                        \
                        const __m256 m8 = _mm256_set1_ps(f16(b + 2) * 0.125f);                     \
                        I8_ROWS(mr, c, blk, dot_us(w, xv), d)                                      \
                        for (int t = 0; t < (mr); t++)                                             \
                            acc[t][c] = _mm256_fmadd_ps(m8, _mm256_set1_ps(xs[t * nb + blk]), acc[t][c]); \
                    }                                                                              \
                }                                                                                  \
            break;                                                                                 \
        }                                                                                          \
        }                                                                                          \
        for (int t = 0; t < (mr); t++)                                                             \
            for (int c = 0; c < NR; c++) _mm256_storeu_ps(acc_io + (t * NR + c) * VN, acc[t][c]);  \
    }
FUSED_I8(1)
FUSED_I8(2)

static void fused_rows_i8(int mr, const int8_t *xq, const float *xd, const float *xs, int64_t K, int64_t type,
                          const uint8_t *const *rows, float *acc) {
    if (mr == 1) fusedq1(xq, xd, xs, K, type, rows, acc);
    else fusedq2(xq, xd, xs, K, type, rows, acc);
}

/* Row t of x (K values) as int8 codes q, per block of 32 the scale d and s = d * the codes' sum. */
EXACT static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *v = x + 32 * b;
        const float amax = amax_of(v, 32);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const int sum = codes16(v, id, q + 32 * b) + codes16(v + 16, id, q + 32 * b + 16);
        d[b] = amax / 127.0f;
        s[b] = d[b] * (float)sum;
    }
}

#endif

#if defined(HAVE_I8K)
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
 * steps, kg_panels for bigger ones, below). */
#define KR 4

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

static void *grown(void **buf, int64_t *size, int64_t bytes);

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

#if !defined(__AVX512F__)
/* ---- AVX2: a panel's superblocks unpacked into records, rows of x against them -------------------- */
typedef struct {
    uint8_t codes[256];     /* the superblock's unsigned codes, in order */
    int16_t sv[16];         /* the integer scale of each 16 values, the even groups' then the odd ones' */
    float mins[8];          /* Q4_K, Q5_K: -dmin * mn[j] of sub-block j */
    float d;
} ksb;

/* A thread's buffer for one panel's unpacked superblocks. */
static ksb *k_panel_buffer(int64_t records) {
    static __thread void *buf = NULL;
    static __thread int64_t size = 0;
    return grown(&buf, &size, records * (int64_t)sizeof(ksb));
}

/* One superblock b of a row of `type` into its record. */
static inline void k_unpack(int64_t type, const uint8_t *b, ksb *r) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (type == T_Q6_K) {
        const __m256i m30 = _mm256_set1_epi8(0x30);
        const int8_t *sc = (const int8_t *)(b + 192);
        r->d = f16(b + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32), qh = load32(b + 128 + 32 * h);
            __m256i *v = (__m256i *)(r->codes + 128 * h);
            _mm256_storeu_si256(v, _mm256_or_si256(_mm256_and_si256(l0, m4),
                                                   _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)));
            _mm256_storeu_si256(v + 1, _mm256_or_si256(_mm256_and_si256(l1, m4),
                                                       _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)));
            _mm256_storeu_si256(v + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                                       _mm256_and_si256(qh, m30)));
            _mm256_storeu_si256(v + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)));
        }
        _mm256_storeu_si256((__m256i *)r->sv, q6k_sv(sc));
        memset(r->mins, 0, sizeof r->mins);
    } else {
        const int five = type == T_Q5_K;
        __m256 mins;
        uint32_t u[4];
        _mm256_storeu_si256((__m256i *)r->sv, k4_sv(b, u, &mins));
        _mm256_storeu_ps(r->mins, mins);
        r->d = f16(b);
        const uint8_t *q = b + (five ? 48 : 16);
        const __m256i qh = five ? load32(b + 16) : _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
        __m256i *v = (__m256i *)r->codes;
        for (int j = 0; j < 4; j++) {
            const __m256i x = load32(q + 32 * j);
            __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            if (five) {
                const __m256i h = _mm256_srli_epi16(qh, 2 * j);
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 1), one), 4));
            }
            _mm256_storeu_si256(v + 2 * j, lo);
            _mm256_storeu_si256(v + 2 * j + 1, hi);
        }
    }
}

/* acc[t * NR * VN] (one weight row's running sums for rows t < mr of x, from row t0) over its
 * records r[0 .. s1 - s0), superblocks s0 .. s1 of K. */
#define K_ROWS(mr)                                                                                 \
    static void k_rows##mr(int q6, const ksb *r, int64_t s0, int64_t s1, const xk *x, int64_t K, int64_t t0, \
                           float *acc) {                                                           \
        const int64_t ns = K / 256, nb = K / 32, ng = K / 16;                                      \
        __m256 f[mr];                                                                              \
        for (int t = 0; t < (mr); t++) f[t] = _mm256_loadu_ps(acc + t * NR * VN);                  \
        for (int64_t sb = s0; sb < s1; sb++) {                                                     \
            const ksb *k = r + (sb - s0);                                                          \
            const int8_t *xq = x->q + t0 * K + 256 * sb;                                           \
            if (!q6) {                                                                             \
                const __m256 mins = _mm256_loadu_ps(k->mins);                                      \
                for (int t = 0; t < (mr); t++)                                                     \
                    f[t] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(x->s + (t0 + t) * nb + 8 * sb), f[t]); \
            }                                                                                      \
            __m256i i[mr];                                                                         \
            for (int t = 0; t < (mr); t++) i[t] = _mm256_setzero_si256();                          \
            const __m256i sv = load32((const uint8_t *)k->sv);                                     \
            for (int j = 0; j < 8; j++) {                                                          \
                const __m256i w = load32(k->codes + 32 * j), s = _mm256_shuffle_epi8(sv, load32(K_SPREAD[j])); \
                for (int t = 0; t < (mr); t++)                                                     \
                    i[t] = _mm256_add_epi32(i[t], _mm256_madd_epi16(                               \
                        _mm256_maddubs_epi16(w, load32((const uint8_t *)(xq + t * K + 32 * j))), s)); \
            }                                                                                      \
            if (q6) {                                                                              \
                for (int t = 0; t < (mr); t++)                                                     \
                    i[t] = _mm256_sub_epi32(i[t], q6_offset(sv, x->b + (t0 + t) * ng + 16 * sb));  \
            }                                                                                      \
            for (int t = 0; t < (mr); t++) {                                                       \
                float sx = k->d * x->d[(t0 + t) * ns + sb];                                        \
                OPAQUE(sx);                                                                        \
                f[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i[t]), _mm256_set1_ps(sx), f[t]);        \
            }                                                                                      \
        }                                                                                          \
        for (int t = 0; t < (mr); t++) _mm256_storeu_ps(acc + t * NR * VN, f[t]);                  \
    }
K_ROWS(1)
K_ROWS(2)
K_ROWS(3)
K_ROWS(4)

static void k_rows(int mr, int q6, const ksb *r, int64_t s0, int64_t s1, const xk *x, int64_t K, int64_t t0,
                   float *acc) {
    switch (mr) {
    case 1: k_rows1(q6, r, s0, s1, x, K, t0, acc); break;
    case 2: k_rows2(q6, r, s0, s1, x, K, t0, acc); break;
    case 3: k_rows3(q6, r, s0, s1, x, K, t0, acc); break;
    default: k_rows4(q6, r, s0, s1, x, K, t0, acc); break;
    }
}

#endif

#if defined(__AVX512F__)
/* r[i] lane j <- r[j] lane i: a 16 x 16 transpose of 32-bit units (a pair of bfloat16 for the AMX tiles, four int8 codes for the VNNI GEMM). */
static inline void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {                /* u[i + j], 128-bit lane L: unit 4L + j of rows i .. i + 3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {                    /* the 128-bit lanes transposed, 4 x 4 */
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

/* Decode-sized steps on AVX-512 (up to I8K_MAX_ROWS rows) take the K-quants straight from the blocks:
 * each superblock's codes widened in registers (two sub-blocks a vector: AVX2's record, never stored),
 * VPMADDUBSW against x's codes, VPDPWSSD with the sub-block scales, with up to KD rows of x, one weight
 * row after another (the panel's rows lie one after another in the file: one stream). Unpacking records
 * once per panel, as AVX2 does, cost more than the products at these sizes (18.7 against 11.2 ms a
 * row on 1.7B-shaped layers, Zen 4). */
#define KD 8                    /* rows of x at a time: 2 x KD of the 32 registers */

/* Superblock b's 256 codes in order, two sub-blocks a vector (w[0..3]), its scales as a record's sv,
 * its float scale d, and for Q4_K and Q5_K -dmin * mn[j] of each sub-block (*mins) and the scale and
 * min bytes (u[4], k4_bytes). */
static inline void k_codes(int64_t type, const uint8_t *b, __m512i *w, __m256i *sv, float *d, __m256 *mins,
                           uint32_t *u) {
    const __mmask32 upper = 0xFFFF0000u, lower = 0x0000FFFFu;
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30), one = _mm512_set1_epi8(1);
    if (type == T_Q6_K) {
        *d = f16(b + 208);
        *sv = q6k_sv((const int8_t *)(b + 192));
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512((const void *)(b + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(load32(b + 128 + 32 * h));
            __m512i ha = _mm512_slli_epi16(qh, 2);
            ha = _mm512_mask_slli_epi16(ha, lower, ha, 2);
            const __m512i hb = _mm512_mask_srli_epi16(qh, upper, qh, 2);
            w[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(ha, m30));
            w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_and_si512(hb, m30));
        }
        return;
    }
    const int five = type == T_Q5_K;
    *sv = k4_sv(b, u, mins);
    *d = f16(b);
    const uint8_t *q = b + (five ? 48 : 16);
    const __m512i qh = five ? _mm512_broadcast_i64x4(load32(b + 16)) : _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
        const __m512i c = _mm512_broadcast_i64x4(load32(q + 32 * j));
        w[j] = _mm512_and_si512(_mm512_mask_srli_epi16(c, upper, c, 4), m4);
        if (five) {
            __m512i h = _mm512_srli_epi16(qh, 2 * j);
            h = _mm512_mask_srli_epi16(h, upper, h, 1);
            w[j] = _mm512_or_si512(w[j], _mm512_slli_epi16(_mm512_and_si512(h, one), 4));
        }
    }
}

#define K_DIRECT(mr)                                                                               \
    static void k_direct##mr(int64_t type, const uint8_t *row, const xk *x, int64_t K, int64_t t0, float *acc) { \
        const int64_t ns = K / 256, nb = K / 32, ng = K / 16, bb = block_bytes(type);              \
        const int q6 = type == T_Q6_K;                                                             \
        __m512 f[mr];                                                                              \
        for (int t = 0; t < (mr); t++) f[t] = _mm512_loadu_ps(acc + t * NR * VN);                  \
        for (int64_t sb = 0; sb < ns; sb++) {                                                      \
            const uint8_t *b = row + sb * bb;                                                      \
            for (int l = 0; l < 4; l++) PREFETCH(b + PF_AHEAD + 64 * l);                           \
            const int8_t *xq = x->q + t0 * K + 256 * sb;                                           \
            __m512i w[4];                                                                          \
            __m256i sv;                                                                            \
            __m256 mins = _mm256_setzero_ps();                                                     \
            float d;                                                                               \
            uint32_t u[4];                                                                         \
            k_codes(type, b, w, &sv, &d, &mins, u);                                                \
            if (!q6) {                                                                             \
                const __m512 mz = _mm512_zextps256_ps512(mins);                                    \
                for (int t = 0; t < (mr); t++)                                                     \
                    f[t] = _mm512_fmadd_ps(mz, _mm512_maskz_loadu_ps(0xff, x->s + (t0 + t) * nb + 8 * sb), f[t]); \
            }                                                                                      \
            __m512i i[mr];                                                                         \
            for (int t = 0; t < (mr); t++) i[t] = _mm512_setzero_si512();                          \
            const __m512i sv2 = _mm512_broadcast_i64x4(sv);                                        \
            for (int j = 0; j < 4; j++) {                                                          \
                const __m512i s = _mm512_shuffle_epi8(sv2, _mm512_loadu_si512((const void *)K_SPREAD[2 * j])); \
                for (int t = 0; t < (mr); t++)                                                     \
                    i[t] = _mm512_dpwssd_epi32(i[t], _mm512_maddubs_epi16(                         \
                        w[j], _mm512_loadu_si512((const void *)(xq + t * K + 64 * j))), s);        \
            }                                                                                      \
            if (q6) {                                                                              \
                for (int t = 0; t < (mr); t++)                                                     \
                    i[t] = _mm512_sub_epi32(i[t], _mm512_zextsi256_si512(q6_offset(sv, x->b + (t0 + t) * ng + 16 * sb))); \
            }                                                                                      \
            for (int t = 0; t < (mr); t++) {                                                       \
                float sx = d * x->d[(t0 + t) * ns + sb];                                           \
                OPAQUE(sx);                                                                        \
                f[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i[t]), _mm512_set1_ps(sx), f[t]);        \
            }                                                                                      \
        }                                                                                          \
        for (int t = 0; t < (mr); t++) _mm512_storeu_ps(acc + t * NR * VN, f[t]);                  \
    }
K_DIRECT(1)
K_DIRECT(2)
K_DIRECT(3)
K_DIRECT(4)
K_DIRECT(5)
K_DIRECT(6)
K_DIRECT(7)
K_DIRECT(8)

static void k_direct(int mr, int64_t type, const uint8_t *row, const xk *x, int64_t K, int64_t t0, float *acc) {
    switch (mr) {
    case 1: k_direct1(type, row, x, K, t0, acc); break;
    case 2: k_direct2(type, row, x, K, t0, acc); break;
    case 3: k_direct3(type, row, x, K, t0, acc); break;
    case 4: k_direct4(type, row, x, K, t0, acc); break;
    case 5: k_direct5(type, row, x, K, t0, acc); break;
    case 6: k_direct6(type, row, x, K, t0, acc); break;
    case 7: k_direct7(type, row, x, K, t0, acc); break;
    default: k_direct8(type, row, x, K, t0, acc); break;
    }
}

/* ---- bigger K-quant steps on AVX-512 VNNI: 16 weight rows in the lanes ---------------------------
 * Steps of more than I8K_MAX_ROWS rows put 16 rows of W in a vector's lanes: each superblock of a
 * group of 16 rows is unpacked once per step into quads of codes (kg.codes[q]: four codes of each of
 * the 16 rows, a 16 x 16 transpose of 32-bit units), and each row of x multiplies them by VPDPBUSD
 * (x's four codes broadcast: 64 multiply-adds an instruction, four times a bfloat16 FMA's pairs), each
 * scale group's int32 sums converted and multiplied by d * its scale (float: VPMULLD is slow on AMD),
 * then per superblock by dx. The mins (Q4_K, Q5_K) and Q6_K's offset of 32 come from the sums of x's
 * codes by VPDPWSSD. A row's bits are the same in every step of this size. */
typedef struct {
    uint8_t codes[64][64];      /* quad q (values 4q .. 4q + 3) of rows 0..15, four codes each */
    float sc[16][16];           /* d * the scale of each group (Q6_K: 16 groups of 16; others: 8 sub-blocks) */
    int16_t mp[8][32];          /* pairs per row: Q4_K/Q5_K (mn[2i], mn[2i + 1]), i < 4; Q6_K (sc[2i], sc[2i + 1]) */
    float d[16], dmin[16];
} kg;

#define MG 8                    /* rows of x at a time: 3 x MG of the 32 registers */

/* acc + VPDPBUSD(w, the four codes at x broadcast), written as one instruction with x from memory:
 * GCC's intrinsic keeps a copy of the accumulator around each one (two extra moves a product). */
static inline __m512i dpbusd_x(__m512i acc, __m512i w, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}

/* Rows r0 .. r0 + n (n <= 16; the rest zero) of part pt, every superblock, into g[0 .. ns). tmp: scratch of
 * KG_TMP bytes. The codes, scales and pairs are written row by row, then turned by 16 x 16 transposes. */
#define KG_TMP (16 * 256 + 2 * 16 * 16 * 4)
static void kg_unpack(const qpart *pt, int64_t row_bytes, int64_t r0, int64_t n, int64_t ns, uint8_t *tmp, kg *g) {
    const int64_t type = pt->type, bb = block_bytes(type);
    const int q6 = type == T_Q6_K;
    float *tsc = (float *)(tmp + 16 * 256);            /* [16 rows][16]: d * each group's scale */
    int32_t *tmp_ = (int32_t *)(tsc + 256);            /* [16 rows][16]: the pairs */
    for (int64_t sb = 0; sb < ns; sb++) {
        kg *o = g + sb;
        for (int64_t c = 0; c < 16; c++) {
            if (c >= n) {
                memset(tmp + 256 * c, 0, 256);
                memset(tsc + 16 * c, 0, 64);
                memset(tmp_ + 16 * c, 0, 64);
                o->d[c] = o->dmin[c] = 0.0f;
                continue;
            }
            const uint8_t *b = pt->data + (r0 + c) * row_bytes + sb * bb;
            __m512i w[4];
            __m256i sv;
            __m256 mins;
            float d;
            uint32_t u[4];                                 /* Q4_K, Q5_K: the scale and min bytes */
            k_codes(type, b, w, &sv, &d, &mins, u);
            for (int j = 0; j < 4; j++) _mm512_storeu_si512((void *)(tmp + 256 * c + 64 * j), w[j]);
            o->d[c] = d;
            if (q6) {
                const __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
                _mm512_storeu_ps(tsc + 16 * c, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
                _mm512_storeu_si512((void *)(tmp_ + 16 * c), _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(sc)));
                o->dmin[c] = 0.0f;
            } else {
                const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(d),
                                                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)u))));
                _mm512_storeu_ps(tsc + 16 * c, _mm512_zextps256_ps512(sc));
                _mm512_storeu_si512((void *)(tmp_ + 16 * c),
                                    _mm512_zextsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(u + 2)))));
                o->dmin[c] = f16(b + 2);
            }
        }
        __m512i r[16];
        for (int j = 0; j < 4; j++) {              /* quads 16 j .. 16 j + 15 of the 16 rows */
            for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_si512((const void *)(tmp + 256 * c + 64 * j));
            transpose16(r);
            for (int q = 0; q < 16; q++) _mm512_storeu_si512((void *)o->codes[16 * j + q], r[q]);
        }
        for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_si512((const void *)(tsc + 16 * c));
        transpose16(r);
        for (int j = 0; j < 16; j++) _mm512_storeu_si512((void *)o->sc[j], r[j]);
        for (int c = 0; c < 16; c++) r[c] = _mm512_loadu_si512((const void *)(tmp_ + 16 * c));
        transpose16(r);
        for (int i = 0; i < 8; i++) _mm512_storeu_si512((void *)o->mp[i], r[i]);
    }
}

/* out[t][0 .. n) for rows t0 .. t0 + mr of x against the group's records g[0 .. ns). */
#define KG_ROWS(mr, q6, name)                                                                      \
    static void name(const kg *g, int64_t ns, const xk *x, int64_t K, int64_t t0, float *out, int64_t ldo, \
                     int64_t n) {                                                                  \
        enum { groups = (q6) ? 16 : 8, quads = (q6) ? 4 : 8 };                                     \
        __m512 f[mr];                                                                              \
        for (int t = 0; t < (mr); t++) f[t] = _mm512_setzero_ps();                                 \
        for (int64_t sb = 0; sb < ns; sb++) {                                                      \
            const kg *r = g + sb;                                                                  \
            const int32_t *xq = (const int32_t *)(x->q + t0 * K + 256 * sb);                       \
            __m512 fs[mr];                                                                         \
            __m512i ia[mr];                                                                        \
            for (int t = 0; t < (mr); t++) fs[t] = _mm512_setzero_ps();                            \
            for (int j = 0; j < groups; j++) {                                                     \
                for (int t = 0; t < (mr); t++) ia[t] = _mm512_setzero_si512();                     \
                for (int qd = 0; qd < quads; qd++) {                                               \
                    const int q = j * quads + qd;                                                  \
                    const __m512i w = _mm512_loadu_si512((const void *)r->codes[q]);               \
                    for (int t = 0; t < (mr); t++) ia[t] = dpbusd_x(ia[t], w, xq + t * K / 4 + q);  \
                }                                                                                  \
                const __m512 sc = _mm512_loadu_ps(r->sc[j]);                                       \
                for (int t = 0; t < (mr); t++) fs[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[t]), sc, fs[t]); \
            }                                                                                      \
            /* the sums of x's codes: Q6_K per 16 (x->b: the even groups', then the odd ones'), the \
             * others per 32, in pairs as VPDPWSSD takes them */                                   \
            for (int t = 0; t < (mr); t++) ia[t] = _mm512_setzero_si512();                         \
            for (int i = 0; i < ((q6) ? 8 : 4); i++) {                                             \
                const __m512i mp = _mm512_loadu_si512((const void *)r->mp[i]);                     \
                for (int t = 0; t < (mr); t++)                                                     \
                    ia[t] = _mm512_dpwssd_epi32(ia[t], mp, _mm512_set1_epi32(x->p[((t0 + t) * ns + sb) * 12 + ((q6) ? 4 : 0) + i])); \
            }                                                                                      \
            /* Q6_K: 32 * d, the others dmin, times the sums of x's codes against the pairs */     \
            const __m512 dm = (q6) ? _mm512_mul_ps(_mm512_loadu_ps(r->d), _mm512_set1_ps(32.0f)) : _mm512_loadu_ps(r->dmin); \
            for (int t = 0; t < (mr); t++) {                                                       \
                const __m512 dx = _mm512_set1_ps(x->d[(t0 + t) * ns + sb]);                        \
                fs[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ia[t]), dm, fs[t]);                    \
                f[t] = _mm512_fmadd_ps(fs[t], dx, f[t]);                                           \
            }                                                                                      \
        }                                                                                          \
        const __mmask16 m = (__mmask16)((1u << n) - 1);                                            \
        for (int t = 0; t < (mr); t++) _mm512_mask_storeu_ps(out + (t0 + t) * ldo, m, f[t]);       \
    }
KG_ROWS(1, 0, kg_rows1)
KG_ROWS(1, 1, kg_rows1q6)
KG_ROWS(2, 0, kg_rows2)
KG_ROWS(2, 1, kg_rows2q6)
KG_ROWS(3, 0, kg_rows3)
KG_ROWS(3, 1, kg_rows3q6)
KG_ROWS(4, 0, kg_rows4)
KG_ROWS(4, 1, kg_rows4q6)
KG_ROWS(5, 0, kg_rows5)
KG_ROWS(5, 1, kg_rows5q6)
KG_ROWS(6, 0, kg_rows6)
KG_ROWS(6, 1, kg_rows6q6)
KG_ROWS(7, 0, kg_rows7)
KG_ROWS(7, 1, kg_rows7q6)
KG_ROWS(8, 0, kg_rows8)
KG_ROWS(8, 1, kg_rows8q6)

static void kg_rows(int mr, int q6, const kg *g, int64_t ns, const xk *x, int64_t K, int64_t t0, float *out,
                    int64_t ldo, int64_t n) {
    switch (mr) {
    case 1: (q6 ? kg_rows1q6 : kg_rows1)(g, ns, x, K, t0, out, ldo, n); break;
    case 2: (q6 ? kg_rows2q6 : kg_rows2)(g, ns, x, K, t0, out, ldo, n); break;
    case 3: (q6 ? kg_rows3q6 : kg_rows3)(g, ns, x, K, t0, out, ldo, n); break;
    case 4: (q6 ? kg_rows4q6 : kg_rows4)(g, ns, x, K, t0, out, ldo, n); break;
    case 5: (q6 ? kg_rows5q6 : kg_rows5)(g, ns, x, K, t0, out, ldo, n); break;
    case 6: (q6 ? kg_rows6q6 : kg_rows6)(g, ns, x, K, t0, out, ldo, n); break;
    case 7: (q6 ? kg_rows7q6 : kg_rows7)(g, ns, x, K, t0, out, ldo, n); break;
    default: (q6 ? kg_rows8q6 : kg_rows8)(g, ns, x, K, t0, out, ldo, n); break;
    }
}
#define HAVE_KG 1
#endif

/* Row x (K values) as Q8_K-style codes: per superblock of 256 the scale d, per 32 codes s = d *
 * their sum, per 16 codes their sum (in a record's sv order). Exact IEEE arithmetic, as quantize_row. */
EXACT static void quantize_row_k(const float *x, int64_t K, int8_t *q, float *d, float *s, int16_t *sums) {
    for (int64_t sb = 0; sb < K / 256; sb++) {
        const float *v = x + 256 * sb;
        const float amax = amax_of(v, 256);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        d[sb] = amax / 127.0f;
        for (int g = 0; g < 16; g++)               /* the even groups', then the odd ones' */
            sums[16 * sb + g % 2 * 8 + g / 2] = (int16_t)codes16(v + 16 * g, id, q + 256 * sb + 16 * g);
        for (int b = 0; b < 8; b++) s[8 * sb + b] = d[sb] * (float)(sums[16 * sb + b] + sums[16 * sb + 8 + b]);
    }
}
#endif

/* Values [k0, k0 + n) of one row (k0 and n whole blocks of the type) as float32 into dst. The
 * loops are written for the compiler's vectoriser: a block's codes widened, scaled and offset. */
static void dequant(int64_t type, const uint8_t *row, int64_t k0, int64_t n, float *restrict dst) {
    const int64_t bv = block_values(type), bb = block_bytes(type);
    const uint8_t *b = row + k0 / bv * bb;
#if defined(HAVE_FUSED)
    if (dequant_simd(type, b, n, dst)) return;
#endif
    switch (type) {
    case T_F32:
        memcpy(dst, b, (size_t)n * 4);
        return;
    case T_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = f16(b + 2 * i);
        return;
    case T_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = bf16(b + 2 * i);
        return;
    case T_Q4_0:
        for (int64_t blk = 0; blk < n / 32; blk++, b += 18, dst += 32) {
            const float d = f16(b), o = -8.0f * d;
            const uint8_t *q = b + 2;
            for (int i = 0; i < 16; i++) {
                dst[i] = (float)(q[i] & 15) * d + o;
                dst[i + 16] = (float)(q[i] >> 4) * d + o;
            }
        }
        return;
    case T_Q4_1:
        for (int64_t blk = 0; blk < n / 32; blk++, b += 20, dst += 32) {
            const float d = f16(b), m = f16(b + 2);
            const uint8_t *q = b + 4;
            for (int i = 0; i < 16; i++) {
                dst[i] = (float)(q[i] & 15) * d + m;
                dst[i + 16] = (float)(q[i] >> 4) * d + m;
            }
        }
        return;
    case T_Q5_0:
    case T_Q5_1: {
        const int one = type == T_Q5_1;
        for (int64_t blk = 0; blk < n / 32; blk++, b += 22 + 2 * one, dst += 32) {
            const float d = f16(b), o = one ? f16(b + 2) : -16.0f * d;
            uint32_t qh;
            memcpy(&qh, b + 2 + 2 * one, 4);
            const uint8_t *q = b + 6 + 2 * one;
            for (int i = 0; i < 16; i++) {
                dst[i] = (float)((q[i] & 15) | ((qh >> i) & 1) << 4) * d + o;
                dst[i + 16] = (float)((q[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) * d + o;
            }
        }
        return;
    }
    case T_Q8_0:
        for (int64_t blk = 0; blk < n / 32; blk++, b += 34, dst += 32) {
            const float d = f16(b);
            const int8_t *q = (const int8_t *)(b + 2);
            for (int i = 0; i < 32; i++) dst[i] = (float)q[i] * d;
        }
        return;
    case T_Q4_K:
    case T_Q5_K: {
        const int five = type == T_Q5_K;
        for (int64_t blk = 0; blk < n / 256; blk++, b += five ? 176 : 144, dst += 256) {
            const float d = f16(b), dmin = f16(b + 2);
            const uint8_t *qh = b + 16, *q = b + (five ? 48 : 16);
            for (int j = 0; j < 4; j++, q += 32) {
                uint8_t sc0, mn0, sc1, mn1;
                k_scale_min(b + 4, 2 * j, &sc0, &mn0);
                k_scale_min(b + 4, 2 * j + 1, &sc1, &mn1);
                const float s0 = d * sc0, o0 = -(dmin * mn0), s1 = d * sc1, o1 = -(dmin * mn1);
                float *lo = dst + 64 * j, *hi = lo + 32;
                if (five) {
                    for (int i = 0; i < 32; i++) {
                        lo[i] = (float)((q[i] & 15) | ((qh[i] >> (2 * j)) & 1) << 4) * s0 + o0;
                        hi[i] = (float)((q[i] >> 4) | ((qh[i] >> (2 * j + 1)) & 1) << 4) * s1 + o1;
                    }
                } else {
                    for (int i = 0; i < 32; i++) {
                        lo[i] = (float)(q[i] & 15) * s0 + o0;
                        hi[i] = (float)(q[i] >> 4) * s1 + o1;
                    }
                }
            }
        }
        return;
    }
    case T_Q6_K:
        for (int64_t blk = 0; blk < n / 256; blk++, b += 210, dst += 256) {
            const float d = f16(b + 208);
            const int8_t *sc = (const int8_t *)(b + 192);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                float *o = dst + 128 * h;
                const int8_t *s = sc + 8 * h;
                /* value i of each quarter: its scale is s[quarter * 2 + i / 16] */
                for (int i = 0; i < 32; i++) {
                    const float a0 = d * s[i / 16], a1 = d * s[2 + i / 16], a2 = d * s[4 + i / 16],
                                a3 = d * s[6 + i / 16];
                    o[i] = (float)((ql[i] & 15) | (qh[i] & 3) << 4) * a0 - 32.0f * a0;
                    o[i + 32] = (float)((ql[i + 32] & 15) | ((qh[i] >> 2) & 3) << 4) * a1 - 32.0f * a1;
                    o[i + 64] = (float)((ql[i] >> 4) | ((qh[i] >> 4) & 3) << 4) * a2 - 32.0f * a2;
                    o[i + 96] = (float)((ql[i + 32] >> 4) | ((qh[i] >> 6) & 3) << 4) * a3 - 32.0f * a3;
                }
            }
        }
        return;
    }
}

/* acc[r][c] += x[r][0..kc) * w[c][0..kc) lane-wise, for r < mr (compile-time), c < NR. */
#define TILE(mr)                                                                                   \
    static inline void tile##mr(const float *restrict x, int64_t ldx, const float *restrict w,    \
                                int64_t k, float *restrict acc) {                                  \
        vf a[mr][NR];                                                                              \
        for (int r = 0; r < mr; r++)                                                               \
            for (int c = 0; c < NR; c++) a[r][c] = (vf){0};                                        \
        for (int64_t i = 0; i < k; i += VN) {                                                      \
            vf wv[NR];                                                                             \
            for (int c = 0; c < NR; c++) wv[c] = vload(w + c * k + i);                             \
            for (int r = 0; r < mr; r++) {                                                         \
                const vf xv = vload(x + r * ldx + i);                                              \
                for (int c = 0; c < NR; c++) a[r][c] = FMA(xv, wv[c], a[r][c]);                    \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < mr; r++)                                                               \
            for (int c = 0; c < NR; c++) vstore(acc + (r * NR + c) * VN, a[r][c]);                 \
    }
TILE(1)
TILE(2)
TILE(3)
#if MR > 3
TILE(4)
#endif

static inline void tile_rows(int mr, const float *x, int64_t ldx, const float *w, int64_t kc, float *acc) {
    switch (mr) {
    case 1: tile1(x, ldx, w, kc, acc); break;
    case 2: tile2(x, ldx, w, kc, acc); break;
    case 3: tile3(x, ldx, w, kc, acc); break;
#if MR > 3
    case 4: tile4(x, ldx, w, kc, acc); break;
#endif
    }
}

/* The NR running sums of one row of x (acc: NR vectors of VN lanes), each added across its lanes
 * by one fixed tree, into dst[0 .. nr). Every path ends its outputs here, so the order is the same
 * whichever path computed them. */
#if defined(__AVX512F__)
static inline __m128 fold(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

static inline void reduce_row(const float *acc, float *dst, int64_t nr) {
    __m128 r0 = fold(_mm512_loadu_ps(acc)), r1 = fold(_mm512_loadu_ps(acc + VN)),
           r2 = fold(_mm512_loadu_ps(acc + 2 * VN)), r3 = fold(_mm512_loadu_ps(acc + 3 * VN));
    _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
    const __m128 sum = _mm_add_ps(_mm_add_ps(r0, r1), _mm_add_ps(r2, r3));
    if (nr == NR) {
        _mm_storeu_ps(dst, sum);
    } else {
        float t[4];
        _mm_storeu_ps(t, sum);
        for (int64_t c = 0; c < nr; c++) dst[c] = t[c];
    }
}
#else
static inline void reduce_row(const float *acc, float *dst, int64_t nr) {
    for (int64_t c = 0; c < nr; c++) {
        float t[VN];
        memcpy(t, acc + c * VN, sizeof t);
        for (int w = VN / 2; w >= 1; w /= 2)
            for (int l = 0; l < w; l++) t[l] += t[l + w];
        dst[c] = t[0];
    }
}
#endif

typedef struct {
    const float *x;
    int64_t T, K, ldx;
    const qpart *parts;
    int64_t num_parts;
    int64_t part_panels[MAX_PARTS + 1];   /* prefix sums of each part's panels */
    float *out;
    int64_t ldo;
    const uint16_t *xb;                   /* x rounded to bfloat16 [T, K]: the `fast` numerics; else NULL */
    int amx;                              /* big `fast` steps on the AMX tiles (xb padded to 32 rows) */
    const int8_t *xq;                     /* x as int8 codes [T, K] (the `fast` numerics on AVX2); else NULL */
    const float *xd, *xs;                 /* per row and block of 32: the scale, and scale * the codes' sum */
    const int8_t *kq;                     /* x as int8 codes per superblock [T, K] (K-quants' `fast` on AVX2) */
    const float *kd, *ks;                 /* their scales [T, K/256], and scale * each 32 codes' sum [T, K/32] */
    const int16_t *kb;                    /* each 16 codes' sum [T, K/16] */
    const int32_t *kp;                    /* kg_panels: those sums in VPDPWSSD's pairs [T, K/256, 12] */
} job;

/* The most rows a float32 step of this job takes on the fused path. */
static inline int64_t fused_max_rows(const job *jb) {
    return jb->K >= WIDE_K ? FUSED_MAX_ROWS_WIDE : FUSED_MAX_ROWS;
}

/* *buf grown to at least `bytes` (64-byte aligned; its contents not kept), or NULL when out of
 * memory: a thread's buffer, kept for its life. */
static void *grown(void **buf, int64_t *size, int64_t bytes) {
    if (bytes > *size) {
        free(*buf);
        *buf = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        *size = *buf == NULL ? 0 : bytes;
    }
    return *buf;
}

/* A thread's buffer for one panel's widened rows (a few hundred KiB at most). */
static float *panel_buffer(int64_t floats) {
    static __thread void *buf = NULL;
    static __thread int64_t size = 0;
    return grown(&buf, &size, floats * 4);
}

/* Where panel p lies: its part, the part's first output column, the panel's first row in the part,
 * the bytes of one of the part's rows, and the panel where the next part begins. */
typedef struct {
    const qpart *pt;
    int64_t col0, r0, row_bytes, part_end;
} placed;

static placed place(const job *jb, int64_t p) {
    int64_t part = 0;
    while (jb->part_panels[part + 1] <= p) part++;
    const qpart *pt = &jb->parts[part];
    int64_t col0 = 0;
    for (int64_t i = 0; i < part; i++) col0 += jb->parts[i].rows;
    return (placed){pt, col0, (p - jb->part_panels[part]) * NR, jb->K / block_values(pt->type) * block_bytes(pt->type),
                    jb->part_panels[part + 1]};
}

#if defined(HAVE_BF16)
/* rows r0 .. r0 + n (n <= 32) of part pt as pairs of bfloat16 in the lanes (the AMX tiles' layout, and
 * bg_rows'): for 32 values of K (chunk ks) and 16 rows of W (cb), 16 vectors of 16 pairs:
 * panel[((ks * 2 + cb) * 16 + p) * 16 + c] = values 2p and 2p + 1 of chunk ks of row 16 cb + c, as one
 * 32-bit unit (rows past n are zero). rows_bf [16][256] bfloat16 and row [256] float32: scratch. */
static void widen_pairs(const qpart *pt, int64_t K, int64_t row_bytes, int64_t r0, int64_t n, float *row,
                        bf16_t *rows_bf, uint32_t *panel) {
    const int64_t halves = 2;
    const int64_t type = pt->type;
    if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0) {   /* a block a chunk: widened in registers */
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
 * read them (widen_pairs, once per step; Q4_0, Q4_1 and Q8_0 widened in registers, a block a chunk),
 * and each pair of values of a row of x, broadcast, multiplies both by VDPBF16PS. No sums across lanes
 * at the end, where the tiled path's reduce_row of every 4 x 4 outputs weighed on products of the
 * default model's K of 576, and each broadcast serves 32 weight rows. The broadcast is its own
 * instruction: as VDPBF16PS's {1to16} memory operand the products were slower on Zen 4 (ad hoc).
 * The default model's products at 32 rows, 2 threads, Zen 4: 29.4 against 30.6-35.2 ms a step
 * (docs/benchmarks.md). A row's bits are the same in every step of this size, and differ from smaller
 * steps' (forge_qmatmul_bf16_split). */
#define HAVE_BG 1
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
static int64_t bg_group(const job *jb, int64_t p, int64_t p_hi) {
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
#if defined(HAVE_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8
#endif
#ifndef AMX_X_BYTES
#define AMX_X_BYTES (1 << 22)
#endif
int amx_enable(void);                       /* amx_gemm.c: Linux's permission, once per process */
void amx_load_config(void);                 /* amx_gemm.c: the tiles' shapes, on this thread */

static int amx_usable(void) {
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
static void amx_panels(const job *jb, int64_t p_lo, int64_t p_hi) {
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

static void run_panel(const job *jb, int64_t p, int64_t t_lo, int64_t t_hi);

#if defined(HAVE_KG)
/* Big `fast` steps with K-quant parts on AVX-512 VNNI: their panels four at a time (16 rows of one
 * part) through the lanes-as-rows kernel, unpacked once per step, every row of x against them; the
 * other parts' panels through bg_rows (bfloat16). */
static void kg_panels(const job *jb, int64_t p_lo, int64_t p_hi) {
    static __thread void *buf = NULL;
    static __thread int64_t size = 0;
    const int64_t K = jb->K, ns = K / 256;
    uint8_t *tmp = grown(&buf, &size, KG_TMP + ns * (int64_t)sizeof(kg));
    if (tmp == NULL) abort();                   /* a few hundred KiB: the process is out of memory */
    kg *g = (kg *)(tmp + KG_TMP);
    const xk x = {jb->kq, jb->kd, jb->ks, jb->kb, jb->kp};
    for (int64_t p = p_lo; p < p_hi;) {
        const placed at = place(jb, p);
        if (!k_type(at.pt->type)) {            /* bfloat16: x rounded for them (jb->xb) */
            p = bg_group(jb, p, p_hi);
            continue;
        }
        int64_t end = p + 4;                    /* four panels of one part, within this thread's run */
        if (end > p_hi) end = p_hi;
        if (end > at.part_end) end = at.part_end;
        int64_t n = (end - p) * NR;
        if (n > at.pt->rows - at.r0) n = at.pt->rows - at.r0;
        kg_unpack(at.pt, at.row_bytes, at.r0, n, ns, tmp, g);
        for (int64_t t0 = 0; t0 < jb->T; t0 += MG)
            kg_rows((int)(jb->T - t0 < MG ? jb->T - t0 : MG), at.pt->type == T_Q6_K, g, ns, &x, K, t0,
                    jb->out + at.col0 + at.r0, jb->ldo, n);
        p = end;
    }
}
#endif

/* Panels [p_lo, p_hi) of the whole (all parts) into out: small steps panel by panel; big ones in
 * tiles of rows of x that stay in L2 (about 384 KiB), each tile over every panel. */
static void run_panels(const job *jb, int64_t p_lo, int64_t p_hi) {
#if defined(HAVE_AMX)
    if (jb->amx) {
        amx_panels(jb, p_lo, p_hi);
        return;
    }
#endif
#if defined(HAVE_KG)
    if (jb->kq != NULL && jb->T > I8K_MAX_ROWS) {
        kg_panels(jb, p_lo, p_hi);
        return;
    }
#endif
#if defined(HAVE_BG)
    if (jb->xb != NULL && jb->T > FUSED_MAX_ROWS_BF16) {     /* the K-quants' panels (int8) as before */
        for (int64_t p = p_lo; p < p_hi;) {
            if (jb->kq != NULL && k_type(place(jb, p).pt->type)) run_panel(jb, p++, 0, jb->T);
            else p = bg_group(jb, p, p_hi);
        }
        return;
    }
#endif
    if (jb->T <= fused_max_rows(jb)) {
        for (int64_t p = p_lo; p < p_hi; p++) run_panel(jb, p, 0, jb->T);
        return;
    }
#if defined(HAVE_I8K)
    if (jb->kq != NULL) {                 /* int8 codes of x in tiles of ~256 KiB, each over every panel */
        int64_t tb = 262144 / jb->K / KR * KR;
        tb = tb < 32 ? 32 : tb > 256 ? 256 : tb;
        for (int64_t t0 = 0; t0 < jb->T; t0 += tb)
            for (int64_t p = p_lo; p < p_hi; p++) run_panel(jb, p, t0, jb->T - t0 < tb ? jb->T : t0 + tb);
        return;
    }
#endif
    /* x tiles of ~384 KiB of floats, or ~768 KiB of bfloat16 rows: twice the rows, so that each panel's
     * widening (dequant, then rounding) is shared by more of them (measured 555-573 against 498
     * GFLOP/s at 512 rows on 1.7B-shaped layers; ad-hoc, docs/benchmarks.md) */
    int64_t tb = (jb->xb != NULL ? 393216 : 98304) / jb->K / MR * MR;
    tb = tb < 32 ? 32 : tb > 256 ? 256 : tb;
    for (int64_t t0 = 0; t0 < jb->T; t0 += tb)
        for (int64_t p = p_lo; p < p_hi; p++) run_panel(jb, p, t0, jb->T - t0 < tb ? jb->T : t0 + tb);
}

/* Panel p for rows [t_lo, t_hi) of x. */
static void run_panel(const job *jb, int64_t p, int64_t t_lo, int64_t t_hi) {
    float acc[(FUSED_MAX_ROWS > MR ? FUSED_MAX_ROWS : MR) * NR * VN] __attribute__((aligned(64)));
    const int64_t K = jb->K;
    const placed at = place(jb, p);
    const qpart *pt = at.pt;
    const int64_t col0 = at.col0, r0 = at.r0, row_bytes = at.row_bytes;
    const int64_t nr = pt->rows - r0 < NR ? pt->rows - r0 : NR;
    const int bf = jb->xb != NULL;                 /* the fast numerics: x and the panel in bfloat16 */
#if defined(HAVE_I8K)
    if (jb->kq != NULL && k_type(pt->type)) {      /* K-quants in the fast numerics, every step */
        const xk x = {jb->kq, jb->kd, jb->ks, jb->kb, NULL};
#if defined(__AVX512F__)
        /* decode-sized steps (bigger ones go to kg_panels): straight from the blocks */
        for (int64_t t0 = t_lo; t0 < t_hi; t0 += KD) {
            const int mr = (int)(t_hi - t0 < KD ? t_hi - t0 : KD);
            memset(acc, 0, (size_t)mr * NR * VN * sizeof(float));
            for (int64_t c = 0; c < nr; c++)
                k_direct(mr, pt->type, pt->data + (r0 + c) * row_bytes, &x, K, t0, acc + c * VN);
            for (int64_t t = 0; t < mr; t++)
                reduce_row(acc + t * NR * VN, jb->out + (t0 + t) * jb->ldo + col0 + r0, nr);
        }
        return;
#else
        const int64_t ns = K / 256, bb = block_bytes(pt->type);
        ksb *panel = k_panel_buffer(NR * ns);
        if (panel == NULL) abort();                /* tens of KiB: the process is out of memory */
        for (int64_t c = 0; c < NR; c++) {
            const uint8_t *row = pt->data + (r0 + (c < nr ? c : 0)) * row_bytes;
            for (int64_t sb = 0; sb < ns; sb++) {
                const uint8_t *b = row + sb * bb;
                for (int l = 0; l < 3; l++) PREFETCH(b + PF_AHEAD + 64 * l);
                k_unpack(pt->type, b, panel + c * ns + sb);
            }
        }
        for (int64_t t0 = t_lo; t0 < t_hi; t0 += KR) {
            const int mr = (int)(t_hi - t0 < KR ? t_hi - t0 : KR);
            memset(acc, 0, (size_t)mr * NR * VN * sizeof(float));
            for (int64_t c = 0; c < NR; c++)
                k_rows(mr, pt->type == T_Q6_K, panel + c * ns, 0, ns, &x, K, t0, acc + c * VN);
            for (int64_t t = 0; t < mr; t++)
                reduce_row(acc + t * NR * VN, jb->out + (t0 + t) * jb->ldo + col0 + r0, nr);
        }
        return;
#endif
    }
#endif
#if defined(HAVE_I8)
    if (jb->xq != NULL && i8_type(pt->type)) {     /* the other types' int8 products: steps of up to I8_MAX_ROWS */
        const uint8_t *rows[NR];
        const int64_t nb = K / 32;
        for (int64_t c = 0; c < NR; c++) rows[c] = pt->data + (r0 + (c < nr ? c : 0)) * row_bytes;
        for (int64_t t0 = t_lo; t0 < t_hi; t0 += FR8) {
            const int mr = (int)(t_hi - t0 < FR8 ? t_hi - t0 : FR8);
            memset(acc, 0, (size_t)mr * NR * VN * sizeof(float));
            fused_rows_i8(mr, jb->xq + t0 * K, jb->xd + t0 * nb, jb->xs + t0 * nb, K, pt->type, rows, acc);
            for (int64_t t = 0; t < mr; t++)
                reduce_row(acc + t * NR * VN, jb->out + (t0 + t) * jb->ldo + col0 + r0, nr);
        }
        return;
    }
#endif
#if defined(HAVE_FUSED)
#if defined(HAVE_BF16)
    const int64_t fused_max = bf ? FUSED_MAX_ROWS_BF16 : fused_max_rows(jb);
#else
    const int64_t fused_max = fused_max_rows(jb);
#endif
    if (jb->T <= fused_max && fused_type(pt->type)) {
        const uint8_t *rows[NR];
        for (int64_t c = 0; c < NR; c++) rows[c] = pt->data + (r0 + (c < nr ? c : 0)) * row_bytes;
        for (int64_t t0 = 0; t0 < jb->T; t0 += FR) {      /* the panel stays in L1 between groups */
            const int mr = (int)(jb->T - t0 < FR ? jb->T - t0 : FR);
            memset(acc, 0, (size_t)mr * NR * VN * sizeof(float));
#if defined(HAVE_BF16)
            if (bf) fused_rows_bf16(mr, jb->xb + t0 * K, K, 0, K, pt->type, rows, acc);
            else
#endif
                fused_rows(mr, jb->x + t0 * jb->ldx, jb->ldx, 0, K, pt->type, rows, acc);
            for (int64_t t = 0; t < mr; t++)
                reduce_row(acc + t * NR * VN, jb->out + (t0 + t) * jb->ldo + col0 + r0, nr);
        }
        return;
    }
#endif
    /* The tiled path: the panel's rows widened whole (NR x K floats, in L1 or L2; in the fast
     * numerics each row widened into float scratch, then rounded into a bfloat16 panel), then
     * every row of a tile of x takes its dot products with them, MR rows at a time, the sums in
     * registers over all of K. */
    float *wpanel = panel_buffer(bf ? NR * K / 2 + K : NR * K);
    if (wpanel == NULL) abort();                /* a few hundred KiB: the process is out of memory */
    float *row = bf ? wpanel + NR * K / 2 : NULL;
    for (int64_t c = 0; c < NR; c++) {
        float *dst = bf ? row : wpanel + c * K;
        if (c < nr) dequant(pt->type, pt->data + (r0 + c) * row_bytes, 0, K, dst);
        else memset(dst, 0, (size_t)K * sizeof(float));
#if defined(HAVE_BF16)
        if (bf) to_bf16(row, K, (bf16_t *)wpanel + c * K);
#endif
    }
    for (int64_t t = 0; t < t_hi - t_lo; t += MR) {
        const int mr = (int)(t_hi - t_lo - t < MR ? t_hi - t_lo - t : MR);
#if defined(HAVE_BF16)
        if (bf) tile_rows_bf16(mr, jb->xb + (t_lo + t) * K, K, (const bf16_t *)wpanel, K, acc);
        else
#endif
            tile_rows(mr, jb->x + (t_lo + t) * jb->ldx, jb->ldx, wpanel, K, acc);
        for (int r = 0; r < mr; r++)
            reduce_row(acc + r * NR * VN, jb->out + (t_lo + t + r) * jb->ldo + col0 + r0, nr);
    }
}

/* Part `index` of `count` of a job, on one of the pool's threads: its contiguous run of panels. */
static void panels_of(const job *jb, int index, int count, int64_t *lo, int64_t *hi) {
    const int64_t total = jb->part_panels[jb->num_parts];
    *lo = total * index / count;
    *hi = total * (index + 1) / count;
}

static void qmatmul_part(const void *ctx, int index, int count) {
    int64_t lo, hi;
    panels_of((const job *)ctx, index, count, &lo, &hi);
    run_panels((const job *)ctx, lo, hi);
}

/* Whether a `fast` step of T rows takes the K-quants' int8 products (where the build has them). */
#if defined(HAVE_KG)
#define K_INT8_STEP(T) 1                        /* every step: decode from the blocks, bigger ones kg_panels */
#else
#define K_INT8_STEP(T) ((T) <= I8K_MAX_ROWS)
#endif

/* out[t][col] = sum_k x[t][k] * W[col][k] for t < T, W the parts stacked (see the header).
 * x [T, ldx] float32 (the first K used), out [T, ldo] float32. Returns 0, or -1 for a type this
 * kernel does not read, K not whole blocks, or too many parts. */
int forge_qmatmul(const float *x, int64_t T, int64_t K, int64_t ldx, const qpart *parts, int64_t num_parts,
                  float *out, int64_t ldo, int64_t fast) {
    if (num_parts < 1 || num_parts > MAX_PARTS || K <= 0 || K % 32) return -1;
#if !defined(HAVE_BF16) && !defined(HAVE_I8)
    if (fast) return -2;
#endif
    job jb = {.x = x, .T = T, .K = K, .ldx = ldx, .parts = parts, .num_parts = num_parts, .out = out, .ldo = ldo,
              .xb = NULL, .amx = 0, .xq = NULL, .xd = NULL, .xs = NULL, .kq = NULL, .kd = NULL, .ks = NULL,
              .kb = NULL, .kp = NULL};
    jb.part_panels[0] = 0;
    for (int64_t i = 0; i < num_parts; i++) {
        const int64_t bv = block_values(parts[i].type);
        if (bv == 0 || K % bv || parts[i].rows < 0) return -1;
        jb.part_panels[i + 1] = jb.part_panels[i] + (parts[i].rows + NR - 1) / NR;
    }
    if (T <= 0) return 0;
    int any_k = 0, any_other = 0;
    for (int64_t i = 0; i < num_parts; i++) {
        if (k_type(parts[i].type)) any_k = 1;
        else any_other = 1;
    }
    const int k_int8 = any_k && K % 256 == 0;   /* the K-quants' int8 products, where the build has them */
    (void)k_int8, (void)any_other;
#if defined(HAVE_BF16)
#if defined(HAVE_AMX)
    /* With the tiles, smaller `fast` steps take the float32 path: on the Intel host its one-row decode
     * is faster than the bfloat16 one (and exact), and the bits differ across AMX_MIN_ROWS anyway. */
    if (fast && T < AMX_MIN_ROWS && amx_usable()) fast = 0;
#endif
#if defined(HAVE_I8K)
    /* With int8 K-quants beside bfloat16 (AVX-512), x is rounded to bfloat16 only for the other types,
     * or where the step goes to the AMX tiles (which take every type). */
#if defined(HAVE_AMX)
    if (fast && !(k_int8 && K_INT8_STEP(T) && !any_other && !(T >= AMX_MIN_ROWS && amx_usable()))) {
#else
    if (fast && !(k_int8 && K_INT8_STEP(T) && !any_other)) {
#endif
#else
    if (fast) {                           /* x rounded once, on the caller's thread */
#endif
        static __thread void *buf = NULL;
        static __thread int64_t size = 0;
        int64_t rows = T;
#if defined(HAVE_AMX)
        jb.amx = amx_usable();                        /* T >= AMX_MIN_ROWS here */
        if (jb.amx) rows = (T + 31) / 32 * 32;        /* the tiles read x 32 rows at a time */
#endif
        bf16_t *xb = grown(&buf, &size, rows * K * 2);
        if (xb == NULL) return -3;
        for (int64_t t = 0; t < T; t++) to_bf16(x + t * ldx, K, xb + t * K);
        memset(xb + T * K, 0, (size_t)((rows - T) * K) * sizeof *xb);
        jb.xb = xb;
    }
#endif
#if defined(HAVE_I8K)
    if (fast && k_int8 && K_INT8_STEP(T) && !jb.amx) {   /* x quantized once per superblock */
        static __thread void *buf = NULL;
        static __thread int64_t size = 0;
        const int64_t ns = K / 256, nb = K / 32, ng = K / 16;
        float *scales = grown(&buf, &size, (T * ns + T * nb) * 4 + T * ng * 2 + T * K);
        if (scales == NULL) return -3;
        int16_t *sums = (int16_t *)(scales + T * ns + T * nb);
        int8_t *codes = (int8_t *)(sums + T * ng);
        for (int64_t t = 0; t < T; t++)
            quantize_row_k(x + t * ldx, K, codes + t * K, scales + t * ns, scales + T * ns + t * nb, sums + t * ng);
        jb.kq = codes, jb.kd = scales, jb.ks = scales + T * ns, jb.kb = sums;
#if defined(HAVE_KG)
        if (T > I8K_MAX_ROWS) {             /* kg_panels' sums of x's codes, as VPDPWSSD's pairs */
            static __thread void *pbuf = NULL;
            static __thread int64_t psize = 0;
            int32_t *pairs = grown(&pbuf, &psize, T * ns * 12 * 4);
            if (pairs == NULL) return -3;
            for (int64_t t = 0; t < T; t++)
                for (int64_t sb = 0; sb < ns; sb++) {
                    const int16_t *bs = sums + t * ng + 16 * sb;   /* the even groups', then the odd ones' */
                    int32_t *o = pairs + (t * ns + sb) * 12;
                    for (int i = 0; i < 4; i++)                   /* per 32: groups 2j and 2j + 1 */
                        o[i] = (int32_t)((uint32_t)(uint16_t)(bs[2 * i] + bs[8 + 2 * i]) |
                                         (uint32_t)(uint16_t)(bs[2 * i + 1] + bs[9 + 2 * i]) << 16);
                    for (int i = 0; i < 8; i++)                   /* per 16: groups 2i and 2i + 1 */
                        o[4 + i] = (int32_t)((uint32_t)(uint16_t)bs[i] | (uint32_t)(uint16_t)bs[8 + i] << 16);
                }
            jb.kp = pairs;
        }
#endif
    }
#endif
#if defined(HAVE_I8)
    int any_i8 = 0;
    for (int64_t i = 0; i < num_parts; i++) any_i8 |= i8_type(parts[i].type);
    if (fast && any_i8 && T <= I8_MAX_ROWS) {   /* x quantized once per block of 32 */
        static __thread void *buf = NULL;
        static __thread int64_t size = 0;
        const int64_t nb = K / 32;
        float *scales = grown(&buf, &size, T * K + 2 * T * nb * 4);
        if (scales == NULL) return -3;
        int8_t *codes = (int8_t *)(scales + 2 * T * nb);
        for (int64_t t = 0; t < T; t++)
            quantize_row(x + t * ldx, K, codes + t * K, scales + t * nb, scales + T * nb + t * nb);
        jb.xq = codes, jb.xd = scales, jb.xs = scales + T * nb;
    }
#endif
    forge_run_parallel(qmatmul_part, &jb, jb.part_panels[num_parts] > 1);
    return 0;
}

/* The fewest rows of a `fast` step that run on the AMX tiles here (AMX_MIN_ROWS), or 0 where none
 * do (the build has no tiles, or Linux does not allow them). */
int forge_qmatmul_amx(void) {
#if defined(HAVE_AMX)
    return amx_usable() ? AMX_MIN_ROWS : 0;
#else
    return 0;
#endif
}

/* The most rows of a `fast` step that take the int8 products here (I8_MAX_ROWS), or 0 where the
 * build has none (bigger steps take the float32 path). */
int forge_qmatmul_int8_rows(void) {
#if defined(HAVE_I8)
    return I8_MAX_ROWS;
#else
    return 0;
#endif
}

/* The most rows of a `fast` step whose K-quant products are int8 here (INT64_MAX: every step), or 0
 * where the build has none. */
int64_t forge_qmatmul_int8_k_rows(void) {
#if defined(HAVE_KG) || (defined(HAVE_I8K) && !defined(__AVX512F__))
    return INT64_MAX;
#elif defined(HAVE_I8K)
    return I8K_MAX_ROWS;
#else
    return 0;
#endif
}

/* The most rows of a `fast` K-quant step that the decode kernels take here, bigger ones adding in
 * another order (the lanes-as-rows kernel: a row's bits differ across this bound), or 0 where one
 * kernel takes every step. */
int64_t forge_qmatmul_int8_k_split(void) {
#if defined(HAVE_KG)
    return I8K_MAX_ROWS;
#else
    return 0;
#endif
}

/* The most rows of a `fast` bfloat16 step that the fused path takes here, bigger ones adding in another
 * order (32 weight rows in the lanes: a row's bits differ across this bound), or 0 where one order
 * serves every step. */
int64_t forge_qmatmul_bf16_split(void) {
#if defined(HAVE_BG)
    return FUSED_MAX_ROWS_BF16;
#else
    return 0;
#endif
}

/* Which `fast` numerics this build has: 1 bfloat16 products (AVX-512 BF16), 2 int8 activations
 * (AVX2), 3 int8 activations for the K-quants and bfloat16 for the other types (AVX-512 with BW,
 * VNNI and BF16), 0 none. */
int forge_qmatmul_fast(void) {
#if defined(HAVE_BF16) && defined(HAVE_I8K)
    return 3;
#elif defined(HAVE_BF16)
    return 1;
#elif defined(HAVE_I8)
    return 2;
#else
    return 0;
#endif
}

/* Rows of one part dequantized into dst [n, K] float32 (for tests and the embedding lookup). */
int forge_dequant_rows(const uint8_t *data, int64_t type, int64_t K, const int64_t *rows, int64_t n, float *dst) {
    const int64_t bv = block_values(type);
    if (bv == 0 || K % bv || (bv < 32 && K % 32)) return -1;
    const int64_t row_bytes = K / bv * block_bytes(type);
    for (int64_t i = 0; i < n; i++) dequant(type, data + rows[i] * row_bytes, 0, K, dst + i * K);
    return 0;
}

/* The vector width this build computes in (16 with AVX-512, 8 without). */
int forge_qmatmul_lanes(void) { return VN; }
