/* genome-lm's DSA ops for a CPU, fused: one pass per query instead of torch's chain of gathered
 * [C, S, H, D] temporaries (see ../dsa/sparse_attention.py, the torch path these match).
 *
 * Built and loaded by native.py (gcc -O3 -march=native -fopenmp-simd, no OpenMP runtime):
 * each function works on a range of rows [r0, r1) of one flattened [B * T] sequence batch, and
 * native.py runs the ranges on its threads (ctypes releases the GIL). Rows are fp32 and
 * contiguous; a key index is relative to its row's sequence (base = r / T * T).
 *
 * Repeats: each row's valid slots (idx >= 0) count once per key. A row whose valid slots are
 * strictly ascending (select_tokens' layout) is used as is; any other row is sorted and
 * de-duplicated first (the order of keys changes no result beyond rounding).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The distinct valid keys of one row of S slots, into keys; returns how many. */
static int64_t row_keys(const int64_t *ix, int64_t S, int64_t *keys) {
    int64_t n = 0, last = -1, ascending = 1;
    for (int64_t s = 0; s < S; s++) {
        if (ix[s] < 0) continue;
        if (ix[s] <= last) ascending = 0;
        last = ix[s];
        keys[n++] = ix[s];
    }
    if (ascending || n < 2) return n;
    qsort(keys, (size_t)n, sizeof(int64_t), cmp_i64);
    int64_t m = 1;
    for (int64_t i = 1; i < n; i++)
        if (keys[i] != keys[m - 1]) keys[m++] = keys[i];
    return m;
}

/* exp(x) for x <= 0 (a softmax's shifted scores), to about 2 ulp, in plain arithmetic so that the
 * compiler vectorises the loops that call it (libm's expf is a scalar call per element, most of
 * the forward's time). Below -87.3 it returns exp(-87.3) = 1.2e-38, where expf is smaller still. */
static inline float exp_neg(float x) {
    x = x < -87.3f ? -87.3f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;  /* ln 2 in two parts (Cody-Waite) */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;  /* exp(r) on [-ln2/2, ln2/2]: the Cephes minimax polynomial */
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t D) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

/* Scores of one row's n keys, head-major: s[h * S + i] = scale * q[h] . k[key i, h]; mx[h] their
 * maximum over i. */
static inline __attribute__((always_inline)) void row_scores(const float *restrict qr, const float *restrict k, int64_t base, const int64_t *keys,
                       int64_t n, int64_t S, int64_t H, int64_t D, float scale, float *restrict s,
                       float *restrict mx) {
    for (int64_t i = 0; i < n; i++) {
        const float *kr = k + (base + keys[i]) * H * D;
        for (int64_t h = 0; h < H; h++) s[h * S + i] = scale * dot(qr + h * D, kr + h * D, D);
    }
    for (int64_t h = 0; h < H; h++) {
        float m = -INFINITY;
        for (int64_t i = 0; i < n; i++) m = s[h * S + i] > m ? s[h * S + i] : m;
        mx[h] = m;
    }
}

/* s[h * S + i] <- exp(s[h * S + i] - shift[h]) for i < n; returns nothing, sums into sum[h] if given. */
static void row_exp(float *restrict s, int64_t n, int64_t S, int64_t H, const float *restrict shift,
                    float *restrict sum) {
    for (int64_t h = 0; h < H; h++) {
        float *sh = s + h * S, acc = 0.0f, c = shift[h];
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; i++) {
            float e = exp_neg(sh[i] - c);
            sh[i] = e;
            acc += e;
        }
        if (sum) sum[h] = acc;
    }
}

/* o [R, H, Dv], lse [R, H] for rows r0..r1-1. */
static inline __attribute__((always_inline)) void sparse_fwd(
    const float *q, const float *k, const float *v, const int64_t *idx, int64_t r0, int64_t r1, int64_t T,
    int64_t S, int64_t H, int64_t D, int64_t Dv, float scale, float *o, float *lse) {
    float *s = malloc(sizeof(float) * (size_t)(S * H + 2 * H));
    int64_t *keys = malloc(sizeof(int64_t) * (size_t)S);
    float *mx = s + S * H, *sum = mx + H;
    for (int64_t r = r0; r < r1; r++) {
        int64_t base = r / T * T, n = row_keys(idx + r * S, S, keys);
        float *orow = o + r * H * Dv;
        memset(orow, 0, sizeof(float) * (size_t)(H * Dv));
        if (n == 0) {
            for (int64_t h = 0; h < H; h++) lse[r * H + h] = -INFINITY;
            continue;
        }
        row_scores(q + r * H * D, k, base, keys, n, S, H, D, scale, s, mx);
        row_exp(s, n, S, H, mx, sum);
        for (int64_t i = 0; i < n; i++) {
            const float *vr = v + (base + keys[i]) * H * Dv;
            for (int64_t h = 0; h < H; h++) {
                float p = s[h * S + i];
                float *oh = orow + h * Dv;
                const float *vh = vr + h * Dv;
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) oh[d] += p * vh[d];
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float inv = 1.0f / sum[h];
            for (int64_t d = 0; d < Dv; d++) orow[h * Dv + d] *= inv;
            lse[r * H + h] = mx[h] + logf(sum[h]);
        }
    }
    free(s);
    free(keys);
}

/* Gradients for rows r0..r1-1: dq [R, H, D] written, dk [R, H, D] and dv [R, H, Dv] added to
 * (the caller gives each thread its own dk, dv). delta [R, H] = rowsum(do * o) - dlse. */
static inline __attribute__((always_inline)) void sparse_bwd(
    const float *q, const float *k, const float *v, const int64_t *idx, const float *lse, const float *dout,
    const float *delta, int64_t r0, int64_t r1, int64_t T, int64_t S, int64_t H, int64_t D, int64_t Dv,
    float scale, float *dq, float *dk, float *dv) {
    float *s = malloc(sizeof(float) * (size_t)(S * H + 2 * H));
    int64_t *keys = malloc(sizeof(int64_t) * (size_t)S);
    float *mx = s + S * H;
    for (int64_t r = r0; r < r1; r++) {
        int64_t base = r / T * T, n = row_keys(idx + r * S, S, keys);
        const float *qr = q + r * H * D, *dor = dout + r * H * Dv;
        float *dqr = dq + r * H * D;
        memset(dqr, 0, sizeof(float) * (size_t)(H * D));
        if (n == 0) continue;
        row_scores(qr, k, base, keys, n, S, H, D, scale, s, mx);
        row_exp(s, n, S, H, lse + r * H, NULL);
        for (int64_t i = 0; i < n; i++) {
            int64_t key = base + keys[i];
            const float *kr = k + key * H * D, *vr = v + key * H * Dv;
            float *dkr = dk + key * H * D, *dvr = dv + key * H * Dv;
            for (int64_t h = 0; h < H; h++) {
                float p = s[h * S + i];
                float ds = p * (dot(dor + h * Dv, vr + h * Dv, Dv) - delta[r * H + h]) * scale;
                const float *qh = qr + h * D, *kh = kr + h * D, *doh = dor + h * Dv;
                float *dqh = dqr + h * D, *dkh = dkr + h * D, *dvh = dvr + h * Dv;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) {
                    dqh[d] += ds * kh[d];
                    dkh[d] += ds * qh[d];
                }
#pragma omp simd
                for (int64_t d = 0; d < Dv; d++) dvh[d] += p * doh[d];
            }
        }
    }
    free(s);
    free(keys);
}

/* The exported entry points: head widths of 16 (the tiny presets) get a copy of the loops compiled
 * for that width (fully unrolled dot products, about 2x faster); any other width the general one. */
void dsa_sparse_fwd(const float *q, const float *k, const float *v, const int64_t *idx, int64_t r0, int64_t r1,
                    int64_t T, int64_t S, int64_t H, int64_t D, int64_t Dv, float scale, float *o, float *lse) {
    if (D == 16 && Dv == 16)
        sparse_fwd(q, k, v, idx, r0, r1, T, S, H, 16, 16, scale, o, lse);
    else
        sparse_fwd(q, k, v, idx, r0, r1, T, S, H, D, Dv, scale, o, lse);
}

void dsa_sparse_bwd(const float *q, const float *k, const float *v, const int64_t *idx, const float *lse,
                    const float *dout, const float *delta, int64_t r0, int64_t r1, int64_t T, int64_t S,
                    int64_t H, int64_t D, int64_t Dv, float scale, float *dq, float *dk, float *dv) {
    if (D == 16 && Dv == 16)
        sparse_bwd(q, k, v, idx, lse, dout, delta, r0, r1, T, S, H, 16, 16, scale, dq, dk, dv);
    else
        sparse_bwd(q, k, v, idx, lse, dout, delta, r0, r1, T, S, H, D, Dv, scale, dq, dk, dv);
}
