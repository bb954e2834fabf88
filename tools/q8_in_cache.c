/* Our Q8_0 kernel (kazeia_stream/engine/q8_product.c) on one thread and N rows of x (1 unless
   given, at most 4: the streams a generator's pass batches), its weights in this core's L2
   cache and then from memory: what its arithmetic allows when reading is not the limit, beside
   what it reads from memory. Where the two are close, the kernel is bound by both at once and
   reads below the memory's speed (numpy's, `python -m kazeia_stream.bandwidth 1`), as on Zen 1,
   whose integer multiplies run on one pipe; at four rows on Zen 3, by its arithmetic.

       cc -O3 -I kazeia_stream/engine tools/q8_in_cache.c -o /tmp/q8_in_cache -lm && /tmp/q8_in_cache [N]

   Weights of 1024 columns (the 0.6B's width), best of 5 runs; ns per 32 multiply-adds (a block
   of weights and a row of x) and the weights' GB/s. Where the CPU has AVX512-VNNI, its loops
   (AMX's tiles, where they run too, are not timed here). */

#include "q8_product.c"

#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 1;
    if (n < 1 || n > ROWS) {
        printf("rows of x: 1 to %d\n", ROWS);
        return 1;
    }
    const int level = kz_q8_product_level();
    if (level == 0) {
        puts("this CPU runs neither variant (AVX2 with FMA and F16C, or AVX512-VNNI)");
        return 1;
    }
    const int avx512 = level >= 2; /* where AMX runs too, AVX512's loops */
    const struct layout *layout = avx512 ? &layout512 : &layout256;
    tile_fn *tile = avx512 ? tile512() : tile256;
    const int64_t k = 1024, nb = k / 32, groups = (nb + layout->blocks - 1) / layout->blocks;
    const size_t q_row = groups * layout->bytes, d_row = groups * layout->floats;
    float *x = aligned_alloc(64, k * sizeof(float));
    int8_t *q = aligned_alloc(64, n * q_row);
    float *d = aligned_alloc(64, n * d_row * sizeof(float));
    for (int r = 0; r < n; r++) { /* rows of their own numbers (the timing does not depend on them) */
        for (int64_t i = 0; i < k; i++) x[i] = (float)((i * 7919 + r) % 200 - 100) / 37.0f;
        (avx512 ? quantize512 : quantize256)(x, k, q + r * q_row, d + r * d_row);
    }
    const struct {
        const char *where;
        size_t bytes;
        int repeat;
    } cases[] = {{"L2 cache", 256 << 10, 2000}, {"memory", (size_t)512 << 20, 3}};
    printf("%s variant, 1 thread, %d row(s) of x\n", avx512 ? "AVX512-VNNI" : "AVX2", n);
    for (int c = 0; c < 2; c++) {
        const int64_t m = cases[c].bytes / (nb * sizeof(block_q8_0));
        block_q8_0 *w = aligned_alloc(64, (m * nb * sizeof(block_q8_0) + 63) / 64 * 64);
        float *dst = aligned_alloc(64, n * m * sizeof(float));
        for (int64_t i = 0; i < m * nb; i++) {
            w[i].d = 0x2000; /* fp16 2^-7 */
            for (int j = 0; j < 32; j++) w[i].qs[j] = (int8_t)((i * 31 + j * 17) % 255 - 127);
        }
        double best = 1e9;
        for (int run = 0; run < 5; run++) {
            const double t0 = now();
            for (int r = 0; r < cases[c].repeat; r++)
                for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS)
                    tile(w, nb, q_row, d_row, n, q, d, dst, m, r0, r0 + TILE_ROWS < m ? r0 + TILE_ROWS : m, NULL);
            const double t = (now() - t0) / cases[c].repeat;
            best = t < best ? t : best;
        }
        printf("%-8s (%4zu KB): %.2f ns per 32 multiply-adds, %.1f GB/s\n", cases[c].where,
               cases[c].bytes >> 10, best * 1e9 / (m * nb * n), m * nb * sizeof(block_q8_0) / best / 1e9);
        free(w);
        free(dst);
    }
    return 0;
}
