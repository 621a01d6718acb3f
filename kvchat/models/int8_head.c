/* The output head's matmul: int8 weights in groups with one float32 scale each (the layout of
 * GGUF's Q8_0), float32 activations in, float32 logits out, summed in integers.
 *
 * A weight is s[r, c / group] * q[r, c], the group being 32 columns or the whole row. Each
 * activation row is first written as 16-bit integers x_int on a power-of-two grid, a block of
 * 256 columns at a time (native_sums.h's grid_row: 15 bits against the block's largest value,
 * unit u[m, b]; the last block may be shorter). The columns are taken 64 at a time from the
 * first (a span; the last may be shorter), and for weight row r and activation row m,
 *
 *   D[L]      = the sum of q[r, c] * x_int[m, c] over the span's columns c0 + 4L to c0 + 4L + 3,
 *               L = 0..15 (0 where the span has no such columns; exact, and exact in float32:
 *               |D| <= 4 * 128 * 32767 < 2^24)
 *   a[L]      = fmaf(D[L], S[L], a[L])                      over block b's spans, from 0
 *   acc[L]    = fmaf(a[L], u[m, b], acc[L])                 for b in order, from 0
 *   out[m, r] = the fixed tree over the 16 lanes (native_sums.h's tree16)
 *
 * where S[L] is s[r, (c0 + 4L) / group], the scale of the lane's columns, or 0 where it has
 * none (so that a lane without columns adds nothing, whatever the row's scales hold). Integer products are exact, so AVX-512 (a span's 64 weights as their even and odd columns'
 * 16-bit words by two shifts, then two vpmaddwd), AVX2 (the same on each half, lanes 0-7 and
 * 8-15 in two registers) and the portable C give the same bits, whatever the rows in a call or
 * the threads. The float work is two fmas a lane per 64 weights, where a sum of
 * float32(scale * q) * x costs a conversion, a multiply and an fma per weight and lane.
 *
 * Built by kvchat/models/native.py with -fopenmp; it needs only libc, libm and libgomp. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVCHAT_X86 1
#endif

#include "native_sums.h"

#define SPAN 64
#define ROWS 8 /* activation rows sharing one pass over a weight row */

typedef struct {
    const int8_t *q;
    const float *scales;
    const int16_t *xi; /* (m_rows, k): x_int, for the portable path */
    const int16_t *xs; /* (m_rows, spans * 64): each span's even columns, then its odd ones */
    const float *u;    /* (m_rows, blocks): the grid's units */
    float *out;
    long m_rows, n, k, groups, lo, hi;
    int isa;
} job_t;

static inline long spans_of(long k) { return (k + SPAN - 1) / SPAN; }
static inline long blocks_of(long k) { return (k + GRID_BLOCK - 1) / GRID_BLOCK; }

/* the 16 lane scales S of the span from column c0 of row r: the group is 32 columns or the
 * whole row; 0 for a lane without columns */
static inline void span_scales(const job_t *j, long r, long c0, float *lanes)
{
    for (int l = 0; l < 16; l++) {
        long c = c0 + 4 * l;
        lanes[l] = c < j->k ? j->scales[r * j->groups + (j->groups == 1 ? 0 : c / 32)] : 0.0f;
    }
}

/* a span's 64 weights from column c0, the missing ones of a short span 0 */
static inline const int8_t *span_q(const job_t *j, long r, long c0, int8_t *pad)
{
    const int8_t *q = j->q + r * j->k + c0;
    if (c0 + SPAN <= j->k) return q;
    memset(pad, 0, SPAN);
    memcpy(pad, q, (size_t)(j->k - c0));
    return pad;
}

/* each activation row's x_int, a span at a time: its even columns, then its odd ones */
static void split_spans(const int16_t *xi, long m_rows, long k, int16_t *xs)
{
    long width = spans_of(k) * SPAN;
    memset(xs, 0, (size_t)(m_rows * width) * sizeof(int16_t));
    for (long m = 0; m < m_rows; m++)
        for (long c = 0; c < k; c++)
            xs[m * width + c / SPAN * SPAN + (c % 2) * 32 + (c % SPAN) / 2] = xi[m * k + c];
}

static void rows_portable(const job_t *j)
{
    long k = j->k, blocks = blocks_of(k);
    for (long m = 0; m < j->m_rows; m++) {
        const int16_t *x = j->xi + m * k;
        for (long r = j->lo; r < j->hi; r++) {
            const int8_t *q = j->q + r * k;
            float acc[16] = {0};
            for (long b = 0; b < blocks; b++) {
                long end = b * GRID_BLOCK + GRID_BLOCK < k ? b * GRID_BLOCK + GRID_BLOCK : k;
                float a[16] = {0};
                for (long c0 = b * GRID_BLOCK; c0 < end; c0 += SPAN) {
                    float scale[16];
                    span_scales(j, r, c0, scale);
                    for (int l = 0; l < 16; l++) {
                        int32_t d = 0;
                        for (long c = c0 + 4 * l; c < c0 + 4 * l + 4 && c < end; c++)
                            d += q[c] * x[c];
                        a[l] = fmaf((float)d, scale[l], a[l]);
                    }
                }
                for (int l = 0; l < 16; l++) acc[l] = fmaf(a[l], j->u[m * blocks + b], acc[l]);
            }
            j->out[m * j->n + r] = tree16(acc);
        }
    }
}

#ifdef KVCHAT_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx2,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

/* span_scales of span p of row r as a register: a whole span's two groups' from memory */
AVX512 static inline __m512 scales512(const job_t *j, long r, long p)
{
    const float *s = j->scales + r * j->groups;
    if ((p + 1) * SPAN > j->k) {
        float lanes[16];
        span_scales(j, r, p * SPAN, lanes);
        return _mm512_loadu_ps(lanes);
    }
    if (j->groups == 1) return _mm512_set1_ps(s[0]);
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_castsi128_ps(
        _mm_loadl_epi64((const __m128i *)(s + 2 * p)))));
}

/* D of a span as 16 floats: its weights' even and odd columns against x's */
AVX512 static inline __m512 span512(const int16_t *xs, __m512i v)
{
    __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), odd = _mm512_srai_epi16(v, 8);
    return _mm512_cvtepi32_ps(_mm512_add_epi32(
        _mm512_madd_epi16(_mm512_loadu_si512((const void *)xs), even),
        _mm512_madd_epi16(_mm512_loadu_si512((const void *)(xs + 32)), odd)));
}

/* one activation row: a weight row at a time, in the file's order (on an EPYC, reading four
 * rows side by side took 1.7x as long from memory) */
AVX512 static void one_row512(const job_t *j)
{
    long k = j->k, blocks = blocks_of(k), spans = spans_of(k), whole = k / SPAN;
    int8_t pad[SPAN];
    for (long r = j->lo; r < j->hi; r++) {
        const int8_t *q = j->q + r * k;
        __m512 acc = _mm512_setzero_ps();
        for (long b = 0, p = 0; b < blocks; b++) {
            __m512 a = _mm512_setzero_ps();
            for (long end = p + GRID_BLOCK / SPAN < spans ? p + GRID_BLOCK / SPAN : spans;
                 p < end; p++) {
                _mm_prefetch((const char *)(q + 8 * k + p * SPAN), _MM_HINT_T0);
                const int8_t *w = p < whole ? q + p * SPAN : span_q(j, r, p * SPAN, pad);
                __m512 d = span512(j->xs + p * SPAN, _mm512_loadu_si512((const void *)w));
                __m512 sv = scales512(j, r, p);
                a = _mm512_fmadd_ps(d, sv, a);
            }
            acc = _mm512_fmadd_ps(a, _mm512_set1_ps(j->u[b]), acc);
        }
        j->out[r] = sum512(acc);
    }
}

/* up to ROWS activation rows from m0 against weight row r, each span's weights split once */
#define FOR_ROWS(m, mb) _Pragma("GCC unroll 8") for (int m = 0; m < ROWS; m++) if (m < (mb))

AVX512 static void many_rows512(const job_t *j, long m0, long mb, long r)
{
    long k = j->k, blocks = blocks_of(k), spans = spans_of(k), width = spans * SPAN;
    int8_t pad[SPAN];
    __m512 acc[ROWS], a[ROWS];
    FOR_ROWS(m, ROWS) acc[m] = _mm512_setzero_ps();
    for (long b = 0, p = 0; b < blocks; b++) {
        FOR_ROWS(m, ROWS) a[m] = _mm512_setzero_ps();
        for (long end = p + GRID_BLOCK / SPAN < spans ? p + GRID_BLOCK / SPAN : spans; p < end;
             p++) {
            _mm_prefetch((const char *)(j->q + (r + 4) * k + p * SPAN), _MM_HINT_T0);
            __m512i v = _mm512_loadu_si512((const void *)span_q(j, r, p * SPAN, pad));
            __m512 s = scales512(j, r, p);
            const int16_t *xs = j->xs + m0 * width + p * SPAN;
            FOR_ROWS(m, mb) a[m] = _mm512_fmadd_ps(span512(xs + m * width, v), s, a[m]);
        }
        FOR_ROWS(m, mb)
            acc[m] = _mm512_fmadd_ps(a[m], _mm512_set1_ps(j->u[(m0 + m) * blocks + b]), acc[m]);
    }
    FOR_ROWS(m, mb) j->out[(m0 + m) * j->n + r] = sum512(acc[m]);
}

AVX512 static void rows_avx512(const job_t *j)
{
    if (j->m_rows == 1) {
        one_row512(j);
        return;
    }
    for (long r = j->lo; r < j->hi; r++)
        for (long m0 = 0; m0 < j->m_rows; m0 += ROWS)
            many_rows512(j, m0, j->m_rows - m0 < ROWS ? j->m_rows - m0 : ROWS, r);
}

/* D of a span's half (32 weights at v, x's words at xs: lanes 0-7 or 8-15) as 8 floats */
AVX2 static inline __m256 half256(const int16_t *xs, __m256i v)
{
    __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), odd = _mm256_srai_epi16(v, 8);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(
        _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xs), even),
        _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xs + 32)), odd)));
}

/* scales512's two halves */
AVX2 static inline void scales256(const job_t *j, long r, long p, __m256 *lo, __m256 *hi)
{
    const float *s = j->scales + r * j->groups;
    if ((p + 1) * SPAN > j->k) {
        float lanes[16];
        span_scales(j, r, p * SPAN, lanes);
        *lo = _mm256_loadu_ps(lanes);
        *hi = _mm256_loadu_ps(lanes + 8);
        return;
    }
    *lo = _mm256_set1_ps(j->groups == 1 ? s[0] : s[2 * p]);
    *hi = _mm256_set1_ps(j->groups == 1 ? s[0] : s[2 * p + 1]);
}

AVX2 static void rows_avx2(const job_t *j)
{
    long k = j->k, blocks = blocks_of(k), spans = spans_of(k), width = spans * SPAN;
    int8_t pad[SPAN];
    for (long r = j->lo; r < j->hi; r++) {
        for (long m0 = 0; m0 < j->m_rows; m0 += ROWS / 2) {
            long mb = j->m_rows - m0 < ROWS / 2 ? j->m_rows - m0 : ROWS / 2;
            __m256 acc_lo[ROWS / 2], acc_hi[ROWS / 2], a_lo[ROWS / 2], a_hi[ROWS / 2];
            FOR_ROWS(m, ROWS / 2) acc_lo[m] = acc_hi[m] = _mm256_setzero_ps();
            for (long b = 0, p = 0; b < blocks; b++) {
                FOR_ROWS(m, ROWS / 2) a_lo[m] = a_hi[m] = _mm256_setzero_ps();
                for (long end = p + GRID_BLOCK / SPAN < spans ? p + GRID_BLOCK / SPAN : spans;
                     p < end; p++) {
                    const int8_t *q = span_q(j, r, p * SPAN, pad);
                    __m256i v0 = _mm256_loadu_si256((const __m256i *)q);
                    __m256i v1 = _mm256_loadu_si256((const __m256i *)(q + 32));
                    __m256 s_lo, s_hi;
                    scales256(j, r, p, &s_lo, &s_hi);
                    const int16_t *xs = j->xs + m0 * width + p * SPAN;
                    FOR_ROWS(m, mb) {
                        a_lo[m] = _mm256_fmadd_ps(half256(xs + m * width, v0), s_lo, a_lo[m]);
                        a_hi[m] = _mm256_fmadd_ps(half256(xs + m * width + 16, v1), s_hi,
                                                  a_hi[m]);
                    }
                }
                FOR_ROWS(m, mb) {
                    __m256 unit = _mm256_set1_ps(j->u[(m0 + m) * blocks + b]);
                    acc_lo[m] = _mm256_fmadd_ps(a_lo[m], unit, acc_lo[m]);
                    acc_hi[m] = _mm256_fmadd_ps(a_hi[m], unit, acc_hi[m]);
                }
            }
            FOR_ROWS(m, mb) j->out[(m0 + m) * j->n + r] = sum256x2(acc_lo[m], acc_hi[m]);
        }
    }
}
#endif

/* 2: AVX-512, 1: AVX2 + FMA, 0: portable C */
int kvchat_int8_head_isa(void)
{
#ifdef KVCHAT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq"))
        return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return 1;
#endif
    return 0;
}

static int best_isa = -1;

static void run(const job_t *j)
{
#ifdef KVCHAT_X86
    if (j->isa == 2) { rows_avx512(j); return; }
    if (j->isa == 1) { rows_avx2(j); return; }
#endif
    rows_portable(j);
}

/* q: (n, k) int8; scales: (n, k / group) float32; x: (m_rows, k) float32; out: (m_rows, n)
 * float32. k must be a multiple of 16 and group 32 (dividing k) or k. Returns 0, -1 when the
 * arguments are not that, -2 when out of memory. */
int kvchat_int8_head_mm(const int8_t *q, const float *scales, const float *x, float *out,
                        long m_rows, long n, long k, long group, int threads, int force_isa)
{
    if (k <= 0 || k % 16 || !(group == k || (group == 32 && k % 32 == 0)) || n <= 0
        || m_rows < 0)
        return -1;
    if (m_rows == 0) return 0;
    if (best_isa < 0) best_isa = kvchat_int8_head_isa();
    int isa = force_isa >= 0 && force_isa < best_isa ? force_isa : best_isa;
    if (threads < 1) threads = 1;
    int16_t *xi, *xs = NULL;
    float *u;
    void *scratch = grid_rows(x, m_rows, k, threads, &xi, &u);
    if (scratch && isa > 0) {
        xs = aligned_alloc(64, (size_t)(m_rows * spans_of(k) * SPAN) * sizeof(int16_t));
        if (xs) split_spans(xi, m_rows, k, xs);
    }
    if (!scratch || (isa > 0 && !xs)) {
        free(scratch);
        return -2;
    }
    long per = (n + threads - 1) / threads;
    per = (per + 15) / 16 * 16; /* whole cache lines of output per thread */
    long chunks = (n + per - 1) / per;
    /* OpenMP, so that the threads are torch's own (the same libgomp): no second pool to wake
     * or to spin beside it */
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (long c = 0; c < chunks; c++) {
        job_t job = {q, scales, xi, xs, u, out, m_rows, n, k, k / group, c * per,
                     c * per + per < n ? c * per + per : n, isa};
        run(&job);
    }
    free(xs);
    free(scratch);
    return 0;
}
