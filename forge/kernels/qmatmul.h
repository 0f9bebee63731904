/* What the files of forge's product straight from GGUF blocks share (the product and its overview:
 * qmatmul.c). Each file includes this header first:
 *
 *   the ggml type ids and a part's layout (qpart, the structure forge.kernels.products passes);
 *   the shapes of the register tiles (VN lanes, MR x NR tiles, FR rows of x on the fused path);
 *   which paths a build has (HAVE_*), decided once here from the compiler's -m flags so that every
 *     file agrees (forge.kernels.compiled builds each level with its own flags: ISA_FLAGS);
 *   the small helpers every path widens and adds with (f16, block_bytes, reduce_row, ...), inline;
 *   the job (one call's arguments and x's forms) and where a panel lies in it (place);
 *   the functions one file defines and another calls, hidden from the library's exported symbols.
 */
#ifndef FORGE_QMATMUL_H
#define FORGE_QMATMUL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* A function of one file of the product that another calls: not one of the library's symbols. */
#define FORGE_HIDDEN __attribute__((visibility("hidden")))

/* ---- ggml type ids (gguf.constants.GGMLQuantizationType) ------------------------------------- */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23,
       T_BF16 = 30, T_MXFP4 = 39 };

typedef struct {
    const uint8_t *data;    /* rows * row_bytes bytes, the file's blocks row after row */
    int64_t rows;           /* output features of this part */
    int64_t type;           /* ggml type id */
} qpart;

/* ---- the register tiles: VN lanes a vector, MR x NR tiles of dot products, FR rows of x fused -- */
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

/* forge_qmatmul's `fast` for the deterministic numerics: qmatmul_det.c's product (exported there). */
#define FORGE_DET 2
/* A part's type flag: its data in the deterministic product's own layout (qmatmul_det_pack.h), which only that
 * product reads: groups of 16 rows, det_group_bytes(type, K) each. */
#define DET_PACKED 0x100
FORGE_HIDDEN int64_t det_group_bytes(int64_t type, int64_t K);
int forge_qmatmul_det(const float *x, int64_t T, int64_t K, int64_t ldx, const qpart *parts, int64_t num_parts,
                      float *out, int64_t ldo);
int forge_qmatmul_det_type(int64_t type);

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

/* The K-quants whose `fast` numerics are int8 products (x per superblock of 256). */
static inline int k_type(int64_t type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K; }

/* Bytes per row and values per block of each type; 0: not a type this kernel reads. */
static inline int64_t block_values(int64_t type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_IQ4_NL: case T_MXFP4: return 32;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 0;
    }
}

static inline int64_t block_bytes(int64_t type) {
    switch (type) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_IQ4_NL: return 18;
    case T_MXFP4: return 17;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_IQ4_XS: return 136;
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

/* ---- what a build has: its paths, from the compiler's -m flags ------------------------------------ */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* The SIMD widening and the fused path of small steps: qmatmul_avx512.c, or qmatmul_avx2.c. */
#define HAVE_FUSED 1
/* Weights are read this many bytes ahead of their use (software prefetch: each thread streams
 * NR rows at once, more than the hardware prefetcher follows at full speed; measured on a 2-core
 * EPYC, one decoding row: 9 GB/s without, 20 GB/s with 16 KiB; docs/benchmarks.md). */
#ifndef PF_AHEAD
#define PF_AHEAD 16384
#endif
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The `fast` numerics in bfloat16 (qmatmul_avx512.c): x and the widened weights rounded to bfloat16,
 * pair dot products. Steps of up to FUSED_MAX_ROWS_BF16 rows on the fused path, bigger ones with weight
 * rows in the lanes (bg_rows: HAVE_BG) or on the AMX tiles (HAVE_AMX). */
#define HAVE_BF16 1
#ifndef FUSED_MAX_ROWS_BF16
#define FUSED_MAX_ROWS_BF16 4
#endif
typedef uint16_t bf16_t;

static inline __m512bh bh_load(const bf16_t *p) { return (__m512bh)_mm512_loadu_si512((const void *)p); }
static inline __m512bh bh_pair(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }

/* n floats (n a multiple of 32) rounded to bfloat16, in order. */
static inline void to_bf16(const float *src, int64_t n, bf16_t *dst) {
    for (int64_t i = 0; i < n; i += 32)
        _mm512_storeu_si512((void *)(dst + i), (__m512i)bh_pair(_mm512_loadu_ps(src + i), _mm512_loadu_ps(src + i + 16)));
}
#define HAVE_BG 1
#endif

/* The `fast` numerics' int8 products (qmatmul_int8.c; the K-quants' on AVX-512: qmatmul_int8_avx512.c).
 * AVX2 builds (no AVX-512): int8 activations for Q4_0, Q4_1, Q8_0 and the table types IQ4_NL, IQ4_XS,
 * MXFP4 (HAVE_I8) and the K-quants Q4_K, Q5_K, Q6_K; AVX-512
 * builds with BW, VNNI and BF16: the K-quants' (HAVE_KG for their bigger steps), the other types' staying
 * bfloat16. */
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
#define KR 4                    /* AVX2: rows of x a K-quant panel's records take at a time */
#endif

#if defined(HAVE_I8K) && !defined(__AVX512F__)
#define HAVE_I8 1
/* The types whose int8 products take x per block of 32 (steps of up to I8_MAX_ROWS rows). */
static inline int i8_type(int64_t type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_IQ4_NL || type == T_IQ4_XS ||
           type == T_MXFP4;
}

#define FR8 2
/* Q4_0, Q4_1, Q8_0 and the table types: steps of up to I8_MAX_ROWS rows take the int8 products; bigger ones
 * (prefill) the float32 path, faster there: the int8 rows go FR8 at a time through each panel,
 * widening its codes again for each pair, where the float32 tiles widen a panel once for a whole tile of x (1.7B-shaped layers,
 * AVX2 host, ms int8 against float32: 21.3 / 45.2 at 1 row, 66.8 / 97.4 at 4, 144.1 / 123.5 at 5,
 * 172.7 / 146.9 at 8, 8,122 / 4,918 at 512; docs/benchmarks.md). A row's bits then differ
 * between steps of up to I8_MAX_ROWS rows and bigger ones, as with the AMX tiles. */
#ifndef I8_MAX_ROWS
#define I8_MAX_ROWS 4
#endif
#endif

#if defined(HAVE_I8K) && defined(__AVX512F__)
#define HAVE_KG 1               /* bigger K-quant steps with 16 weight rows in the lanes (kg_panels) */
#endif

/* Big `fast` steps on the AMX tiles (qmatmul_avx512.c): AMX_MIN_ROWS rows or more, x in tiles of
 * AMX_X_BYTES. A build without the AMX flags (FORGE_KERNEL_ISA=avx512 and lower) has none of this. */
#if defined(HAVE_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_AMX 1
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8
#endif
#ifndef AMX_X_BYTES
#define AMX_X_BYTES (1 << 22)
#endif
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
#endif

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

/* Where panel p lies: its part, the part's first output column, the panel's first row in the part,
 * the bytes of one of the part's rows, and the panel where the next part begins. */
typedef struct {
    const qpart *pt;
    int64_t col0, r0, row_bytes, part_end;
} placed;

static inline placed place(const job *jb, int64_t p) {
    int64_t part = 0;
    while (jb->part_panels[part + 1] <= p) part++;
    const qpart *pt = &jb->parts[part];
    int64_t col0 = 0;
    for (int64_t i = 0; i < part; i++) col0 += jb->parts[i].rows;
    return (placed){pt, col0, (p - jb->part_panels[part]) * NR, jb->K / block_values(pt->type) * block_bytes(pt->type),
                    jb->part_panels[part + 1]};
}

/* ---- across the files --------------------------------------------------------------------------- */
/* qmatmul.c: a thread's buffer grown (see there), and the portable widening of every type. */
FORGE_HIDDEN void *grown(void **buf, int64_t *size, int64_t bytes);
FORGE_HIDDEN void dequant(int64_t type, const uint8_t *row, int64_t k0, int64_t n, float *restrict dst);

#if defined(HAVE_FUSED)
/* The types the fused path and the SIMD widening take. */
static inline int fused_type(int64_t type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0 || type == T_Q4_K || type == T_Q6_K ||
           type == T_Q2_K || type == T_Q3_K || type == T_IQ4_NL || type == T_IQ4_XS || type == T_MXFP4 ||
           type == T_F16 || type == T_BF16;
}
/* qmatmul_avx512.c or qmatmul_avx2.c: dequant()'s SIMD form (0 for a type it does not take), and the
 * fused path: mr (up to FR) rows of x against a panel's NR rows of W, values [k0, k1), into acc. */
FORGE_HIDDEN int dequant_simd(int64_t type, const uint8_t *b, int64_t n, float *restrict dst);
FORGE_HIDDEN void fused_rows(int mr, const float *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,
                             const uint8_t *const *rows, float *acc);
#endif

#if defined(HAVE_BF16)
/* qmatmul_avx512.c: the fused path in bfloat16, and a group of up to 32 rows of W through bg_rows. */
FORGE_HIDDEN void fused_rows_bf16(int mr, const bf16_t *x, int64_t ldx, int64_t k0, int64_t k1, int64_t type,
                                  const uint8_t *const *rows, float *acc);
FORGE_HIDDEN int64_t bg_group(const job *jb, int64_t p, int64_t p_hi);
#endif

#if defined(HAVE_AMX)
/* qmatmul_avx512.c: whether Linux lets the process use the tiles, and panels on the tiles. */
FORGE_HIDDEN int amx_usable(void);
FORGE_HIDDEN void amx_panels(const job *jb, int64_t p_lo, int64_t p_hi);
#endif

#if defined(HAVE_I8K)
/* qmatmul_int8.c: a row of x as int8 codes per superblock; qmatmul_int8.c (AVX2) or
 * qmatmul_int8_avx512.c: a K-quant panel in the int8 numerics (run_panel's path; acc: its buffer). */
FORGE_HIDDEN void quantize_row_k(const float *x, int64_t K, int8_t *q, float *d, float *s, int16_t *sums);
FORGE_HIDDEN void k_quant_panel(const job *jb, const placed *at, int64_t nr, int64_t t_lo, int64_t t_hi,
                                float *acc);
#endif

#if defined(HAVE_KG)
/* qmatmul_int8_avx512.c: bigger `fast` steps' panels, K-quants with 16 weight rows in the lanes. */
FORGE_HIDDEN void kg_panels(const job *jb, int64_t p_lo, int64_t p_hi);
#endif

#if defined(HAVE_I8)
/* qmatmul_int8.c: a row of x as int8 codes per block of 32, and a Q4_0, Q4_1 or Q8_0 panel in the
 * int8 numerics (run_panel's path; acc: its buffer). */
FORGE_HIDDEN void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s);
FORGE_HIDDEN void i8_panel(const job *jb, const placed *at, int64_t nr, int64_t t_lo, int64_t t_hi, float *acc);
#endif

#endif
