/* mHC's Sinkhorn normalisation for a CPU, fused (genome_lm/model/common.py's _sinkhorn_steps and
 * _sinkhorn_grad, which this matches): matrices laid out tokens-last, z [N][N][M], so every step
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

static inline __attribute__((always_inline)) void sinkhorn_fwd(const float *z, int64_t M, int64_t N, int64_t iters,
                                                               float eps, int64_t m0, int64_t m1, float *out) {
    float *c = malloc(sizeof(float) * (size_t)(N * N * TB + N * TB)), *den = c + N * N * TB;
    for (int64_t t0 = m0; t0 < m1; t0 += TB) {
        int64_t nt = m1 - t0 < TB ? m1 - t0 : TB;
        softmax_rows(z + t0, M, N, nt, c);
        for (int64_t e = 0; e < N * N; e++)
            for (int64_t t = 0; t < nt; t++) c[e * TB + t] += eps;
        for (int64_t s = 0; s < 2 * iters - 1; s++) normalise(c, N, nt, s % 2, eps, den);
        for (int64_t e = 0; e < N * N; e++) memcpy(out + e * M + t0, c + e * TB, sizeof(float) * (size_t)nt);
    }
    free(c);
}

static inline __attribute__((always_inline)) void sinkhorn_bwd(const float *z, const float *grad, int64_t M,
                                                               int64_t N, int64_t iters, float eps, int64_t m0,
                                                               int64_t m1, float *dz) {
    int64_t steps = 2 * iters - 1, NN = N * N;
    /* ys[s]: the output of step s; dens[s]: its denominators; p: the softmax; g: the gradient */
    float *buf = malloc(sizeof(float) * (size_t)((steps + 3) * NN * TB + steps * N * TB + TB));
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
}

void mhc_sinkhorn_fwd(const float *z, int64_t M, int64_t N, int64_t iters, float eps, int64_t m0, int64_t m1,
                      float *out) {
    if (N == 4)
        sinkhorn_fwd(z, M, 4, iters, eps, m0, m1, out);
    else
        sinkhorn_fwd(z, M, N, iters, eps, m0, m1, out);
}

void mhc_sinkhorn_bwd(const float *z, const float *grad, int64_t M, int64_t N, int64_t iters, float eps,
                      int64_t m0, int64_t m1, float *dz) {
    if (N == 4)
        sinkhorn_bwd(z, grad, M, 4, iters, eps, m0, m1, dz);
    else
        sinkhorn_bwd(z, grad, M, N, iters, eps, m0, m1, dz);
}
