/* SnakeBeta, y = x + beta * sin(alpha * x)^2 per row (a channel) of x [rows, cols], in one pass
   over x (numpy takes five, and its sin is a third of the cost; see codec.py's SnakeBeta).

   sin^2 t: t = j pi/2 + r with |r| <= pi/4, r reduced with pi/2 in three parts (Cody and Waite;
   the first two have short mantissas, so j times them is exact for |t| up to REDUCED_MAX), then
   sin^2 r for an even j and cos^2 r = 1 - sin^2 r (at least 1/2: no cancellation) for an odd
   one, by the minimax polynomial of Cephes' sinf (errors of a unit in the last place; with its
   cosf's for cos r, an element took 1.9-2.1 instead of 1.6-1.8 ns on a Zen 1). Beyond
   REDUCED_MAX (activations never get there; random weights might) an element takes libm's
   sinf. Two variants of the same steps: AVX-512, 16 floats a register, and AVX2 with FMA, 8, four
   registers at a time (`WIDE`). */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define AVX512 __attribute__((target("avx512f,avx512dq")))
#define AVX2 __attribute__((target("avx2,fma")))
#define REDUCED_MAX 8192.0f
/* Registers in flight in the AVX2 loop (see SIN2): on Zen 1, 1.08 against 1.56 ns an element
   one at a time (96 x 1920, the same bits). */
#define WIDE 4

#define TWO_OVER_PI 0.636619772367581f
#define PIO2_1 1.5703125f
#define PIO2_2 4.837512969970703125e-4f
#define PIO2_3 7.54978995489188216e-8f
#define S1 -1.6666654611e-1f
#define S2 8.3321608736e-3f
#define S3 -1.9515295891e-4f

/* The variant this CPU runs: 2 AVX-512, 1 AVX2 with FMA, 0 neither. */
int kz_snake_level(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

/* y for the elements set in `beyond` (beyond the reduction's range) of x, by libm's sin; each
   x is read before its y is written (y may be x). */
static void far(const float *x, float *y, unsigned beyond, float alpha, float beta) {
    for (int l = 0; beyond; l++, beyond >>= 1) {
        if (beyond & 1) {
            float s = sinf(x[l] * alpha);
            y[l] = fmaf(beta, s * s, x[l]);
        }
    }
}

/* sin^2 t in place for the n registers t[0..n) at one width: P the intrinsics' prefix (_mm512,
   _mm256), V the register type; ROUND (to the nearest integer) and PICK (s where j is even, c
   where odd) are the width's own instructions. Each step runs on every register before the
   next: a register's steps depend on each other (about 55 cycles on Zen 1), and several in
   flight keep the units busy. One body for both variants, so that they give the same bits. */
#define SIN2(NAME, P, V, ROUND, PICK)                                                      \
    static inline __attribute__((always_inline)) void NAME(V *t, const int n) {            \
        V j[WIDE], r[WIDE], z[WIDE];                                                       \
        for (int u = 0; u < n; u++) {                                                      \
            j[u] = ROUND(P##_mul_ps(t[u], P##_set1_ps(TWO_OVER_PI)));                      \
            r[u] = P##_fnmadd_ps(j[u], P##_set1_ps(PIO2_1), t[u]);                         \
        }                                                                                  \
        for (int u = 0; u < n; u++) r[u] = P##_fnmadd_ps(j[u], P##_set1_ps(PIO2_2), r[u]); \
        for (int u = 0; u < n; u++) r[u] = P##_fnmadd_ps(j[u], P##_set1_ps(PIO2_3), r[u]); \
        for (int u = 0; u < n; u++) z[u] = P##_mul_ps(r[u], r[u]);                         \
        for (int u = 0; u < n; u++) {                                                      \
            V ps = P##_fmadd_ps(P##_fmadd_ps(P##_set1_ps(S3), z[u], P##_set1_ps(S2)), z[u], \
                                P##_set1_ps(S1));                                          \
            t[u] = P##_fmadd_ps(P##_mul_ps(r[u], z[u]), ps, r[u]);                         \
        }                                                                                  \
        for (int u = 0; u < n; u++) {                                                      \
            V s2 = P##_mul_ps(t[u], t[u]);                                                 \
            t[u] = PICK(j[u], s2, P##_sub_ps(P##_set1_ps(1.0f), s2));                      \
        }                                                                                  \
    }

AVX512 static inline __m512 round512(__m512 x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

AVX512 static inline __m512 pick512(__m512 j, __m512 s, __m512 c) {
    __mmask16 odd = _mm512_test_epi32_mask(_mm512_cvtps_epi32(j), _mm512_set1_epi32(1));
    return _mm512_mask_blend_ps(odd, s, c);
}

AVX2 static inline __m256 round256(__m256 x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

AVX2 static inline __m256 pick256(__m256 j, __m256 s, __m256 c) {
    __m256i odd = _mm256_slli_epi32(_mm256_cvtps_epi32(j), 31); /* the sign bit: blendv's mask */
    return _mm256_blendv_ps(s, c, _mm256_castsi256_ps(odd));
}

AVX512 SIN2(sin2_512, _mm512, __m512, round512, pick512)
AVX2 SIN2(sin2_256, _mm256, __m256, round256, pick256)

/* y may be x (in place): an element's x is read before its y is written (by `far` too: the
   store leaves those elements alone). */
AVX512 void kz_snake_avx512(const float *x, int64_t rows, int64_t cols, int64_t ldx,
                            const float *alpha, const float *beta, float *y, int64_t ldy) {
    for (int64_t i = 0; i < rows; i++) {
        const float *xr = x + i * ldx;
        float *yr = y + i * ldy;
        __m512 a = _mm512_set1_ps(alpha[i]), b = _mm512_set1_ps(beta[i]);
        for (int64_t c = 0; c < cols; c += 16) {
            __mmask16 m = cols - c >= 16 ? 0xFFFF : (__mmask16)((1u << (cols - c)) - 1);
            __m512 xv = _mm512_maskz_loadu_ps(m, xr + c), t = _mm512_mul_ps(xv, a), sin2 = t;
            sin2_512(&sin2, 1);
            __m512 out = _mm512_fmadd_ps(b, sin2, xv);
            __mmask16 beyond = _mm512_mask_cmp_ps_mask(
                m, _mm512_abs_ps(t), _mm512_set1_ps(REDUCED_MAX), _CMP_GT_OQ);
            _mm512_mask_storeu_ps(yr + c, m & ~beyond, out);
            if (beyond) far(xr + c, yr + c, beyond, alpha[i], beta[i]);
        }
    }
}

AVX2 void kz_snake_avx2(const float *x, int64_t rows, int64_t cols, int64_t ldx,
                        const float *alpha, const float *beta, float *y, int64_t ldy) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t i = 0; i < rows; i++) {
        const float *xr = x + i * ldx;
        float *yr = y + i * ldy;
        __m256 a = _mm256_set1_ps(alpha[i]), b = _mm256_set1_ps(beta[i]);
        int64_t c = 0;
        for (; c + 8 * WIDE <= cols; c += 8 * WIDE) { /* WIDE whole registers at a time */
            __m256 xv[WIDE], t[WIDE], over = _mm256_setzero_ps();
            for (int u = 0; u < WIDE; u++) {
                t[u] = _mm256_mul_ps(xv[u] = _mm256_loadu_ps(xr + c + 8 * u), a);
                __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t[u]);
                over = _mm256_or_ps(over, _mm256_cmp_ps(abs, _mm256_set1_ps(REDUCED_MAX), _CMP_GT_OQ));
            }
            if (_mm256_movemask_ps(over)) break; /* the rest of the row a register at a time */
            sin2_256(t, WIDE);
            for (int u = 0; u < WIDE; u++) _mm256_storeu_ps(yr + c + 8 * u, _mm256_fmadd_ps(b, t[u], xv[u]));
        }
        for (; c < cols; c += 8) {
            /* masked moves for a row's last few only: they are slow on some AVX2 CPUs */
            int whole = cols - c >= 8;
            __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(cols - c)), lanes);
            __m256 xv = whole ? _mm256_loadu_ps(xr + c) : _mm256_maskload_ps(xr + c, m);
            __m256 t = _mm256_mul_ps(xv, a), sin2 = t;
            sin2_256(&sin2, 1);
            __m256 out = _mm256_fmadd_ps(b, sin2, xv);
            __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), t);
            __m256 over = _mm256_cmp_ps(abs, _mm256_set1_ps(REDUCED_MAX), _CMP_GT_OQ);
            int beyond = _mm256_movemask_ps(_mm256_and_ps(over, _mm256_castsi256_ps(m)));
            if (beyond) { /* those elements are x's until `far` reads them */
                _mm256_maskstore_ps(yr + c, _mm256_andnot_si256(_mm256_castps_si256(over), m), out);
                far(xr + c, yr + c, (unsigned)beyond, alpha[i], beta[i]);
            } else if (whole) {
                _mm256_storeu_ps(yr + c, out);
            } else {
                _mm256_maskstore_ps(yr + c, m, out);
            }
        }
    }
}
