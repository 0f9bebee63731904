/* Reading the K/V cache, widened to float32, for forge's kernels (paged_attention.c,
 * prefill_attention.c). The storage type is kv_type: 0 float32, 1 float16, 2 bfloat16 (raw uint16
 * bits; widening either half type is exact), 3 int8 with a float16 scale per KV_INT8_GROUP values
 * (`scales`, indexed by a value's offset / KV_INT8_GROUP; forge.models.llama.kv_dtype). An int8 value
 * widens to q * scale, exact in float32 (7 bits times 11). `scales` is unused by the other types. */
#ifndef FORGE_KV16_H
#define FORGE_KV16_H

#include <stdint.h>
#include <string.h>

#define KV_INT8_GROUP 32

/* The cache slot of key position p through a block table: a shift and a mask for a power-of-two
 * block size (an integer division per key cost as much as the key's arithmetic). */
static inline int64_t slot_of(const int64_t *table, int64_t p, int64_t block_size) {
    if ((block_size & (block_size - 1)) == 0) {
        const int shift = __builtin_ctzll((unsigned long long)block_size);
        return (table[p >> shift] << shift) + (p & (block_size - 1));
    }
    return table[p / block_size] * block_size + p % block_size;
}

static inline float kv_scale(const uint16_t *scales, int64_t at) {
    _Float16 h;
    memcpy(&h, scales + at / KV_INT8_GROUP, sizeof h);
    return (float)h;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* Sixteen values from offset `at` (a multiple of 16: for int8 they share one scale). */
static inline __m512 load16_kv(const void *base, const uint16_t *scales, int64_t at, int kv_type) {
    if (kv_type == 0)
        return _mm512_loadu_ps((const float *)base + at);
    if (kv_type == 3) {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const int8_t *)base + at));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(kv_scale(scales, at)));
    }
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at));
    if (kv_type == 1)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#endif
