/* Attention with one order of sums per query, whatever else is in the call: kvchat's
 * batch-invariant attention for prefill, decode steps, drafts and shared heads alike.
 *
 * For query (b, h, i) it visits the keys the query may see in position order: first the P
 * columns of a shared head (every row's first P positions, held once), then its own N columns
 * where mask[b, i, c] is set (or, with no mask, columns [0, N - Q + i]: causal, bottom-right
 * aligned). Those visible keys are numbered j = 0, 1, ... and everything below depends on that
 * numbering only: not on padding, holes, the batch, the other queries, the chunk a prompt was
 * prefilled in, or the threads.
 *
 *   s[j] = softcap(scale * dot(q, k_j))      dot in 16 lanes over d (lane d % 16, d ascending),
 *                                             then the fixed tree of native_sums.h
 *   m    = max over j of s[j]
 *   e[j] = exp(s[j] - m)                      Cephes' expf polynomial, 16 keys at a time
 *   sum  = tree(lanes), lane l = e[l] + e[l+16] + ...   (key j in lane j % 16, j ascending)
 *   acc  = e[0] * v_0 + e[1] * v_1 + ...      per output dim, in j order
 *   out  = acc / sum                          rounded to bfloat16 (RNE) for bfloat16 K/V
 *
 * Products and sums are float32 and never contracted (-ffp-contract=off), so the vector code
 * (GCC vector extensions, built for AVX-512, AVX2 and the baseline) gives the portable scalar
 * bits. A query that may see no key gets zeros. Each query is computed by one thread. */

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
    int bf16;
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

#define LOAD1(row, at, bf16) ((bf16) ? bf16_of(((const uint16_t *)(row))[at]) \
                                     : ((const float *)(row))[at])
static inline float bf16_of(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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
} scratch_t;

#define MAX_VECS 32 /* head_dim up to 512 */

/* The g query heads that share KV head `kv`, at query i of row bi: each computed exactly as it
 * would be alone (the heads share only the loads of each key and value). */
INLINE void attend(const attn_t *a, long item, const scratch_t *w, const int bf16)
{
    const long d = a->d, whole = d / 16 * 16, vecs = d / 16, g = a->h / a->kh;
    const long nq = a->nq, n = a->n, p = a->p, keys = w->keys, es = bf16 ? 2 : 4;
    const long kv = item % a->kh, i = (item / a->kh) % nq, bi = item / (a->kh * nq);
    const float scale = a->scale, softcap = a->softcap;
    float *const scores = w->scores, *const qf = w->qf;
    v16 *const acc = w->acc, *const qv = w->qv;
    int32_t *const cols = w->cols;
    for (long hh = 0; hh < g; hh++) {
        long at = bi * a->qs[0] + (kv * g + hh) * a->qs[1] + i * a->qs[2];
        for (long x = 0; x < d; x++) qf[hh * d + x] = LOAD1(a->q, at + x, bf16);
        for (long x = 0; x < vecs; x++) qv[hh * vecs + x] = load16_f32(qf + hh * d + x * 16);
    }
    /* the visible keys in position order: the head's columns as -p..-1, then the row's own */
    const uint8_t *mrow = a->mask ? a->mask + (bi * nq + i) * n : NULL;
    long seen = 0, last = mrow ? n : n - nq + i + 1;
    for (long c = -p; c < 0; c++) cols[seen++] = (int32_t)c;
    for (long c = 0; c < last; c++)
        if (!mrow || mrow[c]) cols[seen++] = (int32_t)c;
    const char *kbase = (const char *)a->k + (bi * a->ks[0] + kv * a->ks[1]) * es;
    const char *vbase = (const char *)a->v + (bi * a->vs[0] + kv * a->vs[1]) * es;
    const char *hkbase = p ? (const char *)a->hk + kv * a->hks[0] * es : NULL;
    const char *hvbase = p ? (const char *)a->hv + kv * a->hvs[0] * es : NULL;
    float best[64], sum[64];
    for (long hh = 0; hh < g; hh++) best[hh] = -INFINITY;
    for (long j = 0; j < seen; j++) {
        long c = cols[j];
        const char *row = c < 0 ? hkbase + (c + p) * a->hks[1] * es : kbase + c * a->ks[2] * es;
        v16 kr[MAX_VECS];
        for (long x = 0; x < vecs; x++) kr[x] = LOAD16(row, x * 16, bf16);
        for (long hh = 0; hh < g; hh++) {
            v16 lanes = {0};
            for (long x = 0; x < vecs; x++) lanes = lanes + qv[hh * vecs + x] * kr[x];
            float s;
            if (whole == d) {
                s = tree_v16(lanes) * scale;
            } else {
                float lane[16];
                memcpy(lane, &lanes, 64);
                for (long x = whole; x < d; x++)
                    lane[x % 16] = lane[x % 16] + qf[hh * d + x] * LOAD1(row, x, bf16);
                s = tree16(lane) * scale;
            }
            if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
            scores[hh * keys + j] = s;
            if (s > best[hh]) best[hh] = s;
        }
    }
    /* e[j] = exp(s[j] - m) in place, 16 keys at a time; their sum in 16 lanes (key j in lane
     * j % 16), then the tree */
    for (long hh = 0; hh < g; hh++) {
        float *sc = scores + hh * keys;
        v16 m = SPLAT(best[hh]), lanes = {0};
        for (long j = seen; j < (seen + 15) / 16 * 16; j++) sc[j] = -INFINITY;
        for (long j = 0; j < seen; j += 16) {
            v16 e = exp16(load16_f32(sc + j) - m);
            memcpy(sc + j, &e, 64);
            lanes = lanes + e;
        }
        sum[hh] = tree_v16(lanes);
        for (long x = 0; x <= vecs; x++) acc[hh * (vecs + 1) + x] = (v16){0};
    }
    /* acc = e[0] v_0 + e[1] v_1 + ... per output dim (the dims past the last 16 in one more
     * vector's first lanes) */
    for (long j = 0; j < seen; j++) {
        long c = cols[j];
        const char *row = c < 0 ? hvbase + (c + p) * a->hvs[1] * es : vbase + c * a->vs[2] * es;
        v16 vr[MAX_VECS + 1];
        for (long x = 0; x < vecs; x++) vr[x] = LOAD16(row, x * 16, bf16);
        if (whole < d) {
            float rest[16] = {0};
            for (long x = whole; x < d; x++) rest[x - whole] = LOAD1(row, x, bf16);
            memcpy(&vr[vecs], rest, 64);
        }
        long all = whole < d ? vecs + 1 : vecs;
        for (long hh = 0; hh < g; hh++) {
            float e = scores[hh * keys + j];
            v16 ev = SPLAT(e);
            for (long x = 0; x < all; x++)
                acc[hh * (vecs + 1) + x] = acc[hh * (vecs + 1) + x] + ev * vr[x];
        }
    }
    for (long hh = 0; hh < g; hh++) {
        long o = ((bi * nq + i) * a->h + kv * g + hh) * d;
        const float *num = (const float *)(acc + hh * (vecs + 1));
        for (long x = 0; x < d; x++) {
            float val = seen ? num[x] / sum[hh] : 0.0f;
            if (bf16) ((uint16_t *)a->out)[o + x] = float_bf16(val);
            else ((float *)a->out)[o + x] = val;
        }
    }
}

static void attend_bf16(const attn_t *a, long item, const scratch_t *w) { attend(a, item, w, 1); }
static void attend_f32(const attn_t *a, long item, const scratch_t *w) { attend(a, item, w, 0); }
#if defined(__x86_64__) || defined(__i386__)
#define AVX512 __attribute__((target("avx512f,avx512dq")))
#define AVX2 __attribute__((target("avx2")))
AVX512 static void attend_bf16_avx512(const attn_t *a, long item, const scratch_t *w)
{
    attend(a, item, w, 1);
}
AVX512 static void attend_f32_avx512(const attn_t *a, long item, const scratch_t *w)
{
    attend(a, item, w, 0);
}
AVX2 static void attend_bf16_avx2(const attn_t *a, long item, const scratch_t *w)
{
    attend(a, item, w, 1);
}
AVX2 static void attend_f32_avx2(const attn_t *a, long item, const scratch_t *w)
{
    attend(a, item, w, 0);
}
#endif

/* 2: AVX-512, 1: AVX2, 0: baseline vector code (all three give the same bits) */
int kvchat_attention_isa(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return 2;
    if (__builtin_cpu_supports("avx2")) return 1;
#endif
    return 0;
}

/* q (b, h, nq, d), k / v (b, kh, n, d), a head hk / hv (kh, p, d) or NULL with p = 0, strides
 * in elements; mask (b, nq, n) bytes or NULL; out (b, nq, h, d) contiguous. bf16: 1 for
 * bfloat16 tensors, 0 for float32. Returns 0, -1 on bad shapes, -2 when out of memory. */
int kvchat_attention(const void *q, const void *k, const void *v, const void *hk,
                     const void *hv, const uint8_t *mask, void *out, const long *shape,
                     const long *strides, float scale, float softcap, int bf16, int threads,
                     int force_isa)
{
    attn_t a = {q, k, v, hk, hv, mask, out, shape[0], shape[1], shape[2], shape[3], shape[4],
                shape[5], shape[6], {strides[0], strides[1], strides[2]},
                {strides[3], strides[4], strides[5]}, {strides[6], strides[7], strides[8]},
                {strides[9], strides[10]}, {strides[11], strides[12]}, scale, softcap, bf16};
    if (a.b < 0 || a.h <= 0 || a.kh <= 0 || a.h % a.kh || a.nq < 0 || a.n < 0 || a.p < 0
        || a.d <= 0 || (a.p && (hk == NULL || hv == NULL)))
        return -1;
    if (a.b * a.h * a.nq == 0) return 0;
    int isa = kvchat_attention_isa();
    if (force_isa >= 0 && force_isa < isa) isa = force_isa;
    if (threads < 1) threads = 1;
    long g = a.h / a.kh, keys = (a.p + a.n + 15) / 16 * 16, vecs = a.d / 16 + 1;
    if (g > 64 || vecs > MAX_VECS) return -1;
    /* each thread's scratch, allocated before the threads start */
    size_t t = (size_t)threads;
    float *scores = malloc(sizeof(float) * (size_t)(g * keys + 16) * t);
    int32_t *cols = malloc(sizeof(int32_t) * (size_t)(keys + 1) * t);
    v16 *acc = aligned_alloc(64, sizeof(v16) * (size_t)(g * vecs) * t);
    v16 *qv = aligned_alloc(64, sizeof(v16) * (size_t)(g * vecs) * t);
    float *qf = malloc(sizeof(float) * (size_t)(a.d * g) * t);
    int rc = 0;
    if (!scores || !cols || !acc || !qv || !qf) {
        rc = -2;
    } else {
        long items = a.b * a.kh * a.nq;
        #pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
        for (long item = 0; item < items; item++) {
            long me = omp_get_thread_num();
            scratch_t w = {scores + me * (g * keys + 16), qf + me * a.d * g,
                           acc + me * g * vecs, qv + me * g * vecs, cols + me * (keys + 1),
                           keys};
#if defined(__x86_64__) || defined(__i386__)
            if (isa == 2) {
                if (bf16) attend_bf16_avx512(&a, item, &w);
                else attend_f32_avx512(&a, item, &w);
                continue;
            }
            if (isa == 1) {
                if (bf16) attend_bf16_avx2(&a, item, &w);
                else attend_f32_avx2(&a, item, &w);
                continue;
            }
#endif
            if (bf16) attend_bf16(&a, item, &w);
            else attend_f32(&a, item, &w);
        }
    }
    free(scores); free(cols); free(acc); free(qv); free(qf);
    return rc;
}
