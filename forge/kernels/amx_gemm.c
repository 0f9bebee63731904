/* Big steps' products on the AMX tile units (Intel Sapphire Rapids and later), in "bf16x3":
 * float32 accuracy from bfloat16 tiles.
 *
 * Every float32 value v is split into two bfloat16 halves, hi = bf16(v) and lo = bf16(v - hi), so
 * that hi + lo holds ~16 significant bits of v. Then
 *
 *     x @ W  ~=  xhi @ Whi + xhi @ Wlo + xlo @ Whi        (xlo @ Wlo, ~2^-16 of the rest, dropped)
 *
 * with float32 accumulation in the tiles (TDPBF16PS): three bfloat16 products that together agree
 * with the float32 product to ~1e-5 relative (the float32 one is ~1e-6; plain bfloat16 ~1e-2).
 * On this machine's AMX they run at about twice BLAS's float32 rate, so steps of hundreds of
 * tokens (prefill) take them. The weights stay in their 4-bit planes: a call widens each panel of
 * 32 output columns just before multiplying by it, into a buffer that stays in cache.
 *
 * Layouts: activations hi/lo [m_pad, k] row-major bfloat16, m_pad a multiple of 32 (rows past m
 * are zero); a panel [k / 2][32][2] bfloat16 (the pairs of consecutive k that a TDPBF16PS row
 * takes); k a multiple of 32. The library is compiled for the host (-march=native): without AMX
 * every entry point returns -1 and callers keep their other path.
 */
#define _GNU_SOURCE             /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The split into bfloat16 planes is AVX-512 code: a build for a lower level (FORGE_KERNEL_ISA avx2 or
 * baseline, which turn AVX-512 off but keep -march=native's AMX flags) has no AMX path either. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__linux__)
#define FORGE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define MAX_BLOCK 256
#define MAX_PLANES 2

/* Round to nearest even (finite values; the engine's activations and weights are). */
static inline uint16_t bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float float_of(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void split(float v, uint16_t *hi, uint16_t *lo) {
    *hi = bf16_of(v);
    *lo = bf16_of(v - float_of(*hi));
}

/* Ask Linux for the tile state (once per process). 0 when AMX may be used. */
int amx_enable(void) {
#ifdef FORGE_AMX
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 0 : -1;
#else
    return -1;
#endif
}

#ifdef FORGE_AMX
/* 16 floats -> their bfloat16 halves (round to nearest even, as bf16_of). */
static inline void split16(__m512 v, uint16_t *hi, uint16_t *lo) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256((__m256i *)hi, h);
    _mm256_storeu_si256((__m256i *)lo, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
}
#endif

/* x [m, k] float32 -> hi, lo [m_pad, k] bfloat16, rows m .. m_pad - 1 zero. */
int amx_split_rows(const float *x, int64_t m, int64_t k, int64_t m_pad, uint16_t *hi, uint16_t *lo) {
#ifdef FORGE_AMX
    if (m_pad < m || m_pad % 32 || k % 32)
        return -1;
    for (int64_t i = 0; i < m * k; i += 16)
        split16(_mm512_loadu_ps(x + i), hi + i, lo + i);
    memset(hi + m * k, 0, (size_t)((m_pad - m) * k) * sizeof *hi);
    memset(lo + m * k, 0, (size_t)((m_pad - m) * k) * sizeof *lo);
    return 0;
#else
    (void)x; (void)m; (void)k; (void)m_pad; (void)hi; (void)lo;
    return -1;
#endif
}

#ifdef FORGE_AMX
/* Tile numbers must be constants: 0-3 the output block, 4-5 rows of x, 6-7 columns of a panel. */
#define LOAD_X(top, bottom) do { _tile_loadd(4, (top), sa); _tile_loadd(5, (bottom), sa); } while (0)
#define LOAD_PANEL(p) do { _tile_loadd(6, (p), 128); _tile_loadd(7, (p) + 32, 128); } while (0)
#define DOT_2X2() do { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); \
                       _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } while (0)

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The one tile configuration forge's kernels use (qmatmul_avx512.c's too): palette 1, all 8 tiles of 16
 * rows of 64 bytes. Per thread: each call that uses the tiles loads it first. A constant in memory,
 * not a local filled in: GCC's _tile_loadconfig tells the compiler it reads only the first 8 bytes,
 * so stores to a local's rows and column sizes may be dropped as dead (this crashed once moved into
 * a function of its own). */
static const tile_config TILES_16X64 = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

__attribute__((visibility("hidden"))) void amx_load_config(void) { _tile_loadconfig(&TILES_16X64); }

/* Columns n0 .. n0 + 31 of W (rows of the planes' [N, K] matrix: w = scale * q + offset per block,
 * q rebuilt from its nibbles as onnx_linear.py packs them) as a panel: ph, pl [k / 2][32][2]
 * bfloat16 halves. th, tl: scratch of 32 * k values each (the 32 rows widened, then transposed by
 * pairs of k, the unit a tile row takes). */
static void widen_panel(const uint8_t *const *planes, int64_t num_planes, const float *scale, const float *offset,
                        int64_t k, int64_t block_size, int64_t n0, uint16_t *ph, uint16_t *pl, uint16_t *th,
                        uint16_t *tl) {
    const int64_t num_blocks = k / block_size, half = block_size / 2;
    for (int64_t c = 0; c < 32; c++) {
        const int64_t n = n0 + c;
        uint16_t *rh = th + c * k, *rl = tl + c * k;
        for (int64_t b = 0; b < num_blocks; b++) {
            const int64_t at = n * num_blocks + b;
            if (block_size == 32 && num_planes == 1) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(planes[0] + at * 16));
                const __m128i mask = _mm_set1_epi8(0x0F);
                const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
                const __m512 s = _mm512_set1_ps(scale[at]), o = _mm512_set1_ps(offset[at]);
                const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
                const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(low, high)));
                split16(_mm512_add_ps(_mm512_mul_ps(q0, s), o), rh + b * 32, rl + b * 32);
                split16(_mm512_add_ps(_mm512_mul_ps(q1, s), o), rh + b * 32 + 16, rl + b * 32 + 16);
                continue;
            }
            const float s = scale[at], o = offset[at];
            int32_t q[MAX_BLOCK];
            for (int64_t j = 0; j < half; j++) {
                q[2 * j] = planes[0][at * half + j] & 0x0F;
                q[2 * j + 1] = planes[0][at * half + j] >> 4;
            }
            for (int64_t p = 1; p < num_planes; p++)
                for (int64_t j = 0; j < half; j++) {
                    q[2 * j] |= (planes[p][at * half + j] & 0x0F) << (4 * p);
                    q[2 * j + 1] |= (planes[p][at * half + j] >> 4) << (4 * p);
                }
            for (int64_t i = 0; i < block_size; i++)
                split(s * (float)q[i] + o, rh + b * block_size + i, rl + b * block_size + i);
        }
    }
    /* ph[p][c] = th[c][p] over 32-bit units (a pair of k per unit) */
    const int64_t units = k / 2;
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)units));
    const __m512i rows16 = _mm512_add_epi32(rows, _mm512_set1_epi32((int)(16 * units)));
    for (int64_t p = 0; p < units; p++) {
        const int *bh = (const int *)th + p, *bl = (const int *)tl + p;
        _mm512_storeu_si512(ph + p * 64, _mm512_i32gather_epi32(rows, bh, 4));
        _mm512_storeu_si512(ph + p * 64 + 32, _mm512_i32gather_epi32(rows16, bh, 4));
        _mm512_storeu_si512(pl + p * 64, _mm512_i32gather_epi32(rows, bl, 4));
        _mm512_storeu_si512(pl + p * 64 + 32, _mm512_i32gather_epi32(rows16, bl, 4));
    }
}
#endif

/* c[i][j - n_lo] (row stride ldc floats) = (x @ W)[i][j] for i < m, n_lo <= j < n_hi: x as
 * amx_split_rows left it, W as 4-bit planes with per-block scale and offset [N, k / block_size]
 * (see widen_panel). Each panel of 32 columns is widened into a buffer that stays in cache while
 * every row block multiplies by it. Tiles: 0-3 a 32 x 32 block of c, 4-5 two 16-row slices of x,
 * 6-7 two 16-column slices of the panel. Returns 0; -1 for sizes beyond its limits (k and
 * n_hi - n_lo multiples of 32, m_pad of 32, block_size even and at most 256, 1 or 2 planes); -2
 * without memory for its buffers. */
int amx_gemm_planes(const uint16_t *ah, const uint16_t *al, int64_t m, int64_t m_pad, int64_t k,
                    const uint8_t *const *planes, int64_t num_planes, const float *scale, const float *offset,
                    int64_t block_size, int64_t n_lo, int64_t n_hi, float *c, int64_t ldc) {
#ifdef FORGE_AMX
    if (m_pad < m || m_pad % 32 || k % 32 || (n_hi - n_lo) % 32 || n_lo < 0 || n_hi < n_lo || ldc < n_hi - n_lo
        || block_size <= 0 || block_size % 2 || block_size > MAX_BLOCK || k % block_size || num_planes < 1
        || num_planes > MAX_PLANES)
        return -1;
    uint16_t *buf = aligned_alloc(64, (size_t)(4 * 32 * k) * sizeof *buf);
    if (buf == NULL)
        return -2;
    uint16_t *ph = buf, *pl = buf + 32 * k, *th = buf + 64 * k, *tl = buf + 96 * k;
    amx_load_config();
    const int64_t sa = k * 2;
    float tail[32 * 32];
    for (int64_t j = n_lo; j < n_hi; j += 32) {
        widen_panel(planes, num_planes, scale, offset, k, block_size, j, ph, pl, th, tl);
        float *cj = c + (j - n_lo);
        for (int64_t i = 0; i < m; i += 32) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const uint16_t *a0h = ah + i * k, *a1h = ah + (i + 16) * k, *a0l = al + i * k, *a1l = al + (i + 16) * k;
            for (int64_t kk = 0; kk < k; kk += 32) {
                const uint16_t *bph = ph + kk * 32, *bpl = pl + kk * 32;
                LOAD_X(a0h + kk, a1h + kk);
                LOAD_PANEL(bph);
                DOT_2X2();                                /* xhi . Whi */
                LOAD_PANEL(bpl);
                DOT_2X2();                                /* xhi . Wlo */
                LOAD_X(a0l + kk, a1l + kk);
                LOAD_PANEL(bph);
                DOT_2X2();                                /* xlo . Whi */
            }
            if (i + 32 <= m) {
                float *o = cj + i * ldc;
                _tile_stored(0, o, ldc * 4);
                _tile_stored(1, o + 16, ldc * 4);
                _tile_stored(2, o + 16 * ldc, ldc * 4);
                _tile_stored(3, o + 16 * ldc + 16, ldc * 4);
            } else {                                  /* the last rows: only those below m */
                _tile_stored(0, tail, 128);
                _tile_stored(1, tail + 16, 128);
                _tile_stored(2, tail + 16 * 32, 128);
                _tile_stored(3, tail + 16 * 32 + 16, 128);
                for (int64_t r = 0; r < m - i; r++)
                    memcpy(cj + (i + r) * ldc, tail + r * 32, 32 * sizeof(float));
            }
        }
    }
    _tile_release();
    free(buf);
    return 0;
#else
    (void)ah; (void)al; (void)m; (void)m_pad; (void)k; (void)planes; (void)num_planes; (void)scale; (void)offset;
    (void)block_size; (void)n_lo; (void)n_hi; (void)c; (void)ldc;
    return -1;
#endif
}
