/* bfloat16 linear layers at decode sizes: y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]), in place
   of torch's (oneDNN's) bf16 matmul for few rows.

   A decode step of a ~100M-parameter model reads every weight once per step. torch's bf16 matmul
   streamed them at ~12 GB/s for one row and ~6 GB/s for 32 rows on this project's 2-core EPYC
   (its kernels tile for large M and re-pack or re-read the weight), where the memory reads
   ~29 GB/s and llama.cpp's kernels reach ~20 GB/s. Here each tile of 4 weight rows is loaded into L1
   once and dotted with every row of x (which stays in L1/L2), so the weight crosses the memory
   bus once per call, and the products run on AVX512-BF16's dot-product instruction (pairs of
   bf16 multiplied and summed into float32 lanes). Accumulation is in float32 and the result
   rounded once to bf16, as oneDNN does; only the order of the float32 additions differs.

   The weight keeps torch's layout ([N, K] rows, as nn.Linear stores it): nothing is re-packed, so
   tensor-parallel loading, the torch path for prefill-sized inputs and checkpoints are untouched.
   Each 4x4 tile (4 rows of x by 4 weight rows) ends with the 16 dot products' 16-lane sums
   folded into one vector by `sum_lanes16` (simd.h).

   Without AVX512-BF16 (another CPU, another compiler) a portable loop computes the same thing
   and `linear_bf16_fast` returns 0, so the model keeps torch's matmul there. */

#include <stdint.h>

#include "dtype.h"
#include "simd.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define TILE_N 4
/* tiles ahead whose rows the first pass over a tile prefetches (1 to 16 measured alike here) */
#define PF_DIST 2

int linear_bf16_fast(void) { return HAVE_DPBF16; }

KERNEL_INLINE void store_out(uint16_t *y, const uint16_t *bias, int64_t N, int64_t m, int64_t n,
                             float acc) {
    if (bias) acc += bf16_to_float(bias[n]);
    y[m * N + n] = float_to_bf16(acc);
}

#if HAVE_DPBF16

/* Rows m0 .. m0+MT of y, columns n0 .. n0+TILE_N; MT is a constant at each call site so the
   accumulators live in registers. */
KERNEL_INLINE void tile(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                        int64_t N, int64_t K, int64_t m0, int64_t n0, int MT, int prefetch) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const uint16_t *xr[4], *wr[TILE_N];
    for (int i = 0; i < MT; i++) xr[i] = x + (m0 + i) * K;
    for (int j = 0; j < TILE_N; j++) wr[j] = w + (n0 + j) * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        if (prefetch)
            for (int j = 0; j < TILE_N; j++)
                _mm_prefetch((const char *)(wr[j] + PF_DIST * TILE_N * K + k), _MM_HINT_T0);
        __m512bh wv[TILE_N];
        for (int j = 0; j < TILE_N; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wr[j] + k);
        for (int i = 0; i < MT; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr[i] + k);
            for (int j = 0; j < TILE_N; j++)
                acc[i * TILE_N + j] = _mm512_dpbf16_ps(acc[i * TILE_N + j], xv, wv[j]);
        }
    }
    if (k < K) {  // the tail: masked loads read zeros past K
        const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv[TILE_N];
        for (int j = 0; j < TILE_N; j++)
            wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[j] + k);
        for (int i = 0; i < MT; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[i] + k);
            for (int j = 0; j < TILE_N; j++)
                acc[i * TILE_N + j] = _mm512_dpbf16_ps(acc[i * TILE_N + j], xv, wv[j]);
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, sum_lanes16(acc));
    for (int i = 0; i < MT; i++)
        for (int j = 0; j < TILE_N; j++) store_out(y, bias, N, m0 + i, n0 + j, sums[i * TILE_N + j]);
}

/* One weight tile of TILE_N rows against every row of x: the tile stays in L1 throughout. */
static void column_tile(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                        int64_t M, int64_t N, int64_t K, int64_t n0) {
    // the first pass over this tile also prefetches a later tile's rows (if there is one):
    // the weight comes from DRAM, and the other passes run from L1 meanwhile
    int prefetch = n0 + (PF_DIST + 1) * TILE_N <= N;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4, prefetch = 0) tile(x, w, bias, y, N, K, m, n0, 4, prefetch);
    switch (M - m) {
        case 3: tile(x, w, bias, y, N, K, m, n0, 3, prefetch); break;
        case 2: tile(x, w, bias, y, N, K, m, n0, 2, prefetch); break;
        case 1: tile(x, w, bias, y, N, K, m, n0, 1, prefetch); break;
        default: break;
    }
}

#endif

/* One output column n for every row, portably (the N % TILE_N columns, and CPUs without
   AVX512-BF16). */
static void column(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int64_t M, int64_t N, int64_t K, int64_t n) {
    for (int64_t m = 0; m < M; m++) {
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; k++)
            acc += bf16_to_float(x[m * K + k]) * bf16_to_float(w[n * K + k]);
        store_out(y, bias, N, m, n, acc);
    }
}

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]; all bf16, contiguous. Columns are split across
   threads, so each thread streams its own share of the weight. */
int linear_bf16(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                int64_t K, int num_threads) {
    const uint16_t *xs = x, *ws = w, *bs = bias;
    uint16_t *ys = y;
    const int64_t tiles = HAVE_DPBF16 ? N / TILE_N : 0;
#pragma omp parallel num_threads(num_threads)
    {
#if HAVE_DPBF16
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++) column_tile(xs, ws, bs, ys, M, N, K, t * TILE_N);
#endif
#pragma omp for schedule(static)
        for (int64_t n = tiles * TILE_N; n < N; n++) column(xs, ws, bs, ys, M, N, K, n);
    }
    return 0;
}
