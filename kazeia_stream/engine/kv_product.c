/* The attention's products over the KV cache (the keys times a step's queries, the values
   times its weights), as a ggml custom operation (see kv_product.py for why).

   dst = ggml_mul_mat(a, b): a [k, m, A, B] float16 or float32, b [k, n, A g, B] float32, each
   with its numbers along k contiguous and any strides above; dst [m, n, A g, B] float32,
   contiguous. Matrix i2 of a serves matrices i2 g .. i2 g + g - 1 of b (grouped-query
   attention), as ggml broadcasts. Each row of a is read once, widened to float32 in the
   registers, and multiplied with the g n rows of b its matrix serves, kept in float32 (ggml
   rounds them to float16 beside a float16 a), R rows of a matrix at a time: the g n rows of
   b are loaded once for all R. An element of dst is summed in one order whatever the threads
   and the rows beside it: eight lanes of fmadds over k, their sum, then the last k % 8 terms.
   Threads take contiguous runs of a's rows. */

#include "ggml_op.h"

#define GGML_TYPE_F16 1
#define OUTS 8   /* elements of dst a pass over rows of a makes: eight accumulators */
#define AHEAD 16 /* rows of a prefetched ahead: a head's keys are a few lines a row, far apart */
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* The variant this CPU runs: AVX2 with FMA and F16C, or none. */
int kz_kv_product_level(void) { return vnni_level() > 0; }

AVX2 INLINE __m256 load8(const char *row, int f16, int64_t at) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + at)))
               : _mm256_loadu_ps((const float *)row + at);
}

AVX2 INLINE float load1(const char *row, int f16, int64_t at) {
    return f16 ? _cvtsh_ss(((const uint16_t *)row)[at]) : ((const float *)row)[at];
}

/* The lanes' sums of eight vectors, in one order for each: ((0 + 1) + (2 + 3)) + ((4 + 5) +
   (6 + 7)). */
AVX2 INLINE __m256 sums8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* sums[N j + c] = rows[j] . b[c] over k, for R rows of a and N rows of b (R N <= OUTS). */
AVX2 INLINE void dots(const char *const *rows, int f16, int64_t k, const float *const *b, float *sums, const int R,
                      const int N) {
    __m256 acc[OUTS];
    for (int j = 0; j < OUTS; j++) acc[j] = _mm256_setzero_ps();
    int64_t at = 0;
    for (; at + 8 <= k; at += 8) {
        __m256 vb[OUTS];
        for (int c = 0; c < N; c++) vb[c] = _mm256_loadu_ps(b[c] + at);
        for (int j = 0; j < R; j++) {
            const __m256 va = load8(rows[j], f16, at);
            for (int c = 0; c < N; c++) acc[N * j + c] = _mm256_fmadd_ps(va, vb[c], acc[N * j + c]);
        }
    }
    float all[OUTS];
    _mm256_storeu_ps(all, sums8(acc));
    for (; at < k; at++)
        for (int j = 0; j < R; j++)
            for (int c = 0; c < N; c++) all[N * j + c] += load1(rows[j], f16, at) * b[c][at];
    for (int j = 0; j < R * N; j++) sums[j] = all[j];
}

/* Rows [i0, i1) of matrix (i2, i3) of a, R at a time (the last ones one at a time), times the
   N rows of b it serves (R N <= OUTS, constants). */
AVX2 INLINE void rows_of(const struct tensor *a, const struct tensor *b, struct tensor *dst, int64_t i2, int64_t i3,
                         int64_t i0, int64_t i1, const int R, const int N) {
    const int64_t k = a->ne[0], n = b->ne[1], g = b->ne[2] / a->ne[2], stride = (int64_t)a->nb[1];
    const int f16 = a->type == GGML_TYPE_F16;
    const int64_t bytes = k * (f16 ? 2 : 4);
    const char *matrix = (const char *)a->data + i2 * a->nb[2] + i3 * a->nb[3];
    const float *bs[OUTS];
    char *out[OUTS];
    for (int c = 0; c < N; c++) {
        const int64_t h = i2 * g + c / n, col = c % n;
        bs[c] = (const float *)((const char *)b->data + col * b->nb[1] + h * b->nb[2] + i3 * b->nb[3]);
        out[c] = (char *)dst->data + col * dst->nb[1] + h * dst->nb[2] + i3 * dst->nb[3];
    }
    for (int64_t i = i0; i < i1 && i < i0 + AHEAD; i++)
        for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(matrix + i * stride + l, _MM_HINT_T0);
    for (int64_t i = i0; i < i1;) {
        const int count = i1 - i >= R ? R : 1;
        const char *rows[OUTS];
        for (int j = 0; j < count; j++) {
            rows[j] = matrix + (i + j) * stride;
            if (i + j + AHEAD < i1)
                for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(rows[j] + AHEAD * stride + l, _MM_HINT_T0);
        }
        float sums[OUTS];
        if (count == R)
            dots(rows, f16, k, bs, sums, R, N);
        else
            dots(rows, f16, k, bs, sums, 1, N);
        for (int j = 0; j < count; j++, i++)
            for (int c = 0; c < N; c++) *(float *)(out[c] + i * dst->nb[0]) = sums[N * j + c];
    }
}

/* Rows [r0, r1) of a, counted along its rows, then its matrices. */
AVX2 INLINE void run(const struct tensor *a, const struct tensor *b, struct tensor *dst, int64_t r0, int64_t r1,
                     const int R, const int N) {
    const int64_t m = a->ne[1], heads = a->ne[2];
    for (int64_t r = r0; r < r1;) {
        const int64_t matrix = r / m, i0 = r % m, i1 = r1 - r < m - i0 ? i0 + r1 - r : m;
        rows_of(a, b, dst, matrix % heads, matrix / heads, i0, i1, R, N);
        r += i1 - i0;
    }
}

/* The custom operation (ggml_custom_op_t), for g n <= OUTS (kv_product.py). */
AVX2 void kz_kv_product_avx2(struct tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct tensor *a = dst->src[0], *b = dst->src[1];
    const int64_t rows = a->ne[1] * a->ne[2] * a->ne[3], r0 = rows * ith / nth, r1 = rows * (ith + 1) / nth;
    switch (b->ne[1] * (b->ne[2] / a->ne[2])) {
    case 1: run(a, b, dst, r0, r1, 8, 1); break;
    case 2: run(a, b, dst, r0, r1, 4, 2); break;
    case 3: run(a, b, dst, r0, r1, 2, 3); break;
    case 4: run(a, b, dst, r0, r1, 2, 4); break;
    case 5: run(a, b, dst, r0, r1, 1, 5); break;
    case 6: run(a, b, dst, r0, r1, 1, 6); break;
    case 7: run(a, b, dst, r0, r1, 1, 7); break;
    default: run(a, b, dst, r0, r1, 1, 8); break;
    }
}
