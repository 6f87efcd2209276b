/* What the float32 kernels of `--dtype auto` share: one fixed order for a vector's sum. */
#ifndef MOONCAKE_LANES_H
#define MOONCAKE_LANES_H

#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma")))

/* The 8 lanes' sum in one fixed order. */
TARGET static inline float lanes_sum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif
