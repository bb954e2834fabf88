/* Float32 weights times float32 columns, as a ggml custom operation (see f32_product.py for why).

   dst [n, m] = w [m, k] @ x [k, n] (each column of x, and each row of dst, contiguous). Lanes
   over k: every element of dst has a vector accumulator of its own (16 lanes on AVX-512, 8 on
   AVX2), fed its products in the order of k and summed across its lanes in one fixed order at
   the end, so a column's numbers do not depend on how many columns come with it or where it
   sits among them. Tiles of 4 weight rows by a few columns share their loads; ggml's threads
   claim chunks of weight rows in turn (`claim`, ggml_op.h), each read from memory once while
   every column passes. */

#include <stdlib.h>
#include <string.h>

#include "ggml_op.h"

#define ROWS 4 /* weight rows per tile */
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))

/* The variant this CPU runs: 2 AVX-512, 1 AVX2, 0 neither. */
int kz_f32_product_level(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
}

/* Where a tile reads and writes: w's rows [i0, i0 + rm), x's columns [j0, j0 + rn). */
struct operands {
    const float *w, *x;
    float *dst;
    size_t w_row, x_row, dst_row; /* in floats */
    int64_t k;
};

/* AVX-512: up to ROWS x COLS512 accumulators (16 of the 32 registers). */
#define COLS512 4

/* A full tile's 16 sums, each across its accumulator's lanes in _mm512_reduce_add_ps's order
   (lanes i and i + 8, then i and i + 4, i and i + 2, i and i + 1: the same numbers), but four
   accumulators to a register at each stage: on Zen 4 the decoder's products of k = 96..768
   took 8-36% longer with the 16 one at a time. Column b's rows end in quarter b of the last. */
AVX512 INLINE void sums512(__m512 acc[ROWS][COLS512], float *dst, size_t dst_row) {
    __m512 h[8], f[4], e[2];
    for (int a = 0; a < ROWS; a++) /* [p_i + p_i+8 | q_i + q_i+8], (p, q) a row's columns */
        for (int m = 0; m < 2; m++) {
            __m512 p = acc[a][2 * m], q = acc[a][2 * m + 1];
            h[2 * a + m] =
                _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x44), _mm512_shuffle_f32x4(p, q, 0xEE));
        }
    for (int c = 0; c < 4; c++) /* lanes i and i + 4: quarter b row c's column b */
        f[c] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * c], h[2 * c + 1], 0x88),
                             _mm512_shuffle_f32x4(h[2 * c], h[2 * c + 1], 0xDD));
    for (int d = 0; d < 2; d++) /* lanes i and i + 2, within each quarter */
        e[d] = _mm512_add_ps(_mm512_shuffle_ps(f[2 * d], f[2 * d + 1], 0x44),
                             _mm512_shuffle_ps(f[2 * d], f[2 * d + 1], 0xEE));
    /* lanes i and i + 1: quarter b is column b's rows 0..3 */
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
    _mm_storeu_ps(dst, _mm512_castps512_ps128(s));
    _mm_storeu_ps(dst + dst_row, _mm512_extractf32x4_ps(s, 1));
    _mm_storeu_ps(dst + 2 * dst_row, _mm512_extractf32x4_ps(s, 2));
    _mm_storeu_ps(dst + 3 * dst_row, _mm512_extractf32x4_ps(s, 3));
}

AVX512 INLINE void tile512(const struct operands *o, int64_t i0, int64_t j0, const int rm,
                           const int rn) {
    __m512 acc[ROWS][COLS512];
    for (int a = 0; a < rm; a++)
        for (int b = 0; b < rn; b++) acc[a][b] = _mm512_setzero_ps();
    const float *w = o->w + i0 * o->w_row, *x = o->x + j0 * o->x_row;
    int64_t l = 0;
    for (; l + 16 <= o->k; l += 16) {
        __m512 wv[ROWS];
        for (int a = 0; a < rm; a++) wv[a] = _mm512_loadu_ps(w + a * o->w_row + l);
        for (int b = 0; b < rn; b++) {
            __m512 xv = _mm512_loadu_ps(x + b * o->x_row + l);
            for (int a = 0; a < rm; a++) acc[a][b] = _mm512_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    if (l < o->k) { /* the last lanes: zeros beyond k */
        const __mmask16 mask = (__mmask16)((1u << (o->k - l)) - 1);
        __m512 wv[ROWS];
        for (int a = 0; a < rm; a++) wv[a] = _mm512_maskz_loadu_ps(mask, w + a * o->w_row + l);
        for (int b = 0; b < rn; b++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + b * o->x_row + l);
            for (int a = 0; a < rm; a++) acc[a][b] = _mm512_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    if (rm == ROWS && rn == COLS512) {
        sums512(acc, o->dst + j0 * o->dst_row + i0, o->dst_row);
        return;
    }
    for (int a = 0; a < rm; a++)
        for (int b = 0; b < rn; b++)
            o->dst[(j0 + b) * o->dst_row + i0 + a] = _mm512_reduce_add_ps(acc[a][b]);
}

/* AVX2: up to ROWS x COLS256 accumulators (12 of the 16 registers). */
#define COLS256 3

AVX2 INLINE void tile256(const struct operands *o, int64_t i0, int64_t j0, const int rm,
                         const int rn) {
    __m256 acc[ROWS][COLS256];
    for (int a = 0; a < rm; a++)
        for (int b = 0; b < rn; b++) acc[a][b] = _mm256_setzero_ps();
    const float *w = o->w + i0 * o->w_row, *x = o->x + j0 * o->x_row;
    int64_t l = 0;
    for (; l + 8 <= o->k; l += 8) {
        __m256 wv[ROWS];
        for (int a = 0; a < rm; a++) wv[a] = _mm256_loadu_ps(w + a * o->w_row + l);
        for (int b = 0; b < rn; b++) {
            __m256 xv = _mm256_loadu_ps(x + b * o->x_row + l);
            for (int a = 0; a < rm; a++) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    if (l < o->k) { /* the last lanes: zeros beyond k */
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(o->k - l)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 wv[ROWS];
        for (int a = 0; a < rm; a++) wv[a] = _mm256_maskload_ps(w + a * o->w_row + l, mask);
        for (int b = 0; b < rn; b++) {
            __m256 xv = _mm256_maskload_ps(x + b * o->x_row + l, mask);
            for (int a = 0; a < rm; a++) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);
        }
    }
    for (int a = 0; a < rm; a++)
        for (int b = 0; b < rn; b++) o->dst[(j0 + b) * o->dst_row + i0 + a] = sum256(acc[a][b]);
}

/* tile(o, i, j, rm, rn) for rn of 1..COLS512 or 1..COLS256, each count's body inlined */
#define COLUMNS512(tile, o, i, j, rm, rn)            \
    switch (rn) {                                    \
    case 1: tile(o, i, j, rm, 1); break;             \
    case 2: tile(o, i, j, rm, 2); break;             \
    case 3: tile(o, i, j, rm, 3); break;             \
    default: tile(o, i, j, rm, COLS512); break;      \
    }
#define COLUMNS256(tile, o, i, j, rm, rn)            \
    if (rn == 1) tile(o, i, j, rm, 1);               \
    else if (rn == 2) tile(o, i, j, rm, 2);          \
    else tile(o, i, j, rm, COLS256);

/* Weight rows [r0, r1) by every column: tiles of ROWS rows (then the rows left one at a time)
   by `cols` columns (then the columns left). A lone column takes the rows one at a time: the
   weights then stream from memory in order (four rows at once read them at 12 GB/s on Zen 4,
   ggml's row at a time at 21; the numbers are the same either way). */
#define ROWS_BY(target, name, tile, cols, columns)                                          \
    target static void name(const struct operands *o, int64_t r0, int64_t r1, int64_t n) { \
        for (int64_t i = r0; i < r1;) {                                                     \
            const int rm = n > 1 && r1 - i >= ROWS ? ROWS : 1;                              \
            for (int64_t j = 0; j < n; j += cols) {                                         \
                const int rn = n - j < cols ? (int)(n - j) : cols;                          \
                if (rm == ROWS) {                                                           \
                    columns(tile, o, i, j, ROWS, rn)                                        \
                } else {                                                                    \
                    columns(tile, o, i, j, 1, rn)                                           \
                }                                                                           \
            }                                                                               \
            i += rm;                                                                        \
        }                                                                                   \
    }

ROWS_BY(AVX512, rows512, tile512, COLS512, COLUMNS512)
ROWS_BY(AVX2, rows256, tile256, COLS256, COLUMNS256)

/* Panels: a weight packed 16 rows at a time, each panel [k][16] (the rows beyond the matrix's
   zero), times columns of x: every element of dst is one chain of fmadds over k in order, from
   zero, whatever the columns beside it, on either variant alike (the same numbers). Tiles of a
   few panels by a few columns: each panel's 16 floats at l and each column's x[l] broadcast
   give an outer product into the tile's accumulators, so no sums across lanes are left to do
   at the end (on Zen 4, 55-58 G multiply-adds a second at the decoder's shapes from the
   caches, against 30-39 G for the tiles above in the same throw-away loop). */
#define PANEL 16

/* AVX-512: up to PANELS512 panels x COLP512 columns of accumulators (24 of the 32 registers). */
#define PANELS512 4
#define COLP512 6

AVX512 INLINE void panel512(const float *w, int64_t k, const float *x, size_t x_row, float *dst,
                            size_t dst_row, const int rp, const int rn) {
    __m512 acc[PANELS512][COLP512];
    for (int a = 0; a < rp; a++)
        for (int b = 0; b < rn; b++) acc[a][b] = _mm512_setzero_ps();
    for (int64_t l = 0; l < k; l++) {
        __m512 wv[PANELS512];
        for (int a = 0; a < rp; a++) wv[a] = _mm512_loadu_ps(w + (a * k + l) * PANEL);
        for (int b = 0; b < rn; b++) {
            __m512 xb = _mm512_set1_ps(x[b * x_row + l]);
            for (int a = 0; a < rp; a++) acc[a][b] = _mm512_fmadd_ps(wv[a], xb, acc[a][b]);
        }
    }
    for (int a = 0; a < rp; a++)
        for (int b = 0; b < rn; b++) _mm512_storeu_ps(dst + b * dst_row + a * PANEL, acc[a][b]);
}

/* AVX2: one panel (two registers) x up to COLP256 columns (12 of the 16 registers). */
#define PANELS256 1
#define COLP256 6

AVX2 INLINE void panel256(const float *w, int64_t k, const float *x, size_t x_row, float *dst,
                          size_t dst_row, const int rp, const int rn) {
    (void)rp; /* always one */
    __m256 acc[2][COLP256];
    for (int h = 0; h < 2; h++)
        for (int b = 0; b < rn; b++) acc[h][b] = _mm256_setzero_ps();
    for (int64_t l = 0; l < k; l++) {
        __m256 lo = _mm256_loadu_ps(w + l * PANEL), hi = _mm256_loadu_ps(w + l * PANEL + 8);
        for (int b = 0; b < rn; b++) {
            __m256 xb = _mm256_set1_ps(x[b * x_row + l]);
            acc[0][b] = _mm256_fmadd_ps(lo, xb, acc[0][b]);
            acc[1][b] = _mm256_fmadd_ps(hi, xb, acc[1][b]);
        }
    }
    for (int b = 0; b < rn; b++) {
        _mm256_storeu_ps(dst + b * dst_row, acc[0][b]);
        _mm256_storeu_ps(dst + b * dst_row + 8, acc[1][b]);
    }
}

/* tile(..., rp, rn) for rn of 1..6, each count's body inlined */
#define COLUMNS6(tile, w, k, x, x_row, dst, dst_row, rp, rn)        \
    switch (rn) {                                                   \
    case 1: tile(w, k, x, x_row, dst, dst_row, rp, 1); break;       \
    case 2: tile(w, k, x, x_row, dst, dst_row, rp, 2); break;       \
    case 3: tile(w, k, x, x_row, dst, dst_row, rp, 3); break;       \
    case 4: tile(w, k, x, x_row, dst, dst_row, rp, 4); break;       \
    case 5: tile(w, k, x, x_row, dst, dst_row, rp, 5); break;       \
    default: tile(w, k, x, x_row, dst, dst_row, rp, 6); break;      \
    }

/* Panels [p0, p1) by every column: tiles of up to `panels` panels by 6 columns (then the
   columns left), each panel read from memory once while every column passes. */
#define PANELS_BY(target, name, tile, panels)                                                   \
    target static void name(const struct operands *o, int64_t p0, int64_t p1, int64_t n) {     \
        for (int64_t p = p0; p < p1; p += panels) {                                            \
            const int rp = p1 - p < panels ? (int)(p1 - p) : panels;                           \
            const float *w = o->w + p * o->k * PANEL;                                          \
            for (int64_t j = 0; j < n; j += 6) {                                               \
                const int rn = n - j < 6 ? (int)(n - j) : 6;                                   \
                const float *x = o->x + j * o->x_row;                                          \
                float *dst = o->dst + j * o->dst_row + p * PANEL;                              \
                switch (rp) {                                                                  \
                case 1: COLUMNS6(tile, w, o->k, x, o->x_row, dst, o->dst_row, 1, rn) break;    \
                case 2: COLUMNS6(tile, w, o->k, x, o->x_row, dst, o->dst_row, 2, rn) break;    \
                case 3: COLUMNS6(tile, w, o->k, x, o->x_row, dst, o->dst_row, 3, rn) break;    \
                default: COLUMNS6(tile, w, o->k, x, o->x_row, dst, o->dst_row, panels, rn) break; \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

PANELS_BY(AVX512, panels512, panel512, PANELS512)
PANELS_BY(AVX2, panels256, panel256, PANELS256)

/* dst = W x for a packed W of m rows, called directly (the codec decoder's own buffers, on
   its one thread): column j of x at x + j * x_col (k floats), of dst at dst + j * dst_col (m
   floats; the last panel's rows beyond m are computed aside and left out). */
static void panels_at(void (*panels)(const struct operands *, int64_t, int64_t, int64_t),
                      const float *w, int64_t m, int64_t k, const float *x, int64_t x_col,
                      int64_t n, float *dst, int64_t dst_col) {
    const int64_t full = m / PANEL, rest = m % PANEL;
    const struct operands o = {.w = w, .x = x, .dst = dst, .x_row = x_col, .dst_row = dst_col, .k = k};
    panels(&o, 0, full, n);
    if (!rest) return;
    float *aside = malloc((size_t)n * PANEL * sizeof(float));
    if (aside == NULL) abort(); /* as numpy would raise */
    const struct operands last = {.w = w + full * k * PANEL, .x = x, .dst = aside, .x_row = x_col, .dst_row = PANEL, .k = k};
    panels(&last, 0, 1, n);
    for (int64_t j = 0; j < n; j++) memcpy(dst + j * dst_col + full * PANEL, aside + j * PANEL, rest * sizeof(float));
    free(aside);
}

void kz_f32_product_panels_avx512(const float *w, int64_t m, int64_t k, const float *x, int64_t x_col,
                                  int64_t n, float *dst, int64_t dst_col) {
    panels_at(panels512, w, m, k, x, x_col, n, dst, dst_col);
}

void kz_f32_product_panels_avx2(const float *w, int64_t m, int64_t k, const float *x, int64_t x_col,
                                int64_t n, float *dst, int64_t dst_col) {
    panels_at(panels256, w, m, k, x, x_col, n, dst, dst_col);
}

/* Rows: W in place [m, k] times x [k, n] whose rows are contiguous, into dst [m, n] likewise,
   called directly (the decoder's context buffers and outputs, channel-major): lanes over the
   columns, each W[i, l] broadcast, so that every element of dst is again one chain of fmadds
   over k in order, from zero: the numbers of the panels above, on either variant. Tiles of a
   few rows of W by a few vectors of columns, the last vector masked. */

/* AVX-512: up to BROWS512 rows x BVECS512 vectors of 16 columns (24 of the 32 registers). */
#define BROWS512 6
#define BVECS512 4

AVX512 INLINE void bcast512(const float *w, int64_t w_row, int64_t k, const float *x, int64_t x_row,
                            float *dst, int64_t dst_row, const int rr, const int rc, __mmask16 last) {
    __m512 acc[BROWS512][BVECS512];
    for (int a = 0; a < rr; a++)
        for (int c = 0; c < rc; c++) acc[a][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < k; l++) {
        __m512 xv[BVECS512];
        for (int c = 0; c < rc - 1; c++) xv[c] = _mm512_loadu_ps(x + l * x_row + 16 * c);
        xv[rc - 1] = _mm512_maskz_loadu_ps(last, x + l * x_row + 16 * (rc - 1));
        for (int a = 0; a < rr; a++) {
            __m512 wb = _mm512_set1_ps(w[a * w_row + l]);
            for (int c = 0; c < rc; c++) acc[a][c] = _mm512_fmadd_ps(wb, xv[c], acc[a][c]);
        }
    }
    for (int a = 0; a < rr; a++) {
        for (int c = 0; c < rc - 1; c++) _mm512_storeu_ps(dst + a * dst_row + 16 * c, acc[a][c]);
        _mm512_mask_storeu_ps(dst + a * dst_row + 16 * (rc - 1), last, acc[a][rc - 1]);
    }
}

/* AVX2: up to BROWS256 rows x BVECS256 vectors of 8 columns (12 of the 16 registers). */
#define BROWS256 4
#define BVECS256 3

AVX2 INLINE void bcast256(const float *w, int64_t w_row, int64_t k, const float *x, int64_t x_row,
                          float *dst, int64_t dst_row, const int rr, const int rc, int last) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(last), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 acc[BROWS256][BVECS256];
    for (int a = 0; a < rr; a++)
        for (int c = 0; c < rc; c++) acc[a][c] = _mm256_setzero_ps();
    for (int64_t l = 0; l < k; l++) {
        __m256 xv[BVECS256];
        for (int c = 0; c < rc - 1; c++) xv[c] = _mm256_loadu_ps(x + l * x_row + 8 * c);
        xv[rc - 1] = _mm256_maskload_ps(x + l * x_row + 8 * (rc - 1), mask);
        for (int a = 0; a < rr; a++) {
            __m256 wb = _mm256_set1_ps(w[a * w_row + l]);
            for (int c = 0; c < rc; c++) acc[a][c] = _mm256_fmadd_ps(wb, xv[c], acc[a][c]);
        }
    }
    for (int a = 0; a < rr; a++) {
        for (int c = 0; c < rc - 1; c++) _mm256_storeu_ps(dst + a * dst_row + 8 * c, acc[a][c]);
        _mm256_maskstore_ps(dst + a * dst_row + 8 * (rc - 1), mask, acc[a][rc - 1]);
    }
}

/* tile(..., rr, rc, last) for rc of 1..4 (AVX2: 1..3), each count's body inlined */
#define VECS(tile, top, w, w_row, k, x, x_row, dst, dst_row, rr, rc, last)    \
    switch (rc) {                                                             \
    case 1: tile(w, w_row, k, x, x_row, dst, dst_row, rr, 1, last); break;    \
    case 2: tile(w, w_row, k, x, x_row, dst, dst_row, rr, 2, last); break;    \
    case 3: tile(w, w_row, k, x, x_row, dst, dst_row, rr, 3, last); break;    \
    default: tile(w, w_row, k, x, x_row, dst, dst_row, rr, top, last); break; \
    }

/* Rows of W by every column: tiles of `rows` (at most 6) rows (then the rows left) by
   `vecs` vectors of `lanes` columns (then the columns left, the last vector masked). */
#define BCAST_BY(target, name, tile, rows, vecs, lanes, mask_of)                                       \
    target void name(const float *w, int64_t m, int64_t k, int64_t w_row, const float *x,             \
                     int64_t x_row, int64_t n, float *dst, int64_t dst_row) {                         \
        for (int64_t i = 0; i < m; i += rows) {                                                       \
            const int rr = m - i < rows ? (int)(m - i) : rows;                                        \
            for (int64_t j = 0; j < n; j += vecs * lanes) {                                           \
                const int64_t cols = n - j < vecs * lanes ? n - j : vecs * lanes;                     \
                const int rc = (int)((cols + lanes - 1) / lanes);                                     \
                const int left = (int)(cols - (rc - 1) * lanes); /* columns in the last vector */    \
                const float *wi = w + i * w_row, *xj = x + j;                                         \
                float *d = dst + i * dst_row + j;                                                     \
                switch (rr) {                                                                         \
                case 1: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 1, rc, mask_of(left)) break; \
                case 2: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 2, rc, mask_of(left)) break; \
                case 3: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 3, rc, mask_of(left)) break; \
                case 4: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 4, rc, mask_of(left)) break; \
                case 5: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 5 < rows ? 5 : rows, rc, mask_of(left)) break; \
                default: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, rows, rc, mask_of(left)) break; \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }

#define MASK16(left) ((__mmask16)((1u << (left)) - 1))
#define COUNT8(left) (left)

BCAST_BY(AVX512, kz_f32_product_rows_avx512, bcast512, BROWS512, BVECS512, 16, MASK16)
BCAST_BY(AVX2, kz_f32_product_rows_avx2, bcast256, BROWS256, BVECS256, 8, COUNT8)

/* The custom operation's body (ggml_custom_op_t) for one of its nth threads: src[0] the
   weights, src[1] x, on one variant's tiles. */
static void product(struct tensor *dst, int nth, struct claims *claims,
                    void (*rows)(const struct operands *, int64_t, int64_t, int64_t)) {
    const struct tensor *w = dst->src[0], *x = dst->src[1];
    const struct operands o = {
        .w = w->data,
        .x = x->data,
        .dst = dst->data,
        .w_row = w->nb[1] / sizeof(float),
        .x_row = x->nb[1] / sizeof(float),
        .dst_row = dst->nb[1] / sizeof(float),
        .k = w->ne[0],
    };
    for (int64_t first, last; claim(claims, w->ne[1], &first, &last);) rows(&o, first, last, x->ne[1]);
    claimed(claims, nth);
}

void kz_f32_product_avx512(struct tensor *dst, int ith, int nth, void *claims) {
    (void)ith;
    product(dst, nth, claims, rows512);
}

void kz_f32_product_avx2(struct tensor *dst, int ith, int nth, void *claims) {
    (void)ith;
    product(dst, nth, claims, rows256);
}
