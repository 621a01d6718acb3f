/* The output head kept as a GGUF's Q6_K blocks (210 bytes per 256 weights: gguf_blocks.c gives
 * the layout), float32 activations in, float32 logits out.
 *
 * A Q6_K weight is scale * q with q = the 6-bit value - 32 in [-32, 31] and one scale per 16
 * columns, scale = float32(d * sc) (d float16, sc int8: the product is exact in float32, and so
 * is scale * q). So the head is int8_head.c's definition with groups of 16 and those scales,
 * and gives its bits: each logit summed by one thread over 16 lanes, lane l taking the columns
 * c with c % 16 == l by fused multiply-adds in column order, weight float32(scale * q) first,
 * then the lanes as the fixed tree of native_sums.h. The AVX-512, AVX2 and portable paths
 * unpack a block's 256 values to int8 first, the same integers on all three, then sum as
 * int8_head.c's paths do.
 *
 * It reads 0.82 bytes a weight where the int8 head reads 1.125: a decode step of a model whose
 * head is a large part of it reads that much less. */

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVCHAT_X86 1
#endif

#include "native_sums.h"

#define QK 256
#define BLOCK_BYTES 210
#define ROW_BLOCK 4 /* activation rows sharing one pass over the weights (AVX2, portable) */
#define ROW_BLOCK512 8

typedef struct {
    const uint8_t *w;
    const float *x;
    float *out;
    long m_rows, n, k, lo, hi;
    int isa;
} job_t;

static void rows_portable(const job_t *j)
{
    long blocks = j->k / QK, row_bytes = blocks * BLOCK_BYTES;
    int8_t q[QK];
    float s[16];
    for (long r = j->lo; r < j->hi; r++) {
        for (long m0 = 0; m0 < j->m_rows; m0 += ROW_BLOCK) {
            long mb = j->m_rows - m0 < ROW_BLOCK ? j->m_rows - m0 : ROW_BLOCK;
            float lane[ROW_BLOCK][16] = {{0}};
            for (long bi = 0; bi < blocks; bi++) {
                q6k_unpack(j->w + r * row_bytes + bi * BLOCK_BYTES, q, s);
                for (int g = 0; g < 16; g++)
                    for (int l = 0; l < 16; l++) {
                        float w = s[g] * (float)q[16 * g + l];
                        for (long m = 0; m < mb; m++) {
                            float xv = j->x[(m0 + m) * j->k + bi * QK + 16 * g + l];
                            lane[m][l] = fmaf(w, xv, lane[m][l]);
                        }
                    }
            }
            for (long m = 0; m < mb; m++) j->out[(m0 + m) * j->n + r] = tree16(lane[m]);
        }
    }
}

#ifdef KVCHAT_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx2,fma")))
#define AVX2 __attribute__((target("avx2,fma")))

/* the next rows' copy of a block, a line at a time, as this one is read */
static inline void prefetch_block(const uint8_t *b)
{
    for (int line = 0; line < BLOCK_BYTES; line += 64)
        _mm_prefetch((const char *)(b + line), _MM_HINT_T0);
}

/* q6k_unpack's integers and scales (native_sums.h), 32 values an instruction */
AVX2 static inline void unpack_avx2(const uint8_t *b, int8_t *q, float *s)
{
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    const __m256i off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        __m256i la = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
        __m256i lb = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
        __m256i hh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        /* each byte's own bits: a 16-bit shift, then a mask that keeps none of its neighbour's */
        __m256i v0 = _mm256_or_si256(_mm256_and_si256(la, low4),
                                     _mm256_and_si256(_mm256_slli_epi16(hh, 4), bits45));
        __m256i v1 = _mm256_or_si256(_mm256_and_si256(lb, low4),
                                     _mm256_and_si256(_mm256_slli_epi16(hh, 2), bits45));
        __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), low4),
                                     _mm256_and_si256(hh, bits45));
        __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), low4),
                                     _mm256_and_si256(_mm256_srli_epi16(hh, 2), bits45));
        int8_t *o = q + 128 * h;
        _mm256_storeu_si256((__m256i *)o, _mm256_sub_epi8(v0, off));
        _mm256_storeu_si256((__m256i *)(o + 32), _mm256_sub_epi8(v1, off));
        _mm256_storeu_si256((__m256i *)(o + 64), _mm256_sub_epi8(v2, off));
        _mm256_storeu_si256((__m256i *)(o + 96), _mm256_sub_epi8(v3, off));
    }
    uint16_t dh;
    memcpy(&dh, b + 208, 2);
    __m256 d = _mm256_set1_ps(half_float(dh));
    __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    _mm256_storeu_ps(s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
    _mm256_storeu_ps(s + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
}

/* unpack_avx2's, a whole half-block (128 values) in two 64-byte registers: ql's 64 bytes are
 * the low nibbles of values 0-63 and the high ones of 64-127; qh's 32 bytes, held twice, give
 * their 2-bit pairs by shifts of 4 and 2 (0-63) and of 0 and -2 (64-127) */
AVX512 static inline void unpack_avx512(const uint8_t *b, int8_t *q, float *s)
{
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    const __m512i off = _mm512_set1_epi8(32);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; h++) {
        __m512i l = _mm512_loadu_si512((const void *)(b + 64 * h));
        __m512i hh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        __m512i v01 = _mm512_ternarylogic_epi32(  /* (a & b) | c */
            l, low4, _mm512_and_si512(_mm512_sllv_epi16(hh, up), bits45), 0xEA);
        __m512i v23 = _mm512_ternarylogic_epi32(
            _mm512_srli_epi16(l, 4), low4, _mm512_and_si512(_mm512_srlv_epi16(hh, down), bits45),
            0xEA);
        _mm512_storeu_si512((void *)(q + 128 * h), _mm512_sub_epi8(v01, off));
        _mm512_storeu_si512((void *)(q + 128 * h + 64), _mm512_sub_epi8(v23, off));
    }
    uint16_t dh;
    memcpy(&dh, b + 208, 2);
    __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16((short)dh)); /* exact, AVX-512F's own */
    __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    _mm512_storeu_ps(s, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
}

AVX512 static inline __m512 weights16(const int8_t *q, float scale)
{
    return _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)q))));
}

/* One activation row, four weight rows at a time from `r`, their next four prefetched as these
 * are read (int8_head.c's one_row_avx512). Returns the first row it left. */
AVX512 static long one_row_avx512(const job_t *j, long r)
{
    long blocks = j->k / QK, row_bytes = blocks * BLOCK_BYTES;
    int8_t q[4][QK];
    float s[4][16];
    for (; r + 4 <= j->hi; r += 4) {
        const uint8_t *w = j->w + r * row_bytes;
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
        for (long bi = 0; bi < blocks; bi++) {
            for (int i = 0; i < 4; i++) {
                const uint8_t *b = w + i * row_bytes + bi * BLOCK_BYTES;
                prefetch_block(b + 4 * row_bytes);
                unpack_avx512(b, q[i], s[i]);
            }
            const float *x = j->x + bi * QK;
            for (int g = 0; g < 16; g++) {
                __m512 xc = _mm512_loadu_ps(x + 16 * g);
                t0 = _mm512_fmadd_ps(weights16(q[0] + 16 * g, s[0][g]), xc, t0);
                t1 = _mm512_fmadd_ps(weights16(q[1] + 16 * g, s[1][g]), xc, t1);
                t2 = _mm512_fmadd_ps(weights16(q[2] + 16 * g, s[2][g]), xc, t2);
                t3 = _mm512_fmadd_ps(weights16(q[3] + 16 * g, s[3][g]), xc, t3);
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
    long blocks = j->k / QK, row_bytes = blocks * BLOCK_BYTES, k = j->k, n = j->n;
    long first = j->m_rows == 1 ? one_row_avx512(j, j->lo) : j->lo;
    int8_t q[QK];
    float s[16];
    for (long m0 = 0; m0 < j->m_rows; m0 += ROW_BLOCK512) {
        long mb = j->m_rows - m0 < ROW_BLOCK512 ? j->m_rows - m0 : ROW_BLOCK512;
        const float *x = j->x + m0 * k;
        float *out = j->out + m0 * n;
        for (long r = first; r < j->hi; r++) {
            __m512 t[ROW_BLOCK512];
            for (int m = 0; m < ROW_BLOCK512; m++) t[m] = _mm512_setzero_ps();
            for (long bi = 0; bi < blocks; bi++) {
                const uint8_t *b = j->w + r * row_bytes + bi * BLOCK_BYTES;
                prefetch_block(b + row_bytes);
                unpack_avx512(b, q, s);
                for (int g = 0; g < 16; g++) {
                    __m512 w = weights16(q + 16 * g, s[g]);
                    long c = bi * QK + 16 * g;
                    HEAD_FMA8(t, w, x, k, c, mb);
                }
            }
            for (long m = 0; m < mb; m++) out[m * n + r] = sum512(t[m]);
        }
    }
}

AVX2 static void rows_avx2(const job_t *j)
{
    long blocks = j->k / QK, row_bytes = blocks * BLOCK_BYTES, k = j->k, n = j->n;
    int8_t q[QK];
    float s[16];
    for (long m0 = 0; m0 < j->m_rows; m0 += ROW_BLOCK) {
        long mb = j->m_rows - m0 < ROW_BLOCK ? j->m_rows - m0 : ROW_BLOCK;
        const float *x = j->x + m0 * k;
        float *out = j->out + m0 * n;
        for (long r = j->lo; r < j->hi; r++) {
            __m256 lo[ROW_BLOCK], hi[ROW_BLOCK];
            for (int m = 0; m < ROW_BLOCK; m++) lo[m] = hi[m] = _mm256_setzero_ps();
            for (long bi = 0; bi < blocks; bi++) {
                const uint8_t *b = j->w + r * row_bytes + bi * BLOCK_BYTES;
                prefetch_block(b + row_bytes);
                unpack_avx2(b, q, s);
                for (int g = 0; g < 16; g++) {
                    __m256 scale = _mm256_set1_ps(s[g]);
                    __m256 w0 = head_weights8(q + 16 * g, scale);
                    __m256 w1 = head_weights8(q + 16 * g + 8, scale);
                    long c = bi * QK + 16 * g;
                    HEAD_FMA4X2(lo, hi, w0, w1, x, k, c, mb);
                }
            }
            for (long m = 0; m < mb; m++) out[m * n + r] = sum256x2(lo[m], hi[m]);
        }
    }
}
#endif

static int best_isa = -1;

static void run(const job_t *j)
{
#ifdef KVCHAT_X86
    if (j->isa == 2) { rows_avx512(j); return; }
    if (j->isa == 1) { rows_avx2(j); return; }
#endif
    rows_portable(j);
}

/* w: (n, k / 256 * 210) Q6_K bytes; x: (m_rows, k) float32; out: (m_rows, n) float32; the
 * instruction set is int8_head.c's choice (kvchat_int8_head_isa), `force_isa` caps it. Returns
 * 0, or -1 when k is not a multiple of 256. */
int kvchat_q6k_head_mm(const uint8_t *w, const float *x, float *out, long m_rows, long n, long k,
                       int threads, int force_isa)
{
    if (k <= 0 || k % QK || n <= 0 || m_rows < 0)
        return -1;
    if (best_isa < 0) best_isa = kvchat_int8_head_isa();
    int isa = force_isa >= 0 && force_isa < best_isa ? force_isa : best_isa;
    if (threads < 1) threads = 1;
    long per = (n + threads - 1) / threads;
    per = (per + 15) / 16 * 16; /* whole cache lines of output per thread */
    long chunks = (n + per - 1) / per;
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (long c = 0; c < chunks; c++) {
        job_t job = {w, x, out, m_rows, n, k, c * per, c * per + per < n ? c * per + per : n,
                     isa};
        run(&job);
    }
    return 0;
}
