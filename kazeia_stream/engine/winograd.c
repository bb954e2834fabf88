/* The transforms of Winograd's F(2, 7) for a causal convolution of 7 taps with a dilation d
   (winograd.py has the algorithm and its matrices; codec.py's CausalConv runs it): a tile is
   the outputs at columns t and t + d, made from the 8 inputs at t + u d, u = 0..7, of the
   layer's context buffer (the 8th is 0 for a tile of one output). The 8 products between the
   transforms are the GEMMs.

   Tiles come in runs (`struct run`): `count` tiles from column `col`, `step` apart (1, or 2
   for a dilation of 1: tiles at t, t + 2, ...), of one output or two. A tile's numbers depend
   on its inputs only, whatever tiles come with it (the decoder's streams rely on it): every
   element is one chain of multiply-adds in a fixed order. The input transform runs 8 channels
   a vector on columns transposed first (a tile's inputs are then 8 loads whatever d: along the
   columns, the runs of a dilation of 3 are 3 tiles long); the output transform is the
   compiler's to vectorize. One variant, AVX2 with FMA. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))
#define P 8 /* points: a tile's inputs, and its products */

struct run {
    int64_t col, count, step, paired;
};

/* The variant this CPU runs: 1 AVX2 with FMA, 0 none. */
int kz_winograd_level(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

/* y[col + i step] = bias + sum_k at[0][k] m[k][tile], and y[... + d] with at[1] for a pair. */
INLINE void out_run(const float *m, int64_t d, int64_t count, const int64_t step, const int paired,
                    const float *at, float bias, float *y, int64_t plane) {
    for (int64_t i = 0; i < count; i++) {
        float a = bias, b = bias;
        for (int k = 0; k < P; k++) {
            a = fmaf(at[k], m[k * plane + i], a);
            if (paired) b = fmaf(at[P + k], m[k * plane + i], b);
        }
        y[i * step] = a;
        if (paired) y[i * step + d] = b;
    }
}

/* Columns c0..c0 + 7 of rows r0..r0 + 7 of x (rows beyond `rows` as zeros) as 8 vectors of
   the 8 rows, one per column, stored at out, out + 8, ... (the classic 8x8 transpose). */
AVX2 static void columns8(const float *x, int64_t ld, int64_t n, float *out) {
    __m256 r[8], t[8], s[8];
    for (int j = 0; j < 8; j++) r[j] = j < n ? _mm256_loadu_ps(x + j * ld) : _mm256_setzero_ps();
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    for (int j = 0; j < 8; j += 4) {
        s[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
        s[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
        s[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
        s[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int j = 0; j < 4; j++) {
        _mm256_storeu_ps(out + 8 * j, _mm256_permute2f128_ps(s[j], s[j + 4], 0x20));
        _mm256_storeu_ps(out + 8 * (j + 4), _mm256_permute2f128_ps(s[j], s[j + 4], 0x31));
    }
}

/* The input transform, 8 channels a vector: x [rows, ld] (a context buffer's rows, `width`
   columns read), v [P][tiles][ldv] (ldv a multiple of 8, at least rows; planes `plane` floats
   apart): tile-major, as the GEMMs take it transposed. Each group of 8 rows is first turned
   into columns of 8, in `cols` (8 * width floats; a tile's inputs are then 8 vector loads,
   whatever d). */
AVX2 void kz_winograd_in_avx2(const float *x, int64_t rows, int64_t ld, int64_t width, int64_t d,
                              const struct run *runs, int64_t n_runs, const float *bt, float *v,
                              int64_t ldv, int64_t plane, float *cols) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        int64_t n = rows - r0 < 8 ? rows - r0 : 8, c = 0;
        for (; c + 8 <= width; c += 8) columns8(x + r0 * ld + c, ld, n, cols + 8 * c);
        for (; c < width; c++)
            for (int j = 0; j < 8; j++) cols[8 * c + j] = j < n ? x[(r0 + j) * ld + c] : 0.0f;
        float *vt = v + r0;
        for (const struct run *run = runs; run < runs + n_runs; run++) {
            for (int64_t i = 0; i < run->count; i++, vt += ldv) {
                const float *t = cols + 8 * (run->col + i * run->step);
                __m256 in[P];
                for (int u = 0; u < P - 1; u++) in[u] = _mm256_loadu_ps(t + 8 * u * d);
                in[P - 1] = run->paired ? _mm256_loadu_ps(t + 8 * (P - 1) * d) : _mm256_setzero_ps();
                for (int k = 0; k < P; k++) {
                    __m256 acc = _mm256_mul_ps(_mm256_set1_ps(bt[k * P]), in[0]);
                    for (int u = 1; u < P; u++) acc = _mm256_fmadd_ps(_mm256_set1_ps(bt[k * P + u]), in[u], acc);
                    _mm256_storeu_ps(vt + k * plane, acc);
                }
            }
        }
    }
}

/* The output transform: m [P][rows][tiles] (the products; planes `plane` floats apart), y
   [rows, ld] the layer's output. */
AVX2 void kz_winograd_out_avx2(const float *m, int64_t rows, int64_t tiles, int64_t plane,
                               int64_t d, const struct run *runs, int64_t n_runs, const float *at,
                               const float *bias, float *y, int64_t ld) {
    for (int64_t r = 0; r < rows; r++) {
        const float *mr = m + r * tiles;
        for (const struct run *run = runs; run < runs + n_runs; mr += run->count, run++) {
            float *t = y + r * ld + run->col;
            if (run->step == 1 && run->paired) out_run(mr, d, run->count, 1, 1, at, bias[r], t, plane);
            else if (run->step == 1) out_run(mr, d, run->count, 1, 0, at, bias[r], t, plane);
            else if (run->paired) out_run(mr, d, run->count, 2, 1, at, bias[r], t, plane);
            else out_run(mr, d, run->count, 2, 0, at, bias[r], t, plane);
        }
    }
}
