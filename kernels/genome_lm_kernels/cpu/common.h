/* What genome-lm's C kernels share (included by dsa.c and mhc.c). */
#ifndef GENOME_LM_CPU_COMMON_H
#define GENOME_LM_CPU_COMMON_H

#include <stdint.h>

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

#endif
