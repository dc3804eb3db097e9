/* Decode attention over the paged KV cache, reading each cached key and value once, in place.

   One query token per row. The cache of one layer is [kv_heads, num_blocks, block_size, head_dim];
   row b's context is the first context_lens[b] slots of the blocks block_tables[b, :]. The query
   heads of one KV head are done together, so each key and value row is loaded (and converted to
   float) once for all of them. Work is split over (row, kv head) pairs with OpenMP, and a context
   past PART_TOKENS over parts of it too (Part, combine); the library links the libgomp torch has
   loaded, so it shares torch's thread pool instead of adding one.

   The cache holds the activations' type, or bf16 under float32 activations (`--kv-cache-dtype`:
   half the bytes to read, widened as each block is read).

   Built by replicas/kernels/__init__.py with -O3 and -ffast-math; the softmax's exp is
   exp_approx.h's, inline and vectorised. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "deal.h"
#include "dtype.h"
#include "exp_approx.h"
#include "tiles.h"
#include "vec.h"

#define INLINE KERNEL_INLINE
/* key blocks the bf16 and vector paths ask for ahead (2 to 4 measured best on the bf16 path, 8
   and 16 slower) */
#define PF_BLOCKS 4

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

/* s[j] = exp(s[j] - max s) in place, n >= 1; returns their sum (the softmax's denominator) and
   leaves max s in *max.
   The maximum starts from s[0], not -INFINITY: under -ffast-math the compiler may assume no
   infinities, and GCC 12's SVE vectorisation of the max from -INFINITY returned garbage (caught
   by tests/replicas/test_cross_isa.py under qemu). */
INLINE float exp_shifted(float *s, int64_t n, float *max) {
    float m = s[0], sum = 0.0f;
    for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
    *max = m;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) {
        s[j] = exp_approx(s[j] - m);
        sum += s[j];
    }
    return sum;
}

#ifdef __AVX512F__
/* x[t] holds partial sums of key t in its 16 lanes; returns the 16 totals, key t in lane t.
   A transpose-and-add tree: 45 shuffles and adds instead of 16 separate horizontal sums (which
   cost as much as the dot products feeding them at head dim 64). */
KERNEL_INLINE __m512 sum_lanes16(const __m512 *x) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  // within 128-bit lanes: interleaved pair sums
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]),
                             _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  // each 128-bit lane: the sums of its part of 4 items
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // across 128-bit lanes: pair lanes (0, 1) and (2, 3), twice
    const int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], even),
                               _mm512_shuffle_f32x4(u[0], u[1], odd));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], even),
                               _mm512_shuffle_f32x4(u[2], u[3], odd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, even),
                         _mm512_shuffle_f32x4(s01, s23, odd));
}

#endif

/* A buffer of a thread's, grown (never shrunk) as contexts grow: a malloc and free per
   (row, kv head) task, thousands a decode step, cost more than the softmax. */
typedef struct {
    float *buf;
    size_t bytes;
} Grown;

INLINE float *grow(Grown *g, size_t bytes) {
    if (bytes > g->bytes) {
        free(g->buf);
        g->bytes = bytes + bytes / 4;
        g->buf = malloc(g->bytes);
        if (g->buf == NULL) g->bytes = 0;
    }
    return g->buf;
}

/* a thread's scratch for its tasks' scores (and a combine's row) */
static __thread Grown scratch_space;
INLINE float *scratch(size_t bytes) { return grow(&scratch_space, bytes); }

/* Asks for the cache lines of one block ahead of use: a row's blocks are scattered over the
   cache, so the hardware prefetcher cannot see the next one coming, and two threads each waiting
   on one miss at a time reach a fraction of the memory bandwidth (8 of ~49 GB/s measured).
   Into L2 (the T1 hint), not L1: L1 has too few miss buffers for a block's 32 lines and more,
   and prefetches it cannot track are dropped. With the bf16 path asking PF_BLOCKS key blocks
   ahead, and each block's values while its keys are scored, 32 rows x 200 tokens of bench-135m
   (30 layers' caches, scattered blocks) took 7.6 ms instead of 13 (every block asked for into
   L1 at the task's start): 19 of the ~27 GB/s two threads read sequentially. */
INLINE void prefetch_block(const void *cache, int64_t base, int dtype, int64_t elems) {
    const char *p = (const char *)cache + base * (dtype == BF16 ? 2 : 4);
    const int64_t bytes = elems * (dtype == BF16 ? 2 : 4);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* The scoring loop's asks at block i of a task: on the first block, the keys of the first
   PF_BLOCKS; then the keys PF_BLOCKS ahead and block i's values, which are summed once every
   key is scored; the first `span` elements of each block */
INLINE void prefetch_scoring(const void *k_cache, const void *v_cache, const int64_t *table,
                             int64_t i, int64_t blocks, int64_t head_base, int64_t elems,
                             int dtype, int64_t span) {
    if (i == 0)
        for (int64_t j = 0; j < blocks && j < PF_BLOCKS; j++)
            prefetch_block(k_cache, head_base + table[j] * elems, dtype, span);
    if (i + PF_BLOCKS < blocks)
        prefetch_block(k_cache, head_base + table[i + PF_BLOCKS] * elems, dtype, span);
    prefetch_block(v_cache, head_base + table[i] * elems, dtype, span);
}

/* The task a thread does after this one (dealt ahead: deal.h), whose blocks it asks
   for while this one's values are summed from L2: that phase and the softmax read no memory,
   and without the next task's blocks coming meanwhile the cores stalled on each task's first
   blocks (bench-135m, 32 rows x ~214 tokens, 30 layers' caches: 7.1 ms a step, 3.2 with the
   caches in L3). */
typedef struct {
    const int64_t *table;
    int64_t blocks, head_base;
} Next;

/* blocks i0 .. i1 (those it has) of the next task: its keys, then its values; the first `span`
   elements of each (a block's elems, or its head: attend_vec) */
INLINE void prefetch_next(const Next *next, const void *k_cache, const void *v_cache, int64_t i0,
                          int64_t i1, int64_t elems, int dtype, int64_t span) {
    if (next == NULL) return;
    for (int64_t i = i0; i < i1 && i < next->blocks; i++) {
        prefetch_block(k_cache, next->head_base + next->table[i] * elems, dtype, span);
        prefetch_block(v_cache, next->head_base + next->table[i] * elems, dtype, span);
    }
}

/* Contexts past PART_TOKENS are split into equal parts of at most that many (whole blocks), each
   its own task, so that one row's few (row, kv head) tasks spread over the team: one stream of
   bench-135m (3 KV heads) on 2 threads had one thread attend over two heads' contexts while the
   other had one. A part's task leaves its result unnormalised here; `combine` then weighs the
   parts by their maxima (flash-decoding's split-KV). Whether a row is split depends on its own
   length alone, never on the batch, so a request's tokens do not change with what runs beside
   it. The kernel alone, one row, 30 layers' caches, Zen 5: 4,000 tokens 0.73-0.87x the time
   unsplit. The price is a prompt's tokens past PART_TOKENS (each a decode row on CPUs): their
   parts cost ~9% more than whole rows (parts of 512 and 1,024 made every prompt past those
   lengths pay it; at 2,048 few prompts on CPUs do). */
#define PART_TOKENS 2048
/* split rows' tasks per wave (EXPORT): their partial results, WAVE_TASKS x group x
   (head_dim + 2) floats, are what the calling thread keeps between calls */
#define WAVE_TASKS 4096
typedef struct {
    float *max, *sum; /* [group]: the part's largest score, the sum of exp(score - max) */
    float *acc;       /* [group, head_dim]: the values weighed by exp(score - max) */
} Part;

#if defined(__AVX512BF16__)
/* bf16 caches with 16-token blocks on CPUs with AVX512_BF16: products straight from the cached
   bf16 with vdpbf16ps (fp32 sums), no conversion of keys and values to float first. Scores of 16
   keys per query head: one vector of partial sums per key, summed with the transpose tree.
   Values: the rows of keys t and t + 1 interleaved into (v_t[d], v_t+1[d]) pairs, times the
   pair (p_t, p_t+1) of probabilities rounded to bf16 (as a bf16 attention matmul rounds them);
   the interleave leaves the head dim permuted inside each 32 lanes, undone once at the end.
   Half the instructions per cached element of the float path. */
INLINE void scores_dp(const uint16_t *qg, const uint16_t *k, int64_t chunks, int64_t n,
                      float scale, float *dst) {
    __m512 acc[16];
    for (int t = 0; t < 16; t++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; c++)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qg + 32 * c),
                                 (__m512bh)_mm512_loadu_si512(k + t * 32 * chunks + 32 * c));
        acc[t] = a;
    }
    const __mmask16 keep = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
    _mm512_mask_storeu_ps(dst, keep, _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale)));
}

/* acc[g] (2 * chunks vectors each, permuted head dim) += sum over the n keys of one block of
   p_g,t v_t, for the gn <= 16 / (2 * chunks) query heads g of pg (rows `len` apart): each pair
   of value rows is loaded and interleaved once for all of them. */
INLINE void values_dp(const uint16_t *pg, int64_t len, int64_t gn, const uint16_t *v,
                      const int64_t chunks, int64_t n, __m512 *acc) {
    const int64_t tile = 16 / (2 * chunks);
    for (int64_t t = 0; t < n; t += 2) {
        const int pair = t + 1 < n;
        __m512bh p[16];
        for (int64_t g = 0; g < tile; g++) {
            if (g >= gn) break;
            uint32_t bits = pg[g * len + t];
            if (pair) bits |= (uint32_t)pg[g * len + t + 1] << 16;
            p[g] = (__m512bh)_mm512_set1_epi32((int)bits);
        }
        for (int64_t c = 0; c < chunks; c++) {
            const __m512i a = _mm512_loadu_si512(v + t * 32 * chunks + 32 * c);
            /* past the context the slot may hold anything, NaN included: never load it */
            const __m512i b = pair ? _mm512_loadu_si512(v + (t + 1) * 32 * chunks + 32 * c)
                                   : _mm512_setzero_si512();
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int64_t g = 0; g < tile; g++) {
                if (g >= gn) break;
                __m512 *ag = acc + g * 2 * chunks;
                ag[2 * c] = _mm512_dpbf16_ps(ag[2 * c], lo, p[g]);
                ag[2 * c + 1] = _mm512_dpbf16_ps(ag[2 * c + 1], hi, p[g]);
            }
        }
    }
}

#if HAVE_TILES
/* With AMX a block's 16 keys are scored for every query head of the group by tile products:
   the block's keys [16, 32 dims] (rows of the cache, in place) times q's dims as k pairs
   [16 pairs, group] (laid out once a task) into [16 keys, group] float32 sums, one product per
   32 dims. On vdpbf16ps each key took a vector of partial sums per head and the transpose tree
   after. A key's score is a function of its own row, so a row's bits do not depend on its batch.
   Tiles: 0 the sums, 1 and 6 the keys (in turn), 2..5 q's chunks. The values stay on
   values_dp: tiles would want them interleaved in pairs of keys, as the cache does not hold
   them. */
#define TILES_OK(DTYPE, BS, D, G) (DP_OK(DTYPE, BS, D) && (D) <= 128 && (G) <= 16)
/* each thread of a call's parallel region, before its tasks (`_tile_release` after) */
static void tiles_configure(int64_t group) {
    const int g = (int)(4 * group), rows[8] = {16, 16, 16, 16, 16, 16, 16, 0};
    const int colsb[8] = {g, 64, g, g, g, g, 64, 0};
    tiles_load(rows, colsb);
}

/* q's rows of the group as tiles 2.. (qt: room for chunks x 16 x group pairs) */
INLINE void tiles_load_q(const uint16_t *qrow, int64_t group, int64_t chunks, uint32_t *qt) {
    const int64_t head_dim = 32 * chunks;
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t p = 0; p < 16; p++)
            for (int64_t g = 0; g < group; g++)
                memcpy(qt + (c * 16 + p) * group + g, qrow + g * head_dim + 32 * c + 2 * p, 4);
    const size_t stride = 4 * (size_t)group;
    _tile_loadd(2, qt, stride);
    if (chunks > 1) _tile_loadd(3, qt + 16 * group, stride);
    if (chunks > 2) _tile_loadd(4, qt + 32 * group, stride);
    if (chunks > 3) _tile_loadd(5, qt + 48 * group, stride);
}

/* the first n of one block's keys (kb) against the group: scores[g * len + t] */
INLINE void tiles_scores(const uint16_t *kb, int64_t group, int64_t chunks, int64_t n,
                         float scale, float *scores, int64_t len) {
    float sums[16 * 16] __attribute__((aligned(64)));
    const size_t stride = 64 * (size_t)chunks;  /* a key's row: 32 * chunks bf16 */
    _tile_zero(0);
    _tile_loadd(1, kb, stride);
    _tile_dpbf16ps(0, 1, 2);
    if (chunks > 1) {
        _tile_loadd(6, kb + 32, stride);
        _tile_dpbf16ps(0, 6, 3);
    }
    if (chunks > 2) {
        _tile_loadd(1, kb + 64, stride);
        _tile_dpbf16ps(0, 1, 4);
    }
    if (chunks > 3) {
        _tile_loadd(6, kb + 96, stride);
        _tile_dpbf16ps(0, 6, 5);
    }
    _tile_stored(0, sums, 4 * (size_t)group);
    for (int64_t g = 0; g < group; g++)
        for (int64_t t = 0; t < n; t++) scores[g * len + t] = sums[t * group + g] * scale;
}
#else
#define TILES_OK(DTYPE, BS, D, G) 0
#endif

/* One (row, kv head) task of the bf16 path; head_dim = 32 * chunks, chunks <= 8. tiles: this
   thread's tiles are configured for the scores (TILES_OK). */
INLINE int attend_dp(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                     const int64_t *table, int64_t len, uint16_t *out, int64_t b, int64_t h,
                     int64_t heads, int64_t group, const int64_t chunks, int64_t slots,
                     float scale, const Next *next, const Part *part, int tiles) {
    const int64_t head_dim = 32 * chunks, elems = 16 * head_dim;
    const int64_t head_base = h * slots * head_dim, blocks = (len + 15) / 16;
    /* scores [group, len] in float, then the same as bf16 probabilities | q as tiles */
    float *scores = scratch(sizeof(float) * (size_t)(group * len) +
                            2 * (size_t)(group * len + 32) + 4 * (size_t)(64 * group + 16));
    if (scores == NULL) return 1;
    uint16_t *probs = (uint16_t *)(scores + group * len);
    const uint16_t *qrow = q + (b * heads + h * group) * head_dim;
#if HAVE_TILES
    uint32_t *qt = (uint32_t *)(((uintptr_t)(probs + group * len + 32) + 63) & ~(uintptr_t)63);
    if (tiles) tiles_load_q(qrow, group, chunks, qt);
#else
    (void)tiles;
#endif
    for (int64_t i = 0; i < blocks; i++) {
        prefetch_scoring(k_cache, v_cache, table, i, blocks, head_base, elems, BF16, elems);
        const uint16_t *kb = k_cache + head_base + table[i] * elems;
        const int64_t n = len - 16 * i < 16 ? len - 16 * i : 16;
#if HAVE_TILES
        if (tiles) {
            tiles_scores(kb, group, chunks, n, scale, scores + 16 * i, len);
            continue;
        }
#endif
        for (int64_t g = 0; g < group; g++)
            scores_dp(qrow + g * head_dim, kb, chunks, n, scale, scores + g * len + 16 * i);
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len, max;
        const float sum = exp_shifted(sg, len, &max);
        const float inv = part ? 1.0f : 1.0f / sum;
        if (part) part->max[g] = max, part->sum[g] = sum;
        uint32_t *bits = (uint32_t *)sg;
#pragma omp simd
        for (int64_t j = 0; j < len; j++) {
            sg[j] *= inv;
            probs[g * len + j] = bf16_narrow(bits[j]);
        }
    }
    /* the query heads in tiles whose accumulators fit 16 registers (bench-135m: all 3 heads of
       a KV head at head dim 64), so each value block is read once per tile, not once a head */
    const int64_t tile = 16 / (2 * chunks);
    for (int64_t g0 = 0; g0 < group; g0 += tile) {
        const int64_t gn = group - g0 < tile ? group - g0 : tile;
        __m512 acc[16];
        for (int64_t c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t i = 0; i < blocks; i++) {
            const int64_t n = len - 16 * i < 16 ? len - 16 * i : 16;
            values_dp(probs + g0 * len + 16 * i, len, gn, v_cache + head_base + table[i] * elems,
                      chunks, n, acc);
            if (g0 == 0) prefetch_next(next, k_cache, v_cache, i, i + 1, elems, BF16, elems);
        }
        if (g0 == 0) prefetch_next(next, k_cache, v_cache, blocks, INT64_MAX, elems, BF16, elems);
        for (int64_t g = 0; g < gn; g++) {
            /* lanes 4l..4l+3 of lo hold dims 8l..8l+3 of their 32, of hi dims 8l+4..8l+7 */
            float lo[16], hi[16];
            uint16_t *o = out + (b * heads + h * group + g0 + g) * head_dim;
            float *po = part ? part->acc + (g0 + g) * head_dim : NULL;
            for (int64_t c = 0; c < chunks; c++) {
                _mm512_storeu_ps(lo, acc[g * 2 * chunks + 2 * c]);
                _mm512_storeu_ps(hi, acc[g * 2 * chunks + 2 * c + 1]);
                for (int l = 0; l < 4; l++)
                    for (int e = 0; e < 4; e++) {
                        float x = lo[4 * l + e], y = hi[4 * l + e];
                        if (po) {
                            po[32 * c + 8 * l + e] = x;
                            po[32 * c + 8 * l + 4 + e] = y;
                            continue;
                        }
                        uint32_t xb, yb;
                        memcpy(&xb, &x, 4);
                        memcpy(&yb, &y, 4);
                        o[32 * c + 8 * l + e] = bf16_narrow(xb);
                        o[32 * c + 8 * l + 4 + e] = bf16_narrow(yb);
                    }
            }
        }
    }
    return 0;
}
#endif

/* Each query head's scores [len] (rows `len` apart) into probabilities; for a part, into
   exp(score - max), its max and sum kept for `combine`. */
INLINE void softmax_heads(float *scores, int64_t group, int64_t len, const Part *part) {
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len, max;
        const float sum = exp_shifted(sg, len, &max);
        if (part) {
            part->max[g] = max, part->sum[g] = sum;
            continue;
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < len; j++) sg[j] *= inv;
    }
}

/* ---- float32 sums over blocks in vectors: every ISA level (vec.h's width) -------------------
   16-token blocks, head dims a multiple of LANES. Scores: for each query head of the group, one
   vector of partial products per key, summed across lanes LANES keys at a time (sum_lanes), so a
   block's 16 scores cost its 16 x D / LANES products and 16 / LANES sums. Values: tiles of a few
   query heads x a few vectors of the head dim, one broadcast probability per key and head. A
   float32 cache is read in place; a bf16 one is widened a block at a time into the task's buffer.
   Each output is the same sequence of operations whatever the batch, so a row's bits do not
   depend on what runs beside it. Zen 3 (AVX2), bench-135m's shapes (9 heads over 3 KV heads, head
   dim 64) over 30 layers' float32 caches, against the row loops this replaced (each row copied,
   then a dot product per head): 1.35-1.6x faster at 32 rows x 200 tokens, 64 x 600 and 1 x 4,000;
   with the rows' blocks in L2, 2.3x. */

/* lane t of the result: the sum of x[t]'s lanes, for x[0 .. LANES) */
INLINE vf sum_lanes(const vf *x) {
#if VBYTES == 64
    return (vf)sum_lanes16((const __m512 *)x);
#elif VBYTES == 32
    /* [x0 0-3, x1 0-3, x2 0-3, x3 0-3 | x0 4-7, ...], the same for x4..x7, then the halves */
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps((__m256)x[0], (__m256)x[1]),
                                    _mm256_hadd_ps((__m256)x[2], (__m256)x[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps((__m256)x[4], (__m256)x[5]),
                                    _mm256_hadd_ps((__m256)x[6], (__m256)x[7]));
    return (vf)_mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                             _mm256_permute2f128_ps(a, b, 0x31));
#elif defined(__aarch64__)
    return (vf)vpaddq_f32(vpaddq_f32((float32x4_t)x[0], (float32x4_t)x[1]),
                          vpaddq_f32((float32x4_t)x[2], (float32x4_t)x[3]));
#else
    vf s;
    for (int t = 0; t < LANES; t++) {
        float a = 0.0f;
        for (int l = 0; l < LANES; l++) a += x[t][l];
        s[t] = a;
    }
    return s;
#endif
}

INLINE vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the first n rows of a block of the cache as float32: in place, or widened into buf */
INLINE const float *block_rows(const void *cache, int64_t base, int dtype, int64_t n,
                               int64_t head_dim, float *buf) {
    if (dtype != BF16) return (const float *)cache + base;
    const uint16_t *s = (const uint16_t *)cache + base;
    uint32_t *d = (uint32_t *)buf;
#pragma omp simd
    for (int64_t i = 0; i < n * head_dim; i++) d[i] = bf16_widen(s[i]);
    return buf;
}

/* q's vectors a score tile holds: with its LANES accumulators, 12 of AVX2's 16 registers */
#define SCORE_QV (VREGS / 4)

/* scores[g * len + t] = q_g . k_t for the first n keys of one block (k: its rows), every g: LANES
   keys at a time, q's vectors in registers SCORE_QV at a time, each key's vector loaded once per
   head (a load per product: two, q's and the key's, were the loop's bound). Keys past n are not
   read: past the context a slot may hold anything. */
INLINE void block_scores(const float *qf, int64_t group, const int64_t head_dim, const float *k,
                         int64_t n, float *scores, int64_t len) {
    const int64_t chunks = head_dim / LANES;
    for (int64_t g = 0; g < group; g++) {
        const float *qg = qf + g * head_dim;
        float *dst = scores + g * len;
        for (int64_t t0 = 0; t0 < n; t0 += LANES) {
            vf acc[LANES];
            for (int t = 0; t < LANES; t++) acc[t] = (vf){0};
            for (int64_t c0 = 0; c0 < chunks; c0 += SCORE_QV) {
                const int64_t cn = chunks - c0 < SCORE_QV ? chunks - c0 : SCORE_QV;
                vf qv[SCORE_QV];
                for (int64_t c = 0; c < cn; c++) qv[c] = vload(qg + LANES * (c0 + c));
                for (int t = 0; t < LANES; t++) {
                    if (t0 + t >= n) continue;
                    const float *kt = k + (t0 + t) * head_dim + LANES * c0;
                    for (int64_t c = 0; c < cn; c++) acc[t] += qv[c] * vload(kt + LANES * c);
                }
            }
            const vf s = sum_lanes(acc);
            if (n - t0 >= LANES) memcpy(dst + t0, &s, sizeof s);
            else for (int64_t l = 0; l < n - t0; l++) dst[t0 + l] = s[l];
        }
    }
}

/* A value tile: VALUE_VECS vectors of the head dim for GN query heads, each value vector loaded
   once for all of them. GN: as many heads as leave room for the loads and the broadcasts. */
#define VALUE_VECS 4
#define VALUE_HEADS ((VREGS - VALUE_VECS - 2) / VALUE_VECS)

/* ag[g] (rows head_dim apart) += sum over the first n keys t of one block (v: its rows) of
   pg[g * len + t] * v_t, for dims c0 .. c0 + cn vectors and GN heads (constants at the calls) */
INLINE void values_tile(const float *pg, int64_t len, const int GN, const float *v,
                        const int64_t head_dim, int64_t c0, const int64_t cn, int64_t n,
                        float *ag) {
    vf a[VALUE_HEADS][VALUE_VECS];
    for (int g = 0; g < GN; g++)
        for (int64_t c = 0; c < cn; c++) a[g][c] = vload(ag + g * head_dim + LANES * (c0 + c));
    for (int64_t t = 0; t < n; t++) {
        vf x[VALUE_VECS];
        for (int64_t c = 0; c < cn; c++) x[c] = vload(v + t * head_dim + LANES * (c0 + c));
        for (int g = 0; g < GN; g++) {
            const vf p = (vf){0} + pg[g * len + t];
            for (int64_t c = 0; c < cn; c++) a[g][c] += p * x[c];
        }
    }
    for (int g = 0; g < GN; g++)
        for (int64_t c = 0; c < cn; c++)
            memcpy(ag + g * head_dim + LANES * (c0 + c), &a[g][c], sizeof a[g][c]);
}

/* acc[g] += sum over the first n keys t of one block (v: its rows) of p_g[t] * v_t, every g, in
   value tiles (chunks: a constant at the call sites, so the tiles unroll) */
INLINE void block_values(const float *scores, int64_t len, int64_t group, const int64_t head_dim,
                         const float *v, int64_t n, float *acc) {
    const int64_t chunks = head_dim / LANES;
    for (int64_t g0 = 0; g0 < group; g0 += VALUE_HEADS) {
        const int64_t gn = group - g0 < VALUE_HEADS ? group - g0 : VALUE_HEADS;
        const float *pg = scores + g0 * len;
        float *ag = acc + g0 * head_dim;
        for (int64_t c0 = 0; c0 < chunks; c0 += VALUE_VECS) {
            const int64_t cn = chunks - c0 < VALUE_VECS ? chunks - c0 : VALUE_VECS;
#define TILE(GN) values_tile(pg, len, GN, v, head_dim, c0, cn, n, ag)
            if (cn == VALUE_VECS) {
                switch (gn) {
                case 1: TILE(1); break;
                case 2: TILE(2); break;
#if VALUE_HEADS >= 6
                case 3: TILE(3); break;
                case 4: TILE(4); break;
                case 5: TILE(5); break;
                case 6: TILE(6); break;
#endif
                default: TILE(gn); break;
                }
            } else {
                for (int64_t g = 0; g < gn; g++)
                    values_tile(pg + g * len, len, 1, v, head_dim, c0, cn, n, ag + g * head_dim);
            }
#undef TILE
        }
    }
}

#define VEC_PF_LINES 2

/* One (row, kv head) task, or a part of one (`part`: see Part), on the vector path: 16-token
   blocks, head_dim % LANES == 0 (a constant at the call sites). Memory in the bf16 path's order
   (key blocks asked for PF_BLOCKS ahead, each block's values while its keys are scored, the next
   task's blocks meanwhile), but only each block's first VEC_PF_LINES lines: the hardware
   prefetcher follows a block once its first lines are asked for. Zen 3 (AVX2), bench-135m's
   shapes over 30 layers' caches: whole blocks asked for were no faster than none, and 20-35%
   slower with the caches in L3; 1-2 lines of each were the best of 0, 1, 2, 4, 8 and whole, by
   2-8%. Returns nonzero if its buffer could not be allocated. */
INLINE int attend_vec(const void *q, const void *k_cache, const void *v_cache,
                      const int64_t *table, int64_t len, void *out, int64_t b, int64_t h,
                      int64_t heads, int64_t group, const int64_t head_dim, int64_t slots,
                      float scale, int dtype, int kv, const Next *next, const Part *part) {
    const int64_t elems = 16 * head_dim, head_base = h * slots * head_dim, blocks = (len + 15) / 16;
    /* scores [group, len] | q [group, D] | acc [group, D] | one block in float [16, D] */
    float *buf = scratch(sizeof(float) * (size_t)(group * len + (2 * group + 16) * head_dim));
    if (buf == NULL) return 1;
    float *scores = buf, *qf = buf + group * len, *acc = qf + group * head_dim;
    float *rows = acc + group * head_dim;
    load_row(q, (b * heads + h * group) * head_dim, dtype, qf, group * head_dim);
    for (int64_t i = 0; i < group * head_dim; i++) qf[i] *= scale;
    const int64_t span = VEC_PF_LINES * 64 / (kv == BF16 ? 2 : 4);

    for (int64_t i = 0; i < blocks; i++) {
        prefetch_scoring(k_cache, v_cache, table, i, blocks, head_base, elems, kv, span);
        const int64_t n = len - 16 * i < 16 ? len - 16 * i : 16;
        const int64_t base = head_base + table[i] * elems;
        const float *k = block_rows(k_cache, base, kv, n, head_dim, rows);
        block_scores(qf, group, head_dim, k, n, scores + 16 * i, len);
    }
    softmax_heads(scores, group, len, part);
    memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t n = len - 16 * i < 16 ? len - 16 * i : 16;
        const int64_t base = head_base + table[i] * elems;
        const float *v = block_rows(v_cache, base, kv, n, head_dim, rows);
        block_values(scores + 16 * i, len, group, head_dim, v, n, acc);
        prefetch_next(next, k_cache, v_cache, i, i + 1, elems, kv, span);
    }
    prefetch_next(next, k_cache, v_cache, blocks, INT64_MAX, elems, kv, span);
    if (part)
        memcpy(part->acc, acc, sizeof(float) * (size_t)(group * head_dim));
    else
        store_row(out, (b * heads + h * group) * head_dim, dtype, acc, group * head_dim);
    return 0;
}

/* One (row, kv head) task, or a part of one, for the shapes the vector path does not take (other
   block sizes and head dims): row by row, in loops the compiler vectorises. Returns nonzero if
   its buffer could not be allocated. */
INLINE int attend(
    const void *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
    void *out, int64_t b, int64_t h, int64_t heads, int64_t group, int64_t head_dim,
    int64_t slots, int64_t block_size, float scale, int dtype, int kv, const Part *part) {
    const int64_t head_base = h * slots * head_dim;
    /* scores [group, len] | q [group, D] | acc [group, D] | one key or value row [D] */
    float *buf = scratch(sizeof(float) * (size_t)(group * len + (2 * group + 1) * head_dim));
    if (buf == NULL) return 1;
    float *scores = buf;
    float *qf = buf + group * len;
    float *acc = qf + group * head_dim;
    float *row = acc + group * head_dim;
    load_row(q, (b * heads + h * group) * head_dim, dtype, qf, group * head_dim);
    for (int64_t i = 0; i < group * head_dim; i++) qf[i] *= scale;

    /* block by block: no division per key. All of the task's keys and values are asked for
       up front (a row's blocks are scattered, so the hardware prefetcher cannot follow them). */
    const int64_t blocks = (len + block_size - 1) / block_size, elems = block_size * head_dim;
    for (int64_t i = 0; i < blocks; i++) prefetch_block(k_cache, head_base + table[i] * elems, kv, elems);
    for (int64_t i = 0; i < blocks; i++) prefetch_block(v_cache, head_base + table[i] * elems, kv, elems);
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = head_base + table[start / block_size] * block_size * head_dim;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t t = 0; t < n; t++) {
            load_row(k_cache, base + t * head_dim, kv, row, head_dim);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qf + g * head_dim;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < head_dim; d++) s += qg[d] * row[d];
                scores[g * len + start + t] = s;
            }
        }
    }
    softmax_heads(scores, group, len, part);
    memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t base = head_base + table[start / block_size] * block_size * head_dim;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t t = 0; t < n; t++) {
            load_row(v_cache, base + t * head_dim, kv, row, head_dim);
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * len + start + t];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) ag[d] += p * row[d];
            }
        }
    }
    if (part)
        memcpy(part->acc, acc, sizeof(float) * (size_t)(group * head_dim));
    else
        store_row(out, (b * heads + h * group) * head_dim, dtype, acc, group * head_dim);
    return 0;
}

/* The parts of one (row, kv head) into its group's rows of out: each part's sums weighed by
   exp(its max - the largest max). */
INLINE void combine(const float *parts, int64_t count, int64_t group, int64_t head_dim,
                    void *out, int64_t offset, int dtype, float *row) {
    const int64_t stride = group * (2 + head_dim);
    for (int64_t g = 0; g < group; g++) {
        float max = parts[g];
        for (int64_t p = 1; p < count; p++)
            max = parts[p * stride + g] > max ? parts[p * stride + g] : max;
        float sum = 0.0f;
        memset(row, 0, sizeof(float) * (size_t)head_dim);
        for (int64_t p = 0; p < count; p++) {
            const float *part = parts + p * stride;
            const float w = expf(part[g] - max);
            sum += w * part[group + g];
            const float *acc = part + 2 * group + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) row[d] += w * acc[d];
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < head_dim; d++) row[d] *= inv;
        store_row(out, offset + g * head_dim, dtype, row, head_dim);
    }
}

#if defined(__AVX512BF16__)
#define DP_OK(DTYPE, BS, D) ((DTYPE) == BF16 && (BS) == 16 && (D) % 32 == 0 && (D) <= 256)
/* a constant chunk count per call site, so the register arrays stay registers */
INLINE int attend_dp_any(const void *q, const void *k, const void *v, const int64_t *table,
                         int64_t len, void *out, int64_t b, int64_t h, int64_t heads,
                         int64_t group, int64_t head_dim, int64_t slots, float scale,
                         const Next *next, const Part *part, int tiles) {
#define DP(CH) \
    attend_dp(q, k, v, table, len, out, b, h, heads, group, CH, slots, scale, next, part, tiles)
    switch (head_dim / 32) {
    case 2: return DP(2);
    case 4: return DP(4);
    default: return DP(head_dim / 32);
    }
#undef DP
}
#define ATTEND_DP attend_dp_any
#else
#define DP_OK(DTYPE, BS, D) 0
#define ATTEND_DP(...) 0
#endif

/* One task: the AVX512-BF16 path where it applies, else the vector path, else the row loops;
   the first two ask for `next`'s blocks meanwhile. dtype: q's and out's; kv: the cache's (bf16
   under float32 compute, or the same). Returns nonzero if its buffer could not be allocated. */
INLINE int attend_task(const void *q, const void *k, const void *v, const int64_t *table,
                       int64_t len, void *out, int64_t b, int64_t h, int64_t heads, int64_t group,
                       int64_t head_dim, int64_t slots, int64_t block_size, float scale, int dtype,
                       int kv, const Next *next, const Part *part, int tiles) {
    if (kv == dtype && DP_OK(dtype, block_size, head_dim))
        return ATTEND_DP(q, k, v, table, len, out, b, h, heads, group, head_dim, slots, scale,
                         next, part, tiles);
    (void)tiles;
    if (block_size == 16 && head_dim % LANES == 0) {
        /* the common head dims as constants, so the vector loops unroll */
#define VEC(D) attend_vec(q, k, v, table, len, out, b, h, heads, group, D, slots, scale, dtype, \
                          kv, next, part)
        switch (head_dim) {
        case 64: return VEC(64);
        case 128: return VEC(128);
        default: return VEC(head_dim);
        }
#undef VEC
    }
    return attend(q, k, v, table, len, out, b, h, heads, group, head_dim, slots, block_size,
                  scale, dtype, kv, part);
}

/* Inside a call's parallel region: `tiles` says whether this thread's tiles hold the scores'
   configuration (TILES_OK), released at the region's end (a thread's tile state in use is saved
   at every context switch). */
#if HAVE_TILES
#define TILES_BEGIN(tiles, DTYPE, BS, D, G)                                                   \
    const int tiles = TILES_OK(DTYPE, BS, D, G);                                              \
    if (tiles) tiles_configure(G);
#define TILES_END(tiles) \
    if (tiles) _tile_release();
#else
#define TILES_BEGIN(tiles, DTYPE, BS, D, G) const int tiles = 0;
#define TILES_END(tiles)
#endif

/* the calling thread's buffer for its calls' partial results (split rows: EXPORT) */
static __thread Grown partial_space;

/* A decode step's tasks: row b's are first[b] .. first[b + 1], its kv heads' parts in turn
   (parts[b] of per[b] blocks each, the last one shorter); first is NULL where no row is split
   (then task t is row t / kv_heads's kv head t % kv_heads, whole). widest: the most tasks of
   one row. */
typedef struct {
    int64_t *first, *parts, *per;
    int64_t block_size, tasks, widest;
} Tasks;

/* NULL arrays and every row whole where none is longer than a part (most steps); returns
   nonzero where an array could not be allocated. */
static int plan_tasks(Tasks *t, const int64_t *lens, int64_t batch, int64_t kv_heads,
                      int64_t block_size) {
    const int64_t most = PART_TOKENS / block_size > 0 ? PART_TOKENS / block_size : 1;
    t->block_size = block_size;
    t->first = t->parts = t->per = NULL;
    t->tasks = batch * kv_heads;
    t->widest = kv_heads;
    int64_t b = 0;
    while (b < batch && lens[b] <= most * block_size) b++;
    if (b == batch) return 0;
    t->first = malloc(sizeof(int64_t) * (size_t)(3 * batch + 1));
    if (t->first == NULL) return 1;
    t->parts = t->first + batch + 1, t->per = t->parts + batch;
    t->first[0] = 0;
    for (b = 0; b < batch; b++) {
        const int64_t blocks = (lens[b] + block_size - 1) / block_size;
        /* equal parts, none empty: a 1,100-token row is two of 560 and 540, not 1,024 and 76 */
        const int64_t count = (blocks + most - 1) / most;
        t->per[b] = (blocks + count - 1) / count;
        t->parts[b] = (blocks + t->per[b] - 1) / t->per[b];
        t->first[b + 1] = t->first[b] + t->parts[b] * kv_heads;
        if (t->parts[b] * kv_heads > t->widest) t->widest = t->parts[b] * kv_heads;
    }
    t->tasks = t->first[batch];
    return 0;
}

/* Task `task` of a plan with split rows: its row, kv head, part count, and the part's first block
   and token count.
   *row: a thread's cursor, 0 before its first task: a thread's tasks come in increasing order
   (deal.h), so it only ever moves forward (a binary search a task cost 3% of a 600-token
   prefill's attention). */
INLINE void task_of(const Tasks *t, const int64_t *lens, int64_t task, int64_t *row, int64_t *b,
                    int64_t *h, int64_t *count, int64_t *block0, int64_t *len) {
    while (t->first[*row + 1] <= task) ++*row;
    *b = *row, *count = t->parts[*row];
    const int64_t r = task - t->first[*row], p = r % *count;
    *h = r / *count;
    *block0 = p * t->per[*row];
    const int64_t start = *block0 * t->block_size, end = start + t->per[*row] * t->block_size;
    *len = (end < lens[*b] ? end : lens[*b]) - start;
}

/* q, out: [B, H, D] of DTYPE; k_cache, v_cache: [Hkv, num_blocks * block_size, D] of KV;
   block_tables: [B, max_blocks]; context_lens: [B]. Returns nonzero if a buffer failed.
   One function per pair of dtypes, each with its own parallel region, so they are constants
   inside the outlined loop body. (row, kv head, part) tasks are dealt ahead (deal.h), so that
   each can ask for the next one's blocks meanwhile (`Next`); the parts of split rows are
   combined after. */
#define EXPORT(NAME, DTYPE, KV)                                                                 \
    int NAME(const void *q, const void *k, const void *v, const int64_t *tables,                \
             const int64_t *lens, void *out, int64_t batch, int64_t heads, int64_t kv_heads,    \
             int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks,      \
             float scale, int num_threads) {                                                    \
        const int64_t group = heads / kv_heads, slots = num_blocks * block_size;                \
        Tasks plan;                                                                             \
        if (plan_tasks(&plan, lens, batch, kv_heads, block_size)) return 1;                     \
        const int64_t tasks = plan.tasks, stride = group * (2 + head_dim);                      \
        /* split rows go in waves of at most WAVE_TASKS tasks (whole rows), each ended by its   \
           combines: the partial results of a long prefill chunk's every part would not fit */  \
        float *partials = NULL;                                                                 \
        if (plan.first != NULL) {                                                               \
            const int64_t held = WAVE_TASKS > plan.widest ? WAVE_TASKS : plan.widest;           \
            partials = grow(&partial_space, sizeof(float) * (size_t)(held * stride));           \
            if (partials == NULL) {                                                             \
                free(plan.first);                                                               \
                return 1;                                                                       \
            }                                                                                   \
        }                                                                                       \
        int failed = 0;                                                                         \
        int64_t claimed = 0;                                                                    \
        if (plan.first == NULL) {                                                               \
            _Pragma("omp parallel num_threads(num_threads)") {                                  \
                TILES_BEGIN(tiles, DTYPE, block_size, head_dim, group)                          \
                FOR_DEALT_AHEAD(task, after, tasks, claimed) {                                  \
                    const int64_t b = task / kv_heads, h = task % kv_heads;                     \
                    Next next = {NULL, 0, 0};                                                   \
                    if (after < tasks) {                                                        \
                        const int64_t nb = after / kv_heads;                                    \
                        next.table = tables + nb * max_blocks;                                  \
                        next.blocks = (lens[nb] + block_size - 1) / block_size;                 \
                        next.head_base = after % kv_heads * slots * head_dim;                   \
                    }                                                                           \
                    if (attend_task(q, k, v, tables + b * max_blocks, lens[b], out, b, h,       \
                                    heads, group, head_dim, slots, block_size, scale, DTYPE,    \
                                    KV, after < tasks ? &next : NULL, NULL, tiles))             \
                        failed = 1;                                                             \
                }                                                                               \
                TILES_END(tiles)                                                                \
            }                                                                                   \
            return failed;                                                                      \
        }                                                                                       \
        _Pragma("omp parallel num_threads(num_threads)") {                                      \
            TILES_BEGIN(tiles, DTYPE, block_size, head_dim, group)                              \
            int64_t cursor = 0, next_cursor = 0; /* task_of's, for this task and the next */    \
            for (int64_t b0 = 0, t0 = 0; t0 < tasks;) {                                         \
                /* this wave: rows b0 .. b1, tasks t0 .. t1 (every thread finds the same) */    \
                int64_t b1 = b0 + 1, t1 = plan.first[b1];                                       \
                while (b1 < batch && plan.first[b1 + 1] - t0 <= WAVE_TASKS)                     \
                    t1 = plan.first[++b1];                                                      \
                FOR_DEALT_AHEAD(task, after, t1, claimed) {                                     \
                    int64_t b, h, count, block0, len;                                           \
                    task_of(&plan, lens, task, &cursor, &b, &h, &count, &block0, &len);         \
                    const int64_t *table = tables + b * max_blocks + block0;                    \
                    Part part = {NULL, NULL, NULL};                                             \
                    if (count > 1) {                                                            \
                        float *slot = partials + (task - t0) * stride;                          \
                        part = (Part){slot, slot + group, slot + 2 * group};                    \
                    }                                                                           \
                    Next next = {NULL, 0, 0};                                                   \
                    if (after < t1) {                                                           \
                        int64_t nb, nh, ncount, nblock0, nlen;                                  \
                        task_of(&plan, lens, after, &next_cursor, &nb, &nh, &ncount, &nblock0,  \
                                &nlen);                                                         \
                        next.table = tables + nb * max_blocks + nblock0;                        \
                        next.blocks = (nlen + block_size - 1) / block_size;                     \
                        next.head_base = nh * slots * head_dim;                                 \
                    }                                                                           \
                    if (attend_task(q, k, v, table, len, out, b, h, heads, group, head_dim,     \
                                    slots, block_size, scale, DTYPE, KV,                        \
                                    after < t1 ? &next : NULL,                                  \
                                    count == 1 ? NULL : &part, tiles))                          \
                        failed = 1;                                                             \
                }                                                                               \
                _Pragma("omp barrier")                                                          \
                float *row = scratch(sizeof(float) * (size_t)head_dim);                         \
                _Pragma("omp for schedule(static)")                                             \
                for (int64_t i = b0 * kv_heads; i < b1 * kv_heads; i++) {                       \
                    const int64_t b = i / kv_heads, h = i % kv_heads;                           \
                    if (plan.parts[b] == 1) continue;                                           \
                    if (row == NULL) {                                                          \
                        failed = 1;                                                             \
                        continue;                                                               \
                    }                                                                           \
                    combine(partials + (plan.first[b] + h * plan.parts[b] - t0) * stride,       \
                            plan.parts[b], group, head_dim, out,                                \
                            (b * heads + h * group) * head_dim, DTYPE, row);                    \
                }                                                                               \
                /* (the for's barrier: every combine read its partials before the next wave) */ \
                _Pragma("omp single")                                                           \
                claimed = t1;                                                                   \
                b0 = b1, t0 = t1;                                                               \
            }                                                                                   \
            TILES_END(tiles)                                                                    \
        }                                                                                       \
        free(plan.first);                                                                       \
        return failed;                                                                          \
    }

EXPORT(paged_decode_attention_f32, F32, F32)
EXPORT(paged_decode_attention_bf16, BF16, BF16)
/* float32 compute over a bf16 cache (--kv-cache-dtype bfloat16) */
EXPORT(paged_decode_attention_f32_bf16kv, F32, BF16)
