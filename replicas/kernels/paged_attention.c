/* Decode attention over the paged KV cache, reading each cached key and value once, in place.

   One query token per row. The cache of one layer is [kv_heads, num_blocks, block_size, head_dim];
   row b's context is the first context_lens[b] slots of the blocks block_tables[b, :]. The query
   heads of one KV head are done together, so each key and value row is loaded (and converted to
   float) once for all of them. Work is split over (row, kv head) pairs with OpenMP; the library
   links the libgomp torch has loaded, so it shares torch's thread pool instead of adding one.

   Built by replicas/kernels/__init__.py with -O3 -march=native -ffast-math (vectorised exp). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

static inline __attribute__((always_inline)) void load_row(const void *src, int64_t offset, int dtype, float *dst, int64_t n) {
    if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        uint32_t *d = (uint32_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
    } else {
        memcpy(dst, (const float *)src + offset, sizeof(float) * (size_t)n);
    }
}

static inline __attribute__((always_inline)) void store_row(void *dst, int64_t offset, int dtype, const float *src, int64_t n) {
    if (dtype == BF16) {
        uint16_t *d = (uint16_t *)dst + offset;
        const uint32_t *s = (const uint32_t *)src;
        /* round to nearest even; attention outputs are finite */
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = (uint16_t)((s[i] + 0x7fffu + ((s[i] >> 16) & 1u)) >> 16);
    } else {
        memcpy((float *)dst + offset, src, sizeof(float) * (size_t)n);
    }
}

/* One (row, kv head) task. Returns nonzero if its buffer could not be allocated. */
static inline __attribute__((always_inline)) int attend(
    const void *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
    void *out, int64_t b, int64_t h, int64_t heads, int64_t group, int64_t head_dim,
    int64_t slots, int64_t block_size, float scale, int dtype) {
    const int64_t head_base = h * slots * head_dim;
    /* scores [group, len] | q [group, D] | acc [group, D] | one key or value row [D] */
    float *buf = malloc(sizeof(float) * (size_t)(group * len + (2 * group + 1) * head_dim));
    if (buf == NULL) return 1;
    float *scores = buf;
    float *qf = buf + group * len;
    float *acc = qf + group * head_dim;
    float *row = acc + group * head_dim;
    load_row(q, (b * heads + h * group) * head_dim, dtype, qf, group * head_dim);
    for (int64_t i = 0; i < group * head_dim; i++) qf[i] *= scale;

    /* block by block: no division per key */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = head_base + table[start / block_size] * block_size * head_dim;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t t = 0; t < n; t++) {
            load_row(k_cache, base + t * head_dim, dtype, row, head_dim);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qf + g * head_dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; d++) s += qg[d] * row[d];
                scores[g * len + start + t] = s;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len;
        float m = -INFINITY, sum = 0.0f;
        for (int64_t j = 0; j < len; j++) m = sg[j] > m ? sg[j] : m;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; j++) {
            sg[j] = expf(sg[j] - m);
            sum += sg[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < len; j++) sg[j] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = head_base + table[start / block_size] * block_size * head_dim;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t t = 0; t < n; t++) {
            load_row(v_cache, base + t * head_dim, dtype, row, head_dim);
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * len + start + t];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ag[d] += p * row[d];
            }
        }
    }
    store_row(out, (b * heads + h * group) * head_dim, dtype, acc, group * head_dim);
    free(buf);
    return 0;
}

/* q, out: [B, H, D]; k_cache, v_cache: [Hkv, num_blocks * block_size, D];
   block_tables: [B, max_blocks]; context_lens: [B]. Returns nonzero if a buffer failed.
   One function per dtype, each with its own parallel region, so the dtype is a constant inside
   the outlined loop body. */
#define EXPORT(NAME, DTYPE)                                                                     \
    int NAME(const void *q, const void *k, const void *v, const int64_t *tables,                \
             const int64_t *lens, void *out, int64_t batch, int64_t heads, int64_t kv_heads,    \
             int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks,      \
             float scale, int num_threads) {                                                    \
        const int64_t group = heads / kv_heads, slots = num_blocks * block_size;                \
        int failed = 0;                                                                         \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")               \
        for (int64_t task = 0; task < batch * kv_heads; task++) {                               \
            const int64_t b = task / kv_heads, h = task % kv_heads;                             \
            if (attend(q, k, v, tables + b * max_blocks, lens[b], out, b, h, heads, group,      \
                       head_dim, slots, block_size, scale, DTYPE))                              \
                failed = 1;                                                                     \
        }                                                                                       \
        return failed;                                                                          \
    }

EXPORT(paged_decode_attention_f32, F32)
EXPORT(paged_decode_attention_bf16, BF16)
