/* x @ W.T for W held in GGUF Q8_0 blocks (34 bytes: a float16 scale d, then 32 int8 q; w = d * q).
 *
 * Used for the output head, whose Q8_0 blocks forge already keeps for the token embedding: no
 * second copy of the weights. Each output row of W is widened to float32 once (d * q, exactly the
 * file's values) into a buffer that stays in L1, then dotted with every row of x; float32
 * arithmetic, dot products as in dot.h. A call computes the
 * columns [v_lo, v_hi) of out, so the engine's pool threads split the vocabulary between them.
 * forge.kernels.quant_blocks' dequantize() followed by a float64 product is the reference it is tested
 * against.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dot.h"

#define Q8_BLOCK 32
#define Q8_BYTES 34
#define MAX_K 8192

/* Widen one Q8_0 row of K values to float32 (d * q, as the file means them). */
static inline void widen_row(const uint8_t *restrict b, int64_t num_blocks, float *restrict row) {
    for (int64_t j = 0; j < num_blocks; j++, b += Q8_BYTES) {
        _Float16 h;
        memcpy(&h, b, sizeof h);
        const float d = (float)h;
        const int8_t *q = (const int8_t *)(b + 2);
        float *r = row + j * Q8_BLOCK;
        for (int i = 0; i < Q8_BLOCK; i++)
            r[i] = d * (float)q[i];
    }
}

/* out[t + a][v + c] for a, c < 4: sixteen dot products sharing their loads (4 rows of x against
 * 4 widened rows of W), in 16-lane vectors (GCC vector extensions) that stay in registers. */
typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 r;
    memcpy(&r, p, sizeof r);
    return r;
}

static inline void tile4x4(const float *restrict x, const float *restrict rows, int64_t k, int64_t v_total,
                           float *restrict out) {
    v16 acc[4][4] = {{{0}}};
    for (int64_t i = 0; i < k; i += LANES) {
        const v16 x0 = load16(x + i), x1 = load16(x + k + i), x2 = load16(x + 2 * k + i), x3 = load16(x + 3 * k + i);
        for (int c = 0; c < 4; c++) {
            const v16 w = load16(rows + c * k + i);
            acc[0][c] += x0 * w;
            acc[1][c] += x1 * w;
            acc[2][c] += x2 * w;
            acc[3][c] += x3 * w;
        }
    }
    for (int a = 0; a < 4; a++)
        for (int c = 0; c < 4; c++) {
            float s = 0.0f;
            for (int l = 0; l < LANES; l++)
                s += acc[a][c][l];
            out[a * v_total + c] = s;
        }
}

/* The direct and column paths below compute in vectors of VN floats: 16 with AVX-512, 8 with AVX2
 * (16-float vectors would spill AVX2's 16 registers: measured on an x86-64-v3 build, the column
 * path at 32 rows took 762 ms with them, 20 ms with 8-float ones; docs/benchmarks.md). Without
 * either they are off and the tiles above serve every row count. */
#if defined(__AVX512F__)
#define VN 16
#elif defined(__AVX2__)
#define VN 8
#else
#define VN 0
#endif

#if VN
typedef float vn __attribute__((vector_size(VN * sizeof(float))));

static inline vn loadn(const float *p) {
    vn r;
    memcpy(&r, p, sizeof r);
    return r;
}

/* VN int8 as VN floats in two instructions (gcc 12 turns the vector extensions' own conversion
 * into value-by-value code, 5x slower). */
static inline vn widenn(const uint8_t *p) {
#if VN == 16
    return (vn)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return (vn)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}

static inline float hsumn(vn a) {
    float s = 0.0f;
    for (int l = 0; l < VN; l++)
        s += a[l];
    return s;
}

/* Up to DIRECT_MAX_ROWS rows of x (one decoding sequence, or a few with its drafts), each row of x
 * meets 8 rows of W at a time straight from their blocks: 32 int8 values widened in 32 / VN
 * vectors, dotted with x, scaled by the block's d, into 8 independent accumulators (one per row
 * of W). Nothing is stored and read back, and no accumulator waits on another's chain. */
#define DIRECT_MAX_ROWS 8
#define DIRECT_W 8
#define PARTS (Q8_BLOCK / VN)

/* One block of one row of W (at b) dotted with the block's PARTS vectors of x, scaled by its d. */
static inline vn block_dot(const uint8_t *restrict b, const vn *restrict xs) {
    _Float16 h;
    memcpy(&h, b, sizeof h);
    vn p = widenn(b + 2) * xs[0];
    for (int part = 1; part < PARTS; part++)
        p += widenn(b + 2 + part * VN) * xs[part];
    return p * (float)h;
}

static void q8_0_matmul_direct(const float *restrict x, int64_t num_rows, int64_t k,
                               const uint8_t *restrict blocks, int64_t v_lo, int64_t v_hi, int64_t v_total,
                               float *restrict out) {
    const int64_t num_blocks = k / Q8_BLOCK, row_bytes = num_blocks * Q8_BYTES;
    int64_t v = v_lo;
    for (; v + DIRECT_W <= v_hi; v += DIRECT_W) {
        const uint8_t *w = blocks + v * row_bytes;
        for (int64_t t = 0; t < num_rows; t++) {
            const float *xt = x + t * k;
            vn acc[DIRECT_W];
            for (int c = 0; c < DIRECT_W; c++)
                acc[c] = (vn){0};
            for (int64_t j = 0; j < num_blocks; j++) {
                vn xs[PARTS];
                for (int part = 0; part < PARTS; part++)
                    xs[part] = loadn(xt + j * Q8_BLOCK + part * VN);
                for (int c = 0; c < DIRECT_W; c++)
                    acc[c] += block_dot(w + c * row_bytes + j * Q8_BYTES, xs);
            }
            for (int c = 0; c < DIRECT_W; c++)
                out[t * v_total + v + c] = hsumn(acc[c]);
        }
    }
    for (; v < v_hi; v++) {                             /* the last few rows of W one by one */
        const uint8_t *w = blocks + v * row_bytes;
        for (int64_t t = 0; t < num_rows; t++) {
            vn acc = {0};
            for (int64_t j = 0; j < num_blocks; j++) {
                vn xs[PARTS];
                for (int part = 0; part < PARTS; part++)
                    xs[part] = loadn(x + t * k + j * Q8_BLOCK + part * VN);
                acc += block_dot(w + j * Q8_BYTES, xs);
            }
            out[t * v_total + v] = hsumn(acc);
        }
    }
}

/* From COLUMN_MIN_ROWS rows of x on, the product runs the other way round: x is transposed once
 * per call (xt[k][t], its rows padded with zeros to a multiple of X_COLS = 2 VN), and each step of
 * k loads two vectors of xt (X_COLS rows of x) and broadcasts one widened value of each of 6 rows
 * of W; 12 accumulators hold out[t..t+X_COLS-1][v..v+5], with no horizontal sums (the 4x4 tiles
 * above end each tile in 16 of them). W's rows are widened as above, contiguously. */
#define W_ROWS 6
#define X_COLS (2 * VN)
#define COLUMN_MIN_ROWS 12

static inline void column_tile(const float *restrict xt, int64_t t_pad, const float *restrict rows, int64_t k,
                               int64_t num_w, float *restrict out, int64_t v_total, int64_t num_x) {
    vn acc[W_ROWS][2];
    for (int c = 0; c < W_ROWS; c++)
        acc[c][0] = acc[c][1] = (vn){0};
    for (int64_t i = 0; i < k; i++) {
        const vn x0 = loadn(xt + i * t_pad), x1 = loadn(xt + i * t_pad + VN);
        for (int c = 0; c < W_ROWS; c++) {
            const float w = rows[c * k + i];
            acc[c][0] += w * x0;
            acc[c][1] += w * x1;
        }
    }
    for (int64_t c = 0; c < num_w; c++)
        for (int64_t t = 0; t < num_x; t++)
            out[t * v_total + c] = t < VN ? acc[c][0][t] : acc[c][1][t - VN];
}

static int q8_0_matmul_columns(const float *restrict x, int64_t num_rows, int64_t k, const uint8_t *restrict blocks,
                               int64_t v_lo, int64_t v_hi, int64_t v_total, float *restrict out) {
    const int64_t num_blocks = k / Q8_BLOCK;
    const int64_t t_pad = (num_rows + X_COLS - 1) / X_COLS * X_COLS;
    float *xt = aligned_alloc(64, (size_t)(k * t_pad) * sizeof(float));
    float *rows = aligned_alloc(64, (size_t)(W_ROWS * k) * sizeof(float));
    if (xt == NULL || rows == NULL) {
        free(xt);
        free(rows);
        return -2;
    }
    for (int64_t i = 0; i < k; i++) {                   /* x transposed, zero-padded */
        for (int64_t t = 0; t < num_rows; t++)
            xt[i * t_pad + t] = x[t * k + i];
        for (int64_t t = num_rows; t < t_pad; t++)
            xt[i * t_pad + t] = 0.0f;
    }
    for (int64_t v = v_lo; v < v_hi; v += W_ROWS) {
        const int64_t num_w = v_hi - v < W_ROWS ? v_hi - v : W_ROWS;
        for (int64_t c = 0; c < W_ROWS; c++) {
            if (c < num_w)
                widen_row(blocks + (v + c) * num_blocks * Q8_BYTES, num_blocks, rows + c * k);
            else
                memset(rows + c * k, 0, (size_t)k * sizeof(float));
        }
        for (int64_t t = 0; t < num_rows; t += X_COLS) {
            const int64_t num_x = num_rows - t < X_COLS ? num_rows - t : X_COLS;
            column_tile(xt + t, t_pad, rows, k, num_w, out + t * v_total + v, v_total, num_x);
        }
    }
    free(xt);
    free(rows);
    return 0;
}
#endif  /* VN */

/* x:      [T, K] float32
 * blocks: [V, K / 32, 34] the Q8_0 rows of W
 * out:    [T, V] float32, columns [v_lo, v_hi) written
 * Returns 0, -1 when K is not whole blocks of 32 or exceeds MAX_K (a multiple of 16, as the
 * tiles read 16 lanes at a time), or -2 when the buffers of the column path cannot be allocated. */
int q8_0_matmul(const float *restrict x, int64_t num_rows, int64_t k, const uint8_t *restrict blocks,
                int64_t v_lo, int64_t v_hi, int64_t v_total, float *restrict out) {
    if (k % Q8_BLOCK || k > MAX_K)
        return -1;
#if VN
    if (num_rows >= COLUMN_MIN_ROWS)
        return q8_0_matmul_columns(x, num_rows, k, blocks, v_lo, v_hi, v_total, out);
    if (num_rows <= DIRECT_MAX_ROWS) {
        q8_0_matmul_direct(x, num_rows, k, blocks, v_lo, v_hi, v_total, out);
        return 0;
    }
#endif
    const int64_t num_blocks = k / Q8_BLOCK;
    static _Thread_local float rows[4 * MAX_K];
    int64_t v = v_lo;
    for (; v + 4 <= v_hi; v += 4) {                     /* 4 rows of W at a time */
        for (int c = 0; c < 4; c++)
            widen_row(blocks + (v + c) * num_blocks * Q8_BYTES, num_blocks, rows + c * k);
        int64_t t = 0;
        for (; t + 4 <= num_rows; t += 4)
            tile4x4(x + t * k, rows, k, v_total, out + t * v_total + v);
        for (; t < num_rows; t++)
            for (int c = 0; c < 4; c++)
                out[t * v_total + v + c] = dot(rows + c * k, x + t * k, k);
    }
    for (; v < v_hi; v++) {                             /* the last few rows one by one */
        widen_row(blocks + v * num_blocks * Q8_BYTES, num_blocks, rows);
        for (int64_t t = 0; t < num_rows; t++)
            out[t * v_total + v] = dot(rows, x + t * k, k);
    }
    return 0;
}
