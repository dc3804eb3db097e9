/* Every decoder layer of a Llama-family model (Llama, Mistral, Qwen2) on CPUs, in one call per
   step (bf16 over AVX512-BF16-packed weights; float32 over bf16 weights widened in registers, or
   over 4/8-bit block-quantized weights): the same kernels the Python layers call, in the same
   order, so the hidden states are bit-identical, without the Python between them.

   Per layer the Python path made ~25 interpreter-level calls (modules, kernel wrappers, views,
   output allocations): ~130 us a layer, ~4 ms of a 40 ms 32-row decode step of bench-135m's 30
   layers. Here a layer is nine C calls on buffers carved once per step from one allocation.

   Weights are packed (linear.c: `linear_bf16`'s or `linear_mixed`'s layout); the caches are each
   layer's [kv_heads, slots, head_dim] (of the activations' type, or bf16: `_bf16kv`); every
   token of the step is a decode row of the attention (prefill tokens included, as the model
   runner describes them on CPUs). Tensor parallelism (the all-reduces), Qwen3's q/k norms and an
   o_proj bias are not done here: the model keeps its Python layers for those. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*norm_fn)(const void *, void *, const void *, float, void *, int64_t, int64_t, int);
typedef int (*linear_fn)(const void *, const void *, const void *, void *, int64_t, int64_t,
                         int64_t, int);
typedef int (*rope_fn)(void *, const void *, const void *, const int64_t *, void *, void *,
                       int64_t, int64_t, int64_t, int64_t, int64_t, int);
typedef int (*attention_fn)(const void *, const void *, const void *, const int64_t *,
                            const int64_t *, void *, int64_t, int64_t, int64_t, int64_t, int64_t,
                            int64_t, int64_t, float, int);
typedef int (*silu_fn)(const void *, void *, int64_t, int64_t, int);

#define DECLARE(SUFFIX)                                                                          \
    int add_rms_norm_##SUFFIX(const void *, void *, const void *, float, void *, int64_t,       \
                              int64_t, int);                                                     \
    int rope_store_##SUFFIX(void *, const void *, const void *, const int64_t *, void *, void *, \
                            int64_t, int64_t, int64_t, int64_t, int64_t, int);                   \
    int paged_decode_attention_##SUFFIX(const void *, const void *, const void *,                \
                                        const int64_t *, const int64_t *, void *, int64_t,       \
                                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,    \
                                        float, int);                                             \
    int silu_mul_##SUFFIX(const void *, void *, int64_t, int64_t, int);
DECLARE(bf16)
DECLARE(f32)
int rope_store_f32_bf16kv(void *, const void *, const void *, const int64_t *, void *, void *,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int);
int paged_decode_attention_f32_bf16kv(const void *, const void *, const void *, const int64_t *,
                                      const int64_t *, void *, int64_t, int64_t, int64_t,
                                      int64_t, int64_t, int64_t, int64_t, float, int);
int linear_bf16(const void *, const void *, const void *, void *, int64_t, int64_t, int64_t, int);
int linear_mixed(const void *, const void *, const void *, void *, int64_t, int64_t, int64_t, int);
int linear_q(const void *, const void *, const void *, void *, int64_t, int64_t, int64_t, int);

/* One layer's parameters and cache; mirrored by a ctypes.Structure in kernels/__init__.py. */
typedef struct {
    const void *input_norm, *post_norm;   /* [hidden] */
    const void *qkv, *qkv_bias;           /* packed [qkv_width, hidden]; bias [qkv_width] or NULL */
    const void *o, *gate_up, *down;       /* packed */
    void *k_cache, *v_cache;              /* [kv_heads, cache_slots, head_dim] */
} Layer;

typedef struct {
    size_t elem; /* bytes per activation */
    norm_fn norm;
    linear_fn linear;
    rope_fn rope;
    attention_fn attention;
    silu_fn silu;
} Ops;

/* x: [T, hidden] the embeddings; out: [T, hidden] the last layer's output; residual: [T, hidden]
   the residual stream after it (the model's final norm adds the two). tables [T, max_blocks],
   lens [T]: each token's context as a decode row's. Returns nonzero if a buffer failed. */
static int layers(const Ops *ops, const Layer *layers, int64_t num_layers, const void *x,
                  void *out, void *residual, int64_t T, int64_t hidden, int64_t heads,
                  int64_t kv_heads, int64_t head_dim, int64_t inter, float eps, float scale,
                  const void *cos, const void *sin, const int64_t *slots, const int64_t *tables,
                  const int64_t *lens, int64_t max_blocks, int64_t cache_slots,
                  int64_t block_size, int num_threads) {
    const int64_t width = (heads + 2 * kv_heads) * head_dim, q_dim = heads * head_dim;
    const size_t e = ops->elem;
    /* activation buffers: h [T, hidden] | qkv [T, width] | q [T, q_dim] | attn [T, q_dim] |
       y [T, hidden] | gate_up [T, 2 inter] | act [T, inter] */
    char *buf = malloc(e * (size_t)T * (size_t)(2 * hidden + width + 2 * q_dim + 3 * inter));
    if (buf == NULL) return 1;
    char *h = buf, *qkv = h + e * T * hidden, *q = qkv + e * T * width, *attn = q + e * T * q_dim;
    char *y = attn + e * T * q_dim, *gate_up = y + e * T * hidden;
    char *act = gate_up + e * T * 2 * inter;
    int failed = 0;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const Layer *w = layers + l;
        if (l == 0) {
            ops->norm(x, NULL, w->input_norm, eps, h, T, hidden, num_threads);
            memcpy(residual, x, e * (size_t)(T * hidden));
        } else {
            ops->norm(out, residual, w->input_norm, eps, h, T, hidden, num_threads);
        }
        failed |= ops->linear(h, w->qkv, w->qkv_bias, qkv, T, width, hidden, num_threads);
        ops->rope(qkv, cos, sin, slots, w->k_cache, w->v_cache, T, heads, kv_heads, head_dim,
                  cache_slots, num_threads);
        for (int64_t t = 0; t < T; t++)
            memcpy(q + e * t * q_dim, qkv + e * t * width, e * (size_t)q_dim);
        failed |= ops->attention(q, w->k_cache, w->v_cache, tables, lens, attn, T, heads,
                                kv_heads, head_dim, cache_slots / block_size, block_size,
                                max_blocks, scale, num_threads);
        failed |= ops->linear(attn, w->o, NULL, y, T, hidden, q_dim, num_threads);
        ops->norm(y, residual, w->post_norm, eps, h, T, hidden, num_threads);
        failed |= ops->linear(h, w->gate_up, NULL, gate_up, T, 2 * inter, hidden, num_threads);
        ops->silu(gate_up, act, T, inter, num_threads);
        failed |= ops->linear(act, w->down, NULL, out, T, hidden, inter, num_threads);
    }
    free(buf);
    return failed;
}

#define LLAMA_LAYERS(NAME, ELEM, SUFFIX, LINEAR, KV)                                             \
    int NAME(const Layer *l, int64_t n, const void *x, void *out, void *residual, int64_t T,    \
             int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,  \
             float eps, float scale, const void *cos, const void *sin, const int64_t *slots,    \
             const int64_t *tables, const int64_t *lens, int64_t max_blocks,                    \
             int64_t cache_slots, int64_t block_size, int num_threads) {                         \
        static const Ops ops = {ELEM, add_rms_norm_##SUFFIX, LINEAR, rope_store_##SUFFIX##KV,    \
                                paged_decode_attention_##SUFFIX##KV, silu_mul_##SUFFIX};         \
        return layers(&ops, l, n, x, out, residual, T, hidden, heads, kv_heads, head_dim, inter, \
                      eps, scale, cos, sin, slots, tables, lens, max_blocks, cache_slots,        \
                      block_size, num_threads);                                                  \
    }

/* bf16 activations over linear_bf16's packing (AVX512-BF16) */
LLAMA_LAYERS(llama_layers_bf16, 2, bf16, linear_bf16, )
/* float32 activations over linear_mixed's packing (every other level), the cache float32 or
   bf16 */
LLAMA_LAYERS(llama_layers_f32, 4, f32, linear_mixed, )
LLAMA_LAYERS(llama_layers_f32_bf16kv, 4, f32, linear_mixed, _bf16kv)
/* float32 activations over block-quantized weights (quant_linear.c's packing), likewise */
LLAMA_LAYERS(llama_layers_q, 4, f32, linear_q, )
LLAMA_LAYERS(llama_layers_q_bf16kv, 4, f32, linear_q, _bf16kv)
