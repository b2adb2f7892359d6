/* Which of the built instruction-set levels this CPU runs (native.py imports the matching module):
 * 4 = x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), 3 = x86-64-v3 (AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE),
 * 0 = the baseline every build has. native.py asks the baseline module. */
#include "kernels.h"

const char *genome_lm_source_hash(void) { return GENOME_LM_SOURCE_HASH; }

int genome_lm_cpu_level(void) {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("bmi2"))
        return 4;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("lzcnt") &&
        __builtin_cpu_supports("movbe"))
        return 3;
#endif
    return 0;
}
