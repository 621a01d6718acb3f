/* One decoder layer of a Llama-shaped model for one row and one new token, in one call: the
 * fused decode forward's steps (kvchat/engine/fused_decode.py's _layer) on the same kernels, in
 * the same order, so every value has the bits that forward gives it.
 *
 *   x  = rms_norm(hidden) as bfloat16              layer_ops.c
 *   qkv = x times the stacked q, k, v weight         int4_matmul.c
 *   q | k = rotary(q | k)                            layer_ops.c
 *   K/V buffers at `pos` = k, v                      (1, KH, capacity, D) bfloat16
 *   a  = attention(q, keys 0 .. pos)                 attention.c (causal: every key)
 *   hidden += float(a times o)                       float32, as torch adds bfloat16 to it
 *   x  = rms_norm(hidden) as bfloat16
 *   g | u = x times the stacked gate, up weight
 *   hidden += float((silu(g) * u) times down)        silu: torch's own bfloat16 values, a
 *                                                    table of all 65,536; the product rounded
 *                                                    to bfloat16 as torch rounds it
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
    const void *norm1, *norm2; /* the norms' weights */
    float eps1, eps2;
    int flags1, flags2;        /* layer_ops.c's flags for each */
    int4_t qkv, o, gate_up, down;
    long hidden, heads, kv_heads, dim, rotary, inter;
    float scaling;
    const uint16_t *silu;      /* torch's bfloat16 silu of each bfloat16, by its bits */
} layer_t;

static inline float bf16_float(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static int mm(const int4_t *w, const uint16_t *x, uint16_t *out, int threads)
{
    return kvchat_int4_mm(w->q, w->scales, w->zeros, x, out, 1, w->n, w->k, threads, -1);
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
    long words = h + qkv_n + qk + heads * d + h + 2 * inter + inter + h;
    uint16_t *scratch = malloc((size_t)words * sizeof(uint16_t));
    if (!scratch) return -2;
    uint16_t *x = scratch, *qkv = x + h, *rot = qkv + qkv_n, *att = rot + qk, *o = att + heads * d;
    uint16_t *gu = o + h, *prod = gu + 2 * inter, *mlp = prod + inter;
    int rc = kvchat_rms_norm(hidden, h, 1, L->norm1, L->norm1, 1, 1, h, L->eps1, L->flags1, x,
                             threads);
    if (!rc) rc = mm(&L->qkv, x, qkv, threads);
    long xs[3] = {qkv_n, qkv_n, d}, cs[2] = {0, L->rotary};
    if (!rc) rc = kvchat_rotary(qkv, xs, cos, sin, cs, 1, 1, heads + kvh, d, L->rotary, rot);
    if (!rc) {
        for (long j = 0; j < kvh; j++) {
            memcpy(k_buf + (j * capacity + pos) * d, rot + (heads + j) * d, (size_t)d * 2);
            memcpy(v_buf + (j * capacity + pos) * d, qkv + qk + j * d, (size_t)d * 2);
        }
        long shape[7] = {1, heads, kvh, 1, pos + 1, 0, d};
        long strides[13] = {qk, d, d, kvh * capacity * d, capacity * d, d,
                            kvh * capacity * d, capacity * d, d, capacity * d, d, capacity * d, d};
        rc = kvchat_attention(rot, k_buf, v_buf, NULL, NULL, NULL, att, shape, strides,
                              L->scaling, 0.0f, 1, threads, -1);
    }
    if (!rc) rc = mm(&L->o, att, o, threads);
    if (!rc) {
        for (long i = 0; i < h; i++) hidden[i] += bf16_float(o[i]);
        rc = kvchat_rms_norm(hidden, h, 1, L->norm2, L->norm2, 1, 1, h, L->eps2, L->flags2, x,
                             threads);
    }
    if (!rc) rc = mm(&L->gate_up, x, gu, threads);
    if (!rc) {
        for (long i = 0; i < inter; i++)
            prod[i] = float_bf16(bf16_float(L->silu[gu[i]]) * bf16_float(gu[inter + i]));
        rc = mm(&L->down, prod, mlp, threads);
    }
    if (!rc)
        for (long i = 0; i < h; i++) hidden[i] += bf16_float(mlp[i]);
    free(scratch);
    return rc;
}
