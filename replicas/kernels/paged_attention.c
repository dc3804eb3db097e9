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

#include "bf16.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1 };

#define INLINE static inline __attribute__((always_inline))

INLINE void load_row(const void *src, int64_t offset, int dtype, float *dst, int64_t n) {
    if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        uint32_t *d = (uint32_t *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = bf16_widen(s[i]);
    } else {
        memcpy(dst, (const float *)src + offset, sizeof(float) * (size_t)n);
    }
}

INLINE void store_row(void *dst, int64_t offset, int dtype, const float *src, int64_t n) {
    if (dtype == BF16) {
        uint16_t *d = (uint16_t *)dst + offset;
        const uint32_t *s = (const uint32_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) d[i] = bf16_narrow(s[i]);
    } else {
        memcpy((float *)dst + offset, src, sizeof(float) * (size_t)n);
    }
}

#ifdef __AVX512F__
/* x[t] holds partial sums of key t in its 16 lanes; returns the 16 totals, key t in lane t.
   A transpose-and-add tree: 45 shuffles and adds instead of 16 separate horizontal sums. */
INLINE __m512 sum_lanes16(const __m512 *x) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], even),
                               _mm512_shuffle_f32x4(u[0], u[1], odd));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], even),
                               _mm512_shuffle_f32x4(u[2], u[3], odd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, even),
                         _mm512_shuffle_f32x4(s01, s23, odd));
}

/* Scores of the first n keys of one 16-key block for every query head of the group:
   scores[g * len + t] = q_g . k_t. kf: room for 16 x D floats. */
INLINE void block_scores16(
    const float *qf, int64_t group, int64_t head_dim, const void *k_cache, int64_t base,
    int dtype, int64_t n, float *scores, int64_t len, float *kf) {
    const int64_t chunks = head_dim / 16;
    const float *k;
    if (dtype == BF16) {
        /* the block is whole in the cache even past n: converting all 16 rows is safe, and the
           lanes of keys past n are never stored */
        const uint16_t *src = (const uint16_t *)k_cache + base;
        for (int64_t i = 0; i < 16 * chunks; i++) {
            __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 16 * i)));
            _mm512_storeu_ps(kf + 16 * i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
        k = kf;
    } else {
        k = (const float *)k_cache + base;
    }
    const __mmask16 keep = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    for (int64_t g = 0; g < group; g++) {
        const float *qg = qf + g * head_dim;
        __m512 acc[16];
        for (int t = 0; t < 16; t++) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(k + t * head_dim));
            for (int64_t c = 1; c < chunks; c++)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c),
                                    _mm512_loadu_ps(k + t * head_dim + 16 * c), a);
            acc[t] = a;
        }
        _mm512_mask_storeu_ps(scores + g * len, keep, sum_lanes16(acc));
    }
}

/* acc[g] += sum over the first n keys t of the block: p_g[t] * v_t, with the head dim in
   registers (chunks = head_dim / 16, a constant at the call sites so the loops unroll): one
   independent accumulator per chunk instead of a load-add-store chain through memory per key. */
INLINE void block_values16(
    const float *scores, int64_t len, int64_t group, const int64_t chunks, const void *v_cache,
    int64_t base, int dtype, int64_t n, float *acc, float *vf) {
    const int64_t head_dim = 16 * chunks;
    const float *v;
    if (dtype == BF16) {
        const uint16_t *src = (const uint16_t *)v_cache + base;
        for (int64_t i = 0; i < n * chunks; i++) {
            __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 16 * i)));
            _mm512_storeu_ps(vf + 16 * i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
        v = vf;
    } else {
        v = (const float *)v_cache + base;
    }
    for (int64_t g = 0; g < group; g++) {
        __m512 a[16];
        for (int64_t c = 0; c < chunks; c++) a[c] = _mm512_loadu_ps(acc + g * head_dim + 16 * c);
        for (int64_t t = 0; t < n; t++) {
            const __m512 p = _mm512_set1_ps(scores[g * len + t]);
            for (int64_t c = 0; c < chunks; c++)
                a[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + t * head_dim + 16 * c), a[c]);
        }
        for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(acc + g * head_dim + 16 * c, a[c]);
    }
}
#endif

/* One (row, kv head) task. Returns nonzero if its buffer could not be allocated. */
INLINE int attend(
    const void *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
    void *out, int64_t b, int64_t h, int64_t heads, int64_t group, int64_t head_dim,
    int64_t slots, int64_t block_size, float scale, int dtype) {
    const int64_t head_base = h * slots * head_dim;
    /* scores [group, len] | q [group, D] | acc [group, D] | one key or value row [D] |
       one block of keys in float [16, D] */
    float *buf = malloc(sizeof(float) * (size_t)(group * len + (2 * group + 17) * head_dim));
    if (buf == NULL) return 1;
    float *scores = buf;
    float *qf = buf + group * len;
    float *acc = qf + group * head_dim;
    float *row = acc + group * head_dim;
    float *kf = row + head_dim;
    const int fast = block_size == 16 && head_dim % 16 == 0;
    (void)kf;
    (void)fast;
    load_row(q, (b * heads + h * group) * head_dim, dtype, qf, group * head_dim);
    for (int64_t i = 0; i < group * head_dim; i++) qf[i] *= scale;

    /* block by block: no division per key */
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = head_base + table[start / block_size] * block_size * head_dim;
        const int64_t n = len - start < block_size ? len - start : block_size;
#ifdef __AVX512F__
        if (fast) {
            block_scores16(qf, group, head_dim, k_cache, base, dtype, n, scores + start, len, kf);
            continue;
        }
#endif
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
#ifdef __AVX512F__
        if (fast && head_dim == 64) {
            block_values16(scores + start, len, group, 4, v_cache, base, dtype, n, acc, kf);
            continue;
        }
        if (fast && head_dim == 128) {
            block_values16(scores + start, len, group, 8, v_cache, base, dtype, n, acc, kf);
            continue;
        }
#endif
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
