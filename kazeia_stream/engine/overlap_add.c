/* A transposed convolution's overlap-add (codec_layers.py's CausalTransConv; overlap_add.py has
   the rule and numpy's version of it): from the product Z [C_out, k, n, S] (tap, input time
   step, stream), the output Y [C_out, n, s, S], y[c, t, m] = (z[c, m, t] + b[c]) + z[c, s + m,
   t - 1] for the taps m < k - s that overlap the next step (t - 1 = -1: the tail carried from
   the last call), and z[c, m, t] + b[c] for the others; then the tail [k - s, C_out, S] <- z[c,
   s + m, n - 1]. The sums in numpy's order, so the same bits. Plain C: numpy's version loops
   over the phases in Python and over the S streams (1-4) innermost, 4-13x slower on the
   decoder's shapes. */

#include <stdint.h>

static inline __attribute__((always_inline)) void add(const float *z, const float *bias, float *tail, float *y,
                                                      int64_t c_out, int64_t k, int64_t s, int64_t n,
                                                      const int64_t S) {
    const int64_t over = k - s;
    for (int64_t c = 0; c < c_out; c++) {
        const float *zc = z + c * k * n * S;
        float *yc = y + c * n * s * S;
        const float b = bias[c];
        for (int64_t m = 0; m < s; m++) {
            const float *za = zc + m * n * S;
            float *ym = yc + m * S;
            if (m < over) {
                const float *zb = zc + (s + m) * n * S - S, *last = tail + (m * c_out + c) * S;
                for (int64_t q = 0; q < S; q++) ym[q] = (za[q] + b) + last[q];
                for (int64_t t = 1; t < n; t++)
                    for (int64_t q = 0; q < S; q++) ym[t * s * S + q] = (za[t * S + q] + b) + zb[t * S + q];
            } else {
                for (int64_t t = 0; t < n; t++)
                    for (int64_t q = 0; q < S; q++) ym[t * s * S + q] = za[t * S + q] + b;
            }
        }
        for (int64_t m = 0; m < over; m++)
            for (int64_t q = 0; q < S; q++) tail[(m * c_out + c) * S + q] = zc[((s + m) * n + n - 1) * S + q];
    }
}

/* One stream (the decoder's later blocks) in a loop of its own, whose innermost loop runs
   along the time steps. */
void kz_overlap_add(const float *z, const float *bias, float *tail, float *y, int64_t c_out, int64_t k,
                    int64_t s, int64_t n, int64_t streams) {
    if (streams == 1)
        add(z, bias, tail, y, c_out, k, s, n, 1);
    else
        add(z, bias, tail, y, c_out, k, s, n, streams);
}
