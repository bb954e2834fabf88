/* What our C kernels share: the INLINE macro; for our ggml custom operation (q8_product.c),
   the leading fields of ggml's tensor, the claims by which ggml's threads take an operation's
   weight rows, and the sum of a float32 vector's lanes on AVX2. */

#ifndef KZ_GGML_OP_H
#define KZ_GGML_OP_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

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

/* The sum of v's eight lanes, in one order. */
__attribute__((target("avx2"))) INLINE float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#endif
