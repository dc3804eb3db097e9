/* The sampler's kernels (replicas/sampler.py) on CPUs: each row's largest logit (greedy rows), the
   k largest logits of each row, one token a row drawn from its logits, a token's
   log-probability, rank and the row's most likely alternatives (logprobs), the repetition,
   frequency and presence penalties, and constraint bitmasks.

   Top-k (`_window`'s window): torch's CPU topk over a 49,152-token vocabulary took ~55-110 us a
   row (2.2 ms for 32 rows at k = 64, on 2 cores); one pass that keeps a heap of the k best and
   skips every block of 16 logits whose largest is no better than the heap's least (nearly all
   of them once the heap holds the row's top) reads the row once at the speed of a max.

   Order: descending; equal values the lower index first. NaN is not ordered here (torch puts it
   first); logits the sampler sees are finite or -inf.

   Built by replicas/kernels/__init__.py together with the other kernels. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"

#define TOPK_BLOCK 64

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
        /* whether any logit of the block passes the least kept: compares ORed in vectors, no
           horizontal max a block (which took as long as the rest of the draw) */
        const float least = v[0];
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int j = 0; j < TOPK_BLOCK; j++) hit |= x[i + j] > least;
        if (!hit) continue;
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

/* ---- greedy rows -----------------------------------------------------------------------------
   torch.argmax's answer: the first index of the row's largest value, or of its first NaN (NaN
   ranks above everything, as in torch). torch's CPU argmax took 0.69 ms for 32 rows of a
   49,152-token vocabulary on 2 cores (2-core Zen 4). Built with -ffast-math, so NaN is found
   from the bits, not by x != x. */

#define SCAN_BLOCK 64

static inline int is_nan(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return (b & 0x7fffffffu) > 0x7f800000u;
}

/* the first index in x[0, n) where pred holds, blocks of SCAN_BLOCK tested in vectors; n if none */
#define FIRST_WHERE(PRED)                                                                     \
    do {                                                                                      \
        int64_t i = 0;                                                                        \
        for (; i + SCAN_BLOCK <= n; i += SCAN_BLOCK) {                                        \
            int hit = 0;                                                                      \
            _Pragma("omp simd reduction(| : hit)") for (int j = 0; j < SCAN_BLOCK; j++) {     \
                const float e = x[i + j];                                                     \
                hit |= (PRED);                                                                \
            }                                                                                 \
            if (hit) break;                                                                   \
        }                                                                                     \
        for (; i < n; i++) {                                                                  \
            const float e = x[i];                                                             \
            if (PRED) return i;                                                               \
        }                                                                                     \
        return n;                                                                             \
    } while (0)

static int64_t first_nan(const float *x, int64_t n) { FIRST_WHERE(is_nan(e)); }

static int64_t first_equal(const float *x, int64_t n, float m) { FIRST_WHERE(e == m); }

static int64_t row_argmax(const float *x, int64_t n) {
    float m = x[0];
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t i = 0; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        nan |= is_nan(x[i]);
    }
    if (nan) return first_nan(x, n);
    /* none equal: every value is -inf, below the reduction's start (-FLT_MAX under
       -ffast-math), and torch's answer is the first */
    const int64_t at = first_equal(x, n, m);
    return at < n ? at : 0;
}

/* x [rows, n] float32, n > 0; out [rows] int64 */
int argmax_f32(const void *x, int64_t rows, int64_t n, void *out, int num_threads) {
    const float *xs = x;
    int64_t *os = out;
    if (n <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) os[r] = row_argmax(xs + r * n, n);
    return 0;
}

/* ---- the draw -------------------------------------------------------------------------------
   One token a row by inverse transform (`_draw`'s, one uniform a row against the running sum of
   the row's probabilities), every row on its own: a row with top-k or top-p draws inside the
   window of its largest max(first, top_k + 1) logits where its set closes there, in the window's
   order, else by rejection (`_draw_truncated`'s: a token drawn from the whole row is kept where
   it lies in the set, else it and every token no more likely leave the row and the row draws
   again, with a new uniform: `redraw_f32`, a round a call); a row with neither draws over the
   whole row. A row's min_p first drops every token less likely than min_p times the largest
   (`min_p_floor`), as `_min_p` masks them in torch. In torch that is ~15 tensor operations a
   step (max, softmax, the window's gathers, running sums, searches), ~0.4 ms for one row of a
   49,152-token vocabulary against 20-35 us here. Probabilities are e^(x - max) / sum; a logit
   more than 87 below the row's largest (e^-87 ~ 1e-38 of its mass) gets none, and a token of
   none is never drawn. */

#define WINDOW_MAX 256 /* a window's widest (kernels.TOPK_MAX): wider, by rejection */
#define DRAW_BLOCK 16

/* e^d for d <= 0, 0 below -87 (exp_approx's polynomial): written so that GCC vectorizes it in
   these loops (exp_approx's union and rounding branch kept them scalar: 6x slower) */
KERNEL_INLINE float weight(float d) {
    const float c = fmaxf(d, -87.0f), fn = __builtin_rintf(c * 1.44269504088896341f);
    const float r = (c - fn * 0.693359375f) + fn * 2.12194440e-4f;
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (
        1.0f / 120 + r * (1.0f / 720))))));
    const int32_t bits = ((int32_t)fn + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return d >= -87.0f ? p * scale : 0.0f;
}

static float row_max(const float *x, int64_t n) {
    float m = x[0];
#pragma omp simd reduction(max : m)
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* the weight of a logit above floor (the tokens a rejection left in the row; -FLT_MAX: all,
   a constant where inlined, so the plain draw's loops carry no test: 5% of its time) */
KERNEL_INLINE float weight_above(float x, float m, float floor) {
    return floor == -FLT_MAX || x > floor ? weight(x - m) : 0.0f;
}

KERNEL_INLINE float row_mass(const float *x, int64_t n, float m, float floor) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += weight_above(x[i], m, floor);
    return s;
}

/* The first token above floor whose running sum of weights passes target: blocks whose sum
   does not reach it are passed whole. Summed in another order than row_mass, so a target within
   rounding of the total can be passed by none: then the last token of any weight. */
KERNEL_INLINE int64_t row_search(const float *x, int64_t n, float m, float floor,
                                float target) {
    float run = 0.0f;
    int64_t i = 0, last = -1, last_block = -1;
    for (; i + DRAW_BLOCK <= n; i += DRAW_BLOCK) {
        float b = 0.0f;
#pragma omp simd reduction(+ : b)
        for (int j = 0; j < DRAW_BLOCK; j++) b += weight_above(x[i + j], m, floor);
        if (run + b > target) break;
        if (b > 0.0f) run += b, last_block = i;
    }
    for (; i < n; i++) {
        const float w = weight_above(x[i], m, floor);
        if (w > 0.0f) {
            run += w, last = i;
            if (run > target) return i;
        }
    }
    if (last < 0 && last_block >= 0)
        for (int64_t j = last_block + DRAW_BLOCK - 1; j >= last_block && last < 0; j--)
            if (weight_above(x[j], m, floor) > 0.0f) last = j;
    return last < 0 ? 0 : last;
}

/* Whether token t lies in its row's set: fewer than top_k tokens more likely, holding less than
   top_p of the row's mass (the most likely token always does; equal ones at the boundary are
   kept). */
KERNEL_INLINE int in_set(const float *x, int64_t n, float m, float mass, int64_t t,
                         int64_t top_k, float top_p) {
    const float xt = x[t];
    int64_t count = 0;
    float above = 0.0f;
#pragma omp simd reduction(+ : count, above)
    for (int64_t i = 0; i < n; i++) {
        count += x[i] > xt;
        above += weight_above(x[i], m, xt);
    }
    return count == 0 || (count < top_k && above < top_p * mass);
}

/* The set of a row with top-k / top-p inside its w largest logits (v, ix: best first): 1 and its
   token where the set closes there, else 0 (it may reach past them). */
KERNEL_INLINE int set_draw(const float *v, const int64_t *ix, int64_t w, int64_t n,
                          int64_t top_k, float top_p, float u, float m, float floor, float mass,
                          int64_t *token) {
    float p[WINDOW_MAX];
    /* the set: ranks below top_k, above min_p's floor, whose more likely tokens hold less than
       top_p (at least one: the largest is above the floor) */
    int64_t c = 0;
    float before = 0.0f;
    for (; c < w; c++) {
        if (c >= top_k || (c > 0 && before >= top_p) || !(v[c] > floor)) break;
        p[c] = weight(v[c] - m) / mass;
        before += p[c];
    }
    if (c == w && w < n) return 0; /* the set may reach past the window */
    float total = 0.0f;
    for (int64_t j = 0; j < c; j++) total += p[j];
    const float target = u * total;
    float run = 0.0f;
    int64_t pick = 0;
    for (int64_t j = 0; j < c; j++) {
        if (p[j] > 0.0f) {
            run += p[j], pick = j;
            if (run > target) break;
        }
    }
    *token = ix[pick];
    return 1;
}

/* A first look at a row's NARROW largest logits: a confident model's set (a low temperature, a
   top_p) closes within a few, and a heap of 64 took 40 us of a 49,152-token row (its ~425
   insertions' branches) against ~5 us for 16. Where the set closes inside the narrow window it
   is the same set, drawn in the same order, as inside the wide one. */
#define NARROW 16

/* A row with top-k / top-p: 1 and its token where its set closes inside its window, else 0. */
KERNEL_INLINE int row_window(const float *x, int64_t n, int64_t first, int64_t top_k,
                            float top_p, float u, float m, float floor, float mass,
                            int64_t *token) {
    int64_t w = top_k < n ? top_k + 1 : 0;
    w = w > first ? w : first;
    w = w < n ? w : n;
    if (w > WINDOW_MAX) return 0;
    float v[WINDOW_MAX];
    int64_t ix[WINDOW_MAX];
    /* (a top_k of NARROW or more alone sets that many tokens: the first look cannot close) */
    if (w > NARROW && (top_p < 1.0f || top_k < NARROW)) {
        row_topk(x, n, NARROW, v, ix);
        if (set_draw(v, ix, NARROW, n, top_k, top_p, u, m, floor, mass, token)) return 1;
    }
    row_topk(x, n, w, v, ix);
    return set_draw(v, ix, w, n, top_k, top_p, u, m, floor, mass, token);
}

/* min_p's floor: a token whose probability is below min_p times the largest's, e^(x - m) <
   min_p, leaves the row, so a row keeps x >= m + ln(min_p), i.e. x above the float below it;
   -FLT_MAX (none) for min_p 0. min_p 1 keeps the largest logits alone. */
KERNEL_INLINE float min_p_floor(float m, float min_p) {
    return min_p > 0.0f ? nextafterf(m + logf(min_p), -FLT_MAX) : -FLT_MAX;
}

/* One row of draw_f32 (floor: min_p's, the constant -FLT_MAX where a row has none, so those
   loops carry no test) */
KERNEL_INLINE void draw_row(const float *row, int64_t n, float m, float floor, int64_t first,
                            int64_t top_k, float top_p, float u, int64_t *token, uint8_t *kept) {
    const float mass = row_mass(row, n, m, floor);
    const int truncated = top_k < n || top_p < 1.0f;
    if (truncated && row_window(row, n, first, top_k, top_p, u, m, floor, mass, token)) {
        *kept = 1;
        return;
    }
    *token = row_search(row, n, m, floor, u * mass);
    *kept = (uint8_t)(!truncated || in_set(row, n, m, mass, *token, top_k, top_p));
}

/* x [rows, n] float32 (the tempered logits); first: a window's least width (the sampler's
   FIRST_CANDIDATES); top_k [rows] (n or more: none), top_p [rows] (1: none), min_p [rows] (0:
   none), u [rows] uniforms in [0, 1); tokens [rows] int64 out, kept [rows] uint8 out (0: the
   row's set reaches past its window and its token, drawn from the whole row, lies outside it:
   rejected, for `redraw_f32`). */
int draw_f32(const void *x, int64_t rows, int64_t n, int64_t first, const void *top_k,
             const void *top_p, const void *min_p, const void *u, void *tokens, void *kept,
             int num_threads) {
    const float *xs = x, *ps = top_p, *mps = min_p, *us = u;
    const int64_t *ks = top_k;
    int64_t *ts = tokens;
    uint8_t *cs = kept;
    if (n <= 0 || first <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = xs + r * n;
        const float m = row_max(row, n);
        if (mps[r] > 0.0f)
            draw_row(row, n, m, min_p_floor(m, mps[r]), first, ks[r], ps[r], us[r], ts + r, cs + r);
        else
            draw_row(row, n, m, -FLT_MAX, first, ks[r], ps[r], us[r], ts + r, cs + r);
    }
    return 0;
}

/* One rejection round for `count` rows of x [.., n]: row j is x's row at[j], whose last draw,
   tokens[j], lay outside its set; it and every token no more likely leave the row, and the row
   draws again from what is left with u[j]. tokens [count] int64 in and out, kept [count] uint8
   out (0: rejected again); top_k, top_p, min_p as draw_f32's, one a row of the round. */
int redraw_f32(const void *x, int64_t count, int64_t n, const void *at, const void *top_k,
               const void *top_p, const void *min_p, const void *u, void *tokens, void *kept,
               int num_threads) {
    const float *xs = x, *ps = top_p, *mps = min_p, *us = u;
    const int64_t *rs = at, *ks = top_k;
    int64_t *ts = tokens;
    uint8_t *cs = kept;
    if (n <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (count > 1)
    for (int64_t j = 0; j < count; j++) {
        const float *row = xs + rs[j] * n;
        const float m = row_max(row, n);
        /* the set's mass: the tokens min_p keeps (a rejected token is one of them) */
        const float mass = row_mass(row, n, m, min_p_floor(m, mps[j]));
        const float floor = row[ts[j]], left = row_mass(row, n, m, floor);
        if (!(left > 0.0f)) { /* nothing above it (it was the most likely): always in the set */
            cs[j] = 1;
            continue;
        }
        ts[j] = row_search(row, n, m, floor, us[j] * left);
        cs[j] = (uint8_t)in_set(row, n, m, mass, ts[j], ks[j], ps[j]);
    }
    return 0;
}

/* ---- logprobs -------------------------------------------------------------------------------
   A row's log-probabilities are x - lse, lse = m + ln sum e^(x - m) (log_softmax's); for its
   token: that value and its rank (1 + the tokens strictly more likely), and the row's k most
   likely tokens with theirs, best first (the heap's order: equal values the lower index first).
   torch's log_softmax, compare-and-sum and topk over 32 rows of 49,152 logits took 3-12 ms a
   step on 2 cores (2-core Zen 4); a native pass each for the max, the sum, the rank and the top
   k. */

/* x [rows, n] float32 (raw logits), tokens [rows] int64; 0 <= k <= min(n, WINDOW_MAX);
   chosen [rows] float32, ranks [rows] int64, top_values [rows, k] float32, top_ids [rows, k]
   int64 out */
int logprobs_f32(const void *x, int64_t rows, int64_t n, const void *tokens, int64_t k,
                 void *chosen, void *ranks, void *top_values, void *top_ids, int num_threads) {
    const float *xs = x;
    const int64_t *ts = tokens;
    float *cs = chosen, *tv = top_values;
    int64_t *rs = ranks, *ti = top_ids;
    if (n <= 0 || k < 0 || k > n || k > WINDOW_MAX) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = xs + r * n;
        const float m = row_max(row, n);
        /* the mass in float runs of 256 summed in double: one float sum over a 49,152-token
           row drifted by 1e-4 where the build sums one lane at a time (portable) */
        double mass = 0.0;
        for (int64_t i = 0; i < n; i += 256)
            mass += row_mass(row + i, n - i < 256 ? n - i : 256, m, -FLT_MAX);
        const float lse = m + (float)log(mass);
        const float xt = row[ts[r]];
        int64_t above = 0;
#pragma omp simd reduction(+ : above)
        for (int64_t i = 0; i < n; i++) above += row[i] > xt;
        cs[r] = xt - lse;
        rs[r] = above + 1;
        if (k == 0) continue;
        row_topk(row, n, k, tv + r * k, ti + r * k);
        for (int64_t j = 0; j < k; j++) tv[r * k + j] -= lse;
    }
    return 0;
}

/* ---- penalties ------------------------------------------------------------------------------
   As `apply_penalties` defines them: the repetition penalty r on each distinct token of the row's
   prompt and output once (x / r where x > 0, else x * r), then the frequency penalty f and the
   presence penalty p on each distinct output token (x - f * its count, then - p). Only the seen
   tokens are touched, with the same float operations as torch's gather/scatter and full-row
   subtractions (so the same bits); torch's counts over the whole vocabulary and the passes over
   every row took 5-7 ms a step for 32 rows of 49,152 logits (2-core Zen 4). */

#define SEEN 0x80000000u /* a token's repetition penalty is applied (the rest: its output count) */

/* a thread's [n] counters, zero between rows (each row clears what it touched) */
static __thread uint32_t *marks;
static __thread int64_t marks_len;

/* x [rows, n] float32, in place; ids [rows, width] int64: each row's prompt and output tokens,
   then negative padding; lens [rows]: ids taken; out_start [rows]: where the output starts;
   repetition, frequency, presence [rows] float32 (1, 0, 0: none). Returns nonzero when a thread's
   counters could not be allocated. Without -ffast-math's reciprocals and fused multiply-adds
   here: x / r as a multiply by 1 / r, or x - f * count in one rounding, would differ from
   torch's bits. */
__attribute__((optimize("no-reciprocal-math", "fp-contract=off")))
int penalize_f32(void *x, int64_t rows, int64_t n, const void *ids, int64_t width,
                 const void *lens, const void *out_start, const void *repetition,
                 const void *frequency, const void *presence, int num_threads) {
    float *xs = x;
    const int64_t *is = ids, *ls = lens, *os = out_start;
    const float *rep = repetition, *freq = frequency, *pres = presence;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        if (marks_len < n) {
            free(marks);
            marks = calloc((size_t)n, sizeof *marks);
            marks_len = marks ? n : 0;
            if (!marks) {
                failed = 1;
                continue;
            }
        }
        float *row = xs + r * n;
        const int64_t *id = is + r * width;
        const int64_t len = ls[r] < width ? ls[r] : width;
        if (rep[r] != 1.0f)
            for (int64_t j = 0; j < len; j++) {
                const int64_t t = id[j];
                if (t < 0 || t >= n || (marks[t] & SEEN)) continue;
                marks[t] |= SEEN;
                row[t] = row[t] > 0.0f ? row[t] / rep[r] : row[t] * rep[r];
            }
        if (freq[r] != 0.0f || pres[r] != 0.0f) {
            for (int64_t j = os[r]; j < len; j++)
                if (id[j] >= 0 && id[j] < n) marks[id[j]]++;
            for (int64_t j = os[r]; j < len; j++) {
                const int64_t t = id[j];
                if (t < 0 || t >= n || !(marks[t] & ~SEEN)) continue;
                row[t] -= freq[r] * (float)(marks[t] & ~SEEN);
                row[t] -= pres[r];
                marks[t] &= SEEN; /* applied: the token's later copies pass */
            }
        }
        for (int64_t j = 0; j < len; j++)
            if (id[j] >= 0 && id[j] < n) marks[id[j]] = 0;
    }
    return failed;
}

/* ---- bitmasks -------------------------------------------------------------------------------
   A constrained row's disallowed tokens to -inf (structured/bitmask.py's layout: int32 words,
   bit t % 32 of word t / 32 set where token t is allowed; tokens past the words' 32 W are
   disallowed). torch's unpacking to bytes, compare and masked fill took 4 ms a step for 32 rows
   of 49,152 logits on 2 cores (2-core Zen 4). */

KERNEL_INLINE float neg_inf(void) {
    const uint32_t bits = 0xff800000u; /* -inf, from its bits: -ffast-math assumes none */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* x [.., n] float32 in place; words [.., w] int32; rows [count] int64: the constrained rows
   (their masks are their rows of words). */
int bitmask_f32(void *x, int64_t n, const void *words, int64_t w, const void *rows, int64_t count,
                int num_threads) {
    float *xs = x;
    const uint32_t *ws = words;
    const int64_t *rs = rows;
    const float ninf = neg_inf();
    const int64_t covered = n < 32 * w ? n : 32 * w;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count > 1)
    for (int64_t j = 0; j < count; j++) {
        float *row = xs + rs[j] * n;
        const uint32_t *mask = ws + rs[j] * w;
        int64_t i = 0;
        for (; i + 32 <= covered; i += 32) {
            const uint32_t m = mask[i / 32];
            if (m == 0xffffffffu) continue;
#pragma omp simd
            for (int b = 0; b < 32; b++) row[i + b] = (m >> b) & 1u ? row[i + b] : ninf;
        }
        for (; i < covered; i++)
            if (!((mask[i / 32] >> (i % 32)) & 1u)) row[i] = ninf;
        for (; i < n; i++) row[i] = ninf;
    }
    return 0;
}
