/* A draw from float32 logits after Hugging Face's warpers (temperature, top-k, top-p), in one
   call: sampler.py's numpy steps, in float64 as they are, on the kept entries only (numpy's
   ten calls over the whole vocabulary took 146 us a draw on the caches that a code predictor
   pass leaves, this 58 with the call from Python; see sampler.py). The kept entries'
   probabilities are numpy's to rounding (exp and the sums' order differ), so a draw differs
   from numpy's only where the uniform falls within rounding of a boundary of their cumulative
   sums. Ties at the top-p cut go in index order, as sampler.py's stable sort puts them. No
   state: safe in any number of threads. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "sampler.h"

typedef struct {
    double score;
    int64_t index;
} entry;

/* Ascending by score, ties by index. */
static int ascending(const void *a, const void *b) {
    const entry *x = a, *y = b;
    if (x->score != y->score) return x->score < y->score ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The k-th largest of s[0..n) (1 <= k <= n), found in `work` (n doubles, reordered). */
static double kth_largest(const double *s, int64_t n, int64_t k, double *work) {
    for (int64_t i = 0; i < n; i++) work[i] = s[i];
    int64_t lo = 0, hi = n - 1;
    const int64_t want = n - k; /* its place in ascending order */
    while (lo < hi) {           /* quickselect, Hoare's partition */
        const double pivot = work[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (work[i] < pivot) i++;
            while (work[j] > pivot) j--;
            if (i <= j) {
                const double t = work[i];
                work[i++] = work[j];
                work[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return work[want];
}

/* The softmax of the scores of entries e[0..m), into p: exponentials from the largest, over
   their sum. */
static void softmax(const entry *e, int64_t m, double *p) {
    double top = -INFINITY, sum = 0.0;
    for (int64_t i = 0; i < m; i++) top = e[i].score > top ? e[i].score : top;
    for (int64_t i = 0; i < m; i++) sum += p[i] = exp(e[i].score - top);
    for (int64_t i = 0; i < m; i++) p[i] /= sum;
}

/* The entries of s[0..n) at or above kth and above -inf, in index order, into kept; their count. */
static int64_t gather(const double *s, int64_t n, double kth, entry *kept) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (s[i] >= kth && s[i] > -INFINITY) kept[m++] = (entry){s[i], i};
    return m;
}

/* The index drawn from logits[0..n) for the uniform u in [0, 1): temperature, then the top_k
   best (0 or n: all; ties at the k-th score kept), then the fewest best whose probabilities
   reach top_p (1: all; the worst dropped while those dropped stay <= 1 - top_p), then the
   first entry whose cumulative probability, in index order and over its total, exceeds u.
   -1 where no logit is above -inf. */
int64_t kz_sampler_draw(const float *logits, int64_t n, double temperature, int64_t top_k, double top_p,
                        double u) {
    double *s = malloc(2 * (size_t)n * sizeof(double)), *p = s + n;
    entry *kept = malloc((size_t)n * sizeof(entry));
    int64_t drawn = -1;
    if (s == NULL || kept == NULL) abort(); /* as ggml does when memory runs out */
    for (int64_t i = 0; i < n; i++) s[i] = (double)logits[i] / temperature;
    const double kth = 0 < top_k && top_k < n ? kth_largest(s, n, top_k, p) : -INFINITY;
    int64_t m = gather(s, n, kth, kept);
    if (m == 0) goto done;
    if (top_p < 1.0) {
        qsort(kept, (size_t)m, sizeof(entry), ascending);
        softmax(kept, m, p);
        int64_t dropped = 0;
        for (double below = p[0]; dropped < m - 1 && below <= 1.0 - top_p; below += p[++dropped]) {}
        for (int64_t i = 0; i < dropped; i++) s[kept[i].index] = -INFINITY;
        m = gather(s, n, kth, kept); /* the rest, in index order again */
    }
    softmax(kept, m, p);
    for (int64_t i = 1; i < m; i++) p[i] += p[i - 1];
    drawn = kept[m - 1].index;
    for (int64_t i = 0; i < m; i++)
        if (p[i] / p[m - 1] > u) {
            drawn = kept[i].index;
            break;
        }
done:
    free(s);
    free(kept);
    return drawn;
}
