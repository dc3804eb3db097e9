/* AVX-512 helpers shared by the kernels. */
#pragma once
#include "dtype.h"

#ifdef __AVX512F__
#include <immintrin.h>

/* x[t] holds partial sums of item t in its 16 lanes; returns the 16 totals, item t in lane t.
   A transpose-and-add tree: 45 shuffles and adds instead of 16 separate horizontal sums (which
   cost as much as the dot products feeding them at head dim 64 or K = 576). */
KERNEL_INLINE __m512 sum_lanes16(const __m512 *x) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  // within 128-bit lanes: interleaved pair sums
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // each 128-bit lane: the sums of its part of 4 items
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // across 128-bit lanes: pair lanes (0, 1) and (2, 3), twice
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], even),
                               _mm512_shuffle_f32x4(u[0], u[1], odd));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], even),
                               _mm512_shuffle_f32x4(u[2], u[3], odd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, even),
                         _mm512_shuffle_f32x4(s01, s23, odd));
}
#endif
