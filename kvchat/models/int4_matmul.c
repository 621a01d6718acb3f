/* The int4 linear layers' matmul: 4-bit weights in groups of 32 columns sharing a float16
 * scale and zero (w = q * scale + zero, q in [0, 15]: GGUF's Q4_1 grids exactly, as its d and
 * m are float16, and Q4_K's to float16's 11 bits), bfloat16 activations in, bfloat16 outputs
 * out, each output's sums in one order that depends on neither the number of rows, nor the
 * threads, nor the instruction set.
 *
 * Each activation group (32 columns of one row) is first written as 16-bit integers on a
 * power-of-two grid: with e the largest exponent field of its values (at least 15), the unit is
 * u = 2^(e - 141) and x_int = x / u rounded to nearest even, so every value within 7 binades of
 * the group's largest is held exactly, the rest to 2^-15 of it, and |x_int| <= 32,640 (in a
 * group whose largest value is below 2^-112 the floor on e makes the unit coarser than that).
 * Denormal values count as zero; a group holding an infinity or NaN gets u = NaN. Then
 *
 *   out[m, r] = bf16(a + b),  a = fma(D_g * u_g, scale[r, g], a)  for g in order from a = 0,
 *                             b = fma(S_g * u_g, zero[r, g], b)   likewise,
 *
 * with D_g the group's sum of q[r, c] * x_int[m, c] and S_g its sum of x_int[m, c]: integer
 * sums, exact in any order (|D_g| < 2^24, so the float D_g and D_g * u_g are exact too, short
 * of overflow: values beyond about 2^118 take D_g * u_g to infinity, on every path alike).
 * Integer products let AVX-512 VNNI's vpdpwssd take 32 of them an instruction, and AVX2's
 * vpmaddwd 16, with the same bits.
 *
 * Layout: output rows in tiles of 16 (n % 16 == 0). Tile t's group g is 256 bytes at
 * (t * groups + g) * 256: 8 chunks s of 32 bytes, byte 2 r + h of chunk s holding row 16 t + r's
 * column 2 s + h in its low nibble and 16 + 2 s + h in its high one. Its scales and zeros are
 * float16 (n / 16, groups, 16): row 16 t + r's at (t * groups + g) * 16 + r. The weight stays
 * (n, k / 2) bytes and the scales (n, k / 32), each tile's rows whole.
 *
 * Built by kvchat/models/native.py with -fopenmp; it needs only libc, libm and libgomp. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVCHAT_X86 1
#endif

#include "native_sums.h"

#define GROUP 32
#define TILE 16       /* output rows a tile holds */
#define TILE_BYTES 256 /* one group of a tile */
#define ROW_BLOCK 4   /* activation rows sharing one decode of a weight tile */
#define ROW_CHUNK 64  /* activation rows kept in cache while a thread's tiles pass over them */
#define PREFETCH 2048 /* bytes of weights ahead of the one read */
#define MIN_EXP 15    /* the smallest exponent field a unit is taken from: u >= 2^-126 */

typedef struct {
    const uint8_t *q;
    const uint16_t *scales, *zeros;
    const int16_t *xi;  /* (m_rows, k): x_int */
    const float *u, *s; /* (m_rows, groups): each group's unit and S_g * u_g */
    uint16_t *out;
    long m_rows, n, k, lo, hi; /* tiles [lo, hi) */
} job_t;

/* one activation row's groups as x_int, u and S * u (the definition above) */
static void quantize_row(const uint16_t *x, long k, int16_t *xi, float *u, float *s)
{
    for (long g = 0; g < k / GROUP; g++) {
        const uint16_t *v = x + g * GROUP;
        int top = MIN_EXP, bad = 0;
        for (int c = 0; c < GROUP; c++) {
            int e = (v[c] >> 7) & 0xff;
            bad |= e == 0xff;
            top = e > top ? e : top;
        }
        int32_t sum = 0;
        for (int c = 0; c < GROUP; c++) {
            int e = (v[c] >> 7) & 0xff, d = top - e;
            int32_t mant = 128 | (v[c] & 0x7f), val;
            if (e == 0 || e == 0xff) {
                val = 0;
            } else if (d <= 7) {
                val = mant << (7 - d);
            } else if (d - 7 >= 9) {
                val = 0;
            } else { /* mant / 2^sh to nearest even */
                int sh = d - 7;
                int32_t rem = mant & ((1 << sh) - 1), half = 1 << (sh - 1);
                val = mant >> sh;
                val += rem > half || (rem == half && (val & 1));
            }
            val = v[c] & 0x8000 ? -val : val;
            xi[g * GROUP + c] = (int16_t)val;
            sum += val;
        }
        float unit = bad ? NAN : ldexpf(1.0f, top - 141);
        u[g] = unit;
        s[g] = (float)sum * unit;
    }
}

/* out[m, 16 t + r] from a tile's 16 lanes a + b */
static void store_tile(const job_t *j, long m, long t, const float *a, const float *b)
{
    uint16_t *o = j->out + m * j->n + TILE * t;
    for (int r = 0; r < TILE; r++) o[r] = float_bf16(a[r] + b[r]);
}

static void tile_portable(const job_t *j, long t, long m)
{
    long groups = j->k / GROUP;
    const int16_t *xi = j->xi + m * j->k;
    float a[TILE] = {0}, b[TILE] = {0};
    for (long g = 0; g < groups; g++) {
        const uint8_t *w = j->q + (t * groups + g) * TILE_BYTES;
        const uint16_t *sc = j->scales + (t * groups + g) * TILE, *ze = j->zeros + (t * groups + g) * TILE;
        float u = j->u[m * groups + g], s = j->s[m * groups + g];
        for (int r = 0; r < TILE; r++) {
            int32_t d = 0;
            for (int c = 0; c < 16; c++) {
                uint8_t byte = w[32 * (c / 2) + 2 * r + c % 2];
                d += (byte & 15) * xi[g * GROUP + c] + (byte >> 4) * xi[g * GROUP + 16 + c];
            }
            a[r] = fmaf((float)d * u, half_float(sc[r]), a[r]);
            b[r] = fmaf(s, half_float(ze[r]), b[r]);
        }
    }
    store_tile(j, m, t, a, b);
}

static void rows_portable(const job_t *j)
{
    for (long t = j->lo; t < j->hi; t++)
        for (long m = 0; m < j->m_rows; m++) tile_portable(j, t, m);
}

#ifdef KVCHAT_X86
static inline int32_t pair_at(const int16_t *xi)
{
    int32_t v;
    memcpy(&v, xi, 4);
    return v;
}

/* A thread's tiles [lo, hi) against every activation row: ROW_CHUNK rows at a time stay in
 * cache while the tiles pass over them, ROW_BLOCK rows sharing each decode of a tile (the
 * tile function inlined for each block size, under the instruction set's target). */
#define ROWS(name, target_isa, tile)                                                   \
    __attribute__((target(target_isa))) static void name(const job_t *j)               \
    {                                                                                  \
        for (long c0 = 0; c0 < j->m_rows; c0 += ROW_CHUNK) {                           \
            long c1 = c0 + ROW_CHUNK < j->m_rows ? c0 + ROW_CHUNK : j->m_rows;         \
            for (long t = j->lo; t < j->hi; t++)                                       \
                for (long m0 = c0; m0 < c1; m0 += ROW_BLOCK) {                         \
                    switch (c1 - m0 < ROW_BLOCK ? c1 - m0 : ROW_BLOCK) {               \
                    case 1: tile(j, t, m0, 1); break;                                  \
                    case 2: tile(j, t, m0, 2); break;                                  \
                    case 3: tile(j, t, m0, 3); break;                                  \
                    default: tile(j, t, m0, 4); break;                                 \
                    }                                                                  \
                }                                                                      \
        }                                                                              \
    }

#define AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) inline

/* float_bf16 of 8 lanes, in order */
AVX2 static __m128i bf16x8_avx2(__m256 f)
{
    __m256i u = _mm256_castps_si256(f);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000)); /* both below 2^31 */
    __m256i h = _mm256_blendv_epi8(rounded, quiet, nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* Half h (rows 8 h to 8 h + 7) of tile t against activation rows m0 .. m0 + mb - 1: lane r of
 * a chunk's 16 words (its bytes 16 h to 16 h + 15) is row 8 h + r's pair of low nibbles, or,
 * shifted, of high ones; vpmaddwd sums each pair's products into 32 bits. */
AVX2 static void half_avx2(const job_t *j, long t, int h, long m0, int mb, __m256 *a, __m256 *b)
{
    long groups = j->k / GROUP, k = j->k;
    const __m256i low = _mm256_set1_epi16(15);
#pragma GCC unroll 4
    for (int m = 0; m < mb; m++) a[m] = b[m] = _mm256_setzero_ps();
    for (long g = 0; g < groups; g++) {
        const uint8_t *w = j->q + (t * groups + g) * TILE_BYTES + 16 * h;
        _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
        __m256i d0[ROW_BLOCK], d1[ROW_BLOCK];
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++) d0[m] = d1[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 32 * c)));
            __m256i lo = _mm256_and_si256(words, low), hi = _mm256_srli_epi16(words, 4);
#pragma GCC unroll 4
            for (int m = 0; m < mb; m++) {
                const int16_t *xg = j->xi + (m0 + m) * k + GROUP * g + 2 * c;
                __m256i p = _mm256_add_epi32(
                    _mm256_madd_epi16(lo, _mm256_set1_epi32(pair_at(xg))),
                    _mm256_madd_epi16(hi, _mm256_set1_epi32(pair_at(xg + 16))));
                if (c % 2) d1[m] = _mm256_add_epi32(d1[m], p);
                else d0[m] = _mm256_add_epi32(d0[m], p);
            }
        }
        long at = (t * groups + g) * TILE + 8 * h;
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(j->scales + at)));
        __m256 ze = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(j->zeros + at)));
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++) {
            long ug = (m0 + m) * groups + g;
            __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(d0[m], d1[m])),
                                     _mm256_set1_ps(j->u[ug]));
            a[m] = _mm256_fmadd_ps(d, sc, a[m]);
            b[m] = _mm256_fmadd_ps(_mm256_set1_ps(j->s[ug]), ze, b[m]);
        }
    }
}

AVX2 static void tile_avx2(const job_t *j, long t, long m0, int mb)
{
    __m256 a[2][ROW_BLOCK], b[2][ROW_BLOCK];
    half_avx2(j, t, 0, m0, mb, a[0], b[0]);
    half_avx2(j, t, 1, m0, mb, a[1], b[1]);
    for (int m = 0; m < mb; m++)
        for (int h = 0; h < 2; h++)
            _mm_storeu_si128((__m128i *)(j->out + (m0 + m) * j->n + TILE * t + 8 * h),
                             bf16x8_avx2(_mm256_add_ps(a[h][m], b[h][m])));
}

/* quantize_row, 8 values a register (32-bit lanes: AVX2 shifts 16-bit lanes by one count
 * only), the same integers, units and sums; rounding as quantize_row_avx512 says */
__attribute__((target("avx2"))) static void quantize_row_avx2(const uint16_t *x, long k,
                                                                int16_t *xi, float *u, float *s)
{
    const __m256i ff = _mm256_set1_epi32(0xff), x7f = _mm256_set1_epi32(0x7f);
    const __m256i b128 = _mm256_set1_epi32(128), seven = _mm256_set1_epi32(7);
    const __m256i one = _mm256_set1_epi32(1), nine = _mm256_set1_epi32(9);
    const __m256i zero = _mm256_setzero_si256(), sign = _mm256_set1_epi32(0x8000);
    for (long g = 0; g < k / GROUP; g++) {
        __m256i v[4], e[4], top = _mm256_set1_epi32(MIN_EXP), bad = zero;
        for (int p = 0; p < 4; p++) {
            const __m128i *at = (const __m128i *)(x + g * GROUP + 8 * p);
            v[p] = _mm256_cvtepu16_epi32(_mm_loadu_si128(at));
            e[p] = _mm256_and_si256(_mm256_srli_epi32(v[p], 7), ff);
            top = _mm256_max_epi32(top, e[p]);
            bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(e[p], ff));
        }
        __m128i t4 = _mm_max_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
        t4 = _mm_max_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_max_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        int top_e = _mm_cvtsi128_si32(t4);
        __m256i tops = _mm256_set1_epi32(top_e), sum = zero;
        for (int p = 0; p < 4; p++) {
            __m256i d = _mm256_sub_epi32(tops, e[p]);
            __m256i mant = _mm256_or_si256(_mm256_and_si256(v[p], x7f), b128);
            __m256i up = _mm256_max_epi32(_mm256_sub_epi32(seven, d), zero);
            __m256i left = _mm256_sllv_epi32(mant, up);
            __m256i sh = _mm256_min_epi32(_mm256_max_epi32(_mm256_sub_epi32(d, seven), one), nine);
            __m256i lsb = _mm256_and_si256(_mm256_srlv_epi32(mant, sh), one);
            __m256i bias = _mm256_sub_epi32(_mm256_sllv_epi32(one, _mm256_sub_epi32(sh, one)), one);
            __m256i right = _mm256_srlv_epi32(
                _mm256_add_epi32(_mm256_add_epi32(mant, bias), lsb), sh);
            __m256i val = _mm256_blendv_epi8(left, right, _mm256_cmpgt_epi32(d, seven));
            __m256i drop = _mm256_or_si256(_mm256_cmpeq_epi32(e[p], zero),
                                           _mm256_cmpeq_epi32(e[p], ff));
            val = _mm256_andnot_si256(drop, val);
            __m256i neg = _mm256_cmpeq_epi32(_mm256_and_si256(v[p], sign), sign);
            val = _mm256_sub_epi32(_mm256_xor_si256(val, neg), neg); /* -val where neg */
            sum = _mm256_add_epi32(sum, val);
            _mm_storeu_si128((__m128i *)(xi + g * GROUP + 8 * p),
                             _mm_packs_epi32(_mm256_castsi256_si128(val),
                                             _mm256_extracti128_si256(val, 1)));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        uint32_t bits = (uint32_t)(top_e - 14) << 23; /* 2^(top - 141), top - 141 >= -126 */
        float unit;
        memcpy(&unit, &bits, 4);
        unit = _mm256_movemask_epi8(bad) ? NAN : unit;
        u[g] = unit;
        s[g] = (float)_mm_cvtsi128_si32(s4) * unit;
    }
}

ROWS(rows_avx2, "avx2,fma,f16c", tile_avx2)

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) inline

/* float_bf16 of 16 lanes, in order (bf16x8_avx2's twice as wide) */
VNNI static __m256i bf16x16_avx512(__m512 f)
{
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

/* Tile t against activation rows m0 .. m0 + mb - 1: lane r of a chunk's 32 words is row r's
 * pair of low nibbles, or, shifted, of high ones; vpdpwssd adds each pair's products to it.
 * Each row's sums run in four chains (chunk parity, low or high), added at the group's end. */
VNNI static void tile_vnni(const job_t *j, long t, long m0, int mb)
{
    long groups = j->k / GROUP, k = j->k;
    const __m512i low = _mm512_set1_epi16(15);
    __m512 a[ROW_BLOCK], b[ROW_BLOCK];
#pragma GCC unroll 4
    for (int m = 0; m < mb; m++) a[m] = b[m] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        const uint8_t *w = j->q + (t * groups + g) * TILE_BYTES;
        _mm_prefetch((const char *)(w + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH + 192), _MM_HINT_T0);
        __m512i d[ROW_BLOCK][4];
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++)
            d[m][0] = d[m][1] = d[m][2] = d[m][3] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 32 * c)));
            __m512i lo = _mm512_and_si512(words, low), hi = _mm512_srli_epi16(words, 4);
#pragma GCC unroll 4
            for (int m = 0; m < mb; m++) {
                const int16_t *xg = j->xi + (m0 + m) * k + GROUP * g + 2 * c;
                d[m][2 * (c % 2)] = _mm512_dpwssd_epi32(d[m][2 * (c % 2)], lo,
                                                         _mm512_set1_epi32(pair_at(xg)));
                d[m][2 * (c % 2) + 1] = _mm512_dpwssd_epi32(d[m][2 * (c % 2) + 1], hi,
                                                             _mm512_set1_epi32(pair_at(xg + 16)));
            }
        }
        long at = (t * groups + g) * TILE;
        __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(j->scales + at)));
        __m512 ze = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(j->zeros + at)));
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++) {
            long ug = (m0 + m) * groups + g;
            __m512i sum = _mm512_add_epi32(_mm512_add_epi32(d[m][0], d[m][1]),
                                           _mm512_add_epi32(d[m][2], d[m][3]));
            __m512 dq = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(j->u[ug]));
            a[m] = _mm512_fmadd_ps(dq, sc, a[m]);
            b[m] = _mm512_fmadd_ps(_mm512_set1_ps(j->s[ug]), ze, b[m]);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < mb; m++) /* store_tile's a + b, 16 lanes at once */
        _mm256_storeu_si256((__m256i *)(j->out + (m0 + m) * j->n + TILE * t),
                            bf16x16_avx512(_mm512_add_ps(a[m], b[m])));
}

ROWS(rows_vnni, "avx512f,avx512bw,avx512vnni", tile_vnni)

/* quantize_row, 32 values (a group) a vector: the same integers, units and sums. The right
 * shift rounds to nearest even as (mant + 2^(sh-1) - 1 + lsb) >> sh with lsb the kept value's
 * last bit; shifts of 9 or more, which leave 0, are taken as 9 (16-bit lanes hold the sum). */
__attribute__((target("avx512f,avx512bw"))) static void quantize_row_avx512(
    const uint16_t *x, long k, int16_t *xi, float *u, float *s)
{
    const __m512i ff = _mm512_set1_epi16(0xff), x7f = _mm512_set1_epi16(0x7f);
    const __m512i b128 = _mm512_set1_epi16(128), seven = _mm512_set1_epi16(7);
    const __m512i one = _mm512_set1_epi16(1), nine = _mm512_set1_epi16(9);
    const __m512i zero = _mm512_setzero_si512();
    for (long g = 0; g < k / GROUP; g++) {
        __m512i v = _mm512_loadu_si512((const void *)(x + g * GROUP));
        __m512i e = _mm512_and_si512(_mm512_srli_epi16(v, 7), ff);
        __mmask32 bad = _mm512_cmpeq_epi16_mask(e, ff);
        __m256i m256 = _mm256_max_epu16(_mm512_castsi512_si256(e),
                                        _mm512_extracti64x4_epi64(e, 1));
        __m128i m128 = _mm_max_epu16(_mm256_castsi256_si128(m256),
                                     _mm256_extracti128_si256(m256, 1));
        /* the largest of eight: 0xffff less the smallest of their complements */
        int top = 0xffff - (_mm_cvtsi128_si32(_mm_minpos_epu16(
                                _mm_xor_si128(m128, _mm_set1_epi16(-1)))) & 0xffff);
        top = top > MIN_EXP ? top : MIN_EXP;
        __m512i d = _mm512_sub_epi16(_mm512_set1_epi16((short)top), e);
        __m512i mant = _mm512_or_si512(_mm512_and_si512(v, x7f), b128);
        __m512i left = _mm512_sllv_epi16(mant, _mm512_subs_epu16(seven, d));
        __m512i sh = _mm512_min_epu16(_mm512_max_epu16(_mm512_subs_epu16(d, seven), one), nine);
        __m512i lsb = _mm512_and_si512(_mm512_srlv_epi16(mant, sh), one);
        __m512i bias = _mm512_sub_epi16(_mm512_sllv_epi16(one, _mm512_sub_epi16(sh, one)), one);
        __m512i right = _mm512_srlv_epi16(_mm512_add_epi16(_mm512_add_epi16(mant, bias), lsb), sh);
        __m512i val = _mm512_mask_blend_epi16(_mm512_cmple_epu16_mask(d, seven), right, left);
        val = _mm512_maskz_mov_epi16(~(bad | _mm512_cmpeq_epi16_mask(e, zero)), val);
        val = _mm512_mask_sub_epi16(val, _mm512_movepi16_mask(v), zero, val);
        _mm512_storeu_si512((void *)(xi + g * GROUP), val);
        int32_t sum = _mm512_reduce_add_epi32(_mm512_madd_epi16(val, one));
        uint32_t bits = (uint32_t)(top - 14) << 23; /* 2^(top - 141), top - 141 >= -126 */
        float unit;
        memcpy(&unit, &bits, 4);
        unit = bad ? NAN : unit;
        u[g] = unit;
        s[g] = (float)sum * unit;
    }
}
#endif

/* 2: AVX-512 (F, BW, DQ) with VNNI and F16C, 1: AVX2 with FMA and F16C, 0: portable C */
int kvchat_int4_isa(void)
{
#ifdef KVCHAT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni")
        && __builtin_cpu_supports("f16c")) /* block_head.c's VNNI path takes DQ and F16C too */
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c"))
        return 1;
#endif
    return 0;
}

static int best_isa = -1;

/* q: (n, k / 2) bytes, scales, zeros: (n, k / 32) float16, in the layout above; x: (m_rows, k)
 * bfloat16; out: (m_rows, n) bfloat16. k must be a multiple of 32 and n of 16. Returns 0, -1
 * when the arguments are not that, -2 when out of memory. */
int kvchat_int4_mm(const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                   const uint16_t *x, uint16_t *out, long m_rows, long n, long k,
                   int threads, int force_isa)
{
    if (k <= 0 || k % GROUP || n <= 0 || n % TILE || m_rows < 0) return -1;
    if (m_rows == 0) return 0;
    long groups = k / GROUP;
    /* x_int, then the units and S * u: one allocation, whole cache lines */
    size_t xi_bytes = ((size_t)(m_rows * k) * sizeof(int16_t) + 63) / 64 * 64;
    size_t f_bytes = ((size_t)(m_rows * groups) * sizeof(float) + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, xi_bytes + 2 * f_bytes);
    if (scratch == NULL) return -2;
    int16_t *xi = (int16_t *)scratch;
    float *u = (float *)(scratch + xi_bytes), *s = (float *)(scratch + xi_bytes + f_bytes);
    if (best_isa < 0) best_isa = kvchat_int4_isa();
    int isa = force_isa >= 0 && force_isa < best_isa ? force_isa : best_isa;
    if (threads < 1) threads = 1;
    #pragma omp parallel for num_threads(m_rows < 16 ? 1 : threads) schedule(static)
    for (long m = 0; m < m_rows; m++) {
#ifdef KVCHAT_X86
        if (isa == 2) {
            quantize_row_avx512(x + m * k, k, xi + m * k, u + m * groups, s + m * groups);
            continue;
        }
        if (isa == 1) {
            quantize_row_avx2(x + m * k, k, xi + m * k, u + m * groups, s + m * groups);
            continue;
        }
#endif
        quantize_row(x + m * k, k, xi + m * k, u + m * groups, s + m * groups);
    }
    long tiles = n / TILE, per = (tiles + threads - 1) / threads;
    long chunks = (tiles + per - 1) / per;
    #pragma omp parallel for num_threads(chunks < threads ? (int)chunks : threads) \
        schedule(static, 1)
    for (long c = 0; c < chunks; c++) {
        job_t job = {q, scales, zeros, xi, u, s, out, m_rows, n, k, c * per,
                     c * per + per < tiles ? c * per + per : tiles};
#ifdef KVCHAT_X86
        if (isa == 2) { rows_vnni(&job); continue; }
        if (isa == 1) { rows_avx2(&job); continue; }
#endif
        rows_portable(&job);
    }
    free(scratch);
    return 0;
}
