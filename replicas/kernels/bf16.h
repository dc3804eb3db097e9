/* bfloat16 <-> float32 on bit patterns, shared by the kernels: widening is a shift; narrowing
   rounds to nearest even, as torch does (the kernels' values are finite). */
#pragma once
#include <stdint.h>

static inline uint32_t bf16_widen(uint16_t h) { return (uint32_t)h << 16; }

static inline uint16_t bf16_narrow(uint32_t f) {
    return (uint16_t)((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
}
