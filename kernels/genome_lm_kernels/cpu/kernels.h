/* The C kernels' entry points: the one declaration of each, included by every source (so the
 * compiler checks each definition against it) and read by build.py as the Python side's cdef
 * (so the calls from Python are compiled against it too). Every entry point works on rows
 * [r0, r1) (or tokens [m0, m1)) of flattened, contiguous fp32 arrays and returns 0, or
 * GENOME_LM_NO_MEMORY when a work buffer could not be allocated (nothing is written then). */
#ifndef GENOME_LM_CPU_KERNELS_H
#define GENOME_LM_CPU_KERNELS_H

#include <stdint.h>

#define GENOME_LM_NO_MEMORY 1


/* dsa.c */
int dsa_sparse_fwd(const float *q, const float *k, const float *v, const int32_t *idx, int64_t r0, int64_t r1,
                   int64_t T, int64_t S, int64_t H, int64_t D, int64_t Dv, float scale, float *o, float *lse);
int dsa_sparse_bwd(const float *q, const float *k, const float *v, const int32_t *idx, const float *lse,
                   const float *dout, const float *delta, int64_t r0, int64_t r1, int64_t T, int64_t S, int64_t H,
                   int64_t D, int64_t Dv, float scale, float *dq, float *dk, float *dv);
int dsa_indexer_loss_dense(const float *q, const float *kT, const float *qi, const float *kp, const float *kpT,
                           const float *w, int64_t r0, int64_t r1, int64_t T, int64_t N, int64_t H, int64_t D,
                           int64_t Hi, int64_t Di, int64_t kpool, float scale, float idx_scale, float *kl,
                           float *dqi, float *dw, float *dkp);
int dsa_select_tokens(const float *qi, const float *kpT, const float *w, int64_t r0, int64_t r1, int64_t T,
                      int64_t N, int64_t Hi, int64_t Di, int64_t kpool, int64_t topk, int64_t n_pick, int64_t t0,
                      float scale, int32_t *out);

/* kda.c */
int kda_fwd(const float *q, const float *k, const float *v, const float *g, const float *beta, float scale,
            const float *S0, int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, int64_t r0, int64_t r1,
            float *o, float *S_final, float *S_blocks);
int kda_bwd(const float *q, const float *k, const float *v, const float *g, const float *beta, float scale,
            const float *S_blocks, const float *dO, const float *dS_final, int64_t B, int64_t T, int64_t H,
            int64_t K, int64_t V, int64_t r0, int64_t r1, float *dq, float *dk, float *dv, float *dg, float *dbeta,
            float *dS0);

/* mhc.c */
int mhc_sinkhorn_fwd(const float *z, int64_t M, int64_t N, int64_t iters, float eps, int64_t m0, int64_t m1,
                     float *out);
int mhc_sinkhorn_bwd(const float *z, const float *grad, int64_t M, int64_t N, int64_t iters, float eps, int64_t m0,
                     int64_t m1, float *dz);
int mhc_collapse_fwd(const float *pre, const float *s, int64_t N, int64_t D, int64_t m0, int64_t m1, float *x);
int mhc_collapse_bwd(const float *pre, const float *s, const float *g, int64_t N, int64_t D, int64_t m0, int64_t m1,
                     float *dpre, float *ds);
int mhc_merge_fwd(const float *post, const float *comb, const float *y, const float *s, int64_t N, int64_t D,
                  int64_t m0, int64_t m1, float *out);
int mhc_merge_bwd(const float *post, const float *comb, const float *y, const float *s, const float *g, int64_t N,
                  int64_t D, int64_t m0, int64_t m1, float *dpost, float *dcomb, float *dy, float *ds);

/* level.c */
int genome_lm_cpu_level(void);
const char *genome_lm_source_hash(void);

#endif
