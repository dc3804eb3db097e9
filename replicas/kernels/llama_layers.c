/* Every decoder layer of a Llama-family model (Llama, Mistral, Qwen2) on CPUs in bf16, in one
   call per step: the same kernels the Python layers call, in the same order, so the hidden states
   are bit-identical, without the Python between them.

   Per layer the Python path made ~25 interpreter-level calls (modules, kernel wrappers, views,
   output allocations): ~130 us a layer, ~4 ms of a 40 ms 32-row decode step of bench-135m's 30
   layers. Here a layer is nine C calls on buffers carved once per step from one allocation.

   Weights are packed (linear.c); the caches are each layer's [kv_heads, slots, head_dim]; every
   token of the step is a decode row of the attention (prefill tokens included, as the model
   runner describes them on CPUs). Tensor parallelism (the all-reduces), Qwen3's q/k norms and an
   o_proj bias are not done here: the model keeps its Python layers for those. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int add_rms_norm_bf16(const void *x, void *residual, const void *weight, float eps, void *out,
                      int64_t rows, int64_t dim, int num_threads);
int linear_bf16(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                int64_t K, int num_threads);
int rope_store_bf16(void *qkv, const void *cos, const void *sin, const int64_t *slots,
                    void *k_cache, void *v_cache, int64_t tokens, int64_t heads, int64_t kv_heads,
                    int64_t head_dim, int64_t cache_slots, int num_threads);
int paged_decode_attention_bf16(const void *q, const void *k, const void *v,
                                const int64_t *tables, const int64_t *lens, void *out,
                                int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                                float scale, int num_threads);
int silu_mul_bf16(const void *x, void *out, int64_t rows, int64_t inter, int num_threads);

/* One layer's parameters and cache; mirrored by a ctypes.Structure in kernels/__init__.py. */
typedef struct {
    const void *input_norm, *post_norm;   /* [hidden] */
    const void *qkv, *qkv_bias;           /* packed [qkv_width, hidden]; bias [qkv_width] or NULL */
    const void *o, *gate_up, *down;       /* packed */
    void *k_cache, *v_cache;              /* [kv_heads, cache_slots, head_dim] */
} Layer;

/* x: [T, hidden] the embeddings; out: [T, hidden] the last layer's output; residual: [T, hidden]
   the residual stream after it (the model's final norm adds the two). tables [T, max_blocks],
   lens [T]: each token's context as a decode row's. Returns nonzero if a buffer failed. */
int llama_layers_bf16(const Layer *layers, int64_t num_layers, const void *x, void *out,
                      void *residual, int64_t T, int64_t hidden, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t inter, float eps, float scale, const void *cos,
                      const void *sin, const int64_t *slots, const int64_t *tables,
                      const int64_t *lens, int64_t max_blocks, int64_t cache_slots,
                      int64_t block_size, int num_threads) {
    const int64_t width = (heads + 2 * kv_heads) * head_dim, q_dim = heads * head_dim;
    /* bf16 buffers: h [T, hidden] | qkv [T, width] | q [T, q_dim] | attn [T, q_dim] |
       y [T, hidden] | gate_up [T, 2 inter] | act [T, inter] */
    uint16_t *buf = malloc(sizeof(uint16_t) * (size_t)T *
                           (size_t)(2 * hidden + width + 2 * q_dim + 3 * inter));
    if (buf == NULL) return 1;
    uint16_t *h = buf, *qkv = h + T * hidden, *q = qkv + T * width, *attn = q + T * q_dim;
    uint16_t *y = attn + T * q_dim, *gate_up = y + T * hidden, *act = gate_up + T * 2 * inter;
    int failed = 0;
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const Layer *w = layers + l;
        if (l == 0) {
            add_rms_norm_bf16(x, NULL, w->input_norm, eps, h, T, hidden, num_threads);
            memcpy(residual, x, sizeof(uint16_t) * (size_t)(T * hidden));
        } else {
            add_rms_norm_bf16(out, residual, w->input_norm, eps, h, T, hidden, num_threads);
        }
        linear_bf16(h, w->qkv, w->qkv_bias, qkv, T, width, hidden, num_threads);
        rope_store_bf16(qkv, cos, sin, slots, w->k_cache, w->v_cache, T, heads, kv_heads,
                        head_dim, cache_slots, num_threads);
        for (int64_t t = 0; t < T; t++)
            memcpy(q + t * q_dim, qkv + t * width, sizeof(uint16_t) * (size_t)q_dim);
        failed = paged_decode_attention_bf16(q, w->k_cache, w->v_cache, tables, lens, attn, T,
                                             heads, kv_heads, head_dim, cache_slots / block_size,
                                             block_size, max_blocks, scale, num_threads);
        linear_bf16(attn, w->o, NULL, y, T, hidden, q_dim, num_threads);
        add_rms_norm_bf16(y, residual, w->post_norm, eps, h, T, hidden, num_threads);
        linear_bf16(h, w->gate_up, NULL, gate_up, T, 2 * inter, hidden, num_threads);
        silu_mul_bf16(gate_up, act, T, inter, num_threads);
        linear_bf16(act, w->down, NULL, out, T, hidden, inter, num_threads);
    }
    free(buf);
    return failed;
}
