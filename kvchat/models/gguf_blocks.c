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
 * ql[64 h + 32 (r % 2) + j] >> (4 (r / 2)) & 15, high = qh[32 h + j] >> (2 r) & 3.
 *
 * kvchat_int4_from_blocks reads Q4_1 and Q4_K rows straight into the int4 layers' layout
 * (int4_matmul.c's: groups of 32 with a float16 scale and zero, w = q * scale + zero), with no
 * float copy and no grid to search: each group already is one. Q4_1 (20 bytes per 32: d, m
 * float16, 16 bytes with value j low in byte j and 16 + j high) gives scale d and zero m, its
 * own bits. Q4_K gives scale float16(d * sc) and zero float16(-(dmin * m)) (nearest even; the
 * products are exact in float). Each 16 rows are then written as one of int4_matmul.c's tiles. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_sums.h"

#define QK_K 256
#define Q4_1 3 /* GGMLQuantizationType */
#define Q4_K 12
#define Q6_K 14

static inline uint16_t read_u16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Q4_K's 6-bit scale and min of sub-block `sub` from its 12 bytes `s` */
static inline void q4_k_scale_min(const uint8_t *s, int sub, int *sc, int *m)
{
    if (sub < 4) {
        *sc = s[sub] & 63;
        *m = s[4 + sub] & 63;
    } else {
        *sc = (s[8 + sub - 4] & 15) | ((s[sub - 4] >> 2) & 0x30);
        *m = (s[8 + sub - 4] >> 4) | ((s[sub] >> 2) & 0x30);
    }
}

static void q4_k_block(const uint8_t *b, float *out)
{
    float d = half_float(read_u16(b)), dmin = half_float(read_u16(b + 2));
    const uint8_t *s = b + 4, *qs = b + 16;
    for (int sub = 0; sub < 8; sub++) {
        int sc, m;
        q4_k_scale_min(s, sub, &sc, &m);
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
    int8_t q[QK_K];
    float s[16];
    q6k_unpack(b, q, s);
    for (int p = 0; p < QK_K; p++) out[p] = s[p / 16] * (float)q[p];
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

/* one row of Q4_K blocks: k / 256 blocks in, k values (one a byte) and k / 32 scales and zeros
 * out; 0, or 1 where a scale or zero is not finite as a float16 */
static int q4_k_row(const uint8_t *in, long k, uint8_t *q, uint16_t *scales, uint16_t *zeros)
{
    int bad = 0;
    for (long b = 0; b < k / QK_K; b++) {
        const uint8_t *blk = in + b * 144, *qs = blk + 16;
        float d = half_float(read_u16(blk)), dmin = half_float(read_u16(blk + 2));
        for (int sub = 0; sub < 8; sub++) {
            int sc, m;
            q4_k_scale_min(blk + 4, sub, &sc, &m);
            uint16_t scale = float_half(d * (float)sc), zero = float_half(-(dmin * (float)m));
            bad |= (scale & 0x7c00u) == 0x7c00u || (zero & 0x7c00u) == 0x7c00u;
            scales[8 * b + sub] = scale;
            zeros[8 * b + sub] = zero;
            for (int j = 0; j < 32; j++)
                q[QK_K * b + 32 * sub + j] = (qs[32 * (sub / 2) + j] >> (4 * (sub % 2))) & 15;
        }
    }
    return bad;
}

/* one row of Q4_1 blocks (k / 32 of them) */
static int q4_1_row(const uint8_t *in, long k, uint8_t *q, uint16_t *scales, uint16_t *zeros)
{
    int bad = 0;
    for (long g = 0; g < k / 32; g++) {
        const uint8_t *blk = in + 20 * g, *qs = blk + 4;
        scales[g] = read_u16(blk);
        zeros[g] = read_u16(blk + 2);
        bad |= (scales[g] & 0x7c00u) == 0x7c00u || (zeros[g] & 0x7c00u) == 0x7c00u;
        for (int i = 0; i < 16; i++) {
            q[32 * g + i] = qs[i] & 15;
            q[32 * g + 16 + i] = qs[i] >> 4;
        }
    }
    return bad;
}

/* 16 rows of values (one a byte), scales and zeros into int4_matmul.c's tile layout */
static void tile_pack(const uint8_t *v, const uint16_t *sv, const uint16_t *zv, long k,
                      uint8_t *q, uint16_t *scales, uint16_t *zeros)
{
    long groups = k / 32;
    for (long g = 0; g < groups; g++)
        for (int r = 0; r < 16; r++) {
            const uint8_t *row = v + r * k + 32 * g;
            for (int c = 0; c < 16; c++)
                q[256 * g + 32 * (c / 2) + 2 * r + c % 2] = (uint8_t)(row[c] | (row[16 + c] << 4));
            scales[16 * g + r] = sv[r * groups + g];
            zeros[16 * g + r] = zv[r * groups + g];
        }
}

/* `rows` rows (a multiple of 16) of `k` values in GGML type `type` (Q4_1 or Q4_K) from `src`
 * into q ((rows, k / 2) bytes), scales and zeros ((rows, k / 32) float16), in int4_matmul.c's
 * tile layout. Returns 0; -1 for another type, a k the type cannot hold or rows not in whole
 * tiles; -2 where a scale or zero overflows float16 (the caller grids the values instead), -3
 * when out of memory. */
int kvchat_int4_from_blocks(int type, const uint8_t *src, long rows, long k, uint8_t *q,
                            uint16_t *scales, uint16_t *zeros, int threads)
{
    long row_bytes, groups = k / 32;
    int (*row)(const uint8_t *, long, uint8_t *, uint16_t *, uint16_t *);
    if (rows % 16) return -1;
    if (type == Q4_K && k % QK_K == 0) {
        row_bytes = k / QK_K * 144;
        row = q4_k_row;
    } else if (type == Q4_1 && k % 32 == 0) {
        row_bytes = k / 32 * 20;
        row = q4_1_row;
    } else {
        return -1;
    }
    int bad = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : 1) reduction(| : bad)
    {
        uint8_t *v = malloc((size_t)(16 * k));
        uint16_t *sz = malloc(sizeof(uint16_t) * (size_t)(32 * groups));
        if (v == NULL || sz == NULL) bad |= 4;
#pragma omp for schedule(static)
        for (long t = 0; t < rows / 16; t++) {
            if (v == NULL || sz == NULL) continue;
            for (int r = 0; r < 16; r++)
                bad |= row(src + (16 * t + r) * row_bytes, k, v + r * k, sz + r * groups,
                           sz + (16 + r) * groups);
            tile_pack(v, sz, sz + 16 * groups, k, q + 16 * t * (k / 2), scales + 16 * t * groups,
                      zeros + 16 * t * groups);
        }
        free(v);
        free(sz);
    }
    return bad & 4 ? -3 : bad ? -2 : 0;
}
