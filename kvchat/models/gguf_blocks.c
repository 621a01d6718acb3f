/* GGUF's Q4_K and Q6_K blocks de-quantized to float32 when a model is packed: the numbers
 * gguf-py's numpy code gives (its dequantize_blocks, op for op: float16 read exactly, each
 * product and difference rounded on its own, no fused multiply-add), on every thread. Tests
 * compare the two bitwise. Any other type is left to gguf-py.
 *
 * Q4_K, 144 bytes per 256 values: d, dmin (float16), 12 bytes of 6-bit scales and mins for
 * eight sub-blocks of 32, then 128 bytes of nibbles; value p (sub-block b = p / 32, chunk
 * c = p / 64) is (d * sc[b]) * q - dmin * m[b], q = qs[32 c + p % 32] >> (4 (b % 2)) & 15.
 *
 * Q6_K, 210 bytes per 256 values: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
 * scales (one per 16 values), d (float16); value p (half h = p / 128, quarter r = p % 128 / 32,
 * j = p % 32) is (d * scale[p / 16]) * (q - 32), q = low | high << 4 with low =
 * ql[64 h + 32 (r % 2) + j] >> (4 (r / 2)) & 15, high = qh[32 h + j] >> (2 r) & 3. */

#include <stdint.h>
#include <string.h>

#include "native_sums.h"

#define QK_K 256
#define Q4_K 12 /* GGMLQuantizationType */
#define Q6_K 14

static inline uint16_t read_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static void q4_k_block(const uint8_t *b, float *out)
{
    float d = half_float(read_u16(b)), dmin = half_float(read_u16(b + 2));
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int sub = 0; sub < 8; sub++) {
        int sc, m;
        if (sub < 4) {
            sc = s[sub] & 63;
            m = s[4 + sub] & 63;
        } else {
            sc = (s[8 + sub - 4] & 15) | ((s[sub - 4] >> 2) & 0x30);
            m = (s[8 + sub - 4] >> 4) | ((s[sub] >> 2) & 0x30);
        }
        float scale = d * (float)sc, low = dmin * (float)m;
        const uint8_t *q = qs + 32 * (sub / 2);
        int shift = 4 * (sub % 2);
        for (int j = 0; j < 32; j++) {
            float t = scale * (float)((q[j] >> shift) & 15);
            out[32 * sub + j] = t - low;
        }
    }
}

static void q6_k_block(const uint8_t *b, float *out)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_float(read_u16(b + 208));
    for (int p = 0; p < QK_K; p++) {
        int h = p / 128, r = p % 128 / 32, j = p % 32;
        int low = (ql[64 * h + 32 * (r % 2) + j] >> (4 * (r / 2))) & 15;
        int high = (qh[32 * h + j] >> (2 * r)) & 3;
        int q = (int)(int8_t)(uint8_t)(low | (high << 4)) - 32;
        float scale = d * (float)sc[p / 16];
        out[p] = scale * (float)q;
    }
}

/* `blocks` blocks of GGML type `type` from `src` into `out` (256 floats each). Returns 0, or
 * -1 for a type this file does not take. */
int kvchat_gguf_blocks(int type, const uint8_t *src, long blocks, float *out, int threads)
{
    long size;
    void (*block)(const uint8_t *, float *);
    if (type == Q4_K) {
        size = 144;
        block = q4_k_block;
    } else if (type == Q6_K) {
        size = 210;
        block = q6_k_block;
    } else {
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (long i = 0; i < blocks; i++) block(src + i * size, out + i * QK_K);
    return 0;
}
