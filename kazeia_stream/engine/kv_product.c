/* The attention's products over the KV cache (the keys times a step's queries, the values
   times its weights), as a ggml custom operation (see kv_product.py for why).

   dst = ggml_mul_mat(a, b): a [k, m, A, B] float16 or float32, b [k, n, A g, B] float32, each
   with its numbers along k contiguous and any strides above; dst [m, n, A g, B] float32,
   contiguous. Matrix i2 of a serves matrices i2 g .. i2 g + g - 1 of b (grouped-query
   attention), as ggml broadcasts. Each row of a is read once, widened to float32 in the
   registers, and multiplied with the g n rows of b its matrix serves, kept in float32 (ggml
   rounds them to float16 beside a float16 a), R rows of a matrix at a time: the g n rows of
   b are loaded once for all R. An element of dst is summed in one order whatever the threads
   and the rows beside it: eight lanes of fmadds over k, their sum, then the last k % 8 terms.
   Threads take contiguous runs of a's rows. */

#include "ggml_op.h"

#define GGML_TYPE_F16 1
#define OUTS 8   /* elements of dst a pass over rows of a makes: eight accumulators */
#define AHEAD 16 /* rows of a prefetched ahead: a head's keys are a few lines a row, far apart */
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* The variant this CPU runs: AVX2 with FMA and F16C, or none. */
int kz_kv_product_level(void) { return vnni_level() > 0; }

AVX2 INLINE __m256 load8(const char *row, int f16, int64_t at) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + at)))
               : _mm256_loadu_ps((const float *)row + at);
}

AVX2 INLINE float load1(const char *row, int f16, int64_t at) {
    return f16 ? _cvtsh_ss(((const uint16_t *)row)[at]) : ((const float *)row)[at];
}

/* The lanes' sums of eight vectors, in one order for each: ((0 + 1) + (2 + 3)) + ((4 + 5) +
   (6 + 7)). */
AVX2 INLINE __m256 sums8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* sums[N j + c] = rows[j] . b[c] over k, for R rows of a and N rows of b (R N <= OUTS). */
AVX2 INLINE void dots(const char *const *rows, int f16, int64_t k, const float *const *b, float *sums, const int R,
                      const int N) {
    __m256 acc[OUTS];
    for (int j = 0; j < OUTS; j++) acc[j] = _mm256_setzero_ps();
    int64_t at = 0;
    for (; at + 8 <= k; at += 8) {
        __m256 vb[OUTS];
        for (int c = 0; c < N; c++) vb[c] = _mm256_loadu_ps(b[c] + at);
        for (int j = 0; j < R; j++) {
            const __m256 va = load8(rows[j], f16, at);
            for (int c = 0; c < N; c++) acc[N * j + c] = _mm256_fmadd_ps(va, vb[c], acc[N * j + c]);
        }
    }
    float all[OUTS];
    _mm256_storeu_ps(all, sums8(acc));
    for (; at < k; at++)
        for (int j = 0; j < R; j++)
            for (int c = 0; c < N; c++) all[N * j + c] += load1(rows[j], f16, at) * b[c][at];
    for (int j = 0; j < R * N; j++) sums[j] = all[j];
}

/* outs[c] + t step (a float) = row t . b[c] over k, for the n rows at base + t stride and the
   N rows of b, R rows at a time (the last ones one at a time; R N <= OUTS, constants), AHEAD
   rows prefetched. */
AVX2 INLINE void over_rows(const char *base, int64_t stride, int64_t n, int f16, int64_t k, const float *const *b,
                           char *const *outs, size_t step, const int R, const int N) {
    const int64_t bytes = k * (f16 ? 2 : 4);
    for (int64_t t = 0; t < n && t < AHEAD; t++)
        for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(base + t * stride + l, _MM_HINT_T0);
    for (int64_t t = 0; t < n;) {
        const int count = n - t >= R ? R : 1;
        const char *rows[OUTS];
        for (int j = 0; j < count; j++) {
            rows[j] = base + (t + j) * stride;
            if (t + j + AHEAD < n)
                for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(rows[j] + AHEAD * stride + l, _MM_HINT_T0);
        }
        float sums[OUTS];
        if (count == R)
            dots(rows, f16, k, b, sums, R, N);
        else
            dots(rows, f16, k, b, sums, 1, N);
        for (int j = 0; j < count; j++, t++)
            for (int c = 0; c < N; c++) *(float *)(outs[c] + t * step) = sums[N * j + c];
    }
}

/* `call(R, N)` for N = count rows of b a row of a serves (1 <= count <= OUTS): R rows of a at
   a time, as many as the accumulators hold. */
#define BY_COUNT(count, call)       \
    switch (count) {                \
    case 1: call(8, 1); break;      \
    case 2: call(4, 2); break;      \
    case 3: call(2, 3); break;      \
    case 4: call(2, 4); break;      \
    case 5: call(1, 5); break;      \
    case 6: call(1, 6); break;      \
    case 7: call(1, 7); break;      \
    default: call(1, 8); break;     \
    }

/* Rows [i0, i1) of matrix (i2, i3) of a times the N rows of b it serves (`over_rows`). */
AVX2 INLINE void rows_of(const struct tensor *a, const struct tensor *b, struct tensor *dst, int64_t i2, int64_t i3,
                         int64_t i0, int64_t i1, const int R, const int N) {
    const int64_t n = b->ne[1], g = b->ne[2] / a->ne[2];
    const char *matrix = (const char *)a->data + i2 * a->nb[2] + i3 * a->nb[3];
    const float *bs[OUTS];
    char *out[OUTS];
    for (int c = 0; c < N; c++) {
        const int64_t h = i2 * g + c / n, col = c % n;
        bs[c] = (const float *)((const char *)b->data + col * b->nb[1] + h * b->nb[2] + i3 * b->nb[3]);
        out[c] = (char *)dst->data + col * dst->nb[1] + h * dst->nb[2] + i3 * dst->nb[3] + i0 * dst->nb[0];
    }
    over_rows(matrix + i0 * a->nb[1], (int64_t)a->nb[1], i1 - i0, a->type == GGML_TYPE_F16, a->ne[0], bs, out,
              dst->nb[0], R, N);
}

/* Rows [r0, r1) of a, counted along its rows, then its matrices. */
AVX2 INLINE void run(const struct tensor *a, const struct tensor *b, struct tensor *dst, int64_t r0, int64_t r1,
                     const int R, const int N) {
    const int64_t m = a->ne[1], heads = a->ne[2];
    for (int64_t r = r0; r < r1;) {
        const int64_t matrix = r / m, i0 = r % m, i1 = r1 - r < m - i0 ? i0 + r1 - r : m;
        rows_of(a, b, dst, matrix % heads, matrix / heads, i0, i1, R, N);
        r += i1 - i0;
    }
}

/* The custom operation (ggml_custom_op_t), for g n <= OUTS (kv_product.py). */
AVX2 void kz_kv_product_avx2(struct tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct tensor *a = dst->src[0], *b = dst->src[1];
    const int64_t rows = a->ne[1] * a->ne[2] * a->ne[3], r0 = rows * ith / nth, r1 = rows * (ith + 1) / nth;
#define RUN(R, N) run(a, b, dst, r0, r1, R, N)
    BY_COUNT(b->ne[1] * (b->ne[2] / a->ne[2]), RUN)
#undef RUN
}

/* ---- A step's whole attention in one operation (`attend`, kv_product.py) ----

   For parts of one query row each (a talker step of each stream, a code predictor step), what
   a layer does between its q/k/v products and its o product: the q and k heads RMS-normed
   (`rms_normed`, ggml_op.h) and rotated (NeoX RoPE), both as ggml computes them, k and v
   written into the caches at the part's position (K a row per position, V transposed in
   blocks), then each query head's scores over the positions up to its own, their softmax and
   the values they weight. In ggml that is nine
   operations a layer, each ended by a barrier where the other thread waits, for a few
   microseconds of work: a code predictor step's 5 layers spent 35 us a layer there on the Xeon
   with AMX, its products 565. Here a thread takes whole KV heads (a part's writes and reads of a
   head are then one thread's, in the parts' order: a later part of a slot reads what an earlier
   one wrote). The products over the cache are `dots`' (each element summed in the order
   `kz_kv_product_avx2` sums it); the softmax's exponentials are our own, within a few units in
   the last place of ggml's. */

#include <string.h>

/* The operation's userdata: RMS norms' epsilon, RoPE's base, the scores' scale, positions per V
   block and each part's KV slot. */
struct attend {
    float eps, theta, scale;
    int32_t unused;
    int64_t v_block, parts;
    int64_t slots[];
};

/* cos and sin of each rotated pair's angle at position pos (ggml's rope cache: the angle
   multiplied by theta_scale from one pair to the next, in float). */
static void angles(int32_t pos, int64_t pairs, float theta_scale, float *cs, float *sn) {
    float theta = (float)pos;
    for (int64_t i = 0; i < pairs; i++) {
        cs[i] = cosf(theta);
        sn[i] = sinf(theta);
        theta *= theta_scale;
    }
}

/* x [2 pairs] rotated in place, NeoX's pairs (i, i + pairs). */
static void rotated(float *x, int64_t pairs, const float *cs, const float *sn) {
    for (int64_t i = 0; i < pairs; i++) {
        const float x0 = x[i], x1 = x[i + pairs];
        x[i] = x0 * cs[i] - x1 * sn[i];
        x[i + pairs] = x0 * sn[i] + x1 * cs[i];
    }
}

/* e^x for x <= 0 (0 below float's range): 2^n e^r, r = x - n ln 2 in two parts, e^r to degree 6. */
AVX2 INLINE __m256 exp8(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

/* p[0..n) = the softmax of scale s[0..n) (n > 0); p may be s. */
AVX2 static void softmax(const float *s, int64_t n, float scale, float *p) {
    float top = -INFINITY;
    for (int64_t t = 0; t < n; t++) top = fmaxf(top, s[t] * scale);
    double sum = 0.0;
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(scale));
        _mm256_storeu_ps(p + t, exp8(_mm256_sub_ps(x, _mm256_set1_ps(top))));
    }
    if (t < n) {
        float last[8] = {0}, out[8];
        for (int64_t i = t; i < n; i++) last[i - t] = s[i] * scale - top;
        for (int64_t i = n - t; i < 8; i++) last[i] = -INFINITY;
        _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(last)));
        for (int64_t i = t; i < n; i++) p[i] = out[i - t];
    }
    for (t = 0; t < n; t++) sum += (double)p[t];
    const float inv = (float)(1.0 / sum);
    for (t = 0; t < n; t++) p[t] *= inv;
}

/* over_rows into out[c n + t] for N = group (1 <= group <= OUTS). */
AVX2 static void over_rows_of(const char *base, int64_t stride, int64_t n, int f16, int64_t k, const float *const *b,
                              float *out, int64_t group) {
    char *outs[OUTS];
    for (int64_t c = 0; c < group; c++) outs[c] = (char *)(out + c * n);
#define OVER(R, N) over_rows(base, stride, n, f16, k, b, outs, sizeof(float), R, N)
    BY_COUNT(group, OVER)
#undef OVER
}

/* x[0..n) stored as the cache's numbers (float16 rounded to nearest, as ggml's set_rows), each
   `step` bytes after the last. */
AVX2 static void store(const float *x, int64_t n, int f16, char *at, size_t step) {
    for (int64_t i = 0; i < n; i++, at += step) {
        if (f16)
            *(uint16_t *)at = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
        else
            *(float *)at = x[i];
    }
}

/* The operation (ggml_custom_op_t): src q [hd heads, P], k and v [hd kvh, P] (float32, a part a
   column), q_norm and k_norm [hd], positions (int32 [P]), the K cache [kv channels, n_ctx,
   slots] and the V cache [v_block, kv channels, blocks, slots] (float16 or float32); dst [hd
   heads, P]. Thread ith of nth takes KV heads [ith kvh / nth, (ith + 1) kvh / nth). */
AVX2 void kz_kv_product_attend_avx2(struct tensor *dst, int ith, int nth, void *userdata) {
    const struct attend *u = userdata;
    const struct tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2], *q_norm = dst->src[3],
                        *k_norm = dst->src[4], *kc = dst->src[6], *vc = dst->src[7];
    const int32_t *positions = (const int32_t *)dst->src[5]->data;
    const int64_t hd = q_norm->ne[0], pairs = hd / 2, kvh = k->ne[0] / hd, group = q->ne[0] / hd / kvh;
    const int f16 = kc->type == GGML_TYPE_F16;
    const size_t item = f16 ? 2 : 4;
    const float theta_scale = powf(u->theta, -2.0f / (float)hd);
    int64_t most = 1;
    for (int64_t p = 0; p < u->parts; p++) most = positions[p] + 1 > most ? positions[p] + 1 : most;
    const int64_t room = (most + 7) / 8 * 8; /* a head's probabilities, zeros after its last */
    float *work = aligned_alloc(64, (size_t)((group + 1) * hd + 2 * pairs + group * room + hd * group) * 4 + 64);
    if (work == NULL) abort(); /* as ggml does when memory runs out */
    float *kk = work, *qq = kk + hd, *cs = qq + group * hd, *sn = cs + pairs;
    float *prob = sn + pairs, *piece = prob + group * room;
    for (int64_t h = ith * kvh / nth; h < (ith + 1) * kvh / nth; h++) {
        for (int64_t p = 0; p < u->parts; p++) {
            const int32_t at = positions[p];
            const int64_t n = at + 1, slot = u->slots[p];
            angles(at, pairs, theta_scale, cs, sn);
            const float *kp = (const float *)((const char *)k->data + p * k->nb[1]) + h * hd;
            rms_normed(kp, k_norm->data, hd, u->eps, kk);
            rotated(kk, pairs, cs, sn);
            const char *keys = (const char *)kc->data + slot * kc->nb[2] + h * hd * item;
            store(kk, hd, f16, (char *)keys + at * kc->nb[1], item);
            const char *values = (const char *)vc->data + slot * vc->nb[3] + h * hd * vc->nb[1];
            const float *vv = (const float *)((const char *)v->data + p * v->nb[1]) + h * hd;
            const size_t cell = at / u->v_block * vc->nb[2] + at % u->v_block * vc->nb[0];
            store(vv, hd, f16, (char *)values + cell, vc->nb[1]);
            const float *b[OUTS];
            for (int64_t c = 0; c < group; c++) {
                float *qc = qq + c * hd;
                const float *qp = (const float *)((const char *)q->data + p * q->nb[1]) + (h * group + c) * hd;
                rms_normed(qp, q_norm->data, hd, u->eps, qc);
                rotated(qc, pairs, cs, sn);
                b[c] = qc;
            }
            over_rows_of(keys, (int64_t)kc->nb[1], n, f16, hd, b, prob, group); /* scores [group, n] */
            for (int64_t c = group - 1; c >= 0; c--) { /* each head's row moved to its room, zeros after */
                float *row = prob + c * room;
                memmove(row, prob + c * n, (size_t)n * 4);
                for (int64_t t = n; t < room; t++) row[t] = 0.0f;
                softmax(row, n, u->scale, row);
            }
            float *out = (float *)((char *)dst->data + p * dst->nb[1]) + h * group * hd;
            for (int64_t first = 0; first < n; first += u->v_block) { /* one product per V block, summed */
                const int64_t in_block = room - first < u->v_block ? room - first : u->v_block;
                for (int64_t c = 0; c < group; c++) b[c] = prob + c * room + first;
                over_rows_of(values + first / u->v_block * vc->nb[2], (int64_t)vc->nb[1], hd, f16, in_block, b,
                             first == 0 ? out : piece, group);
                if (first > 0)
                    for (int64_t i = 0; i < group * hd; i++) out[i] += piece[i];
            }
        }
    }
    free(work);
}
