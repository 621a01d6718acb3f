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

#include "attention.h"

/* The g query heads that share KV head `kv`, at query i of row bi: each computed exactly as it
 * would be alone (the heads share only the loads of each key and value). */
INLINE void attend(const attn_t *a, long item, const scratch_t *w, const int bf16)
{
    const long d = a->d, whole = d / 16 * 16, vecs = d / 16, g = a->h / a->kh;
    const long nq = a->nq, p = a->p, keys = w->keys, es = bf16 ? 2 : 4;
    const long i = item % nq, kv = (item / nq) % a->kh, bi = item / (a->kh * nq);
    const float scale = a->scale, softcap = a->softcap;
    float *const scores = w->scores, *const qf = w->qf;
    v16 *const acc = w->acc, *const qv = w->qv;
    int32_t *const cols = w->cols;
    for (long hh = 0; hh < g; hh++) {
        long at = bi * a->qs[0] + (kv * g + hh) * a->qs[1] + i * a->qs[2];
        for (long x = 0; x < d; x++) qf[hh * d + x] = LOAD1(a->q, at + x, bf16);
        for (long x = 0; x < vecs; x++) qv[hh * vecs + x] = load16_f32(qf + hh * d + x * 16);
    }
    const long seen = visible_keys(a, bi, i, cols);
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
        sum[hh] = exp_scores(scores + hh * keys, seen, best[hh]);
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
        write_out(a, o, (const float *)(acc + hh * (vecs + 1)), sum[hh], seen);
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


/* the entry for this dtype, head dim and instruction set: the blocked form where one is built,
 * `attend` otherwise */
static attend_fn pick(int isa, int bf16, long d)
{
    attend_fn fn = kvchat_attention_blocked(isa, bf16, d);
    if (fn) return fn;
#if defined(__x86_64__) || defined(__i386__)
    if (isa == 2) return bf16 ? attend_bf16_avx512 : attend_f32_avx512;
    if (isa == 1) return bf16 ? attend_bf16_avx2 : attend_f32_avx2;
#endif
    return bf16 ? attend_bf16 : attend_f32;
}

/* one thread's share of each scratch array (in its own elements): thread t's slice begins
 * t of these past thread 0's, which scratch_t w0 points at */
typedef struct {
    long scores, qf, vecs, cols;
} sizes_t;

/* every (row, KV head, query) of the call, each by one thread on its own slice of w0: the
 * queries of one KV head are consecutive items (`attend` reads the item so), so that a thread's
 * run of them reads one head's keys and values, which stay in its cache (2-15% less time
 * for a 512-token prefill's attention on 2 threads than with the KV heads interleaved) */
static int run_items(const attn_t *a, attend_fn fn, int threads, const scratch_t *w0,
                     const sizes_t *z)
{
    long items = a->b * a->kh * a->nq;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
    for (long item = 0; item < items; item++) {
        long me = omp_get_thread_num();
        scratch_t w = {w0->scores + me * z->scores, w0->qf + me * z->qf,
                       w0->acc + me * z->vecs, w0->qv + me * z->vecs, w0->cols + me * z->cols,
                       w0->keys, w0->rows + me * BLOCK_FLOATS};
        fn(a, item, &w);
    }
    return 0;
}

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

/* bfloat16 rows (n0, n1, n2, d) with element strides st, to be widened into float32 rows,
 * contiguous, at dst */
typedef struct {
    const void *src;
    long n0, n1, n2, st[3];
    float *dst;
} widen_t;

/* the rows of every job in `jobs`, in one parallel loop; d a multiple of 16 */
static void widen(const widen_t *jobs, int count, long d, int threads)
{
    long ends[8], rows = 0;
    for (int j = 0; j < count; j++) ends[j] = rows += jobs[j].n0 * jobs[j].n1 * jobs[j].n2;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++) {
        int j = 0;
        while (r >= ends[j]) j++;
        const widen_t *w = jobs + j;
        long at = r - (ends[j] - w->n0 * w->n1 * w->n2), n12 = w->n1 * w->n2;
        const uint16_t *row = (const uint16_t *)w->src + at / n12 * w->st[0]
                              + at / w->n2 % w->n1 * w->st[1] + at % w->n2 * w->st[2];
        for (long x = 0; x < d; x += 16) {
            v16 v = load16_bf16(row + x);
            memcpy(w->dst + at * d + x, &v, 64);
        }
    }
}

#define WIDEN_MAX_BYTES (64L << 20)
#define WIDEN_MIN_QUERIES 16

/* The call with bfloat16 keys read by many queries each (a prefill): widened to float32
 * once, then attended by the blocked form for float32 with a bfloat16 output. The same bits
 * (widening is exact), without widening every key again for each query. Returns 1 when it
 * ran, 0 when the call is not one. */
static int attend_widened(const attn_t *a, int isa, int threads, const scratch_t *w0,
                          const sizes_t *z)
{
    const long b = a->b, h = a->h, kh = a->kh, nq = a->nq, n = a->n, p = a->p, d = a->d;
    /* a prefill's keys, read by its nq queries each, pay for a fresh buffer and one pass over
     * them; a decode step's or a few drafts' do not (the head alone is not worth it either) */
    if (!a->bf16 || nq < WIDEN_MIN_QUERIES || !kvchat_attention_blocked(isa, 0, d)) return 0;
    long qe = b * h * nq * d, ke = b * kh * n * d, he = kh * p * d;
    if ((qe + 2 * (ke + he)) * 4 > WIDEN_MAX_BYTES) return 0;
    float *buf = aligned_alloc(64, (size_t)(qe + 2 * (ke + he) + 16) * 4);
    if (!buf) return 0;
    float *qf = buf, *kf = qf + qe, *vf = kf + ke, *hkf = vf + ke, *hvf = hkf + he;
    widen_t jobs[5] = {
        {a->q, b, h, nq, {a->qs[0], a->qs[1], a->qs[2]}, qf},
        {a->k, b, kh, n, {a->ks[0], a->ks[1], a->ks[2]}, kf},
        {a->v, b, kh, n, {a->vs[0], a->vs[1], a->vs[2]}, vf},
        {a->hk, 1, kh, p, {0, a->hks[0], a->hks[1]}, hkf},
        {a->hv, 1, kh, p, {0, a->hvs[0], a->hvs[1]}, hvf}};
    widen(jobs, p ? 5 : 3, d, threads);
    attn_t f = *a;
    f.q = qf; f.k = kf; f.v = vf; f.hk = p ? hkf : NULL; f.hv = p ? hvf : NULL;
    f.qs[0] = h * nq * d; f.qs[1] = nq * d; f.qs[2] = d;
    f.ks[0] = f.vs[0] = kh * n * d; f.ks[1] = f.vs[1] = n * d; f.ks[2] = f.vs[2] = d;
    f.hks[0] = f.hvs[0] = p * d; f.hks[1] = f.hvs[1] = d;
    f.bf16 = 0;
    run_items(&f, kvchat_attention_blocked(isa, 0, d), threads, w0, z);
    free(buf);
    return 1;
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
                {strides[9], strides[10]}, {strides[11], strides[12]}, scale, softcap, bf16, bf16};
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
    sizes_t z = {g * keys + 16, a.d * g, g * vecs, keys + 1};
    scratch_t w0 = {malloc(sizeof(float) * (size_t)z.scores * t),
                    malloc(sizeof(float) * (size_t)z.qf * t),
                    aligned_alloc(64, sizeof(v16) * (size_t)z.vecs * t),
                    aligned_alloc(64, sizeof(v16) * (size_t)z.vecs * t),
                    malloc(sizeof(int32_t) * (size_t)z.cols * t), keys,
                    aligned_alloc(64, sizeof(float) * BLOCK_FLOATS * t)};
    int rc = 0;
    if (!w0.scores || !w0.qf || !w0.acc || !w0.qv || !w0.cols || !w0.rows)
        rc = -2;
    else if (!attend_widened(&a, isa, threads, &w0, &z))
        rc = run_items(&a, pick(isa, bf16, a.d), threads, &w0, &z);
    free(w0.scores); free(w0.qf); free(w0.acc); free(w0.qv); free(w0.cols); free(w0.rows);
    return rc;
}
