/* The k largest logits of each row, for the sampler's top-k / top-p window (replicas/sampler.py:
   `_window`). torch's CPU topk over a 49,152-token vocabulary took ~55-110 us a row (2.2 ms
   for 32 rows at k = 64, on 2 cores); one pass that keeps a heap of the k best and skips every
   block of 16 logits whose largest is no better than the heap's least (nearly all of them once
   the heap holds the row's top) reads the row once at the speed of a max.

   Order: descending; equal values the lower index first. NaN is not ordered here (torch puts it
   first); logits the sampler sees are finite or -inf.

   Built by replicas/kernels/__init__.py together with the other kernels. */

#include <stdint.h>

#define TOPK_BLOCK 16

/* a ranks below b: smaller, or equal and later */
static inline int below(float av, int64_t ai, float bv, int64_t bi) {
    return av < bv || (av == bv && ai > bi);
}

/* restores the min-heap (the lowest-ranked at 0) of `size` from position i down */
static void sift_down(float *v, int64_t *ix, int64_t i, int64_t size) {
    for (;;) {
        int64_t low = i;
        const int64_t l = 2 * i + 1, r = l + 1;
        if (l < size && below(v[l], ix[l], v[low], ix[low])) low = l;
        if (r < size && below(v[r], ix[r], v[low], ix[low])) low = r;
        if (low == i) return;
        const float tv = v[i];
        const int64_t ti = ix[i];
        v[i] = v[low], ix[i] = ix[low];
        v[low] = tv, ix[low] = ti;
        i = low;
    }
}

static void row_topk(const float *x, int64_t n, int64_t k, float *v, int64_t *ix) {
    for (int64_t i = 0; i < k; i++) v[i] = x[i], ix[i] = i;
    for (int64_t i = k / 2 - 1; i >= 0; i--) sift_down(v, ix, i, k);
    /* a later logit equal to the least kept ranks below it (its index is higher): only a
       strictly larger one enters */
    int64_t i = k;
    for (; i < n && i % TOPK_BLOCK; i++)
        if (x[i] > v[0]) v[0] = x[i], ix[0] = i, sift_down(v, ix, 0, k);
    for (; i + TOPK_BLOCK <= n; i += TOPK_BLOCK) {
        float best = x[i];
        for (int j = 1; j < TOPK_BLOCK; j++) best = x[i + j] > best ? x[i + j] : best;
        if (!(best > v[0])) continue;
        for (int j = 0; j < TOPK_BLOCK; j++)
            if (x[i + j] > v[0]) v[0] = x[i + j], ix[0] = i + j, sift_down(v, ix, 0, k);
    }
    for (; i < n; i++)
        if (x[i] > v[0]) v[0] = x[i], ix[0] = i, sift_down(v, ix, 0, k);
    /* heapsort: each lowest-ranked to the back, so the row ends best first */
    for (int64_t end = k - 1; end > 0; end--) {
        const float tv = v[0];
        const int64_t ti = ix[0];
        v[0] = v[end], ix[0] = ix[end];
        v[end] = tv, ix[end] = ti;
        sift_down(v, ix, 0, end);
    }
}

/* x [rows, n] float32; values [rows, k] float32, indices [rows, k] int64; 0 < k <= n. */
int topk_f32(const void *x, int64_t rows, int64_t n, int64_t k, void *values, void *indices,
             int num_threads) {
    const float *xs = x;
    float *vs = values;
    int64_t *is = indices;
    if (k <= 0 || k > n) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) row_topk(xs + r * n, n, k, vs + r * k, is + r * k);
    return 0;
}
