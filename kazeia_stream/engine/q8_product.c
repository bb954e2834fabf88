/* Q8_0 weights times float32 rows, as a ggml custom operation (see q8_product.py for why).

   dst [m, n] = w [m, k] (Q8_0: blocks of an fp16 scale and 32 int8) @ x [k, n] (float32 rows),
   the rows of x quantized to Q8_0 as ggml does. Two variants of the same loops: int8 products on
   AVX512-VNNI, two blocks per 512-bit register (x offset to unsigned, as vpdpbusd takes it), or
   on AVX2 (u8 x s8 pairs, then pairs of int16; the sign moved onto x), one block per 256-bit
   register. A row of dst is summed in one order whatever n is, so a
   sequence's numbers do not depend on the rows computed beside it. ggml's threads take chunks
   of 64 weight rows in turn (a counter of the operation's own, `struct claims`: a thread that
   another process or the codec decoder holds back leaves its share to the others, as ggml's
   own products do) and read each from memory once, in tiles of 16 rows that stay in the cache
   while every row of x passes (four at a time). */

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

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

typedef struct {
    uint16_t d;
    int8_t qs[32];
} __attribute__((packed)) block_q8_0;

#define ROWS 4         /* rows of x per pass over a weight row (registers) */
#define TILE_ROWS 16   /* weight rows per tile: they stay in L1 while every row of x passes */
#define CHUNK_ROWS 64  /* weight rows a thread claims at a time */
#define PREFETCH 8192  /* bytes ahead in the weights: one core reads at memory speed */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* The variant this CPU runs: 2 AVX512-VNNI, 1 AVX2, 0 neither. */
int kz_q8_product_level(void) {
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

/* A block's scale as ggml's quantize_row_q8_0: d = max|x| / 127 (stored as fp16, kept eight
   times over, the width of a block's lanes); the values are multiplied by 127 / max|x| and
   rounded to the nearest (even on ties). Returns that multiplier. */
__attribute__((target("f16c"))) static inline float scale(float amax, float *d8) {
    float d = _cvtsh_ss(_cvtss_sh(amax / 127.0f, 0));
    for (int i = 0; i < 8; i++) d8[i] = d;
    return amax != 0.0f ? 127.0f / amax : 0.0f;
}

AVX512 static void quantize512(const float *x, int64_t k, int8_t *q, float *d8) {
    for (int64_t b = 0; b < k / 32; b++) {
        __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        __m512 id = _mm512_set1_ps(scale(amax, d8 + b * 8));
        const __m128i offset = _mm_set1_epi8((char)0x80); /* q + 128: unsigned for vpdpbusd */
        __m128i q_lo = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, id)));
        __m128i q_hi = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, id)));
        _mm_storeu_si128((__m128i *)(q + b * 32), _mm_xor_si128(q_lo, offset));
        _mm_storeu_si128((__m128i *)(q + b * 32 + 16), _mm_xor_si128(q_hi, offset));
    }
}

AVX2 static void quantize256(const float *x, int64_t k, int8_t *q, float *d8) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / 32; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * 32 + i * 8);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        __m256 id = _mm256_set1_ps(scale(_mm_cvtss_f32(m4), d8 + b * 8));
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
        /* packs interleave the 128-bit lanes: the permutation puts the 32 bytes back in order */
        __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]),
                                            _mm256_packs_epi32(i[2], i[3]));
        packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * 32), packed);
    }
}

/* dst[r][row] for weight rows [r0, r1) and rows r of x in [0, n), n <= ROWS. */
typedef void tile_fn(const block_q8_0 *w, int64_t nb, int64_t k, int n, const int8_t *q,
                     const float *d8, float *dst, size_t dst_row, int64_t r0, int64_t r1);

/* A tile_fn over `rows`, a body inlined for each n: its accumulators stay in registers. */
#define INLINE static inline __attribute__((always_inline))
#define TILE(target, name, rows)                                                                \
    target static void name(const block_q8_0 *w, int64_t nb, int64_t k, int n, const int8_t *q,  \
                            const float *d8, float *dst, size_t dst_row, int64_t r0, int64_t r1) { \
        switch (n) {                                                                            \
        case 1: rows(w, nb, k, 1, q, d8, dst, dst_row, r0, r1); break;                          \
        case 2: rows(w, nb, k, 2, q, d8, dst, dst_row, r0, r1); break;                          \
        case 3: rows(w, nb, k, 3, q, d8, dst, dst_row, r0, r1); break;                          \
        default: rows(w, nb, k, ROWS, q, d8, dst, dst_row, r0, r1); break;                      \
        }                                                                                       \
    }

AVX512 INLINE void rows512(const block_q8_0 *w, int64_t nb, int64_t k, const int n, const int8_t *q,
                           const float *d8, float *dst, size_t dst_row, int64_t r0, int64_t r1) {
    /* x holds q + 128 (unsigned, as vpdpbusd takes it): each dot product starts from
       -128 * (the sum of w's four int8), computed once for every row of x */
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int64_t row = r0; row < r1; row++) {
        const block_q8_0 *wr = w + row * nb;
        __m512 acc[ROWS];
        for (int r = 0; r < n; r++) acc[r] = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            _mm_prefetch((const char *)(wr + b) + PREFETCH, _MM_HINT_T0);
            __m512i wq = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)wr[b].qs)),
                _mm256_loadu_si256((const __m256i *)wr[b + 1].qs), 1);
            __m512i zero = _mm512_setzero_si512();
            __m512i start = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, offset, wq));
            __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(wr[b].d)),
                                           _mm256_set1_ps(_cvtsh_ss(wr[b + 1].d)), 1);
            for (int r = 0; r < n; r++) {
                __m512i xq = _mm512_loadu_si512((const void *)(q + r * k + b * 32));
                __m512i dot = _mm512_dpbusd_epi32(start, xq, wq);
                __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(d8 + (r * nb + b) * 8));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
            }
        }
        if (b < nb) { /* an odd last block */
            __m256i wq = _mm256_loadu_si256((const __m256i *)wr[b].qs);
            __m256i start = _mm256_sub_epi32(
                _mm256_setzero_si256(),
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm512_castsi512_si256(offset), wq));
            float dw = _cvtsh_ss(wr[b].d);
            for (int r = 0; r < n; r++) {
                __m256i xq = _mm256_loadu_si256((const __m256i *)(q + r * k + b * 32));
                __m256i dot = _mm256_dpbusd_epi32(start, xq, wq);
                __m256 scale = _mm256_set1_ps(dw * d8[(r * nb + b) * 8]);
                __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), scale);
                acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(part));
            }
        }
        for (int r = 0; r < n; r++) dst[r * dst_row + row] = _mm512_reduce_add_ps(acc[r]);
    }
}

TILE(AVX512, tile512, rows512)

/* One block of w (its magnitudes, the sign of each int8) times one of x, as floats: the
   int16 pair sums cannot saturate, x's int8 lie in [-127, 127]. */
AVX2 static inline __m256 dot256(__m256i magnitude, __m256i wq, const int8_t *xq) {
    __m256i signed_x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xq), wq);
    __m256i pairs = _mm256_maddubs_epi16(magnitude, signed_x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

AVX2 INLINE void rows256(const block_q8_0 *w, int64_t nb, int64_t k, const int n, const int8_t *q,
                         const float *d8, float *dst, size_t dst_row, int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; row++) {
        const block_q8_0 *wr = w + row * nb;
        __m256 even[ROWS], odd[ROWS]; /* two chains of fmadds per row: blocks 0, 2, .. and 1, 3, .. */
        for (int r = 0; r < n; r++) even[r] = odd[r] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            _mm_prefetch((const char *)(wr + b) + PREFETCH, _MM_HINT_T0);
            __m256i w0 = _mm256_loadu_si256((const __m256i *)wr[b].qs);
            __m256i w1 = _mm256_loadu_si256((const __m256i *)wr[b + 1].qs);
            __m256i m0 = _mm256_abs_epi8(w0), m1 = _mm256_abs_epi8(w1);
            float dw0 = _cvtsh_ss(wr[b].d), dw1 = _cvtsh_ss(wr[b + 1].d);
            for (int r = 0; r < n; r++) {
                const int8_t *xq = q + r * k + b * 32;
                const float *dx = d8 + (r * nb + b) * 8;
                even[r] = _mm256_fmadd_ps(dot256(m0, w0, xq), _mm256_set1_ps(dw0 * dx[0]), even[r]);
                odd[r] = _mm256_fmadd_ps(dot256(m1, w1, xq + 32), _mm256_set1_ps(dw1 * dx[8]), odd[r]);
            }
        }
        if (b < nb) { /* an odd last block */
            __m256i wq = _mm256_loadu_si256((const __m256i *)wr[b].qs);
            __m256i magnitude = _mm256_abs_epi8(wq);
            float dw = _cvtsh_ss(wr[b].d);
            for (int r = 0; r < n; r++) {
                __m256 scale = _mm256_set1_ps(dw * d8[(r * nb + b) * 8]);
                even[r] = _mm256_fmadd_ps(dot256(magnitude, wq, q + r * k + b * 32), scale, even[r]);
            }
        }
        for (int r = 0; r < n; r++) {
            __m256 sum = _mm256_add_ps(even[r], odd[r]);
            __m128 s = _mm_add_ps(_mm256_extractf128_ps(sum, 1), _mm256_castps256_ps128(sum));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            dst[r * dst_row + row] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        }
    }
}

TILE(AVX2, tile256, rows256)

/* The chunks of one operation's weight rows that its threads have claimed, and the threads
   that found none left: the last of those starts the count again for the operation's next run
   (ggml runs a graph's next operation, and a graph again, only once every thread is done with
   this one). One per operation (its userdata), zeroed by the caller. */
struct claims {
    int next;
    int done;
};

/* The custom operation's body (ggml_custom_op_t) for one of its nth threads: src[0] the
   weights, src[1] x, on one variant's quantizer and tiles. */
static void product(struct tensor *dst, int nth, struct claims *claims,
                    void (*quantize)(const float *, int64_t, int8_t *, float *), tile_fn *tile) {
    const struct tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t k = w->ne[0], m = w->ne[1], n = x->ne[1], nb = k / 32;
    const int chunks = (int)((m + CHUNK_ROWS - 1) / CHUNK_ROWS);
    int8_t *q = aligned_alloc(64, (size_t)((n * k + 63) / 64 * 64));
    float *d8 = aligned_alloc(64, (size_t)((n * nb * 8 * 4 + 63) / 64 * 64));
    if (q == NULL || d8 == NULL) abort(); /* as ggml does when memory runs out */
    for (int64_t r = 0; r < n; r++) {
        const float *row = (const float *)((const char *)x->data + r * x->nb[1]);
        quantize(row, k, q + r * k, d8 + r * nb * 8);
    }
    const size_t dst_row = dst->nb[1] / sizeof(float);
    const block_q8_0 *weights = w->data;
    for (int c; (c = __atomic_fetch_add(&claims->next, 1, __ATOMIC_RELAXED)) < chunks;) {
        const int64_t first = (int64_t)c * CHUNK_ROWS;
        const int64_t last = first + CHUNK_ROWS < m ? first + CHUNK_ROWS : m;
        for (int64_t r0 = first; r0 < last; r0 += TILE_ROWS) {
            int64_t r1 = r0 + TILE_ROWS < last ? r0 + TILE_ROWS : last;
            for (int64_t r = 0; r < n; r += ROWS) {
                int count = n - r < ROWS ? (int)(n - r) : ROWS;
                float *out = (float *)dst->data + r * dst_row;
                tile(weights, nb, k, count, q + r * k, d8 + r * nb * 8, out, dst_row, r0, r1);
            }
        }
    }
    if (__atomic_fetch_add(&claims->done, 1, __ATOMIC_ACQ_REL) == nth - 1) {
        __atomic_store_n(&claims->next, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&claims->done, 0, __ATOMIC_RELEASE);
    }
    free(q);
    free(d8);
}

void kz_q8_product_avx512(struct tensor *dst, int ith, int nth, void *claims) {
    (void)ith;
    product(dst, nth, claims, quantize512, tile512);
}

void kz_q8_product_avx2(struct tensor *dst, int ith, int nth, void *claims) {
    (void)ith;
    product(dst, nth, claims, quantize256, tile256);
}
