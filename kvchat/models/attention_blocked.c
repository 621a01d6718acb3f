/* attention.c's attention, the same products and sums in the same order per query, for the
 * head dims most models use (64, 96, 128, 256): keys and values a block at a time, each block
 * widened to float32 once for all the query heads that share it; each head's scores 16 keys at
 * a time, the tree of every key's 16 lanes done for the 16 in registers (tree_v16x16); its
 * weighted values held in registers across the block, several heads at once so that their
 * chains of sums are in flight together. attention.c picks this form where it is built
 * (`kvchat_attention_blocked`) and the plain one elsewhere; both give the same bits. */

#include "attention.h"

static const float zeros[256] __attribute__((aligned(64)));

/* Four levels of tree_v16 for 16 vectors at once: lane t of the result is tree_v16(l[t]), with
 * the same additions in the same order, each level adding the upper half of every vector's
 * partial sums to its lower half (two vectors share one register from the first level on). */
INLINE v16 add_halves(v16 x, v16 y, int level)
{
    v16 lo, hi;
    if (level == 1) {
        lo = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22,
                                     23);
        hi = __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                     30, 31);
    } else if (level == 2) {
        lo = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                     27);
        hi = __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                     30, 31);
    } else if (level == 3) {
        lo = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                     29);
        hi = __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                     31);
    } else {
        lo = __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                     30);
        hi = __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                     31);
    }
    return lo + hi;
}

INLINE v16 tree_v16x16(const v16 *l)
{
    v16 a[8], b[4], c[2];
    #pragma GCC unroll 8
    for (int t = 0; t < 8; t++) a[t] = add_halves(l[2 * t], l[2 * t + 1], 1);
    #pragma GCC unroll 8
    for (int t = 0; t < 4; t++) b[t] = add_halves(a[2 * t], a[2 * t + 1], 2);
    #pragma GCC unroll 8
    for (int t = 0; t < 2; t++) c[t] = add_halves(b[2 * t], b[2 * t + 1], 3);
    return add_halves(c[0], c[1], 4);
}

/* where rows cols[from..from+count) of base (keys or values) are as float32, into at[]: in place
 * for float32, widened into `out` for bfloat16; the head's columns (c < 0) from hbase */
INLINE void rows_at(const attn_t *a, const int32_t *cols, long from, long count,
                    const char *base, long stride, const char *hbase, long hstride, float *out,
                    const float **at, const int bf16, const long vecs)
{
    const long es = bf16 ? 2 : 4;
    for (long t = 0; t < count; t++) {
        long c = cols[from + t];
        const char *row = c < 0 ? hbase + (c + a->p) * hstride * es : base + c * stride * es;
        if (!bf16) {
            at[t] = (const float *)row;
            continue;
        }
        #pragma GCC unroll 16
        for (long x = 0; x < vecs; x++) {
            v16 r = load16_bf16((const uint16_t *)row + x * 16);
            memcpy(out + (t * vecs + x) * 16, &r, 64);
        }
        at[t] = out + t * vecs * 16;
    }
}

/* query . key in 16 lanes (lane x % 16, x ascending): `attend`'s `lanes` for one key */
INLINE v16 key_lanes(const v16 *q, const float *key, const long vecs)
{
    v16 lanes = {0};
    #pragma GCC unroll 16
    for (long x = 0; x < vecs; x++) lanes = lanes + q[x] * load16_f32(key + x * 16);
    return lanes;
}

/* acc of heads h0..h0+heads += e[t] * value t for the block's count values, in t order */
INLINE void weigh_values(v16 *acc, const float *scores, long keys, long h0, long j0, long count,
                         const float *const *at, const long vecs, const long heads)
{
    v16 sums[16];
    #pragma GCC unroll 16
    for (long y = 0; y < heads * vecs; y++) sums[y] = acc[h0 * vecs + y];
    for (long t = 0; t < count; t++) {
        #pragma GCC unroll 4
        for (long u = 0; u < heads; u++) {
            v16 ev = SPLAT(scores[(h0 + u) * keys + j0 + t]);
            #pragma GCC unroll 16
            for (long x = 0; x < vecs; x++)
                sums[u * vecs + x] = sums[u * vecs + x] + ev * load16_f32(at[t] + x * 16);
        }
    }
    #pragma GCC unroll 16
    for (long y = 0; y < heads * vecs; y++) acc[h0 * vecs + y] = sums[y];
}

/* `attend` for a head dim of 16 * vecs, keys and values a block at a time: each block widened
 * to float32 once for all g heads, each head's scores 16 keys at a time (tree_v16x16), its
 * weighted values in registers through the block. Every query, head, key and dim gets the
 * products and sums `attend` gives it, in the same order: the same bits. */
INLINE void attend_blocked(const attn_t *a, long item, const scratch_t *w, const int bf16,
                           const long vecs)
{
    const long d = vecs * 16, g = a->h / a->kh, nq = a->nq, p = a->p;
    const long keys = w->keys, es = bf16 ? 2 : 4;
    const long i = item % nq, kv = (item / nq) % a->kh, bi = item / (a->kh * nq);
    const float scale = a->scale, softcap = a->softcap;
    float *const scores = w->scores, *const rows = w->rows;
    v16 *const acc = w->acc, *const qv = w->qv;
    int32_t *const cols = w->cols;
    for (long hh = 0; hh < g; hh++) {
        long qat = bi * a->qs[0] + (kv * g + hh) * a->qs[1] + i * a->qs[2];
        for (long x = 0; x < vecs; x++) qv[hh * vecs + x] = LOAD16(a->q, qat + x * 16, bf16);
    }
    const long seen = visible_keys(a, bi, i, cols);
    const char *kbase = (const char *)a->k + (bi * a->ks[0] + kv * a->ks[1]) * es;
    const char *vbase = (const char *)a->v + (bi * a->vs[0] + kv * a->vs[1]) * es;
    const char *hkbase = p ? (const char *)a->hk + kv * a->hks[0] * es : NULL;
    const char *hvbase = p ? (const char *)a->hv + kv * a->hvs[0] * es : NULL;
    float best[64], sum[64];
    const v16 ninf = SPLAT(-INFINITY), scalev = SPLAT(scale);
    v16 bestv[64];
    for (long hh = 0; hh < g; hh++) bestv[hh] = ninf;
    /* scores, 16 keys at a time; the lanes past `seen` read zeros and are dropped */
    for (long j0 = 0; j0 < seen; j0 += 16) {
        long count = seen - j0 < 16 ? seen - j0 : 16;
        const float *at[16];
        rows_at(a, cols, j0, count, kbase, a->ks[2], hkbase, a->hks[1], rows, at, bf16, vecs);
        for (long t = count; t < 16; t++) at[t] = zeros;
        for (long hh = 0; hh < g; hh++) {
            v16 q[16], l[16];
            #pragma GCC unroll 16
            for (long x = 0; x < vecs; x++) q[x] = qv[hh * vecs + x];
            if (vecs <= 8) {
                #pragma GCC unroll 16
                for (int t = 0; t < 16; t++) l[t] = key_lanes(q, at[t], vecs);
            } else { /* wide heads: four keys at a time, the query in registers */
                #pragma GCC unroll 4
                for (int t = 0; t < 16; t++) l[t] = key_lanes(q, at[t], vecs);
            }
            v16 s = tree_v16x16(l) * scalev;
            if (softcap > 0.0f) {
                float lane[16];
                memcpy(lane, &s, 64);
                for (int t = 0; t < 16; t++) lane[t] = tanhf(lane[t] / softcap) * softcap;
                memcpy(&s, lane, 64);
            }
            if (count < 16) {
                v16i live = SPLAT(0);
                for (int t = 0; t < count; t++) live[t] = -1;
                s = (v16)(((v16i)s & live) | ((v16i)ninf & ~live));
            }
            memcpy(scores + hh * keys + j0, &s, 64);
            v16i more = s > bestv[hh];
            bestv[hh] = (v16)(((v16i)s & more) | ((v16i)bestv[hh] & ~more));
        }
    }
    for (long hh = 0; hh < g; hh++) {
        best[hh] = -INFINITY;
        #pragma GCC unroll 16
        for (int t = 0; t < 16; t++)
            if (bestv[hh][t] > best[hh]) best[hh] = bestv[hh][t];
    }
    for (long hh = 0; hh < g; hh++) {
        sum[hh] = exp_scores(scores + hh * keys, seen, best[hh]);
        for (long x = 0; x < vecs; x++) acc[hh * vecs + x] = (v16){0};
    }
    /* acc = e[0] v_0 + e[1] v_1 + ..., a block of values at a time */
    const long block = BLOCK_FLOATS / d;
    for (long j0 = 0; j0 < seen; j0 += block) {
        long count = seen - j0 < block ? seen - j0 : block;
        const float *at[BLOCK_FLOATS / 64];
        rows_at(a, cols, j0, count, vbase, a->vs[2], hvbase, a->hvs[1], rows, at, bf16, vecs);
        /* up to 16 / vecs heads at a time (16 sums in registers), so that their chains of
         * sums are in flight at once */
        for (long h0 = 0; h0 < g;) {
            long heads = g - h0 < 16 / vecs ? g - h0 : 16 / vecs;
            if (heads >= 4) heads = 4;
            if (heads == 4) weigh_values(acc, scores, keys, h0, j0, count, at, vecs, 4);
            else if (heads == 3) weigh_values(acc, scores, keys, h0, j0, count, at, vecs, 3);
            else if (heads == 2) weigh_values(acc, scores, keys, h0, j0, count, at, vecs, 2);
            else weigh_values(acc, scores, keys, h0, j0, count, at, vecs, 1);
            h0 += heads;
        }
    }
    for (long hh = 0; hh < g; hh++) {
        long o = ((bi * nq + i) * a->h + kv * g + hh) * d;
        write_out(a, o, (const float *)(acc + hh * vecs), sum[hh], seen);
    }
}

/* one entry per dtype and head dim the blocked form is built for (16 * vecs) */
#define BLOCKED(name, bf16, vecs) \
    static void name(const attn_t *a, long item, const scratch_t *w) \
    { \
        attend_blocked(a, item, w, bf16, vecs); \
    }

/* the blocked entries of one instruction set: head dims 64, 96, 128 and 256, each dtype */
#define BLOCKED_SET(target, tag) \
    target BLOCKED(b4_##tag, 1, 4) target BLOCKED(b6_##tag, 1, 6) \
    target BLOCKED(b8_##tag, 1, 8) target BLOCKED(b16_##tag, 1, 16) \
    target BLOCKED(f4_##tag, 0, 4) target BLOCKED(f6_##tag, 0, 6) \
    target BLOCKED(f8_##tag, 0, 8) target BLOCKED(f16_##tag, 0, 16) \
    static attend_fn blocked_##tag(int bf16, long d) \
    { \
        switch (d) { \
        case 64: return bf16 ? b4_##tag : f4_##tag; \
        case 96: return bf16 ? b6_##tag : f6_##tag; \
        case 128: return bf16 ? b8_##tag : f8_##tag; \
        case 256: return bf16 ? b16_##tag : f16_##tag; \
        default: return NULL; \
        } \
    }
#if defined(__x86_64__) || defined(__i386__)
#define AVX512 __attribute__((target("avx512f,avx512dq")))
#define AVX2 __attribute__((target("avx2")))
BLOCKED_SET(AVX512, avx512)
BLOCKED_SET(AVX2, avx2)
#endif

/* the blocked form for this dtype, head dim and instruction set, or NULL where none is built:
 * for AVX-512 and AVX2; the baseline build (16 vector registers of 128 bits on x86-64) would
 * spill the 16 keys' and heads' sums that make the blocked form fast, and keeps the plain one */
attend_fn kvchat_attention_blocked(int isa, int bf16, long d)
{
#if defined(__x86_64__) || defined(__i386__)
    if (isa == 2) return blocked_avx512(bf16, d);
    if (isa == 1) return blocked_avx2(bf16, d);
#endif
    (void)isa, (void)bf16, (void)d;
    return NULL;
}
