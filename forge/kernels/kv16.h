/* Reading the K/V cache sixteen values at a time, widened to float32, for forge's AVX-512 kernels
 * (paged_attention.c, prefill_attention.c). The storage type is kv_type: 0 float32, 1 float16,
 * 2 bfloat16 (raw uint16 bits; widening either half type is exact). */
#ifndef FORGE_KV16_H
#define FORGE_KV16_H

#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

static inline __m512 load16_kv(const void *base, int64_t at, int kv_type) {
    if (kv_type == 0)
        return _mm512_loadu_ps((const float *)base + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    if (kv_type == 1)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#endif
