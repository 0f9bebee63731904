/* y = x @ W.T straight from a GGUF file's blocks, in the `deterministic` numerics: the same bits for
 * a row whatever its batch, the thread count and the x86 instruction set the library was built for.
 *
 * The arithmetic is defined once (forge.kernels.det_reference is the same definition in numpy, and
 * the tests hold every build of this file to it bit for bit):
 *
 *   x is quantized per block of 32 values: dx = max|x| / 127, codes q = x * (127 / max|x|) rounded to
 *     nearest even (all codes 0 where max|x| is 0), with the sum of the block's codes `bsum` (and of
 *     each half's 16, for Q6_K);
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
 * With AVX2 (every AVX-512 build too) the work is 8 weight rows at a time, in 256-bit vectors: a chunk of
 * blocks of the 8 rows unpacked once into a thread's buffer (codes, A, M, z and Q6_K's scales), then for
 * every row of x each block's 8 integer products (VPMADDUBSW, VPMADDWD), their lanes summed per weight row
 * (a transposition of adds), and the 8 rows' terms added to 8 float32 running sums. Without AVX2 the
 * same in scalar C. Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (forge_qmatmul_det_type
 * says which).
 */
#include "pool.h"
#include "qmatmul.h"

#include <stdatomic.h>

#define DET_CHUNK 32           /* blocks of 32 values unpacked at a time (8 weight rows: 8 KiB of codes) */
#define DET_COLS 8             /* weight rows a thread takes together */

int forge_qmatmul_det_type(int64_t type) {
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1 || type == T_Q8_0 ||
           type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

/* ---- x as int8 codes per block of 32 ------------------------------------------------------------ */

/* Row x (K values, a multiple of 32) as codes q, scales dx per block, the sums of each block's codes
 * (bsum) and of each half's 16 (hsum, two per block). */
static void det_quantize_row(const float *x, int64_t K, int8_t *q, float *dx, int32_t *bsum, int32_t *hsum) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax;                  /* a NaN drops out */
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        dx[b] = amax / 127.0f;
        int32_t h[2] = {0, 0};
#if defined(__AVX2__)
        const __m256 vid = _mm256_set1_ps(id);
        const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
        __m256i c[4];
        for (int g = 0; g < 4; g++) {
            c[g] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * g), vid));   /* nearest even */
            c[g] = _mm256_max_epi32(_mm256_min_epi32(c[g], hi), lo);
        }
        const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
        const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
        _mm256_storeu_si256((__m256i *)(q + 32 * b),
                            _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xD8));
        int32_t lanes[32];
        for (int g = 0; g < 4; g++) _mm256_storeu_si256((__m256i *)(lanes + 8 * g), c[g]);
        for (int i = 0; i < 32; i++) h[i / 16] += lanes[i];
#else
        for (int i = 0; i < 32; i++) {
            float r = nearbyintf(v[i] * id);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            q[32 * b + i] = (int8_t)r;
            h[i / 16] += (int32_t)r;
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
static inline int32_t block_int(const uint8_t *c, const det_consts *k, int64_t type, const int8_t *q, int32_t h0,
                                int32_t h1) {
    int32_t s0 = 0, s1 = 0;
    if (type == T_Q8_0) {
        for (int i = 0; i < 16; i++) s0 += (int8_t)c[i] * q[i];
        for (int i = 16; i < 32; i++) s1 += (int8_t)c[i] * q[i];
    } else {
        for (int i = 0; i < 16; i++) s0 += c[i] * q[i];
        for (int i = 16; i < 32; i++) s1 += c[i] * q[i];
    }
    return k->s0 * s0 + k->s1 * s1 - k->z * (k->s0 * h0 + k->s1 * h1);
}

/* The block's float term (the definition above, in this order). */
static inline float block_term(const det_consts *k, float dx, int32_t I, int32_t bsum) {
    const float a = k->A * dx, m = k->M * dx;
    const float t = a * (float)I, u = m * (float)bsum;
    return t + u;
}

#if defined(__AVX2__)
/* The sums of each of 8 vectors' 8 int32 lanes, in one vector (lane c: v[c]'s sum). */
static inline __m256i lane_sums(const __m256i *v) {
    const __m256i a01 = _mm256_hadd_epi32(v[0], v[1]), a23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a45 = _mm256_hadd_epi32(v[4], v[5]), a67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a01, a23), b1 = _mm256_hadd_epi32(a45, a67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}
#endif

/* Weight rows [n0, n0 + cols) of part pt (cols <= DET_COLS), into out's columns col0 + (n0 - 0) ... */
static void det_group(const det_job *jb, const qpart *pt, int64_t n0, int cols, int64_t col0, float *acc) {
    const int64_t type = pt->type, nb = jb->nb, T = jb->T;
    const int64_t row_bytes = jb->K / block_values(type) * block_bytes(type);
    const uint8_t *rows[DET_COLS];
    for (int c = 0; c < DET_COLS; c++) rows[c] = pt->data + (n0 + (c < cols ? c : 0)) * row_bytes;
    uint8_t codes[DET_CHUNK][DET_COLS][32] __attribute__((aligned(32)));
    det_consts ks[DET_CHUNK][DET_COLS];
    memset(acc, 0, (size_t)(T * DET_COLS) * sizeof(float));
    for (int64_t b0 = 0; b0 < nb; b0 += DET_CHUNK) {
        const int64_t nbc = nb - b0 < DET_CHUNK ? nb - b0 : DET_CHUNK;
        for (int64_t b = 0; b < nbc; b++)
            for (int c = 0; c < DET_COLS; c++) unpack_block(type, rows[c], b0 + b, codes[b][c], &ks[b][c]);
#if defined(__AVX2__)
        float A[DET_CHUNK][DET_COLS] __attribute__((aligned(32))), M[DET_CHUNK][DET_COLS] __attribute__((aligned(32)));
        int32_t Z[DET_CHUNK][DET_COLS] __attribute__((aligned(32)));
        int32_t S0[DET_CHUNK][DET_COLS] __attribute__((aligned(32))), S1[DET_CHUNK][DET_COLS] __attribute__((aligned(32)));
        __m256i SV[DET_CHUNK][DET_COLS];    /* Q6_K: the int16 scales of each pair of products */
        for (int64_t b = 0; b < nbc; b++)
            for (int c = 0; c < DET_COLS; c++) {
                A[b][c] = ks[b][c].A;
                M[b][c] = ks[b][c].M;
                Z[b][c] = ks[b][c].z;
                S0[b][c] = ks[b][c].s0;
                S1[b][c] = ks[b][c].s1;
                if (type == T_Q6_K)
                    SV[b][c] = _mm256_set_m128i(_mm_set1_epi16(ks[b][c].s1), _mm_set1_epi16(ks[b][c].s0));
            }
        const __m256i ones = _mm256_set1_epi16(1);
        for (int64_t t = 0; t < T; t++) {
            const int8_t *xq = jb->xq + t * jb->K + 32 * b0;
            const float *dx = jb->dx + t * nb + b0;
            const int32_t *bs = jb->bsum + t * nb + b0, *hs = jb->hsum + t * 2 * nb + 2 * b0;
            __m256 s = _mm256_loadu_ps(acc + t * DET_COLS);
            for (int64_t b = 0; b < nbc; b++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
                __m256i v[DET_COLS];
                for (int c = 0; c < DET_COLS; c++) {
                    const __m256i w = _mm256_load_si256((const __m256i *)codes[b][c]);
                    __m256i pairs;
                    if (type == T_Q8_0)
                        pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
                    else
                        pairs = _mm256_maddubs_epi16(w, xv);
                    v[c] = _mm256_madd_epi16(pairs, type == T_Q6_K ? SV[b][c] : ones);
                }
                __m256i I = lane_sums(v);
                const __m256i s0 = _mm256_load_si256((const __m256i *)S0[b]);
                const __m256i s1 = _mm256_load_si256((const __m256i *)S1[b]);
                const __m256i off = _mm256_add_epi32(_mm256_mullo_epi32(s0, _mm256_set1_epi32(hs[2 * b])),
                                                     _mm256_mullo_epi32(s1, _mm256_set1_epi32(hs[2 * b + 1])));
                I = _mm256_sub_epi32(I, _mm256_mullo_epi32(_mm256_load_si256((const __m256i *)Z[b]), off));
                const __m256 d = _mm256_set1_ps(dx[b]);
                const __m256 a = _mm256_mul_ps(_mm256_load_ps(A[b]), d), m = _mm256_mul_ps(_mm256_load_ps(M[b]), d);
                const __m256 term = _mm256_add_ps(_mm256_mul_ps(a, _mm256_cvtepi32_ps(I)),
                                                  _mm256_mul_ps(m, _mm256_set1_ps((float)bs[b])));
                s = _mm256_add_ps(s, term);
            }
            _mm256_storeu_ps(acc + t * DET_COLS, s);
        }
#else
        for (int64_t t = 0; t < T; t++) {
            const int8_t *xq = jb->xq + t * jb->K + 32 * b0;
            const float *dx = jb->dx + t * nb + b0;
            const int32_t *bs = jb->bsum + t * nb + b0, *hs = jb->hsum + t * 2 * nb + 2 * b0;
            for (int c = 0; c < DET_COLS; c++) {
                float s = acc[t * DET_COLS + c];
                for (int64_t b = 0; b < nbc; b++) {
                    const int32_t I = block_int(codes[b][c], &ks[b][c], type, xq + 32 * b, hs[2 * b], hs[2 * b + 1]);
                    s = s + block_term(&ks[b][c], dx[b], I, bs[b]);
                }
                acc[t * DET_COLS + c] = s;
            }
        }
#endif
    }
    for (int64_t t = 0; t < T; t++)
        for (int c = 0; c < cols; c++) jb->out[t * jb->ldo + col0 + c] = acc[t * DET_COLS + c];
}

static void det_part(const void *ctx, int index, int count) {
    const det_job *jb = ctx;
    const int64_t total = jb->groups[jb->num_parts];
    const int64_t lo = total * index / count, hi = total * (index + 1) / count;
    if (lo >= hi) return;
    float *acc = malloc((size_t)(jb->T * DET_COLS) * sizeof(float));
    if (acc == NULL) {
        atomic_store((_Atomic int *)&jb->error, -3);
        return;
    }
    int64_t col0 = 0;
    for (int64_t p = 0; p < jb->num_parts; p++) {
        const qpart *pt = &jb->parts[p];
        for (int64_t g = jb->groups[p] > lo ? jb->groups[p] : lo; g < jb->groups[p + 1] && g < hi; g++) {
            const int64_t n0 = (g - jb->groups[p]) * DET_COLS;
            const int cols = (int)(pt->rows - n0 < DET_COLS ? pt->rows - n0 : DET_COLS);
            det_group(jb, pt, n0, cols, col0 + n0, acc);
        }
        col0 += pt->rows;
    }
    free(acc);
}

/* x [T, K] (rows ldx floats apart) @ W.T into out [T, N] (rows ldo apart), W the parts stacked along N,
 * on the pool's threads. 0, or -1 (a type it does not read, K not whole blocks, too many parts),
 * -3 (no memory). */
int forge_qmatmul_det(const float *x, int64_t T, int64_t K, int64_t ldx, const qpart *parts, int64_t num_parts,
                      float *out, int64_t ldo) {
    if (num_parts < 1 || num_parts > MAX_PARTS || K <= 0) return -1;
    det_job jb = {.T = T, .K = K, .nb = K / 32, .parts = parts, .num_parts = num_parts, .out = out, .ldo = ldo};
    for (int64_t p = 0; p < num_parts; p++) {
        if (!forge_qmatmul_det_type(parts[p].type) || K % block_values(parts[p].type) != 0) return -1;
        jb.groups[p + 1] = jb.groups[p] + (parts[p].rows + DET_COLS - 1) / DET_COLS;
    }
    if (T <= 0) return 0;
    const int64_t nb = K / 32;
    int8_t *xq = malloc((size_t)(T * K));
    float *dx = malloc((size_t)(T * nb) * sizeof(float));
    int32_t *bsum = malloc((size_t)(T * nb) * sizeof(int32_t)), *hsum = malloc((size_t)(T * 2 * nb) * sizeof(int32_t));
    int rc = 0;
    if (xq == NULL || dx == NULL || bsum == NULL || hsum == NULL) {
        rc = -3;
    } else {
        for (int64_t t = 0; t < T; t++) det_quantize_row(x + t * ldx, K, xq + t * K, dx + t * nb, bsum + t * nb, hsum + t * 2 * nb);
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

/* x's codes as the product takes them (for the tests): q [T, K], dx and bsum [T, K / 32], hsum [T, K / 16]. */
int forge_det_quantize(const float *x, int64_t T, int64_t K, int64_t ldx, int8_t *q, float *dx, int32_t *bsum,
                       int32_t *hsum) {
    if (K % 32 != 0) return -1;
    for (int64_t t = 0; t < T; t++)
        det_quantize_row(x + t * ldx, K, q + t * K, dx + t * (K / 32), bsum + t * (K / 32), hsum + t * (K / 16));
    return 0;
}
