/* The deterministic product's own layout of a weight (qmatmul_det.c includes it after its unpacking): the
 * file's blocks rearranged once, at load, so that a step reads each weight row's codes already side by side
 * with 15 other rows' (what the chunk's buffer holds, the VPDPBUSD's and the tiles' operand), in the file's
 * bytes (Q4_K and Q5_K 2-3% more: their scales a byte each). A part so packed has DET_PACKED in its type; its data is groups of DET_PG
 * weight rows (the rows padded with zeros to a whole number of DET_PACK_ROWS), and each group, block by
 * block (K-quants: a superblock's header first):
 *
 *   codes: 4-bit planes of 256 bytes, byte 4 r + k of plane gg holding code 4 gg + k of row r in its low
 *     nibble and code 4 (gg + 4) + k in its high one; 5-bit types add 64 bytes (bit g of byte 4 r + k: the
 *     fifth bit of code 4 g + k), Q6_K 128 (two bits a code: codes 0-15 in the first 64 bytes, 16-31 in the
 *     second); Q8_0's signed codes as bytes, 64 a group of 4 codes (512 bytes);
 *   constants, 16 rows side by side: Q4_0, Q5_0, Q8_0 the scale d (float16), Q4_1 and Q5_1 d and m; Q4_K
 *     and Q5_K the 6-bit scale and min of the block (bytes), the superblock's d and dmin (float16) in its
 *     header; Q6_K the block's two int8 group scales, the superblock's d in its header.
 *
 * The codes and constants are the file's own, so the product's integers and float operations are those of
 * the definition (qmatmul_det.c's header): the same bits as from the file's blocks. Moves only; the packing
 * itself is scalar C (once per weight, at load).
 */
#ifndef FORGE_QMATMUL_DET_PACK_H
#define FORGE_QMATMUL_DET_PACK_H

#define DET_PG 16               /* weight rows a group */
#define DET_PACK_ROWS 32        /* rows padded to a multiple of this (DET_COLS of every build divides it) */
/* Bytes read ahead of a group's block (software prefetch): one row's stream of records is a stream the hardware
 * prefetcher follows, but not far enough ahead for a decode step: of 512, 1024, 2048 and 4096 bytes, 1024-2048 were
 * fastest at 1 and 4 rows in an A/B of this constant (1 thread, Sapphire Rapids; the layout's figures with it:
 * docs/benchmarks.md). */
#define DET_PACK_PF 2048

typedef struct {
    int bytes8;                 /* Q8_0: codes as bytes */
    int hbits;                  /* bits above the low 4 (5-bit types 1, Q6_K 2) */
    int cons;                   /* constants' bytes a block */
    int hdr;                    /* a superblock's header bytes (K-quants) */
    int bps;                    /* blocks of 32 a superblock (K-quants 8, else 1) */
} pack_fmt;

static inline pack_fmt pack_format(int64_t type) {
    switch (type) {
    case T_Q4_0: return (pack_fmt){0, 0, 32, 0, 1};
    case T_Q4_1: return (pack_fmt){0, 0, 64, 0, 1};
    case T_Q5_0: return (pack_fmt){0, 1, 32, 0, 1};
    case T_Q5_1: return (pack_fmt){0, 1, 64, 0, 1};
    case T_Q8_0: return (pack_fmt){1, 0, 32, 0, 1};
    case T_Q4_K: return (pack_fmt){0, 0, 32, 64, 8};
    case T_Q5_K: return (pack_fmt){0, 1, 32, 64, 8};
    default: return (pack_fmt){0, 2, 32, 32, 8};     /* T_Q6_K */
    }
}

static inline int64_t pack_codes_bytes(const pack_fmt *f) { return f->bytes8 ? 512 : 256 + 64 * f->hbits; }
static inline int64_t pack_rec_bytes(const pack_fmt *f) { return pack_codes_bytes(f) + f->cons; }
static inline int64_t pack_super_bytes(const pack_fmt *f) { return f->hdr + f->bps * pack_rec_bytes(f); }

/* Bytes of one group of DET_PG rows of nb blocks. */
static inline int64_t pack_group_bytes(int64_t type, int64_t nb) {
    const pack_fmt f = pack_format(type);
    return nb / f.bps * pack_super_bytes(&f);
}

static inline const uint8_t *pack_header(const uint8_t *group, const pack_fmt *f, int64_t b) {
    return group + b / f->bps * pack_super_bytes(f);
}

static inline const uint8_t *pack_record(const uint8_t *group, const pack_fmt *f, int64_t b) {
    return pack_header(group, f, b) + f->hdr + b % f->bps * pack_rec_bytes(f);
}

/* Block b of row r (0..DET_PG-1) of a packed group: its codes and constants, as unpack_block gives them. */
static void unpack_packed(int64_t type, const uint8_t *group, int r, int64_t b, uint8_t *c, det_consts *k) {
    const pack_fmt f = pack_format(type);
    const uint8_t *rec = pack_record(group, &f, b), *cons = rec + pack_codes_bytes(&f);
    const uint8_t *hdr = pack_header(group, &f, b);
    for (int i = 0; i < 32; i++) {
        const int g = i / 4, at = 4 * r + i % 4;
        if (f.bytes8) {
            c[i] = rec[64 * g + at];
            continue;
        }
        int code = g < 4 ? rec[64 * g + at] & 15 : rec[64 * (g - 4) + at] >> 4;
        if (f.hbits == 1) code |= ((rec[256 + at] >> g) & 1) << 4;
        if (f.hbits == 2) code |= ((rec[256 + 64 * (g / 4) + at] >> (2 * (g % 4))) & 3) << 4;
        c[i] = (uint8_t)code;
    }
    k->M = 0.0f;
    k->z = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q6_K ? 32 : 0;
    k->s0 = k->s1 = 1;
    switch (type) {
    case T_Q4_1:
    case T_Q5_1: k->M = f16(cons + 32 + 2 * r); /* fall through */
    case T_Q4_0:
    case T_Q5_0:
    case T_Q8_0: k->A = f16(cons + 2 * r); return;
    case T_Q4_K:
    case T_Q5_K:
        k->A = f16(hdr + 2 * r) * (float)cons[r];
        k->M = -(f16(hdr + 32 + 2 * r) * (float)cons[16 + r]);
        return;
    default:
        k->A = f16(hdr + 2 * r);
        k->s0 = (int8_t)cons[r];
        k->s1 = (int8_t)cons[16 + r];
        return;
    }
}

/* Groups [g0, g1) of the packed layout of rows [0, rows) of `type` (K values each) from the file's blocks at
 * src into dst (its bytes zeroed here: the padding rows stay zeros). */
static void det_pack_rows(int64_t type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst, int64_t g0, int64_t g1) {
    const pack_fmt f = pack_format(type);
    const int64_t nb = K / 32, gbytes = pack_group_bytes(type, nb);
    const int64_t row_bytes = K / block_values(type) * block_bytes(type);
    memset(dst + g0 * gbytes, 0, (size_t)((g1 - g0) * gbytes));
    for (int64_t n = g0 * DET_PG; n < rows && n < g1 * DET_PG; n++) {
        const uint8_t *row = src + n * row_bytes;
        uint8_t *group = dst + n / DET_PG * gbytes;
        const int r = (int)(n % DET_PG);
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *rec = (uint8_t *)pack_record(group, &f, b), *cons = rec + pack_codes_bytes(&f);
            uint8_t *hdr = (uint8_t *)pack_header(group, &f, b);
#if !defined(VW)    /* the vector builds write the codes from the chunk's unpacking (det_pack_codes_v) */
            uint8_t c[32];
            det_consts k;
            unpack_block(type, row, b, c, &k);
            for (int i = 0; i < 32; i++) {
                const int g = i / 4, at = 4 * r + i % 4;
                if (f.bytes8) {
                    rec[64 * g + at] = c[i];
                    continue;
                }
                rec[64 * (g % 4) + at] |= (uint8_t)((c[i] & 15) << (g < 4 ? 0 : 4));
                if (f.hbits == 1) rec[256 + at] |= (uint8_t)(((c[i] >> 4) & 1) << g);
                if (f.hbits == 2) rec[256 + 64 * (g / 4) + at] |= (uint8_t)(((c[i] >> 4) & 3) << (2 * (g % 4)));
            }
#endif
            switch (type) {
            case T_Q4_0:
            case T_Q4_1:
            case T_Q5_0:
            case T_Q5_1:
            case T_Q8_0: {
                const uint8_t *blk = row + b * block_bytes(type);
                memcpy(cons + 2 * r, blk, 2);
                if (type == T_Q4_1 || type == T_Q5_1) memcpy(cons + 32 + 2 * r, blk + 2, 2);
                break;
            }
            case T_Q4_K:
            case T_Q5_K: {
                const uint8_t *sb = row + b / 8 * block_bytes(type);
                int sc, mn;
                k4_scale_min(sb + 4, (int)(b % 8), &sc, &mn);
                cons[r] = (uint8_t)sc;
                cons[16 + r] = (uint8_t)mn;
                memcpy(hdr + 2 * r, sb, 2);
                memcpy(hdr + 32 + 2 * r, sb + 2, 2);
                break;
            }
            default: {
                const uint8_t *sb = row + b / 8 * 210;
                cons[r] = sb[192 + 2 * (b % 8)];
                cons[16 + r] = sb[192 + 2 * (b % 8) + 1];
                memcpy(hdr + 2 * r, sb + 208, 2);
                break;
            }
            }
        }
    }
}

#if defined(VW)
/* The codes of groups [g0, g1) (whole DET_COLS rows of them) from the chunk's vector unpacking, a plane at a time:
 * -3 without the memory for its buffer. */
static int det_pack_codes_v(int64_t type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst, int64_t g0,
                            int64_t g1) {
    const pack_fmt f = pack_format(type);
    const int64_t nb = K / 32, gbytes = pack_group_bytes(type, nb);
    const int64_t row_bytes = K / block_values(type) * block_bytes(type);
    uint8_t *zero = calloc(1, (size_t)row_bytes);              /* the padding rows' blocks: codes 0 */
    det_chunk *ch = aligned_alloc(64, sizeof(det_chunk));
    if (zero == NULL || ch == NULL) {
        free(zero);
        free(ch);
        return -3;
    }
    const __m256i m4 = _mm256_set1_epi8(15), m1 = _mm256_set1_epi8(1), m2 = _mm256_set1_epi8(3);
    for (int64_t n0 = g0 * DET_PG; n0 < g1 * DET_PG; n0 += DET_COLS) {
        const uint8_t *rp[DET_COLS];
        for (int c = 0; c < DET_COLS; c++) rp[c] = n0 + c < rows ? src + (n0 + c) * row_bytes : zero;
        for (int64_t b0 = 0; b0 < nb; b0 += DET_CHUNK) {
            const int64_t nbc = nb - b0 < DET_CHUNK ? nb - b0 : DET_CHUNK;
            unpack_chunk(type, rp, b0, nbc, ch);
            for (int o = 0; o < DET_COLS / DET_PG; o++) {
                uint8_t *group = dst + (n0 / DET_PG + o) * gbytes;
                for (int64_t b = 0; b < nbc; b++) {
                    uint8_t *rec = (uint8_t *)pack_record(group, &f, b0 + b);
                    for (int h = 0; h < 2; h++) {
                        __m256i c[8];
                        for (int g = 0; g < 8; g++) c[g] = load_b32(ch->codes[b][g] + 64 * o + 32 * h);
                        if (f.bytes8) {          /* the file's signed codes (the chunk's are shifted for the dot) */
                            for (int g = 0; g < 8; g++)
                                _mm256_storeu_si256((__m256i *)(rec + 64 * g + 32 * h),
                                                    Q8_SHIFT ? _mm256_xor_si256(c[g], _mm256_set1_epi8((char)0x80)) : c[g]);
                            continue;
                        }
                        for (int g = 0; g < 4; g++)
                            _mm256_storeu_si256((__m256i *)(rec + 64 * g + 32 * h),
                                                _mm256_or_si256(_mm256_and_si256(c[g], m4),
                                                                _mm256_slli_epi16(_mm256_and_si256(c[g + 4], m4), 4)));
                        for (int hh = 0; hh < f.hbits; hh++) {
                            __m256i hb = _mm256_setzero_si256();
                            for (int g = 0; g < 8; g++) {
                                const __m256i top = _mm256_srli_epi16(c[g], 4);
                                if (f.hbits == 1)
                                    hb = _mm256_or_si256(hb, _mm256_slli_epi16(_mm256_and_si256(top, m1), g));
                                else if (g / 4 == hh)
                                    hb = _mm256_or_si256(hb, _mm256_slli_epi16(_mm256_and_si256(top, m2), 2 * (g % 4)));
                            }
                            _mm256_storeu_si256((__m256i *)(rec + 256 + 64 * hh + 32 * h), hb);
                        }
                    }
                }
            }
        }
    }
    free(zero);
    free(ch);
    return 0;
}
#endif

#if defined(VW)
/* Packed groups of weight rows [n0, n0 + DET_COLS) into the chunk's buffer, blocks [b0, b0 + nbc): the
 * codes' planes split (and Q8_0's shifted as the dot takes them), the constants widened as consts8 does
 * (the same float operations). */
static inline __attribute__((always_inline)) void unpack_packed_body(const int64_t type, const uint8_t *data, int64_t nb,
                                                                     int64_t n0, int64_t b0, int64_t nbc, det_chunk *ch) {
    const pack_fmt f = pack_format(type);
    const int64_t gbytes = pack_group_bytes(type, nb);
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int o = 0; o < DET_COLS / DET_PG; o++) {
        const uint8_t *group = data + (n0 / DET_PG + o) * gbytes;
        for (int64_t b = 0; b < nbc; b++) {
            const uint8_t *rec = pack_record(group, &f, b0 + b), *cons = rec + pack_codes_bytes(&f);
            const uint8_t *hdr = pack_header(group, &f, b0 + b);
            for (int64_t l = 0; l < pack_rec_bytes(&f); l += 64) _mm_prefetch((const char *)(rec + DET_PACK_PF + l), _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {               /* rows 8 h .. 8 h + 7 of the group: 32 bytes */
                for (int g = 0; g < 8; g++) {
                    __m256i c;
                    if (f.bytes8) {
                        c = load_b32(rec + 64 * g + 32 * h);
                        if (Q8_SHIFT) c = _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80));
                    } else {
                        const __m256i l = load_b32(rec + 64 * (g % 4) + 32 * h);
                        c = _mm256_and_si256(g < 4 ? l : _mm256_srli_epi16(l, 4), m4);
                        if (f.hbits == 1) {
                            const __m256i hb = _mm256_srli_epi16(load_b32(rec + 256 + 32 * h), g);
                            c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(1)), 4));
                        } else if (f.hbits == 2) {
                            const __m256i hb = _mm256_srli_epi16(load_b32(rec + 256 + 64 * (g / 4) + 32 * h), 2 * (g % 4));
                            c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(hb, _mm256_set1_epi8(3)), 4));
                        }
                    }
                    _mm256_store_si256((__m256i *)(ch->codes[b][g] + 64 * o + 32 * h), c);
                }
                float *A = ch->A[b] + DET_PG * o + 8 * h, *M = ch->M[b] + DET_PG * o + 8 * h;
                const __m128i lo8 = _mm_loadl_epi64((const __m128i *)(cons + 8 * h));
                const __m128i hi8 = _mm_loadl_epi64((const __m128i *)(cons + 16 + 8 * h));
                switch (type) {
                case T_Q4_1:
                case T_Q5_1:
                    _mm256_store_ps(A, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cons + 16 * h))));
                    _mm256_store_ps(M, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cons + 32 + 16 * h))));
                    break;
                case T_Q4_0:
                case T_Q5_0:
                case T_Q8_0:
                    _mm256_store_ps(A, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cons + 16 * h))));
                    _mm256_store_ps(M, _mm256_setzero_ps());
                    break;
                case T_Q4_K:
                case T_Q5_K: {
                    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * h)));
                    const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 32 + 16 * h)));
                    _mm256_store_ps(A, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo8))));
                    /* -(dmin * mn): the negation is exact */
                    _mm256_store_ps(M, _mm256_xor_ps(_mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi8))),
                                                     _mm256_set1_ps(-0.0f)));
                    break;
                }
                default:
                    _mm256_store_ps(A, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(hdr + 16 * h))));
                    _mm256_store_ps(M, _mm256_setzero_ps());
                    _mm256_store_si256((__m256i *)(ch->S0[b] + DET_PG * o + 8 * h), _mm256_cvtepi8_epi32(lo8));
                    _mm256_store_si256((__m256i *)(ch->S1[b] + DET_PG * o + 8 * h), _mm256_cvtepi8_epi32(hi8));
                    break;
                }
            }
        }
    }
}

/* ---- decode steps straight from the packed layout: VW weight rows in the lanes, no buffer -------------- */
#if VW == 16
#define PV_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define PV_AND(a, b) _mm512_and_si512(a, b)
#define PV_OR(a, b) _mm512_or_si512(a, b)
#define PV_SRL16(a, n) _mm512_srli_epi16(a, n)
#define PV_SLL16(a, n) _mm512_slli_epi16(a, n)
#define PV_BYTES(v) _mm512_set1_epi8((char)(v))
#define PV_XOR(a, b) _mm512_xor_si512(a, b)
#define PV_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define PV_U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define PV_I8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define PV_NEG(a) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)))
#define VF_ZERO() _mm512_setzero_ps()
#else
#define PV_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define PV_AND(a, b) _mm256_and_si256(a, b)
#define PV_OR(a, b) _mm256_or_si256(a, b)
#define PV_SRL16(a, n) _mm256_srli_epi16(a, n)
#define PV_SLL16(a, n) _mm256_slli_epi16(a, n)
#define PV_BYTES(v) _mm256_set1_epi8((char)(v))
#define PV_XOR(a, b) _mm256_xor_si256(a, b)
#define PV_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define PV_U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define PV_I8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define PV_NEG(a) _mm256_xor_ps(a, _mm256_set1_ps(-0.0f))
#define VF_ZERO() _mm256_setzero_ps()
#endif

/* Steps of up to this many rows read the packed layout straight (bigger ones by the chunk's buffer onto the tiles,
 * or in passes of this many rows without them): on the AVX-512 and AVX2 builds alike faster than the chunk's
 * buffer up to 16 rows and more (`scripts/ab/ab_kernels.py layers --layer-threads 1 --clock cpu --isa LEVEL
 * --numerics deterministic,deterministic-file`, docs/benchmarks.md), with a row's sums in registers. */
#ifndef DET_PACK_DIRECT_ROWS
#define DET_PACK_DIRECT_ROWS 16
#endif

/* Rows [0, T) of x (T <= DET_PACK_DIRECT_ROWS) against weight rows VW * hv .. of a packed group (the lanes; VW is
 * the group with AVX-512, half of it with AVX2), into out's columns col0 .. col0 + cols: block by block, the
 * 8 code vectors split from their planes, one broadcast of x's 4 hi (lo) bytes and one VPDPBUSD a group, the
 * terms as block_term_v makes them (the same operations in the same order: the same bits). Inlined per type. */
static inline __attribute__((always_inline)) void packed_direct_body(const det_job *jb, const uint8_t *group, int hv,
                                                                     int cols, int64_t col0, int64_t t0, int64_t T,
                                                                     const int64_t type) {
    const pack_fmt f = pack_format(type);
    const int64_t nb = jb->nb;
    const int q6 = type == T_Q6_K;
    const int32_t z = type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : type == T_Q8_0 ? Q8_SHIFT : 0;
    const int off = VW * 4 * hv;                          /* the lanes' bytes in each 64-byte group of codes */
    vfl s[DET_PACK_DIRECT_ROWS];
    for (int t = 0; t < T; t++) s[t] = VF_ZERO();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *rec = pack_record(group, &f, b), *cons = rec + pack_codes_bytes(&f);
        const uint8_t *hdr = pack_header(group, &f, b);
        for (int64_t l = 0; l < pack_rec_bytes(&f); l += 64) _mm_prefetch((const char *)(rec + DET_PACK_PF + l), _MM_HINT_T0);
        vi w[8];
        if (f.bytes8) {
            for (int g = 0; g < 8; g++) {
                w[g] = PV_LOAD(rec + 64 * g + off);
                if (Q8_SHIFT) w[g] = PV_XOR(w[g], PV_BYTES(0x80));
            }
        } else {
            for (int g = 0; g < 4; g++) {
                const vi l = PV_LOAD(rec + 64 * g + off);
                w[g] = PV_AND(l, PV_BYTES(15));
                w[g + 4] = PV_AND(PV_SRL16(l, 4), PV_BYTES(15));
            }
            if (f.hbits == 1) {
                const vi hb = PV_LOAD(rec + 256 + off);
                for (int g = 0; g < 8; g++) w[g] = PV_OR(w[g], PV_SLL16(PV_AND(PV_SRL16(hb, g), PV_BYTES(1)), 4));
            } else if (f.hbits == 2) {
                for (int g = 0; g < 8; g++) {
                    const vi hb = PV_LOAD(rec + 256 + 64 * (g / 4) + off);
                    w[g] = PV_OR(w[g], PV_SLL16(PV_AND(PV_SRL16(hb, 2 * (g % 4)), PV_BYTES(3)), 4));
                }
            }
        }
        vfl A, M = VF_ZERO();
        vi S0 = VI_ZERO(), S1 = VI_ZERO();
        const int r0 = VW * hv;                           /* the lanes' first row in the group */
        if (type == T_Q4_K || type == T_Q5_K) {
            A = VF_MUL(PV_F16(hdr + 2 * r0), VF_CVT(PV_U8(cons + r0)));
            M = PV_NEG(VF_MUL(PV_F16(hdr + 32 + 2 * r0), VF_CVT(PV_U8(cons + 16 + r0))));
        } else if (q6) {
            A = PV_F16(hdr + 2 * r0);
            S0 = PV_I8(cons + r0);
            S1 = PV_I8(cons + 16 + r0);
        } else {
            A = PV_F16(cons + 2 * r0);
            if (type == T_Q4_1 || type == T_Q5_1) M = PV_F16(cons + 32 + 2 * r0);
        }
        for (int t = 0; t < T; t++) {
            const int8_t *xb = jb->xq + (t0 + t) * 2 * jb->K + 64 * b;
            vi Ih[2] = {VI_ZERO(), VI_ZERO()}, Il[2] = {VI_ZERO(), VI_ZERO()};
            for (int g = 0; g < 8; g++) {
                const int k = q6 && g >= 4;
                int32_t xh, xl;
                memcpy(&xh, xb + 4 * g, 4);
                memcpy(&xl, xb + 32 + 4 * g, 4);
                const vi xhv = VI_SET1(xh), xlv = VI_SET1(xl);
#if !defined(DET_VNNI)
                if (type == T_Q8_0) {            /* signed codes: |w| against x with w's sign */
                    Ih[k] = DOT_U8(Ih[k], _mm256_abs_epi8(w[g]), _mm256_sign_epi8(xhv, w[g]));
                    Il[k] = DOT_U8(Il[k], _mm256_abs_epi8(w[g]), _mm256_sign_epi8(xlv, w[g]));
                    continue;
                }
#endif
                Ih[k] = DOT_U8(Ih[k], w[g], xhv);
                Il[k] = DOT_U8(Il[k], w[g], xlv);
            }
            const vi I0 = VI_ADD(VI_SHL7(Ih[0]), Il[0]);
            const int32_t bs = jb->bsum[(t0 + t) * nb + b];
            vi In;
            if (q6) {
                const vi I1 = VI_ADD(VI_SHL7(Ih[1]), Il[1]);
                const int32_t *hs = jb->hsum + (t0 + t) * 2 * nb + 2 * b;
                In = VI_ADD(VI_MUL(S0, VI_SUB(I0, VI_SET1(32 * hs[0]))), VI_MUL(S1, VI_SUB(I1, VI_SET1(32 * hs[1]))));
            } else {
                In = VI_SUB(I0, VI_SET1(z * bs));
            }
            const vfl d = VF_SET1(jb->dx[(t0 + t) * nb + b]);
            const vfl a = VF_MUL(A, d), m = VF_MUL(M, d);
            s[t] = VF_ADD(s[t], VF_ADD(VF_MUL(a, VF_CVT(In)), VF_MUL(m, VF_SET1((float)bs))));
        }
    }
    for (int t = 0; t < T; t++) {
        float o[VW];
        VF_STOREU(o, s[t]);
        for (int c = 0; c < cols; c++) jb->out[(t0 + t) * jb->ldo + col0 + c] = o[c];
    }
}

static void packed_direct(const det_job *jb, int64_t type, const uint8_t *group, int hv, int cols, int64_t col0,
                          int64_t t0, int64_t T) {
    switch (type) {
    case T_Q4_0: packed_direct_body(jb, group, hv, cols, col0, t0, T, T_Q4_0); return;
    case T_Q4_1: packed_direct_body(jb, group, hv, cols, col0, t0, T, T_Q4_1); return;
    case T_Q5_0: packed_direct_body(jb, group, hv, cols, col0, t0, T, T_Q5_0); return;
    case T_Q5_1: packed_direct_body(jb, group, hv, cols, col0, t0, T, T_Q5_1); return;
    case T_Q8_0: packed_direct_body(jb, group, hv, cols, col0, t0, T, T_Q8_0); return;
    case T_Q4_K: packed_direct_body(jb, group, hv, cols, col0, t0, T, T_Q4_K); return;
    case T_Q5_K: packed_direct_body(jb, group, hv, cols, col0, t0, T, T_Q5_K); return;
    default: packed_direct_body(jb, group, hv, cols, col0, t0, T, T_Q6_K); return;
    }
}

static void unpack_packed_chunk(int64_t type, const uint8_t *data, int64_t nb, int64_t n0, int64_t b0, int64_t nbc,
                                det_chunk *ch) {
    switch (type) {
    case T_Q4_0: unpack_packed_body(T_Q4_0, data, nb, n0, b0, nbc, ch); return;
    case T_Q4_1: unpack_packed_body(T_Q4_1, data, nb, n0, b0, nbc, ch); return;
    case T_Q5_0: unpack_packed_body(T_Q5_0, data, nb, n0, b0, nbc, ch); return;
    case T_Q5_1: unpack_packed_body(T_Q5_1, data, nb, n0, b0, nbc, ch); return;
    case T_Q8_0: unpack_packed_body(T_Q8_0, data, nb, n0, b0, nbc, ch); return;
    case T_Q4_K: unpack_packed_body(T_Q4_K, data, nb, n0, b0, nbc, ch); return;
    case T_Q5_K: unpack_packed_body(T_Q5_K, data, nb, n0, b0, nbc, ch); return;
    default: unpack_packed_body(T_Q6_K, data, nb, n0, b0, nbc, ch); return;
    }
}
#endif

/* Bytes the packed layout of `rows` rows of `type` (K values each) takes (qmatmul_det_pack.h), or -1 for a type or K
 * it does not take. */
int64_t forge_det_pack_bytes(int64_t type, int64_t rows, int64_t K) {
    if (!forge_qmatmul_det_type(type) || K <= 0 || K % block_values(type) != 0) return -1;
    return (rows + DET_PACK_ROWS - 1) / DET_PACK_ROWS * DET_PACK_ROWS / DET_PG * pack_group_bytes(type, K / 32);
}

FORGE_HIDDEN int64_t det_group_bytes(int64_t type, int64_t K) { return pack_group_bytes(type, K / 32); }

typedef struct {
    int64_t type, rows, K, groups;
    const uint8_t *src;
    uint8_t *dst;
    _Atomic int error;
} det_pack_job;

static void det_pack_part(const void *ctx, int index, int count) {
    det_pack_job *jb = (det_pack_job *)ctx;
    const int64_t units = jb->groups / 2;                   /* DET_PACK_ROWS rows: whole DET_COLS of every build */
    const int64_t g0 = 2 * (units * index / count), g1 = 2 * (units * (index + 1) / count);
    if (g0 >= g1) return;
    det_pack_rows(jb->type, jb->src, jb->rows, jb->K, jb->dst, g0, g1);
#if defined(VW)
    if (det_pack_codes_v(jb->type, jb->src, jb->rows, jb->K, jb->dst, g0, g1) != 0)
        atomic_store((_Atomic int *)&jb->error, -3);
#endif
}

/* The file's blocks of `rows` rows at src in the packed layout at dst (forge_det_pack_bytes of it), on the pool's
 * threads: 0, or -1 (a type or K it does not take), -3 (no memory). */
int forge_det_pack(int64_t type, const uint8_t *src, int64_t rows, int64_t K, uint8_t *dst) {
    const int64_t size = forge_det_pack_bytes(type, rows, K);
    if (size < 0) return -1;
    det_pack_job jb = {.type = type, .rows = rows, .K = K, .groups = size / pack_group_bytes(type, K / 32),
                       .src = src, .dst = dst};
    atomic_init(&jb.error, 0);
    forge_run_parallel(det_pack_part, &jb, jb.groups > 2);
    return atomic_load(&jb.error);
}

#endif
