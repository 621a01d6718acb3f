/* What the native kernels share: the fixed sum of 16 lanes they end each output with (l + l+8,
 * then + l+4, + l+2, + l+1; `tree16` over an array, the portable paths, `sum512` over an
 * AVX-512 register and `sum256x2` over two AVX2 registers give the same bits), the rounding of
 * their bfloat16 outputs, float16 values read and written exactly, and the output heads'
 * activation grid. */

#ifndef KVCHAT_NATIVE_SUMS_H
#define KVCHAT_NATIVE_SUMS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* float to bfloat16, rounding to nearest even as torch rounds (the kernels' bfloat16 outputs);
 * a NaN kept quiet by a select, not a branch, so that loops over it vectorize */
static inline uint16_t float_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

/* a bfloat16 as float32, exactly */
static inline float bf16_float(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* an IEEE half as float32, exactly (what vcvtph2ps gives) */
static inline float half_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu, u;
    float f;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
    memcpy(&f, &u, 4);
    return f;
}

/* float to IEEE half, rounding to nearest even (c10's fp16_ieee_from_fp32_value, which torch's
 * scalar conversion runs; its vector conversion, vcvtps2ph, rounds the same) */
static inline uint16_t float_half(float f)
{
    const float to_inf = 0x1.0p+112f, to_zero = 0x1.0p-110f;
    float base = (fabsf(f) * to_inf) * to_zero, bias_f;
    uint32_t w, bias, bits;
    memcpy(&w, &f, 4);
    uint32_t shl1 = w + w, sign = w & 0x80000000u;
    bias = shl1 & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    bias = (bias >> 1) + 0x07800000u;
    memcpy(&bias_f, &bias, 4);
    base = bias_f + base;
    memcpy(&bits, &base, 4);
    uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

/* One GGUF Q6_K block (210 bytes: gguf_blocks.c gives the layout) as its 256 int8 values
 * q - 32 and its 16 scales float32(d * sc): value p is s[p / 16] * q[p], exactly (gguf-py's
 * number). The decoders of the embedding (gguf_blocks.c) and of the head (block_head.c) both
 * read a block through it. */
static inline void q6k_unpack(const uint8_t *b, int8_t *q, float *s)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    uint16_t dh;
    memcpy(&dh, b + 208, 2);
    float d = half_float(dh);
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 32; j++) {
                int low = (ql[64 * h + 32 * (r % 2) + j] >> (4 * (r / 2))) & 15;
                int high = (qh[32 * h + j] >> (2 * r)) & 3;
                q[128 * h + 32 * r + j] = (int8_t)((low | (high << 4)) - 32);
            }
    for (int g = 0; g < 16; g++) s[g] = d * (float)sc[g];
}

static inline float tree16(const float *lane)
{
    float a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = lane[i] + lane[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    for (int i = 0; i < 2; i++) c[i] = b[i] + b[i + 2];
    return c[0] + c[1];
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

__attribute__((target("avx512f,avx512dq"))) static inline float sum512(__m512 v)
{
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* the same tree over 16 lanes held as two AVX2 registers, lanes 0-7 and 8-15 */
__attribute__((target("avx2"))) static inline float sum256x2(__m256 lo, __m256 hi)
{
    __m256 a = _mm256_add_ps(lo, hi);
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#endif

/* The head kernels' activation grid (block_head.c, int8_head.c): a row of float32 activations,
 * a block of 256 columns at a time (the last block may be shorter), as 16-bit integers on a
 * power-of-two grid of the block's own. With E the largest exponent field of the block's values
 * (at least 15), the unit is u = 2^(E - 141) and
 *
 *   x_int = clamp(rint(x / u), -32767, 32767)          (x / u exact; rint to nearest even)
 *
 * so each value keeps 15 bits against the block's largest; a block holding an infinity or NaN
 * gets u = NaN (and x_int 0). */
#define GRID_BLOCK 256

static inline void grid_row(const float *x, long k, int16_t *xi, float *u)
{
    for (long b = 0; b * GRID_BLOCK < k; b++) {
        const float *v = x + b * GRID_BLOCK;
        long len = k - b * GRID_BLOCK < GRID_BLOCK ? k - b * GRID_BLOCK : GRID_BLOCK;
        int top = 15, bad = 0;
        for (long c = 0; c < len; c++) {
            uint32_t bits;
            memcpy(&bits, v + c, 4);
            int e = (int)((bits >> 23) & 0xff);
            bad |= e == 0xff;
            top = e > top ? e : top;
        }
        float inv = ldexpf(1.0f, 141 - top);
        for (long c = 0; c < len; c++) {
            float t = bad ? 0.0f : rintf(v[c] * inv);
            t = t > 32767.0f ? 32767.0f : t < -32767.0f ? -32767.0f : t;
            xi[b * GRID_BLOCK + c] = (int16_t)t;
        }
        u[b] = bad ? NAN : ldexpf(1.0f, top - 141);
    }
}

/* every row's grid_row, in one allocation that the caller frees (NULL when out of memory):
 * x_int (m_rows, k) at *xi, the units (m_rows, blocks) at *u */
static inline void *grid_rows(const float *x, long m_rows, long k, int threads, int16_t **xi,
                              float **u)
{
    long blocks = (k + GRID_BLOCK - 1) / GRID_BLOCK;
    size_t xi_bytes = ((size_t)(m_rows * k) * sizeof(int16_t) + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, xi_bytes + ((size_t)(m_rows * blocks) * sizeof(float) + 63)
                                          / 64 * 64);
    if (!scratch) return NULL;
    int16_t *xs = (int16_t *)scratch;
    float *us = (float *)(scratch + xi_bytes);
    #pragma omp parallel for num_threads(threads > 1 && m_rows * k >= 65536 ? threads : 1) \
        schedule(static)
    for (long m = 0; m < m_rows; m++) grid_row(x + m * k, k, xs + m * k, us + m * blocks);
    *xi = xs;
    *u = us;
    return scratch;
}

/* the instruction set of the head kernels (int8_head.c): 2 AVX-512, 1 AVX2 + FMA, 0 portable */
int kvchat_int8_head_isa(void);

#endif
