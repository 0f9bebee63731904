/* The deterministic numerics' row-wise operations (compiled without -ffast-math and with -ffp-contract=off:
 * forge.kernels.compiled's FILE_FLAGS), on det_math.h's exponential and logarithm. forge.kernels.det_math
 * and forge.kernels.det_rowwise are their definitions in numpy; every build (scalar, AVX2, AVX-512) gives
 * their bits: vector lanes hold independent values (elementwise), or the 16 partial sums of the definition.
 *
 *   det_sum of a row's terms t_0 .. t_{n-1}: 16 partial sums p_j of the terms t_i with i = j mod 16, each in
 *     index order from +0, then the fixed tree q_j = p_j + p_{j+8}, r_j = q_j + q_{j+4}, s_j = r_j + r_{j+2},
 *     s_0 + s_1. AVX-512 keeps the 16 partials in one register, AVX2 in two, the scalar tail goes on in them.
 *   RMSNorm of x [h] with weight w: ss = det_sum of x_i * x_i; inv = 1 / sqrt(ss / h + eps); out_i =
 *     (x_i * inv) * w_i (sqrt and the division correctly rounded, as IEEE has them).
 *   The gated activations of [gate | up] (g, u): SiLU: (g / (1 + det_exp(-g))) * u. GELU by its tanh form:
 *     0.5 g (1 + tanh(a)) = g / (1 + exp(-2a)) with a = sqrt(2 / pi) (g + 0.044715 g^3), so z = (((g * g) *
 *     0.044715 + 1) * g) * K (K = -2 sqrt(2 / pi) in float32) and (g / (1 + det_exp(z))) * u: no cancellation
 *     for a large negative a, and exactly g * u once det_exp(z) is below half an ulp of 1. gpt-oss's clamped
 *     SwiGLU: g' = min(g, 7), u' = max(min(u, 7), -7), (g' / (1 + det_exp(g' * -1.702))) * (u' + 1).
 *   logsumexp of a row: m = its max, m + det_log(det_sum of det_exp(x_i - m)); softmax: e_i = det_exp(x_i - m),
 *     e_i / det_sum of e.
 *   tanh(x): Cephes' tanhf: for |x| < 0.625 the odd polynomial x + (P(z) * z) * x (z = x * x); else
 *     1 - 2 / (det_exp(2|x|) + 1), its sign x's. Scalar code only (Gemma 2's final soft-capping).
 *   The dense product out[t, e] = det_sum of x[t, i] * w[e, i] (a router's float32 rows).
 */
#include <stdint.h>

#include "det_math.h"

/* out[i] = det_exp(x[i]), 16, 8 or 1 lanes at a time (the same bits); out may be x. */
void forge_det_exp(const float *x, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, det_exp16(_mm512_loadu_ps(x + i)));
#endif
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, det_exp8(_mm256_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = det_exp(x[i]);
}

/* out[i] = det_log(x[i]) for normal x[i] > 0. */
void forge_det_log(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = det_log(x[i]);
}

static inline float det_tree16(const float p[16]) {
    float q[8], r[4];
    for (int j = 0; j < 8; j++) q[j] = p[j] + p[j + 8];
    for (int j = 0; j < 4; j++) r[j] = q[j] + q[j + 4];
    return (r[0] + r[2]) + (r[1] + r[3]);
}

/* det_sum of a[i] * b[i]. */
static float det_dot(const float *a, const float *b, int64_t n) {
    float p[16] = {0};
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    _mm512_storeu_ps(p, acc);
#elif defined(__AVX2__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
#endif
    for (; i < n; i++) p[i & 15] += a[i] * b[i];
    return det_tree16(p);
}

/* out[i] = (x[i] * inv) * w[i]; out may be x. */
static void det_scale_row(const float *x, float inv, const float *w, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 v = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), v), _mm512_loadu_ps(w + i)));
#elif defined(__AVX2__)
    const __m256 v = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), v), _mm256_loadu_ps(w + i)));
#endif
    for (; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

/* RMSNorm of the rows of length h at x + a * xa + b * xb (a < outer, b < inner; strides in floats), weight w [h],
 * into out + a * oa + b * ob (out may be x). */
void forge_det_rms_norm(const float *x, int64_t outer, int64_t inner, int64_t xa, int64_t xb, int64_t h,
                        const float *w, float eps, float *out, int64_t oa, int64_t ob) {
    for (int64_t a = 0; a < outer; a++)
        for (int64_t b = 0; b < inner; b++) {
            const float *row = x + a * xa + b * xb;
            const float ss = det_dot(row, row, h);
            const float inv = 1.0f / sqrtf(ss / (float)h + eps);
            det_scale_row(row, inv, w, h, out + a * oa + b * ob);
        }
}

#define DET_GELU_A 0.044715f
#define DET_GELU_K -1.5957691216057308f
#define DET_OAI_LIMIT 7.0f
#define DET_OAI_ALPHA -1.702f

static inline float det_gated(float g, float u, int mode) {
    if (mode == 0) return (g / (1.0f + det_exp(-g))) * u;
    if (mode == 1) return (g / (1.0f + det_exp((((g * g) * DET_GELU_A + 1.0f) * g) * DET_GELU_K))) * u;
    g = g < DET_OAI_LIMIT ? g : DET_OAI_LIMIT;                 /* as VMINPS: a NaN becomes the bound */
    u = u < DET_OAI_LIMIT ? u : DET_OAI_LIMIT;
    u = u > -DET_OAI_LIMIT ? u : -DET_OAI_LIMIT;
    return (g / (1.0f + det_exp(g * DET_OAI_ALPHA))) * (u + 1.0f);
}

#if defined(__AVX512F__)
static inline __m512 det_gated16(__m512 g, __m512 u, int mode) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 z;
    if (mode == 0) {
        z = _mm512_sub_ps(_mm512_setzero_ps(), g);
    } else if (mode == 1) {
        z = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(g, g), _mm512_set1_ps(DET_GELU_A)), one);
        z = _mm512_mul_ps(_mm512_mul_ps(z, g), _mm512_set1_ps(DET_GELU_K));
    } else {
        g = _mm512_min_ps(g, _mm512_set1_ps(DET_OAI_LIMIT));
        u = _mm512_max_ps(_mm512_min_ps(u, _mm512_set1_ps(DET_OAI_LIMIT)), _mm512_set1_ps(-DET_OAI_LIMIT));
        u = _mm512_add_ps(u, one);
        z = _mm512_mul_ps(g, _mm512_set1_ps(DET_OAI_ALPHA));
    }
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, det_exp16(z))), u);
}
#endif

#if defined(__AVX2__)
static inline __m256 det_gated8(__m256 g, __m256 u, int mode) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 z;
    if (mode == 0) {
        z = _mm256_sub_ps(_mm256_setzero_ps(), g);
    } else if (mode == 1) {
        z = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(g, g), _mm256_set1_ps(DET_GELU_A)), one);
        z = _mm256_mul_ps(_mm256_mul_ps(z, g), _mm256_set1_ps(DET_GELU_K));
    } else {
        g = _mm256_min_ps(g, _mm256_set1_ps(DET_OAI_LIMIT));
        u = _mm256_max_ps(_mm256_min_ps(u, _mm256_set1_ps(DET_OAI_LIMIT)), _mm256_set1_ps(-DET_OAI_LIMIT));
        u = _mm256_add_ps(u, one);
        z = _mm256_mul_ps(g, _mm256_set1_ps(DET_OAI_ALPHA));
    }
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, det_exp8(z))), u);
}
#endif

/* out [n, f] = act(gate, up) of gate_up = [gate | up] [n, 2f], both C-contiguous; mode 0 SiLU, 1 GELU (tanh),
 * 2 gpt-oss's clamped SwiGLU. */
void forge_det_gated(const float *gate_up, int64_t n, int64_t f, int64_t mode, float *out) {
    const int m = (int)mode;
    for (int64_t t = 0; t < n; t++) {
        const float *g = gate_up + t * 2 * f, *u = g + f;
        float *o = out + t * f;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= f; i += 16)
            _mm512_storeu_ps(o + i, det_gated16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i), m));
#endif
#if defined(__AVX2__)
        for (; i + 8 <= f; i += 8)
            _mm256_storeu_ps(o + i, det_gated8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i), m));
#endif
        for (; i < f; i++) o[i] = det_gated(g[i], u[i], m);
    }
}

static float det_row_max(const float *x, int64_t n) {
    float m = x[0];
    for (int64_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* det_sum of det_exp(x[i] - m); with e, each det_exp(x[i] - m) stored there too. */
static float det_exp_sum(const float *x, int64_t n, float m, float *e) {
    float p[16] = {0};
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = det_exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
        if (e) _mm512_storeu_ps(e + i, v);
        acc = _mm512_add_ps(acc, v);
    }
    _mm512_storeu_ps(p, acc);
#elif defined(__AVX2__)
    const __m256 mv = _mm256_set1_ps(m);
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m256 a = det_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
        const __m256 b = det_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv));
        if (e) {
            _mm256_storeu_ps(e + i, a);
            _mm256_storeu_ps(e + i + 8, b);
        }
        lo = _mm256_add_ps(lo, a);
        hi = _mm256_add_ps(hi, b);
    }
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
#endif
    for (; i < n; i++) {
        const float v = det_exp(x[i] - m);
        if (e) e[i] = v;
        p[i & 15] += v;
    }
    return det_tree16(p);
}

/* out[r] = logsumexp of row r of x [rows, n] (rows `stride` floats apart), n >= 1. */
void forge_det_logsumexp(const float *x, int64_t rows, int64_t n, int64_t stride, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        const float m = det_row_max(row, n);
        out[r] = m + det_log(det_exp_sum(row, n, m, NULL));
    }
}

/* out [rows, n] (C-contiguous) = the softmax of each row of x (rows `stride` floats apart), n >= 1. */
void forge_det_softmax(const float *x, int64_t rows, int64_t n, int64_t stride, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float *o = out + r * n;
        const float s = det_exp_sum(row, n, det_row_max(row, n), o);
        for (int64_t i = 0; i < n; i++) o[i] = o[i] / s;
    }
}

/* out[i] = tanh(x[i]), the definition above; out may be x. */
void forge_det_tanh(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i], a = v < 0.0f ? -v : v;
        float y;
        if (a < 0.625f) {
            const float z = v * v;
            float p = -5.70498872745e-3f;
            p = p * z + 2.06390887954e-2f;
            p = p * z - 5.37397155531e-2f;
            p = p * z + 1.33314422036e-1f;
            p = p * z - 3.33332819422e-1f;
            y = (p * z) * v + v;
        } else {
            y = 1.0f - 2.0f / (det_exp(a + a) + 1.0f);
            y = v < 0.0f ? -y : y;
        }
        out[i] = y;
    }
}

/* out [t, e] = det_sum over i of x[t, i] * w[e, i]: x [t, h] and w [e, h] C-contiguous. */
void forge_det_matmul_f32(const float *x, int64_t t, int64_t h, const float *w, int64_t e, float *out) {
    for (int64_t a = 0; a < t; a++)
        for (int64_t b = 0; b < e; b++) out[a * e + b] = det_dot(x + a * h, w + b * h, h);
}
