/* The deterministic numerics' attention: one algorithm for every query row (a decode row, a row of a prompt chunk
 * of any size or position, a speculative guess), whose output has the same bits among any batch mates, on any
 * thread and in every build (scalar, AVX2, AVX-512). Compiled without -ffast-math and with -ffp-contract=off
 * (forge.kernels.compiled's FILE_FLAGS); forge.kernels.det_attention_reference is the same definition in numpy,
 * and the tests hold every build to it bit for bit.
 *
 * The definition, per query row (one query head h, its scaled query q as the model passes it, at position p) and
 * its KV head h / group (GQA), over the keys j = f .. p it sees (f = 0; with a sliding window W, max(0, p - W + 1)),
 * read from the paged cache through the sequence's block table and widened exactly to float32 (float32, float16 or
 * bfloat16 storage; the int8 cache is refused in this numerics), every step one float32 operation, no fused
 * multiply-add:
 *   s_j = 0; s_j = s_j + q_d * k_jd for d = 0 .. hd - 1 in order;
 *   with Gemma 2's soft-capping at c: a = s_j * (1 / c); t = det_exp(a + a); s_j = (1 - 2 / (t + 1)) * c;
 *   m = the largest s_j, and the head's attention sink (gpt-oss) where it has one;
 *   e_j = det_exp(s_j - m) (det_math.h);
 *   sixteen partials P_k = the sum of e_j over j = k (mod 16), from 0, j ascending; l = the fixed tree
 *     P_k = P_k + P_(k+8) (k < 8), then P_k + P_(k+4) (k < 4), then P_k + P_(k+2) (k < 2), then P_0 + P_1;
 *     with a sink: l = l + det_exp(sink - m);
 *   o_d = (0 + e_f * v_fd + ... + e_p * v_pd, added j ascending) / l.
 * The indices j are absolute positions, so a row's partials are the same wherever its chunk starts.
 *
 * How: the work is split into (segment, KV head) items on the kernel pool (forge_run_parallel); a segment is a run of
 * consecutive rows of one sequence (a decode row alone, or up to a few dozen rows of a chunk). An item widens its
 * keys once into tiles of sixteen keys, transposed 8 x 8 in registers straight from the cache ([tile][d][16]), and
 * its values into rows (a decode row reads them in place: once each); the segment's rows and the group's query
 * heads share them. Scores go sixteen keys at a time, a lane per key (each lane the
 * definition's sum over d); the exponentials and partials a lane per j mod 16; the outputs a lane per d. Every lane
 * does the scalar definition's operations, so the width changes nothing.
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "det_math.h"
#include "transpose8.h"
#include "pool.h"

#define DET_TILE 16
#define DET_MAX_GROUP 64
#define DET_MAX_HEAD_DIM 512
#define DET_PREFETCH 8               /* keys ahead whose rows an item prefetches */

/* One value of the cache widened to float32, exactly: kv_type 0 float32, 1 float16, 2 bfloat16 (raw bits). */
static inline float widen(const void *base, int kv_type, int64_t at) {
    if (kv_type == 0)
        return ((const float *)base)[at];
    const uint16_t bits = ((const uint16_t *)base)[at];
    if (kv_type == 1) {
        _Float16 h;
        memcpy(&h, &bits, sizeof h);
        return (float)h;
    }
    const uint32_t wide = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &wide, sizeof f);
    return f;
}

/* n values from offset `at`, widened into out. */
static void widen_row(const void *base, int kv_type, int64_t at, int64_t n, float *restrict out) {
    int64_t d = 0;
#if defined(__F16C__)
    if (kv_type == 1)
        for (; d + 8 <= n; d += 8)
            _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at + d))));
#endif
    for (; d < n; d++) out[d] = widen(base, kv_type, at + d);
}

/* s[16 * tiles] = the scores of one query against `tiles` tiles of sixteen transposed keys (kt [tiles][hd][16]),
 * a lane per key: the scalar build's (the vector builds score several heads at once: scores_heads). */
#if !defined(__AVX2__) && !defined(__AVX512F__)
static void scores(const float *restrict q, const float *restrict kt, int64_t hd, int64_t tiles, float *restrict s) {
    const int64_t step = hd * DET_TILE;
    for (int64_t t = 0; t < tiles; t++) {
        float a[DET_TILE] = {0};
        for (int64_t d = 0; d < hd; d++)
            for (int l = 0; l < DET_TILE; l++) a[l] = a[l] + q[d] * kt[t * step + d * DET_TILE + l];
        memcpy(s + t * DET_TILE, a, sizeof a);
    }
}
#endif

/* s[16] <- det_exp(s - m), lane by lane. */
static inline void tile_exps(float *restrict s, float m) {
#if defined(__AVX512F__)
    _mm512_storeu_ps(s, det_exp16(_mm512_sub_ps(_mm512_loadu_ps(s), _mm512_set1_ps(m))));
#elif defined(__AVX2__)
    for (int h = 0; h < DET_TILE; h += 8)
        _mm256_storeu_ps(s + h, det_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + h), _mm256_set1_ps(m))));
#else
    for (int l = 0; l < DET_TILE; l++) s[l] = det_exp(s[l] - m);
#endif
}

/* The sixteen partials' fixed tree. */
static inline float tree16(float *p) {
    for (int half = 8; half >= 1; half /= 2)
        for (int k = 0; k < half; k++) p[k] = p[k] + p[k + half];
    return p[0];
}

/* The soft-capping of the definition, in place over n scores. */
static void softcap_scores(float *s, int64_t n, float cap) {
    const float inv = 1.0f / cap;
    for (int64_t i = 0; i < n; i++) {
        const float a = s[i] * inv;
        const float t = det_exp(a + a);
        s[i] = (1.0f - 2.0f / (t + 1.0f)) * cap;
    }
}

/* dst[i * dst_stride + l] = src[l * src_stride + i] for l, i < 8: moves, no arithmetic. */
#if defined(__AVX2__)
static inline void transpose8(const float *src, int64_t src_stride, float *dst, int64_t dst_stride) {
    __m256 r[8], o[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_stride);
    transpose8v(r, o);
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * dst_stride, o[i]);
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
#define DET_DIRECT 1
/* Eight values widened exactly from `at` of a cache of kv_type (0 float32, 1 float16, 2 bfloat16); at < 0: zeros. */
static inline __m256 load8_kv(const void *base, int kv_type, int64_t at) {
    if (at < 0)
        return _mm256_setzero_ps();
    if (kv_type == 0)
        return _mm256_loadu_ps((const float *)base + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at));
    if (kv_type == 1)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* kt [hd][16] = the tile's keys straight from the cache (key l's row at at[l], -1: zeros), 8 x 8 at a time. */
static void transpose_tile_direct(const void *k, int kv_type, const int64_t *at, int64_t hd, float *restrict kt) {
    for (int64_t d = 0; d < hd; d += 8)
        for (int half = 0; half < 2; half++) {
            __m256 r[8], o[8];
            for (int i = 0; i < 8; i++) {
                const int64_t a = at[half * 8 + i];
                r[i] = load8_kv(k, kv_type, a < 0 ? -1 : a + d);
            }
            transpose8v(r, o);
            float *dst = kt + d * DET_TILE + half * 8;
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * DET_TILE, o[i]);
        }
}
#endif

/* One tile's keys, rows rb [16][hd] (key l of the tile in row l), transposed into kt [hd][16]. */
static void transpose_tile(const float *restrict rb, int64_t hd, float *restrict kt) {
    int64_t d = 0;
#if defined(__AVX2__)
    for (; d + 8 <= hd; d += 8) {
        transpose8(rb + d, hd, kt + d * DET_TILE, DET_TILE);
        transpose8(rb + 8 * hd + d, hd, kt + d * DET_TILE + 8, DET_TILE);
    }
#endif
    for (; d < hd; d++)
        for (int l = 0; l < DET_TILE; l++) kt[d * DET_TILE + l] = rb[l * hd + d];
}

/* The outputs' sums: acc[k][d] = 0 + e_a * v_ad + ... + e_b * v_bd (j ascending) for the group's heads k < group,
 * e [group][width] (head k's weights at e + k * width), v the values' rows from key a's (row j at v + (j - a) * hd).
 * A lane per d. */
#if defined(__AVX512F__)
#define DET_VL 16
typedef __m512 det_vec;
#define det_zero _mm512_setzero_ps
#define det_set1 _mm512_set1_ps
#define det_load _mm512_loadu_ps
#define det_store _mm512_storeu_ps
#define det_add _mm512_add_ps
#define det_mul _mm512_mul_ps
#define DET_HEADS 4
#elif defined(__AVX2__)
#define DET_VL 8
typedef __m256 det_vec;
#define det_zero _mm256_setzero_ps
#define det_set1 _mm256_set1_ps
#define det_load _mm256_loadu_ps
#define det_store _mm256_storeu_ps
#define det_add _mm256_add_ps
#define det_mul _mm256_mul_ps
#define DET_HEADS 3
#endif

/* Where the values come from: widened rows v (row j at v + (j - a) * hd), or, with `cache` (a decode row: each value
 * read once), straight from the cache of kv_type, row j at element at[j - a]. */
typedef struct {
    const float *v;
    const void *cache;
    int kv_type;
    const int64_t *at;
} det_values;

#if defined(DET_VL) && defined(DET_DIRECT)
#if DET_VL == 16
static inline det_vec load_kv(const void *base, int kv_type, int64_t at) {
    if (kv_type == 0)
        return _mm512_loadu_ps((const float *)base + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    if (kv_type == 1)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
#define load_kv load8_kv
#endif
#endif

#ifdef DET_VL
/* Four vectors of d (4 * DET_VL dims from d0) for hn <= DET_HEADS heads from k0, the sums in registers. */
static inline __attribute__((always_inline)) void weigh4(const float *restrict e, int64_t width, int64_t k0, int hn,
                                                        int64_t a, int64_t b, const det_values *src, int64_t hd,
                                                        int64_t d0, float *restrict acc) {
    det_vec o[DET_HEADS][4];
    for (int k = 0; k < DET_HEADS; k++)
        for (int c = 0; c < 4; c++) o[k][c] = det_zero();
    for (int64_t j = a; j <= b; j++) {
        det_vec v0, v1, v2, v3;
#ifdef DET_DIRECT
        if (src->cache != NULL) {
            const int64_t at = src->at[j - a] + d0;
            v0 = load_kv(src->cache, src->kv_type, at);
            v1 = load_kv(src->cache, src->kv_type, at + DET_VL);
            v2 = load_kv(src->cache, src->kv_type, at + 2 * DET_VL);
            v3 = load_kv(src->cache, src->kv_type, at + 3 * DET_VL);
        } else
#endif
        {
            const float *vr = src->v + (j - a) * hd + d0;
            v0 = det_load(vr);
            v1 = det_load(vr + DET_VL);
            v2 = det_load(vr + 2 * DET_VL);
            v3 = det_load(vr + 3 * DET_VL);
        }
        for (int k = 0; k < DET_HEADS; k++) {
            if (k >= hn) break;
            const det_vec w = det_set1(e[(k0 + k) * width + j]);
            o[k][0] = det_add(o[k][0], det_mul(w, v0));
            o[k][1] = det_add(o[k][1], det_mul(w, v1));
            o[k][2] = det_add(o[k][2], det_mul(w, v2));
            o[k][3] = det_add(o[k][3], det_mul(w, v3));
        }
    }
    for (int k = 0; k < hn; k++)
        for (int c = 0; c < 4; c++) det_store(acc + (k0 + k) * hd + d0 + c * DET_VL, o[k][c]);
}
#endif

static void weigh_values(const float *restrict e, int64_t width, int64_t group, int64_t a, int64_t b,
                         const det_values *src, int64_t hd, float *restrict acc) {
    const float *restrict v = src->v;
#ifdef DET_VL
    if (hd % (4 * DET_VL) == 0) {
        for (int64_t d0 = 0; d0 < hd; d0 += 4 * DET_VL)
            for (int64_t k0 = 0; k0 < group; k0 += DET_HEADS) {
                const int hn = group - k0 < DET_HEADS ? (int)(group - k0) : DET_HEADS;
                switch (hn) {                           /* a constant count: the sums stay in registers */
                case 1: weigh4(e, width, k0, 1, a, b, src, hd, d0, acc); break;
                case 2: weigh4(e, width, k0, 2, a, b, src, hd, d0, acc); break;
#if DET_HEADS >= 4
                case 3: weigh4(e, width, k0, 3, a, b, src, hd, d0, acc); break;
#endif
                default: weigh4(e, width, k0, DET_HEADS, a, b, src, hd, d0, acc); break;
                }
            }
        return;
    }
#endif
    for (int64_t k = 0; k < group; k++) {
        float *o = acc + k * hd;
        for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
        for (int64_t j = a; j <= b; j++) {
            const float w = e[k * width + j];
            for (int64_t d = 0; d < hd; d++) o[d] = o[d] + w * v[(j - a) * hd + d];
        }
    }
}

/* The scores of the group's heads (queries q [group][hd]) against `tiles` tiles of transposed keys: head k's into
 * e + k * width, as `scores` gives them; with vectors, up to four heads at once share each load of the keys. */
#ifdef DET_VL
#define DET_SCORE_HEADS 4
/* Two vectors of keys (AVX-512: two tiles, t and t2; AVX2: both halves of tile t) for hn heads from k0. */
static inline __attribute__((always_inline)) void scores2(const float *restrict q, int64_t k0, int hn,
                                                         const float *restrict kt, int64_t hd, int64_t t, int64_t t2,
                                                         int store2, float *restrict e, int64_t width) {
    const int64_t step = hd * DET_TILE;
#if DET_VL == 16
    const float *ka = kt + t * step, *kb = kt + t2 * step;
    float *ea = e + t * DET_TILE, *eb = e + t2 * DET_TILE;
#else
    (void)t2;
    const float *ka = kt + t * step, *kb = ka + 8;
    float *ea = e + t * DET_TILE, *eb = ea + 8;
#endif
    det_vec o[DET_SCORE_HEADS][2];
    for (int k = 0; k < DET_SCORE_HEADS; k++) o[k][0] = o[k][1] = det_zero();
    for (int64_t d = 0; d < hd; d++) {
        const det_vec va = det_load(ka + d * DET_TILE), vb = det_load(kb + d * DET_TILE);
        for (int k = 0; k < DET_SCORE_HEADS; k++) {
            if (k >= hn) break;
            const det_vec qd = det_set1(q[(k0 + k) * hd + d]);
            o[k][0] = det_add(o[k][0], det_mul(qd, va));
            o[k][1] = det_add(o[k][1], det_mul(qd, vb));
        }
    }
    for (int k = 0; k < hn; k++) {
        det_store(ea + (k0 + k) * width, o[k][0]);
        if (store2) det_store(eb + (k0 + k) * width, o[k][1]);
    }
}

static inline __attribute__((always_inline)) void scores_heads(const float *restrict q, int64_t k0, int hn,
                                                              const float *restrict kt, int64_t hd, int64_t tiles,
                                                              float *restrict e, int64_t width) {
#if DET_VL == 16
    int64_t t = 0;
    for (; t + 2 <= tiles; t += 2) scores2(q, k0, hn, kt, hd, t, t + 1, 1, e, width);
    if (t < tiles) scores2(q, k0, hn, kt, hd, t, t, 0, e, width);      /* the last tile twice, stored once */
#else
    for (int64_t t = 0; t < tiles; t++) scores2(q, k0, hn, kt, hd, t, t, 1, e, width);
#endif
}
#endif

static void scores_group(const float *restrict q, int64_t group, const float *restrict kt, int64_t hd, int64_t tiles,
                         float *restrict e, int64_t width) {
#ifdef DET_VL
    for (int64_t k0 = 0; k0 < group; k0 += DET_SCORE_HEADS) {
        switch (group - k0 < DET_SCORE_HEADS ? group - k0 : DET_SCORE_HEADS) {   /* a constant count of heads */
        case 1: scores_heads(q, k0, 1, kt, hd, tiles, e, width); break;
        case 2: scores_heads(q, k0, 2, kt, hd, tiles, e, width); break;
        case 3: scores_heads(q, k0, 3, kt, hd, tiles, e, width); break;
        default: scores_heads(q, k0, DET_SCORE_HEADS, kt, hd, tiles, e, width); break;
        }
    }
#else
    for (int64_t k = 0; k < group; k++) scores(q + k * hd, kt, hd, tiles, e + k * width);
#endif
}

typedef struct {
    const float *q;                          /* [T, nh, hd] */
    const void *k, *v;                       /* [num_blocks, block_size, nkv, hd] */
    int kv_type;
    const int64_t *tables;                   /* [num_tables, table_width] */
    int64_t table_width;
    const int64_t *seg;                      /* [num_segs, 4]: table row, first row of T, rows, first row's position */
    int64_t num_segs, nh, nkv, hd, block_size, window;
    float softcap;
    const float *sinks;                      /* [nh] or NULL */
    float *out;                              /* [T, nh, hd] */
    int64_t max_keys, max_rows;              /* over the segments: keys an item reads, rows it has */
    _Atomic int64_t next;                    /* the next item to take */
    _Atomic int failed;
} det_job;

/* A pool thread's buffer `which`, grown as needed (never freed: one each per thread). */
static float *thread_buffer(int which, int64_t floats) {
    static __thread float *buf[5] = {NULL, NULL, NULL, NULL, NULL};
    static __thread int64_t size[5] = {0, 0, 0, 0, 0};
    if (floats > size[which]) {
        free(buf[which]);
        buf[which] = aligned_alloc(64, (size_t)((floats + 15) / 16 * 16) * sizeof(float));
        size[which] = buf[which] == NULL ? 0 : floats;
    }
    return buf[which];
}

static inline int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* One item: segment s's rows, KV head g's query heads. */
static void det_item(const det_job *jb, int64_t s, int64_t g, float *restrict kt, float *restrict vw,
                     float *restrict sc, float *restrict acc, float *restrict rb) {
    const int64_t *seg = jb->seg + 4 * s;
    const int64_t *table = jb->tables + seg[0] * jb->table_width;
    const int64_t row0 = seg[1], rows = seg[2], pos0 = seg[3];
    const int64_t hd = jb->hd, nkv = jb->nkv, nh = jb->nh, group = nh / nkv, bs = jb->block_size;
    const int64_t lo = first_key(pos0, jb->window), hi = pos0 + rows;        /* the keys any row sees */
    const int64_t t0 = lo / DET_TILE, t1 = (hi + DET_TILE - 1) / DET_TILE;
    const int64_t row_bytes = hd * (jb->kv_type == 0 ? 4 : 2);
#if defined(DET_VL) && defined(DET_DIRECT)
    const int direct = rows == 1 && hd % (4 * DET_VL) == 0;     /* one row reads each value once: no widening */
#else
    const int direct = 0;
#endif
    int64_t *vat = (int64_t *)vw;                                /* direct: the values' rows, from key lo */
    for (int64_t t = t0; t < t1; t++) {
        int64_t at[DET_TILE];                                                /* each key's row; -1: no row sees it */
        for (int l = 0; l < DET_TILE; l++) {
            const int64_t j = t * DET_TILE + l;
            at[l] = j < lo || j >= hi ? -1 : ((table[j / bs] * bs + j % bs) * nkv + g) * hd;
            if (at[l] >= 0 && j + DET_PREFETCH < hi) {
                const int64_t ahead = j + DET_PREFETCH;
                const int64_t next = ((table[ahead / bs] * bs + ahead % bs) * nkv + g) * row_bytes;
                for (int64_t byte = 0; byte < row_bytes; byte += 64) {
                    __builtin_prefetch((const char *)jb->k + next + byte);
                    __builtin_prefetch((const char *)jb->v + next + byte);
                }
            }
            if (at[l] >= 0 && direct)
                vat[j - lo] = at[l];
            else if (at[l] >= 0)
                widen_row(jb->v, jb->kv_type, at[l], hd, vw + (j - lo) * hd);
        }
#ifdef DET_DIRECT
        if (hd % 8 == 0) {
            transpose_tile_direct(jb->k, jb->kv_type, at, hd, kt + (t - t0) * hd * DET_TILE);
            continue;
        }
#endif
        for (int l = 0; l < DET_TILE; l++) {
            if (at[l] < 0) memset(rb + l * hd, 0, (size_t)hd * sizeof(float));
            else widen_row(jb->k, jb->kv_type, at[l], hd, rb + l * hd);
        }
        transpose_tile(rb, hd, kt + (t - t0) * hd * DET_TILE);
    }
    for (int64_t i = 0; i < rows; i++) {
        const int64_t pos = pos0 + i, f = first_key(pos, jb->window);
        const int64_t tf = f / DET_TILE, tl = pos / DET_TILE, width = (tl - tf + 1) * DET_TILE;
        float sums[DET_MAX_GROUP];
        scores_group(jb->q + ((row0 + i) * nh + g * group) * hd, group, kt + (tf - t0) * hd * DET_TILE, hd,
                     tl - tf + 1, sc, width);
        for (int64_t k = 0; k < group; k++) {
            const int64_t h = g * group + k;
            float *e = sc + k * width;                                       /* e[(t - tf) * 16 + lane] */
            const int64_t a = f - tf * DET_TILE, b = pos - tf * DET_TILE;   /* the visible lanes: a .. b */
            if (jb->softcap > 0.0f) softcap_scores(e + a, b - a + 1, jb->softcap);
            for (int64_t j = 0; j < a; j++) e[j] = -INFINITY;                /* lanes out of sight: no max */
            for (int64_t j = b + 1; j < width; j++) e[j] = -INFINITY;
            float mx[DET_TILE];                                              /* the max (exact in any order) */
            for (int l = 0; l < DET_TILE; l++) mx[l] = -INFINITY;
            for (int64_t t = 0; t <= tl - tf; t++)
                for (int l = 0; l < DET_TILE; l++) mx[l] = e[t * DET_TILE + l] > mx[l] ? e[t * DET_TILE + l] : mx[l];
            float m = mx[0];
            for (int l = 1; l < DET_TILE; l++) m = mx[l] > m ? mx[l] : m;
            if (jb->sinks != NULL && jb->sinks[h] > m) m = jb->sinks[h];
            for (int64_t j = 0; j < a; j++) e[j] = m;       /* out of sight: det_exp(0), not a slow subnormal */
            for (int64_t j = b + 1; j < width; j++) e[j] = m;
            for (int64_t t = 0; t <= tl - tf; t++) tile_exps(e + t * DET_TILE, m);
            for (int64_t j = 0; j < a; j++) e[j] = 0.0f;                     /* lanes out of sight weigh nothing */
            for (int64_t j = b + 1; j < width; j++) e[j] = 0.0f;
            float p[DET_TILE] = {0};
            for (int64_t t = 0; t <= tl - tf; t++)                           /* + 0 changes no partial */
                for (int l = 0; l < DET_TILE; l++) p[l] = p[l] + e[t * DET_TILE + l];
            float sum = tree16(p);
            if (jb->sinks != NULL) sum = sum + det_exp(jb->sinks[h] - m);
            sums[k] = sum;
        }
        const det_values src = {vw + (f - lo) * hd, direct ? jb->v : NULL, jb->kv_type, vat + (f - lo)};
        weigh_values(sc, width, group, f - tf * DET_TILE, pos - tf * DET_TILE, &src, hd, acc);
        for (int64_t k = 0; k < group; k++) {
            float *dst = jb->out + ((row0 + i) * nh + g * group + k) * hd;
            for (int64_t d = 0; d < hd; d++) dst[d] = acc[k * hd + d] / sums[k];
        }
    }
}

static void det_part(const void *ctx, int index, int count) {
    (void)index;
    (void)count;
    det_job *jb = (det_job *)ctx;
    const int64_t items = jb->num_segs * jb->nkv, group = jb->nh / jb->nkv;
    const int64_t tiles = (jb->max_keys + 2 * DET_TILE) / DET_TILE;
    float *kt = thread_buffer(0, tiles * DET_TILE * jb->hd);
    float *vw = thread_buffer(1, jb->max_keys * jb->hd);
    float *sc = thread_buffer(2, group * tiles * DET_TILE);
    float *acc = thread_buffer(3, group * jb->hd);
    float *rb = thread_buffer(4, DET_TILE * jb->hd);
    if (kt == NULL || vw == NULL || sc == NULL || acc == NULL || rb == NULL) {
        atomic_store(&jb->failed, 1);
        return;
    }
    for (int64_t it; (it = atomic_fetch_add(&jb->next, 1)) < items;)
        det_item(jb, it / jb->nkv, it % jb->nkv, kt, vw, sc, acc, rb);
}

/* Attention of the segments' rows into out, by the definition above. seg [num_segs, 4]: each segment's block-table
 * row, first row of q/out, number of rows (consecutive positions) and first row's position. window 0: none; softcap
 * 0: none; sinks NULL: none. Returns 0; -1 for a group or head_dim beyond the limits or an unknown kv_type; -2 when
 * a thread found no memory for its buffers. */
int forge_det_attention(const float *q, const void *k, const void *v, int kv_type, const int64_t *tables,
                        int64_t table_width, const int64_t *seg, int64_t num_segs, int64_t nh, int64_t nkv,
                        int64_t hd, int64_t block_size, int64_t window, float softcap, const float *sinks,
                        float *out, int parallel) {
    if (nkv < 1 || nh % nkv || nh / nkv > DET_MAX_GROUP || hd > DET_MAX_HEAD_DIM || kv_type < 0 || kv_type > 2)
        return -1;
    int64_t max_keys = 1, max_rows = 1;
    for (int64_t s = 0; s < num_segs; s++) {
        const int64_t lo = first_key(seg[4 * s + 3], window), hi = seg[4 * s + 3] + seg[4 * s + 2];
        max_keys = hi - lo > max_keys ? hi - lo : max_keys;
        max_rows = seg[4 * s + 2] > max_rows ? seg[4 * s + 2] : max_rows;
    }
    det_job jb = {q, k, v, kv_type, tables, table_width, seg, num_segs, nh, nkv, hd, block_size, window, softcap,
                  sinks, out, max_keys, max_rows, 0, 0};
    forge_run_parallel(det_part, &jb, parallel && num_segs * nkv > 1);
    return atomic_load(&jb.failed) ? -2 : 0;
}
