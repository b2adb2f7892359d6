/* mHC's Sinkhorn normalisation for a CPU, fused (../mhc/recompute.py's steps and grad, which this
 * matches): matrices laid out tokens-last, z [N][N][M], so every step
 * runs vectorised over a block of tokens held in cache; torch's path makes one pass over all M
 * tokens per step (about 160 passes per call at 20 iterations).
 *
 *   c = softmax_j(z[i][j]) + eps; then for dim in [0] + [1, 0] * (iters - 1): c /= sum_dim(c) + eps
 * Backward recomputes the steps of a block, keeping each (output, denominator), and walks back:
 *   g = (g - sum_dim(g * y)) / denom;  dz = p * (g - sum_j(g * p)), p = softmax_j(z).
 * Tokens m0..m1-1 (each thread its own range).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define TB 64 /* tokens per block */

/* p[i][j][t] = softmax over j of z[i][j][t] (block of nt tokens at z + t0, row stride M). */
static inline __attribute__((always_inline)) void softmax_rows(const float *z, int64_t M, int64_t N, int64_t nt,
                                                                float *p) {
    for (int64_t i = 0; i < N; i++) {
        float mx[TB], sum[TB];
        for (int64_t t = 0; t < nt; t++) mx[t] = -INFINITY, sum[t] = 0.0f;
        for (int64_t j = 0; j < N; j++) {
            const float *zr = z + (i * N + j) * M;
#pragma omp simd
            for (int64_t t = 0; t < nt; t++) mx[t] = zr[t] > mx[t] ? zr[t] : mx[t];
        }
        for (int64_t j = 0; j < N; j++) {
            const float *zr = z + (i * N + j) * M;
            float *pr = p + (i * N + j) * TB;
#pragma omp simd
            for (int64_t t = 0; t < nt; t++) {
                pr[t] = exp_neg(zr[t] - mx[t]);
                sum[t] += pr[t];
            }
        }
        for (int64_t j = 0; j < N; j++) {
            float *pr = p + (i * N + j) * TB;
#pragma omp simd
            for (int64_t t = 0; t < nt; t++) pr[t] /= sum[t];
        }
    }
}

/* One normalisation of c [N][N][TB] over dim (0: sum over i, per column j; 1: over j, per row i):
 * c /= sum + eps; the denominators into den [N][TB]. */
static inline __attribute__((always_inline)) void normalise(float *c, int64_t N, int64_t nt, int dim, float eps,
                                                            float *den) {
    for (int64_t a = 0; a < N; a++) {
        float *d = den + a * TB;
        for (int64_t t = 0; t < nt; t++) d[t] = eps;
        for (int64_t b = 0; b < N; b++) {
            const float *cr = c + (dim == 0 ? b * N + a : a * N + b) * TB;
#pragma omp simd
            for (int64_t t = 0; t < nt; t++) d[t] += cr[t];
        }
        for (int64_t b = 0; b < N; b++) {
            float *cr = c + (dim == 0 ? b * N + a : a * N + b) * TB;
#pragma omp simd
            for (int64_t t = 0; t < nt; t++) cr[t] /= d[t];
        }
    }
}

static inline __attribute__((always_inline)) int sinkhorn_fwd(const float *z, int64_t M, int64_t N, int64_t iters,
                                                               float eps, int64_t m0, int64_t m1, float *out) {
    float *c = malloc(sizeof(float) * (size_t)(N * N * TB + N * TB));
    if (!c) return GENOME_LM_NO_MEMORY;
    float *den = c + N * N * TB;
    for (int64_t t0 = m0; t0 < m1; t0 += TB) {
        int64_t nt = m1 - t0 < TB ? m1 - t0 : TB;
        softmax_rows(z + t0, M, N, nt, c);
        for (int64_t e = 0; e < N * N; e++)
            for (int64_t t = 0; t < nt; t++) c[e * TB + t] += eps;
        for (int64_t s = 0; s < 2 * iters - 1; s++) normalise(c, N, nt, s % 2, eps, den);
        for (int64_t e = 0; e < N * N; e++) memcpy(out + e * M + t0, c + e * TB, sizeof(float) * (size_t)nt);
    }
    free(c);
    return 0;
}

static inline __attribute__((always_inline)) int sinkhorn_bwd(const float *z, const float *grad, int64_t M,
                                                               int64_t N, int64_t iters, float eps, int64_t m0,
                                                               int64_t m1, float *dz) {
    int64_t steps = 2 * iters - 1, NN = N * N;
    /* ys[s]: the output of step s; dens[s]: its denominators; p: the softmax; g: the gradient */
    float *buf = malloc(sizeof(float) * (size_t)((steps + 3) * NN * TB + steps * N * TB + TB));
    if (!buf) return GENOME_LM_NO_MEMORY;
    float *ys = buf, *p = ys + steps * NN * TB, *g = p + NN * TB, *c = g + NN * TB, *dens = c + NN * TB;
    float *acc = dens + steps * N * TB;
    for (int64_t t0 = m0; t0 < m1; t0 += TB) {
        int64_t nt = m1 - t0 < TB ? m1 - t0 : TB;
        softmax_rows(z + t0, M, N, nt, p);
        for (int64_t e = 0; e < NN; e++)
            for (int64_t t = 0; t < nt; t++) c[e * TB + t] = p[e * TB + t] + eps;
        for (int64_t s = 0; s < steps; s++) {
            normalise(c, N, nt, s % 2, eps, dens + s * N * TB);
            memcpy(ys + s * NN * TB, c, sizeof(float) * (size_t)(NN * TB));
        }
        for (int64_t e = 0; e < NN; e++) memcpy(g + e * TB, grad + e * M + t0, sizeof(float) * (size_t)nt);
        for (int64_t s = steps - 1; s >= 0; s--) {
            int dim = s % 2;
            const float *y = ys + s * NN * TB, *den = dens + s * N * TB;
            for (int64_t a = 0; a < N; a++) {
                for (int64_t t = 0; t < nt; t++) acc[t] = 0.0f;
                for (int64_t b = 0; b < N; b++) {
                    int64_t e = dim == 0 ? b * N + a : a * N + b;
#pragma omp simd
                    for (int64_t t = 0; t < nt; t++) acc[t] += g[e * TB + t] * y[e * TB + t];
                }
                for (int64_t b = 0; b < N; b++) {
                    int64_t e = dim == 0 ? b * N + a : a * N + b;
#pragma omp simd
                    for (int64_t t = 0; t < nt; t++) g[e * TB + t] = (g[e * TB + t] - acc[t]) / den[a * TB + t];
                }
            }
        }
        for (int64_t i = 0; i < N; i++) {
            for (int64_t t = 0; t < nt; t++) acc[t] = 0.0f;
            for (int64_t j = 0; j < N; j++) {
                int64_t e = i * N + j;
#pragma omp simd
                for (int64_t t = 0; t < nt; t++) acc[t] += g[e * TB + t] * p[e * TB + t];
            }
            for (int64_t j = 0; j < N; j++) {
                int64_t e = i * N + j;
                float *dr = dz + e * M + t0;
#pragma omp simd
                for (int64_t t = 0; t < nt; t++) dr[t] = p[e * TB + t] * (g[e * TB + t] - acc[t]);
            }
        }
    }
    free(buf);
    return 0;
}

int mhc_sinkhorn_fwd(const float *z, int64_t M, int64_t N, int64_t iters, float eps, int64_t m0, int64_t m1,
                      float *out) {
    if (N == 4)
        return sinkhorn_fwd(z, M, 4, iters, eps, m0, m1, out);
    else
        return sinkhorn_fwd(z, M, N, iters, eps, m0, m1, out);
}

int mhc_sinkhorn_bwd(const float *z, const float *grad, int64_t M, int64_t N, int64_t iters, float eps,
                      int64_t m0, int64_t m1, float *dz) {
    if (N == 4)
        return sinkhorn_bwd(z, grad, M, 4, iters, eps, m0, m1, dz);
    else
        return sinkhorn_bwd(z, grad, M, N, iters, eps, m0, m1, dz);
}

/* ---------------------------------------------------------------------------------------------
 * The streams' two per-token products (HyperConnection in genome_lm/model/common.py), token-major:
 * streams s [M][N][D], block output / input y [M][D], pre and post [M][N], comb [M][N][N].
 *   collapse: x[d] = sum_n pre[n] s[n][d]                      (the block's input)
 *   merge:    out[j][d] = post[j] y[d] + sum_i comb[i][j] s[i][d]  (the new streams)
 * torch runs merge as a batched 4 x 4 by 4 x D product per token plus a broadcast product, and
 * their backwards as several more passes over [M, N, D]; here each token is one pass, forward and
 * backward. Tokens m0..m1-1 (each thread its own range).
 */
/* out[d] = sum_n coef[n * stride] rows[n][d] (+ out[d] when add): the weighted row sums that every
 * product here is made of. */
static inline __attribute__((always_inline)) void weighted_rows(float *out, const float *coef, int64_t stride,
                                                                const float *rows, int64_t N, int64_t D, int add) {
    for (int64_t n = 0; n < N; n++) {
        const float c = coef[n * stride];
        const float *r = rows + n * D;
        if (n == 0 && !add) {
#pragma omp simd
            for (int64_t d = 0; d < D; d++) out[d] = c * r[d];
        } else {
#pragma omp simd
            for (int64_t d = 0; d < D; d++) out[d] += c * r[d];
        }
    }
}

static inline __attribute__((always_inline)) void collapse_fwd(const float *pre, const float *s, int64_t N,
                                                               int64_t D, int64_t m0, int64_t m1, float *x) {
    for (int64_t m = m0; m < m1; m++) weighted_rows(x + m * D, pre + m * N, 1, s + m * N * D, N, D, 0);
}

/* dpre[n] = sum_d g[d] s[n][d];  ds[n][d] = pre[n] g[d] */
static inline __attribute__((always_inline)) void collapse_bwd(const float *pre, const float *s, const float *g,
                                                               int64_t N, int64_t D, int64_t m0, int64_t m1,
                                                               float *dpre, float *ds) {
    for (int64_t m = m0; m < m1; m++) {
        const float *sm = s + m * N * D, *pm = pre + m * N, *gm = g + m * D;
        float *dsm = ds + m * N * D;
        for (int64_t n = 0; n < N; n++) {
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) {
                acc += gm[d] * sm[n * D + d];
                dsm[n * D + d] = pm[n] * gm[d];
            }
            dpre[m * N + n] = acc;
        }
    }
}

static inline __attribute__((always_inline)) void merge_fwd(const float *post, const float *comb, const float *y,
                                                            const float *s, int64_t N, int64_t D, int64_t m0,
                                                            int64_t m1, float *out) {
    for (int64_t m = m0; m < m1; m++) {
        const float *sm = s + m * N * D, *ym = y + m * D, *pm = post + m * N, *cm = comb + m * N * N;
        float *om = out + m * N * D;
        for (int64_t j = 0; j < N; j++) {
            weighted_rows(om + j * D, pm + j, 0, ym, 1, D, 0);
            weighted_rows(om + j * D, cm + j, N, sm, N, D, 1);
        }
    }
}

/* dpost[j] = sum_d g[j][d] y[d];  dy[d] = sum_j post[j] g[j][d];
 * dcomb[i][j] = sum_d s[i][d] g[j][d];  ds[i][d] = sum_j comb[i][j] g[j][d] */
static inline __attribute__((always_inline)) void merge_bwd(const float *post, const float *comb, const float *y,
                                                            const float *s, const float *g, int64_t N, int64_t D,
                                                            int64_t m0, int64_t m1, float *dpost, float *dcomb,
                                                            float *dy, float *ds) {
    for (int64_t m = m0; m < m1; m++) {
        const float *sm = s + m * N * D, *ym = y + m * D, *pm = post + m * N, *cm = comb + m * N * N;
        const float *gm = g + m * N * D;
        float *dym = dy + m * D, *dsm = ds + m * N * D;
        for (int64_t j = 0; j < N; j++) {
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += gm[j * D + d] * ym[d];
            dpost[m * N + j] = acc;
        }
        weighted_rows(dym, pm, 1, gm, N, D, 0);
        for (int64_t i = 0; i < N; i++) {
            for (int64_t j = 0; j < N; j++) {
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t d = 0; d < D; d++) acc += sm[i * D + d] * gm[j * D + d];
                dcomb[m * N * N + i * N + j] = acc;
            }
            weighted_rows(dsm + i * D, cm + i * N, 1, gm, N, D, 0);
        }
    }
}

/* The exported entry points: N = 4 with D = 64 (the presets') get loops compiled for them. */
#define MHC_DISPATCH(call_fixed, call_any) \
    if (N == 4 && D == 64)                 \
        call_fixed;                        \
    else                                   \
        call_any;

int mhc_collapse_fwd(const float *pre, const float *s, int64_t N, int64_t D, int64_t m0, int64_t m1, float *x) {
    MHC_DISPATCH(collapse_fwd(pre, s, 4, 64, m0, m1, x), collapse_fwd(pre, s, N, D, m0, m1, x))
    return 0;
}

int mhc_collapse_bwd(const float *pre, const float *s, const float *g, int64_t N, int64_t D, int64_t m0, int64_t m1,
                      float *dpre, float *ds) {
    MHC_DISPATCH(collapse_bwd(pre, s, g, 4, 64, m0, m1, dpre, ds), collapse_bwd(pre, s, g, N, D, m0, m1, dpre, ds))
    return 0;
}

int mhc_merge_fwd(const float *post, const float *comb, const float *y, const float *s, int64_t N, int64_t D,
                   int64_t m0, int64_t m1, float *out) {
    MHC_DISPATCH(merge_fwd(post, comb, y, s, 4, 64, m0, m1, out), merge_fwd(post, comb, y, s, N, D, m0, m1, out))
    return 0;
}

int mhc_merge_bwd(const float *post, const float *comb, const float *y, const float *s, const float *g, int64_t N,
                   int64_t D, int64_t m0, int64_t m1, float *dpost, float *dcomb, float *dy, float *ds) {
    MHC_DISPATCH(merge_bwd(post, comb, y, s, g, 4, 64, m0, m1, dpost, dcomb, dy, ds),
                 merge_bwd(post, comb, y, s, g, N, D, m0, m1, dpost, dcomb, dy, ds))
    return 0;
}
