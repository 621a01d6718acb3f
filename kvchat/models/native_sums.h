/* What the native kernels share: the fixed sum of 16 lanes they end each output with (l + l+8,
 * then + l+4, + l+2, + l+1; `tree16` over an array, the portable paths, and `sum512` over an
 * AVX-512 register give the same bits), the rounding of their bfloat16 outputs, and float16
 * values read and written exactly. */

#ifndef KVCHAT_NATIVE_SUMS_H
#define KVCHAT_NATIVE_SUMS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* float to bfloat16, rounding to nearest even as torch rounds (the kernels' bfloat16 outputs) */
static inline uint16_t float_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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
#endif

#endif
