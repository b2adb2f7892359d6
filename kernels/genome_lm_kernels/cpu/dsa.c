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

#include "common.h"
#include "kernels.h"

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The distinct valid keys of one row of S slots, into keys; returns how many. */
static int64_t row_keys(const int32_t *ix, int64_t S, int64_t *keys) {
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

static inline float dot(const float *restrict a, const float *restrict b, int64_t D) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; d++) acc += a[d] * b[d];
    return acc;
}

/* Scores of one row's n keys, head-major: s[h * S + i] = scale * q[h] . k[key i, h]. */
static inline __attribute__((always_inline)) void row_scores(const float *restrict qr, const float *restrict k,
                                                             int64_t base, const int64_t *keys, int64_t n, int64_t S,
                                                             int64_t H, int64_t D, float scale, float *restrict s) {
    for (int64_t i = 0; i < n; i++) {
        const float *kr = k + (base + keys[i]) * H * D;
        for (int64_t h = 0; h < H; h++) s[h * S + i] = scale * dot(qr + h * D, kr + h * D, D);
    }
}

/* mx[h]: the maximum over i < n of s[h * S + i] (the forward's softmax shift). */
static void row_max(const float *restrict s, int64_t n, int64_t S, int64_t H, float *restrict mx) {
    for (int64_t h = 0; h < H; h++) {
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
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
static inline __attribute__((always_inline)) int sparse_fwd(
    const float *q, const float *k, const float *v, const int32_t *idx, int64_t r0, int64_t r1, int64_t T,
    int64_t S, int64_t H, int64_t D, int64_t Dv, float scale, float *o, float *lse) {
    float *s = malloc(sizeof(float) * (size_t)(S * H + 2 * H));
    int64_t *keys = malloc(sizeof(int64_t) * (size_t)S);
    if (!s || !keys) {
        free(s);
        free(keys);
        return GENOME_LM_NO_MEMORY;
    }
    float *mx = s + S * H, *sum = mx + H;
    for (int64_t r = r0; r < r1; r++) {
        int64_t base = r / T * T, n = row_keys(idx + r * S, S, keys);
        float *orow = o + r * H * Dv;
        memset(orow, 0, sizeof(float) * (size_t)(H * Dv));
        if (n == 0) {
            for (int64_t h = 0; h < H; h++) lse[r * H + h] = -INFINITY;
            continue;
        }
        row_scores(q + r * H * D, k, base, keys, n, S, H, D, scale, s);
        row_max(s, n, S, H, mx);
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
    return 0;
}

/* Gradients for rows r0..r1-1: dq [R, H, D] written, dk [R, H, D] and dv [R, H, Dv] added to
 * (the caller gives each thread its own dk, dv). delta [R, H] = rowsum(do * o) - dlse. */
static inline __attribute__((always_inline)) int sparse_bwd(
    const float *q, const float *k, const float *v, const int32_t *idx, const float *lse, const float *dout,
    const float *delta, int64_t r0, int64_t r1, int64_t T, int64_t S, int64_t H, int64_t D, int64_t Dv,
    float scale, float *dq, float *dk, float *dv) {
    float *s = malloc(sizeof(float) * (size_t)(S * H));
    int64_t *keys = malloc(sizeof(int64_t) * (size_t)S);
    if (!s || !keys) {
        free(s);
        free(keys);
        return GENOME_LM_NO_MEMORY;
    }
    for (int64_t r = r0; r < r1; r++) {
        int64_t base = r / T * T, n = row_keys(idx + r * S, S, keys);
        const float *qr = q + r * H * D, *dor = dout + r * H * Dv;
        float *dqr = dq + r * H * D;
        memset(dqr, 0, sizeof(float) * (size_t)(H * D));
        if (n == 0) continue;
        row_scores(qr, k, base, keys, n, S, H, D, scale, s);
        row_exp(s, n, S, H, lse + r * H, NULL);  /* p, shifted by the forward's lse */
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
    return 0;
}

/* The exported entry points: head widths of 16 (the tiny presets) get a copy of the loops compiled
 * for that width (fully unrolled dot products, about 2x faster); any other width the general one. */
int dsa_sparse_fwd(const float *q, const float *k, const float *v, const int32_t *idx, int64_t r0, int64_t r1,
                    int64_t T, int64_t S, int64_t H, int64_t D, int64_t Dv, float scale, float *o, float *lse) {
    if (D == 16 && Dv == 16)
        return sparse_fwd(q, k, v, idx, r0, r1, T, S, H, 16, 16, scale, o, lse);
    else
        return sparse_fwd(q, k, v, idx, r0, r1, T, S, H, D, Dv, scale, o, lse);
}

int dsa_sparse_bwd(const float *q, const float *k, const float *v, const int32_t *idx, const float *lse,
                    const float *dout, const float *delta, int64_t r0, int64_t r1, int64_t T, int64_t S,
                    int64_t H, int64_t D, int64_t Dv, float scale, float *dq, float *dk, float *dv) {
    if (D == 16 && Dv == 16)
        return sparse_bwd(q, k, v, idx, lse, dout, delta, r0, r1, T, S, H, 16, 16, scale, dq, dk, dv);
    else
        return sparse_bwd(q, k, v, idx, lse, dout, delta, r0, r1, T, S, H, D, Dv, scale, dq, dk, dv);
}

/* ------------------------------------------------------------------------------------------------
 * The indexer loss, dense mode (../dsa/loss.py's torch path, which this matches): for each query t
 * with M = min(N, (t + 1) / kpool) complete pools visible,
 *   p[m]  = sum over heads h of softmax_j(scale q[t,h] . k[j,h], j <= t), summed over pool m's
 *           tokens, L1-normalised over the M pools (the incomplete tail pool is dropped);
 *   I[m]  = sum_h w[t,h] relu(idx_scale qi[t,h] . kp[m]);
 *   kl[t] = sum_m p[m] (log p[m] - log_softmax(I)[m])   (terms with p[m] = 0 left out),
 * and, in the same pass, kl[t]'s gradient with respect to qi[t], w[t] and kp (dkl/dI = softmax(I)
 * - p): the caller scales them by the loss's gradient / the number of rows, so backward
 * recomputes nothing. Keys are laid out transposed, kT [B][H * D][T] and kpT [B][Di][N], so that
 * the scores run along keys with the query's values broadcast (no horizontal sums); the pooled
 * keys also as rows, kp [B][N][Di], for the gradients. Rows r0..r1-1 of the flattened [B * T];
 * dkp [B][N][Di] is added to (one per thread).
 */
/* 16 floats as one value (GCC / Clang vector extension: one zmm register with AVX-512, two ymm
 * with AVX2), so that a tile's partial sums stay in registers; loads and stores go through memcpy
 * (unaligned). */
typedef float f32x16 __attribute__((vector_size(64)));
#define KEY_TILE 64 /* keys scored at a time: 4 x 16 partial sums */

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out[j] = scale * sum_d x[d] * kT[d * ld + j] for j < n (x of D values; kT rows of ld floats). */
static inline __attribute__((always_inline)) void scores_along_keys(const float *restrict x,
                                                                    const float *restrict kT, int64_t ld,
                                                                    int64_t D, int64_t n, float scale,
                                                                    float *restrict out) {
    int64_t j0 = 0;
    for (; j0 + KEY_TILE <= n; j0 += KEY_TILE) {
        f32x16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t d = 0; d < D; d++) {
            const float *row = kT + d * ld + j0;
            f32x16 xd = (f32x16){0} + x[d] * scale;
            a0 += xd * load16(row);
            a1 += xd * load16(row + 16);
            a2 += xd * load16(row + 32);
            a3 += xd * load16(row + 48);
        }
        memcpy(out + j0, &a0, sizeof a0);
        memcpy(out + j0 + 16, &a1, sizeof a1);
        memcpy(out + j0 + 32, &a2, sizeof a2);
        memcpy(out + j0 + 48, &a3, sizeof a3);
    }
    for (int64_t j = j0; j < n; j++) out[j] = 0.0f;
    for (int64_t d = 0; d < D; d++) {
        const float *row = kT + d * ld;
        float xd = x[d] * scale;
#pragma omp simd
        for (int64_t j = j0; j < n; j++) out[j] += xd * row[j];
    }
}

static inline __attribute__((always_inline)) int indexer_loss_dense(
    const float *q, const float *kT, const float *qi, const float *kp, const float *kpT, const float *w,
    int64_t r0, int64_t r1, int64_t T, int64_t N, int64_t H, int64_t D, int64_t Hi, int64_t Di, int64_t kpool,
    float scale, float idx_scale, float *kl, float *dqi, float *dw, float *dkp) {
    float *buf = malloc(sizeof(float) * (size_t)(2 * T + (Hi + 3) * N));
    if (!buf) return GENOME_LM_NO_MEMORY;
    float *attn = buf + T, *p = attn + T, *I = p + N, *dI = I + N, *s = dI + N;
    for (int64_t r = r0; r < r1; r++) {
        int64_t b = r / T, t = r % T, n = t + 1, M = n / kpool < N ? n / kpool : N;
        float *dqr = dqi + r * Hi * Di, *dwr = dw + r * Hi;
        memset(dqr, 0, sizeof(float) * (size_t)(Hi * Di));
        memset(dwr, 0, sizeof(float) * (size_t)Hi);
        kl[r] = 0.0f;
        if (M == 0) continue;
        /* target: softmax over keys 0..t per head, summed over heads, pooled, normalised */
        const float *kTb = kT + b * H * D * T;
        for (int64_t j = 0; j < M * kpool; j++) attn[j] = 0.0f;
        for (int64_t h = 0; h < H; h++) {
            scores_along_keys(q + (r * H + h) * D, kTb + h * D * T, T, D, n, scale, buf);
            float mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < n; j++) mx = buf[j] > mx ? buf[j] : mx;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                float e = exp_neg(buf[j] - mx);
                buf[j] = e;
                sum += e;
            }
            float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t j = 0; j < M * kpool; j++) attn[j] += buf[j] * inv;
        }
        float total = 0.0f;
        for (int64_t m = 0; m < M; m++) {
            float pm = 0.0f;
            for (int64_t i = 0; i < kpool; i++) pm += attn[m * kpool + i];
            p[m] = pm;
            total += pm;
        }
        float inv_total = 1.0f / (total > 1.17549435e-38f ? total : 1.17549435e-38f);
        /* indexer scores I[m] = sum_h w[h] relu(s[h][m]) */
        const float *kpTb = kpT + b * Di * N, *qir = qi + r * Hi * Di, *wr = w + r * Hi;
        for (int64_t m = 0; m < M; m++) I[m] = 0.0f;
        for (int64_t h = 0; h < Hi; h++) {
            float *sh = s + h * N;
            scores_along_keys(qir + h * Di, kpTb, N, Di, M, idx_scale, sh);
            float wh = wr[h];
#pragma omp simd
            for (int64_t m = 0; m < M; m++) I[m] += wh * (sh[m] > 0.0f ? sh[m] : 0.0f);
        }
        float mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx)
        for (int64_t m = 0; m < M; m++) mx = I[m] > mx ? I[m] : mx;
        for (int64_t m = 0; m < M; m++) sum += exp_neg(I[m] - mx);
        float lse = mx + logf(sum), acc = 0.0f;
        for (int64_t m = 0; m < M; m++) {
            float pm = p[m] * inv_total;
            float logq = I[m] - lse;
            if (pm > 0.0f) acc += pm * (logf(pm > 1.17549435e-38f ? pm : 1.17549435e-38f) - logq);
            dI[m] = exp_neg(logq) - pm;
        }
        kl[r] = acc;
        /* gradients: dw[h] = sum_m dI relu(s_h); ds_h = dI w[h] [s_h > 0] idx_scale;
         * dqi[h] = sum_m ds_h[m] kp[m]; dkp[m] += sum_h ds_h[m] qi[h] */
        for (int64_t h = 0; h < Hi; h++) {
            float *sh = s + h * N, wh = wr[h] * idx_scale, g = 0.0f;
#pragma omp simd reduction(+ : g)
            for (int64_t m = 0; m < M; m++) {
                float pos = sh[m] > 0.0f ? sh[m] : 0.0f;
                g += dI[m] * pos;
                sh[m] = sh[m] > 0.0f ? dI[m] * wh : 0.0f; /* s_h becomes ds_h */
            }
            dwr[h] = g;
        }
        const float *kpb = kp + b * N * Di;
        float *dkpb = dkp + b * N * Di;
        if (Di == 16 && Hi <= 8) { /* a pooled key is one vector: one pass over the pools */
            f32x16 dq[8] = {{0}}, qv[8];
            for (int64_t h = 0; h < Hi; h++) qv[h] = load16(qir + h * 16);
            for (int64_t m = 0; m < M; m++) {
                f32x16 kv = load16(kpb + m * 16), dk = load16(dkpb + m * 16);
                for (int64_t h = 0; h < Hi; h++) {
                    float c = s[h * N + m];
                    dq[h] += c * kv;
                    dk += c * qv[h];
                }
                memcpy(dkpb + m * 16, &dk, sizeof dk);
            }
            for (int64_t h = 0; h < Hi; h++) memcpy(dqr + h * 16, &dq[h], sizeof dq[h]);
        } else {
            for (int64_t m = 0; m < M; m++) {
                const float *km = kpb + m * Di;
                float *dkm = dkpb + m * Di;
                for (int64_t h = 0; h < Hi; h++) {
                    float c = s[h * N + m];
                    const float *qh = qir + h * Di;
                    float *dqh = dqr + h * Di;
#pragma omp simd
                    for (int64_t d = 0; d < Di; d++) {
                        dqh[d] += c * km[d];
                        dkm[d] += c * qh[d];
                    }
                }
            }
        }
    }
    free(buf);
    return 0;
}

int dsa_indexer_loss_dense(const float *q, const float *kT, const float *qi, const float *kp, const float *kpT,
                            const float *w, int64_t r0, int64_t r1, int64_t T, int64_t N, int64_t H, int64_t D,
                            int64_t Hi, int64_t Di, int64_t kpool, float scale, float idx_scale, float *kl,
                            float *dqi, float *dw, float *dkp) {
    if (D == 16 && Di == 16)
        return indexer_loss_dense(q, kT, qi, kp, kpT, w, r0, r1, T, N, H, 16, Hi, 16, kpool, scale, idx_scale, kl, dqi,
                           dw, dkp);
    else
        return indexer_loss_dense(q, kT, qi, kp, kpT, w, r0, r1, T, N, H, D, Hi, Di, kpool, scale, idx_scale, kl, dqi,
                           dw, dkp);
}

/* ------------------------------------------------------------------------------------------------
 * Token selection (../dsa/indexer.py's select_tokens, which this matches slot for slot): for each
 * query t, the indexer scores of its M = min(N, (t + 1) / kpool) complete pools,
 *   I[m] = sum_h w[t,h] relu(scale qi[t,h] . kp[m]),
 * the top min(n_pick, M) of them (ties to the lower pool), written ascending as kpool tokens each
 * into n_pick pool slots, then the query's incomplete tail pool, then -1 padding: S = topk + kpool
 * - 1 slots. Row r is query t0 + r % T of sequence r / T (t0 > 0: a chunked prefill's later
 * chunk, whose N pools are those complete so far). Each score depends on its own row and pool
 * only (the same sums in the same order whatever M is), so a chunk selects what the whole
 * sequence does.
 */

/* The k-th largest of x[0..n-1] (1 <= k <= n); reorders x. Quickselect, median-of-three pivot. */
static float kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1; /* position in descending order */
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        float a = x[lo], b = x[mid], c = x[hi];
        float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: larger values to the left */
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) {
                float tmp = x[i];
                x[i++] = x[j];
                x[j--] = tmp;
            }
        }
        if (want <= j)
            hi = j;
        else if (want >= i)
            lo = i;
        else
            return x[want]; /* between j and i: equal to the pivot */
    }
    return x[lo];
}

/* The pools of the k largest of I[0..M-1] (ties to the lower pool), ascending, as kpool tokens each
 * into row (returns the slots written). Exact, without sorting the row: the k-th largest block
 * maximum (blocks of PICK_BLOCK pools) is a lower bound of the k-th largest score (k blocks reach
 * it), so only the blocks whose maximum reaches it hold candidates; the k-th largest candidate is
 * the threshold. work: M + M / PICK_BLOCK + 1 floats. */
#define PICK_BLOCK 16
static int64_t pick_top(const float *I, int64_t M, int64_t k, int64_t kpool, float *work, int32_t *row) {
    int64_t nb = (M + PICK_BLOCK - 1) / PICK_BLOCK;
    float *bmax = work + M;
    for (int64_t j = 0; j < nb; j++) {
        int64_t a = j * PICK_BLOCK, e = a + PICK_BLOCK < M ? a + PICK_BLOCK : M;
        float mx = -INFINITY;
        for (int64_t m = a; m < e; m++) mx = I[m] > mx ? I[m] : mx;
        bmax[j] = mx;
    }
    float bound = -INFINITY; /* fewer blocks than k: every pool is a candidate */
    if (k <= nb) {
        memcpy(work, bmax, sizeof(float) * (size_t)nb);
        bound = kth_largest(work, nb, k);
    }
    int64_t n = 0;
    for (int64_t j = 0; j < nb; j++) {
        if (bmax[j] < bound) continue;
        int64_t a = j * PICK_BLOCK, e = a + PICK_BLOCK < M ? a + PICK_BLOCK : M;
        for (int64_t m = a; m < e; m++)
            if (I[m] >= bound) work[n++] = I[m];
    }
    float thr = kth_largest(work, n, k);
    int64_t above = 0;
    for (int64_t j = 0; j < nb; j++) {
        if (bmax[j] < thr) continue;
        int64_t a = j * PICK_BLOCK, e = a + PICK_BLOCK < M ? a + PICK_BLOCK : M;
        for (int64_t m = a; m < e; m++) above += I[m] > thr;
    }
    int64_t ties = k - above, slot = 0; /* pools scoring exactly thr to take, the lowest first */
    for (int64_t j = 0; j < nb && slot < k * kpool; j++) {
        if (bmax[j] < thr) continue;
        int64_t a = j * PICK_BLOCK, e = a + PICK_BLOCK < M ? a + PICK_BLOCK : M;
        for (int64_t m = a; m < e; m++)
            if (I[m] > thr || (I[m] == thr && ties-- > 0))
                for (int64_t i = 0; i < kpool; i++) row[slot++] = (int32_t)(m * kpool + i);
    }
    return slot;
}

static inline __attribute__((always_inline)) int select_tokens(
    const float *qi, const float *kpT, const float *w, int64_t r0, int64_t r1, int64_t T, int64_t N, int64_t Hi,
    int64_t Di, int64_t kpool, int64_t topk, int64_t n_pick, int64_t t0, float scale, int32_t *out) {
    int64_t S = topk + kpool - 1;
    float *buf = malloc(sizeof(float) * (size_t)(3 * N + N / PICK_BLOCK + 2));
    if (!buf) return GENOME_LM_NO_MEMORY;
    float *I = buf, *sh = I + N, *work = sh + N;
    for (int64_t r = r0; r < r1; r++) {
        int64_t b = r / T, t = t0 + r % T, M = (t + 1) / kpool < N ? (t + 1) / kpool : N;
        int64_t k = n_pick < M ? n_pick : M;
        int32_t *row = out + r * S;
        for (int64_t s = 0; s < S; s++) row[s] = -1;
        if (k > 0) {
            const float *kpTb = kpT + b * Di * N, *qir = qi + r * Hi * Di, *wr = w + r * Hi;
            for (int64_t m = 0; m < M; m++) I[m] = 0.0f;
            for (int64_t h = 0; h < Hi; h++) {
                scores_along_keys(qir + h * Di, kpTb, N, Di, M, scale, sh);
                float wh = wr[h];
#pragma omp simd
                for (int64_t m = 0; m < M; m++) I[m] += wh * (sh[m] > 0.0f ? sh[m] : 0.0f);
            }
            pick_top(I, M, k, kpool, work, row);
        }
        int64_t start = t + 1 - (t + 1) % kpool; /* the incomplete tail pool: start .. t */
        for (int64_t i = 0; i < kpool - 1 && start + i <= t; i++) row[n_pick * kpool + i] = (int32_t)(start + i);
    }
    free(buf);
    return 0;
}

int dsa_select_tokens(const float *qi, const float *kpT, const float *w, int64_t r0, int64_t r1, int64_t T,
                       int64_t N, int64_t Hi, int64_t Di, int64_t kpool, int64_t topk, int64_t n_pick, int64_t t0,
                       float scale, int32_t *out) {
    if (Di == 16)
        return select_tokens(qi, kpT, w, r0, r1, T, N, Hi, 16, kpool, topk, n_pick, t0, scale, out);
    else
        return select_tokens(qi, kpT, w, r0, r1, T, N, Hi, Di, kpool, topk, n_pick, t0, scale, out);
}
