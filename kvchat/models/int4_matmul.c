/* The int4 linear layers' matmul: 4-bit weights in groups of 32 columns sharing a float16
 * scale and zero (w = q * scale + zero, q in [0, 15]: GGUF's Q4_1 grids exactly, as its d and
 * m are float16, and Q4_K's to float16's 11 bits), bfloat16 activations in, bfloat16 outputs
 * out:
 *
 * out[m, r] = bf16( sum over groups g of  scale[r, g] * D(r, g, m)  +  zero[r, g] * S(g, m) )
 *
 * with D the group's dot product of q and x and S the group's sum of x, all in one fixed
 * order that depends on neither the number of rows, nor the threads, nor the instruction set:
 * - D in 16 lanes, lane l = float(p[2l] + p[2l+1]), p[c] = q[c] * x[c] (exact in float:
 *   4 bits times bfloat16's 8). This is what AVX-512 BF16's vdpbf16ps gives with a zero
 *   accumulator (its products are exact and their sum is rounded once); the AVX2 path gets it
 *   as fma(q[2l+1], x[2l+1], q[2l] * x[2l]) (the product inside is exact too), so all three
 *   paths agree bit for bit; denormal inputs and sums count as zero in each, as the
 *   instruction flushes them;
 * - the lanes accumulate by fma(D[l], scale, .), the even groups in one set of 16 lanes and the
 *   odd ones in another, each in group order (two chains, so one row is not bound by the fma
 *   latency);
 * - S per group: the same pair sums over x, then the tree below; the zero terms in 16 lanes,
 *   lane l taking the groups g with g % 16 == l by fma in group order;
 * - the three sets are added lane by lane ((even + odd) + zero) and the 16 lanes summed as a
 *   fixed tree (l + l+8, + l+4, + l+2, + l+1).
 *
 * Layout of q (N, K / 2 bytes): each pair of groups (64 columns, 32 bytes) holds column i in
 * byte i's low nibble and column 32 + i in its high nibble; an odd last group (16 bytes) holds
 * column i low and 16 + i high.
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
#define ROW_BLOCK 8 /* activation rows sharing one decode of a weight group */
#define TILE_BYTES (192 * 1024) /* packed weight rows kept in cache across the row blocks */
#define PREFETCH 2048 /* bytes of weights ahead of the one read */
#define PAD8(g) (((g) + 7) / 8 * 8)
#define SCALES_MAX 2048 /* groups per row the AVX-512 path takes (k up to 65,536) */
/* floats of a thread's scratch row (AVX2): a weight row's scales and zeros, whole cache lines */
#define SCRATCH(k) ((2 * PAD8((k) / GROUP) + 15) / 16 * 16)

typedef struct {
    const uint8_t *q;
    const uint16_t *scales, *zeros, *x;
    const float *xsum; /* (m_rows, groups) */
    const float *xf;   /* AVX2: (m_rows, groups, 32): each group's even columns, then its odd */
    uint16_t *out;
    long m_rows, n, k, lo, hi;
    int x_tiny;     /* AVX2: split_x's answer */
    float *scratch; /* AVX2: one row's scales and zeros as floats, a thread's own */
    const float *xpad; /* AVX2: xsum, each row run on with zeros to PAD8(groups) */
} job_t;

static inline float bf16_float(uint16_t v)
{
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float flushed(float f) /* denormals to zero, as vdpbf16ps takes and gives them */
{
    return fabsf(f) < 1.17549435e-38f ? 0.0f * f : f;
}

/* q[c] for column c of a row (the layout above) */
static inline int nibble(const uint8_t *row, long c, long groups)
{
    long g = c / GROUP, i = c % GROUP;
    if (g == groups - 1 && groups % 2) {
        uint8_t byte = row[g * 16 + (i % 16)];
        return i < 16 ? byte & 15 : byte >> 4;
    }
    long pair = g / 2, j = (g % 2) * 32 + i; /* column within the pair's 64 */
    uint8_t byte = row[pair * 32 + (j % 32)];
    return j < 32 ? byte & 15 : byte >> 4;
}

static void group_sums(const uint16_t *x, float *xsum, long m_rows, long k)
{
    long groups = k / GROUP;
    for (long m = 0; m < m_rows; m++)
        for (long g = 0; g < groups; g++) {
            const uint16_t *v = x + m * k + g * GROUP;
            float lane[16];
            for (int l = 0; l < 16; l++) lane[l] = bf16_float(v[2 * l]) + bf16_float(v[2 * l + 1]);
            xsum[m * groups + g] = tree16(lane);
        }
}

static void zero_lanes(const uint16_t *zeros, const float *xsum, long groups, float *lane)
{
    for (int l = 0; l < 16; l++) lane[l] = 0.0f;
    for (long g = 0; g < groups; g++)
        lane[g % 16] = fmaf(half_float(zeros[g]), xsum[g], lane[g % 16]);
}

static void rows_portable(const job_t *j)
{
    long groups = j->k / GROUP, k = j->k;
    for (long m = 0; m < j->m_rows; m++) {
        const uint16_t *x = j->x + m * k;
        for (long r = j->lo; r < j->hi; r++) {
            const uint8_t *row = j->q + r * (k / 2);
            float acc[2][16] = {{0}}, lanes[16];
            for (long g = 0; g < groups; g++) {
                float scale = half_float(j->scales[r * groups + g]);
                for (int l = 0; l < 16; l++) {
                    long c = g * GROUP + 2 * l;
                    float p0 = (float)nibble(row, c, groups) * flushed(bf16_float(x[c]));
                    float p1 = (float)nibble(row, c + 1, groups) * flushed(bf16_float(x[c + 1]));
                    acc[g % 2][l] = fmaf(flushed(p0 + p1), scale, acc[g % 2][l]);
                }
            }
            float z[16];
            zero_lanes(j->zeros + r * groups, j->xsum + m * groups, groups, z);
            for (int l = 0; l < 16; l++) lanes[l] = (acc[0][l] + acc[1][l]) + z[l];
            j->out[m * j->n + r] = float_bf16(tree16(lanes));
        }
    }
}

#ifdef KVCHAT_X86
/* weight rows per tile: TILE_BYTES of packed rows, a multiple of 16, stay in cache while every
 * row block of activations passes over them */
static long tile_rows(long k)
{
    long tile = TILE_BYTES / (k / 2);
    return tile < 16 ? 16 : tile / 16 * 16;
}

/* x as the AVX2 path reads it: per group its 16 even columns, then its 16 odd ones, as floats
 * with denormals flushed (what vdpbf16ps does with them). Returns 1 when some nonzero x is
 * below 2^-118: only then can a pair sum q0 x0 + q1 x1 be denormal (both products are
 * multiples of 2^(e - 7) for the smaller exponent e, so a nonzero sum is at least 2^-125). */
static int split_x(const uint16_t *x, float *xf, long m_rows, long k)
{
    int tiny = 0;
    for (long m = 0; m < m_rows; m++)
        for (long c = 0; c < k; c += 2) {
            float *out = xf + m * k + (c / GROUP) * GROUP + (c % GROUP) / 2;
            out[0] = flushed(bf16_float(x[m * k + c]));
            out[GROUP / 2] = flushed(bf16_float(x[m * k + c + 1]));
            for (int i = 0; i < 2; i++) {
                float a = fabsf(out[i * GROUP / 2]);
                tiny |= a != 0.0f && a < 0x1p-118f;
            }
        }
    return tiny;
}

#define AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) inline
#define AVX2_ROW_BLOCK 4

/* n float16s as floats, then zeros up to a multiple of 8 (the AVX2 path reads whole vectors) */
AVX2 static void halves_float(const uint16_t *h, long n, float *out)
{
    long g = 0;
    for (; g + 8 <= n; g += 8)
        _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
    if (g < n) {
        uint16_t rest[8] = {0};
        memcpy(rest, h + g, sizeof(uint16_t) * (size_t)(n - g));
        _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rest)));
    }
}

/* zero_lanes in two sets of 8 lanes: groups g with g % 16 == l, by fma in group order; `zeros`
 * and `xsum` run on with zeros to a multiple of 8 groups, whose fma(0, 0, .) changes no lane
 * (a lane is never -0: it starts at +0, and x + (+0) and exact cancellations give +0) */
AVX2 static void zero_lanes256(const float *zeros, const float *xsum, long groups,
                               __m256 *lo, __m256 *hi)
{
    __m256 lane[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long g = 0; g < groups; g += 8)
        lane[(g / 8) % 2] = _mm256_fmadd_ps(_mm256_loadu_ps(zeros + g), _mm256_loadu_ps(xsum + g),
                                            lane[(g / 8) % 2]);
    *lo = lane[0];
    *hi = lane[1];
}

/* tree16 over lanes lo (0-7) and hi (8-15) */
AVX2 static float sum256(__m256 lo, __m256 hi)
{
    __m256 a = _mm256_add_ps(lo, hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* the low 4 bits of each 32-bit lane of v >> shift, as floats */
AVX2 static __m256 nibbles(__m256i v, int shift)
{
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, shift),
                                               _mm256_set1_epi32(15)));
}

/* block_bf16's work on AVX2: `mb` activation rows against weight rows [lo, hi). Lane l of a
 * half h (0: lanes 0-7, 1: 8-15) reads bytes 16h + 2l and 16h + 2l + 1 of a pair, as one
 * 32-bit word: their low nibbles are the even group's columns, their high ones the odd's. The
 * halves are independent lanes, so each runs alone over the row (half the accumulators live at
 * once). `flush`: a pair sum may be denormal (see split_x); else the test is skipped. */
AVX2 static void block_avx2(const job_t *j, long m0, int mb, long lo, long hi, int flush)
{
    long groups = j->k / GROUP, k = j->k, pairs = groups / 2;
    const __m256 tiny = _mm256_set1_ps(1.17549435e-38f);
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (long r = lo; r < hi; r++) {
        const uint8_t *row = j->q + r * (k / 2);
        float *s = j->scratch, *zf = j->scratch + PAD8(groups);
        halves_float(j->scales + r * groups, groups, s);
        halves_float(j->zeros + r * groups, groups, zf);
        __m256 lanes[AVX2_ROW_BLOCK][2];
        for (int h = 0; h < 2; h++) {
            __m256 acc[AVX2_ROW_BLOCK], odd[AVX2_ROW_BLOCK];
#pragma GCC unroll 4
            for (int m = 0; m < mb; m++) acc[m] = odd[m] = _mm256_setzero_ps();
            for (long p = 0; p < pairs; p++) {
                if (h == 0) _mm_prefetch((const char *)(row + 32 * p + PREFETCH), _MM_HINT_T0);
                __m256 s0 = _mm256_broadcast_ss(s + 2 * p);
                __m256 s1 = _mm256_broadcast_ss(s + 2 * p + 1);
                __m256i v = _mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)(row + 32 * p + 16 * h)));
                __m256 ae = nibbles(v, 0), ao = nibbles(v, 8);
                __m256 be = nibbles(v, 4), bo = nibbles(v, 12);
#pragma GCC unroll 4
                for (int m = 0; m < mb; m++) {
                    const float *xa = j->xf + (m0 + m) * k + 64 * p + 8 * h, *xb = xa + GROUP;
                    __m256 da = _mm256_fmadd_ps(ao, _mm256_loadu_ps(xa + 16),
                                                _mm256_mul_ps(ae, _mm256_loadu_ps(xa)));
                    __m256 db = _mm256_fmadd_ps(bo, _mm256_loadu_ps(xb + 16),
                                                _mm256_mul_ps(be, _mm256_loadu_ps(xb)));
                    if (flush) { /* denormal sums to zero, NaN kept, as the portable path */
                        da = _mm256_and_ps(da, _mm256_cmp_ps(_mm256_and_ps(da, abs), tiny,
                                                             _CMP_NLT_UQ));
                        db = _mm256_and_ps(db, _mm256_cmp_ps(_mm256_and_ps(db, abs), tiny,
                                                             _CMP_NLT_UQ));
                    }
                    acc[m] = _mm256_fmadd_ps(da, s0, acc[m]);
                    odd[m] = _mm256_fmadd_ps(db, s1, odd[m]);
                }
            }
            if (groups % 2) { /* an odd last group: lanes 0-7 low nibbles, 8-15 high ones */
                long g = groups - 1;
                __m256 sg = _mm256_broadcast_ss(s + g);
                __m256i v = _mm256_srli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                    (const __m128i *)(row + 16 * g))), 4 * h);
                __m256 qe = nibbles(v, 0), qo = nibbles(v, 8);
#pragma GCC unroll 4
                for (int m = 0; m < mb; m++) {
                    const float *xg = j->xf + (m0 + m) * k + GROUP * g + 8 * h;
                    __m256 d = _mm256_fmadd_ps(qo, _mm256_loadu_ps(xg + 16),
                                               _mm256_mul_ps(qe, _mm256_loadu_ps(xg)));
                    if (flush)
                        d = _mm256_and_ps(d, _mm256_cmp_ps(_mm256_and_ps(d, abs), tiny,
                                                           _CMP_NLT_UQ));
                    acc[m] = _mm256_fmadd_ps(d, sg, acc[m]);
                }
            }
#pragma GCC unroll 4
            for (int m = 0; m < mb; m++) lanes[m][h] = _mm256_add_ps(acc[m], odd[m]);
        }
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++) {
            __m256 z0, z1;
            zero_lanes256(zf, j->xpad + (m0 + m) * PAD8(groups), groups, &z0, &z1);
            j->out[(m0 + m) * j->n + r] = float_bf16(
                sum256(_mm256_add_ps(lanes[m][0], z0), _mm256_add_ps(lanes[m][1], z1)));
        }
    }
}

__attribute__((target("avx2,fma,f16c")))
static void rows_avx2(const job_t *j)
{
    long tile = tile_rows(j->k);
    for (long t = j->lo; t < j->hi; t += tile) {
        long hi = t + tile < j->hi ? t + tile : j->hi;
        for (long m0 = 0; m0 < j->m_rows; m0 += AVX2_ROW_BLOCK) {
            long left = j->m_rows - m0;
            int mb = left < AVX2_ROW_BLOCK ? (int)left : AVX2_ROW_BLOCK;
            if (j->x_tiny) {
                switch (mb) {
                case 1: block_avx2(j, m0, 1, t, hi, 1); break;
                case 2: block_avx2(j, m0, 2, t, hi, 1); break;
                case 3: block_avx2(j, m0, 3, t, hi, 1); break;
                default: block_avx2(j, m0, 4, t, hi, 1); break;
                }
            } else {
                switch (mb) {
                case 1: block_avx2(j, m0, 1, t, hi, 0); break;
                case 2: block_avx2(j, m0, 2, t, hi, 0); break;
                case 3: block_avx2(j, m0, 3, t, hi, 0); break;
                default: block_avx2(j, m0, 4, t, hi, 0); break;
                }
            }
        }
    }
}

#define BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"), \
                            always_inline)) inline

/* zero_lanes, 16 groups a step */
BF16 static __m512 zero_lanes512(const uint16_t *zeros, const float *xsum, long groups)
{
    __m512 lane = _mm512_setzero_ps();
    for (long g = 0; g < groups; g += 16) {
        __mmask16 live = groups - g >= 16 ? 0xffff : (__mmask16)((1u << (groups - g)) - 1);
        __m512 z = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, zeros + g));
        lane = _mm512_mask3_fmadd_ps(z, _mm512_maskz_loadu_ps(live, xsum + g), lane, live);
    }
    return lane;
}

/* vdpbf16ps with a zero accumulator: a pair's sum of products, rounded once */
BF16 static __m512 pair_sums(__m512i w, __m512i x)
{
    return _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w, (__m512bh)x);
}

/* bfloat16 of q for q = 0..15, twice (vpermw reads 32 words) */
BF16 static __m512i q_table(void)
{
    return _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
}

/* a row's scales as floats, read by broadcasts from memory: a load each, where a float16
 * broadcast and its conversion took two vector uops of the port the table lookups need */
BF16 static void row_scales(const uint16_t *s, long groups, float *sf)
{
    for (long g = 0; g < groups; g += 16) {
        __mmask16 live = groups - g >= 16 ? 0xffff : (__mmask16)((1u << (groups - g)) - 1);
        _mm512_storeu_ps(sf + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, s + g)));
    }
}

/* pair p of a weight row as bfloat16: w0 its even group, w1 its odd one. A byte per word:
 * vpermw reads the low 5 bits, so the low nibble indexes the twice-written table as it is, and
 * the high one once shifted down. */
BF16 static void pair_words(const uint8_t *row, long p, __m512i table, __m512i *w0, __m512i *w1)
{
    /* one stream per thread reaches about 16 GB/s from memory on its own, 25 with this
     * prefetch (a 2-core EPYC, 17,920 x 1,536 weights out of cache) */
    _mm_prefetch((const char *)(row + 32 * p + PREFETCH), _MM_HINT_T0);
    __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * p)));
    *w0 = _mm512_permutexvar_epi16(words, table);
    *w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
}

/* a cache line of scales and of zeros per 16 pairs, ahead */
BF16 static void prefetch_scales(const job_t *j, long r, long p)
{
    long groups = j->k / GROUP;
    if (p % 16 == 0) {
        _mm_prefetch((const char *)(j->scales + r * groups + 2 * p + PREFETCH / 8), _MM_HINT_T0);
        _mm_prefetch((const char *)(j->zeros + r * groups + 2 * p + PREFETCH / 8), _MM_HINT_T0);
    }
}

/* an odd last group (16 bytes, columns i and 16 + i) as bfloat16 */
BF16 static __m512i last_words(const uint8_t *row, long g, __m512i table)
{
    __m128i b = _mm_loadu_si128((const __m128i *)(row + 16 * g));
    __m256i both = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_and_si128(b, _mm_set1_epi8(15))),
        _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)), 1);
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(both), table);
}

/* output (m, r) from its even and odd lanes: ((even + odd) + zero terms), summed as tree16 */
BF16 static void finish(const job_t *j, long m, long r, __m512 even, __m512 odd)
{
    long groups = j->k / GROUP;
    __m512 z = zero_lanes512(j->zeros + r * groups, j->xsum + m * groups, groups);
    j->out[m * j->n + r] = float_bf16(sum512(_mm512_add_ps(_mm512_add_ps(even, odd), z)));
}

/* One row block of `mb` activation rows against weight rows [lo, hi); mb is a constant where
 * this is inlined, so the accumulators stay in registers. */
BF16 static void block_bf16(const job_t *j, long m0, int mb, long lo, long hi)
{
    long groups = j->k / GROUP, k = j->k, pairs = groups / 2;
    const __m512i table = q_table();
    const __m512 zero = _mm512_setzero_ps();
    const uint16_t *x = j->x + m0 * k;
    float sf[SCALES_MAX + 16];
    for (long r = lo; r < hi; r++) {
        const uint8_t *row = j->q + r * (k / 2);
        row_scales(j->scales + r * groups, groups, sf);
        __m512 acc[ROW_BLOCK], odd[ROW_BLOCK];
#pragma GCC unroll 8
        for (int m = 0; m < mb; m++) acc[m] = odd[m] = zero;
        for (long p = 0; p < pairs; p++) {
            __m512i w0, w1;
            prefetch_scales(j, r, p);
            pair_words(row, p, table, &w0, &w1);
            __m512 s0 = _mm512_set1_ps(sf[2 * p]), s1 = _mm512_set1_ps(sf[2 * p + 1]);
#pragma GCC unroll 8
            for (int m = 0; m < mb; m++) {
                const uint16_t *xm = x + m * k + 64 * p;
                __m512 d0 = _mm512_dpbf16_ps(zero, (__m512bh)w0,
                                             (__m512bh)_mm512_loadu_si512(xm));
                acc[m] = _mm512_fmadd_ps(d0, s0, acc[m]);
                __m512 d1 = _mm512_dpbf16_ps(zero, (__m512bh)w1,
                                             (__m512bh)_mm512_loadu_si512(xm + 32));
                odd[m] = _mm512_fmadd_ps(d1, s1, odd[m]);
            }
        }
        if (groups % 2) {
            long g = groups - 1;
            __m512i w = last_words(row, g, table);
            __m512 sg = _mm512_set1_ps(sf[g]);
#pragma GCC unroll 8
            for (int m = 0; m < mb; m++) {
                __m512 d = _mm512_dpbf16_ps(zero, (__m512bh)w,
                                            (__m512bh)_mm512_loadu_si512(x + m * k + GROUP * g));
                acc[m] = _mm512_fmadd_ps(d, sg, acc[m]);
            }
        }
#pragma GCC unroll 8
        for (int m = 0; m < mb; m++) finish(j, m0 + m, r, acc[m], odd[m]);
    }
}

/* block_bf16 for one activation row, two weight rows at a time: each output's sums in the same
 * order, but four independent fma chains in flight instead of two, so a decode step is not
 * bound by the fma latency (one row's chains wait 4 cycles a pair) */
BF16 static void block_bf16_one(const job_t *j, long m0, long lo, long hi)
{
    long groups = j->k / GROUP, k = j->k, pairs = groups / 2, r = lo;
    const __m512i table = q_table();
    const __m512 zero = _mm512_setzero_ps();
    const uint16_t *x = j->x + m0 * k;
    float sa[SCALES_MAX + 16], sb[SCALES_MAX + 16];
    for (; r + 1 < hi; r += 2) {
        const uint8_t *ra = j->q + r * (k / 2), *rb = ra + k / 2;
        row_scales(j->scales + r * groups, groups, sa);
        row_scales(j->scales + (r + 1) * groups, groups, sb);
        __m512 acc_a = zero, odd_a = zero, acc_b = zero, odd_b = zero;
        for (long p = 0; p < pairs; p++) {
            __m512i a0, a1, b0, b1;
            prefetch_scales(j, r, p);
            prefetch_scales(j, r + 1, p);
            pair_words(ra, p, table, &a0, &a1);
            pair_words(rb, p, table, &b0, &b1);
            __m512i x0 = _mm512_loadu_si512(x + 64 * p), x1 = _mm512_loadu_si512(x + 64 * p + 32);
            acc_a = _mm512_fmadd_ps(pair_sums(a0, x0), _mm512_set1_ps(sa[2 * p]), acc_a);
            acc_b = _mm512_fmadd_ps(pair_sums(b0, x0), _mm512_set1_ps(sb[2 * p]), acc_b);
            odd_a = _mm512_fmadd_ps(pair_sums(a1, x1), _mm512_set1_ps(sa[2 * p + 1]), odd_a);
            odd_b = _mm512_fmadd_ps(pair_sums(b1, x1), _mm512_set1_ps(sb[2 * p + 1]), odd_b);
        }
        if (groups % 2) {
            long g = groups - 1;
            __m512bh xg = (__m512bh)_mm512_loadu_si512(x + GROUP * g);
            acc_a = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, (__m512bh)last_words(ra, g, table), xg),
                                    _mm512_set1_ps(sa[g]), acc_a);
            acc_b = _mm512_fmadd_ps(_mm512_dpbf16_ps(zero, (__m512bh)last_words(rb, g, table), xg),
                                    _mm512_set1_ps(sb[g]), acc_b);
        }
        finish(j, m0, r, acc_a, odd_a);
        finish(j, m0, r + 1, acc_b, odd_b);
    }
    if (r < hi) block_bf16(j, m0, 1, r, hi);
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
static void rows_bf16(const job_t *j)
{
    long tile = tile_rows(j->k);
    for (long t = j->lo; t < j->hi; t += tile) {
        long hi = t + tile < j->hi ? t + tile : j->hi;
        for (long m0 = 0; m0 < j->m_rows; m0 += ROW_BLOCK) {
            long left = j->m_rows - m0;
            switch (left < ROW_BLOCK ? left : ROW_BLOCK) {
            case 1: block_bf16_one(j, m0, t, hi); break;
            case 2: block_bf16(j, m0, 2, t, hi); break;
            case 3: block_bf16(j, m0, 3, t, hi); break;
            case 4: block_bf16(j, m0, 4, t, hi); break;
            case 5: block_bf16(j, m0, 5, t, hi); break;
            case 6: block_bf16(j, m0, 6, t, hi); break;
            case 7: block_bf16(j, m0, 7, t, hi); break;
            default: block_bf16(j, m0, 8, t, hi); break;
            }
        }
    }
}
#endif

/* 2: AVX-512 with BF16 dot products, 1: AVX2 with FMA and F16C, 0: portable C */
int kvchat_int4_isa(void)
{
#ifdef KVCHAT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512bf16"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c"))
        return 1;
#endif
    return 0;
}

static int best_isa = -1;

/* q: (n, k / 2) bytes, the layout above; scales, zeros: (n, k / 32) float16; x: (m_rows, k)
 * bfloat16; out: (m_rows, n) bfloat16. k must be a multiple of 32. Returns 0, -1 when the
 * arguments are not that, -2 when out of memory. */
int kvchat_int4_mm(const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                   const uint16_t *x, uint16_t *out, long m_rows, long n, long k,
                   int threads, int force_isa)
{
    if (k <= 0 || k % GROUP || n <= 0 || m_rows < 0) return -1;
    if (m_rows == 0) return 0;
    float *xsum = malloc(sizeof(float) * (size_t)(m_rows * (k / GROUP)));
    if (xsum == NULL) return -2;
    if (best_isa < 0) best_isa = kvchat_int4_isa();
    int isa = force_isa >= 0 && force_isa < best_isa ? force_isa : best_isa;
    if (threads < 1) threads = 1;
    float *xf = NULL;
    int x_tiny = 0;
    long pad = (m_rows * PAD8(k / GROUP) + 15) / 16 * 16; /* floats of the padded group sums */
    if (isa == 1) {
        /* the split activations, the padded group sums, then each chunk's scratch row, whole
         * cache lines apart (threads writing one line would take it from each other) */
        size_t floats = (size_t)(m_rows * k + pad + (n + 15) / 16 * SCRATCH(k)); /* k % 32 == 0 */
        xf = aligned_alloc(64, sizeof(float) * floats);
        if (xf == NULL) {
            free(xsum);
            return -2;
        }
        x_tiny = split_x(x, xf, m_rows, k);
    }
    group_sums(x, xsum, m_rows, k);
    if (xf) { /* the AVX2 path's copy of xsum, padded */
        long groups = k / GROUP;
        float *xpad = xf + m_rows * k;
        memset(xpad, 0, sizeof(float) * (size_t)(m_rows * PAD8(groups)));
        for (long m = 0; m < m_rows; m++)
            memcpy(xpad + m * PAD8(groups), xsum + m * groups, sizeof(float) * (size_t)groups);
    }
    long per = (n + threads - 1) / threads;
    per = (per + 15) / 16 * 16;
    long chunks = (n + per - 1) / per;
    #pragma omp parallel for num_threads(chunks < threads ? (int)chunks : threads) \
        schedule(static, 1)
    for (long c = 0; c < chunks; c++) {
        job_t job = {q, scales, zeros, x, xsum, xf, out, m_rows, n, k, c * per,
                     c * per + per < n ? c * per + per : n, x_tiny,
                     xf ? xf + m_rows * k + pad + c * SCRATCH(k) : NULL,
                     xf ? xf + m_rows * k : NULL};
#ifdef KVCHAT_X86
        if (isa == 2 && k / GROUP <= SCALES_MAX) { rows_bf16(&job); continue; }
        if (isa == 1) { rows_avx2(&job); continue; }
#endif
        rows_portable(&job);
    }
    free(xsum);
    free(xf);
    return 0;
}
