/* y = x @ W.T straight from a GGUF file's blocks, float32 activations and accumulation.
 *
 * W [N, K] is one or more parts stacked along N (q, k and v of a layer; gate and up), each part
 * the file's own bytes (a view of its mapping: nothing is copied at load) in any of the types
 * qmatmul.h names (T_*). Every weight is widened exactly as the file means it (w = scale * q +
 * offset per block, forge.kernels.quant_blocks being the reference), in panels of NR rows of W that
 * the threads take in contiguous runs:
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
 * 256: decode steps straight from the blocks, bigger ones with 16 weight rows in the lanes
 * of VPDPBUSD); on AVX2 alone, x as int8 codes multiplied with the file's integer codes in
 * int32 (VPMADDUBSW/VPMADDWD): for the K-quants x per superblock of 256 and one float scale per
 * superblock, in every step; for Q4_0, Q4_1, Q8_0 and the table types IQ4_NL, IQ4_XS, MXFP4 x per
 * block of 32 and a float scale per block, in steps of up to I8_MAX_ROWS rows (forge_qmatmul_fast
 * says which numerics this build has). Q2_K, Q3_K, Q5_0, Q5_1 and the 16-bit types take bfloat16
 * on AVX-512 and the float32 product on AVX2.
 *
 * The files (this one is the entry: forge_qmatmul, run_panel's choice of a path, the tiled path, the
 * portable widening, and what a build has):
 *   qmatmul.h              what they all share: the type ids, the tiles' shapes, which paths a build has
 *                          (HAVE_*), the job, and the functions the files call across
 *   qmatmul_lowbit.h       the scales and tables of the low-bit types (Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4)
 *   qmatmul_avx512.c       AVX-512: the widening, the fused path (float32 and bfloat16), the `fast`
 *                          bfloat16 steps with weight rows in the lanes, and the AMX tiles
 *   qmatmul_avx2.c         AVX2: the widening and the fused path in float32
 *   qmatmul_int8.h, .c     the `fast` int8 numerics: x as int8 codes, and AVX2's integer products
 *   qmatmul_int8_avx512.c  the K-quants' int8 products on AVX-512 VNNI
 *   pool.c                 the threads: the library's pool
 *
 * Threads: the library's pool (pool.c, forge_pool_threads), the caller taking the first run of panels.
 * One caller at a time: a second concurrent caller computes alone.
 */
#include "pool.h"
#include "qmatmul.h"
#include "qmatmul_lowbit.h"

/* Values [k0, k0 + n) of one row (k0 and n whole blocks of the type) as float32 into dst. The
 * loops are written for the compiler's vectoriser: a block's codes widened, scaled and offset. */
void dequant(int64_t type, const uint8_t *row, int64_t k0, int64_t n, float *restrict dst) {
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
    case T_Q2_K:          /* value 128 h + 32 s + l: bits 2s, 2s + 1 of code byte 32 h + l; group of 16 g */
        for (int64_t blk = 0; blk < n / 256; blk++, b += 84, dst += 256) {
            const float d = f16(b + 80), dmin = f16(b + 82);
            for (int g = 0; g < 16; g++) {
                const float s = d * (float)(b[g] & 15), o = -(dmin * (float)(b[g] >> 4));
                const uint8_t *q = b + 16 + 32 * (g / 8) + 16 * (g % 2);
                const int shift = 2 * (g % 8 / 2);
                for (int i = 0; i < 16; i++) dst[16 * g + i] = (float)((q[i] >> shift) & 3) * s + o;
            }
        }
        return;
    case T_Q3_K:          /* as Q2_K's codes, a third bit from hmask: bit 4 h + s of byte l */
        for (int64_t blk = 0; blk < n / 256; blk++, b += 110, dst += 256) {
            const float d = f16(b + 108);
            for (int g = 0; g < 16; g++) {
                const float s = d * (float)q3k_scale(b + 96, g);
                const uint8_t *q = b + 32 + 32 * (g / 8) + 16 * (g % 2), *hm = b + 16 * (g % 2);
                const int shift = 2 * (g % 8 / 2), hshift = g / 2;
                for (int i = 0; i < 16; i++)
                    dst[16 * g + i] = (float)((((q[i] >> shift) & 3) | ((hm[i] >> hshift) & 1) << 2) - 4) * s;
            }
        }
        return;
    case T_IQ4_NL:
    case T_MXFP4: {
        const int nl = type == T_IQ4_NL;
        const int8_t *values = nl ? IQ4_VALUES : MXFP4_VALUES;
        for (int64_t blk = 0; blk < n / 32; blk++, b += 18 - !nl, dst += 32) {
            const float d = nl ? f16(b) : e8m0_half(b[0]);
            const uint8_t *q = b + 2 - !nl;
            for (int i = 0; i < 16; i++) {
                dst[i] = d * (float)values[q[i] & 15];
                dst[i + 16] = d * (float)values[q[i] >> 4];
            }
        }
        return;
    }
    case T_IQ4_XS:        /* eight IQ4_NL blocks, each its own six-bit scale */
        for (int64_t blk = 0; blk < n / 256; blk++, b += 136)
            for (int j = 0; j < 8; j++, dst += 32) {
                const float d = iq4xs_scale(b, j);
                const uint8_t *q = b + 8 + 16 * j;
                for (int i = 0; i < 16; i++) {
                    dst[i] = d * (float)IQ4_VALUES[q[i] & 15];
                    dst[i + 16] = d * (float)IQ4_VALUES[q[i] >> 4];
                }
            }
        return;
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

#if defined(HAVE_BF16)
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
#endif

/* The most rows a float32 step of this job takes on the fused path. */
static inline int64_t fused_max_rows(const job *jb) {
    return jb->K >= WIDE_K ? FUSED_MAX_ROWS_WIDE : FUSED_MAX_ROWS;
}

/* *buf grown to at least `bytes` (64-byte aligned; its contents not kept), or NULL when out of
 * memory: a thread's buffer, kept for its life. */
void *grown(void **buf, int64_t *size, int64_t bytes) {
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

static void run_panel(const job *jb, int64_t p, int64_t t_lo, int64_t t_hi);

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
        k_quant_panel(jb, &at, nr, t_lo, t_hi, acc);
        return;
    }
#endif
#if defined(HAVE_I8)
    if (jb->xq != NULL && i8_type(pt->type)) {     /* the other types' int8 products: steps of up to I8_MAX_ROWS */
        i8_panel(jb, &at, nr, t_lo, t_hi, acc);
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
    if (fast == FORGE_DET) {      /* the deterministic numerics (qmatmul_det.c), where it reads every part */
        int det = 1;
        for (int64_t i = 0; i < num_parts; i++) det &= forge_qmatmul_det_type(parts[i].type & ~(int64_t)DET_PACKED);
        if (det) return forge_qmatmul_det(x, T, K, ldx, parts, num_parts, out, ldo);
        fast = 0;
    }
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
