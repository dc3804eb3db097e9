/* Residual add and RMSNorm of each row in one pass, as transformers computes them:
   sum = x + residual (rounded to the model dtype), out = weight * (sum * rsqrt(mean(sum^2) + eps))
   with the normalisation in float32, rounded to the model dtype, then scaled by the weight and
   rounded again. Replaces ~8 small torch ops per norm (tens of microseconds each at decode sizes).

   Rows are split across threads only for prefill-sized inputs: at decode sizes a parallel region
   costs more than the work, and each one is a barrier where a preempted thread stalls the other.

   Built by replicas/kernels/__init__.py together with the other kernels. */

#include <math.h>
#include <stdint.h>

#include "dtype.h"

/* One row, rounded after each op as torch rounds. */
KERNEL_INLINE void norm_row(
    const void *x, void *residual, const void *weight, float eps, void *out, int64_t r,
    int64_t dim, int dtype) {
    const int64_t base = r * dim;
    float ss = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        float s = load(x, base + d, dtype);
        if (residual) {
            s = rnd(s + load(residual, base + d, dtype), dtype);
            store(residual, base + d, s, dtype);
        }
        ss += s * s;
    }
    const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    const void *src = residual ? residual : x;
    for (int64_t d = 0; d < dim; d++)
        store(out, base + d, load(weight, d, dtype) * rnd(load(src, base + d, dtype) * inv, dtype),
              dtype);
}

/* x, out: [rows, dim]; residual: [rows, dim] or NULL (no add); weight: [dim]. One function per
   dtype, each with its own parallel region, so the dtype is a constant in the loop body. */
#define EXPORT(NAME, DTYPE)                                                                     \
    int NAME(const void *x, void *residual, const void *weight, float eps, void *out,           \
             int64_t rows, int64_t dim, int num_threads) {                                      \
        _Pragma("omp parallel for num_threads(num_threads) if (rows >= 64)")                    \
        for (int64_t r = 0; r < rows; r++)                                                      \
            norm_row(x, residual, weight, eps, out, r, dim, DTYPE);                             \
        return 0;                                                                               \
    }

EXPORT(add_rms_norm_f32, F32)
EXPORT(add_rms_norm_bf16, BF16)
