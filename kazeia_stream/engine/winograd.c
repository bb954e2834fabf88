/* The transforms of Winograd's F(4, 7) and F(6, 7) for a causal convolution of 7 taps with a
   dilation d (winograd.py has the algorithm and its matrices; codec.py's CausalConv runs it): a
   tile is the outputs at columns t + i d, i = 0..m - 1 (m = 4 or 6), made from the m + 6 inputs
   at t + u d, u = 0..m + 5, of the layer's context buffer (a tile of fewer outputs, at the end
   of a call, takes zeros for the inputs it does not need). The m + 6 products between the
   transforms are the GEMMs, tile-major: V_k [tiles, C_in] in, M_k = V_k U_k^T [tiles, C_out]
   out, on f32_product.c's kernel (`kz_winograd_conv`: a convolution's call in one call of ours,
   which took 133 products and 21 transforms a frame through Python, about 10 us each).

   Tiles come in runs (`struct run`): `count` tiles from column `col`, `step` apart (1, or m
   for a dilation of 1: tiles at t, t + m, ...), of `outputs` outputs each. A tile's numbers
   depend on its inputs only, whatever tiles come with it (the decoder's streams rely on it):
   every element is made in a fixed order. Both transforms run 8 channels a vector, between 8x8
   transposes: the input's columns are transposed first (a tile's inputs are then m + 6 loads
   whatever d: along the columns, the runs of a dilation of 3 are 3 tiles long), the output's
   back at the end. They use the matrices' symmetry, which winograd.py checks: the points come
   in pairs +p and -p, so B^T's rows 1 to m + 4 are E + O and E - O of a part E of the even
   inputs and a part O of the odd ones (row 0 is even inputs only, row m + 5 odd ones), and
   A^T's even rows take the sum of the products of each pair, its odd rows their difference.
   Each transform is written once for any m and made for m = 4 and m = 6, the tile's inputs
   and outputs in registers. One variant, AVX2 with FMA. */

#include "ggml_op.h" /* INLINE */

#define AVX2 __attribute__((target("avx2,fma")))
#define MAX_OUT 6           /* a whole tile's outputs, at most */
#define MAX_P (MAX_OUT + 6) /* its inputs, and its products */

struct run {
    int64_t col, count, step, outputs;
};

/* The variant this CPU runs: 1 AVX2 with FMA, 0 none. */
int kz_winograd_level(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

/* int32 -1 in lanes 0 .. n - 1, 0 in the others. */
AVX2 static inline __m256i lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The 8x8 transpose: rows 0..7 of src, 8 floats each, `ld` apart (those from `n_in` on as
   zeros), stored as the rows of dst, `ldd` apart: dst row j is src's column j, for j < n_out,
   in the lanes that `mask` sets. */
AVX2 static void transpose8(const float *src, int64_t ld, int64_t n_in, float *dst, int64_t ldd,
                            int64_t n_out, __m256i mask) {
    __m256 r[8], t[8], s[8];
    for (int j = 0; j < 8; j++) r[j] = j < n_in ? _mm256_loadu_ps(src + j * ld) : _mm256_setzero_ps();
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
    const int whole = _mm256_movemask_ps(_mm256_castsi256_ps(mask)) == 0xff;
    for (int j = 0; j < n_out; j++) {
        __m256 column = _mm256_permute2f128_ps(s[j % 4], s[j % 4 + 4], j < 4 ? 0x20 : 0x31);
        if (whole) _mm256_storeu_ps(dst + j * ldd, column);
        else _mm256_maskstore_ps(dst + j * ldd, mask, column); /* microcoded on Zen: only at edges */
    }
}

/* The input transform of F(out, 7), P = out + 6: x [rows, ld] (a context buffer's rows,
   `width` columns read), v [P][tiles][ldv] (ldv a multiple of 8, at least rows; planes
   `plane` floats apart). Each group of 8 rows is first turned into columns of 8, in `cols` (8
   * width floats). */
AVX2 INLINE void transform_in(const int out, const float *x, int64_t rows, int64_t ld, int64_t width, int64_t d,
                              const struct run *runs, int64_t n_runs, const float *bt, float *v, int64_t ldv,
                              int64_t plane, float *cols) {
    const int P = out + 6;
    const __m256i all = _mm256_set1_epi32(-1);
    __m256 e[MAX_P][MAX_P]; /* B^T's entries, broadcast */
    for (int k = 0; k < P; k++)
        for (int u = 0; u < P; u++) e[k][u] = _mm256_set1_ps(bt[k * P + u]);
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        int64_t n = rows - r0 < 8 ? rows - r0 : 8, c = 0;
        for (; c + 8 <= width; c += 8) transpose8(x + r0 * ld + c, ld, n, cols + 8 * c, 8, 8, all);
        for (; c < width; c++)
            for (int j = 0; j < 8; j++) cols[8 * c + j] = j < n ? x[(r0 + j) * ld + c] : 0.0f;
        float *vt = v + r0;
        for (const struct run *run = runs; run < runs + n_runs; run++) {
            const int64_t used = P - out + run->outputs; /* the inputs its tiles read */
            for (int64_t i = 0; i < run->count; i++, vt += ldv) {
                const float *t = cols + 8 * (run->col + i * run->step);
                __m256 in[MAX_P];
                for (int u = 0; u < P; u++)
                    in[u] = u < used ? _mm256_loadu_ps(t + 8 * u * d) : _mm256_setzero_ps();
                __m256 first = _mm256_mul_ps(e[0][0], in[0]);
                __m256 last = _mm256_mul_ps(e[P - 1][P - 1], in[P - 1]);
                for (int u = 2; u < P; u += 2) {
                    first = _mm256_fmadd_ps(e[0][u], in[u], first);
                    last = _mm256_fmadd_ps(e[P - 1][u - 1], in[u - 1], last);
                }
                _mm256_storeu_ps(vt, first);
                _mm256_storeu_ps(vt + (P - 1) * plane, last);
                for (int k = 1; k < P - 1; k += 2) {
                    __m256 even = _mm256_mul_ps(e[k][2], in[2]), odd = _mm256_mul_ps(e[k][1], in[1]);
                    for (int u = 4; u < P; u += 2) {
                        even = _mm256_fmadd_ps(e[k][u], in[u], even);
                        odd = _mm256_fmadd_ps(e[k][u - 1], in[u - 1], odd);
                    }
                    _mm256_storeu_ps(vt + k * plane, _mm256_add_ps(even, odd));
                    _mm256_storeu_ps(vt + (k + 1) * plane, _mm256_sub_ps(even, odd));
                }
            }
        }
    }
}

/* The output transform of F(out, 7), P = out + 6: m [P][tiles][ldm] (the products, ldm a
   multiple of 8, at least rows; planes `plane` floats apart), y [rows, ld] the layer's output,
   written at the chunk's outputs only (columns from y on; `width` the columns its inputs
   span). `cols`: 8 * (width + 8) floats for the outputs' columns of 8, then width + 8 int32,
   -1 at the columns the chunk writes. */
AVX2 INLINE void transform_out(const int out, const float *m, int64_t rows, int64_t ldm, int64_t plane, int64_t d,
                               const struct run *runs, int64_t n_runs, const float *at, const float *bias, float *y,
                               int64_t ld, int64_t width, float *cols) {
    const int P = out + 6;
    int32_t *written = (int32_t *)(cols + 8 * (width + 8));
    int64_t end = 0; /* the columns up to the chunk's last output */
    for (int64_t c = 0; c < width; c++) written[c] = 0;
    for (const struct run *run = runs; run < runs + n_runs; run++)
        for (int64_t i = 0; i < run->count; i++) {
            int64_t t = run->col + i * run->step, last = t + (run->outputs - 1) * d;
            for (int64_t j = 0; j < run->outputs; j++) written[t + j * d] = -1;
            end = last + 1 > end ? last + 1 : end;
        }
    /* A^T's entries: point 0 (column 0) counts in output 0 only, infinity (column P - 1) in
       the last only; a[j][p] for the pair of columns 2 p + 1 and 2 p + 2 */
    const __m256 zero_point = _mm256_set1_ps(at[0]), infinity = _mm256_set1_ps(at[out * P - 1]);
    __m256 a[MAX_OUT][(MAX_P - 2) / 2];
    for (int j = 0; j < out; j++)
        for (int p = 0; p < (P - 2) / 2; p++) a[j][p] = _mm256_set1_ps(at[j * P + 2 * p + 1]);
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        int64_t n = rows - r0 < 8 ? rows - r0 : 8;
        const __m256 bias8 = _mm256_maskload_ps(bias + r0, lanes(n));
        const float *mt = m + r0;
        for (const struct run *run = runs; run < runs + n_runs; run++) {
            for (int64_t i = 0; i < run->count; i++, mt += ldm) {
                float *t = cols + 8 * (run->col + i * run->step);
                __m256 o[MAX_OUT];
                for (int j = 0; j < out; j++) o[j] = bias8;
                o[0] = _mm256_fmadd_ps(zero_point, _mm256_loadu_ps(mt), o[0]);
                __m256 last = _mm256_loadu_ps(mt + (P - 1) * plane);
                o[out - 1] = _mm256_fmadd_ps(infinity, last, o[out - 1]);
                for (int p = 0; p < (P - 2) / 2; p++) {
                    __m256 plus = _mm256_loadu_ps(mt + (2 * p + 1) * plane);
                    __m256 minus = _mm256_loadu_ps(mt + (2 * p + 2) * plane);
                    __m256 sum = _mm256_add_ps(plus, minus), difference = _mm256_sub_ps(plus, minus);
                    for (int j = 0; j < out; j++)
                        o[j] = _mm256_fmadd_ps(a[j][p], j % 2 ? difference : sum, o[j]);
                }
                for (int j = 0; j < run->outputs; j++) _mm256_storeu_ps(t + 8 * j * d, o[j]);
            }
        }
        for (int64_t c = 0; c < end; c += 8) {
            __m256i mask = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(written + c)), lanes(end - c));
            transpose8(cols + 8 * c, 8, 8, y + r0 * ld + c, ld, n, mask);
        }
    }
}

/* f32_product.c's `kz_f32_product_shared`: dst = W x on that kernel's `fn` (its panels, W
   packed), by its caller alone or shared with a team's helpers. */
typedef void product_fn(void *team, int64_t parts, void *fn, const void *w, size_t size, int64_t m, int64_t k,
                        int64_t rows_w, const float *x, int64_t x_step, int64_t n, float *dst, int64_t dst_step);

/* The m + 6 products of a convolution in F(m, 7) (`outputs` m): U_k packed in panels of
   `size`-byte weights [c_out, c_in]. */
struct products {
    product_fn *shared;
    void *panels;
    int64_t size, c_out, c_in, outputs;
    const void *u[MAX_P];
};

/* Consecutive tiles of a call, transformed and multiplied together: runs[first, first + count),
   their columns counted from `start`, reading `width` columns from there (winograd.py's Chunk). */
struct chunk {
    int64_t start, width, first, count, tiles;
};

/* A chunk's input transform, its m + 6 products (shared with `team`'s helpers, parts - 1 of
   them, where team is not NULL), and its output transform, for m = `out`. */
AVX2 INLINE void chunk(const int out, const float *x, int64_t ld, int64_t d, const struct chunk *c,
                       const struct run *runs, const struct products *p, void *team, int64_t parts, const float *bt,
                       const float *at, const float *bias, float *y, int64_t ld_y, float *v, int64_t ldv,
                       int64_t plane_v, float *m, int64_t ldm, int64_t plane_m, float *cols) {
    const struct run *own = runs + c->first;
    transform_in(out, x + c->start, p->c_in, ld, c->width, d, own, c->count, bt, v, ldv, plane_v, cols);
    for (int k = 0; k < out + 6; k++)
        p->shared(team, parts, p->panels, p->u[k], (size_t)p->size, p->c_out, p->c_in, 0, v + k * plane_v, ldv,
                  c->tiles, m + k * plane_m, ldm);
    transform_out(out, m, p->c_out, ldm, plane_m, d, own, c->count, at, bias, y + c->start, ld_y, c->width, cols);
}

/* A convolution's call, chunk by chunk, in F(p->outputs, 7): x [c_in, ld] (a context buffer)
   in, y [c_out, ld_y] out, plus the bias. v and m: the planes [m + 6][tiles][ldv or ldm] of the
   largest chunk; cols: 9 * (the widest chunk's width + 8) floats. */
AVX2 void kz_winograd_conv_avx2(const float *x, int64_t ld, int64_t d, const struct chunk *chunks, int64_t n_chunks,
                                const struct run *runs, const struct products *p, void *team, int64_t parts,
                                const float *bt, const float *at, const float *bias, float *y, int64_t ld_y,
                                float *v, int64_t ldv, int64_t plane_v, float *m, int64_t ldm, int64_t plane_m,
                                float *cols) {
    for (const struct chunk *c = chunks; c < chunks + n_chunks; c++)
        if (p->outputs == 6)
            chunk(6, x, ld, d, c, runs, p, team, parts, bt, at, bias, y, ld_y, v, ldv, plane_v, m, ldm, plane_m, cols);
        else
            chunk(4, x, ld, d, c, runs, p, team, parts, bt, at, bias, y, ld_y, v, ldv, plane_v, m, ldm, plane_m, cols);
}
