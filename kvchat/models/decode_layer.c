/* One decoder layer for one row and one new token, in one call: the fused decode forward's
 * steps (kvchat/engine/fused_decode.py's _layer) on the same kernels, in the same order, so
 * every value has the bits that forward gives it.
 *
 *   x  = rms_norm(hidden) as bfloat16              layer_ops.c
 *   qkv = x times the stacked q, k, v weight         int4_matmul.c, plus the bias (Qwen2)
 *                                                    rounded to bfloat16 as torch rounds it
 *   q | k = rms_norm per head (Qwen3, Gemma 3)       layer_ops.c, where the layer has them
 *   q | k = rotary(q | k)                            layer_ops.c
 *   K/V buffers at `pos` = k, v                      (1, KH, capacity, D) bfloat16
 *   a  = attention(q, keys 0 .. pos)                 attention.c (causal: every key)
 *   hidden += float(norm(a times o))                 float32, as torch adds bfloat16 to it;
 *                                                    Gemma's norm after, where it has one
 *   x  = rms_norm(hidden) as bfloat16
 *   g | u = x times the stacked gate, up weight
 *   hidden += float(norm((act(g) * u) times down))   act: torch's own bfloat16 values of the
 *                                                    layer's activation, a table of all 65,536;
 *                                                    the product rounded to bfloat16 as torch
 *                                                    rounds it
 *
 * The Python caller builds `layer_t` once per layer (kvchat/engine/native_layer.py) and keeps
 * the tensors it points to alive. Built by kvchat/models/native.py with the other kernels. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_sums.h"

int kvchat_rms_norm(const void *x, long outer, long per, const void *w_first,
                    const void *w_rest, long split, long rows, long n, float eps, int flags,
                    void *out, int threads);
int kvchat_int4_mm(const uint8_t *q, const uint16_t *scales, const uint16_t *zeros,
                   const uint16_t *x, uint16_t *out, long m_rows, long n, long k,
                   int threads, int force_isa);
int kvchat_rotary(const uint16_t *x, const long *xs, const uint16_t *cos, const uint16_t *sin,
                  const long *cs, long b, long q, long heads, long d, long r, uint16_t *out);
int kvchat_attention(const void *q, const void *k, const void *v, const void *hk,
                     const void *hv, const uint8_t *mask, void *out, const long *shape,
                     const long *strides, float scale, float softcap, int bf16, int threads,
                     int force_isa);

typedef struct {
    const uint8_t *q;
    const uint16_t *scales, *zeros;
    long n, k;
} int4_t;

typedef struct {
    const void *w, *rest; /* rest: the k norm's weight, heads from `split` on; w NULL: none */
    long split;
    float eps;
    int flags;            /* layer_ops.c's */
} norm_t;

typedef struct {
    norm_t norm1, norm2, qk, post_attn, post_mlp;
    int4_t qkv, o, gate_up, down;
    long hidden, heads, kv_heads, dim, rotary, inter;
    float scaling, softcap; /* softcap 0: none (Gemma 2 caps its scores) */
    const uint16_t *act;  /* torch's bfloat16 activation of each bfloat16, by its bits */
    const uint16_t *qkv_bias; /* bfloat16, or NULL */
} layer_t;

static int mm(const int4_t *w, const uint16_t *x, uint16_t *out, int threads)
{
    return kvchat_int4_mm(w->q, w->scales, w->zeros, x, out, 1, w->n, w->k, threads, -1);
}

/* rows of n values at x, `outer` apart, `per` to a row of x (heads) */
static int norm(const norm_t *nm, const void *x, long outer, long per, long n, void *out,
                int threads)
{
    return kvchat_rms_norm(x, outer, per, nm->w, nm->rest, nm->split, per, n, nm->eps,
                           nm->flags, out, threads);
}

/* hidden += float(v), v normed first where `post` is a norm (into `tmp`) */
static int add(float *hidden, const uint16_t *v, const norm_t *post, uint16_t *tmp, long h,
               int threads)
{
    if (post->w) {
        int rc = norm(post, v, h, 1, h, tmp, threads);
        if (rc) return rc;
        v = tmp;
    }
    for (long i = 0; i < h; i++) hidden[i] += bf16_float(v[i]);
    return 0;
}

/* hidden: (hidden,) float32, updated in place; cos, sin: (rotary,) bfloat16; k_buf, v_buf:
 * (kv_heads, capacity, dim) bfloat16, position `pos` written. Returns 0, -1 on arguments the
 * kernels refuse, -2 when out of memory. */
int kvchat_decode_layer(const layer_t *L, float *hidden, const uint16_t *cos,
                        const uint16_t *sin, uint16_t *k_buf, uint16_t *v_buf, long capacity,
                        long pos, int threads)
{
    long h = L->hidden, d = L->dim, heads = L->heads, kvh = L->kv_heads, inter = L->inter;
    long qkv_n = L->qkv.n, qk = (heads + kvh) * d;
    if (pos < 0 || pos >= capacity || qkv_n != qk + kvh * d || L->gate_up.n != 2 * inter)
        return -1;
    long words = h + qkv_n + 2 * qk + heads * d + 2 * h + 2 * inter + inter + h;
    uint16_t *scratch = malloc((size_t)words * sizeof(uint16_t));
    if (!scratch) return -2;
    uint16_t *x = scratch, *qkv = x + h, *qkn = qkv + qkv_n, *rot = qkn + qk;
    uint16_t *att = rot + qk, *o = att + heads * d, *tmp = o + h, *gu = tmp + h;
    uint16_t *prod = gu + 2 * inter, *mlp = prod + inter;
    int rc = norm(&L->norm1, hidden, h, 1, h, x, threads);
    if (!rc) rc = mm(&L->qkv, x, qkv, threads);
    if (!rc && L->qkv_bias)
        for (long i = 0; i < qkv_n; i++)
            qkv[i] = float_bf16(bf16_float(qkv[i]) + bf16_float(L->qkv_bias[i]));
    const uint16_t *q_k = qkv;
    long xs[3] = {qkv_n, qkv_n, d}, cs[2] = {0, L->rotary};
    if (!rc && L->qk.w) {
        rc = norm(&L->qk, qkv, qkv_n, heads + kvh, d, qkn, threads);
        q_k = qkn;
        xs[0] = xs[1] = qk;
    }
    if (!rc) rc = kvchat_rotary(q_k, xs, cos, sin, cs, 1, 1, heads + kvh, d, L->rotary, rot);
    if (!rc) {
        for (long j = 0; j < kvh; j++) {
            memcpy(k_buf + (j * capacity + pos) * d, rot + (heads + j) * d, (size_t)d * 2);
            memcpy(v_buf + (j * capacity + pos) * d, qkv + qk + j * d, (size_t)d * 2);
        }
        long shape[7] = {1, heads, kvh, 1, pos + 1, 0, d};
        long strides[13] = {qk, d, d, kvh * capacity * d, capacity * d, d,
                            kvh * capacity * d, capacity * d, d, capacity * d, d, capacity * d, d};
        rc = kvchat_attention(rot, k_buf, v_buf, NULL, NULL, NULL, att, shape, strides,
                              L->scaling, L->softcap, 1, threads, -1);
    }
    if (!rc) rc = mm(&L->o, att, o, threads);
    if (!rc) rc = add(hidden, o, &L->post_attn, tmp, h, threads);
    if (!rc) rc = norm(&L->norm2, hidden, h, 1, h, x, threads);
    if (!rc) rc = mm(&L->gate_up, x, gu, threads);
    if (!rc) {
        for (long i = 0; i < inter; i++)
            prod[i] = float_bf16(bf16_float(L->act[gu[i]]) * bf16_float(gu[inter + i]));
        rc = mm(&L->down, prod, mlp, threads);
    }
    if (!rc) rc = add(hidden, mlp, &L->post_mlp, tmp, h, threads);
    free(scratch);
    return rc;
}

/* A step's layers in one call, in order: layer i over k_bufs[i], v_bufs[i] (capacity[i]
 * positions) at pos[i], with its kind's rotary table cos[i], sin[i]; what calling
 * kvchat_decode_layer on each in turn does, without a call from Python between them. Stops
 * at the first layer that returns other than 0 and returns that. */
int kvchat_decode_layers(const layer_t *const *layers, long n, float *hidden,
                         const uint16_t *const *cos, const uint16_t *const *sin,
                         uint16_t *const *k_bufs, uint16_t *const *v_bufs,
                         const long *capacity, const long *pos, int threads)
{
    for (long i = 0; i < n; i++) {
        int rc = kvchat_decode_layer(layers[i], hidden, cos[i], sin[i], k_bufs[i], v_bufs[i],
                                     capacity[i], pos[i], threads);
        if (rc) return rc;
    }
    return 0;
}
