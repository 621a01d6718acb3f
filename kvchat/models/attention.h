/* What attention.c and attention_blocked.c share: the call (attn_t), one thread's scratch,
 * float32 loads of bfloat16 or float32 rows, exp16 and the fixed tree of 16 lanes. */

#ifndef KVCHAT_ATTENTION_H
#define KVCHAT_ATTENTION_H

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_sums.h"

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

typedef struct {
    const void *q, *k, *v, *hk, *hv;
    const uint8_t *mask;
    void *out;
    long b, h, kh, nq, n, p, d;
    long qs[3], ks[3], vs[3], hks[2], hvs[2]; /* element strides: (b, h, i) and (b, h, n) */
    float scale, softcap;
    int bf16;     /* the tensors are bfloat16 (else float32) */
    int out_bf16; /* the output is bfloat16: also after `widen` made the inputs float32 */
} attn_t;

/* 16 values from row[at..at+16) as floats */
#define LOAD16(row, at, bf16) ((bf16) ? load16_bf16((const uint16_t *)(row) + (at)) \
                                      : load16_f32((const float *)(row) + (at)))
static inline v16 load16_bf16(const uint16_t *src)
{
    v16h h;
    memcpy(&h, src, 32);
    return (v16)(__builtin_convertvector(h, v16u) << 16);
}

static inline v16 load16_f32(const float *src)
{
    v16 out;
    memcpy(&out, src, 64);
    return out;
}

#define LOAD1(row, at, bf16) ((bf16) ? bf16_float(((const uint16_t *)(row))[at]) \
                                     : ((const float *)(row))[at])

/* exp(x) for x <= 0, 16 at a time: Cephes' expf (n = round(x log2 e), r = x - n ln 2 in two
 * parts, a degree-5 polynomial, times 2^n), zero below -87. Only additions, multiplications
 * and bit operations, so every build gives the same bits. */
typedef int32_t v16i __attribute__((vector_size(64)));
#define SPLAT(x) {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}
#define INLINE static inline __attribute__((always_inline))
INLINE v16 exp16(v16 x)
{
    const v16 lo = SPLAT(-87.0f), magic = SPLAT(12582912.0f), log2e = SPLAT(1.44269504f);
    const v16 c1 = SPLAT(0.693359375f), c2 = SPLAT(-2.12194440e-4f), one = SPLAT(1.0f);
    const v16 p0 = SPLAT(1.9875691500e-4f), p1 = SPLAT(1.3981999507e-3f);
    const v16 p2 = SPLAT(8.3334519073e-3f), p3 = SPLAT(4.1665795894e-2f);
    const v16 p4 = SPLAT(1.6666665459e-1f), p5 = SPLAT(5.0000001201e-1f);
    const v16i bias = SPLAT(127);
    v16i small = x < lo;
    x = (v16)(((v16i)x & ~small) | ((v16i)lo & small));
    v16 t = x * log2e + magic, n = t - magic;
    v16 r = (x - n * c1) - n * c2;
    v16 poly = ((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5;
    v16 y = poly * r * r + r + one;
    v16i pow2 = ((v16i)t - (v16i)magic + bias) << 23;
    return (v16)((v16i)(y * (v16)pow2) & ~small);
}

/* tree16 on a vector: (l + l+8), + l+4, + l+2, + l+1, the same additions in the same order */
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef float v2 __attribute__((vector_size(8)));
INLINE float tree_v16(v16 v)
{
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    v2 c = __builtin_shufflevector(b, b, 0, 1) + __builtin_shufflevector(b, b, 2, 3);
    return c[0] + c[1];
}

/* scratch of one thread: for each of the g query heads of a KV head, its scores (keys, a
 * multiple of 16), accumulators (vecs) and query */
typedef struct {
    float *scores, *qf;
    v16 *acc, *qv;
    int32_t *cols;
    long keys;
    float *rows; /* BLOCK_FLOATS: one block of keys or values as float32 */
} scratch_t;


#define MAX_VECS 32 /* head_dim up to 512 */

/* the keys query i of row bi sees, in position order, into cols: the head's columns as
 * -p..-1, then the row's own where the mask is set (no mask: causal, bottom-right aligned);
 * returns how many */
INLINE long visible_keys(const attn_t *a, long bi, long i, int32_t *cols)
{
    const long n = a->n, nq = a->nq;
    const uint8_t *mrow = a->mask ? a->mask + (bi * nq + i) * n : NULL;
    long seen = 0, last = mrow ? n : n - nq + i + 1;
    for (long c = -a->p; c < 0; c++) cols[seen++] = (int32_t)c;
    if (!mrow) { /* every column up to `last`: a loop without the test, which vectorizes */
        for (long c = 0; c < last; c++) cols[seen + c] = (int32_t)c;
        return seen + (last > 0 ? last : 0);
    }
    for (long c = 0; c < last; c++)
        if (mrow[c]) cols[seen++] = (int32_t)c;
    return seen;
}

/* e[j] = exp(s[j] - best) in place over the scores of `seen` keys, 16 at a time (the slots
 * up to the next 16 set to -inf); returns their sum, in 16 lanes (key j in lane j % 16) and
 * then the tree */
INLINE float exp_scores(float *sc, long seen, float best)
{
    v16 m = SPLAT(best), lanes = {0};
    for (long j = seen; j < (seen + 15) / 16 * 16; j++) sc[j] = -INFINITY;
    for (long j = 0; j < seen; j += 16) {
        v16 e = exp16(load16_f32(sc + j) - m);
        memcpy(sc + j, &e, 64);
        lanes = lanes + e;
    }
    return tree_v16(lanes);
}

/* the output of one query head at element o: num / sum in the output's dtype (zeros when the
 * query sees no key) */
INLINE void write_out(const attn_t *a, long o, const float *num, float sum, long seen)
{
    for (long x = 0; x < a->d; x++) {
        float val = seen ? num[x] / sum : 0.0f;
        if (a->out_bf16) ((uint16_t *)a->out)[o + x] = float_bf16(val);
        else ((float *)a->out)[o + x] = val;
    }
}

#define BLOCK_FLOATS 4096 /* a block of keys or values as float32 (16 KiB): scratch_t.rows */

typedef void (*attend_fn)(const attn_t *, long, const scratch_t *);

/* attention_blocked.c's form for this instruction set (2 AVX-512, 1 AVX2, 0 the baseline),
 * dtype (bf16: 1 bfloat16, 0 float32) and head dim; NULL where it is not built */
__attribute__((visibility("hidden"))) attend_fn kvchat_attention_blocked(int isa, int bf16,
                                                                          long d);

#endif
