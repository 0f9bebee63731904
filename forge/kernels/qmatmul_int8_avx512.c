/* The K-quants' (Q4_K, Q5_K, Q6_K) int8 products on AVX-512 with BW, VNNI and BF16, x as int8 codes per
 * superblock of 256 (made by qmatmul_int8.c's quantize_row_k): decode-sized steps straight from the
 * blocks (k_direct), bigger ones with 16 weight rows in a vector's lanes (kg_panels). The numerics, and
 * what AVX2 shares with them: qmatmul_int8.h; the overview: qmatmul.c.
 */
#include "qmatmul_int8.h"

#if defined(HAVE_KG)
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

/* Panel `at` (its first nr rows of W) for rows [t_lo, t_hi) of x in the K-quants' int8 numerics: decode-
 * sized steps (bigger ones go to kg_panels), straight from the blocks, KD rows of x at a time. */
void k_quant_panel(const job *jb, const placed *at, int64_t nr, int64_t t_lo, int64_t t_hi, float *acc) {
    const qpart *pt = at->pt;
    const int64_t K = jb->K, col0 = at->col0, r0 = at->r0, row_bytes = at->row_bytes;
    const xk x = {jb->kq, jb->kd, jb->ks, jb->kb, NULL};
    for (int64_t t0 = t_lo; t0 < t_hi; t0 += KD) {
        const int mr = (int)(t_hi - t0 < KD ? t_hi - t0 : KD);
        memset(acc, 0, (size_t)mr * NR * VN * sizeof(float));
        for (int64_t c = 0; c < nr; c++)
            k_direct(mr, pt->type, pt->data + (r0 + c) * row_bytes, &x, K, t0, acc + c * VN);
        for (int64_t t = 0; t < mr; t++)
            reduce_row(acc + t * NR * VN, jb->out + (t0 + t) * jb->ldo + col0 + r0, nr);
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

/* Big `fast` steps with K-quant parts on AVX-512 VNNI: their panels four at a time (16 rows of one
 * part) through the lanes-as-rows kernel, unpacked once per step, every row of x against them; the
 * other parts' panels through bg_rows (bfloat16). */
void kg_panels(const job *jb, int64_t p_lo, int64_t p_hi) {
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
