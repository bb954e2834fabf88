/* Q4_K, Q5_K and Q6_K weights times float32 rows, as ggml custom operations (see
   kquant_product.py for why). Q4_K first:

   dst [m, n] = w [m, k] (Q4_K: super-blocks of 256, an fp16 scale and min, eight 6-bit scales
   and mins of 32 values each, 4-bit values) @ x [k, n] (float32 rows), the rows of x quantized
   as ggml's Q8_K (per 256: int8, the signed largest to -127), so each block's product is
   d_x d_w sum_j sc_j (w_j . x_j) - d_x dmin_w sum_j m_j sum(x_j) in integers but for the two
   scales. AVX2: a register of 32 bytes of values gives the 4-bit values of two sub-blocks (low
   and high nibbles), each multiplied with x's int8 (u8 x s8 pairs, int16) and summed in pairs
   by its sub-block's scale (int16 x int16, int32), so that one conversion and one fmadd scale a
   block. A row of dst is summed in one order whatever n is (a sequence's numbers do not depend
   on the rows beside it), within float rounding of ggml's. Threads claim chunks of weight
   rows and pass x's rows over tiles of them as q8_product.c's do (ggml_op.h). */

#include <stddef.h>
#include <string.h>

#include "ggml_op.h"

#define QK_K 256

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[QK_K / 2];
} block_q4_K;

/* Bytes ahead in the weights: on an Intel Xeon with AMX (family 6 model 167), one thread, one
   row, 2 KB read 12-14.5 GB/s on every variant where 8 KB read 9-12.7 (numpy 14; `python -m
   kazeia_stream.engine.kquant_product --type q4_k --mb 400`, and q6_k). Into the L2
   (prefetcht1), which the Q8_0 kernel's AVX512 variant takes, read slower here: q4_k 4 KB
   ahead 22.2-22.4 GB/s on two threads and 12.0-12.1 on one against 23.3-23.6 and 13.5-13.8,
   2 KB ahead 22.6-23.3 and 12.9-13.4 against 23.6-24.5 and 13.7-14.0. */
#define PREFETCH 2048
#define AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* The variant this CPU runs (`vnni_level`). */
int kz_kquant_product_level(void) { return vnni_level(); }

/* ggml's nearest_int: to the nearest, ties to even, for |v| < 2^22. */
static inline int nearest(float v) {
    float f = v + 12582912.0f;
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* A block of 256 floats as int8 (ggml's quantize_row_q8_K_ref: the signed largest to -127);
   its scale. */
static float q8k_block(const float *x, int8_t *qs) {
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < QK_K; j++) {
        const float ax = x[j] < 0 ? -x[j] : x[j];
        if (ax > amax) {
            amax = ax;
            max = x[j];
        }
    }
    if (amax == 0.0f) {
        memset(qs, 0, QK_K);
        return 0.0f;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < QK_K; j++) {
        const int v = nearest(iscale * x[j]);
        qs[j] = (int8_t)(v < 127 ? v : 127);
    }
    return 1.0f / iscale;
}

/* A row of x per block of 256 for n-value groups: its int8, then the int16 sums of its groups
   (QK_K / n of them); its scale in d. */
static void quantize_q8k(const float *x, int64_t k, int8_t *q, float *d, int n) {
    const int64_t stride = QK_K + 2 * QK_K / n;
    for (int64_t b = 0; b < k / QK_K; b++) {
        int8_t *qs = q + b * stride;
        int16_t sums[QK_K / 16] = {0};
        d[b] = q8k_block(x + b * QK_K, qs);
        for (int j = 0; j < QK_K; j++) sums[j / n] += qs[j];
        memcpy(qs + QK_K, sums, 2 * QK_K / n);
    }
}

/* Q4_K's x: the sums of its eight sub-blocks of 32. */
static const struct layout layout_q4k = {1, QK_K + 16, 1, NULL, NULL};

static void quantize_q4k(const float *x, int64_t k, int8_t *q, float *d) { quantize_q8k(x, k, q, d, 32); }

/* Q6_K's x: the sums of its sixteen groups of 16 (ggml's bsums). */
static const struct layout layout_q6k = {1, QK_K + 32, 1, NULL, NULL};

static void quantize_q6k(const float *x, int64_t k, int8_t *q, float *d) { quantize_q8k(x, k, q, d, 16); }

/* x's int8 of a block from `from` into `to`, sub-blocks in the order rows512 reads them. */
static void reorder512(const int8_t *from, int8_t *to) {
    static const int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    for (int i = 0; i < 8; i++) memcpy(to + 32 * i, from + 32 * order[i], 32);
}

/* quantize_q4k, each block's int8 in rows512's order. */
static void quantize_q4k512(const float *x, int64_t k, int8_t *q, float *d) {
    quantize_q4k(x, k, q, d);
    for (int64_t b = 0; b < k / QK_K; b++) {
        int8_t block[QK_K];
        memcpy(block, q + b * (QK_K + 16), QK_K);
        reorder512(block, q + b * (QK_K + 16));
    }
}

/* A block's eight 6-bit scales (bytes 0-7) and mins (8-15) from its 12 packed bytes (and the
   4 after them, unused): scale j < 4 is byte j's low 6 bits, min j < 4 byte j + 4's; scale
   j >= 4 is byte j + 4's low 4 bits with byte j - 4's top 2 above them, min j >= 4 byte j + 4's
   high 4 bits with byte j's top 2 (ggml's get_scale_min_k4). */
AVX2 INLINE __m128i scales_mins(const uint8_t *packed) {
    const __m128i v = _mm_loadu_si128((const __m128i *)packed);
    const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i masks = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    const __m128i nibbles = _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi8(15)); /* for mins 4-7 */
    const __m128i bits = _mm_blend_epi32(_mm_and_si128(low, masks), nibbles, 8);
    const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
    return _mm_or_si128(bits, _mm_srli_epi16(_mm_and_si128(top, _mm_set1_epi8((char)0xc0)), 2));
}

/* Q5_K: Q4_K's header, then the values' fifth bits (32 bytes: bit 2 j of byte l is value l of
   sub-block 2 j's, bit 2 j + 1 value l of 2 j + 1's), then their low 4 bits as Q4_K's. */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;

/* AVX2, Q4_K (`five` 0) or Q5_K (1): blocks of `size` bytes, Q4_K's header first, the 4-bit
   values at `qs`, Q5_K's fifth bits at `qh`. Each 64 values' two sub-blocks pass every row of x
   before the next 64 are unpacked: only their values and scales stay in registers beside the
   rows' sums. Those of the whole block, held at once, spilled from the 16 registers: Zen 3,
   weights in the cache, one row 1.11-1.19 ns a block of 32 against 1.17-1.30, four rows
   0.69-0.72 against 0.81-0.85 a block and row (Q6_K likewise: 1.13-1.17 against 1.32-1.36,
   0.65-0.68 against 0.76-0.78; a throw-away loop over 128 rows of 2048). */
AVX2 INLINE void rows_k(const uint8_t *w, const size_t size, const size_t qs, const size_t qh, const int five,
                        int64_t nb, size_t q_row, size_t d_row, const int n, const int8_t *q, const float *d,
                        float *dst, size_t dst_row, int64_t r0, int64_t r1) {
    const __m256i low = _mm256_set1_epi8(0x0f), bit = _mm256_set1_epi8(0x01);
    for (int64_t row = r0; row < r1; row++) {
        const uint8_t *wr = w + row * nb * size;
        __m256 acc[ROWS];
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const block_q4_K *blk = (const block_q4_K *)(wr + b * size); /* the header */
            for (size_t l = 0; l < size; l += 64) _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
            const __m256i both = _mm256_cvtepu8_epi16(scales_mins(blk->scales)); /* int16 */
            const __m128i mins = _mm256_extracti128_si256(both, 1);
            const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(both));
            const __m256i fifth = five ? _mm256_loadu_si256((const __m256i *)((const uint8_t *)blk + qh))
                                       : _mm256_setzero_si256();
            __m256i sums[ROWS];
            for (int r = 0; r < n; r++) sums[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint8_t *)blk + qs + 32 * j));
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (five) {
                    const __m256i b0 = _mm256_and_si256(_mm256_srli_epi16(fifth, 2 * j), bit);
                    const __m256i b1 = _mm256_and_si256(_mm256_srli_epi16(fifth, 2 * j + 1), bit);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
                }
                /* scales 2 j and 2 j + 1 in every int16 lane */
                const __m256i s0 = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(4 * j | (4 * j + 1) << 8)));
                const __m256i s1 = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)((4 * j + 2) | (4 * j + 3) << 8)));
                for (int r = 0; r < n; r++) {
                    const int8_t *xq = q + r * q_row + b * (QK_K + 16) + 64 * j;
                    const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq));
                    const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32)));
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_add_epi32(_mm256_madd_epi16(pl, s0), _mm256_madd_epi16(ph, s1)));
                }
            }
            const float dw = _cvtsh_ss(blk->d), mw = _cvtsh_ss(blk->dmin);
            for (int r = 0; r < n; r++) {
                const __m128i xsums = _mm_loadu_si128((const __m128i *)(q + r * q_row + b * (QK_K + 16) + QK_K));
                const __m256i msums = _mm256_zextsi128_si256(_mm_madd_epi16(mins, xsums));
                const float dx = d[r * d_row + b];
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_set1_ps(dx * dw), acc[r]);
                acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msums), _mm256_set1_ps(dx * mw), acc[r]);
            }
        }
        for (int r = 0; r < n; r++) dst[r * dst_row + row] = sum256(acc[r]);
    }
}

AVX2 INLINE void rows256(const void *w, int64_t nb, size_t q_row, size_t d_row, const int n, const int8_t *q,
                         const float *d, float *dst, size_t dst_row, int64_t r0, int64_t r1) {
    rows_k(w, sizeof(block_q4_K), offsetof(block_q4_K, qs), 0, 0, nb, q_row, d_row, n, q, d, dst, dst_row, r0, r1);
}

AVX2 INLINE void rows_q5k(const void *w, int64_t nb, size_t q_row, size_t d_row, const int n, const int8_t *q,
                          const float *d, float *dst, size_t dst_row, int64_t r0, int64_t r1) {
    rows_k(w, sizeof(block_q5_K), offsetof(block_q5_K, qs), offsetof(block_q5_K, qh), 1, nb, q_row, d_row, n, q, d,
           dst, dst_row, r0, r1);
}

TILE(AVX2, tile256, rows256)
TILE(AVX2, tile_q5k256, rows_q5k)
TILE(AVX512, tile_q5k512, rows_q5k)

/* AVX512-VNNI: x's sub-blocks laid out 0, 2, 1, 3, 4, 6, 5, 7 (quantize_q4k512), so that the
   low nibbles of 64 bytes of values (sub-blocks 4 h and 4 h + 2) and their high nibbles (4 h + 1
   and 4 h + 3) each meet 64 contiguous int8 of x; u8 x s8 pairs (int16), then pairs of those
   times their sub-block's scale added into the block's int32 sums (vpdpwssd). */
AVX512 INLINE void rows512(const block_q4_K *w, int64_t nb, size_t q_row, size_t d_row, const int n,
                           const int8_t *q, const float *d, float *dst, size_t dst_row, int64_t r0,
                           int64_t r1) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i pick[4]; /* byte shuffles: scale a in the int16 lanes of 128-bit lanes 0-1, b in 2-3 */
    static const int order[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
    for (int i = 0; i < 4; i++) {
        const __m256i pa = _mm256_set1_epi16((short)(order[i][0] | 0x8000));
        const __m256i pb = _mm256_set1_epi16((short)(order[i][1] | 0x8000));
        pick[i] = _mm512_inserti64x4(_mm512_castsi256_si512(pa), pb, 1);
    }
    const __m128i widen_mins = _mm_setr_epi8(8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1);
    for (int64_t row = r0; row < r1; row++) {
        const block_q4_K *wr = w + row * nb;
        __m512 acc[ROWS];
        __m256 accm[ROWS];
        for (int r = 0; r < n; r++) {
            acc[r] = _mm512_setzero_ps();
            accm[r] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const block_q4_K *blk = wr + b;
            _mm_prefetch((const char *)blk + PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)blk + PREFETCH + 128, _MM_HINT_T0);
            const __m128i bytes = scales_mins(blk->scales);
            const __m128i mins = _mm_shuffle_epi8(bytes, widen_mins); /* int16 */
            const __m512i scales = _mm512_broadcast_i32x4(bytes);
            __m512i sc[4], v[4];
            for (int i = 0; i < 4; i++) sc[i] = _mm512_shuffle_epi8(scales, pick[i]);
            for (int h = 0; h < 2; h++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(blk->qs + 64 * h));
                v[2 * h] = _mm512_and_si512(raw, low);
                v[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
            const float dw = _cvtsh_ss(blk->d), mw = _cvtsh_ss(blk->dmin);
            for (int r = 0; r < n; r++) {
                const int8_t *xq = q + r * q_row + b * (QK_K + 16);
                __m512i sums = _mm512_setzero_si512();
                for (int i = 0; i < 4; i++) {
                    const __m512i p = _mm512_maddubs_epi16(v[i], _mm512_loadu_si512((const void *)(xq + 64 * i)));
                    sums = _mm512_dpwssd_epi32(sums, p, sc[i]);
                }
                const __m128i xsums = _mm_loadu_si128((const __m128i *)(xq + QK_K));
                const __m256i msums = _mm256_zextsi128_si256(_mm_madd_epi16(mins, xsums));
                const float dx = d[r * d_row + b];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(dx * dw), acc[r]);
                accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msums), _mm256_set1_ps(dx * mw), accm[r]);
            }
        }
        for (int r = 0; r < n; r++)
            dst[r * dst_row + row] = _mm512_reduce_add_ps(acc[r]) - sum256(accm[r]);
    }
}

TILE(AVX512, tile512, rows512)

/* Q6_K: per 256 values, their low 4 bits (128 bytes: values 0-31 and 64-95 of each half in
   the low and high nibbles of its first 32 bytes, 32-63 and 96-127 of its next 32), their high
   2 bits (64 bytes: four values a byte, one of each quarter of a half), sixteen int8 scales of
   16 values and an fp16 scale; a value is those 6 bits less 32. */
typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_K;

/* AVX2: the 6-bit values, unsigned (0-63), of 32 values a register, times x's int8 (u8 x s8
   pairs, int16), then pairs of those by their group's scale (int32); the 32 the unsigned
   values carry taken off once a block, from x's group sums times the scales. A block's sum is
   an integer but for its two scales, as ggml's. Each 32 values pass every row of x before the
   next are unpacked (as rows_k's). */
AVX2 INLINE void rows_q6k(const block_q6_K *w, int64_t nb, size_t q_row, size_t d_row, const int n,
                          const int8_t *q, const float *d, float *dst, size_t dst_row, int64_t r0,
                          int64_t r1) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
    __m256i pick[4]; /* byte shuffles: scale 2 i in the int16 lanes of 128-bit lane 0, 2 i + 1 in lane 1 */
    for (int i = 0; i < 4; i++)
        pick[i] = _mm256_setr_epi8(4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1,
                                   4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1, 4 * i, 4 * i + 1,
                                   4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2,
                                   4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3, 4 * i + 2, 4 * i + 3,
                                   4 * i + 2, 4 * i + 3);
    for (int64_t row = r0; row < r1; row++) {
        const block_q6_K *wr = w + row * nb;
        __m256 acc[ROWS];
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const block_q6_K *blk = wr + b;
            for (int l = 0; l < 4; l++) _mm_prefetch((const char *)blk + PREFETCH + 64 * l, _MM_HINT_T0);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
            __m256i sums[ROWS];
            for (int r = 0; r < n; r++) sums[r] = _mm256_setzero_si256();
            for (int h = 0; h < 2; h++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * h));
                const __m256i lows[4] = {ql0, ql1, _mm256_srli_epi16(ql0, 4), _mm256_srli_epi16(ql1, 4)};
                const __m256i half = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                       : _mm256_permute2x128_si256(sc16, sc16, 0x00);
                for (int i = 0; i < 4; i++) { /* 32 values, passing every row of x */
                    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), low2);
                    const __m256i u = _mm256_or_si256(_mm256_and_si256(lows[i], low4), _mm256_slli_epi16(high, 4));
                    const __m256i sc = _mm256_shuffle_epi8(half, pick[i]);
                    for (int r = 0; r < n; r++) {
                        const int8_t *xq = q + r * q_row + b * (QK_K + 32) + 32 * (4 * h + i);
                        const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)xq));
                        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(p, sc));
                    }
                }
            }
            const float dw = _cvtsh_ss(blk->d);
            for (int r = 0; r < n; r++) {
                const __m256i groups = _mm256_loadu_si256((const __m256i *)(q + r * q_row + b * (QK_K + 32) + QK_K));
                const __m256i total = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(_mm256_madd_epi16(sc16, groups), 5));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d[r * d_row + b] * dw), acc[r]);
            }
        }
        for (int r = 0; r < n; r++) dst[r * dst_row + row] = sum256(acc[r]);
    }
}

TILE(AVX2, tile_q6k256, rows_q6k)
TILE(AVX512, tile_q6k512, rows_q6k)

/* The custom operation kz_kquant_product_{type}_{variant} (ggml_custom_op_t): `product` on
   x quantized by `quantize` into `layout` and weight rows multiplied by `tile`. */
#define OPERATION(type, variant, quantize, layout, tile)                                           \
    void kz_kquant_product_##type##_##variant(struct tensor *dst, int ith, int nth, void *claims) { \
        product(dst, ith, nth, claims, QK_K, quantize, &layout, tile);                            \
    }

OPERATION(q4k, avx512, quantize_q4k512, layout_q4k, tile512)
OPERATION(q4k, avx2, quantize_q4k, layout_q4k, tile256)
/* The AVX512 variants of Q5_K and Q6_K are their AVX2 loops built for AVX-512 (the same numbers). */
OPERATION(q5k, avx512, quantize_q4k, layout_q4k, tile_q5k512)
OPERATION(q5k, avx2, quantize_q4k, layout_q4k, tile_q5k256)
OPERATION(q6k, avx512, quantize_q6k, layout_q6k, tile_q6k512)
OPERATION(q6k, avx2, quantize_q6k, layout_q6k, tile_q6k256)
