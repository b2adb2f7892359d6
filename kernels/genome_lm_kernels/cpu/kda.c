/* Kimi Delta Attention for a CPU, one token at a time (kda/reference.py's recurrence), forward
 * and backward, for the small heads of the CPU presets. Per (batch, head), state S [K][V]:
 *
 *   S' = exp(g_t)[:, None] * S;  u = S'^T k_t;  d = beta_t (v_t - u);  S = S' + k_t d^T;
 *   o_t = S^T (scale q_t)
 *
 * At K = V = 16 a token is ~4 K V multiply-adds on a state held in registers and L1; the chunked
 * torch path (kda/chunked.py) spends its time on ~100 small tensor ops per group instead.
 * Forward saves the state entering every block of BT tokens; backward recomputes a block's
 * decayed states S'_t from there and walks back through it:
 *
 *   dS += scale q do^T;  dq = scale S do;  dk = dS d;  dd = dS^T k;  dbeta = dd . (v - u);
 *   dv = beta dd;  du = -beta dd;  dS' = dS + k du^T;  dk += S' du;  dg = rowsum(dS' * S');
 *   dS_prev = exp(g)[:, None] * dS'
 *
 * Layouts: q, k, g [B][T][H][K], v [B][T][H][V], beta [B][T][H] (contiguous, fp32); states
 * [B*H][K][V]; saved block states [B*H][nblocks][K][V]. Rows r0..r1-1 of B*H (one per thread).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define BT 64 /* tokens per saved state */

/* dst = row r's state from src ([rows][n] floats), or zeros when there is none */
static inline void load_state(float *dst, const float *src, int64_t r, int64_t n) {
    if (src)
        memcpy(dst, src + r * n, sizeof(float) * (size_t)n);
    else
        memset(dst, 0, sizeof(float) * (size_t)n);
}

/* One token's write into the state: e = exp(g); S = e[:, None] * S (copied to Sd when given, the
 * decayed state S'); u = S'^T k; d = beta (v - u); S = S' + k d^T. */
static inline __attribute__((always_inline)) void token_write(float *S, const float *kt, const float *gt,
                                                              const float *vt, float bt, int64_t K, int64_t V,
                                                              float *e, float *u, float *d, float *Sd) {
    for (int64_t i = 0; i < K; i++) e[i] = exp_neg(gt[i]);
    for (int64_t j = 0; j < V; j++) u[j] = 0.0f;
    for (int64_t i = 0; i < K; i++) {
        float *Si = S + i * V;
        const float ei = e[i], ki = kt[i];
#pragma omp simd
        for (int64_t j = 0; j < V; j++) {
            Si[j] *= ei;
            u[j] += ki * Si[j];
        }
        if (Sd) memcpy(Sd + i * V, Si, sizeof(float) * (size_t)V);
    }
#pragma omp simd
    for (int64_t j = 0; j < V; j++) d[j] = bt * (vt[j] - u[j]);
    for (int64_t i = 0; i < K; i++) {
        float *Si = S + i * V;
        const float ki = kt[i];
#pragma omp simd
        for (int64_t j = 0; j < V; j++) Si[j] += ki * d[j];
    }
}

static inline __attribute__((always_inline)) int kda_fwd_rows(
    const float *q, const float *k, const float *v, const float *g, const float *beta, float scale,
    const float *S0, int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, int64_t r0, int64_t r1, float *o,
    float *S_final, float *S_blocks) {
    int64_t nblk = (T + BT - 1) / BT;
    float *S = malloc(sizeof(float) * (size_t)(K * V + 2 * V + K));
    if (!S) return GENOME_LM_NO_MEMORY;
    float *u = S + K * V, *d = u + V, *e = d + V;
    for (int64_t r = r0; r < r1; r++) {
        int64_t b = r / H, h = r % H;
        load_state(S, S0, r, K * V);
        for (int64_t t = 0; t < T; t++) {
            if (S_blocks && t % BT == 0)
                memcpy(S_blocks + (r * nblk + t / BT) * K * V, S, sizeof(float) * (size_t)(K * V));
            int64_t row = (b * T + t) * H + h;
            const float *qt = q + row * K, *kt = k + row * K, *gt = g + row * K, *vt = v + row * V;
            token_write(S, kt, gt, vt, beta[row], K, V, e, u, d, NULL);
            float *ot = o + row * V;
            for (int64_t j = 0; j < V; j++) ot[j] = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                const float *Si = S + i * V;
                const float qi = scale * qt[i];
#pragma omp simd
                for (int64_t j = 0; j < V; j++) ot[j] += qi * Si[j];
            }
        }
        if (S_final) memcpy(S_final + r * K * V, S, sizeof(float) * (size_t)(K * V));
    }
    free(S);
    return 0;
}

static inline __attribute__((always_inline)) int kda_bwd_rows(
    const float *q, const float *k, const float *v, const float *g, const float *beta, float scale,
    const float *S_blocks, const float *dO, const float *dS_final, int64_t B, int64_t T, int64_t H, int64_t K,
    int64_t V, int64_t r0, int64_t r1, float *dq, float *dk, float *dv, float *dg, float *dbeta, float *dS0) {
    int64_t nblk = (T + BT - 1) / BT;
    /* per block: the decayed states S'_t, u_t, d_t, exp(g_t); then S, dS, dd, du */
    float *buf = malloc(sizeof(float) * (size_t)(BT * (K * V + 2 * V + K) + 2 * K * V + 2 * V));
    if (!buf) return GENOME_LM_NO_MEMORY;
    float *Sd = buf, *us = Sd + BT * K * V, *ds = us + BT * V, *es = ds + BT * V;
    float *S = es + BT * K, *dS = S + K * V, *dd = dS + K * V, *du = dd + V;
    for (int64_t r = r0; r < r1; r++) {
        int64_t b = r / H, h = r % H;
        load_state(dS, dS_final, r, K * V);
        for (int64_t blk = nblk - 1; blk >= 0; blk--) {
            int64_t t0 = blk * BT, t1 = t0 + BT < T ? t0 + BT : T;
            memcpy(S, S_blocks + (r * nblk + blk) * K * V, sizeof(float) * (size_t)(K * V));
            for (int64_t t = t0; t < t1; t++) { /* the forward again, keeping S'_t, u_t, d_t */
                int64_t row = (b * T + t) * H + h, s = t - t0;
                const float *kt = k + row * K, *gt = g + row * K, *vt = v + row * V;
                token_write(S, kt, gt, vt, beta[row], K, V, es + s * K, us + s * V, ds + s * V, Sd + s * K * V);
            }
            for (int64_t t = t1 - 1; t >= t0; t--) {
                int64_t row = (b * T + t) * H + h, s = t - t0;
                const float *qt = q + row * K, *kt = k + row * K, *vt = v + row * V, *dot = dO + row * V;
                const float *e = es + s * K, *u = us + s * V, *d = ds + s * V, *Sdt = Sd + s * K * V;
                const float bt = beta[row];
                float dd_do = 0.0f; /* d . do, for dq through S = S' + k d^T */
#pragma omp simd reduction(+ : dd_do)
                for (int64_t j = 0; j < V; j++) dd_do += d[j] * dot[j];
                for (int64_t j = 0; j < V; j++) dd[j] = 0.0f;
                for (int64_t i = 0; i < K; i++) {
                    float *dSi = dS + i * V;
                    const float *Sdi = Sdt + i * V;
                    const float qi = scale * qt[i], ki = kt[i];
                    float acc_q = 0.0f, acc_k = 0.0f;
#pragma omp simd reduction(+ : acc_q, acc_k)
                    for (int64_t j = 0; j < V; j++) {
                        dSi[j] += qi * dot[j];
                        acc_q += Sdi[j] * dot[j];
                        acc_k += dSi[j] * d[j];
                        dd[j] += ki * dSi[j];
                    }
                    dq[row * K + i] = scale * (acc_q + ki * dd_do);
                    dk[row * K + i] = acc_k;
                }
                float db = 0.0f;
#pragma omp simd reduction(+ : db)
                for (int64_t j = 0; j < V; j++) {
                    db += dd[j] * (vt[j] - u[j]);
                    dv[row * V + j] = bt * dd[j];
                    du[j] = -bt * dd[j];
                }
                dbeta[row] = db;
                for (int64_t i = 0; i < K; i++) {
                    float *dSi = dS + i * V;
                    const float *Sdi = Sdt + i * V;
                    const float ki = kt[i], ei = e[i];
                    float acc_k = 0.0f, acc_g = 0.0f;
#pragma omp simd reduction(+ : acc_k, acc_g)
                    for (int64_t j = 0; j < V; j++) {
                        float dsd = dSi[j] + ki * du[j];
                        acc_k += Sdi[j] * du[j];
                        acc_g += dsd * Sdi[j];
                        dSi[j] = ei * dsd;
                    }
                    dk[row * K + i] += acc_k;
                    dg[row * K + i] = acc_g;
                }
            }
        }
        if (dS0) memcpy(dS0 + r * K * V, dS, sizeof(float) * (size_t)(K * V));
    }
    free(buf);
    return 0;
}

/* The exported entry points: K = V = 16 (the CPU presets' heads) get loops compiled for them. */
int kda_fwd(const float *q, const float *k, const float *v, const float *g, const float *beta, float scale,
             const float *S0, int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, int64_t r0, int64_t r1, float *o,
             float *S_final, float *S_blocks) {
    if (K == 16 && V == 16)
        return kda_fwd_rows(q, k, v, g, beta, scale, S0, B, T, H, 16, 16, r0, r1, o, S_final, S_blocks);
    else
        return kda_fwd_rows(q, k, v, g, beta, scale, S0, B, T, H, K, V, r0, r1, o, S_final, S_blocks);
}

int kda_bwd(const float *q, const float *k, const float *v, const float *g, const float *beta, float scale,
             const float *S_blocks, const float *dO, const float *dS_final, int64_t B, int64_t T, int64_t H, int64_t K,
             int64_t V, int64_t r0, int64_t r1, float *dq, float *dk, float *dv, float *dg, float *dbeta,
             float *dS0) {
    if (K == 16 && V == 16)
        return kda_bwd_rows(q, k, v, g, beta, scale, S_blocks, dO, dS_final, B, T, H, 16, 16, r0, r1, dq, dk, dv, dg, dbeta,
                     dS0);
    else
        return kda_bwd_rows(q, k, v, g, beta, scale, S_blocks, dO, dS_final, B, T, H, K, V, r0, r1, dq, dk, dv, dg, dbeta,
                     dS0);
}
