/* The small per-layer operations of a decoder between its weight kernels, one call each where
 * torch runs several: a decode step on CPU spends as long in those calls as in the weights.
 *
 * RMSNorm, kvchat's own definition (the model's norm modules and the fused decode forward both
 * run it, `kvchat.models.layer_ops`, so both forwards keep giving the same bits): for each row x of
 * n values (float32, or bfloat16 read exactly),
 *
 *   ss  = the sum of x[c]^2 in double, in 8 lanes (lane c % 8, c ascending), then
 *         ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))    (each square exact in double)
 *   r   = 1 / sqrtf((float)(ss / n) + eps)                      (float32, each op rounded once)
 *   y   = x[c] * r                                              (float32)
 *   t   = y, or bfloat16(y) when `round_y` (Llama's cast back to a bfloat16 input's dtype)
 *   out = w[c] * t, float32, then bfloat16 when `out_bf16`
 *
 * with w the norm's weight read from its own tensor at each call (float32, or bfloat16 read
 * exactly): Llama's weight, or Gemma's (float)(1 + weight) when `gemma`. Nothing depends on the
 * other rows, the threads or the instruction set: the loops are plain C, built with
 * -ffp-contract=off.
 *
 * Rotary embedding, torch's arithmetic exactly (`apply_rotary_pos_emb` on bfloat16 tensors,
 * which computes each elementwise op in float32 and rounds it to bfloat16): over the first R
 * dims of each head, with h = R / 2 and rot[e] = -x[e + h] for e < h, x[e - h] otherwise,
 *
 *   out[e] = bf16(bf16(x[e] * cos[e]) + bf16(rot[e] * sin[e])),   out[e] = x[e] for e >= R.
 *
 * Built by kvchat/models/native.py with the other kernels. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_sums.h"

static inline float round_bf16(float f) { return bf16_float(float_bf16(f)); }

/* the sum of squares of n values, lane c % 8, c ascending, then the fixed tree (the header) */
#define SQUARES(read)                                                                      \
    do {                                                                                   \
        long c = 0;                                                                        \
        for (; c + 8 <= n; c += 8) {                                                       \
            _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {                         \
                double v = read(c + i);                                                    \
                lanes[i] += v * v;                                                         \
            }                                                                              \
        }                                                                                  \
        for (; c < n; c++) {                                                               \
            double v = read(c);                                                            \
            lanes[c % 8] += v * v;                                                         \
        }                                                                                  \
    } while (0)

/* inlined into one copy per instruction set (norm_rows_*): the lanes stay the definition's
 * eight, which AVX-512 holds in one register and AVX2 in two; only the width changes */
__attribute__((always_inline)) static inline void
norm_row(const void *x, long at, int x_bf16, const float *w, long n, float eps, int round_y,
         void *out, long to, int out_bf16)
{
    const uint16_t *xb = (const uint16_t *)x + at;
    const float *xf = (const float *)x + at;
    double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#define READ_BF16(c) (double)bf16_float(xb[c])
#define READ_F32(c) (double)xf[c]
    if (x_bf16) SQUARES(READ_BF16);
    else SQUARES(READ_F32);
    double ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
                + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    float *of = (float *)out + to;
    uint16_t *ob = (uint16_t *)out + to;
    if (!x_bf16 && !out_bf16) {
        for (long c = 0; c < n; c++) of[c] = w[c] * (xf[c] * r);
    } else if (!x_bf16) {
        for (long c = 0; c < n; c++) ob[c] = float_bf16(w[c] * (xf[c] * r));
    } else if (round_y && out_bf16) { /* the loops apart, so that each vectorizes */
        for (long c = 0; c < n; c++) ob[c] = float_bf16(w[c] * round_bf16(bf16_float(xb[c]) * r));
    } else if (round_y) {
        for (long c = 0; c < n; c++) of[c] = w[c] * round_bf16(bf16_float(xb[c]) * r);
    } else if (out_bf16) {
        for (long c = 0; c < n; c++) ob[c] = float_bf16(w[c] * (bf16_float(xb[c]) * r));
    } else {
        for (long c = 0; c < n; c++) of[c] = w[c] * (bf16_float(xb[c]) * r);
    }
}

/* the weight as norm_row multiplies by it: float32 (w_bf16: bfloat16 read exactly), plus 1 for
 * Gemma's formula */
static void weight_row(const void *w, int w_bf16, int gemma, long n, float *to)
{
    const uint16_t *wb = (const uint16_t *)w;
    const float *wf = (const float *)w;
    float one = gemma ? 1.0f : -0.0f; /* -0 + v is v, signed zeros too: Llama's weight as is */
    if (w_bf16) { /* each loop apart, so that it vectorizes */
        for (long c = 0; c < n; c++) to[c] = one + bf16_float(wb[c]);
    } else {
        for (long c = 0; c < n; c++) to[c] = one + wf[c];
    }
}

/* The flags of a call (one argument: each argument costs the Python caller about 0.2 us) */
enum { X_BF16 = 1, W_BF16 = 2, GEMMA = 4, ROUND_Y = 8, OUT_BF16 = 16 };
#define ISA_CAP(flags) (((flags) >> 5) & 3) /* 0: the best here, 1: plain C, 2: AVX2 at most */

typedef struct {
    const void *x;
    const float *w; /* (2, n): w_first's row, then w_rest's */
    long outer, per, split, n;
    float eps;
    int x_bf16, round_y, out_bf16;
    void *out;
} norm_job_t;

/* rows [r0, r1) of a call, one copy per instruction set (the loops vectorized at -O2) */
#define NORM_ROWS(name, attrs)                                                              \
    attrs static void name(const norm_job_t *j, long r0, long r1)                          \
    {                                                                                      \
        for (long r = r0; r < r1; r++) {                                                   \
            long at = (r / j->per) * j->outer + (r % j->per) * j->n;                       \
            norm_row(j->x, at, j->x_bf16, j->w + (r % j->per < j->split ? 0 : j->n), j->n, \
                     j->eps, j->round_y, j->out, r * j->n, j->out_bf16);                   \
        }                                                                                  \
    }

#define VECTORIZED optimize("vect-cost-model=dynamic")
NORM_ROWS(norm_rows_c, __attribute__((VECTORIZED)))
#if defined(__x86_64__) || defined(__i386__)
NORM_ROWS(norm_rows_avx2, __attribute__((target("avx2,fma,f16c"), VECTORIZED)))
NORM_ROWS(norm_rows_avx512,
          __attribute__((target("avx512f,avx512bw,avx512dq,prefer-vector-width=512"), VECTORIZED)))
#endif

typedef void (*norm_rows_fn)(const norm_job_t *, long, long);

/* the copy for this CPU, at most `cap` (ISA_CAP) */
static norm_rows_fn norm_rows_for(int cap)
{
    if (cap == 1) return norm_rows_c;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (cap != 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq"))
        return norm_rows_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return norm_rows_avx2;
#endif
    return norm_rows_c;
}

/* out: (rows, n) contiguous, float32 or bfloat16 (OUT_BF16); x likewise (X_BF16), row r at
 * element (r / per) * outer + (r % per) * n (per = 1, outer = n: contiguous; per = heads: a row
 * of heads read in place). w_first, w_rest: (n,) weights, float32 or bfloat16 (W_BF16); head
 * r % per takes w_first below `split`, w_rest from it on (a q norm's heads, then a k norm's).
 * ISA_CAP(flags) caps the copy that runs (the tests compare them). Returns 0, -1 on bad
 * shapes, -2 out of memory. */
int kvchat_rms_norm(const void *x, long outer, long per, const void *w_first,
                    const void *w_rest, long split, long rows, long n, float eps, int flags,
                    void *out, int threads)
{
    static norm_rows_fn best = NULL;
    int cap = ISA_CAP(flags);
    int w_bf16 = !!(flags & W_BF16), gemma = !!(flags & GEMMA);
    if (rows < 0 || n <= 0 || per <= 0 || outer < per * n || (split < per && !w_rest))
        return -1;
    float *w = malloc(2 * (size_t)n * sizeof(float));
    if (!w) return -2;
    weight_row(w_first, w_bf16, gemma, n, w);
    if (split < per) weight_row(w_rest, w_bf16, gemma, n, w + n);
    if (best == NULL) best = norm_rows_for(0);
    norm_rows_fn fn = cap ? norm_rows_for(cap) : best;
    norm_job_t job = {x, w, outer, per, split, n, eps, !!(flags & X_BF16), !!(flags & ROUND_Y),
                      !!(flags & OUT_BF16), out};
    int team = threads > 1 && rows * n >= 65536 ? threads : 1;
    #pragma omp parallel for num_threads(team) schedule(static, 1)
    for (int t = 0; t < team; t++)
        fn(&job, rows * t / team, rows * (t + 1) / team);
    free(w);
    return 0;
}

/* out[e] for e in [from, to): rot[e] = x[e + shift] with its sign bit xor `flip` (negated) */
__attribute__((optimize("vect-cost-model=dynamic"))) /* the loop vectorized at -O2 */
static void rotate_part(const uint16_t *v, const uint16_t *c, const uint16_t *s, uint16_t *o,
                        long from, long to, long shift, uint16_t flip)
{
    for (long e = from; e < to; e++) {
        float a = round_bf16(bf16_float(v[e]) * bf16_float(c[e]));
        float b = round_bf16(bf16_float(v[e + shift] ^ flip) * bf16_float(s[e]));
        o[e] = float_bf16(a + b);
    }
}

/* x: bfloat16 (b, q, heads, d) at element strides xs (b, q, head; d contiguous); cos / sin:
 * bfloat16 (b or 1, q, r) at strides cs (b, q; r contiguous), both read with them; out:
 * bfloat16 (b, heads, q, d), contiguous. Returns 0, or -1 on bad shapes. */
int kvchat_rotary(const uint16_t *x, const long *xs, const uint16_t *cos, const uint16_t *sin,
                  const long *cs, long b, long q, long heads, long d, long r, uint16_t *out)
{
    if (b < 0 || q < 0 || heads < 0 || r <= 0 || r % 2 || r > d) return -1;
    long h = r / 2;
    for (long bi = 0; bi < b; bi++)
        for (long hh = 0; hh < heads; hh++)
            for (long i = 0; i < q; i++) {
                const uint16_t *v = x + bi * xs[0] + i * xs[1] + hh * xs[2];
                const uint16_t *c = cos + bi * cs[0] + i * cs[1], *s = sin + bi * cs[0] + i * cs[1];
                uint16_t *o = out + ((bi * heads + hh) * q + i) * d;
                rotate_part(v, c, s, o, 0, h, h, 0x8000); /* rot = -x[e + h] */
                rotate_part(v, c, s, o, h, r, -h, 0); /* rot = x[e - h] */
                for (long e = r; e < d; e++) o[e] = v[e];
            }
    return 0;
}
