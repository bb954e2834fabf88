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

#define CHUNK_ROWS 64 /* weight rows a thread claims at a time */

/* The chunks of one operation's weight rows that its threads have claimed, and the threads
   that found none left: the last of those starts the count again for the operation's next run
   (ggml runs a graph's next operation, and a graph again, only once every thread is done with
   this one). One per operation (its userdata), zeroed by the caller. A thread that another
   process or the codec decoder holds back leaves its share to the others, as ggml's own
   products do. */
struct claims {
    int next;
    int done;
};

/* The next chunk of weight rows for this thread, [*first, *last) of m; 0 once none is left. */
static inline int claim(struct claims *claims, int64_t m, int64_t *first, int64_t *last) {
    const int chunks = (int)((m + CHUNK_ROWS - 1) / CHUNK_ROWS);
    const int c = __atomic_fetch_add(&claims->next, 1, __ATOMIC_RELAXED);
    if (c >= chunks) return 0;
    *first = (int64_t)c * CHUNK_ROWS;
    *last = *first + CHUNK_ROWS < m ? *first + CHUNK_ROWS : m;
    return 1;
}

/* This thread found no chunk left (after `claim` returned 0). */
static inline void claimed(struct claims *claims, int nth) {
    if (__atomic_fetch_add(&claims->done, 1, __ATOMIC_ACQ_REL) == nth - 1) {
        __atomic_store_n(&claims->next, 0, __ATOMIC_RELAXED);
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
