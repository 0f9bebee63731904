/* x @ W.T for W held in GGUF Q8_0 blocks (34 bytes: a float16 scale d, then 32 int8 q; w = d * q).
 *
 * Used for the output head, whose Q8_0 blocks forge already keeps for the token embedding: no
 * second copy of the weights. Each output row of W is widened to float32 once (d * q, exactly the
 * file's values) into a buffer that stays in L1, then dotted with every row of x; float32
 * arithmetic, dot products as in dot.h. A call computes the
 * columns [v_lo, v_hi) of out, so the engine's pool threads split the vocabulary between them.
 * forge.kernels.blocks' dequantize() followed by a float64 product is the reference it is tested
 * against.
 */
#include <stdint.h>
#include <string.h>

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

/* x:      [T, K] float32
 * blocks: [V, K / 32, 34] the Q8_0 rows of W
 * out:    [T, V] float32, columns [v_lo, v_hi) written
 * Returns 0, or -1 when K is not whole blocks of 32 or exceeds MAX_K (a multiple of 16, as the
 * tiles read 16 lanes at a time). */
int q8_0_matmul(const float *restrict x, int64_t num_rows, int64_t k, const uint8_t *restrict blocks,
                int64_t v_lo, int64_t v_hi, int64_t v_total, float *restrict out) {
    if (k % Q8_BLOCK || k > MAX_K)
        return -1;
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
