/* Residual add and RMSNorm of each row in one pass, as transformers computes them:
   sum = x + residual (rounded to the model dtype), out = weight * (sum * rsqrt(mean(sum^2) + eps))
   with the normalisation in float32, rounded to the model dtype, then scaled by the weight and
   rounded again. Replaces ~8 small torch ops per norm (tens of microseconds each at decode sizes).

   Rows are split across threads only for prefill-sized inputs: at decode sizes a parallel region
   costs more than the work, and each one is a barrier where a preempted thread stalls the other.

   Built by replicas/kernels/__init__.py together with paged_attention.c. */

#include <math.h>
#include <stdint.h>

static inline float bf16_load(const uint16_t *p, int64_t i) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)p[i] << 16;
    return v.f;
}

static inline float bf16_round(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    v.u = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
    return v.f;
}

static inline void bf16_store(uint16_t *p, int64_t i, float f) {
    union { uint32_t u; float f; } v;
    v.f = bf16_round(f);
    p[i] = (uint16_t)(v.u >> 16);
}

/* x, out: [rows, dim]; residual: [rows, dim] or NULL (then no add and no sum written);
   sum_out: [rows, dim] (may alias residual); weight: [dim]. */
int add_rms_norm_f32(const float *x, float *residual, const float *weight, float eps, float *out,
                     int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *res = residual ? residual + r * dim : 0;
        float ss = 0.0f;
        for (int64_t d = 0; d < dim; d++) {
            float s = res ? xr[d] + res[d] : xr[d];
            if (res) res[d] = s;
            ss += s * s;
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        const float *src = res ? res : xr;
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = weight[d] * (src[d] * inv);
    }
    return 0;
}

int add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight, float eps,
                      uint16_t *out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *res = residual ? residual + r * dim : 0;
        float ss = 0.0f;
        for (int64_t d = 0; d < dim; d++) {
            float s = res ? bf16_round(bf16_load(xr, d) + bf16_load(res, d)) : bf16_load(xr, d);
            if (res) bf16_store(res, d, s);
            ss += s * s;
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        const uint16_t *src = res ? res : xr;
        for (int64_t d = 0; d < dim; d++)
            bf16_store(out, r * dim + d, bf16_load(weight, d) * bf16_round(bf16_load(src, d) * inv));
    }
    return 0;
}
