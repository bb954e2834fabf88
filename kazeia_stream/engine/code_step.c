/* The code predictor's steps in C (a frame's in one call: kz_code_run), the GIL released
   throughout. A step: each stream's input row is the table row of its last code (added to its
   running sum: the talker's next input), the step's other inputs are copied from arrays made
   once, the graph runs, and each stream's next code is drawn from its logits (sampler.c). In
   Python the same work between two graph runs took ~0.2 ms a step on two quiet cores and more
   beside the codec decoder, whose Python holds the GIL at times (code_predictor.py). The
   numbers are those of the Python steps: the rows dequantized as numpy does (a float32
   product per element), the draw sampler.c's. */

#include <stdint.h>
#include <string.h>

#include "sampler.h"

/* ggml's type numbers of the tables this reads */
enum { KZ_F32 = 0, KZ_F16 = 1, KZ_Q8_0 = 8 };
#define QK8_0 32

struct kz_copy {
    void *dst;
    const void *src;
    int64_t size;
};

/* How a stream draws: Hugging Face's warpers (sampler.c), or the first largest logit. */
struct kz_draw {
    double temperature, top_p, uniform;
    int64_t top_k, greedy;
};

struct kz_code_step {
    int (*compute)(void *graph, void *plan); /* ggml_graph_compute */
    void *graph, *plan;
    const struct kz_copy *copies; /* the inputs but the rows, made once */
    int64_t n_copies;
    int64_t rows, width, vocab;
    float *x;              /* [rows, width]: the graph's input rows */
    float *sums;           /* [rows, width]: each stream's sum of its input rows */
    const uint8_t *table;  /* [table rows, width] of table_type */
    int64_t table_type;
    const float *logits;   /* [rows, vocab]: the graph's output */
    struct kz_draw *draws; /* [rows] */
    int64_t *codes;        /* [rows]: each stream's last code in, its next out */
    int64_t status;        /* out: ggml's status of a failed run, or the stream that drew nothing */
};

/* An IEEE half as a float, exactly (subnormals, infinities and NaNs too). */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000 | mantissa << 13;
    } else if (exponent != 0) {
        bits = sign | (exponent + 112) << 23 | mantissa << 13;
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int shift = 0;
        uint32_t m = mantissa;
        while (!(m & 0x400)) {
            m <<= 1;
            shift++;
        }
        bits = sign | (uint32_t)(113 - shift) << 23 | (m & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Row `row` of a [*, width] table of `type` as floats into out; 0 for a type this does not read. */
int kz_code_step_row(const uint8_t *table, int64_t type, int64_t width, int64_t row, float *out) {
    if (type == KZ_F32) {
        memcpy(out, table + row * width * 4, (size_t)width * 4);
    } else if (type == KZ_F16) {
        const uint16_t *h = (const uint16_t *)(table + row * width * 2);
        for (int64_t i = 0; i < width; i++) out[i] = half_to_float(h[i]);
    } else if (type == KZ_Q8_0) {
        const uint8_t *block = table + row * (width / QK8_0) * (2 + QK8_0);
        for (int64_t b = 0; b < width / QK8_0; b++, block += 2 + QK8_0) {
            uint16_t d;
            memcpy(&d, block, 2);
            const float scale = half_to_float(d);
            for (int i = 0; i < QK8_0; i++) out[b * QK8_0 + i] = (float)(int8_t)block[2 + i] * scale;
        }
    } else {
        return 0;
    }
    return 1;
}

/* The first largest of x[0..n), or the first NaN (numpy's argmax). */
static int64_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 0; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

/* One step (see the top): 0; 1 where the graph's run failed (ggml's status in s->status); 2
   where the logits of stream s->status were all -inf (its code and the later streams' are then
   not drawn). */
int kz_code_step(struct kz_code_step *s) {
    for (int64_t r = 0; r < s->rows; r++) {
        float *x = s->x + r * s->width, *sum = s->sums + r * s->width;
        kz_code_step_row(s->table, s->table_type, s->width, s->codes[r], x);
        for (int64_t i = 0; i < s->width; i++) sum[i] += x[i];
    }
    for (int64_t i = 0; i < s->n_copies; i++) memcpy(s->copies[i].dst, s->copies[i].src, (size_t)s->copies[i].size);
    s->status = s->compute(s->graph, s->plan);
    if (s->status != 0) return 1;
    for (int64_t r = 0; r < s->rows; r++) {
        const float *logits = s->logits + r * s->vocab;
        const struct kz_draw *d = &s->draws[r];
        const int64_t code = d->greedy ? argmax(logits, s->vocab)
                                       : kz_sampler_draw(logits, s->vocab, d->temperature, d->top_k, d->top_p,
                                                         d->uniform);
        if (code < 0) {
            s->status = r;
            return 2;
        }
        s->codes[r] = code;
    }
    return 0;
}

/* A frame's steps done..count - 1 in one call (the GIL released throughout), steps[0] the
   first: step i draws with the streams' uniforms[i rows ..] and leaves its codes at out[i
   rows ..]. Before each step but the call's first, 3 is returned (with `done` the steps run)
   once *changes no longer reads `seen`: the cores were lent or given back, or a stream waits to
   begin, and the caller chooses the next steps' threads again. Else 0, or the failed step's
   kz_code_step result. */
struct kz_code_run {
    struct kz_code_step *steps; /* [count - done at the call] */
    int64_t count, done;
    const double *uniforms; /* [count, rows] */
    int64_t *out;           /* [count, rows] */
    const int64_t *changes;
    int64_t seen;
};

int kz_code_run(struct kz_code_run *run) {
    for (const int64_t first = run->done; run->done < run->count; run->done++) {
        if (run->done > first && __atomic_load_n(run->changes, __ATOMIC_ACQUIRE) != run->seen) return 3;
        struct kz_code_step *s = &run->steps[run->done - first];
        for (int64_t r = 0; r < s->rows; r++) s->draws[r].uniform = run->uniforms[run->done * s->rows + r];
        const int result = kz_code_step(s);
        if (result != 0) return result;
        memcpy(run->out + run->done * s->rows, s->codes, (size_t)s->rows * sizeof(int64_t));
    }
    return 0;
}
