/* Q8_0 weights times float32 rows, as a ggml custom operation (see q8_product.py for why).

   dst [m, n] = w [m, k] (Q8_0: blocks of an fp16 scale and 32 int8) @ x [k, n] (float32 rows),
   the rows of x quantized to Q8_0 as ggml does. Variants of the same loops: int8 products on
   AVX512-VNNI, two blocks per 512-bit register (x offset to unsigned, as vpdpbusd takes it) and
   the int32 sums of four registers added down to eight blocks' exact sums, so that one
   conversion and one fmadd scale eight blocks, a lane each (two rows of x a register); where
   the CPU has AMX's int8 tiles, three or four rows of x take them instead, to the same numbers
   bit for bit; or on AVX2 (u8 x s8 pairs, then pairs of int16: |w| times x with w's sign), two
   blocks per 256-bit register, interleaved eight bytes at a time so that one conversion and
   one fmadd scale both. A row of dst is summed in one order whatever n is, so a sequence's
   numbers do not depend on the rows computed beside it. ggml's threads take chunks of 64
   weight rows, each from a contiguous share of its own first (`claim`, ggml_op.h), and read
   each from memory once, in tiles of 16 rows that stay in the cache while every row of x
   passes (four at a time). */

#include "ggml_op.h"

#include <cpuid.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint16_t d;
    int8_t qs[32];
} __attribute__((packed)) block_q8_0;

/* Bytes ahead in the weights that each variant prefetches, so that one core reads at the
   memory's speed. The AVX512 variant prefetches a group's five lines at once. On Intel, into
   the L2 (prefetcht1: the L2's queue of misses is longer than the L1's), 4 KB ahead: a Xeon with
   AMX (family 6 model 167) read 26.5-27.4 GB/s on two threads, as numpy's max does, where into
   the L1 2 KB ahead it read 22.4-23.0, and 14.5-15.2 on one thread against 14.8-15.5
   (`python -m kazeia_stream.engine.q8_product --mb 400`); into the L1 8 KB ahead it read 10 GB/s
   on one thread. Elsewhere into the L1, 2 KB ahead: Zen 4 read as fast into the L1 at 2 and 8 KB,
   and its prefetcht1 is reported to drop some lines (Wang et al., "The Hitchhiker's Guide to
   Programming and Optimizing CXL-Based Heterogeneous Systems", 2024). */
#define PREFETCH512_L2 4096
#define PREFETCH512_L1 2048
#define PREFETCH256 8192
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")))
#define AMX_ROWS 3 /* the fewest rows of x that AMX's tiles take (two ran no faster than AVX512) */

/* Whether this CPU has AMX's int8 tiles and Linux lets this process use them (a process asks
   for their state first). */
static int amx_granted(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* The variants this CPU runs (`vnni_level`, and 3 where AMX runs beside AVX512-VNNI). */
int kz_q8_product_level(void) {
    const int level = vnni_level();
    return level == 2 && amx_granted() ? 3 : level;
}

/* A block's scale as ggml's quantize_row_q8_0: d = max|x| / 127 (rounded through fp16, as
   ggml stores it); the values are multiplied by 127 / max|x| and rounded to the nearest (even
   on ties). Returns that multiplier. */
__attribute__((target("f16c"))) static inline float scale(float amax, float *d) {
    *d = _cvtsh_ss(_cvtss_sh(amax / 127.0f, 0));
    return amax != 0.0f ? 127.0f / amax : 0.0f;
}

/* AVX512-VNNI: groups of eight blocks, their 256 int8 + 128 in order, and their scales as the
   lanes of a group's sums come out of blocks512: blocks 0, 2, 4, 6, 1, 3, 5, 7 (`lane_of`). The
   blocks beyond the last group, their int8 after it, their scales one float each. */
static const struct layout layout512 = {8, 256, 8, NULL, NULL};

/* The lane of block b's sums in a group's (and of block b beyond the last group). */
static inline int lane_of(int64_t b) { return (int)(b & 1) * 4 + (int)(b & 7) / 2; }

AVX512 static void quantize512(const float *x, int64_t k, int8_t *q, float *d8) {
    const int64_t nb = k / 32, groups = nb / 8;
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        float d;
        __m512 id = _mm512_set1_ps(scale(amax, &d));
        d8[b < groups * 8 ? b / 8 * 8 + lane_of(b) : b] = d;
        const __m128i offset = _mm_set1_epi8((char)0x80); /* q + 128: unsigned for vpdpbusd */
        __m128i q_lo = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, id)));
        __m128i q_hi = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, id)));
        _mm_storeu_si128((__m128i *)(q + b * 32), _mm_xor_si128(q_lo, offset));
        _mm_storeu_si128((__m128i *)(q + b * 32 + 16), _mm_xor_si128(q_hi, offset));
    }
}

/* AVX2: a pair of blocks as the weights' pairs are taken (pair256): through the same unpacks,
   each 16-byte lane eight bytes of the first block and eight of the second, bytes 0-7 and
   16-23 of each in the first register, 8-15 and 24-31 in the second. The lanes of the int32
   sums come out as b0, b0, b1, b1, b0, b0, b1, b1, and the scales are laid out so. */
static const struct layout layout256 = {2, 64, 8, NULL, NULL};

/* A block of 32 floats quantized, its int8 in order; its scale in *d. */
AVX2 static inline __m256i block256(const float *x, float *d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + i * 8);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    __m256 id = _mm256_set1_ps(scale(_mm_cvtss_f32(m4), d));
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
    /* packs interleave the 128-bit lanes: the permutation puts the 32 bytes back in order */
    __m256i packed =
        _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AVX2 static void quantize256(const float *x, int64_t k, int8_t *q, float *d) {
    const int64_t nb = k / 32, pairs = (nb + 1) / 2;
    for (int64_t p = 0; p < pairs; p++) {
        float d0, d1 = 0.0f; /* an odd last block's partner: zeros */
        __m256i b0 = block256(x + p * 64, &d0);
        __m256i b1 = 2 * p + 1 < nb ? block256(x + p * 64 + 32, &d1) : _mm256_setzero_si256();
        __m256i lo = _mm256_unpacklo_epi64(b0, b1), hi = _mm256_unpackhi_epi64(b0, b1);
        __m256i *xq = (__m256i *)(q + p * 64);
        _mm256_storeu_si256(xq, lo);
        _mm256_storeu_si256(xq + 1, hi);
        _mm256_storeu_ps(d + p * 8, _mm256_setr_ps(d0, d0, d1, d1, d0, d0, d1, d1));
    }
}

/* The exact int32 sums of a group of eight weight blocks' halves (wq[i]: blocks 2 i and 2 i + 1)
   with one row of x, each dot product starting from start[i] (-128 times the sums of w's four
   int8, as x holds q + 128, unsigned for vpdpbusd): the four registers' lanes added pairwise
   twice, so that 128-bit lane h holds the first (h = 0, 2) or second (h = 1, 3) halves of blocks
   0, 2, 4, 6 (h < 2) or 1, 3, 5, 7 (h >= 2). */
AVX512 INLINE __m512i halves512(const __m512i wq[4], const __m512i start[4], const int8_t *q) {
    __m512i dot[4];
    for (int i = 0; i < 4; i++)
        dot[i] = _mm512_dpbusd_epi32(start[i], _mm512_loadu_si512((const void *)(q + 64 * i)), wq[i]);
    __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(dot[0], dot[1]), _mm512_unpackhi_epi32(dot[0], dot[1]));
    __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(dot[2], dot[3]), _mm512_unpackhi_epi32(dot[2], dot[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

/* Eight blocks' exact sums of one row of x (halves512's halves added), in the lanes of
   `lane_of`, so that a conversion, a product of the scales and an fmadd serve eight blocks (on
   Zen 4 those float operations were the kernel's limit: one product fewer per group of four
   took a fifth off four rows' time). */
AVX512 INLINE __m256i blocks512(__m512i u) {
    const __m512i first = _mm512_shuffle_i32x4(u, u, 0 | 2 << 2), second = _mm512_shuffle_i32x4(u, u, 1 | 3 << 2);
    return _mm256_add_epi32(_mm512_castsi512_si256(first), _mm512_castsi512_si256(second));
}

/* The same for two rows of x at once: the first's eight lanes, then the second's. */
AVX512 INLINE __m512i pair512(__m512i u0, __m512i u1) {
    return _mm512_add_epi32(_mm512_shuffle_i32x4(u0, u1, 0 | 2 << 2 | 0 << 4 | 2 << 6),
                            _mm512_shuffle_i32x4(u0, u1, 1 | 3 << 2 | 1 << 4 | 3 << 6));
}

/* -128 times the sums of each four int8 of w (see blocks512). */
AVX512 INLINE __m512i start512(__m512i wq) {
    const __m512i zero = _mm512_setzero_si512(), offset = _mm512_set1_epi8((char)0x80);
    return _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, offset, wq));
}

/* Two fp16 scales of every other block from `first`, of blocks first, first + 2, first + 4 and
   first + 6, in the lanes of a 64-bit integer. */
static inline uint64_t every_other(const block_q8_0 *first) {
    return (uint64_t)first[0].d | (uint64_t)first[2].d << 16 | (uint64_t)first[4].d << 32 |
           (uint64_t)first[6].d << 48;
}

/* Two rows of x share a register from the eight lanes on (`pair512`), each half as one row
   alone computes it in its own (the same operations lane by lane, and `sum256` on each half). */
AVX512 INLINE void rows512(const block_q8_0 *w, int64_t nb, size_t q_row, size_t d_row, const int n,
                           const int8_t *q, const float *d8, float *dst, size_t dst_row, int64_t r0,
                           int64_t r1, const int into_l2) {
    const int64_t groups = nb / 8;
    const int pairs = n / 2, odd = n & 1, last = n - 1;
    for (int64_t row = r0; row < r1; row++) {
        const block_q8_0 *wr = w + row * nb;
        __m512 acc2[ROWS / 2];
        __m256 acc1 = _mm256_setzero_ps();
        for (int p = 0; p < pairs; p++) acc2[p] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            const block_q8_0 *wb = wr + 8 * g;
            for (int l = 0; l < 5; l++) {
                if (into_l2) _mm_prefetch((const char *)wb + PREFETCH512_L2 + 64 * l, _MM_HINT_T1);
                else _mm_prefetch((const char *)wb + PREFETCH512_L1 + 64 * l, _MM_HINT_T0);
            }
            __m512i wq[4], start[4];
            for (int i = 0; i < 4; i++) {
                wq[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)wb[2 * i].qs)),
                                           _mm256_loadu_si256((const __m256i *)wb[2 * i + 1].qs), 1);
                start[i] = start512(wq[i]);
            }
            /* the scales as the lanes of blocks512's sums: 0, 2, 4, 6, then 1, 3, 5, 7 */
            const __m256 dw = _mm256_cvtph_ps(_mm_set_epi64x((long long)every_other(wb + 1), (long long)every_other(wb)));
            for (int p = 0; p < pairs; p++) {
                const int8_t *x0 = q + 2 * p * q_row + g * 256;
                const __m512i sums = pair512(halves512(wq, start, x0), halves512(wq, start, x0 + q_row));
                const float *dx = d8 + 2 * p * d_row + g * 8;
                const __m512 scale = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(dw), dw, 1),
                                                   _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(dx)),
                                                                      _mm256_loadu_ps(dx + d_row), 1));
                acc2[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc2[p]);
            }
            if (odd) {
                const __m256i sums = blocks512(halves512(wq, start, q + last * q_row + g * 256));
                const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(d8 + last * d_row + g * 8));
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc1);
            }
        }
        for (int64_t b = groups * 8; b < nb; b++) { /* the blocks beyond the last group: a lane each */
            __m256i wq = _mm256_loadu_si256((const __m256i *)wr[b].qs);
            __m256i start = _mm512_castsi512_si256(start512(_mm512_castsi256_si512(wq)));
            const float dw = _cvtsh_ss(wr[b].d);
            float sum[ROWS], scale[ROWS];
            for (int r = 0; r < n; r++) {
                __m256i xq = _mm256_loadu_si256((const __m256i *)(q + r * q_row + b * 32));
                __m256i dot = _mm256_dpbusd_epi32(start, xq, wq);
                sum[r] = (float)_mm512_reduce_add_epi32(_mm512_zextsi256_si512(dot));
                scale[r] = dw * d8[r * d_row + b];
            }
            const int lane = lane_of(b);
            for (int p = 0; p < pairs; p++) {
                const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(sum[2 * p]), _mm256_set1_ps(sum[2 * p + 1]), 1);
                const __m512 c = _mm512_insertf32x8(_mm512_set1_ps(scale[2 * p]), _mm256_set1_ps(scale[2 * p + 1]), 1);
                acc2[p] = _mm512_mask3_fmadd_ps(s, c, acc2[p], (__mmask16)(0x101u << lane));
            }
            if (odd)
                acc1 = _mm256_mask3_fmadd_ps(_mm256_set1_ps(sum[last]), _mm256_set1_ps(scale[last]), acc1, (__mmask8)(1u << lane));
        }
        for (int p = 0; p < pairs; p++) {
            dst[2 * p * dst_row + row] = sum256(_mm512_castps512_ps256(acc2[p]));
            dst[(2 * p + 1) * dst_row + row] = sum256(_mm512_extractf32x8_ps(acc2[p], 1));
        }
        if (odd) dst[last * dst_row + row] = sum256(acc1);
    }
}

/* Prefetching into the L2 (Intel) or the L1 (elsewhere): see PREFETCH512_L2. */
TILE(AVX512, tile512_l2, rows512, 1)
TILE(AVX512, tile512_l1, rows512, 0)

/* The AVX512 variant's tile for this CPU's vendor. */
static tile_fn *tile512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") ? tile512_l2 : tile512_l1;
}

/* AMX: x quantized as for AVX512 (layout512), and for each set of rows of x that pass a tile
   together, every block as AMX's B tile takes it (`pack_amx`): its 32 int8 signed, four bytes of
   each row in turn (8 x 16 bytes), then the rows' scales (4 floats); rows beyond n zero. */
static size_t packed_bytes_amx(int64_t nb) { return (size_t)nb * (128 + 4 * sizeof(float)); }

static void pack_amx(const int8_t *q, const float *d, size_t q_row, size_t d_row, int n, int64_t nb, void *packed) {
    if (n < AMX_ROWS) return; /* a set of a stack's rows that AVX512's loops take (tile_amx) */
    int8_t *xi = packed;
    float *xd = (float *)(xi + nb * 128);
    memset(packed, 0, packed_bytes_amx(nb));
    const int64_t groups = nb / 8;
    for (int r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++) {
            xd[b * 4 + r] = d[r * d_row + (b < groups * 8 ? b / 8 * 8 + lane_of(b) : b)];
            for (int j = 0; j < 8; j++) {
                uint32_t four;
                memcpy(&four, q + r * q_row + b * 32 + 4 * j, sizeof four);
                four ^= 0x80808080u; /* q + 128 back to q */
                memcpy(xi + b * 128 + j * 16 + r * 4, &four, sizeof four);
            }
        }
}

static const struct layout layout_amx = {8, 256, 8, packed_bytes_amx, pack_amx};

/* The tiles (for one operation on a thread): A the weights in place, 16 rows of a block's 32
   int8, a row's bytes apart; B a packed block of x; C 16 x 4 int32 (a weight row's sums with
   four rows of x); two of each, two blocks at a time. */
AMX static void configure_amx(void) {
    struct {
        uint8_t palette, start, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int t = 0; t < 2; t++) {
        config.colsb[t] = 32, config.rows[t] = 16;
        config.colsb[2 + t] = 16, config.rows[2 + t] = 8;
        config.colsb[4 + t] = 16, config.rows[4 + t] = 16;
    }
    _tile_loadconfig(&config);
}

#define LANES16 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)

/* Block b's int32 sums (c: a weight row, then its four rows of x) converted, times the product
   of both scales, added into the lanes of rows512's accumulators that block b takes (`lane_of`),
   as rows512 adds them: each of the 64 a lane here, one accumulator row a block's lane. */
AMX INLINE void add_block(float lanes[8][64], const int32_t c[64], const char *first, __m512i at, int64_t b,
                          const float *xd) {
    const __m512i spread = _mm512_srli_epi32(LANES16, 2); /* lane 4 i + r: weight row i */
    const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(at, first + b * sizeof(block_q8_0), 1)));
    const __m512 dx = _mm512_broadcast_f32x4(_mm_loadu_ps(xd + b * 4));
    float *acc = lanes[lane_of(b)];
    for (int j = 0; j < 4; j++) {
        const __m512 dw4 = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * j), spread), dw);
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * j)));
        _mm512_store_ps(acc + 16 * j, _mm512_fmadd_ps(sum, _mm512_mul_ps(dw4, dx), _mm512_load_ps(acc + 16 * j)));
    }
}

/* 16 weight rows from r0 times n rows of x (AMX_ROWS <= n <= ROWS) on AMX's tiles (configure_amx):
   rows512's numbers, its lanes' sums in the same order, then added as sum256 adds them.
   Prefetches the tile after this one as this one is read. */
AMX INLINE void tiles16(const block_q8_0 *w, int64_t nb, int n, const void *packed, float *dst, size_t dst_row,
                        int64_t r0) {
    const size_t row_bytes = (size_t)nb * sizeof(block_q8_0), per_block = 16 * sizeof(block_q8_0);
    const char *first = (const char *)(w + r0 * nb), *next = first + 16 * row_bytes;
    const int8_t *xi = packed;
    const float *xd = (const float *)(xi + nb * 128);
    const __m512i at = _mm512_mullo_epi32(LANES16, _mm512_set1_epi32((int)row_bytes));
    float lanes[8][64] __attribute__((aligned(64)));
    int32_t c[2][64] __attribute__((aligned(64)));
    memset(lanes, 0, sizeof lanes);
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb; /* not beside an odd last block */
        for (size_t l = 0; l < 2 * per_block; l += 64) _mm_prefetch(next + b * per_block + l, _MM_HINT_T1);
        const char *wb = first + b * sizeof(block_q8_0) + 2;
        _tile_loadd(0, wb, row_bytes);
        _tile_loadd(2, xi + b * 128, 16);
        _tile_zero(4);
        _tile_dpbssd(4, 0, 2);
        if (two) {
            _tile_loadd(1, wb + sizeof(block_q8_0), row_bytes);
            _tile_loadd(3, xi + b * 128 + 128, 16);
            _tile_zero(5);
            _tile_dpbssd(5, 1, 3);
        }
        _tile_stored(4, c[0], 16);
        if (two) _tile_stored(5, c[1], 16);
        for (int e = 0; e <= two; e++) add_block(lanes, c[e], first, at, b + e, xd);
    }
    float out[64] __attribute__((aligned(64)));
    for (int j = 0; j < 4; j++) {
        __m512 t[4];
        for (int l = 0; l < 4; l++)
            t[l] = _mm512_add_ps(_mm512_load_ps(lanes[4 + l] + 16 * j), _mm512_load_ps(lanes[l] + 16 * j));
        _mm512_store_ps(out + 16 * j, _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3])));
    }
    for (int i = 0; i < 16; i++)
        for (int r = 0; r < n; r++) dst[r * dst_row + r0 + i] = out[4 * i + r];
}

/* Full tiles of AMX_ROWS rows of x or more on AMX's, the rest as the AVX512 variant runs them. */
AMX static void tile_amx(const void *w, int64_t nb, size_t q_row, size_t d_row, int n, const int8_t *q,
                         const float *d, float *dst, size_t dst_row, int64_t r0, int64_t r1, const void *packed) {
    if (n >= AMX_ROWS && r1 - r0 == TILE_ROWS) tiles16(w, nb, n, packed, dst, dst_row, r0);
    else tile512_l2(w, nb, q_row, d_row, n, q, d, dst, dst_row, r0, r1, NULL);
}

/* A pair of weight blocks (w1 and d1 zero beside an odd last block) times each row of x: the
   blocks interleaved as quantize256 lays x out, their magnitudes taken once for every row, each
   row signed by the weights and times those, and the int32 sums of both blocks converted and
   scaled at once. The int16 pair sums cannot saturate: x's int8 lie in [-127, 127] and |w| in
   [0, 128]. On Zen 3 (one thread, four rows, `tools/q8_in_cache.c`'s loop) from memory 0.81-0.84
   ns per 32 multiply-adds against 0.90-0.95 with x's magnitudes loaded from a copy beside x
   and the weights signed by x, and 0.85-0.99 with those magnitudes taken in every row. */
AVX2 INLINE void pair256(__m256i w0, __m256i w1, uint64_t d0, uint64_t d1, const int n,
                         const int8_t *q, size_t q_row, const float *d, size_t d_row, __m256 *acc) {
    const __m256i lo = _mm256_unpacklo_epi64(w0, w1), hi = _mm256_unpackhi_epi64(w0, w1);
    const __m128i d4 = _mm_set1_epi64x((long long)(d0 | d0 << 16 | d1 << 32 | d1 << 48));
    const __m256 dw = _mm256_cvtph_ps(d4);
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
    for (int r = 0; r < n; r++) {
        const __m256i *xq = (const __m256i *)(q + r * q_row);
        __m256i plo = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(_mm256_loadu_si256(xq), lo));
        __m256i phi = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(_mm256_loadu_si256(xq + 1), hi));
        __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones));
        __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(d + r * d_row));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
    }
}

AVX2 INLINE void rows256(const block_q8_0 *w, int64_t nb, size_t q_row, size_t d_row, const int n,
                         const int8_t *q, const float *d, float *dst, size_t dst_row, int64_t r0,
                         int64_t r1) {
    for (int64_t row = r0; row < r1; row++) {
        const block_q8_0 *wr = w + row * nb;
        __m256 acc[ROWS];
        for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            _mm_prefetch((const char *)(wr + b) + PREFETCH256, _MM_HINT_T0);
            pair256(_mm256_loadu_si256((const __m256i *)wr[b].qs),
                    _mm256_loadu_si256((const __m256i *)wr[b + 1].qs), wr[b].d, wr[b + 1].d, n,
                    q + b * 32, q_row, d + b * 4, d_row, acc);
        }
        if (b < nb) /* an odd last block */
            pair256(_mm256_loadu_si256((const __m256i *)wr[b].qs), _mm256_setzero_si256(),
                    wr[b].d, 0, n, q + b * 32, q_row, d + b * 4, d_row, acc);
        for (int r = 0; r < n; r++) dst[r * dst_row + row] = sum256(acc[r]);
    }
}

TILE(AVX2, tile256, rows256)

/* The bytes of `struct claims`, which the caller allocates (ggml_graph.py's `_Claims`). */
size_t kz_q8_product_claims_size(void) { return sizeof(struct claims); }

/* AMX's tiles are configured for an operation of AMX_ROWS rows of x or more on each of its
   threads, and released after it: a thread holding them has Linux save 8 KB more at each of its
   switches. Fewer rows (a stream alone) take AVX512's loops, x packed for no tile. */
AMX void kz_q8_product_amx(struct tensor *dst, int ith, int nth, void *claims) {
    if (dst->src[1]->ne[1] < AMX_ROWS) {
        product(dst, ith, nth, claims, 32, quantize512, &layout512, tile512_l2);
        return;
    }
    configure_amx();
    product(dst, ith, nth, claims, 32, quantize512, &layout_amx, tile_amx);
    _tile_release();
}

void kz_q8_product_avx512(struct tensor *dst, int ith, int nth, void *claims) {
    product(dst, ith, nth, claims, 32, quantize512, &layout512, tile512());
}

void kz_q8_product_avx2(struct tensor *dst, int ith, int nth, void *claims) {
    product(dst, ith, nth, claims, 32, quantize256, &layout256, tile256);
}
