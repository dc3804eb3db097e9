/* Rotary embedding of the query and key heads of the fused qkv projection, in place, and the
   step's keys and values stored into the paged cache: one call per layer for what torch runs as
   ~10 ops (chunk, four products, a sum, a difference, cat, two index_copy_), each costing
   microseconds of dispatch at decode sizes.

   Rounded as transformers' apply_rotary_pos_emb rounds in the model dtype: x1*cos - x2*sin with
   each product and the difference rounded (HF's rotate_half convention: the two halves of the
   head dim form the pairs), so bf16 results are bit-identical to the torch path (float32 ones
   may differ in the last bit where the compiler fuses a product into the difference).

   Tokens are split across threads only for prefill-sized inputs (as in rms_norm.c). */

#include <stdint.h>
#include <string.h>

#include "dtype.h"

KERNEL_INLINE void rope_store_token(
    void *qkv, const void *cos, const void *sin, const int64_t *slots, void *k_cache,
    void *v_cache, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t cache_slots, int dtype) {
    const int64_t half = head_dim / 2, width = heads + 2 * kv_heads;
    const size_t row_bytes = (size_t)head_dim * (dtype == BF16 ? 2 : 4);
    for (int64_t h = 0; h < heads + kv_heads; h++) {
        const int64_t base = (t * width + h) * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = load(qkv, base + i, dtype), x2 = load(qkv, base + half + i, dtype);
            const float c = load(cos, t * half + i, dtype), s = load(sin, t * half + i, dtype);
            store(qkv, base + i, rnd(x1 * c, dtype) - rnd(x2 * s, dtype), dtype);
            store(qkv, base + half + i, rnd(x2 * c, dtype) + rnd(x1 * s, dtype), dtype);
        }
    }
    const char *src = (const char *)qkv + (size_t)(t * width + heads) * row_bytes;
    for (int64_t h = 0; h < kv_heads; h++) {
        const size_t dst = (size_t)(h * cache_slots + slots[t]) * row_bytes;
        memcpy((char *)k_cache + dst, src + (size_t)h * row_bytes, row_bytes);
        memcpy((char *)v_cache + dst, src + (size_t)(kv_heads + h) * row_bytes, row_bytes);
    }
}

/* qkv: [T, heads + 2 * kv_heads, D], q and k heads rotated in place; cos, sin: [T, D/2];
   slots: [T]; caches: [kv_heads, cache_slots, D]. */
#define EXPORT(NAME, DTYPE)                                                                     \
    int NAME(void *qkv, const void *cos, const void *sin, const int64_t *slots, void *k_cache,  \
             void *v_cache, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,  \
             int64_t cache_slots, int num_threads) {                                            \
        _Pragma("omp parallel for num_threads(num_threads) if (tokens >= 64)")                  \
        for (int64_t t = 0; t < tokens; t++)                                                    \
            rope_store_token(qkv, cos, sin, slots, k_cache, v_cache, t, heads, kv_heads,        \
                             head_dim, cache_slots, DTYPE);                                     \
        return 0;                                                                               \
    }

EXPORT(rope_store_f32, F32)
EXPORT(rope_store_bf16, BF16)
