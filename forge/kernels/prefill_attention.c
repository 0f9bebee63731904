/* Causal attention of chunks of query rows (prompt chunks, and a decode row with its speculative
 * guesses), read through the block table, on AVX-512.
 *
 * Per segment (one sequence's chunk) and KV head: the keys its rows can see are gathered once,
 * widened to float32 and transposed sixteen at a time in registers into slices of KC keys
 * ([hd][KC] each), the values gathered ([keys][hd]). The query vectors (a row's query heads of this
 * KV head's group) go QB at a time; for each slice, every set of NV of them that sees any of its
 * keys computes its scores by FMAs over the transposed keys, the causal (and sliding-window) mask,
 * an online softmax (running max and sum, the outputs rescaled when the max grows) and the values
 * weighted into its outputs, held in registers for the slice; the slice stays in L1 while the
 * block passes over it. Keys past a vector's position cost nothing beyond the slice that holds its
 * diagonal. An attention sink (gpt-oss) starts a vector's softmax at its logit with a sum of 1.
 * float32 throughout; the exponential is a Cephes-style polynomial (~1 ulp). In the
 * `fast` numerics, with AVX-512 BF16, the two products instead take pairs rounded to bfloat16 by
 * VDPBF16PS (two multiply-adds a lane, summed in float32): each query's pairs of dimensions against
 * each key's, and each pair of keys' weights against their values; the gathered keys and values
 * are rounded into those pairs in place, the softmax stays float32.
 *
 * numpy computes the same in forge.models.llama.attention._prefill (whole rows of scores, a softmax, two
 * batched products): the reference this kernel is tested against. Without AVX-512 the entry point
 * returns -1 and the caller keeps numpy.
 *
 * Built by forge.kernels.compiled with the host's compiler (-O3 -march=native); called through
 * ctypes, which releases the GIL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "kv16.h"

#define KC 64                 /* keys per chunk: four zmm of scores per query vector */
#define NV 4                  /* query vectors taken together */
#define MAX_HZ 4              /* head_dim / 16 the kernel takes: up to 64 */
#define QB 32                 /* query vectors per block: their outputs and a chunk's keys and values fit L1 */
#if defined(__AVX512BF16__)
#define HAVE_BF16_PAIRS 1
#endif

/* exp(x) for x <= 0, 16 at a time; x below -87.3 (and -inf) gives 0 through the caller's mask. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33654f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

typedef struct {
    const float *q;           /* [hd] the scaled query */
    float *o;                 /* [hd] where its output goes */
    int64_t first, last;      /* the keys it sees: first .. last (positions) */
    const float *sink;        /* its head's attention sink (a logit in the softmax's denominator), or NULL */
} vec_t;

/* One chunk of KC keys (kc [hd][KC] transposed, vc [KC][hd], the first key key0) for NV query vectors
 * (some may repeat the last to fill the set: same values, written twice): their running max m, sum l
 * and unnormalised outputs acc [NV][hd] updated (the online softmax). */
static inline __attribute__((always_inline)) void quad_chunk(const vec_t *vecs, float *m, float *l, float *acc,
                                                             const float *restrict kc, const float *restrict vc,
                                                             int64_t key0, const int hz, const int bf,
                                                             const uint32_t *restrict qp) {
    const int64_t hd = 16 * hz;
    __m512 s[NV][KC / 16];
    for (int v = 0; v < NV; v++)
        for (int c = 0; c < KC / 16; c++)
            s[v][c] = _mm512_setzero_ps();
#if defined(HAVE_BF16_PAIRS)
    if (bf)                   /* kc: [hd / 2][KC] pairs of dimensions; qp: [NV][hd / 2] the queries' */
        for (int64_t i = 0; i < hd / 2; i++) {
            const uint32_t *row = (const uint32_t *)kc + i * KC;
            __m512bh kz[KC / 16];
            for (int c = 0; c < KC / 16; c++)
                kz[c] = (__m512bh)_mm512_loadu_si512((const void *)(row + 16 * c));
            for (int v = 0; v < NV; v++) {
                const __m512bh qd = (__m512bh)_mm512_set1_epi32((int)qp[v * hd / 2 + i]);
                for (int c = 0; c < KC / 16; c++)
                    s[v][c] = _mm512_dpbf16_ps(s[v][c], qd, kz[c]);
            }
        }
    else
#endif
    for (int64_t d = 0; d < hd; d++) {
        const float *row = kc + d * KC;
        const __m512 k_0 = _mm512_loadu_ps(row), k_1 = _mm512_loadu_ps(row + 16),
                     k_2 = _mm512_loadu_ps(row + 32), k_3 = _mm512_loadu_ps(row + 48);
        for (int v = 0; v < NV; v++) {
            const __m512 qd = _mm512_set1_ps(vecs[v].q[d]);
            s[v][0] = _mm512_fmadd_ps(qd, k_0, s[v][0]);
            s[v][1] = _mm512_fmadd_ps(qd, k_1, s[v][1]);
            s[v][2] = _mm512_fmadd_ps(qd, k_2, s[v][2]);
            s[v][3] = _mm512_fmadd_ps(qd, k_3, s[v][3]);
        }
    }
    int64_t last = vecs[0].last;
    for (int v = 1; v < NV; v++)
        last = vecs[v].last > last ? vecs[v].last : last;
    const int64_t used = last - key0 + 1 > KC ? KC : last - key0 + 1;   /* keys any of them sees */
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float pbuf[NV][KC] __attribute__((aligned(64)));
    __m512 o[NV][MAX_HZ];
    for (int v = 0; v < NV; v++) {
        for (int z = 0; z < hz; z++)
            o[v][z] = _mm512_load_ps(acc + v * hd + 16 * z);
        __mmask16 valid[KC / 16];
        float cmax = -INFINITY;
        for (int c = 0; c < KC / 16; c++) {
            const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(key0 + 16 * c)));
            valid[c] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32((int)vecs[v].last))
                     & _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32((int)vecs[v].first));
            if (valid[c]) {
                const float cm = _mm512_mask_reduce_max_ps(valid[c], s[v][c]);
                cmax = cm > cmax ? cm : cmax;
            }
        }
        if (cmax == -INFINITY) {                     /* no key of this chunk is visible to it */
            memset(pbuf[v], 0, sizeof pbuf[v]);      /* (as pairs too: zero is zero) */
            continue;
        }
        const float m_new = cmax > m[v] ? cmax : m[v];
        const float alpha = m[v] == -INFINITY ? 0.0f : expf(m[v] - m_new);
        const __m512 mn = _mm512_set1_ps(m_new);
        __m512 total = _mm512_setzero_ps();
        __m512 pc[KC / 16];
        for (int c = 0; c < KC / 16; c++) {
            pc[c] = _mm512_maskz_mov_ps(valid[c], exp512(_mm512_sub_ps(s[v][c], mn)));
            total = _mm512_add_ps(total, pc[c]);
            if (!bf)
                _mm512_store_ps(pbuf[v] + 16 * c, pc[c]);
        }
#if defined(HAVE_BF16_PAIRS)
        if (bf)                                      /* pbuf as uint32: the weights of keys 2j, 2j + 1 */
            for (int c = 0; c < KC / 16; c += 2)
                _mm512_store_si512((void *)(pbuf[v] + 8 * c), (__m512i)_mm512_cvtne2ps_pbh(pc[c + 1], pc[c]));
#endif
        l[v] = l[v] * alpha + _mm512_reduce_add_ps(total);
        m[v] = m_new;
        if (alpha != 1.0f) {
            const __m512 a = _mm512_set1_ps(alpha);
            for (int z = 0; z < hz; z++)
                o[v][z] = _mm512_mul_ps(o[v][z], a);
        }
    }
#if defined(HAVE_BF16_PAIRS)
    if (bf) {                 /* vc: [KC / 2][hd] pairs of keys; a key past `used` weighs 0 */
        for (int64_t j = 0; j < (used + 1) / 2; j++) {
            const uint32_t *vr = (const uint32_t *)vc + j * hd;
            __m512bh vz[MAX_HZ];
            for (int z = 0; z < hz; z++)
                vz[z] = (__m512bh)_mm512_loadu_si512((const void *)(vr + 16 * z));
            for (int v = 0; v < NV; v++) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)((const uint32_t *)pbuf[v])[j]);
                for (int z = 0; z < hz; z++)
                    o[v][z] = _mm512_dpbf16_ps(o[v][z], p, vz[z]);
            }
        }
    } else
#endif
    for (int64_t j = 0; j < used; j++) {
        const float *vr = vc + j * hd;
        __m512 vz[MAX_HZ];
        for (int z = 0; z < hz; z++)
            vz[z] = _mm512_loadu_ps(vr + 16 * z);
        for (int v = 0; v < NV; v++) {
            const __m512 p = _mm512_set1_ps(pbuf[v][j]);
            for (int z = 0; z < hz; z++)
                o[v][z] = _mm512_fmadd_ps(p, vz[z], o[v][z]);
        }
    }
    for (int v = 0; v < NV; v++)
        for (int z = 0; z < hz; z++)
            _mm512_store_ps(acc + v * hd + 16 * z, o[v][z]);
}

/* A block of up to QB query vectors (vecs holds NV - 1 more, repeating the last) against the
 * gathered keys (kt: chunks of [hd][KC]) and values (vg [nk][hd]) whose first column is key k0:
 * chunk by chunk, the chunk's keys and values read from L1 by every set of NV vectors that sees any
 * of them. */
static inline __attribute__((always_inline)) void run_block(const vec_t *vecs, int64_t count, const float *kt,
                                                            const float *vg, int64_t k0, const int hz, const int bf) {
    const int64_t hd = 16 * hz;
    float m[QB + NV], l[QB + NV], acc[(QB + NV) * MAX_HZ * 16] __attribute__((aligned(64)));
    uint32_t qp[(QB + NV) * MAX_HZ * 8];     /* bf: each query's pairs of dimensions in bfloat16 */
#if defined(HAVE_BF16_PAIRS)
    if (bf)
        for (int64_t v = 0; v < count + NV; v++)
            for (int z = 0; z < hz; z += 2) {
                const __m512 lo = _mm512_loadu_ps(vecs[v].q + 16 * z);
                if (z + 1 < hz)
                    _mm512_storeu_si512((void *)(qp + v * hd / 2 + 8 * z),
                                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(vecs[v].q + 16 * z + 16), lo));
                else
                    _mm256_storeu_si256((__m256i *)(qp + v * hd / 2 + 8 * z), (__m256i)_mm512_cvtneps_pbh(lo));
            }
#endif
    int64_t first = vecs[0].first, last = vecs[0].last;
    for (int64_t v = 0; v < count + NV; v++) {
        m[v] = vecs[v].sink != NULL ? *vecs[v].sink : -INFINITY;    /* a sink: the softmax starts from it */
        l[v] = vecs[v].sink != NULL ? 1.0f : 0.0f;
        first = vecs[v].first < first ? vecs[v].first : first;
        last = vecs[v].last > last ? vecs[v].last : last;
    }
    memset(acc, 0, (size_t)((count + NV) * hd) * sizeof(float));
    for (int64_t col = (first - k0) / KC * KC; k0 + col <= last; col += KC) {
        const int64_t key0 = k0 + col;
        for (int64_t j = 0; j < count; j += NV) {
            int64_t qf = vecs[j].first, ql = vecs[j].last;
            for (int64_t e = 1; e < NV; e++) {
                qf = vecs[j + e].first < qf ? vecs[j + e].first : qf;
                ql = vecs[j + e].last > ql ? vecs[j + e].last : ql;
            }
            if (ql < key0 || qf >= key0 + KC)
                continue;                            /* none of them sees a key of this chunk */
            quad_chunk(vecs + j, m + j, l + j, acc + j * hd, kt + col * hd, vg + (bf ? col / 2 : col) * hd, key0, hz,
                       bf, qp + j * hd / 2);
        }
    }
    for (int64_t v = 0; v < count; v++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[v]);
        for (int z = 0; z < hz; z++)
            _mm512_storeu_ps(vecs[v].o + 16 * z, _mm512_mul_ps(_mm512_load_ps(acc + v * hd + 16 * z), inv));
    }
}
/* In place: the 16 x 16 block r[i][j] becomes r[j][i]. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    /* now r[4a + b] holds, in each 128-bit lane L, row (4L' ...): element (row 4a + lane-pair, col b + 4L) */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);        /* lanes 0, 2 of each */
        t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);    /* lanes 1, 3 */
        t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
        t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
        r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
    }
}

/* Keys k0 .. num_keys - 1 of one KV head (at offset `head` in a position's row) widened to float32:
 * the keys transposed into kt (slices of KC keys, [hd][KC] each), the values into vg [nk][hd]; the
 * padding up to nk zero. */
static void gather(const void *k, const void *v, const uint16_t *ks, const uint16_t *vs, int kv_type, const int64_t *table, int64_t block_size,
                   int64_t kv_stride, int64_t head, int64_t k0, int64_t num_keys, int64_t nk, int64_t hd,
                   float *restrict kt, float *restrict vg) {
    int64_t p = k0;
    for (; p + 16 <= num_keys; p += 16) {                /* 16 keys at a time, transposed in registers */
        const int64_t j = p - k0;
        int64_t at[16];
        for (int e = 0; e < 16; e++)
            at[e] = slot_of(table, p + e, block_size) * kv_stride + head;
        float *kslice = kt + (j / KC) * KC * hd + j % KC;     /* j % 16 == 0: one slice holds all 16 */
        for (int64_t d = 0; d < hd; d += 16) {
            __m512 r[16];
            for (int e = 0; e < 16; e++) {
                r[e] = load16_kv(k, ks, at[e] + d, kv_type);
                _mm512_storeu_ps(vg + (j + e) * hd + d, load16_kv(v, vs, at[e] + d, kv_type));
            }
            transpose16(r);
            for (int e = 0; e < 16; e++)
                _mm512_storeu_ps(kslice + (d + e) * KC, r[e]);
        }
    }
    for (; p < num_keys; p++) {                            /* the last few one by one */
        const int64_t at = slot_of(table, p, block_size) * kv_stride + head;
        const int64_t j = p - k0;
        float *kcol = kt + (j / KC) * KC * hd + j % KC;
        for (int64_t d = 0; d < hd; d += 16) {
            float tmp[16] __attribute__((aligned(64)));
            _mm512_store_ps(tmp, load16_kv(k, ks, at + d, kv_type));
            for (int e = 0; e < 16; e++)
                kcol[(d + e) * KC] = tmp[e];
            _mm512_storeu_ps(vg + j * hd + d, load16_kv(v, vs, at + d, kv_type));
        }
    }
    for (int64_t j = num_keys - k0; j < nk; j++) {       /* the padding: finite, masked anyway */
        float *kcol = kt + (j / KC) * KC * hd + j % KC;
        for (int64_t d = 0; d < hd; d++)
            kcol[d * KC] = 0.0f;
        memset(vg + j * hd, 0, (size_t)hd * sizeof(float));
    }
}
#endif

#if defined(HAVE_BF16_PAIRS)
/* rows a and b (n floats each, n a multiple of 16) rounded to bfloat16 and interleaved into n pairs
 * (a's value low, b's high) at dst, which may be a itself: each 16 are read before they are written. */
static inline void pairs_of_rows(const float *a, const float *b, int64_t n, uint32_t *dst) {
    for (int64_t i = 0; i < n; i += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + i)));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b + i)));
        _mm512_storeu_si512((void *)(dst + i), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

/* The gathered keys (kt: chunks of [hd][KC]) and values (vg: [nk][hd]) in place as bfloat16 pairs:
 * each chunk [hd / 2][KC] pairs of dimensions, the values [nk / 2][hd] pairs of keys. Row r of the
 * pairs lands where row r of the floats was, once rows 2r and 2r + 1 have been read. */
static void to_pairs(float *kt, float *vg, int64_t nk, int64_t hd) {
    for (int64_t c = 0; c < nk; c += KC)
        for (int64_t i = 0; i < hd / 2; i++)
            pairs_of_rows(kt + c * hd + 2 * i * KC, kt + c * hd + (2 * i + 1) * KC, KC,
                          (uint32_t *)(kt + c * hd) + i * KC);
    for (int64_t j = 0; j < nk / 2; j++)
        pairs_of_rows(vg + 2 * j * hd, vg + (2 * j + 1) * hd, hd, (uint32_t *)vg + j * hd);
}
#endif

/* 1 when paged_prefill_attention takes this head_dim on this build (AVX-512), else 0. */
int paged_prefill_attention_supports(int64_t hd) {
#if defined(__AVX512F__)
    return hd > 0 && hd % 16 == 0 && hd / 16 <= MAX_HZ;
#else
    (void)hd;
    return 0;
#endif
}

/* q:          [T, nh, hd]  the step's scaled queries
 * k, v:       [num_blocks, block_size, nkv, hd]  one layer's cache; kv_type 0 float32, 1 float16,
 *             2 bfloat16 (raw uint16 bits), 3 int8 with k_scales, v_scales [num_blocks, block_size,
 *             nkv, hd / 32] (kv16.h; unused by the other types)
 * tables:     [num_segs, table_width]  each segment's block ids (at least ceil(keys / block_size))
 * seg_row0, seg_pos0: [num_segs]  a row of T in the segment's chunk and its position (a chunk's rows
 *             are consecutive positions of one sequence)
 * seg_keys:   [num_segs]  the keys to gather: the last position among the segment's ranges + 1
 * ranges:     [n_ranges][3]  rows [lo, hi) of T to compute and their segment; a segment's ranges
 *             consecutive
 * window:     a sliding window (a row at p sees keys p - window + 1 .. p); 0: none
 * scratch:    at least 2 * hd * (the most keys of a segment rounded up to KC, plus KC) floats
 * out:        [T, nh, hd]  the ranges' rows written
 * fast:       1: the products in bfloat16 pairs where the build has AVX-512 BF16 (the `fast`
 *             numerics; else float32, as with 0)
 * sinks:      [nh]  each query head's attention sink, a logit in its softmax's denominator only
 *             (gpt-oss: the online softmax starts from it, a weight of 1 on no value), or NULL: none
 * Returns 0; -1 without AVX-512, for head_dim not a multiple of 16 up to 64, or a scratch too
 * small. */
int paged_prefill_attention(const float *q, const void *k, const void *v, const uint16_t *k_scales,
                            const uint16_t *v_scales, int kv_type, const int64_t *tables,
                            int64_t table_width, const int64_t *seg_row0, const int64_t *seg_pos0,
                            const int64_t *seg_keys, const int64_t *ranges, int64_t n_ranges, int64_t window,
                            int64_t nh, int64_t nkv, int64_t hd, int64_t block_size, float *scratch,
                            int64_t scratch_floats, float *out, int fast, const float *sinks) {
#if defined(__AVX512F__)
#if defined(HAVE_BF16_PAIRS)
    const int bf = fast != 0;
#else
    const int bf = 0;
    (void)fast;
#endif
    if (hd % 16 || hd / 16 > MAX_HZ || kv_type < 0 || kv_type > 3 || (kv_type == 3 && hd % KV_INT8_GROUP))
        return -1;
    const int64_t group = nh / nkv, kv_stride = nkv * hd;
    for (int64_t r_begin = 0, r_end; r_begin < n_ranges; r_begin = r_end) {
        const int64_t seg = ranges[3 * r_begin + 2];
        int64_t lo_all = ranges[3 * r_begin];
        for (r_end = r_begin + 1; r_end < n_ranges && ranges[3 * r_end + 2] == seg; r_end++)
            lo_all = ranges[3 * r_end] < lo_all ? ranges[3 * r_end] : lo_all;
        const int64_t *table = tables + seg * table_width;
        const int64_t row0 = seg_row0[seg], pos0 = seg_pos0[seg], num_keys = seg_keys[seg];
        const int64_t first_pos = pos0 + lo_all - row0;
        const int64_t k0 = window && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
        const int64_t nk = (num_keys - k0 + KC - 1) / KC * KC + KC;   /* a chunk may start past num_keys - KC */
        if (scratch_floats < 2 * hd * nk)
            return -1;
        float *kt = scratch, *vg = scratch + hd * nk;
        for (int64_t g = 0; g < nkv; g++) {
            gather(k, v, k_scales, v_scales, kv_type, table, block_size, kv_stride, g * hd, k0, num_keys, nk, hd, kt, vg);
#if defined(HAVE_BF16_PAIRS)
            if (bf)
                to_pairs(kt, vg, nk, hd);
#endif
            for (int64_t r = r_begin; r < r_end; r++) {
                const int64_t lo = ranges[3 * r], hi = ranges[3 * r + 1];
                const int64_t num_vecs = (hi - lo) * group;
                for (int64_t j0 = 0; j0 < num_vecs; j0 += QB) {
                    vec_t vecs[QB + NV];
                    const int64_t count = num_vecs - j0 < QB ? num_vecs - j0 : QB;
                    for (int64_t e = 0; e < count + NV; e++) {   /* past count: the last again */
                        const int64_t jj = j0 + (e < count ? e : count - 1);
                        const int64_t row = lo + jj / group, head = g * group + jj % group;
                        const int64_t pos = pos0 + row - row0;
                        vecs[e].q = q + (row * nh + head) * hd;
                        vecs[e].o = out + (row * nh + head) * hd;
                        vecs[e].last = pos;
                        vecs[e].first = window && pos - window + 1 > 0 ? pos - window + 1 : 0;
                        vecs[e].sink = sinks != NULL ? sinks + head : NULL;
                    }
                    switch (hd / 16 + 4 * bf) {   /* a copy per head_dim and numerics, a set's outputs held in registers */
                    case 1: run_block(vecs, count, kt, vg, k0, 1, 0); break;
                    case 2: run_block(vecs, count, kt, vg, k0, 2, 0); break;
                    case 3: run_block(vecs, count, kt, vg, k0, 3, 0); break;
                    case 4: run_block(vecs, count, kt, vg, k0, 4, 0); break;
#if defined(HAVE_BF16_PAIRS)
                    case 5: run_block(vecs, count, kt, vg, k0, 1, 1); break;
                    case 6: run_block(vecs, count, kt, vg, k0, 2, 1); break;
                    case 7: run_block(vecs, count, kt, vg, k0, 3, 1); break;
                    case 8: run_block(vecs, count, kt, vg, k0, 4, 1); break;
#endif
                    }
                }
            }
        }
    }
    return 0;
#else
    (void)q; (void)k; (void)v; (void)k_scales; (void)v_scales; (void)kv_type; (void)tables; (void)table_width; (void)seg_row0; (void)seg_pos0;
    (void)seg_keys; (void)ranges; (void)n_ranges; (void)window; (void)nh; (void)nkv; (void)hd; (void)block_size;
    (void)scratch; (void)scratch_floats; (void)out; (void)fast; (void)sinks;
    return -1;
#endif
}
