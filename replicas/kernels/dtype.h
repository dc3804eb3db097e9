/* Element types shared by the kernels: float32 and bfloat16, the latter handled on bit patterns
   (widening is a shift; narrowing rounds to nearest even, as torch does; values are finite).
   load/store/rnd take the dtype as an argument that is a constant at every call site, so each
   exported function compiles to straight-line code for its type. */
#pragma once
#include <stdint.h>

enum { F32 = 0, BF16 = 1 };

#define KERNEL_INLINE static inline __attribute__((always_inline))

KERNEL_INLINE uint32_t bf16_widen(uint16_t h) { return (uint32_t)h << 16; }

KERNEL_INLINE uint16_t bf16_narrow(uint32_t f) {
    return (uint16_t)((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}

KERNEL_INLINE float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = bf16_widen(h);
    return v.f;
}

KERNEL_INLINE uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    return bf16_narrow(v.u);
}

/* element i of p, as float */
KERNEL_INLINE float load(const void *p, int64_t i, int dtype) {
    return dtype == BF16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

KERNEL_INLINE void store(void *p, int64_t i, float f, int dtype) {
    if (dtype == BF16)
        ((uint16_t *)p)[i] = float_to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* the rounding to the model dtype that torch applies after each elementwise op */
KERNEL_INLINE float rnd(float f, int dtype) {
    return dtype == BF16 ? bf16_to_float(float_to_bf16(f)) : f;
}
