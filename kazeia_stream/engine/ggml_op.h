/* What our C kernels share: the INLINE macro; for our ggml custom operations of quantized
   weights times float32 rows (q8_product.c, kquant_product.c), the leading fields of ggml's
   tensor, the claims by which ggml's threads take an operation's weight rows, the loop that
   quantizes x and passes its rows over tiles of weight rows, and the sum of a float32 vector's
   lanes on AVX2. */

#ifndef KZ_GGML_OP_H
#define KZ_GGML_OP_H

#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define INLINE static inline __attribute__((always_inline))

/* The leading fields of struct ggml_tensor (ggml.h of llama-cpp-python 0.3.36). */
struct tensor {
    int type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct tensor *src[10];
    struct tensor *view_src;
    size_t view_offs;
    void *data;
};

#define CHUNK_ROWS 64  /* weight rows a thread claims at a time */
#define ROWS 4         /* rows of x per pass over a weight row (registers) */
#define TILE_ROWS 16   /* weight rows per tile: they stay in L1 while every row of x passes */
#define MAX_SHARES 64  /* threads with a share of their own; any more only take others' */
#define BEGUN (1ull << 63)

/* How one operation's threads take its weight rows: one contiguous share of the chunks per
   thread, which it takes from the front, a chunk at a time; a thread whose share is done takes
   the others' from their backs, so that one that another process or the codec decoder holds
   back leaves the rest of its share to the others, as ggml's own products do. Contiguous,
   because two cores that read interleaved chunks are slower: on Zen 4, two threads reading
   68 KB chunks in turn read 41 GB/s, each its own half 60-69. The last thread to find none
   left sets the shares back for the operation's next run (ggml runs a graph's next operation,
   and a graph again, only once every thread is done with this one). One per operation (its
   userdata), zeroed by the caller. */
struct claims {
    int done;                      /* threads that found no chunk left */
    uint64_t shares[MAX_SHARES];   /* 0 until a thread begins it; then BEGUN | back << 32 | front */
    float eps;                     /* the RMS norm's epsilon, for an operation that norms x (`product`) */
};

/* The shares of an operation run on nth threads: one each, up to MAX_SHARES. */
static inline int shares_of(int nth) { return nth < MAX_SHARES ? nth : MAX_SHARES; }

/* A chunk of share s of n (of chunks in all), from its front (`own`) or its back; 0 if it
   has none left. The first thread to touch a share begins it: every thread of a run knows
   the same bounds. */
static inline int take(uint64_t *share, int s, int n, int chunks, int own, int64_t *chunk) {
    uint64_t v = __atomic_load_n(share, __ATOMIC_RELAXED);
    for (;;) {
        if (v == 0) {
            const uint64_t begun = BEGUN | (uint64_t)((int64_t)(s + 1) * chunks / n) << 32 |
                                   (uint64_t)((int64_t)s * chunks / n);
            if (__atomic_compare_exchange_n(share, &v, begun, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                v = begun;
            continue;
        }
        const int64_t front = (int64_t)(v & 0x7fffffff), back = (int64_t)(v >> 32 & 0x7fffffff);
        if (front >= back) return 0;
        const uint64_t rest = own ? v + 1 : v - (1ull << 32);
        if (__atomic_compare_exchange_n(share, &v, rest, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            *chunk = own ? front : back - 1;
            return 1;
        }
    }
}

/* The next chunk of weight rows for thread ith of nth, [*first, *last) of m; 0 once none is
   left: its own share's, then the others'. */
static inline int claim(struct claims *claims, int64_t m, int ith, int nth, int64_t *first, int64_t *last) {
    const int chunks = (int)((m + CHUNK_ROWS - 1) / CHUNK_ROWS), n = shares_of(nth);
    int64_t chunk;
    for (int i = 0; i < n; i++) {
        const int s = (ith + i) % n;
        if (take(&claims->shares[s], s, n, chunks, i == 0 && ith < n, &chunk)) {
            *first = chunk * CHUNK_ROWS;
            *last = *first + CHUNK_ROWS < m ? *first + CHUNK_ROWS : m;
            return 1;
        }
    }
    return 0;
}

/* This thread found no chunk left (after `claim` returned 0). */
static inline void claimed(struct claims *claims, int nth) {
    if (__atomic_fetch_add(&claims->done, 1, __ATOMIC_ACQ_REL) == nth - 1) {
        for (int s = 0; s < shares_of(nth); s++) __atomic_store_n(&claims->shares[s], 0, __ATOMIC_RELAXED);
        __atomic_store_n(&claims->done, 0, __ATOMIC_RELEASE);
    }
}

/* How a variant lays out a row of x once quantized, per group of weight blocks (a row whose
   block count is no multiple of the group's takes the room of one more): blocks, bytes of int8
   (and whatever else the variant keeps there) and floats of scales. `pack`, where a variant
   has one: what its tiles read besides, made once an operation for each set of rows of x that
   pass the tiles together (ROWS at most) from their quantized rows, in `packed_bytes(nb)`. */
struct layout {
    int blocks, bytes, floats;
    size_t (*packed_bytes)(int64_t nb);
    void (*pack)(const int8_t *q, const float *d, size_t q_row, size_t d_row, int n, int64_t nb, void *packed);
};

/* dst[r][row] for weight rows [r0, r1) (nb blocks each) and rows r of x in [0, n), n <= ROWS:
   x's rows of q_row bytes and d_row scales, as the variant's layout, and what its `pack` made of
   them (NULL without one). */
typedef void tile_fn(const void *w, int64_t nb, size_t q_row, size_t d_row, int n, const int8_t *q,
                     const float *d, float *dst, size_t dst_row, int64_t r0, int64_t r1, const void *packed);

/* A tile_fn over `rows`, a body inlined for each n: its accumulators stay in registers. Any
   further arguments go to `rows` after the tile's, as constants of each body. */
#define TILE(target, name, rows, ...)                                                           \
    target static void name(const void *w, int64_t nb, size_t q_row, size_t d_row, int n,       \
                            const int8_t *q, const float *d, float *dst, size_t dst_row,        \
                            int64_t r0, int64_t r1, const void *packed) {                       \
        (void)packed;                                                                           \
        switch (n) {                                                                            \
        case 1: rows(w, nb, q_row, d_row, 1, q, d, dst, dst_row, r0, r1, ##__VA_ARGS__); break; \
        case 2: rows(w, nb, q_row, d_row, 2, q, d, dst, dst_row, r0, r1, ##__VA_ARGS__); break; \
        case 3: rows(w, nb, q_row, d_row, 3, q, d, dst, dst_row, r0, r1, ##__VA_ARGS__); break; \
        default: rows(w, nb, q_row, d_row, ROWS, q, d, dst, dst_row, r0, r1, ##__VA_ARGS__);    \
        }                                                                                       \
    }

/* The matrix of a stack (w->ne[2] of them) that column r of x takes: ids, int32 [n], or the
   first where there are none. Out of range is a bug of the caller's: abort, as ggml does. */
static inline int64_t matrix_of(const struct tensor *w, const struct tensor *ids, int64_t r) {
    if (ids == NULL) return 0;
    const int64_t id = ((const int32_t *)ids->data)[r];
    if (id < 0 || id >= w->ne[2]) abort();
    return id;
}

/* x[0..k) RMS-normed and times w into y, as ggml's rms_norm and mul compute it: a double sum
   of float squares, the scale in float, (x scale) w. */
static inline void rms_normed(const float *x, const float *w, int64_t k, float eps, float *y) {
    double sum = 0.0;
    for (int64_t i = 0; i < k; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / (double)k), scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < k; i++) y[i] = x[i] * scale * w[i];
}

/* The custom operation's body (ggml_custom_op_t) for one of its nth threads: src[0] the
   weights (a matrix, or a stack of them, in blocks of block_k values), src[1] x, src[2] (where
   w is a stack) the matrix each column takes, src[3] (where given) the weight of an RMS norm
   that each column of x takes first (epsilon claims->eps), src[4] (where given) a residual
   [m, n] added to the product (where ggml ran a norm, a mul and an add as operations of their
   own, each ended by a barrier); src[5] and src[6] (where given, with no stack and no
   residual) more matrices as wide as src[0], of its type, that x multiplies in the same
   operation (a layer's q, k and v, or its gate and up: x normed and quantized once, and one
   barrier, where each operation's end cost 8-11 us on two threads of Zen 3), dst then each
   one's product [its rows, n] after the one before; on one variant's quantizer, layout and
   tiles. Columns that take the same matrix one after another pass its rows together, up to
   ROWS at a time. */
#define MAX_FUSED 3 /* matrices an operation multiplies x by: src[0], src[5], src[6] */
static inline void product(struct tensor *dst, int ith, int nth, struct claims *claims, int64_t block_k,
                           void (*quantize)(const float *, int64_t, int8_t *, float *),
                           const struct layout *layout, tile_fn *tile) {
    const struct tensor *w = dst->src[0], *x = dst->src[1], *ids = dst->src[2], *norm = dst->src[3],
                        *residual = dst->src[4];
    const struct tensor *ws[MAX_FUSED] = {w}; /* the matrices, their rows from starts[i] on */
    int64_t starts[MAX_FUSED + 1] = {0, w->ne[1]};
    int fused = 1;
    for (; fused < MAX_FUSED && dst->src[4 + fused] != NULL; fused++) {
        ws[fused] = dst->src[4 + fused];
        starts[fused + 1] = starts[fused] + ws[fused]->ne[1];
    }
    const int64_t k = w->ne[0], m = starts[fused], n = x->ne[1], nb = k / block_k;
    const size_t groups = (size_t)((nb + layout->blocks - 1) / layout->blocks);
    const size_t q_row = groups * layout->bytes, d_row = groups * layout->floats;
    int8_t *q = aligned_alloc(64, (n * q_row + 63) / 64 * 64);
    float *d = aligned_alloc(64, (n * d_row * 4 + 63) / 64 * 64);
    float *normed = norm != NULL ? aligned_alloc(64, (k * 4 + 63) / 64 * 64) : NULL;
    if (q == NULL || d == NULL || (norm != NULL && normed == NULL)) abort(); /* as ggml does when memory runs out */
    for (int64_t r = 0; r < n; r++) {
        const float *row = (const float *)((const char *)x->data + r * x->nb[1]);
        if (norm != NULL) {
            rms_normed(row, (const float *)norm->data, k, claims->eps, normed);
            row = normed;
        }
        quantize(row, k, q + r * q_row, d + r * d_row);
    }
    /* the sets of rows that pass the tiles together: those that take the same matrix one after
       another, ROWS at most; what the variant packs of each */
    int64_t *sets = malloc((size_t)(n + 1) * sizeof *sets), count = 0;
    if (sets == NULL) abort();
    for (int64_t r = 0; r < n; count++) {
        const int64_t matrix = matrix_of(w, ids, r);
        sets[count] = r++;
        while (r < n && r - sets[count] < ROWS && matrix_of(w, ids, r) == matrix) r++;
    }
    sets[count] = n;
    const size_t pack_bytes = layout->pack != NULL ? (layout->packed_bytes(nb) + 63) / 64 * 64 : 0;
    char *packed = pack_bytes ? aligned_alloc(64, count * pack_bytes) : NULL;
    if (pack_bytes && packed == NULL) abort();
    for (int64_t s = 0; pack_bytes && s < count; s++)
        layout->pack(q + sets[s] * q_row, d + sets[s] * d_row, q_row, d_row, (int)(sets[s + 1] - sets[s]), nb,
                     packed + s * pack_bytes);
    for (int64_t first, last; claim(claims, m, ith, nth, &first, &last);) {
        for (int f = 0; f < fused; f++) { /* the claimed rows of each matrix */
            const int64_t from = first > starts[f] ? first : starts[f];
            const int64_t to = last < starts[f + 1] ? last : starts[f + 1];
            const size_t dst_row = (size_t)ws[f]->ne[1];
            float *block = (float *)dst->data + starts[f] * n;
            for (int64_t r0 = from; r0 < to; r0 += TILE_ROWS) {
                int64_t r1 = r0 + TILE_ROWS < to ? r0 + TILE_ROWS : to;
                for (int64_t s = 0; s < count; s++) {
                    const int64_t r = sets[s];
                    const char *weights = (const char *)ws[f]->data + matrix_of(ws[f], ids, r) * ws[f]->nb[2];
                    tile(weights, nb, q_row, d_row, (int)(sets[s + 1] - r), q + r * q_row, d + r * d_row,
                         block + r * dst_row, dst_row, r0 - starts[f], r1 - starts[f],
                         packed != NULL ? packed + s * pack_bytes : NULL);
                }
            }
        }
        if (residual != NULL) /* ggml's add: residual + product */
            for (int64_t r = 0; r < n; r++) {
                const float *add = (const float *)((const char *)residual->data + r * residual->nb[1]);
                float *out = (float *)dst->data + r * m;
                for (int64_t i = first; i < last; i++) out[i] = add[i] + out[i];
            }
    }
    claimed(claims, nth);
    free(sets);
    free(packed);
    free(q);
    free(d);
    free(normed);
}

/* The variant of a quantized kernel this CPU runs: 2 AVX512-VNNI (with BW, DQ, VL), 1 AVX2
   (with FMA, F16C), 0 neither. */
static inline int vnni_level(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c"))
        return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512vnni")
               ? 2
               : 1;
}

/* The sum of v's eight lanes, in one order. */
__attribute__((target("avx2"))) INLINE float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#endif
