/* The int4 layers' grids, found in C: `quant.quantize_int4` for a whole weight at once, each
 * group of 32 values on its own (one OpenMP thread per run of groups), op for op as the torch
 * code does it, so the grids, scales and zeros are bitwise the same (tests compare the two).
 *
 * For a group c[0..31] (each clamped to float16's range):
 *   lo, hi = min, max; span = hi - lo; step = span / 15;
 *   if span != 0 and not on_grid(step): the 32 values sorted, smallest = the least gap above
 *   span * 1e-4 (else span), levels = rint(span / smallest), candidate = span /
 *   clamp(levels, 1, 15); step = candidate if levels <= 15 and on_grid(candidate);
 *   scale = the least float16 >= step (0 when span is 0), zero = float16(lo) (nearest even);
 *   q[i] = clamp(rint((c[i] - zero) / max(scale, FLT_MIN)), 0, 15)
 * with on_grid(s): every |t - rint(t)| <= 1e-3, t = (c[i] - lo) / max(s, FLT_MIN). rint rounds
 * half to even, as torch's round. Built with -ffp-contract=off: no product is fused into a sum.
 * A group holding a NaN is not gridded here (the caller falls back to torch). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "native_sums.h"

#define GROUP 32
#define F16_MAX 65504.0f

/* the least float16 >= x, for x > 0 (quant._round_up) */
static inline uint16_t half_round_up(float x)
{
    uint16_t down = float_half(x);
    if (half_float(down) >= x || (down & 0x7fffu) >= 0x7c00u) return down;
    return (uint16_t)(down + 1); /* positive and finite: the next half up */
}

/* whether the largest |t - rint(t)| is <= 1e-3 (false for a NaN): the first value past it
 * settles that, so the rest are not divided */
static int on_grid(const float *c, float lo, float step)
{
    float s = step > FLT_MIN ? step : FLT_MIN;
    for (int i = 0; i < GROUP; i++) {
        float t = (c[i] - lo) / s;
        if (!(fabsf(t - rintf(t)) <= 1e-3f)) return 0;
    }
    return 1;
}

static float grid_step(const float *c, float lo, float span)
{
    float step = span / 15.0f;
    if (span == 0.0f || on_grid(c, lo, step)) return step;
    /* the candidate below is span / L for some L in 1..14 (15 failed above), accepted only
     * where on_grid holds for it: where it holds for none, the answer is `step` and the sort
     * can be skipped (the same answer, found in a few divisions: values off any grid, a Q6_K
     * layer's, fail each at their first value or two) */
    int some = 0;
    for (int l = 1; l < 15 && !some; l++) some = on_grid(c, lo, span / (float)l);
    if (!some) return step;
    float sorted[GROUP];
    memcpy(sorted, c, sizeof sorted);
    for (int i = 1; i < GROUP; i++) { /* insertion sort: 32 values */
        float v = sorted[i];
        int j = i - 1;
        for (; j >= 0 && sorted[j] > v; j--) sorted[j + 1] = sorted[j];
        sorted[j + 1] = v;
    }
    float floor_gap = span * 1e-4f, smallest = INFINITY;
    for (int i = 0; i + 1 < GROUP; i++) {
        float gap = sorted[i + 1] - sorted[i];
        float v = gap > floor_gap ? gap : span;
        if (v < smallest) smallest = v;
    }
    float levels = rintf(span / (smallest > FLT_MIN ? smallest : FLT_MIN));
    float candidate = span / (levels < 1.0f ? 1.0f : levels > 15.0f ? 15.0f : levels);
    return levels <= 15.0f && on_grid(c, lo, candidate) ? candidate : step;
}

/* one group: 0, or -1 if it holds a NaN */
static int grid_group(const float *w, uint8_t *q, uint16_t *scale, uint16_t *zero)
{
    float c[GROUP], lo, hi;
    for (int i = 0; i < GROUP; i++) {
        float v = w[i];
        if (v != v) return -1;
        c[i] = v < -F16_MAX ? -F16_MAX : v > F16_MAX ? F16_MAX : v;
    }
    lo = hi = c[0];
    for (int i = 1; i < GROUP; i++) {
        if (c[i] < lo) lo = c[i];
        if (c[i] > hi) hi = c[i];
    }
    float span = hi - lo;
    *scale = span == 0.0f ? 0 : half_round_up(grid_step(c, lo, span));
    *zero = float_half(lo);
    float s = half_float(*scale), z = half_float(*zero);
    if (!(s > FLT_MIN)) s = FLT_MIN;
    for (int i = 0; i < GROUP; i++) {
        float v = rintf((c[i] - z) / s);
        q[i] = (uint8_t)(v < 0.0f ? 0.0f : v > 15.0f ? 15.0f : v);
    }
    return 0;
}

/* w: `groups` runs of 32 float32 values (an (N, K) weight, K % 32 == 0, row-major); q: one
 * byte per value; scales, zeros: one float16 per group. Returns the number of groups that held
 * a NaN (nothing gridded then is to be used). */
long kvchat_int4_grid(const float *w, long groups, uint8_t *q, uint16_t *scales,
                      uint16_t *zeros, int threads)
{
    long bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) num_threads(threads > 0 ? threads : 1)
    for (long g = 0; g < groups; g++)
        bad += grid_group(w + g * GROUP, q + g * GROUP, scales + g, zeros + g) != 0;
    return bad;
}
