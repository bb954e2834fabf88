/* This core's rate for the instructions our AVX2 Q8_0 kernel (kazeia_stream/engine/q8_product.c)
   spends on 32 multiply-adds, run from registers (no loads, eight independent chains), beside
   float32's fused multiply-add: the floor the kernel's arithmetic sets, to compare with what
   `python -m kazeia_stream.engine.q8_product --rows 8 --threads 1` reports for the kernel (its
   "ns per 32 multiply-adds").

       cc -O2 -mavx2 -mfma tools/mac_rate.c -o /tmp/mac_rate && /tmp/mac_rate

   The clock is the core's: a chain of dependent integer adds retires one a cycle. */

#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 100000000L /* iterations of eight */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* GHz: N * 8 dependent adds, one a cycle, eight an iteration (one an iteration read 1.45-2.75
   GHz on a Zen 3 whose FMAs put it at 2.9-3.0: the loop's own overhead, not the adds, set its pace). */
static double clock_ghz(void) {
    long x = 0;
    double t0 = now();
    for (long i = 0; i < N; i++)
        __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                         "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
                         : "+r"(x));
    return N * 8 / (now() - t0) / 1e9;
}

#define EIGHT(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define FOUR(X) X(0) X(1) X(2) X(3)

/* ns per 32 multiply-adds of the kernel's sequence for a pair of blocks and four rows of x:
   the weights' two interleaved halves' magnitudes (once for the four rows), each row signed by
   the weights, times those magnitudes (u8 x s8 pairs), pairs of int16, the halves' sums added,
   to float, fmadd by the scales (the weights' times x's). Four independent rows (x's bits
   stand for its scales too: the timing does not depend on the values, which stay normal
   floats). */
static double int8_ns(void) {
    __m256i lo = _mm256_set1_epi8(-3), hi = _mm256_set1_epi8(5), ones = _mm256_set1_epi16(1);
    __m256 dw = _mm256_set1_ps(0x1p40f);
#define DECL(i) __m256i x##i = _mm256_set1_epi8(i + 1); __m256 a##i = _mm256_setzero_ps();
    FOUR(DECL)
    double t0 = now();
    for (long it = 0; it < N * 2; it++) {
        /* the compiler must not hoist the products out of the loop: x and w may change */
        __asm__ volatile("" : "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3), "+x"(lo), "+x"(hi));
        const __m256i alo = _mm256_abs_epi8(lo), ahi = _mm256_abs_epi8(hi);
#define STEP(i)                                                                                \
    {                                                                                          \
        __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(alo, _mm256_sign_epi8(x##i, lo)), ones); \
        __m256i q = _mm256_madd_epi16(_mm256_maddubs_epi16(ahi, _mm256_sign_epi8(x##i, hi)), ones); \
        a##i = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p, q)), _mm256_mul_ps(dw, _mm256_castsi256_ps(x##i)), a##i); \
    }
        FOUR(STEP)
    }
    double t = now() - t0;
    __m256 sum = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    volatile float sink = _mm256_cvtss_f32(sum);
    (void)sink;
    return t / (N * 16) * 1e9;
}

/* ns per 32 multiply-adds of float32 fmadds (four of eight lanes each). */
static double f32_ns(void) {
#define FDECL(i) __m256 b##i = _mm256_set1_ps(1e-9f * (i + 1));
    EIGHT(FDECL)
    __m256 s = _mm256_set1_ps(0.999f);
    double t0 = now();
    for (long it = 0; it < N; it++) {
#define FSTEP(i) b##i = _mm256_fmadd_ps(b##i, s, s);
        EIGHT(FSTEP)
        __asm__ volatile("" : "+x"(b0), "+x"(b1), "+x"(b2), "+x"(b3), "+x"(b4), "+x"(b5), "+x"(b6), "+x"(b7));
    }
    double t = now() - t0;
    volatile float sink = _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(b0, b7), _mm256_add_ps(b3, b4)));
    (void)sink;
    return 4 * t / (N * 8) * 1e9;
}

int main(void) {
    double ghz = clock_ghz(), i8 = int8_ns(), f32 = f32_ns();
    printf("clock %.2f GHz\n", ghz);
    printf("int8 (the kernel's sequence): %.2f ns per 32 multiply-adds, %.1f a cycle\n", i8, 32 / (i8 * ghz));
    printf("float32 fmadd:                %.2f ns per 32 multiply-adds, %.1f a cycle\n", f32, 32 / (f32 * ghz));
    return 0;
}
