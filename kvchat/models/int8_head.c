/* The output head's matmul: int8 weights in groups with one float32 scale each (the layout of
 * GGUF's Q8_0), float32 activations in, float32 logits out.
 *
 * out[m, r] = sum over c of (scale[r, c / group] * q[r, c]) * x[m, c]
 *
 * Every output is computed by one thread, in one order that does not depend on the number of
 * rows, the threads or the instruction set: 16 lanes, lane l accumulating the columns c with
 * c % 16 == l by fused multiply-adds in column order, the weight first rounded to
 * float32(scale * q); then the lanes are summed as a fixed tree (l + l+8, then + l+4, + l+2,
 * + l+1). The AVX-512 path holds the 16 lanes in one register, the AVX2 path in two, the
 * portable path in an array, so all three give the same bits.
 *
 * Built by kvchat/models/native.py with -fopenmp; it needs only libc, libm and libgomp. */

#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVCHAT_X86 1
#endif

#include "native_sums.h"

#define ROW_BLOCK 4 /* activation rows sharing one pass over the weights (AVX2, portable) */
#define ROW_BLOCK512 8 /* the same on AVX-512, with twice the registers */


typedef struct {
    const int8_t *q;
    const float *scales;
    const float *x;
    float *out;
    long m_rows, n, k, group, lo, hi;
    int isa;
} job_t;

static void rows_portable(const job_t *j)
{
    long groups = j->k / j->group;
    for (long m = 0; m < j->m_rows; m++) {
        const float *x = j->x + m * j->k;
        for (long r = j->lo; r < j->hi; r++) {
            const int8_t *q = j->q + r * j->k;
            const float *s = j->scales + r * groups;
            float lane[16] = {0};
            for (long c = 0; c < j->k; c += 16) {
                float scale = s[c / j->group];
                for (int l = 0; l < 16; l++) {
                    float w = scale * (float)q[c + l];
                    lane[l] = fmaf(w, x[c + l], lane[l]);
                }
            }
            j->out[m * j->n + r] = tree16(lane);
        }
    }
}

#ifdef KVCHAT_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq")))
#define AVX2 __attribute__((target("avx2,fma")))

/* float32(scale * q) of 16 weights: each weight as the definition rounds it */
AVX512 static inline __m512 weights16(const int8_t *q, __m512 scale)
{
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)q))));
}

/* One activation row (a decode step), four weight rows at a time from `r`: each logit's sums
 * in the same order as rows_avx512's, four fma chains in flight instead of one, and the next
 * four rows prefetched as these are read (a core's own hardware prefetch kept the head at about
 * 8 GB/s from memory, a third of what it computes at in cache; a 2-core Xeon, 128,256 x 2,048
 * weights: 18.6 ms a step before, 13.3 ms with this). Returns the first row it left. */
AVX512 static long one_row_avx512(const job_t *j, long r)
{
    long groups = j->k / j->group, k = j->k;
    const float *x = j->x;
    for (; r + 4 <= j->hi; r += 4) {
        const int8_t *q = j->q + r * k;
        const float *s = j->scales + r * groups;
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
        for (long c = 0, g = 0; c < k; g++) {
            __m512 s0 = _mm512_set1_ps(s[g]), s1 = _mm512_set1_ps(s[groups + g]);
            __m512 s2 = _mm512_set1_ps(s[2 * groups + g]), s3 = _mm512_set1_ps(s[3 * groups + g]);
            for (long end = c + j->group; c < end; c += 16) {
                if (c % 64 == 0) /* the next four rows' line at this column: four streams */
                    for (int i = 4; i < 8; i++)
                        _mm_prefetch((const char *)(q + i * k + c), _MM_HINT_T0);
                __m512 xc = _mm512_loadu_ps(x + c);
                t0 = _mm512_fmadd_ps(weights16(q + c, s0), xc, t0);
                t1 = _mm512_fmadd_ps(weights16(q + k + c, s1), xc, t1);
                t2 = _mm512_fmadd_ps(weights16(q + 2 * k + c, s2), xc, t2);
                t3 = _mm512_fmadd_ps(weights16(q + 3 * k + c, s3), xc, t3);
            }
        }
        j->out[r] = sum512(t0);
        j->out[r + 1] = sum512(t1);
        j->out[r + 2] = sum512(t2);
        j->out[r + 3] = sum512(t3);
    }
    return r;
}

AVX512 static void rows_avx512(const job_t *j)
{
    long groups = j->k / j->group, k = j->k, n = j->n;
    long first = j->m_rows == 1 ? one_row_avx512(j, j->lo) : j->lo;
    for (long m0 = 0; m0 < j->m_rows; m0 += ROW_BLOCK512) {
        long mb = j->m_rows - m0 < ROW_BLOCK512 ? j->m_rows - m0 : ROW_BLOCK512;
        const float *x = j->x + m0 * k;
        float *out = j->out + m0 * n;
        for (long r = first; r < j->hi; r++) {
            const int8_t *q = j->q + r * k;
            const float *s = j->scales + r * groups;
            __m512 t[ROW_BLOCK512];
            for (int m = 0; m < ROW_BLOCK512; m++) t[m] = _mm512_setzero_ps();
            for (long c = 0, g = 0; c < k; g++) {
              __m512 scale = _mm512_set1_ps(s[g]);
              for (long end = c + j->group; c < end; c += 16) {
                if (c % 64 == 0) /* the line four rows on, as one_row_avx512 */
                    _mm_prefetch((const char *)(q + 4 * k + c), _MM_HINT_T0);
                __m512 w = weights16(q + c, scale);
                HEAD_FMA8(t, w, x, k, c, mb);
              }
            }
            for (long m = 0; m < mb; m++) out[m * n + r] = sum512(t[m]);
        }
    }
}

AVX2 static void rows_avx2(const job_t *j)
{
    long groups = j->k / j->group, k = j->k, n = j->n;
    for (long m0 = 0; m0 < j->m_rows; m0 += ROW_BLOCK) {
        long mb = j->m_rows - m0 < ROW_BLOCK ? j->m_rows - m0 : ROW_BLOCK;
        const float *x = j->x + m0 * k;
        float *out = j->out + m0 * n;
        for (long r = j->lo; r < j->hi; r++) {
            const int8_t *q = j->q + r * k;
            const float *s = j->scales + r * groups;
            __m256 lo[ROW_BLOCK], hi[ROW_BLOCK];
            for (int m = 0; m < ROW_BLOCK; m++) lo[m] = hi[m] = _mm256_setzero_ps();
            for (long c = 0, g = 0; c < k; g++) {
              __m256 scale = _mm256_set1_ps(s[g]); /* a loop per group: no division per step */
              for (long end = c + j->group; c < end; c += 16) {
                if (c % 64 == 0) /* the line four rows on, as one_row_avx512 */
                    _mm_prefetch((const char *)(q + 4 * k + c), _MM_HINT_T0);
                __m256 w0 = head_weights8(q + c, scale), w1 = head_weights8(q + c + 8, scale);
                HEAD_FMA4X2(lo, hi, w0, w1, x, k, c, mb);
              }
            }
            for (long m = 0; m < mb; m++) out[m * n + r] = sum256x2(lo[m], hi[m]);
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
 * float32. k and group must be multiples of 16, and group must divide k. Returns 0, or -1
 * when the arguments are not that. */
int kvchat_int8_head_mm(const int8_t *q, const float *scales, const float *x, float *out,
                        long m_rows, long n, long k, long group, int threads, int force_isa)
{
    if (k <= 0 || group <= 0 || k % 16 || group % 16 || k % group || n <= 0 || m_rows < 0)
        return -1;
    if (best_isa < 0) best_isa = kvchat_int8_head_isa();
    int isa = force_isa >= 0 && force_isa < best_isa ? force_isa : best_isa;
    if (threads < 1) threads = 1;
    long per = (n + threads - 1) / threads;
    per = (per + 15) / 16 * 16; /* whole cache lines of output per thread */
    long chunks = (n + per - 1) / per;
    /* OpenMP, so that the threads are torch's own (the same libgomp): no second pool to wake
     * or to spin beside it */
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (long c = 0; c < chunks; c++) {
        job_t job = {q, scales, x, out, m_rows, n, k, group, c * per,
                     c * per + per < n ? c * per + per : n, isa};
        run(&job);
    }
    return 0;
}
