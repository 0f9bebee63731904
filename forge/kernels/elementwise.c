/* The forward's row-wise float32 operations between its products, compiled: RMSNorm and the gated
 * SiLU of the MLP. numpy runs each as several passes over [T, H] temporaries on one thread (at 512
 * prompt rows ~60 ms of a ~430 ms step on this machine); here each row is one pass, the
 * exponentials vectorised (glibc's libmvec, -ffast-math). forge.models.llama.llama_model's numpy functions are the reference these are tested against.
 *
 * Built by forge.kernels.compiled with the host's compiler (-O3 -march=native); called through
 * ctypes, which releases the GIL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "dot.h"

/* out[r] = x[r] * w / sqrt(mean(x[r]^2) + eps) for rows r < rows; x rows ldx floats apart, out
 * rows ldo apart (both at least h). */
void forge_rms_norm(const float *restrict x, int64_t rows, int64_t h, int64_t ldx, const float *restrict w,
                    float eps, float *restrict out, int64_t ldo) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * ldo;
        const float inv = 1.0f / sqrtf(dot(xr, xr, h) * (1.0f / (float)h) + eps);
        for (int64_t i = 0; i < h; i++)
            o[i] = xr[i] * inv * w[i];
    }
}

/* out[r][i] = silu(g) * u for g = gate_up[r][i], u = gate_up[r][f + i] (gate_up rows 2f floats,
 * out rows f). The exponent is clamped where expf would overflow: silu(g) is then -0 to float32
 * precision either way (numpy's reference divides by inf). */
void forge_swiglu(const float *restrict gate_up, int64_t rows, int64_t f, float *restrict out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * f, *u = g + f;
        float *o = out + r * f;
        for (int64_t i = 0; i < f; i++) {
            const float e = expf(fminf(-g[i], 88.0f));
            o[i] = g[i] / (1.0f + e) * u[i];
        }
    }
}

/* out[i] = x[i] * Phi(x[i]), the exact GELU (BERT's "gelu"), by libm's erff: with -ffast-math gcc
 * calls glibc's vector erff (libmvec), 8 or 16 lanes a call. forge.models.bert.bert_model.gelu is the reference
 * (an erf within 1.5e-7); both are within 5e-7 of float64's. */
void forge_gelu_erf(const float *restrict x, int64_t n, float *restrict out) {
    for (int64_t i = 0; i < n; i++)
        out[i] = 0.5f * x[i] * (1.0f + erff(x[i] * 0.70710678118654752f));
}

/* x[0..31] <- H x for the 32 x 32 Walsh-Hadamard matrix H (entries +-1, unnormalised: H H = 32 I):
 * five stages of butterflies (with AVX-512 in registers, a stage per permute). forge.models.llama.kv_dtype.
 * hadamard32 makes the same additions in the same order (the same bits). */
#if defined(__AVX512F__)
/* One stage within a vector: lane i gets x[i] + x[i ^ h] where bit h of i is clear, x[i ^ h] - x[i]
 * where it is set (the butterfly a + b, a - b of the scalar loop, the same roundings). */
static inline __m512 butterfly(__m512 x, __m512 partner, __mmask16 upper) {
    return _mm512_mask_sub_ps(_mm512_add_ps(x, partner), upper, partner, x);
}

static inline void hadamard32(float *x) {
    __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
    lo = butterfly(lo, _mm512_permute_ps(lo, 0xB1), 0xAAAA);                       /* h = 1 */
    hi = butterfly(hi, _mm512_permute_ps(hi, 0xB1), 0xAAAA);
    lo = butterfly(lo, _mm512_permute_ps(lo, 0x4E), 0xCCCC);                       /* h = 2 */
    hi = butterfly(hi, _mm512_permute_ps(hi, 0x4E), 0xCCCC);
    lo = butterfly(lo, _mm512_shuffle_f32x4(lo, lo, _MM_SHUFFLE(2, 3, 0, 1)), 0xF0F0);   /* h = 4 */
    hi = butterfly(hi, _mm512_shuffle_f32x4(hi, hi, _MM_SHUFFLE(2, 3, 0, 1)), 0xF0F0);
    lo = butterfly(lo, _mm512_shuffle_f32x4(lo, lo, _MM_SHUFFLE(1, 0, 3, 2)), 0xFF00);   /* h = 8 */
    hi = butterfly(hi, _mm512_shuffle_f32x4(hi, hi, _MM_SHUFFLE(1, 0, 3, 2)), 0xFF00);
    _mm512_storeu_ps(x, _mm512_add_ps(lo, hi));                                    /* h = 16 */
    _mm512_storeu_ps(x + 16, _mm512_sub_ps(lo, hi));
}
#else
static inline void hadamard32(float *x) {
    for (int h = 1; h < 32; h *= 2)
        for (int i = 0; i < 32; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}
#endif

/* Each of `groups` runs of 32 floats of x (contiguous) <- H x * scale (scale a power of two: exact). */
void forge_hadamard32(float *restrict x, int64_t groups, float scale) {
    for (int64_t g = 0; g < groups; g++) {
        float *xg = x + 32 * g;
        hadamard32(xg);
        if (scale != 1.0f)
            for (int i = 0; i < 32; i++)
                xg[i] *= scale;
    }
}

/* One head-row run of an int8 cache: row_len values (a multiple of 32), each group of 32 rotated by H
 * (hadamard32: an outlier spreads over its group, so one scale fits all 32) and stored as int8
 * q = rint(y / d) in [-127, 127] with the float16 scale d = max |y| / 127 (rounded to float16, at
 * most its largest value). Written as multiplications by constants and by 1 / d, which -ffast-math
 * leaves as they are, so that numpy's reference rounds the same. */
static void store_int8_row(const float *restrict xr, int64_t row_len, int8_t *restrict qr, uint16_t *restrict sr) {
    const float inv127 = 1.0f / 127.0f;
    for (int64_t g = 0; g < row_len / 32; g++) {
        float y[32];
        memcpy(y, xr + 32 * g, sizeof y);
        hadamard32(y);
        float amax = 0.0f;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(y[i]));
        const _Float16 h = (_Float16)fminf(amax * inv127, 65504.0f);
        const float d = (float)h;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++)
            qr[32 * g + i] = (int8_t)fminf(fmaxf(rintf(y[i] * id), -127.0f), 127.0f);
        memcpy(sr + g, &h, sizeof h);
    }
}

/* float16 (to nearest, ties to even, as numpy's astype) or bfloat16 bits (forge.models.llama.kv_dtype.
 * to_storage's rounding: to nearest, ties to even; a NaN stays a quiet NaN). */
static void store_half_row(const float *restrict xr, int64_t row_len, uint16_t *restrict out, int bf16) {
    int64_t i = 0;
    if (!bf16) {
#ifdef __F16C__
        for (; i + 8 <= row_len; i += 8)
            _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(xr + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < row_len; i++) {
            const _Float16 h = (_Float16)xr[i];
            memcpy(out + i, &h, sizeof h);
        }
        return;
    }
    for (; i < row_len; i++) {
        uint32_t bits;
        memcpy(&bits, xr + i, sizeof bits);
        const int nan = (bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu);
        out[i] = nan ? (uint16_t)((bits >> 16) | 0x0040u) : (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
}

/* The K/V cache's writer: rows x [n] of row_len floats (the rows ldx floats apart, each row
 * contiguous) into their slots of `dst` ([slots][row_len] of kv_type: 0 float32, 1 float16,
 * 2 bfloat16, 3 int8 with `scales` [slots][row_len / 32], kv16.h's types). Each is what
 * forge.models.llama.kv_dtype writes, bit for bit (to_storage; quantize_int8). */
void forge_kv_store(const float *restrict x, int64_t ldx, int64_t n, int64_t row_len, const int64_t *restrict slots,
                    void *restrict dst, uint16_t *restrict scales, int kv_type) {
    for (int64_t r = 0; r < n; r++) {
        const float *xr = x + r * ldx;
        const int64_t at = slots[r] * row_len;
        if (kv_type == 0)
            memcpy((float *)dst + at, xr, (size_t)row_len * sizeof(float));
        else if (kv_type == 3)
            store_int8_row(xr, row_len, (int8_t *)dst + at, scales + at / 32);
        else
            store_half_row(xr, row_len, (uint16_t *)dst + at, kv_type == 2);
    }
}
