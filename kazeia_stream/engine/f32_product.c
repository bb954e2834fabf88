/* Float32 weights (or float16 ones, widened exactly, in panels) times float32 columns, called
   directly by the codec decoder on its own buffers (see f32_product.py for why), on one thread
   or shared by rows with helper threads (`kz_f32_product_shared`).

   Every element of a product is one chain of fmadds over the inner index k, in order, from
   zero, so that a column's numbers do not depend on how many columns come with it or where it
   sits among them, on either variant (AVX-512, AVX2) and either layout: weights packed in
   panels, times columns of contiguous numbers (lanes over the weight's rows), or weights in
   place, times rows of contiguous numbers (lanes over the columns). Tiles are outer products:
   no sums across lanes are left to do at the end. */

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_op.h" /* INLINE */

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* The variant this CPU runs: 2 AVX-512, 1 AVX2, 0 neither. */
int kz_f32_product_level(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c"))
        return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
}

/* Where the panels' tiles read and write: column j of x at x + j * x_row (k floats), of dst at
   dst + j * dst_row. The weights are float32 or float16 (`kz_f32_product_pack16`): a float16
   weight is widened exactly in the registers, so its products are those of the float32 it
   widens to, from half the bytes (the decoder's few-column products are bound by reading them). */
struct operands {
    const void *w;
    const float *x;
    float *dst;
    size_t x_row, dst_row; /* in floats */
    int64_t k;
};

/* Panels: a weight packed 16 rows at a time, each panel [k][16] (the rows beyond the matrix's
   zero), times columns of x. Tiles of a few panels by a few columns: each panel's 16 weights at
   l and each column's x[l] broadcast give an outer product into the tile's accumulators. */
#define PANEL 16

/* 16 (AVX-512) or 8 (AVX2) weights of a panel, as float32. */
#define F32_512(p) _mm512_loadu_ps(p)
#define F16_512(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define F32_256(p) _mm256_loadu_ps(p)
#define F16_256(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))

/* AVX-512: up to PANELS512 panels x COLP512 columns of accumulators (24 of the 32 registers);
   each panel prefetched 32 steps ahead: a frame's decode alone 50-55 against 54-58 ms, its
   products in a decode's order 40-46 against 46-49 (an Intel Xeon with AMX, family 6 model
   167; `python -m kazeia_stream.engine.codec MMPROJ 1`, six alternated runs). */
#define PANELS512 4
#define COLP512 6

#define PANEL512(name, wtype, load)                                                              \
    AVX512 INLINE void name(const wtype *w, int64_t k, const float *x, size_t x_row, float *dst, \
                            size_t dst_row, const int rp, const int rn) {                        \
        __m512 acc[PANELS512][COLP512];                                                          \
        for (int a = 0; a < rp; a++)                                                             \
            for (int b = 0; b < rn; b++) acc[a][b] = _mm512_setzero_ps();                        \
        for (int64_t l = 0; l < k; l++) {                                                        \
            __m512 wv[PANELS512];                                                                \
            for (int a = 0; a < rp; a++)                                                         \
                _mm_prefetch((const char *)(w + (a * k + l + 32) * PANEL), _MM_HINT_T0);         \
            for (int a = 0; a < rp; a++) wv[a] = load(w + (a * k + l) * PANEL);                  \
            for (int b = 0; b < rn; b++) {                                                       \
                __m512 xb = _mm512_set1_ps(x[b * x_row + l]);                                    \
                for (int a = 0; a < rp; a++) acc[a][b] = _mm512_fmadd_ps(wv[a], xb, acc[a][b]);  \
            }                                                                                    \
        }                                                                                        \
        for (int a = 0; a < rp; a++)                                                             \
            for (int b = 0; b < rn; b++) _mm512_storeu_ps(dst + b * dst_row + a * PANEL, acc[a][b]); \
    }

PANEL512(panel512, float, F32_512)
PANEL512(panel512h, uint16_t, F16_512)

/* AVX2: one panel (two registers) x up to COLP256 columns (12 of the 16 registers); the panel
   prefetched 128 steps ahead: the float16 products of a frame's 4 columns read their 60 MB at
   6.6-6.8 GB/s so, 5.8-5.9 without (Zen 1, one core). */
#define PANELS256 1
#define COLP256 6

#define PANEL256(name, wtype, load)                                                                \
    AVX2 INLINE void name(const wtype *w, int64_t k, const float *x, size_t x_row, float *dst,     \
                          size_t dst_row, const int rp, const int rn) {                            \
        (void)rp; /* always one */                                                                 \
        __m256 acc[2][COLP256];                                                                    \
        for (int h = 0; h < 2; h++)                                                                \
            for (int b = 0; b < rn; b++) acc[h][b] = _mm256_setzero_ps();                          \
        for (int64_t l = 0; l < k; l++) {                                                          \
            _mm_prefetch((const char *)(w + (l + 128) * PANEL), _MM_HINT_T0);                      \
            __m256 lo = load(w + l * PANEL), hi = load(w + l * PANEL + 8);                         \
            for (int b = 0; b < rn; b++) {                                                         \
                __m256 xb = _mm256_set1_ps(x[b * x_row + l]);                                      \
                acc[0][b] = _mm256_fmadd_ps(lo, xb, acc[0][b]);                                    \
                acc[1][b] = _mm256_fmadd_ps(hi, xb, acc[1][b]);                                    \
            }                                                                                      \
        }                                                                                          \
        for (int b = 0; b < rn; b++) {                                                             \
            _mm256_storeu_ps(dst + b * dst_row, acc[0][b]);                                        \
            _mm256_storeu_ps(dst + b * dst_row + 8, acc[1][b]);                                    \
        }                                                                                          \
    }

PANEL256(panel256, float, F32_256)
PANEL256(panel256h, uint16_t, F16_256)

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

/* Panels [p0, p1) of `wtype` weights by every column: tiles of up to `panels` panels by 6
   columns (then the columns left), each panel read from memory once while every column passes. */
#define PANELS_BY(target, name, tile, panels, wtype)                                            \
    target static void name(const struct operands *o, int64_t p0, int64_t p1, int64_t n) {     \
        for (int64_t p = p0; p < p1; p += panels) {                                            \
            const int rp = p1 - p < panels ? (int)(p1 - p) : panels;                           \
            const wtype *w = (const wtype *)o->w + p * o->k * PANEL;                           \
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

PANELS_BY(AVX512, panels512, panel512, PANELS512, float)
PANELS_BY(AVX512, panels512h, panel512h, PANELS512, uint16_t)
PANELS_BY(AVX2, panels256, panel256, PANELS256, float)
PANELS_BY(AVX2, panels256h, panel256h, PANELS256, uint16_t)

/* W [m, k] (element (i, l) at src[i * row + l * col]) packed as `panels_at` takes it, on any
   CPU (plain C: the copy is bound by memory): panel p [k][PANEL] holds rows 16 p .. 16 p + 15,
   the rows beyond m zero; float32 (`pack`) or float16 (`pack16`) as stored. W is read in tiles
   of PACK_PANELS panels by PACK_COLUMNS columns, which touch at most 128 pages whether its rows
   or its columns are far apart (a weight in the file's layout, or a transposed view of it: read
   a panel at a time, the 12288 x 1536 view of a 0.6B decoder touched a page a number). */
#define PACK_PANELS 8
#define PACK_COLUMNS 128
#define PACK(name, wtype)                                                                         \
    void name(const wtype *src, int64_t m, int64_t k, int64_t row, int64_t col, wtype *dst) {     \
        const int64_t panels = (m + PANEL - 1) / PANEL;                                           \
        for (int64_t p0 = 0; p0 < panels; p0 += PACK_PANELS)                                      \
            for (int64_t l0 = 0; l0 < k; l0 += PACK_COLUMNS)                                      \
                for (int64_t p = p0; p < p0 + PACK_PANELS && p < panels; p++) {                   \
                    wtype *panel = dst + p * k * PANEL;                                           \
                    const int rows = m - p * PANEL < PANEL ? (int)(m - p * PANEL) : PANEL;        \
                    for (int64_t l = l0; l < l0 + PACK_COLUMNS && l < k; l++) {                   \
                        const wtype *s = src + p * PANEL * row + l * col;                         \
                        for (int r = 0; r < rows; r++) panel[l * PANEL + r] = s[r * row];         \
                        for (int r = rows; r < PANEL; r++) panel[l * PANEL + r] = 0;              \
                    }                                                                             \
                }                                                                                 \
    }

PACK(kz_f32_product_pack, float)
PACK(kz_f32_product_pack16, uint16_t)

typedef void panels_fn(const struct operands *, int64_t, int64_t, int64_t);

/* dst = W x for a packed W of m rows (`size`-byte weights), called directly (the codec
   decoder's own buffers, on its one thread): column j of x at x + j * x_col (k floats), of dst
   at dst + j * dst_col (m floats; the last panel's rows beyond m are computed aside and left
   out). */
static void panels_at(panels_fn *panels, const void *w, size_t size, int64_t m, int64_t k,
                      const float *x, int64_t x_col, int64_t n, float *dst, int64_t dst_col) {
    const int64_t full = m / PANEL, rest = m % PANEL;
    const struct operands o = {.w = w, .x = x, .dst = dst, .x_row = (size_t)x_col, .dst_row = (size_t)dst_col, .k = k};
    panels(&o, 0, full, n);
    if (!rest) return;
    float *aside = malloc((size_t)n * PANEL * sizeof(float));
    if (aside == NULL) abort(); /* as numpy would raise */
    const struct operands last = {.w = (const char *)w + full * k * PANEL * size, .x = x, .dst = aside, .x_row = (size_t)x_col, .dst_row = PANEL, .k = k};
    panels(&last, 0, 1, n);
    for (int64_t j = 0; j < n; j++) memcpy(dst + j * dst_col + full * PANEL, aside + j * PANEL, rest * sizeof(float));
    free(aside);
}

#define PANELS_AT(name, panels, size)                                                             \
    void name(const void *w, int64_t m, int64_t k, const float *x, int64_t x_col, int64_t n,      \
              float *dst, int64_t dst_col) {                                                      \
        panels_at(panels, w, size, m, k, x, x_col, n, dst, dst_col);                              \
    }

PANELS_AT(kz_f32_product_panels_avx512, panels512, 4)
PANELS_AT(kz_f32_product_panels_avx2, panels256, 4)
PANELS_AT(kz_f32_product_panels16_avx512, panels512h, 2)
PANELS_AT(kz_f32_product_panels16_avx2, panels256h, 2)

/* Rows: W in place [m, k] times x [k, n] whose rows are contiguous, into dst [m, n] likewise
   (the decoder's context buffers and outputs, channel-major): lanes over the columns, each
   W[i, l] broadcast: the numbers of the panels above. Tiles of a few rows of W by a few
   vectors of columns, the last vector masked. */

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

/* AVX2, for fewer rows than a tile of `packed256` (a one-row product would take two chains of
   fmadds there): up to BROWS256 rows x BVECS256 vectors of 8 columns (12 of the 16 registers).
   The last vector is loaded and stored through a mask only where it is partial (`masked`):
   held, the mask took one of the 16 registers, so that the compiler read a column vector from
   the cache for each row (and vmaskmovps costs more than a load): 59% of the FMAs' rate on
   Zen 1, with the columns in L1. */
#define BROWS256 4
#define BVECS256 3

AVX2 INLINE void bcast256_tile(const float *w, int64_t w_row, int64_t k, const float *x, int64_t x_row,
                               float *dst, int64_t dst_row, const int rr, const int rc, const int masked,
                               int last) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(last), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 acc[BROWS256][BVECS256];
    for (int a = 0; a < rr; a++)
        for (int c = 0; c < rc; c++) acc[a][c] = _mm256_setzero_ps();
    for (int64_t l = 0; l < k; l++) {
        __m256 xv[BVECS256];
        for (int c = 0; c < rc - masked; c++) xv[c] = _mm256_loadu_ps(x + l * x_row + 8 * c);
        if (masked) xv[rc - 1] = _mm256_maskload_ps(x + l * x_row + 8 * (rc - 1), mask);
        for (int a = 0; a < rr; a++) {
            __m256 wb = _mm256_set1_ps(w[a * w_row + l]);
            for (int c = 0; c < rc; c++) acc[a][c] = _mm256_fmadd_ps(wb, xv[c], acc[a][c]);
        }
    }
    for (int a = 0; a < rr; a++) {
        for (int c = 0; c < rc - masked; c++) _mm256_storeu_ps(dst + a * dst_row + 8 * c, acc[a][c]);
        if (masked) _mm256_maskstore_ps(dst + a * dst_row + 8 * (rc - 1), mask, acc[a][rc - 1]);
    }
}

AVX2 INLINE void bcast256(const float *w, int64_t w_row, int64_t k, const float *x, int64_t x_row,
                          float *dst, int64_t dst_row, const int rr, const int rc, int last) {
    if (last == 8)
        bcast256_tile(w, w_row, k, x, x_row, dst, dst_row, rr, rc, 0, last);
    else
        bcast256_tile(w, w_row, k, x, x_row, dst, dst_row, rr, rc, 1, last);
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
   `vecs` vectors of `lanes` columns (then the columns left, the last vector masked), in blocks
   of `block(k, rows)` rows of W (a multiple of `rows`), each block's tiles by every column, the
   columns' tiles outer: a tile's columns stay in the L1 while the block's rows pass, the block's
   rows in the L2 while the columns pass. A block of one tile's rows is the plain order. */
#define BCAST_BY(target, name, tile, rows, vecs, lanes, mask_of, block)                                \
    target void name(const float *w, int64_t m, int64_t k, int64_t w_row, const float *x,             \
                     int64_t x_row, int64_t n, float *dst, int64_t dst_row) {                         \
        const int64_t step = block(k, rows);                                                          \
        for (int64_t i0 = 0; i0 < m; i0 += step)                                                      \
            for (int64_t j = 0; j < n; j += vecs * lanes)                                              \
                for (int64_t i = i0; i < i0 + step && i < m; i += rows) {                              \
                    const int rr = m - i < rows ? (int)(m - i) : rows;                                 \
                    const int64_t cols = n - j < vecs * lanes ? n - j : vecs * lanes;                  \
                    const int rc = (int)((cols + lanes - 1) / lanes);                                  \
                    const int left = (int)(cols - (rc - 1) * lanes); /* columns in the last vector */  \
                    const float *wi = w + i * w_row, *xj = x + j;                                      \
                    float *d = dst + i * dst_row + j;                                                  \
                    switch (rr) {                                                                      \
                    case 1: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 1, rc, mask_of(left)) break; \
                    case 2: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 2, rc, mask_of(left)) break; \
                    case 3: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 3, rc, mask_of(left)) break; \
                    case 4: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 4, rc, mask_of(left)) break; \
                    case 5: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, 5 < rows ? 5 : rows, rc, mask_of(left)) break; \
                    default: VECS(tile, vecs, wi, w_row, k, xj, x_row, d, dst_row, rows, rc, mask_of(left)) break; \
                    }                                                                                  \
                }                                                                                      \
    }

#define MASK16(left) ((__mmask16)((1u << (left)) - 1))
#define COUNT8(left) (left)

/* AVX-512: a tile's rows (its CPUs' L2 of 1-2 MB holds the decoder's widest inputs; not
   measured in blocks). AVX2: the rows of W in ROWS_BLOCK256 bytes (a quarter of a Zen's L2 of
   512 KB): the 96 x 96 weight times 1920 columns of the decoder's last block ran 58-71 GFLOP/s
   against 53-56, 192 x 192 times 640 80-87 against 62-66 (Zen 3, one core, its FMAs' peak 115;
   `f32_product.multiply`, best of 200, three alternated rounds). */
#define ROWS_BLOCK256 (128 * 1024)
static inline int64_t one_tile(int64_t k, int rows) {
    (void)k;
    return rows;
}
static inline int64_t in_bytes256(int64_t k, int rows) {
    const int64_t fit = ROWS_BLOCK256 / (4 * k) / rows * rows;
    return fit > rows ? fit : rows;
}

BCAST_BY(AVX512, kz_f32_product_rows_avx512, bcast512, BROWS512, BVECS512, 16, MASK16, one_tile)
BCAST_BY(AVX2 static, few_rows256, bcast256, BROWS256, BVECS256, 8, COUNT8, in_bytes256)

/* AVX2: tiles of up to PROWS256 rows of W by 16 columns (two vectors; 12 accumulators, as BLIS'
   Haswell kernel has them), each tile's columns first copied into a contiguous [k][16], zeros
   past the last column: its loads then run through the L1 in order, not k rows of x apart.
   Zen 3, one core, alternated with tiles of 4 rows by 24 columns in place: a decode's products
   of this kind 15.3-17.6 ms a frame against 17.5-19.8; through `f32_product.multiply`, best of
   many, 3840 x 768 by 128 columns 54-68 GFLOP/s against 39-48, 1536 x 384 by 160 58-84
   against 49-64 (the decoder's smaller ones within the host's noise). */
#define PROWS256 6

AVX2 INLINE void packed256(const float *w, int64_t w_row, int64_t k, const float *xp, float *dst,
                           int64_t dst_row, const int rr, int left) {
    __m256 acc[PROWS256][2];
    for (int a = 0; a < rr; a++) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    for (int64_t l = 0; l < k; l++) {
        const __m256 lo = _mm256_load_ps(xp + 16 * l), hi = _mm256_load_ps(xp + 16 * l + 8);
        for (int a = 0; a < rr; a++) {
            const __m256 wb = _mm256_set1_ps(w[a * w_row + l]);
            acc[a][0] = _mm256_fmadd_ps(wb, lo, acc[a][0]);
            acc[a][1] = _mm256_fmadd_ps(wb, hi, acc[a][1]);
        }
    }
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); /* `left` columns stored */
    const __m256i first8 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lanes);
    const __m256i last8 = _mm256_cmpgt_epi32(_mm256_set1_epi32(left - 8), lanes);
    for (int a = 0; a < rr; a++) {
        if (left == 16) {
            _mm256_storeu_ps(dst + a * dst_row, acc[a][0]);
            _mm256_storeu_ps(dst + a * dst_row + 8, acc[a][1]);
        } else {
            _mm256_maskstore_ps(dst + a * dst_row, first8, acc[a][0]);
            _mm256_maskstore_ps(dst + a * dst_row + 8, last8, acc[a][1]);
        }
    }
}

/* packed256 for rr of 1..6 rows, each count's body inlined */
#define ROWS6(w, w_row, k, xp, dst, dst_row, rr, left)                 \
    switch (rr) {                                                      \
    case 1: packed256(w, w_row, k, xp, dst, dst_row, 1, left); break;  \
    case 2: packed256(w, w_row, k, xp, dst, dst_row, 2, left); break;  \
    case 3: packed256(w, w_row, k, xp, dst, dst_row, 3, left); break;  \
    case 4: packed256(w, w_row, k, xp, dst, dst_row, 4, left); break;  \
    case 5: packed256(w, w_row, k, xp, dst, dst_row, 5, left); break;  \
    default: packed256(w, w_row, k, xp, dst, dst_row, 6, left); break; \
    }

/* x [k, n] (rows x_row floats apart) as packed256 reads it: each 16 columns a [k][16] after
   the last, zeros past column n. */
AVX2 static void pack_columns(const float *x, int64_t x_row, int64_t k, int64_t n, float *xp) {
    for (int64_t j = 0; j < n; j += 16, xp += 16 * k) {
        const int64_t left = n - j < 16 ? n - j : 16;
        for (int64_t l = 0; l < k; l++) {
            const float *from = x + l * x_row + j;
            float *to = xp + 16 * l;
            if (left == 16) {
                _mm256_store_ps(to, _mm256_loadu_ps(from));
                _mm256_store_ps(to + 8, _mm256_loadu_ps(from + 8));
            } else {
                memcpy(to, from, (size_t)left * sizeof(float));
                memset(to + left, 0, (size_t)(16 - left) * sizeof(float));
            }
        }
    }
}

/* As BCAST_BY's loops (blocks of W's rows, each by every tile of columns), x's columns packed
   once for all the blocks. */
AVX2 void kz_f32_product_rows_avx2(const float *w, int64_t m, int64_t k, int64_t w_row, const float *x,
                                   int64_t x_row, int64_t n, float *dst, int64_t dst_row) {
    if (m < PROWS256) {
        few_rows256(w, m, k, w_row, x, x_row, n, dst, dst_row);
        return;
    }
    float *xp = aligned_alloc(32, (size_t)((n + 15) / 16) * (size_t)k * 16 * sizeof(float));
    if (xp == NULL) abort(); /* as numpy would raise */
    pack_columns(x, x_row, k, n, xp);
    const int64_t step = in_bytes256(k, PROWS256);
    for (int64_t i0 = 0; i0 < m; i0 += step)
        for (int64_t j = 0; j < n; j += 16) {
            const float *tile = xp + j * k; /* its columns' [k][16] */
            for (int64_t i = i0; i < i0 + step && i < m; i += PROWS256) {
                const int rr = m - i < PROWS256 ? (int)(m - i) : PROWS256;
                float *d = dst + i * dst_row + j;
                if (n - j >= 16) {
                    ROWS6(w + i * w_row, w_row, k, tile, d, dst_row, rr, 16)
                } else {
                    ROWS6(w + i * w_row, w_row, k, tile, d, dst_row, rr, (int)(n - j))
                }
            }
        }
    free(xp);
}

/* A product shared by rows among the threads of a team: its caller's and helpers that wait in
   `kz_f32_product_serve` while the team is held (the decoder's passes that have every core).
   The helpers spin between products: a sleeping thread took 100-250 us here to wake (a
   virtual CPU's), as long as a share of many of the decoder's products. Shares are whole
   panels, rows [m * i / parts] rounded down to a panel's: each element is computed as alone. */
typedef void panels_export(const void *, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t);
typedef void rows_export(const float *, int64_t, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t);

struct product { /* a call of `panels_export` (rows_w 0) or of `rows_export` (W's rows rows_w apart) */
    void *fn;
    const void *w;
    size_t size; /* a weight's bytes */
    int64_t m, k, rows_w, x_step, n, dst_step, parts;
    const float *x;
    float *dst;
};

struct team {
    _Atomic uint64_t posted, finished;
    _Atomic int stop;
    struct product job;
};

size_t kz_f32_product_team_size(void) { return sizeof(struct team); }

/* A product's multiply-adds below which its caller computes it alone (a share of 0.02-0.05 ms). */
#define SHARED_MACS (1 << 18)

static void share(const struct product *p, int64_t i) {
    const int64_t a = p->m * i / p->parts / PANEL * PANEL;
    const int64_t b = i + 1 == p->parts ? p->m : p->m * (i + 1) / p->parts / PANEL * PANEL;
    if (a >= b) return;
    if (p->rows_w == 0)
        ((panels_export *)p->fn)((const char *)p->w + a * p->k * p->size, b - a, p->k, p->x, p->x_step, p->n,
                                 p->dst + a, p->dst_step);
    else
        ((rows_export *)p->fn)((const float *)p->w + a * p->rows_w, b - a, p->k, p->rows_w, p->x, p->x_step,
                               p->n, p->dst + a * p->dst_step, p->dst_step);
}

/* A helper of `t`, sharing each product posted, until `kz_f32_product_stop` (helper `index`,
   1 to parts - 1, takes the index-th share). Called with Python's lock let go (ctypes). */
void kz_f32_product_serve(struct team *t, int64_t index) {
    uint64_t seen = 0;
    for (;;) {
        uint64_t posted;
        while ((posted = atomic_load_explicit(&t->posted, memory_order_acquire)) == seen)
            if (atomic_load_explicit(&t->stop, memory_order_relaxed)) return;
            else _mm_pause();
        seen = posted;
        share(&t->job, index);
        atomic_fetch_add_explicit(&t->finished, 1, memory_order_release);
    }
}

void kz_f32_product_stop(struct team *t) { atomic_store(&t->stop, 1); }

/* The product `fn` (a variant's `panels` or `rows` export, as `rows_w` says), shared with the
   helpers of `t` (parts - 1 of them) where it is large enough, or by its caller alone (t NULL). */
void kz_f32_product_shared(struct team *t, int64_t parts, void *fn, const void *w, size_t size, int64_t m,
                           int64_t k, int64_t rows_w, const float *x, int64_t x_step, int64_t n, float *dst,
                           int64_t dst_step) {
    struct product p = {.fn = fn, .w = w, .size = size, .m = m, .k = k, .rows_w = rows_w, .x = x,
                        .x_step = x_step, .n = n, .dst = dst, .dst_step = dst_step, .parts = 1};
    if (t == NULL || parts < 2 || m < 2 * PANEL || m * k * n < SHARED_MACS) {
        share(&p, 0);
        return;
    }
    p.parts = parts;
    t->job = p;
    const uint64_t done = atomic_load_explicit(&t->finished, memory_order_relaxed) + (uint64_t)(parts - 1);
    atomic_fetch_add_explicit(&t->posted, 1, memory_order_release);
    share(&p, 0);
    while (atomic_load_explicit(&t->finished, memory_order_acquire) != done) _mm_pause();
}
