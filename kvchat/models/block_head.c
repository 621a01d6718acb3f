/* The output head kept as a GGUF's Q6_K blocks (210 bytes per 256 weights: gguf_blocks.c gives
 * the layout), float32 activations in, float32 logits out, summed in integers.
 *
 * A Q6_K weight is d * sc * q, with q = the 6-bit value - 32 in [-32, 31], sc an int8 per 16
 * columns and d a float16 per block of 256. Each activation row is first written, a block of
 * 256 columns at a time, as 16-bit integers x_int on a power-of-two grid of unit u[m, b]
 * (native_sums.h's grid_row: 15 bits against the block's largest value, where llama.cpp's Q8_K
 * keeps 8; a block holding an infinity or NaN gets u = NaN). Then, for weight row r and
 * activation row m,
 *
 *   D[b][L]   = the sum of (q[r, c] * sc[r, c / 16]) * x_int[m, c] over block b's columns c
 *               with (c % 32) / 2 == L, L = 0..15   (exact in int32: |D| <= 16 * 4096 * 32767)
 *   acc[L]    = fmaf((float)D[b][L], d[r, b] * u[m, b], acc[L])   for b in order, from 0
 *   out[m, r] = the fixed tree over the 16 lanes (native_sums.h's tree16)
 *
 * with (float)D rounded to nearest and d * u exact except at the ends of float32's range (a
 * block of activations beyond about 2^110 with a large d overflows it, one below about 2^-100
 * with a small d falls among the denormals). Integer sums are the same in any order, so AVX-512
 * VNNI (vpdpwssd, 32 products an instruction: lane L takes columns 2L and 2L + 1 of each 32),
 * AVX2 (vpmaddwd, lanes 0-7 and 8-15 in two registers) and the portable C give the same bits,
 * whatever the rows in a call or the threads; the float work is one fma per lane a block. It
 * reads 0.82 bytes a weight where the int8 head reads 1.125: a decode step of a model whose head
 * is a large part of it reads that much less. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVCHAT_X86 1
#endif

#include "native_sums.h"

#define QK 256
#define BLOCK_BYTES 210
#define LANES 16
#define ROWS 8 /* activation rows sharing one pass over a weight row */

int kvchat_int4_isa(void); /* int4_matmul.c: 2 AVX-512 VNNI, 1 AVX2, 0 portable */

typedef struct {
    const uint8_t *w;
    const int16_t *xi; /* (m_rows, k): x_int */
    const float *u;    /* (m_rows, k / 256): the blocks' units */
    float *out;
    long m_rows, n, k, lo, hi;
    int isa;
} job_t;

static inline float block_d(const uint8_t *b)
{
    uint16_t dh;
    memcpy(&dh, b + 208, 2);
    return half_float(dh);
}

static void rows_portable(const job_t *j)
{
    long blocks = j->k / QK, row_bytes = blocks * BLOCK_BYTES;
    int8_t q[QK];
    int16_t w[QK];
    float s[16];
    for (long r = j->lo; r < j->hi; r++) {
        for (long m0 = 0; m0 < j->m_rows; m0 += ROWS) {
            long mb = j->m_rows - m0 < ROWS ? j->m_rows - m0 : ROWS;
            float acc[ROWS][LANES] = {{0}};
            for (long bi = 0; bi < blocks; bi++) {
                const uint8_t *b = j->w + r * row_bytes + bi * BLOCK_BYTES;
                const int8_t *sc = (const int8_t *)(b + 192);
                q6k_unpack(b, q, s);
                for (int c = 0; c < QK; c++) w[c] = (int16_t)(q[c] * sc[c / 16]);
                float d = block_d(b);
                for (long m = 0; m < mb; m++) {
                    const int16_t *x = j->xi + (m0 + m) * j->k + bi * QK;
                    int32_t sum[LANES] = {0};
                    for (int c = 0; c < QK; c++) sum[(c % 32) / 2] += (int32_t)w[c] * x[c];
                    float unit = d * j->u[(m0 + m) * blocks + bi];
                    for (int l = 0; l < LANES; l++)
                        acc[m][l] = fmaf((float)sum[l], unit, acc[m][l]);
                }
            }
            for (long m = 0; m < mb; m++) j->out[(m0 + m) * j->n + r] = tree16(acc[m]);
        }
    }
}

#ifdef KVCHAT_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni,avx2,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma")))

/* the next rows' copy of a block, a line at a time, as this one is read */
static inline void prefetch_block(const uint8_t *b)
{
    _Pragma("GCC unroll 4") for (int line = 0; line < BLOCK_BYTES; line += 64)
        _mm_prefetch((const char *)(b + line), _MM_HINT_T0);
}

/* q6k_unpack's integers (native_sums.h), 32 values an instruction */
AVX2 static inline void unpack_avx2(const uint8_t *b, int8_t *q)
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
}

/* unpack_avx2's, a whole half-block (128 values) in two 64-byte registers: ql's 64 bytes are
 * the low nibbles of values 0-63 and the high ones of 64-127; qh's 32 bytes, held twice, give
 * their 2-bit pairs by shifts of 4 and 2 (0-63) and of 0 and -2 (64-127) */
VNNI static inline void unpack_avx512(const uint8_t *b, int8_t *q)
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
}

/* a block's weights q * sc as 16-bit integers, 32 columns a register (columns 32 p + i in
 * w[p], groups 2 p and 2 p + 1), and its d */
VNNI static inline float weights_vnni(const uint8_t *b, __m512i *w)
{
    int8_t q[QK];
    unpack_avx512(b, q);
    /* sc as 16-bit words 0-15, then each register's two groups' picked from them */
    __m512i sc = _mm512_cvtepi8_epi16(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + 192))));
    const __m512i two = _mm512_set1_epi16(2);
    __m512i pick = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
    _Pragma("GCC unroll 8") for (int p = 0; p < 8; p++, pick = _mm512_add_epi16(pick, two))
        w[p] = _mm512_mullo_epi16(
            _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * p))),
            _mm512_permutexvar_epi16(pick, sc));
    uint16_t dh;
    memcpy(&dh, b + 208, 2);
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(dh))); /* exact, F16C's own */
}

/* D[b] of one activation row's block against w: the 16 lanes of the definition (four chains
 * of vpdpwssd, not one: integer sums, the same in any order) */
VNNI static inline __m512 lanes_vnni(const int16_t *x, const __m512i *w)
{
    __m512i s[4];
    _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++)
        s[p] = _mm512_dpwssd_epi32(_mm512_setzero_si512(),
                                   _mm512_loadu_si512((const void *)(x + 32 * p)), w[p]);
    _Pragma("GCC unroll 4") for (int p = 4; p < 8; p++)
        s[p - 4] = _mm512_dpwssd_epi32(s[p - 4], _mm512_loadu_si512((const void *)(x + 32 * p)),
                                       w[p]);
    return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(s[0], s[1]),
                                               _mm512_add_epi32(s[2], s[3])));
}

/* one activation row (a decode step): its accumulator in a register, not in an array */
VNNI static void one_row_vnni(const job_t *j, long m)
{
    long blocks = j->k / QK, row_bytes = blocks * BLOCK_BYTES;
    const int16_t *x = j->xi + m * j->k;
    const float *u = j->u + m * blocks;
    __m512i w[8];
    for (long r = j->lo; r < j->hi; r++) { /* a row at a time: the memory read in order */
        __m512 acc = _mm512_setzero_ps();
        for (long bi = 0; bi < blocks; bi++) {
            const uint8_t *b = j->w + r * row_bytes + bi * BLOCK_BYTES;
            prefetch_block(b + row_bytes);
            float d = weights_vnni(b, w);
            acc = _mm512_fmadd_ps(lanes_vnni(x + bi * QK, w), _mm512_set1_ps(d * u[bi]), acc);
        }
        j->out[m * j->n + r] = sum512(acc);
    }
}

VNNI static void rows_vnni(const job_t *j)
{
    long blocks = j->k / QK, row_bytes = blocks * BLOCK_BYTES, k = j->k, n = j->n;
    __m512i w[8];
    if (j->m_rows == 1) {
        one_row_vnni(j, 0);
        return;
    }
    for (long m0 = 0; m0 < j->m_rows; m0 += ROWS) {
        long mb = j->m_rows - m0 < ROWS ? j->m_rows - m0 : ROWS;
        for (long r = j->lo; r < j->hi; r++) {
            __m512 acc[ROWS];
            for (int m = 0; m < ROWS; m++) acc[m] = _mm512_setzero_ps();
            for (long bi = 0; bi < blocks; bi++) {
                const uint8_t *b = j->w + r * row_bytes + bi * BLOCK_BYTES;
                prefetch_block(b + row_bytes);
                float d = weights_vnni(b, w);
                for (long m = 0; m < mb; m++) {
                    __m512 unit = _mm512_set1_ps(d * j->u[(m0 + m) * blocks + bi]);
                    acc[m] = _mm512_fmadd_ps(lanes_vnni(j->xi + (m0 + m) * k + bi * QK, w), unit,
                                             acc[m]);
                }
            }
            for (long m = 0; m < mb; m++) j->out[(m0 + m) * n + r] = sum512(acc[m]);
        }
    }
}

AVX2 static void rows_avx2(const job_t *j)
{
    long blocks = j->k / QK, row_bytes = blocks * BLOCK_BYTES, k = j->k, n = j->n;
    int8_t q[QK];
    __m256i w[16]; /* group g's 16 columns, q * sc */
    for (long m0 = 0; m0 < j->m_rows; m0 += ROWS) {
        long mb = j->m_rows - m0 < ROWS ? j->m_rows - m0 : ROWS;
        for (long r = j->lo; r < j->hi; r++) {
            __m256 lo[ROWS], hi[ROWS];
            for (int m = 0; m < ROWS; m++) lo[m] = hi[m] = _mm256_setzero_ps();
            for (long bi = 0; bi < blocks; bi++) {
                const uint8_t *b = j->w + r * row_bytes + bi * BLOCK_BYTES;
                const int8_t *sc = (const int8_t *)(b + 192);
                prefetch_block(b + row_bytes);
                unpack_avx2(b, q);
                for (int g = 0; g < 16; g++)
                    w[g] = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(
                        _mm_loadu_si128((const __m128i *)(q + 16 * g))), _mm256_set1_epi16(sc[g]));
                float d = block_d(b);
                for (long m = 0; m < mb; m++) {
                    const int16_t *x = j->xi + (m0 + m) * k + bi * QK;
                    __m256i sl = _mm256_setzero_si256(), sh = sl;
                    for (int p = 0; p < 8; p++) {
                        __m256i xl = _mm256_loadu_si256((const __m256i *)(x + 32 * p));
                        __m256i xh = _mm256_loadu_si256((const __m256i *)(x + 32 * p + 16));
                        sl = _mm256_add_epi32(sl, _mm256_madd_epi16(xl, w[2 * p]));
                        sh = _mm256_add_epi32(sh, _mm256_madd_epi16(xh, w[2 * p + 1]));
                    }
                    __m256 unit = _mm256_set1_ps(d * j->u[(m0 + m) * blocks + bi]);
                    lo[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sl), unit, lo[m]);
                    hi[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sh), unit, hi[m]);
                }
            }
            for (long m = 0; m < mb; m++) j->out[(m0 + m) * n + r] = sum256x2(lo[m], hi[m]);
        }
    }
}
#endif

static int best_isa = -1;

static void run(const job_t *j)
{
#ifdef KVCHAT_X86
    if (j->isa == 2) { rows_vnni(j); return; }
    if (j->isa == 1) { rows_avx2(j); return; }
#endif
    rows_portable(j);
}

/* w: (n, k / 256 * 210) Q6_K bytes; x: (m_rows, k) float32; out: (m_rows, n) float32; the
 * instruction set is int4_matmul.c's choice (kvchat_int4_isa), `force_isa` caps it. Returns 0,
 * -1 when k is not a multiple of 256, -2 when out of memory. */
int kvchat_q6k_head_mm(const uint8_t *w, const float *x, float *out, long m_rows, long n, long k,
                       int threads, int force_isa)
{
    if (k <= 0 || k % QK || n <= 0 || m_rows < 0)
        return -1;
    if (m_rows == 0) return 0;
    if (best_isa < 0) best_isa = kvchat_int4_isa();
    int isa = force_isa >= 0 && force_isa < best_isa ? force_isa : best_isa;
    if (threads < 1) threads = 1;
    int16_t *xi;
    float *u;
    void *scratch = grid_rows(x, m_rows, k, threads, &xi, &u);
    if (!scratch) return -2;
    long per = (n + threads - 1) / threads;
    per = (per + 15) / 16 * 16; /* whole cache lines of output per thread */
    long chunks = (n + per - 1) / per;
    #pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (long c = 0; c < chunks; c++) {
        job_t job = {w, xi, u, out, m_rows, n, k, c * per, c * per + per < n ? c * per + per : n,
                     isa};
        run(&job);
    }
    free(scratch);
    return 0;
}
