/* Fused paged attention for decode rows: one query token per sequence, read through its block table.
 *
 * For each sequence and each KV head: the scores of the group's query heads against every key of
 * the context (read in place from the paged cache, no gather), a softmax, and the weighted sum of
 * the values, in one pass over the sequence's blocks; a head's attention sink (gpt-oss), when given, joins
 * its softmax's max and sum. The cache may hold float32, float16,
 * bfloat16 (raw uint16 bits) or int8 with a float16 scale per 32 values (kv16.h); every value is
 * widened to float32 as it is read, and all arithmetic is float32. The dot products keep 16 partial sums (vectorised). With AVX-512 (heads a multiple
 * of 16, no soft-capping) the keys go sixteen at a time: each query's sixteen vectors of partial
 * sums are added across lanes together (sum16x16) into sixteen scores; for heads of 64 and groups
 * of up to 4, or of 128 and groups of up to 2, the outputs stay in registers while the values
 * stream past (weigh_values). Sequences of many KV heads with one query head each (MHA: the
 * 1.7B and 7B shapes) go position by position on every CPU (decode_heads_): all heads' keys of a
 * position lie side by side in its row, so one contiguous read serves every head, where head by
 * head reads a short stretch of each row, rows a page apart; with AVX-512, sixteen positions at a
 * time. Each head's arithmetic is the same in either order, so the bits are too.
 * Chunks of a few rows (a decode row with its guesses, up to forge.models.llama.attention's
 * MAX_DECODE_KERNEL_ROWS) come here row by row; longer ones go to prefill_attention.c.
 *
 * The body below is compiled once per storage type: this file includes itself with KV_NAME,
 * KV_T, KV_ROW and KV_CODE defined (paged_decode_attention_f32, _f16, _bf16, _i8); compile it by its absolute
 * path, as forge.kernels.compiled does, so that __FILE__ names it from anywhere.
 *
 * Built by forge.kernels.compiled with the host's compiler (-O3 -march=native); called through
 * ctypes, which releases the GIL, so the engine's pool threads run parts of a step at once.
 * forge.models.llama.attention's numpy decode path is the reference it is tested against.
 */
#ifndef KV_NAME
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif

#include "dot.h"
#include "pool.h"            /* the library's threads: forge_run_parallel */

#define MAX_GROUP 64
#define MAX_HEAD_DIM 256
/* From this many KV heads (one query head each) a sequence's heads go position by position
 * (decode_heads_); fewer heads make rows short enough that head by head reads them as well. Set by
 * forge_decode_by_position (the tests compare both orders bit for bit; ab_kernels.py times them). */
static int64_t many_heads = 8;

/* Sequences with at least `heads` KV heads (one query head each) decode position by position; returns
 * the previous threshold. A huge value keeps every sequence head by head. */
int64_t forge_decode_by_position(int64_t heads) {
    const int64_t before = many_heads;
    many_heads = heads;
    return before;
}

/* A pool thread's scratch buffer `which` (0: decode_part_'s scores, 1: decode_heads_'), grown as needed
 * (never freed: one each per thread). */
static float *scratch_buffer(int which, int64_t floats) {
    static __thread float *buf[2] = {NULL, NULL};
    static __thread int64_t size[2] = {0, 0};
    if (floats > size[which]) {
        free(buf[which]);
        buf[which] = malloc((size_t)floats * sizeof(float));
        size[which] = buf[which] == NULL ? 0 : floats;
    }
    return buf[which];
}

/* A query head's attention sink (gpt-oss: a learned logit per head that joins the softmax's denominator
 * and weighs no value; sinks NULL: none): it joins the head's max before the exponentials, and its
 * exponential over that max joins the sum. */
static inline float sink_max(const float *sinks, int64_t head, float max) {
    return sinks != NULL && sinks[head] > max ? sinks[head] : max;
}

static inline float sink_weight(const float *sinks, int64_t head, float max) {
    return sinks != NULL ? expf(sinks[head] - max) : 0.0f;
}

/* One K or V row widened to float32 (written as bits for bfloat16: a union may pun types in C). */
typedef union { float f[MAX_HEAD_DIM]; uint32_t u[MAX_HEAD_DIM]; } row_buffer;

#include "kv16.h"
#if defined(__AVX512F__)

/* The offsets of keys p .. p + 15 of one head (at `head` in a position's row of kv_stride values):
 * one table lookup when they share a block (block sizes of 16 and more, p a multiple of 16). */
static inline void keys16(const int64_t *table, int64_t p, int64_t block_size, int64_t kv_stride, int64_t head,
                          int64_t at[16]) {
    if (block_size % 16 == 0 && p % 16 == 0) {
        const int64_t first = slot_of(table, p, block_size) * kv_stride + head;
        for (int e = 0; e < 16; e++)
            at[e] = first + e * kv_stride;
        return;
    }
    for (int e = 0; e < 16; e++)
        at[e] = slot_of(table, p + e, block_size) * kv_stride + head;
}

/* Values this many keys ahead are prefetched while weighing the current one. */
#define VALUES_AHEAD 16

/* Ask for the cache lines of a K or V row (`bytes` bytes from element `at` of `base`, elements of
 * `itemsize` bytes) before they are read: one head's rows lie a whole position's width apart (nkv x
 * hd values: 8 KiB for 32 heads of 64 in float32), each on its own page, where the hardware
 * prefetchers do not follow; without this the decode of many heads waits on miss after miss. */
static inline void prefetch_row(const void *base, int64_t at, int itemsize, int64_t bytes) {
    const char *row = (const char *)base + at * itemsize;
    for (int64_t off = 0; off < bytes; off += 64)
        _mm_prefetch(row + off, _MM_HINT_T0);
    _mm_prefetch(row + bytes - 1, _MM_HINT_T0);
}

/* v[i]'s 16 lanes summed, for i < 16: lane i of the result (in order). */
static inline __m512 sum16x16(__m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* b[i]'s 128-bit lane L: lane L's partial sums of v[4i .. 4i + 3] */
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

/* The scores of `group` query vectors qg [group][hd] against the 16 keys at offsets at[0..15] of
 * the cache: scores[j * stride + e] for key e. hd a multiple of 16, at most 256. */
static inline void scores16(const float *restrict qg, int64_t group, int64_t hd, const void *k,
                            const uint16_t *ks, const int64_t *at, int kv_type, float *restrict scores,
                            int64_t stride) {
    for (int64_t j = 0; j < group; j++) {
        const float *qj = qg + j * hd;
        __m512 acc[16];
        for (int e = 0; e < 16; e++)
            acc[e] = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d += 16) {
            const __m512 qd = _mm512_loadu_ps(qj + d);
            for (int e = 0; e < 16; e++)
                acc[e] = _mm512_fmadd_ps(qd, load16_kv(k, ks, at[e] + d, kv_type), acc[e]);
        }
        _mm512_storeu_ps(scores + j * stride, sum16x16(acc));
    }
}

/* scores16 against keys of a half-width or int8 cache (kv_type), each of the 16 widened once into
 * `tile` (L1, 16 x hd floats) rather than once per query vector of the group: for int8 that is a
 * scale, two conversions and a multiply per 16 values. The same values, so the same scores. */
static inline void scores16_widened(const float *restrict qg, int64_t group, int64_t hd, const void *k,
                                    const uint16_t *ks, const int64_t *at, int kv_type, float *restrict tile,
                                    float *restrict scores, int64_t stride) {
    int64_t local[16];
    for (int e = 0; e < 16; e++) {
        for (int64_t d = 0; d < hd; d += 16)
            _mm512_store_ps(tile + e * hd + d, load16_kv(k, ks, at[e] + d, kv_type));
        local[e] = e * hd;
    }
    scores16(qg, group, hd, tile, NULL, local, 0, scores, stride);
}

/* og[j] = sum over keys p of w[j * stride + p] * V[p] / sums[j], for `group` query vectors and
 * heads of 16 nv floats: nv 4 (heads of 64) with groups of up to 4, nv 8 (heads of 128) with up to
 * 2. The 16 vectors of outputs are held in registers while the values stream past once (inlined
 * with nv a constant, the loops unroll). */
static inline __attribute__((always_inline)) void weigh_values(int nv, const void *v, const uint16_t *vs,
                                                               const int64_t *table,
                                                               int64_t block_size, int64_t kv_stride, int64_t head,
                                                               int64_t first, int64_t len, const float *w,
                                                               int64_t stride, int64_t group, int kv_type,
                                                               const float *sums, float *og) {
    const int max_group = 16 / nv;
    __m512 o[16];
    for (int i = 0; i < 16; i++)
        o[i] = _mm512_setzero_ps();
    const int itemsize = kv_type == 0 ? 4 : kv_type == 3 ? 1 : 2;
    for (int64_t p = first; p < len; p++) {
        const int64_t at = slot_of(table, p, block_size) * kv_stride + head;
        if (p + VALUES_AHEAD < len)
            prefetch_row(v, slot_of(table, p + VALUES_AHEAD, block_size) * kv_stride + head, itemsize,
                         16 * nv * itemsize);
        __m512 vz[8];
        for (int z = 0; z < nv; z++)
            vz[z] = load16_kv(v, vs, at + 16 * z, kv_type);
        for (int j = 0; j < max_group; j++) {
            if (j >= group)
                break;
            const __m512 wj = _mm512_set1_ps(w[j * stride + p]);
            for (int z = 0; z < nv; z++)
                o[j * nv + z] = _mm512_fmadd_ps(wj, vz[z], o[j * nv + z]);
        }
    }
    for (int j = 0; j < max_group && j < group; j++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[j]);
        for (int z = 0; z < nv; z++)
            _mm512_storeu_ps(og + (j * nv + z) * 16, _mm512_mul_ps(o[j * nv + z], inv));
    }
}
#endif

/* A row of the cache as float32: the row itself for a float32 cache, else widened into `buf` by a
 * plain loop the compiler vectorises (per element inside the dot products, it did not). */
#define KV_CODE 0
#define KV_NAME f32
#define KV_T float
#define KV_ROW(base, scales, at, buf, n) ((base) + (at))
#include __FILE__
#undef KV_NAME
#undef KV_T
#undef KV_ROW
#undef KV_CODE

/* float16 as raw bits: the compiler does not vectorise _Float16 -> float conversions (gcc 12), so
 * with F16C (every AVX2 CPU) eight at a time by its instruction, else one by one. */
static inline const float *widen_f16(const uint16_t *restrict src, row_buffer *restrict buf, int64_t n) {
    int64_t d = 0;
#ifdef __F16C__
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(buf->f + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
    for (; d < n; d++) {
        _Float16 h;
        memcpy(&h, src + d, sizeof h);
        buf->f[d] = (float)h;
    }
    return buf->f;
}
#define KV_CODE 1
#define KV_NAME f16
#define KV_T uint16_t
#define KV_ROW(base, scales, at, buf, n) widen_f16((base) + (at), (buf), (n))
#include __FILE__
#undef KV_NAME
#undef KV_T
#undef KV_ROW
#undef KV_CODE

static inline const float *widen_bf16(const uint16_t *restrict src, row_buffer *restrict buf, int64_t n) {
    for (int64_t d = 0; d < n; d++)
        buf->u[d] = (uint32_t)src[d] << 16;
    return buf->f;
}
#define KV_CODE 2
#define KV_NAME bf16
#define KV_T uint16_t
#define KV_ROW(base, scales, at, buf, n) widen_bf16((base) + (at), (buf), (n))
#include __FILE__
#undef KV_NAME
#undef KV_T
#undef KV_ROW
#undef KV_CODE

/* int8 with a scale per 32 values (kv16.h); a head's row starts a group (hd a multiple of 32). */
static inline const float *widen_i8(const int8_t *restrict src, const uint16_t *scales, int64_t at,
                                    row_buffer *restrict buf, int64_t n) {
    for (int64_t d0 = 0; d0 < n; d0 += KV_INT8_GROUP) {
        const float scale = kv_scale(scales, at + d0);
        for (int64_t d = d0; d < d0 + KV_INT8_GROUP && d < n; d++)
            buf->f[d] = (float)src[at + d] * scale;
    }
    return buf->f;
}
#define KV_CODE 3
#define KV_NAME i8
#define KV_T int8_t
#define KV_ROW(base, scales, at, buf, n) widen_i8((base), (scales), (at), (buf), (n))
#include __FILE__

#else  /* the body, once per storage type */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)


/* q:            [T, nh, hd]  scaled queries of the step's rows
 * k, v:         [num_blocks, block_size, nkv, hd]  one layer's cache
 * k_scales, v_scales: [num_blocks, block_size, nkv, hd / 32]  their scales (int8 only; else unused)
 * rows:         [S]  the row of T of each decode sequence
 * block_tables: [S, table_width]  block ids, the first ceil(len / block_size) valid
 * context_lens: [S]  keys each sequence sees (its position + 1)
 * first_keys:   [S]  the first key each sequence sees (its sliding window's start), or NULL: 0
 * softcap:      scores become softcap * tanh(score / softcap) before the softmax (Gemma 2); 0: none
 * sinks:        [nh]  each query head's attention sink, a logit in its softmax's denominator only
 *               (gpt-oss), or NULL: none
 * scores:       scratch of at least group * max(context_lens) floats
 * out:          [T, nh, hd]  rows[...] written
 * Returns 0, or -1 when a group exceeds MAX_GROUP or hd MAX_HEAD_DIM (the caller refuses). */
#if defined(__AVX512F__)
/* KV heads [g0, g1) of one sequence and their `group` query heads each, position by position (MHA:
 * 32 KV heads of 64 in the 1.7B and 7B shapes; GQA: the default model's 3 KV heads of 3 query heads):
 * for each block of 16 keys, every query head's 16 scores, then each one's outputs weighed from the
 * same 16 values. A position's row holds all KV heads side by side (nkv x hd values: 4 KiB in float16
 * for the 1.7B, 384 bytes for the default model), so the heads of 16 positions read one contiguous
 * stretch of the block, where taking each head over all its keys in turn (decode_pairs_) reads hd
 * values a position and waits on the memory. With GQA and a half-width cache each key and value is
 * widened once for its group's query heads (scores16_widened; the values' outputs in registers). The
 * same arithmetic in the same order as decode_pairs_, so the same results. hd a multiple of 16, at
 * most MAX_HEAD_DIM; no soft-capping. Returns 0, or -2 with no memory. */
static int CAT(decode_heads_, KV_NAME)(const float *restrict q, const KV_T *restrict k, const KV_T *restrict v,
                                       const uint16_t *k_scales, const uint16_t *v_scales, int64_t row,
                                       const int64_t *table, int64_t first, int64_t len, int64_t g0, int64_t g1,
                                       int64_t nh, int64_t nkv, int64_t hd, int64_t block_size,
                                       const float *sinks, float *restrict out) {
    const int64_t group = nh / nkv, heads = (g1 - g0) * group;      /* query heads, g0 * group on */
    const int64_t kv_stride = nkv * hd, nv = hd / 16, span = len - first;
    float *scores = scratch_buffer(1, heads * span + heads * hd);      /* [heads, span], then [heads, hd] */
    if (scores == NULL)
        return -2;
    float *o = scores + heads * span;
    float maxes[MAX_GROUP * 4], sums[MAX_GROUP * 4];
    if (heads > MAX_GROUP * 4)
        return -2;
    for (int64_t h = 0; h < heads; h++)
        maxes[h] = -INFINITY;
    const float *qs = q + (row * nh + g0 * group) * hd;               /* [heads, hd] */
    int64_t at[16], head_at[16];
    float tile[16 * MAX_HEAD_DIM] __attribute__((aligned(64)));    /* 16 keys of one head, widened */
    int64_t p = first;
    for (; p + 16 <= len; p += 16) {
        keys16(table, p, block_size, kv_stride, 0, at);
        for (int64_t g = g0; g < g1; g++) {
            for (int e = 0; e < 16; e++)
                head_at[e] = at[e] + g * hd;
            const int64_t h0 = (g - g0) * group;
            float *sh = scores + h0 * span - first;
            if (KV_CODE == 0 || group == 1)
                scores16(qs + h0 * hd, group, hd, k, k_scales, head_at, KV_CODE, sh + p, span);
            else
                scores16_widened(qs + h0 * hd, group, hd, k, k_scales, head_at, KV_CODE, tile, sh + p, span);
            for (int64_t j = 0; j < group; j++) {
                const float m16 = _mm512_reduce_max_ps(_mm512_loadu_ps(sh + j * span + p));
                if (m16 > maxes[h0 + j])
                    maxes[h0 + j] = m16;
            }
        }
    }
    row_buffer buf;
    for (; p < len; p++) {
        const int64_t base = slot_of(table, p, block_size) * kv_stride;
        for (int64_t g = g0; g < g1; g++) {
            const float *kp = KV_ROW(k, k_scales, base + g * hd, &buf, hd);
            for (int64_t j = 0; j < group; j++) {
                const int64_t h = (g - g0) * group + j;
                const float x = dot(qs + h * hd, kp, hd);
                scores[h * span + p - first] = x;
                if (x > maxes[h])
                    maxes[h] = x;
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * span, total = 0.0f;
        maxes[h] = sink_max(sinks, g0 * group + h, maxes[h]);
        for (int64_t i = 0; i < span; i++) {
            sh[i] = expf(sh[i] - maxes[h]);
            total += sh[i];
        }
        sums[h] = total + sink_weight(sinks, g0 * group + h, maxes[h]);
    }
    memset(o, 0, (size_t)(heads * hd) * sizeof(float));
    for (p = first; p < len; p += 16) {
        const int n = len - p < 16 ? (int)(len - p) : 16;
        if (n == 16)
            keys16(table, p, block_size, kv_stride, 0, at);
        else
            for (int e = 0; e < n; e++)
                at[e] = slot_of(table, p + e, block_size) * kv_stride;
        if (KV_CODE != 0 && hd == 64 && group > 1 && group <= 4) {
            /* each value widened once for the group's query heads, their outputs in registers */
            for (int64_t g = g0; g < g1; g++) {
                const int64_t h0 = (g - g0) * group;
                __m512 acc[16];
                for (int j = 0; j < 4 && j < group; j++)
                    for (int z = 0; z < 4; z++)
                        acc[4 * j + z] = _mm512_loadu_ps(o + (h0 + j) * hd + 16 * z);
                for (int e = 0; e < n; e++)
                    for (int z = 0; z < 4; z++) {
                        const __m512 vz = load16_kv(v, v_scales, at[e] + g * hd + 16 * z, KV_CODE);
                        for (int j = 0; j < 4 && j < group; j++)
                            acc[4 * j + z] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(h0 + j) * span + p - first + e]),
                                                             vz, acc[4 * j + z]);
                    }
                for (int j = 0; j < 4 && j < group; j++)
                    for (int z = 0; z < 4; z++)
                        _mm512_storeu_ps(o + (h0 + j) * hd + 16 * z, acc[4 * j + z]);
            }
            continue;
        }
        for (int64_t h = 0; h < heads; h++) {
            const int64_t g = g0 + h / group;
            const float *wh = scores + h * span - first;
            __m512 acc[MAX_HEAD_DIM / 16];
            for (int64_t z = 0; z < nv; z++)
                acc[z] = _mm512_loadu_ps(o + h * hd + 16 * z);
            for (int e = 0; e < n; e++) {
                const __m512 w = _mm512_set1_ps(wh[p + e]);
                for (int64_t z = 0; z < nv; z++)
                    acc[z] = _mm512_fmadd_ps(w, load16_kv(v, v_scales, at[e] + g * hd + 16 * z, KV_CODE), acc[z]);
            }
            for (int64_t z = 0; z < nv; z++)
                _mm512_storeu_ps(o + h * hd + 16 * z, acc[z]);
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sums[h]);
        float *oh = out + (row * nh + g0 * group + h) * hd;
        for (int64_t z = 0; z < nv; z++)
            _mm512_storeu_ps(oh + 16 * z, _mm512_mul_ps(_mm512_loadu_ps(o + h * hd + 16 * z), inv));
    }
    return 0;
}
#else
/* Heads [g0, g1) of one sequence with one query head per KV head (MHA), position by position, for
 * CPUs without AVX-512: for each key, every head's score; then for each value, every head's output.
 * A position's row holds all heads side by side (nkv x hd values), so this reads one contiguous
 * stretch per position, where head by head (decode_pairs_) reads hd values a row, a page apart, and
 * waits on the memory (1.7B shapes, AVX2 host: the step's attention at 1,000 keys 103 ms of 215).
 * Each head's arithmetic is decode_pairs_' in the same order (its dot, expf and sums), so the same
 * bits. Returns 0, or -2 with no memory. */
static int CAT(decode_heads_, KV_NAME)(const float *restrict q, const KV_T *restrict k, const KV_T *restrict v,
                                       const uint16_t *k_scales, const uint16_t *v_scales, int64_t row,
                                       const int64_t *table, int64_t first, int64_t len, int64_t g0, int64_t g1,
                                       int64_t nh, int64_t nkv, int64_t hd, int64_t block_size, float softcap,
                                       const float *sinks, float *restrict out) {
    const int64_t heads = g1 - g0, kv_stride = nkv * hd, span = len - first;
    float *scores = scratch_buffer(1, heads * span);                   /* [heads, span] */
    if (scores == NULL)
        return -2;
    float maxes[MAX_GROUP * 4], sums[MAX_GROUP * 4];
    row_buffer buf;
    (void)buf;                                       /* unused by the float32 kernel */
    for (int64_t h = 0; h < heads; h++)
        maxes[h] = -INFINITY;
    for (int64_t p = first; p < len; p++) {
        const int64_t base = slot_of(table, p, block_size) * kv_stride;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t g = g0 + h;
            float x = dot(q + (row * nh + g) * hd, KV_ROW(k, k_scales, base + g * hd, &buf, hd), hd);
            if (softcap > 0.0f)
                x = softcap * tanhf(x / softcap);
            scores[h * span + p - first] = x;
            if (x > maxes[h])
                maxes[h] = x;
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *sh = scores + h * span, total = 0.0f;
        maxes[h] = sink_max(sinks, g0 + h, maxes[h]);
        for (int64_t i = 0; i < span; i++) {
            sh[i] = expf(sh[i] - maxes[h]);
            total += sh[i];
        }
        sums[h] = total + sink_weight(sinks, g0 + h, maxes[h]);
    }
    float *og = out + (row * nh + g0) * hd;          /* [heads, hd]: the heads are adjacent */
    memset(og, 0, (size_t)(heads * hd) * sizeof(float));
    for (int64_t p = first; p < len; p++) {
        const int64_t base = slot_of(table, p, block_size) * kv_stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *vp = KV_ROW(v, v_scales, base + (g0 + h) * hd, &buf, hd);
            const float w = scores[h * span + p - first];
            float *o = og + h * hd;
            for (int64_t d = 0; d < hd; d++)
                o[d] += w * vp[d];
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = 1.0f / sums[h];
        for (int64_t d = 0; d < hd; d++)
            og[h * hd + d] *= inv;
    }
    return 0;
}
#endif

/* Pairs [i0, i1) of (sequence s, KV head g), pair i = s * nkv + g. */
static int CAT(decode_pairs_, KV_NAME)(const float *restrict q, const KV_T *restrict k, const KV_T *restrict v,
                           const uint16_t *k_scales, const uint16_t *v_scales, const int64_t *restrict rows, const int64_t *restrict block_tables,
                           int64_t table_width, const int64_t *restrict context_lens,
                           const int64_t *restrict first_keys, int64_t i0, int64_t i1,
                           int64_t nh, int64_t nkv, int64_t hd, int64_t block_size, float softcap,
                           const float *sinks, float *restrict scores, float *restrict out) {
    const int64_t group = nh / nkv;
    row_buffer buf;
    (void)buf;                                       /* unused by the float32 kernel */
#if defined(__AVX512F__)
    float tile[16 * MAX_HEAD_DIM] __attribute__((aligned(64)));   /* 16 keys widened (not for float32) */
#endif
    const int64_t kv_stride = nkv * hd;              /* floats between two positions of a block */
    for (int64_t i = i0; i < i1; i++) {
        const int64_t s = i / nkv, g = i % nkv;
        const int64_t row = rows[s], len = context_lens[s], first = first_keys ? first_keys[s] : 0;
        const int64_t *table = block_tables + s * table_width;
#if defined(__AVX512F__)
        /* GQA's rows are short (the default model's 3 KV heads: 384 bytes in float16): position by
         * position only where this part holds all of a sequence's heads, or the parts would each read
         * every row for a share of it (one sequence on two threads: slower than head by head) */
        if (nh >= many_heads && nh <= MAX_GROUP * 4 && hd % 16 == 0 && softcap <= 0.0f &&
            (group == 1 || (g == 0 && (s + 1) * nkv <= i1))) {
            const int64_t end = (s + 1) * nkv < i1 ? (s + 1) * nkv : i1;  /* this sequence's heads in range */
            if (CAT(decode_heads_, KV_NAME)(q, k, v, k_scales, v_scales, row, table, first, len, g, g + end - i,
                                            nh, nkv, hd, block_size, sinks, out) != 0)
                return -2;
            i = end - 1;
            continue;
        }
#else
        if (group == 1 && nkv >= many_heads) {
            const int64_t end = (s + 1) * nkv < i1 ? (s + 1) * nkv : i1;  /* this sequence's heads in range */
            if (end - i <= MAX_GROUP * 4) {
                if (CAT(decode_heads_, KV_NAME)(q, k, v, k_scales, v_scales, row, table, first, len, g, g + end - i,
                                                nh, nkv, hd, block_size, softcap, sinks, out) != 0)
                    return -2;
                i = end - 1;
                continue;
            }
        }
#endif
        {
            const float *qg = q + (row * nh + g * group) * hd;      /* [group, hd] */
            float maxes[MAX_GROUP], sums[MAX_GROUP];
            for (int64_t j = 0; j < group; j++)
                maxes[j] = -INFINITY;
            int64_t p = first;
#if defined(__AVX512F__)
            /* 16 keys at a time: each query's 16 dot products as vectors of partial sums, added
             * across lanes together (a scalar sum per dot product cost more than the products) */
            int64_t at[16], next[16];               /* this block of 16 keys' offsets, and the next's */
            if (hd % 16 == 0 && softcap <= 0.0f && p + 16 <= len)
                keys16(table, p, block_size, kv_stride, g * hd, next);
            if (hd % 16 == 0 && softcap <= 0.0f)
                for (; p + 16 <= len; p += 16) {
                    memcpy(at, next, sizeof at);
                    if (p + 32 <= len) {     /* the next 16 keys' rows on their way (see prefetch_row) */
                        keys16(table, p + 16, block_size, kv_stride, g * hd, next);
                        for (int e = 0; e < 16; e++)
                            prefetch_row(k, next[e], (int)sizeof(KV_T), hd * (int64_t)sizeof(KV_T));
                    }
                    if (KV_CODE == 0 || group == 1)
                        scores16(qg, group, hd, k, k_scales, at, KV_CODE, scores + p, len);
                    else
                        scores16_widened(qg, group, hd, k, k_scales, at, KV_CODE, tile, scores + p, len);
                    for (int64_t j = 0; j < group; j++) {
                        const float m16 = _mm512_reduce_max_ps(_mm512_loadu_ps(scores + j * len + p));
                        if (m16 > maxes[j])
                            maxes[j] = m16;
                    }
                }
#endif
            for (; p < len; p++) {
                const float *kp = KV_ROW(k, k_scales, slot_of(table, p, block_size) * kv_stride
                                         + g * hd, &buf, hd);
                for (int64_t j = 0; j < group; j++) {
                    float x = dot(qg + j * hd, kp, hd);
                    if (softcap > 0.0f)
                        x = softcap * tanhf(x / softcap);
                    scores[j * len + p] = x;
                    if (x > maxes[j])
                        maxes[j] = x;
                }
            }
            for (int64_t j = 0; j < group; j++) {
                float *sj = scores + j * len, total = 0.0f;
                maxes[j] = sink_max(sinks, g * group + j, maxes[j]);
                for (int64_t p = first; p < len; p++) {
                    sj[p] = expf(sj[p] - maxes[j]);
                    total += sj[p];
                }
                sums[j] = total + sink_weight(sinks, g * group + j, maxes[j]);
            }
            float *og = out + (row * nh + g * group) * hd;          /* [group, hd] */
#if defined(__AVX512F__)
            if (hd == 64 && group <= 4) {       /* the outputs in registers (SmolLM2, Llama-style heads) */
                weigh_values(4, v, v_scales, table, block_size, kv_stride, g * hd, first, len, scores, len, group, KV_CODE,
                             sums, og);
                continue;
            }
            if (hd == 128 && group <= 2) {
                weigh_values(8, v, v_scales, table, block_size, kv_stride, g * hd, first, len, scores, len, group, KV_CODE,
                             sums, og);
                continue;
            }
#endif
            memset(og, 0, (size_t)(group * hd) * sizeof(float));
            for (int64_t p = first; p < len; p++) {
                const float *vp = KV_ROW(v, v_scales, slot_of(table, p, block_size) * kv_stride
                                         + g * hd, &buf, hd);
                for (int64_t j = 0; j < group; j++) {
                    const float w = scores[j * len + p];
                    float *o = og + j * hd;
                    for (int64_t d = 0; d < hd; d++)
                        o[d] += w * vp[d];
                }
            }
            for (int64_t j = 0; j < group; j++) {
                const float inv = 1.0f / sums[j];
                for (int64_t d = 0; d < hd; d++)
                    og[j * hd + d] *= inv;
            }
        }
    }
    return 0;
}

int CAT(paged_decode_attention_, KV_NAME)(const float *restrict q, const KV_T *restrict k, const KV_T *restrict v,
                           const uint16_t *k_scales, const uint16_t *v_scales, const int64_t *restrict rows, const int64_t *restrict block_tables,
                           int64_t table_width, const int64_t *restrict context_lens,
                           const int64_t *restrict first_keys, int64_t num_seqs,
                           int64_t nh, int64_t nkv, int64_t hd, int64_t block_size, float softcap,
                           const float *sinks, float *restrict scores, float *restrict out) {
    if (nh / nkv > MAX_GROUP || hd > MAX_HEAD_DIM)
        return -1;
    return CAT(decode_pairs_, KV_NAME)(q, k, v, k_scales, v_scales, rows, block_tables, table_width, context_lens,
                                       first_keys, 0, num_seqs * nkv, nh, nkv, hd, block_size, softcap, sinks, scores,
                                       out);
}

typedef struct {
    const float *q;
    const KV_T *k, *v;
    const uint16_t *k_scales, *v_scales;
    const int64_t *rows, *block_tables, *context_lens, *first_keys;
    int64_t table_width, num_seqs, nh, nkv, hd, block_size, max_len;
    float softcap;
    const float *sinks;
    float *out;
    int failed;
} CAT(decode_job_, KV_NAME);

/* Thread `index` of `count`: the pairs whose keys fall in its share of all the pairs' keys. */
static void CAT(decode_part_, KV_NAME)(const void *ctx, int index, int count) {
    const CAT(decode_job_, KV_NAME) *jb = ctx;
    const int64_t pairs = jb->num_seqs * jb->nkv;
    int64_t total = 0;
    for (int64_t s = 0; s < jb->num_seqs; s++) total += jb->context_lens[s] * jb->nkv;
    const int64_t lo = total * index / count, hi = total * (index + 1) / count;
    int64_t i0 = pairs, i1 = pairs, seen = 0;
    for (int64_t i = 0; i < pairs; i++) {            /* pair i starts at key `seen` of the whole */
        if (i0 == pairs && seen >= lo) i0 = i;
        if (seen >= hi) { i1 = i; break; }
        seen += jb->context_lens[i / jb->nkv];
    }
    if (i0 >= i1) return;
    float *scores = scratch_buffer(0, jb->nh / jb->nkv * jb->max_len);
    if (scores == NULL) { ((CAT(decode_job_, KV_NAME) *)ctx)->failed = 1; return; }
    if (CAT(decode_pairs_, KV_NAME)(jb->q, jb->k, jb->v, jb->k_scales, jb->v_scales, jb->rows, jb->block_tables,
                                    jb->table_width, jb->context_lens, jb->first_keys, i0, i1, jb->nh, jb->nkv,
                                    jb->hd, jb->block_size, jb->softcap, jb->sinks, scores, jb->out) != 0)
        ((CAT(decode_job_, KV_NAME) *)ctx)->failed = 1;
}

/* paged_decode_attention on the compiled products' pool: the (sequence, KV head) pairs dealt to its
 * threads by their keys, each thread on its own scores buffer. Returns 0, -1 as above, or -2 when
 * a thread found no memory for its scores. */
int CAT(paged_decode_attention_pool_, KV_NAME)(const float *restrict q, const KV_T *restrict k,
                           const KV_T *restrict v, const uint16_t *k_scales, const uint16_t *v_scales,
                           const int64_t *restrict rows,
                           const int64_t *restrict block_tables, int64_t table_width,
                           const int64_t *restrict context_lens, const int64_t *restrict first_keys,
                           int64_t num_seqs, int64_t nh, int64_t nkv, int64_t hd, int64_t block_size,
                           float softcap, const float *sinks, float *restrict scores, float *restrict out) {
    (void)scores;
    if (nh / nkv > MAX_GROUP || hd > MAX_HEAD_DIM)
        return -1;
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; s++) max_len = context_lens[s] > max_len ? context_lens[s] : max_len;
    CAT(decode_job_, KV_NAME) jb = {q, k, v, k_scales, v_scales, rows, block_tables, context_lens, first_keys, table_width, num_seqs,
                                    nh, nkv, hd, block_size, max_len, softcap, sinks, out, 0};
    forge_run_parallel(CAT(decode_part_, KV_NAME), &jb, num_seqs * nkv > 1);
    return jb.failed ? -2 : 0;
}

#endif
