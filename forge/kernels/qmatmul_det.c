/* y = x @ W.T straight from a GGUF file's blocks, in the `deterministic` numerics: the same bits for
 * a row whatever its batch, the thread count and the x86 instruction set the library was built for.
 *
 * The arithmetic is defined once (forge.kernels.det_reference is the same definition in numpy, and
 * the tests hold every build of this file to it bit for bit):
 *
 *   x is quantized per block of 32 values: dx = max|x| / 16256, codes q = x * (16256 / max|x|) rounded to
 *     nearest even and clamped to +-16256 (all codes 0 where max|x| is below 2^-100; -16256 where the
 *     product is not finite), with the sum of the block's codes `bsum` (and of each half's 16, for Q6_K);
 *   a weight block of 32 values is integer codes c (0..63, or -128..127 for Q8_0) with a float scale
 *     A and offset M (per type below), and its integer product with x's block is exact in int32:
 *       I = sum(c * q) - z * bsum                           (Q4_0: z = 8, Q5_0: z = 16, else z = 0)
 *       I = s0 * sum0(c * q) + s1 * sum1(c * q) - 32 * (s0 * bsum0 + s1 * bsum1)   (Q6_K: the two
 *           groups of 16 and their int8 scales)
 *   the block's term is p = (A * dx) * (float)I + (M * dx) * (float)bsum, each operation one float32
 *     rounding, no fused multiply-add (A: the block's scale, or d * sc for Q4_K/Q5_K, d for Q6_K; M:
 *     Q4_1/Q5_1's m, -(dmin * mn) for Q4_K/Q5_K, else 0);
 *   out = ((0 + p_0) + p_1) + ... over the row's blocks in order.
 *
 * Every integer is exact in any order and every float operation is one IEEE rounding in a fixed order,
 * so the result cannot depend on vector width, on how many rows or columns a call takes, or on the
 * threads. This file is compiled without -ffast-math and with -ffp-contract=off (forge.kernels.compiled's
 * FILE_FLAGS) so that the compiler keeps that order.
 *
 * x is kept as 15-bit codes q = 128 hi + lo, so each block's sum is two byte products (hi, lo) against the
 * weights' codes, which stay bytes. With AVX2 (every AVX-512 build too) two paths, the same integers and the
 * same float operations in the same order (so the same bits):
 *   steps of up to DET_DIRECT_ROWS rows (decode): 8 weight rows' codes of a block unpacked into 8 vectors,
 *     multiplied with x's block (8 int32 partial sums a weight row), the partial sums added per weight row by
 *     a transposition of adds, the 8 rows' terms added into one 8-lane vector of running sums;
 *   bigger steps: a chunk of DET_CHUNK blocks of DET_COLS weight rows (32 with AVX-512 BW/VNNI, 16 with
 *     AVX2) unpacked once into a thread's buffer, codes transposed 4 bytes at a time so that one broadcast
 *     of x's 4 codes and one VPDPBUSD (VPMADDUBSW + VPMADDWD without VNNI) give every weight row its share;
 *     the rows' constants side by side; rows of x DET_RB at a time.
 * Without AVX2 the same in scalar C. Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (forge_qmatmul_det_type
 * says which). The vector unpacking of a block's codes and constants: qmatmul_det_unpack.h.
 *
 * A model's weights come in the product's own layout (qmatmul_det_pack.h, DET_PACKED: 16 rows' codes side by
 * side, packed at load): steps multiply straight from it (one VPDPBUSD a group of 4 codes, no buffer), or with
 * the tiles past 24 rows through the chunk's buffer. The same bits again. */
#include "pool.h"
#include "qmatmul.h"
#include <stdatomic.h>

/* x's codes: |q| <= DET_XMAX = 127 * 128, so that Q6_K's block sums (|I| <= 2 * 128 * 16 * 32 * DET_XMAX)
 * stay within int32 and the hi byte of q = 128 hi + lo stays within -127..127 (VPSIGNB can negate it) */
#define DET_XMAX 16256
#define DET_XMAX_F 16256.0f
/* A block whose max|x| is below 2^-100 is taken as zeros (127 * 128 / max|x| stays finite). */
#define DET_TINY 0x1p-100f

#define DET_CHUNK 16           /* blocks of 32 values unpacked at a time (32 weight rows: 16 KiB of codes) */

int forge_qmatmul_det_type(int64_t type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0 ||
           type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* ---- x as int8 codes per block of 32 ------------------------------------------------------------ */

/* Row x (K values, a multiple of 32) as 15-bit codes q = 128 hi + lo (hi -128..127, lo 0..127), stored per
 * block of 32 as the 32 hi bytes then the 32 lo bytes (xq: 2 K bytes), scales dx per block, the sums of
 * each block's codes (bsum) and of each half's 16 (hsum, two per block). */
static void det_quantize_row(const float *x, int64_t K, int8_t *xq, float *dx, int32_t *bsum, int32_t *hsum) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax;                  /* a NaN drops out */
        }
        if (!(amax >= DET_TINY)) amax = 0.0f;             /* a block this small counts as zeros */
        const float id = amax > 0.0f ? DET_XMAX_F / amax : 0.0f;
        dx[b] = amax / DET_XMAX_F;
        int8_t *hi8 = xq + 64 * b, *lo8 = hi8 + 32;
        int32_t h[2] = {0, 0};
#if defined(__AVX2__)
        const __m256 vid = _mm256_set1_ps(id);
        const __m256i top = _mm256_set1_epi32(DET_XMAX), bottom = _mm256_set1_epi32(-DET_XMAX);
        __m256i c[4], hi[4], lo[4];
        for (int g = 0; g < 4; g++) {
            c[g] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * g), vid));   /* nearest even */
            c[g] = _mm256_max_epi32(_mm256_min_epi32(c[g], top), bottom);
            hi[g] = _mm256_srai_epi32(c[g], 7);
            lo[g] = _mm256_and_si256(c[g], _mm256_set1_epi32(127));
        }
        for (int part = 0; part < 2; part++) {
            const __m256i *u = part ? lo : hi;
            const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(u[0], u[1]), 0xD8);
            const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(u[2], u[3]), 0xD8);
            _mm256_storeu_si256((__m256i *)(part ? lo8 : hi8),
                                _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xD8));
        }
        int32_t lanes[32];
        for (int g = 0; g < 4; g++) _mm256_storeu_si256((__m256i *)(lanes + 8 * g), c[g]);
        for (int i = 0; i < 32; i++) h[i / 16] += lanes[i];
#else
        for (int i = 0; i < 32; i++) {
            const float p = v[i] * id;
            /* VCVTPS2DQ's answer for what int32 cannot hold (a NaN, an infinity): INT32_MIN, so -DET_XMAX */
            float r = p >= -2147483648.0f && p < 2147483648.0f ? nearbyintf(p) : -DET_XMAX_F;
            r = r > DET_XMAX_F ? DET_XMAX_F : r < -DET_XMAX_F ? -DET_XMAX_F : r;
            const int32_t q = (int32_t)r;
            hi8[i] = (int8_t)(q >> 7);         /* arithmetic: floor(q / 128) */
            lo8[i] = (int8_t)(q & 127);
            h[i / 16] += q;
        }
#endif
        hsum[2 * b] = h[0];
        hsum[2 * b + 1] = h[1];
        bsum[b] = h[0] + h[1];
    }
}

/* ---- one weight block as codes and its constants ---------------------------------------------- */

typedef struct {
    float A, M;
    int32_t z;
    int16_t s0, s1;            /* Q6_K's group scales; 1 otherwise */
} det_consts;

/* Q4_K's and Q5_K's six-bit scale and min of sub-block j (0..7) from the twelve bytes at s. */
static inline void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Block b (of 32 values) of a row of `type` at `row`: its 32 codes into c (unsigned, but Q8_0's
 * signed) and its constants. */
static void unpack_block(int64_t type, const uint8_t *row, int64_t b, uint8_t *c, det_consts *k) {
    k->M = 0.0f;
    k->z = 0;
    k->s0 = k->s1 = 1;
    switch (type) {
    case T_Q4_0:
    case T_Q4_1: {
        const uint8_t *blk = row + b * (type == T_Q4_0 ? 18 : 20);
        const uint8_t *qs = blk + (type == T_Q4_0 ? 2 : 4);
        k->A = f16(blk);
        if (type == T_Q4_0) k->z = 8; else k->M = f16(blk + 2);
        for (int i = 0; i < 16; i++) {
            c[i] = qs[i] & 15;
            c[i + 16] = qs[i] >> 4;
        }
        return;
    }
    case T_Q5_0:
    case T_Q5_1: {
        const uint8_t *blk = row + b * (type == T_Q5_0 ? 22 : 24);
        const uint8_t *qh = blk + (type == T_Q5_0 ? 2 : 4);
        const uint8_t *qs = qh + 4;
        uint32_t h;
        memcpy(&h, qh, 4);
        k->A = f16(blk);
        if (type == T_Q5_0) k->z = 16; else k->M = f16(blk + 2);
        for (int i = 0; i < 16; i++) {
            c[i] = (uint8_t)((qs[i] & 15) | (((h >> i) & 1) << 4));
            c[i + 16] = (uint8_t)((qs[i] >> 4) | (((h >> (i + 16)) & 1) << 4));
        }
        return;
    }
    case T_Q8_0: {
        const uint8_t *blk = row + b * 34;
        k->A = f16(blk);
        memcpy(c, blk + 2, 32);
        return;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int j = (int)(b % 8);
        const uint8_t *sb = row + b / 8 * (type == T_Q4_K ? 144 : 176);
        int sc, mn;
        k4_scale_min(sb + 4, j, &sc, &mn);
        k->A = f16(sb) * (float)sc;
        k->M = -(f16(sb + 2) * (float)mn);
        if (type == T_Q4_K) {
            const uint8_t *qs = sb + 16 + 32 * (j / 2);
            for (int i = 0; i < 32; i++) c[i] = (qs[i] >> (4 * (j & 1))) & 15;
        } else {
            const uint8_t *qh = sb + 16, *qs = sb + 48 + 32 * (j / 2);
            for (int i = 0; i < 32; i++)
                c[i] = (uint8_t)(((qs[i] >> (4 * (j & 1))) & 15) | (((qh[i] >> j) & 1) << 4));
        }
        return;
    }
    case T_Q6_K: {
        const int j = (int)(b % 8), half = j / 4, r = j % 4;
        const uint8_t *sb = row + b / 8 * 210;
        const uint8_t *ql = sb + 64 * half + 32 * (r & 1), *qh = sb + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(sb + 192);
        k->A = f16(sb + 208);
        k->z = 32;
        k->s0 = sc[2 * j];
        k->s1 = sc[2 * j + 1];
        for (int i = 0; i < 32; i++)
            c[i] = (uint8_t)(((ql[i] >> (4 * (r >> 1))) & 15) | (((qh[i] >> (2 * r)) & 3) << 4));
        return;
    }
    }
}

/* ---- the product -------------------------------------------------------------------------------- */

/* The vector form: VW weight rows in the lanes of one vector (16 with AVX-512 BW/VL/VNNI, 8 with AVX2),
 * DET_COLS = 2 VW rows a thread takes together, rows of x DET_RB at a time. Each lane does exactly
 * the scalar definition's operations for its weight row, so the width changes nothing in the bits. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define VW 16
typedef __m512i vi;
typedef __m512 vfl;
#define VI_LOAD(p) _mm512_load_si512((const void *)(p))
#define VI_ZERO() _mm512_setzero_si512()
#define VI_SET1(v) _mm512_set1_epi32(v)
#define VI_ADD(a, b) _mm512_add_epi32(a, b)
#define VI_SUB(a, b) _mm512_sub_epi32(a, b)
#define VI_MUL(a, b) _mm512_mullo_epi32(a, b)
#define VI_SHL7(a) _mm512_slli_epi32(a, 7)
#define VF_LOAD(p) _mm512_load_ps(p)
#define VF_LOADU(p) _mm512_loadu_ps(p)
#define VF_STOREU(p, v) _mm512_storeu_ps(p, v)
#define VF_SET1(v) _mm512_set1_ps(v)
#define VF_ADD(a, b) _mm512_add_ps(a, b)
#define VF_MUL(a, b) _mm512_mul_ps(a, b)
#define VF_CVT(a) _mm512_cvtepi32_ps(a)
#define DOT_U8(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)        /* exact: no saturation */
#define DET_VNNI 1
#elif defined(__AVX2__)
#define VW 8
typedef __m256i vi;
typedef __m256 vfl;
#define VI_LOAD(p) _mm256_load_si256((const __m256i *)(p))
#define VI_ZERO() _mm256_setzero_si256()
#define VI_SET1(v) _mm256_set1_epi32(v)
#define VI_ADD(a, b) _mm256_add_epi32(a, b)
#define VI_SUB(a, b) _mm256_sub_epi32(a, b)
#define VI_MUL(a, b) _mm256_mullo_epi32(a, b)
#define VI_SHL7(a) _mm256_slli_epi32(a, 7)
#define VF_LOAD(p) _mm256_load_ps(p)
#define VF_LOADU(p) _mm256_loadu_ps(p)
#define VF_STOREU(p, v) _mm256_storeu_ps(p, v)
#define VF_SET1(v) _mm256_set1_ps(v)
#define VF_ADD(a, b) _mm256_add_ps(a, b)
#define VF_MUL(a, b) _mm256_mul_ps(a, b)
#define VF_CVT(a) _mm256_cvtepi32_ps(a)
#if defined(__AVXVNNI__)
#define DOT_U8(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#define DET_VNNI 1
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_U8(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#define DET_VNNI 1
#else
/* unsigned codes up to 63 (128 for Q8_0's |w|) times x's hi or lo bytes: VPMADDUBSW's pairs stay below
 * 2 * 128 * 128, no saturation */
#define DOT_U8(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#endif
#endif

#if defined(VW)
#define DET_COLS (2 * VW)
#define DET_RB 4
/* Q8_0's signed codes go in as code + 128 (the z of 128 takes them back out): VPDPBUSD's unsigned side.
 * Without VNNI the same exact sum comes from |code| against x with the code's sign. */
#if defined(DET_VNNI)
#define Q8_SHIFT 128
#else
#define Q8_SHIFT 0
#endif
#else
#define DET_COLS 8
#define Q8_SHIFT 0
#endif

typedef struct {
    int64_t T, K, nb;
    const int8_t *xq;          /* [T, K] */
    const float *dx;           /* [T, nb] */
    const int32_t *bsum;       /* [T, nb] */
    const int32_t *hsum;       /* [T, 2 nb] */
    const qpart *parts;
    int64_t num_parts;
    int64_t groups[MAX_PARTS + 1];   /* prefix sums of each part's groups of DET_COLS rows */
    float *out;
    int64_t ldo;
    _Atomic int error;
} det_job;

/* The integer part of one block against one row of x, from codes c: exact. */
static inline int32_t block_int(const uint8_t *c, const det_consts *k, int64_t type, const int8_t *xq, int32_t h0,
                                int32_t h1) {
    int32_t s0 = 0, s1 = 0;
    for (int i = 0; i < 32; i++) {
        const int32_t q = 128 * xq[i] + xq[32 + i];
        const int32_t w = type == T_Q8_0 ? (int8_t)c[i] : c[i];
        if (i < 16) s0 += w * q; else s1 += w * q;
    }
    return k->s0 * s0 + k->s1 * s1 - k->z * (k->s0 * h0 + k->s1 * h1);
}

/* The block's float term (the definition above, in this order). */
static inline float block_term(const det_consts *k, float dx, int32_t I, int32_t bsum) {
    const float a = k->A * dx, m = k->M * dx;
    const float t = a * (float)I, u = m * (float)bsum;
    return t + u;
}

#if defined(VW)
/* A chunk of blocks of DET_COLS weight rows, unpacked for the vector form: for block b and 4-byte group g
 * of its 32 codes, the rows' 4 codes side by side (so that one VPDPBUSD of x's 4 codes, broadcast, gives
 * every row its share of the block's sum), and the rows' constants side by side. */
typedef struct {
    uint8_t codes[DET_CHUNK][8][DET_COLS * 4] __attribute__((aligned(64)));
    float A[DET_CHUNK][DET_COLS] __attribute__((aligned(64)));
    float M[DET_CHUNK][DET_COLS] __attribute__((aligned(64)));
    int32_t S0[DET_CHUNK][DET_COLS] __attribute__((aligned(64)));
    int32_t S1[DET_CHUNK][DET_COLS] __attribute__((aligned(64)));
} det_chunk;

/* Block bt's term (b: its place in the chunk) for row t of x and weight rows h * VW .. of the chunk, from its
 * integer sums (x's hi and lo combined: I0, and Q6_K's second group I1): the definition's operations, in its
 * order, a lane per weight row. Both the vector and the AMX paths add their sums through it. */
static inline __attribute__((always_inline)) vfl block_term_v(const det_job *jb, const det_chunk *ch,
                                                              const int64_t type, int64_t b, int64_t bt, int64_t t,
                                                              int h, vi I0, vi I1) {
    const int64_t nb = jb->nb;
    const int32_t z = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? Q8_SHIFT : 0;
    const int32_t bs = jb->bsum[t * nb + bt];
    vi In;
    if (type == T_Q6_K) {
        const int32_t *hs = jb->hsum + t * 2 * nb + 2 * bt;
        const vi s0 = VI_LOAD(ch->S0[b] + h * VW), s1 = VI_LOAD(ch->S1[b] + h * VW);
        In = VI_ADD(VI_MUL(s0, VI_SUB(I0, VI_SET1(32 * hs[0]))), VI_MUL(s1, VI_SUB(I1, VI_SET1(32 * hs[1]))));
    } else {
        In = VI_SUB(I0, VI_SET1(z * bs));
    }
    const vfl d = VF_SET1(jb->dx[t * nb + bt]);
    const vfl a = VF_MUL(VF_LOAD(ch->A[b] + h * VW), d), m = VF_MUL(VF_LOAD(ch->M[b] + h * VW), d);
    return VF_ADD(VF_MUL(a, VF_CVT(In)), VF_MUL(m, VF_SET1((float)bs)));
}

/* Rows [t0, t0 + R) of x (R <= DET_RB) against the chunk's nbc blocks from block b0: acc += the terms.
 * Inlined per type and R (chunk_rows), so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void chunk_body(const det_job *jb, const det_chunk *ch, const int64_t type,
                                                             int64_t b0, int64_t nbc, int64_t t0, const int R, float *acc) {
    const int q6 = type == T_Q6_K;
    vfl s[DET_RB][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) s[r][h] = VF_LOADU(acc + (t0 + r) * DET_COLS + h * VW);
    for (int64_t b = 0; b < nbc; b++) {
        /* [r][h][k][hl]: x row r, weight rows h * VW.., codes 0-15 / 16-31 (Q6_K's groups; else all in k 0),
         * x's hi / lo bytes */
        vi I[DET_RB][2][2][2];
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 2; k++) I[r][h][k][0] = I[r][h][k][1] = VI_ZERO();
        for (int g = 0; g < 8; g++) {
            const int k = q6 && g >= 4;
            const vi w0 = VI_LOAD(ch->codes[b][g]), w1 = VI_LOAD(ch->codes[b][g] + VW * 4);
            for (int r = 0; r < R; r++) {
                const int8_t *xb = jb->xq + (t0 + r) * 2 * jb->K + 64 * (b0 + b) + 4 * g;
                for (int hl = 0; hl < 2; hl++) {
                    int32_t xw;
                    memcpy(&xw, xb + 32 * hl, 4);
                    const vi xv = VI_SET1(xw);
#if !defined(DET_VNNI)
                    if (type == T_Q8_0) {      /* signed codes: |w| against x with w's sign */
                        I[r][0][k][hl] = DOT_U8(I[r][0][k][hl], _mm256_abs_epi8(w0), _mm256_sign_epi8(xv, w0));
                        I[r][1][k][hl] = DOT_U8(I[r][1][k][hl], _mm256_abs_epi8(w1), _mm256_sign_epi8(xv, w1));
                        continue;
                    }
#endif
                    I[r][0][k][hl] = DOT_U8(I[r][0][k][hl], w0, xv);
                    I[r][1][k][hl] = DOT_U8(I[r][1][k][hl], w1, xv);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                const vi I0 = VI_ADD(VI_SHL7(I[r][h][0][0]), I[r][h][0][1]);
                const vi I1 = q6 ? VI_ADD(VI_SHL7(I[r][h][1][0]), I[r][h][1][1]) : I0;
                s[r][h] = VF_ADD(s[r][h], block_term_v(jb, ch, type, b, b0 + b, t0 + r, h, I0, I1));
            }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) VF_STOREU(acc + (t0 + r) * DET_COLS + h * VW, s[r][h]);
}

#define CHUNK_ROWS_R(T_)                                                                          \
    switch (R) {                                                                                  \
    case 1: chunk_body(jb, ch, T_, b0, nbc, t0, 1, acc); return;                                  \
    case 2: chunk_body(jb, ch, T_, b0, nbc, t0, 2, acc); return;                                  \
    case 3: chunk_body(jb, ch, T_, b0, nbc, t0, 3, acc); return;                                  \
    default: chunk_body(jb, ch, T_, b0, nbc, t0, 4, acc); return;                                 \
    }

static void chunk_rows(const det_job *jb, const det_chunk *ch, int64_t type, int64_t b0, int64_t nbc, int64_t t0, int R,
                       float *acc) {
    switch (type) {
    case T_Q4_0: CHUNK_ROWS_R(T_Q4_0)
    case T_Q4_1: CHUNK_ROWS_R(T_Q4_1)
    case T_Q5_0: CHUNK_ROWS_R(T_Q5_0)
    case T_Q5_1: CHUNK_ROWS_R(T_Q5_1)
    case T_Q8_0: CHUNK_ROWS_R(T_Q8_0)
    case T_Q4_K: CHUNK_ROWS_R(T_Q4_K)
    case T_Q5_K: CHUNK_ROWS_R(T_Q5_K)
    default: CHUNK_ROWS_R(T_Q6_K)
    }
}
#endif

#if defined(VW)
/* ---- steps of a few rows (decode): 8 weight rows unpacked in registers, no buffer ----------------
 * Each block's codes of 8 weight rows are unpacked into 8 vectors, multiplied with x's block (eight int32
 * partial sums a row), the partial sums added per weight row by a transposition of adds (lane_sums), and
 * the 8 rows' terms added in one 8-lane vector: the same integers and the same float operations as the
 * chunked path, in the same order (so the same bits). The rows' constants come a superblock (8 blocks)
 * at a time: each weight row's 8 blocks' scales as a vector, then per block the 8 rows' by a gather. */
#define DET_DIRECT_ROWS 4
#define DET_PF_AHEAD 4096       /* bytes of each weight row read ahead (8 rows: 32 KiB in flight) */

#include "qmatmul_det_unpack.h"

/* Rows [0, T) of x (T <= DET_DIRECT_ROWS) against 8 weight rows: out's columns col0 .. col0 + cols. Inlined
 * once per type (direct_octet), so that each type's loop has its unpacking straight in it. */
static inline __attribute__((always_inline)) void direct_body(const det_job *jb, const qpart *pt, int64_t n0, int cols,
                                                              int64_t col0, const int64_t type) {
    const int64_t nb = jb->nb, T = jb->T;
    const int64_t row_bytes = jb->K / block_values(type) * block_bytes(type);
    const int32_t z = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? Q8_SHIFT : 0;
    const int64_t bb32 = block_bytes(type) * 32 / block_values(type);     /* bytes a block of 32 takes */
    const uint8_t *rows[8];
    for (int c = 0; c < 8; c++) rows[c] = pt->data + (n0 + (c < cols ? c : 0)) * row_bytes;
    __m256 s[DET_DIRECT_ROWS];
    for (int t = 0; t < T; t++) s[t] = _mm256_setzero_ps();
    __m256 A[8], M[8];
    __m256i S0[8], S1[8];
    for (int64_t b8 = 0; b8 < nb; b8 += 8) {
        const int64_t n = nb - b8 < 8 ? nb - b8 : 8;
        consts8(type, rows, b8, n, A, M, S0, S1);
        for (int64_t j = 0; j < n; j++) {
            const int64_t b = b8 + j;
            __m256i w[8];
            if ((b & 1) == 0) {   /* 8 streams of weights: more than the hardware prefetcher keeps up with */
                const int64_t at = b * bb32 + DET_PF_AHEAD;
                for (int c = 0; c < 8; c++) _mm_prefetch((const char *)(rows[c] + at), _MM_HINT_T0);
            }
            for (int c = 0; c < 8; c++) w[c] = codes_of(type, rows[c], b);
            for (int t = 0; t < T; t++) {
                const int8_t *xb = jb->xq + t * 2 * jb->K + 64 * b;
                const __m256i xh = load_b32((const uint8_t *)xb), xl = load_b32((const uint8_t *)xb + 32);
                const int32_t bs = jb->bsum[t * nb + b];
                const int32_t *hs = jb->hsum + t * 2 * nb + 2 * b;
                __m256i v[8], I;
                if (type == T_Q6_K) {
                    /* the two groups' sums apart: lanes 0-3 hold the first 16 codes' products */
                    __m256i v0[8], v1[8];
                    const __m256i lo = _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0);
                    for (int c = 0; c < 8; c++) {
                        const __m256i p = _mm256_add_epi32(_mm256_slli_epi32(DOT8(w[c], xh), 7), DOT8(w[c], xl));
                        v0[c] = _mm256_and_si256(p, lo);
                        v1[c] = _mm256_andnot_si256(lo, p);
                    }
                    const __m256i I0 = lane_sums(v0), I1 = lane_sums(v1);
                    I = _mm256_add_epi32(_mm256_mullo_epi32(S0[j], _mm256_sub_epi32(I0, _mm256_set1_epi32(32 * hs[0]))),
                                         _mm256_mullo_epi32(S1[j], _mm256_sub_epi32(I1, _mm256_set1_epi32(32 * hs[1]))));
                } else {
                    for (int c = 0; c < 8; c++) {
#if !defined(DET_VNNI)
                        if (type == T_Q8_0) {
                            const __m256i aw = _mm256_abs_epi8(w[c]);
                            v[c] = _mm256_add_epi32(_mm256_slli_epi32(DOT8(aw, _mm256_sign_epi8(xh, w[c])), 7),
                                                    DOT8(aw, _mm256_sign_epi8(xl, w[c])));
                            continue;
                        }
#endif
                        v[c] = _mm256_add_epi32(_mm256_slli_epi32(DOT8(w[c], xh), 7), DOT8(w[c], xl));
                    }
                    I = _mm256_sub_epi32(lane_sums(v), _mm256_set1_epi32(z * bs));
                }
                const __m256 d = _mm256_set1_ps(jb->dx[t * nb + b]);
                const __m256 a = _mm256_mul_ps(A[j], d), m = _mm256_mul_ps(M[j], d);
                s[t] = _mm256_add_ps(s[t], _mm256_add_ps(_mm256_mul_ps(a, _mm256_cvtepi32_ps(I)),
                                                         _mm256_mul_ps(m, _mm256_set1_ps((float)bs))));
            }
        }
    }
    for (int t = 0; t < T; t++) {
        float o[8];
        _mm256_storeu_ps(o, s[t]);
        for (int c = 0; c < cols; c++) jb->out[t * jb->ldo + col0 + c] = o[c];
    }
}

static void direct_octet(const det_job *jb, const qpart *pt, int64_t n0, int cols, int64_t col0) {
    switch (pt->type) {
    case T_Q4_0: direct_body(jb, pt, n0, cols, col0, T_Q4_0); return;
    case T_Q4_1: direct_body(jb, pt, n0, cols, col0, T_Q4_1); return;
    case T_Q5_0: direct_body(jb, pt, n0, cols, col0, T_Q5_0); return;
    case T_Q5_1: direct_body(jb, pt, n0, cols, col0, T_Q5_1); return;
    case T_Q8_0: direct_body(jb, pt, n0, cols, col0, T_Q8_0); return;
    case T_Q4_K: direct_body(jb, pt, n0, cols, col0, T_Q4_K); return;
    case T_Q5_K: direct_body(jb, pt, n0, cols, col0, T_Q5_K); return;
    default: direct_body(jb, pt, n0, cols, col0, T_Q6_K); return;
    }
}
#endif

#if defined(VW)
/* Blocks [b0, b0 + nbc) of the DET_COLS rows into the chunk: each 8 rows' codes of a block transposed in
 * registers, 4 bytes at a time, into the 8 groups' places; their constants by consts8. */
static inline __attribute__((always_inline)) void unpack_body(const int64_t type, const uint8_t *const *rows, int64_t b0,
                                                              int64_t nbc, det_chunk *ch) {
    for (int o = 0; o < DET_COLS / 8; o++) {
        for (int64_t b8 = 0; b8 < nbc; b8 += 8) {
            __m256 A[8], M[8];
            __m256i S0[8], S1[8];
            const int64_t n = nbc - b8 < 8 ? nbc - b8 : 8;
            consts8(type, rows + 8 * o, b0 + b8, n, A, M, S0, S1);
            for (int64_t j = 0; j < n; j++) {
                _mm256_store_ps(ch->A[b8 + j] + 8 * o, A[j]);
                _mm256_store_ps(ch->M[b8 + j] + 8 * o, M[j]);
                if (type == T_Q6_K) {
                    _mm256_store_si256((__m256i *)(ch->S0[b8 + j] + 8 * o), S0[j]);
                    _mm256_store_si256((__m256i *)(ch->S1[b8 + j] + 8 * o), S1[j]);
                }
            }
        }
        for (int64_t b = 0; b < nbc; b++) {
            __m256 w[8], g[8];
            for (int c = 0; c < 8; c++) w[c] = _mm256_castsi256_ps(codes_of(type, rows[8 * o + c], b0 + b));
            transpose8v(w, g);                 /* g[k] holds every row's codes 4k .. 4k + 3 */
            for (int k = 0; k < 8; k++) _mm256_store_ps((float *)(ch->codes[b][k] + 32 * o), g[k]);
        }
    }
}

static void unpack_chunk(int64_t type, const uint8_t *const *rows, int64_t b0, int64_t nbc, det_chunk *ch) {
    switch (type) {
    case T_Q4_0: unpack_body(T_Q4_0, rows, b0, nbc, ch); return;
    case T_Q4_1: unpack_body(T_Q4_1, rows, b0, nbc, ch); return;
    case T_Q5_0: unpack_body(T_Q5_0, rows, b0, nbc, ch); return;
    case T_Q5_1: unpack_body(T_Q5_1, rows, b0, nbc, ch); return;
    case T_Q8_0: unpack_body(T_Q8_0, rows, b0, nbc, ch); return;
    case T_Q4_K: unpack_body(T_Q4_K, rows, b0, nbc, ch); return;
    case T_Q5_K: unpack_body(T_Q5_K, rows, b0, nbc, ch); return;
    default: unpack_body(T_Q6_K, rows, b0, nbc, ch); return;
    }
}
#endif

#include "qmatmul_det_pack.h"

#if defined(VW) && VW == 16 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
/* ---- big steps on the AMX tiles (Intel Sapphire Rapids and later) ------------------------------------
 * The chunk's layout is what a tile's B operand takes (each block's 8 groups of 4 codes, 16 weight rows to
 * 64 bytes), and x's hi and lo bytes of a block are 32 bytes a row: for 16 rows of x at a time, each block's
 * 4 products (hi and lo, weight rows 0-15 and 16-31; TDPBSUD: x signed, codes unsigned) give exactly the
 * int32 sums of the vector paths, then the same float operations add each row's terms. Q6_K's two groups of
 * 16 codes go as two tile steps of 16 bytes. */
#define DET_AMX 1
#define DET_AMX_ROWS 8          /* steps of this many rows or more take the tiles (16 rows a tile) */
int amx_enable(void);           /* amx_gemm.c: Linux's permission, once per process */

typedef struct {
    uint8_t palette, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} det_tiles;

/* tiles 0-3: the int32 sums (hi, lo) x (weight rows 0-15, 16-31); 4, 5: x's hi and lo bytes; 6, 7: the codes.
 * Constants in memory: GCC's _tile_loadconfig is said to read only the first 8 bytes of a local. */
static const det_tiles DET_TILES = {.palette = 1, .colsb = {64, 64, 64, 64, 32, 32, 64, 64},
                                    .rows = {16, 16, 16, 16, 16, 16, 8, 8}};
static const det_tiles DET_TILES_HALF = {.palette = 1, .colsb = {64, 64, 64, 64, 16, 16, 64, 64},
                                         .rows = {16, 16, 16, 16, 16, 16, 4, 4}};

static int det_amx_usable(void) {
    static _Atomic int state = 0;                    /* 0: not asked yet, 1: usable, -1: not */
    int s = atomic_load(&state);
    if (s == 0) {
        s = amx_enable() == 0 ? 1 : -1;
        atomic_store(&state, s);
    }
    return s > 0;
}

/* Rows [t0, t0 + R) of x (R <= 16; x's codes padded to whole tiles of rows) against the chunk: acc += the
 * terms, as chunk_body. */
static void amx_rows(const det_job *jb, const det_chunk *ch, int64_t type, int64_t b0, int64_t nbc, int64_t t0, int R,
                     float *acc) {
    const int64_t ldx = 2 * jb->K;
    const int q6 = type == T_Q6_K;
    int32_t ci[2][4][16][16] __attribute__((aligned(64)));       /* [group][tile][row][weight row] */
    _tile_loadconfig(q6 ? &DET_TILES_HALF : &DET_TILES);
    for (int64_t b = 0; b < nbc; b++) {
        const int8_t *xb = jb->xq + t0 * ldx + 64 * (b0 + b);
        for (int k = 0; k <= q6; k++) {
            const uint8_t *wb = ch->codes[b][4 * k];
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, xb + 16 * k, ldx);
            _tile_loadd(5, xb + 32 + 16 * k, ldx);
            _tile_loadd(6, wb, DET_COLS * 4);
            _tile_loadd(7, wb + 64, DET_COLS * 4);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 5, 6);
            _tile_dpbsud(2, 4, 7);
            _tile_dpbsud(3, 5, 7);
            _tile_stored(0, ci[k][0], 64);
            _tile_stored(1, ci[k][1], 64);
            _tile_stored(2, ci[k][2], 64);
            _tile_stored(3, ci[k][3], 64);
        }
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                const vi I0 = VI_ADD(VI_SHL7(VI_LOAD(ci[0][2 * h][r])), VI_LOAD(ci[0][2 * h + 1][r]));
                const vi I1 = q6 ? VI_ADD(VI_SHL7(VI_LOAD(ci[1][2 * h][r])), VI_LOAD(ci[1][2 * h + 1][r])) : I0;
                float *at = acc + (t0 + r) * DET_COLS + h * VW;
                VF_STOREU(at, VF_ADD(VF_LOADU(at), block_term_v(jb, ch, type, b, b0 + b, t0 + r, h, I0, I1)));
            }
    }
}
#endif

#if defined(VW)
/* Whether a packed part's step of T rows goes by the chunk's buffer: with the tiles past 24 rows, never without
 * (`ab_kernels.py layers --clock cpu --isa native|avx512`: docs/benchmarks.md, the passes against the tiles). */
static int det_chunk_rows(int64_t T) {
#if defined(DET_AMX)
    if (det_amx_usable()) return T > 24;
#endif
    return T < 0;
}
#endif

/* Weight rows [n0, n0 + cols) of part pt (cols <= DET_COLS), into out's columns col0 .. col0 + cols. */
static void det_group(const det_job *jb, const qpart *pt, int64_t n0, int cols, int64_t col0, float *acc,
                      void *scratch) {
    const int packed = (pt->type & DET_PACKED) != 0;
    const int64_t type = pt->type & ~(int64_t)DET_PACKED, nb = jb->nb, T = jb->T;
    const int64_t row_bytes = packed ? 0 : jb->K / block_values(type) * block_bytes(type);
    const uint8_t *rows[DET_COLS];
    for (int c = 0; c < DET_COLS; c++) rows[c] = pt->data + (n0 + (c < cols ? c : 0)) * row_bytes;
#if defined(VW)
    if (packed && (T <= DET_PACK_DIRECT_ROWS || !det_chunk_rows(T))) {
        const int64_t gbytes = pack_group_bytes(type, nb);
        for (int64_t t0 = 0; t0 < T; t0 += DET_PACK_DIRECT_ROWS)
            for (int c0 = 0; c0 < cols; c0 += VW)
                packed_direct(jb, type, pt->data + (n0 + c0) / DET_PG * gbytes, (int)((n0 + c0) % DET_PG / VW),
                              cols - c0 < VW ? cols - c0 : VW, col0 + c0, t0,
                              T - t0 < DET_PACK_DIRECT_ROWS ? T - t0 : DET_PACK_DIRECT_ROWS);
        return;
    }
    if (T <= DET_DIRECT_ROWS) {
        for (int c0 = 0; c0 < cols; c0 += 8) direct_octet(jb, pt, n0 + c0, cols - c0 < 8 ? cols - c0 : 8, col0 + c0);
        return;
    }
#endif
    memset(acc, 0, (size_t)(T * DET_COLS) * sizeof(float));
#if defined(VW)
    det_chunk *ch = scratch;
    for (int64_t b0 = 0; b0 < nb; b0 += DET_CHUNK) {
        const int64_t nbc = nb - b0 < DET_CHUNK ? nb - b0 : DET_CHUNK;
        if (packed)
            unpack_packed_chunk(type, pt->data, nb, n0, b0, nbc, ch);
        else
            unpack_chunk(type, rows, b0, nbc, ch);
        int64_t t = 0;
#if defined(DET_AMX)
        if (T >= DET_AMX_ROWS && det_amx_usable()) {
            for (; t < T; t += 16) amx_rows(jb, ch, type, b0, nbc, t, (int)(T - t < 16 ? T - t : 16), acc);
            continue;
        }
#endif
        const int rb = type == T_Q6_K ? 2 : DET_RB;      /* Q6_K's two groups: twice the accumulators */
        for (; t + rb <= T; t += rb) chunk_rows(jb, ch, type, b0, nbc, t, rb, acc);
        if (t < T) chunk_rows(jb, ch, type, b0, nbc, t, (int)(T - t), acc);
    }
#else
    (void)scratch;
    uint8_t codes[DET_CHUNK][DET_COLS][32];
    det_consts ks[DET_CHUNK][DET_COLS];
    for (int64_t b0 = 0; b0 < nb; b0 += DET_CHUNK) {
        const int64_t nbc = nb - b0 < DET_CHUNK ? nb - b0 : DET_CHUNK;
        for (int64_t b = 0; b < nbc; b++)
            for (int c = 0; c < DET_COLS; c++) {
                if (packed)
                    unpack_packed(type, pt->data + (n0 + c) / DET_PG * pack_group_bytes(type, nb), (int)((n0 + c) % DET_PG),
                                  b0 + b, codes[b][c], &ks[b][c]);
                else
                    unpack_block(type, rows[c], b0 + b, codes[b][c], &ks[b][c]);
            }
        for (int64_t t = 0; t < T; t++) {
            const int8_t *xq = jb->xq + t * 2 * jb->K + 64 * b0;
            const float *dx = jb->dx + t * nb + b0;
            const int32_t *bs = jb->bsum + t * nb + b0, *hs = jb->hsum + t * 2 * nb + 2 * b0;
            for (int c = 0; c < DET_COLS; c++) {
                float s = acc[t * DET_COLS + c];
                for (int64_t b = 0; b < nbc; b++) {
                    const int32_t I = block_int(codes[b][c], &ks[b][c], type, xq + 64 * b, hs[2 * b], hs[2 * b + 1]);
                    s = s + block_term(&ks[b][c], dx[b], I, bs[b]);
                }
                acc[t * DET_COLS + c] = s;
            }
        }
    }
#endif
    for (int64_t t = 0; t < T; t++)
        for (int c = 0; c < cols; c++) jb->out[t * jb->ldo + col0 + c] = acc[t * DET_COLS + c];
}

static void det_part(const void *ctx, int index, int count) {
    const det_job *jb = ctx;
    const int64_t total = jb->groups[jb->num_parts];
    const int64_t lo = total * index / count, hi = total * (index + 1) / count;
    if (lo >= hi) return;
    float *acc = malloc((size_t)(jb->T * DET_COLS) * sizeof(float));
#if defined(VW)
    void *scratch = aligned_alloc(64, sizeof(det_chunk));
#else
    void *scratch = NULL;
#endif
    if (acc == NULL || (scratch == NULL && DET_COLS > 8)) {
        free(acc);
        free(scratch);
        atomic_store((_Atomic int *)&jb->error, -3);
        return;
    }
    int64_t col0 = 0;
    for (int64_t p = 0; p < jb->num_parts; p++) {
        const qpart *pt = &jb->parts[p];
        for (int64_t g = jb->groups[p] > lo ? jb->groups[p] : lo; g < jb->groups[p + 1] && g < hi; g++) {
            const int64_t n0 = (g - jb->groups[p]) * DET_COLS;
            const int cols = (int)(pt->rows - n0 < DET_COLS ? pt->rows - n0 : DET_COLS);
            det_group(jb, pt, n0, cols, col0 + n0, acc, scratch);
        }
        col0 += pt->rows;
    }
    free(acc);
    free(scratch);
}

/* x [T, K] (rows ldx floats apart) @ W.T into out [T, N] (rows ldo apart), W the parts stacked along N,
 * on the pool's threads. 0, or -1 (a type it does not read, K not whole blocks, too many parts),
 * -3 (no memory). */
int forge_qmatmul_det(const float *x, int64_t T, int64_t K, int64_t ldx, const qpart *parts, int64_t num_parts,
                      float *out, int64_t ldo) {
    if (num_parts < 1 || num_parts > MAX_PARTS || K <= 0) return -1;
    det_job jb = {.T = T, .K = K, .nb = K / 32, .parts = parts, .num_parts = num_parts, .out = out, .ldo = ldo};
    for (int64_t p = 0; p < num_parts; p++) {
        const int64_t type = parts[p].type & ~(int64_t)DET_PACKED;
        if (!forge_qmatmul_det_type(type) || K % block_values(type) != 0) return -1;
        jb.groups[p + 1] = jb.groups[p] + (parts[p].rows + DET_COLS - 1) / DET_COLS;
    }
    if (T <= 0) return 0;
    const int64_t nb = K / 32;
    const int64_t T_pad = (T + 15) / 16 * 16;        /* whole tiles of rows for the AMX path */
    int8_t *xq = malloc((size_t)(T_pad * 2 * K));
    float *dx = malloc((size_t)(T * nb) * sizeof(float));
    int32_t *bsum = malloc((size_t)(T * nb) * sizeof(int32_t)), *hsum = malloc((size_t)(T * 2 * nb) * sizeof(int32_t));
    int rc = 0;
    if (xq == NULL || dx == NULL || bsum == NULL || hsum == NULL) {
        rc = -3;
    } else {
        for (int64_t t = 0; t < T; t++)
            det_quantize_row(x + t * ldx, K, xq + t * 2 * K, dx + t * nb, bsum + t * nb, hsum + t * 2 * nb);
        memset(xq + T * 2 * K, 0, (size_t)((T_pad - T) * 2 * K));      /* only the pad rows: the rest is written */
        jb.xq = xq, jb.dx = dx, jb.bsum = bsum, jb.hsum = hsum;
        atomic_init(&jb.error, 0);
        forge_run_parallel(det_part, &jb, jb.groups[num_parts] > 1);
        rc = atomic_load(&jb.error);
    }
    free(xq);
    free(dx);
    free(bsum);
    free(hsum);
    return rc;
}

/* x's codes as the product takes them (for the tests): q [T, K] (int16), dx and bsum [T, K / 32], hsum [T, K / 16]. */
int forge_det_quantize(const float *x, int64_t T, int64_t K, int64_t ldx, int16_t *q, float *dx, int32_t *bsum,
                       int32_t *hsum) {
    if (K % 32 != 0) return -1;
    int8_t *xq = malloc((size_t)(2 * K));
    if (xq == NULL) return -3;
    for (int64_t t = 0; t < T; t++) {
        det_quantize_row(x + t * ldx, K, xq, dx + t * (K / 32), bsum + t * (K / 32), hsum + t * (K / 16));
        for (int64_t i = 0; i < K; i++) q[t * K + i] = (int16_t)(128 * xq[i / 32 * 64 + i % 32] + xq[i / 32 * 64 + 32 + i % 32]);
    }
    free(xq);
    return 0;
}
