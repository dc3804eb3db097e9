/* Rotary embedding of the query and key heads of the fused qkv projection, in place, and the
   step's keys and values stored into the paged cache: one call per layer for what torch runs as
   ~10 ops (chunk, four products, a sum, a difference, cat, two index_copy_), each costing
   microseconds of dispatch at decode sizes.

   Rounded as transformers' apply_rotary_pos_emb rounds in the model dtype: x1*cos - x2*sin with
   each product and the difference rounded (HF's rotate_half convention: the two halves of the
   head dim form the pairs), so bf16 results are bit-identical to the torch path (float32 ones
   may differ in the last bit where the compiler fuses a product into the difference).

   The cache may hold a narrower type than the activations (float32 compute over a bf16 cache:
   `--kv-cache-dtype`); each key and value is then rounded to it as it is stored.

   Tokens are split across threads only for prefill-sized inputs (as in rms_norm.c). */

#include <stdint.h>
#include <string.h>

#include "dtype.h"

KERNEL_INLINE void rope_store_token(
    void *qkv, const void *cos, const void *sin, const int64_t *slots, void *k_cache,
    void *v_cache, int64_t t, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t cache_slots, int dtype, int kv) {
    const int64_t half = head_dim / 2, width = heads + 2 * kv_heads;
    for (int64_t h = 0; h < heads + kv_heads; h++) {
        const int64_t base = (t * width + h) * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = load(qkv, base + i, dtype), x2 = load(qkv, base + half + i, dtype);
            const float c = load(cos, t * half + i, dtype), s = load(sin, t * half + i, dtype);
            store(qkv, base + i, rnd(x1 * c, dtype) - rnd(x2 * s, dtype), dtype);
            store(qkv, base + half + i, rnd(x2 * c, dtype) + rnd(x1 * s, dtype), dtype);
        }
    }
    const int64_t src = (t * width + heads) * head_dim;
    for (int64_t h = 0; h < kv_heads; h++) {
        const int64_t dst = (h * cache_slots + slots[t]) * head_dim;
        const int64_t k = src + h * head_dim, v = src + (kv_heads + h) * head_dim;
        if (kv == dtype) {
            const size_t e = dtype == BF16 ? 2 : 4, row = (size_t)head_dim * e;
            memcpy((char *)k_cache + (size_t)dst * e, (const char *)qkv + (size_t)k * e, row);
            memcpy((char *)v_cache + (size_t)dst * e, (const char *)qkv + (size_t)v * e, row);
        } else {
            for (int64_t i = 0; i < head_dim; i++) {
                store(k_cache, dst + i, load(qkv, k + i, dtype), kv);
                store(v_cache, dst + i, load(qkv, v + i, dtype), kv);
            }
        }
    }
}

/* qkv: [T, heads + 2 * kv_heads, D], q and k heads rotated in place; cos, sin: [T, D/2];
   slots: [T]; caches: [kv_heads, cache_slots, D], of type KV. */
#define EXPORT(NAME, DTYPE, KV)                                                                 \
    int NAME(void *qkv, const void *cos, const void *sin, const int64_t *slots, void *k_cache,  \
             void *v_cache, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,  \
             int64_t cache_slots, int num_threads) {                                            \
        _Pragma("omp parallel for num_threads(num_threads) if (tokens >= 64)")                  \
        for (int64_t t = 0; t < tokens; t++)                                                    \
            rope_store_token(qkv, cos, sin, slots, k_cache, v_cache, t, heads, kv_heads,        \
                             head_dim, cache_slots, DTYPE, KV);                                 \
        return 0;                                                                               \
    }

EXPORT(rope_store_f32, F32, F32)
EXPORT(rope_store_bf16, BF16, BF16)
EXPORT(rope_store_f32_bf16kv, F32, BF16)
