/* The `fast` numerics' int8 products, and x made ready for them.
 *
 * AVX2 builds (no AVX-512): int8 activations for Q4_0, Q4_1, Q8_0, IQ4_NL, IQ4_XS, MXFP4 (per block of 32,
 * decode steps) and
 * the K-quants (per superblock of 256, every step), both here. AVX-512 builds with BW, VNNI and BF16
 * (AMD Zen 4 and later, Intel Sapphire Rapids and later): the K-quants' int8 products in 64-byte vectors
 * (qmatmul_int8_avx512.c), x's codes made here, the other types' `fast` numerics staying bfloat16 (int8
 * adds nothing at decode, where both read at memory speed, and prefill of those types keeps the bfloat16
 * tiles). What both share: qmatmul_int8.h; the overview: qmatmul.c.
 */
#include "qmatmul_int8.h"
#include "qmatmul_lowbit.h"

#if defined(HAVE_I8K)
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

/* Row x (K values) as Q8_K-style codes: per superblock of 256 the scale d, per 32 codes s = d *
 * their sum, per 16 codes their sum (in a record's sv order). Exact IEEE arithmetic, as quantize_row. */
EXACT void quantize_row_k(const float *x, int64_t K, int8_t *q, float *d, float *s, int16_t *sums) {
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

#if defined(HAVE_I8)
/* ---- the `fast` numerics on AVX2 (no AVX-512 BF16): int8 activations -------------------------
 * Q4_0, Q4_1, Q8_0, and the table types IQ4_NL, IQ4_XS and MXFP4, whose 4-bit indices become their table's int8
 * values by one VPSHUFB (the K-quants' way: qmatmul_int8.h):
 * x quantized per block of 32 values as llama.cpp's Q8_0 (dx = max|x| / 127, codes x * (127 / max|x|)
 * rounded to nearest even), each weight block's codes multiplied with them as integers (VPMADDUBSW,
 * VPMADDWD: exact; a signed code goes in as |w| against x with w's sign), each block's eight int32
 * sums then scaled by the weight block's scale times dx into float32 lanes, and Q4_1's offset m
 * times dx * the sum of the block's codes. Every row of x is quantized alone and
 * added in one order whatever the step: a row's bits do not depend on the batch. */

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

/* A table type's 16 int8 values in both 128-bit lanes, for VPSHUFB to look 4-bit indices up in. */
static inline __m256i lut_bytes(const int8_t *values) {
    return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)values));
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
        case T_IQ4_NL:                                                                             \
        case T_MXFP4: {                                                                            \
            const int nl = type == T_IQ4_NL;                                                       \
            const __m256i values = lut_bytes(nl ? IQ4_VALUES : MXFP4_VALUES);                      \
            for (int64_t blk = 0; blk < nb; blk++)                                                 \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + blk * (18 - !nl);                                 \
                    if ((blk & 1) == 0) PREFETCH(b + PF_AHEAD);                                    \
                    const __m256i w = _mm256_shuffle_epi8(values, nibbles32(b + 2 - !nl));         \
                    I8_ROWS(mr, c, blk, dot_ss(w, xv), nl ? f16(b) : e8m0_half(b[0]))              \
                }                                                                                  \
            break;                                                                                 \
        }                                                                                          \
        case T_IQ4_XS: {                                                                           \
            const __m256i values = lut_bytes(IQ4_VALUES);                                          \
            for (int64_t blk = 0; blk < nb; blk++)                                                 \
                for (int c = 0; c < NR; c++) {                                                     \
                    const uint8_t *b = rows[c] + blk / 8 * 136;                                    \
                    if ((blk & 7) == 0)                                                            \
                        for (int l = 0; l < 3; l++) PREFETCH(b + PF_AHEAD + 64 * l);               \
                    const __m256i w = _mm256_shuffle_epi8(values, nibbles32(b + 8 + 16 * (blk % 8)));  \
                    float dl = iq4xs_scale(b, (int)(blk % 8));     /* d (ls - 32), then times dx */  \
                    OPAQUE(dl);                                                                    \
                    I8_ROWS(mr, c, blk, dot_ss(w, xv), dl)                                         \
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
EXACT void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *v = x + 32 * b;
        const float amax = amax_of(v, 32);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const int sum = codes16(v, id, q + 32 * b) + codes16(v + 16, id, q + 32 * b + 16);
        d[b] = amax / 127.0f;
        s[b] = d[b] * (float)sum;
    }
}

/* Panel `at` (its first nr rows of W) for rows [t_lo, t_hi) of x (up to I8_MAX_ROWS), FR8 at a time. */
void i8_panel(const job *jb, const placed *at, int64_t nr, int64_t t_lo, int64_t t_hi, float *acc) {
    const qpart *pt = at->pt;
    const int64_t K = jb->K, col0 = at->col0, r0 = at->r0, row_bytes = at->row_bytes;
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
}
#endif

#if defined(HAVE_I8K) && !defined(__AVX512F__)
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

/* Panel `at` (its first nr rows of W) for rows [t_lo, t_hi) of x in the K-quants' int8 numerics: the
 * panel's superblocks unpacked into records once, then KR rows of x at a time against them. */
void k_quant_panel(const job *jb, const placed *at, int64_t nr, int64_t t_lo, int64_t t_hi, float *acc) {
    const qpart *pt = at->pt;
    const int64_t K = jb->K, col0 = at->col0, r0 = at->r0, row_bytes = at->row_bytes;
    const xk x = {jb->kq, jb->kd, jb->ks, jb->kb, NULL};
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
}
#endif
