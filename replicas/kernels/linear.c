/* bfloat16 linear layers on CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) over a weight packed
   once, after loading, for AVX512-BF16's dot-product instruction.

   The instruction multiplies pairs of bf16 and adds each pair's sum into a float32 lane. The
   packed weight is [ceil(N/32)][ceil(K/2)][32][2]: panels of 32 output columns, in each a row of
   32 (column, k pair) entries per k pair, zero-padded past N and K. A 32-column panel is then two
   vectors per k pair, and one x pair broadcast to all lanes multiplies both, so every lane of
   every instruction is one output's running sum: nothing is summed across lanes at the end (the
   unpacked [N, K] layout needed a 16-to-1 fold per 16 outputs, which cost as much as a third of
   the products at K = 576). An 8-row tile keeps 16 accumulators, the panel's two vectors and an
   x broadcast in registers; panels are split across threads, so each thread streams its own
   share of the weight once per call, and x (row tile by row tile) comes from L1/L2.

   Accumulation is in float32 and the result rounded once to bf16 (to nearest even), as oneDNN
   does; only the order of the float32 additions differs. On the project's 2-core EPYC (peak
   ~450 GFLOP/s of these instructions) against the unpacked kernel and torch, bench-135m's
   layer shapes: 1 row 33 GB/s of weights vs 20 and 13; 32 rows 380 GFLOP/s vs 271 and 218; 128
   rows 422 vs 354 and 309; 2048 rows 439 vs 367 and 412.

   Without AVX512-BF16 `linear_bf16_fast` returns 0: nothing is packed and torch multiplies. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "deal.h"
#include "dtype.h"
#include "tiles.h"
#include "vec.h"
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if HAVE_DPBF16 && HAVE_TILES
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

#define PANEL 32 /* output columns per panel: two 16-lane vectors */
#define PANEL_SIZE(K) (((K) + 1) / 2 * 2 * PANEL) /* bf16 elements of a packed panel */
#define ROWS 8   /* rows of x per tile: 16 accumulators */
#define CHUNK_PAIRS 32  /* k pairs of a panel per chunk (panel_rows): 4 KiB of weights, in L1 */
#define CHUNKED_ROWS 64 /* up to this many rows the tiles take turns chunk by chunk */
#define CHUNKED(M, K) ((M) > ROWS && (M) <= CHUNKED_ROWS && (K) >= 2)

int linear_bf16_fast(void) { return HAVE_DPBF16; }

#if HAVE_DPBF16

/* Pairs p0 .. p1 of the panel against rows m0 .. m0+MT of x, going on from the float32 partial
   sums in sums (the tile's MT rows of PANEL; zero where p0 is 0) and leaving them there; MT is
   a constant at each call site so the accumulators live in registers. Meanwhile the tile's
   share of the next chunk's lines (or of the next panel's first) is asked of memory. */
KERNEL_INLINE void chunk_tile(const uint16_t *x, const uint16_t *panel, float *sums, int64_t K,
                              int64_t m0, int64_t p0, int64_t p1, Ahead ahead, int MT) {
    __m512 acc[ROWS][2];
    for (int i = 0; i < MT; i++) {
        acc[i][0] = p0 ? _mm512_loadu_ps(sums + i * PANEL) : _mm512_setzero_ps();
        acc[i][1] = p0 ? _mm512_loadu_ps(sums + i * PANEL + 16) : _mm512_setzero_ps();
    }
    const uint16_t *xr[ROWS];
    for (int i = 0; i < MT; i++) xr[i] = x + (m0 + i) * K;
    for (int64_t p = p0; p < p1; p++) {
        ahead_step(&ahead, p1 - p0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * PANEL);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * PANEL + PANEL);
        for (int i = 0; i < MT; i++) {
            uint32_t pair;
            memcpy(&pair, xr[i] + 2 * p, sizeof pair);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
        }
    }
    for (int i = 0; i < MT; i++) {
        _mm512_storeu_ps(sums + i * PANEL, acc[i][0]);
        _mm512_storeu_ps(sums + i * PANEL + 16, acc[i][1]);
    }
}

/* The sums of rows m0 .. m0+MT (+ the odd K's last element, + bias) into y, rounded once to bf16
   (to nearest even), as oneDNN does. */
KERNEL_INLINE void store_tile(const uint16_t *x, const uint16_t *panel, const float *sums,
                              const uint16_t *bias, uint16_t *y, int64_t N, int64_t K,
                              int64_t m0, int64_t n0, int MT) {
    for (int h = 0; h < 2; h++) {
        const int64_t c0 = n0 + 16 * h;
        if (c0 >= N) break;
        const __mmask16 mask = N - c0 >= 16 ? 0xffff : (__mmask16)((1u << (N - c0)) - 1);
        __m512 b = _mm512_setzero_ps();
        if (bias)
            b = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c0)), 16));
        for (int i = 0; i < MT; i++) {
            __m512 a = _mm512_loadu_ps(sums + i * PANEL + 16 * h);
            if (K & 1)  // the last x element pairs with zero (the packed padding is zero too)
                a = _mm512_dpbf16_ps(
                    a, (__m512bh)_mm512_set1_epi32((int)x[(m0 + i) * K + K - 1]),
                    (__m512bh)_mm512_loadu_si512(panel + K / 2 * 2 * PANEL + PANEL * h));
            _mm256_mask_storeu_epi16(y + (m0 + i) * N + c0, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
        }
    }
}

/* chunk_tile over every pair, then store_tile (the tail tiles of panel_rows) */
KERNEL_INLINE void whole_tile(const uint16_t *x, const uint16_t *panel, float *sums,
                              const uint16_t *bias, uint16_t *y, int64_t N, int64_t K,
                              int64_t m0, int64_t n0, Ahead ahead, int MT) {
    chunk_tile(x, panel, sums, K, m0, 0, K / 2, ahead, MT);
    store_tile(x, panel, sums, bias, y, N, K, m0, n0, MT);
}

/* One panel against every row of x. Beyond one tile and up to CHUNKED_ROWS rows (decode
   batches) the tiles go over the panel together, a chunk at a time: every tile but the first
   reads the chunk from L1, so the panel's memory traffic is spread over all of its compute.
   Tile by tile, the first tile's whole pass waited on memory and the others' on nothing. On Zen
   5 (compute twice Zen 4's, against the same memory), bench-135m's projections, `bench linear`:
   32 rows 533 -> 613-665 GFLOP/s (55% -> 65-68% of the vdpbf16ps peak), 16 rows 338 ->
   419-462; chunks of 16 or 64 pairs were slower than 32, 128 no better than none. The next
   chunk (after the last, the thread's next panel's first, dealt ahead: deal.h) is prefetched
   meanwhile, each tile asking for its rows' share of its lines, one line every few pairs: when
   the first tile asked for all 64 lines within its own pass (a quarter of the chunk's compute
   at 32 rows) the misses queued behind each other and it stalled. Zen 4, the same bench: 32 rows
   62-64% -> 74-80% of the peak, 16 rows 46-49% -> 58-65%, 64 rows 72% -> 79-86%. */
static void panel_rows(const uint16_t *x, const uint16_t *panel, const uint16_t *bias,
                       uint16_t *y, int64_t M, int64_t N, int64_t K, int64_t n0,
                       const uint16_t *next_panel) {
    float sums[CHUNKED_ROWS * PANEL] __attribute__((aligned(64)));
    const int64_t pairs = K / 2, whole = M / ROWS * ROWS;
    int64_t m = 0;
    if (CHUNKED(M, K)) {
        const int64_t lines = 2 * CHUNK_PAIRS; /* of a chunk: a pair is 2 cache lines */
        for (int64_t p0 = 0; p0 < pairs; p0 += CHUNK_PAIRS) {
            const int64_t p1 = p0 + CHUNK_PAIRS < pairs ? p0 + CHUNK_PAIRS : pairs;
            const uint16_t *next = p1 < pairs ? panel + p1 * 2 * PANEL : next_panel;
            for (m = 0; m < whole; m += ROWS)
                chunk_tile(x, panel, sums + m * PANEL, K, m, p0, p1,
                           ahead_share(next, lines, m, ROWS, M), ROWS);
            TAIL_TILES(chunk_tile, M - whole, x, panel, sums + whole * PANEL, K, whole, p0, p1,
                       ahead_share(next, lines, whole, M - whole, M))
        }
        for (m = 0; m < whole; m += ROWS)
            store_tile(x, panel, sums + m * PANEL, bias, y, N, K, m, n0, ROWS);
        TAIL_TILES(store_tile, M - whole, x, panel, sums + whole * PANEL, bias, y, N, K, whole,
                   n0)
        return;
    }
    /* one row, a few, or prefill's many: each tile over the whole panel in one pass, the tiles
       of many asking for the thread's next panel meanwhile */
    const int64_t lines = next_panel ? (PANEL_SIZE(K) * 2 + 63) / 64 : 0;
    for (; m < whole; m += ROWS)
        whole_tile(x, panel, sums, bias, y, N, K, m, n0, ahead_share(next_panel, lines, m, ROWS, M),
                   ROWS);
    TAIL_TILES(whole_tile, M - whole, x, panel, sums, bias, y, N, K, whole, n0,
               ahead_share(next_panel, lines, whole, M - whole, M))
}

#endif

#if HAVE_AMX
/* ---- AMX-BF16 (Sapphire Rapids, Granite Rapids) ------------------------------------------------
   The same packed panels through AMX's tile multiply: TDPBF16PS adds a [16, 32] bf16 tile of x
   times a [32, 16] tile of the weight (as 16 rows of k pairs, the VNNI layout) into a [16, 16]
   float32 tile. A panel's k pair p is 32 columns x 2 = 128 bytes, so its two 16-column halves
   are tiles with a 128-byte stride, read in place: the packing is linear_bf16's. A block of 32
   rows x 32 columns keeps four accumulator tiles, two of x and two of the weight: the eight tile
   registers. Each output is the same sequence of tile products whatever the call's rows, so a
   row's bits do not depend on its batch (as on the vdpbf16ps path).

   On the 2-core Xeon (AMX, 480 MB of L3) this was written on, vdpbf16ps peaks at ~220 GFLOP/s
   and the tiles at ~6,500, so on vdpbf16ps a 32-row decode step's projections were compute-bound
   (bench-135m, `bench linear`: 37.5 ms, where torch's oneDNN, on the tiles, took 22). On the
   tiles: 1 row 10-11 ms (1.8x torch), 32 rows 13-14 ms (1.5x torch; 75-80% of one row's rate of
   reading the weights), 512 rows 72-79 ms (0.8x torch). K must be a multiple of 32 (a tile's
   depth), as every Llama-family width is; other widths take the vdpbf16ps path. A software
   prefetch of the stream 2-16 KiB ahead did not measure above the noise. */

/* Tiles 0, 1: the sums of rows 0..r0 (column halves); 2, 3: of rows 16..16+r1; 4, 5: those rows
   of x; 6, 7: the weight's halves. Each thread configures its own tiles. */
static void amx_configure(int r0, int r1) {
    const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
    const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    tiles_load(rows, colsb);
}

/* One panel against one block of x (r0 rows, then r1 more from 16 on: the configured tiles; x
   and y already at the block's first row), the sums of its first `stored` rows rounded once to
   bf16 (+ bias) into y. */
static void amx_block(const uint16_t *x, const uint16_t *panel, const uint16_t *bias,
                      uint16_t *y, int64_t N, int64_t K, int64_t n0, int r0, int r1,
                      int64_t stored) {
    float sums[32 * PANEL] __attribute__((aligned(64)));
    const size_t xs = (size_t)K * sizeof *x, ws = 2 * PANEL * sizeof *panel;
    const uint16_t *x1 = x + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    if (r1) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
            _tile_loadd(6, panel + k * PANEL, ws);
            _tile_loadd(7, panel + k * PANEL + PANEL, ws);
            _tile_loadd(4, x + k, xs);
            _tile_loadd(5, x1 + k, xs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, sums + 16 * PANEL, PANEL * sizeof *sums);
        _tile_stored(3, sums + 16 * PANEL + 16, PANEL * sizeof *sums);
    } else {
        for (int64_t k = 0; k < K; k += 32) {
            _tile_loadd(6, panel + k * PANEL, ws);
            _tile_loadd(7, panel + k * PANEL + PANEL, ws);
            _tile_loadd(4, x + k, xs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, sums, PANEL * sizeof *sums);
    _tile_stored(1, sums + 16, PANEL * sizeof *sums);
    /* as the vdpbf16ps tiles' sums (K is even: x is not read) */
    store_tile(x, panel, sums, bias, y, N, K, 0, n0, (int)stored);
}

/* One panel against every row: blocks of 32 rows from x, the last (a ragged one past 32 rows)
   from `tail`, its rows copied into zeros, so every block of a call has the same tiles. */
static void amx_panel_rows(const uint16_t *x, const uint16_t *tail, const uint16_t *panel,
                           const uint16_t *bias, uint16_t *y, int64_t M, int64_t N, int64_t K,
                           int64_t n0, int r0, int r1) {
    if (M <= 32) {
        amx_block(x, panel, bias, y, N, K, n0, r0, r1, M);
        return;
    }
    const int64_t whole = M / 32 * 32;
    for (int64_t m = 0; m < whole; m += 32)
        amx_block(x + m * K, panel, bias, y + m * N, N, K, n0, 16, 16, 32);
    if (whole < M) amx_block(tail, panel, bias, y + whole * N, N, K, n0, 16, 16, M - whole);
}

/* Up to this many rows each thread streams a contiguous share of the panels (FOR_STOLEN): on
   tiles a decode batch is memory-bound, not compute-bound as on vdpbf16ps */
#define AMX_STREAM_ROWS 64
static int linear_amx(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                      int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + PANEL - 1) / PANEL, panel_size = PANEL_SIZE(K);
    /* up to 32 rows the tiles are configured to the rows; beyond, to whole blocks */
    const int r0 = M >= 16 ? 16 : (int)M, r1 = M > 32 ? 16 : M > 16 ? (int)M - 16 : 0;
    uint16_t *tail = NULL;
    if (M > 32 && M % 32) {
        const int64_t whole = M / 32 * 32;
        tail = calloc((size_t)(32 * K), sizeof *tail);
        if (tail == NULL) return 2;
        memcpy(tail, x + whole * K, (size_t)((M - whole) * K) * sizeof *x);
    }
    int64_t claimed = 0;
    Stolen stolen;
    stolen_init(&stolen, panels, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure(r0, r1);
        if (M > AMX_STREAM_ROWS) {
            FOR_DEALT_AHEAD(t, after, panels, claimed)
                amx_panel_rows(x, tail, w + t * panel_size, bias, y, M, N, K, t * PANEL, r0, r1);
        } else {
            FOR_STOLEN(t, &stolen,
                       amx_panel_rows(x, tail, w + t * panel_size, bias, y, M, N, K, t * PANEL,
                                      r0, r1))
        }
        /* the tiles' state is saved at every context switch while in use */
        _tile_release();
    }
    free(tail);
    return 0;
}
#endif

/* x [M, K], packed w (above), bias [N] or NULL, y [M, N]; all bf16, contiguous. Returns 1 where
   the build lacks AVX512-BF16 (callers never pack there). */
int linear_bf16(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                int64_t K, int num_threads) {
#if HAVE_DPBF16
    const uint16_t *xs = x, *ws = w, *bs = bias;
    uint16_t *ys = y;
#if HAVE_AMX
    if (K % 32 == 0) return linear_amx(xs, ws, bs, ys, M, N, K, num_threads);
#endif
    const int64_t panels = (N + PANEL - 1) / PANEL, panel_size = PANEL_SIZE(K);
    int64_t claimed = 0;
    Stolen stolen;
    stolen_init(&stolen, panels, num_threads);
    /* Above STREAM_ROWS panels go one at a time, prefill included, so a thread preempted by the
       serving processes holds up one panel rather than half the matrix (served prefill steps
       ran 1.2-1.3x the engine alone's per prompt token on 2 cores, 1.16x after), each thread
       claiming its next before it starts one, so that one's lines are asked for meanwhile. A
       few rows stream their weights: a contiguous share each, with stealing (deal.h). */
#pragma omp parallel num_threads(num_threads)
    if (M > STREAM_ROWS) {
        FOR_DEALT_AHEAD(t, after, panels, claimed)
            panel_rows(xs, ws + t * panel_size, bs, ys, M, N, K, t * PANEL,
                       after < panels ? ws + after * panel_size : NULL);
    } else {
        FOR_STOLEN(t, &stolen,
                   panel_rows(xs, ws + t * panel_size, bs, ys, M, N, K, t * PANEL, NULL))
    }
    return 0;
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return 1;
#endif
}

/* ---- float32 compute over bf16 weights ----------------------------------------------------------
   y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) in float32, the weight kept as bf16 (half the bytes
   of float32: decode steps stream every weight once, so they take about half the time) and
   widened in registers (a 16-bit shift). For CPUs without bf16 dot products (AVX2, AVX-512 F, NEON,
   the portable build), where a bf16 checkpoint computes in float32. The values are the
   checkpoint's: a weight is packed this way only when it is exactly bf16.

   Written once with GCC vector extensions: each ISA build gets its own vector width (VBYTES), so
   its own panel (two vectors of output columns) and row tile (accumulators that fit its
   registers: 16 on AVX2 and SSE, 32 on AVX-512 and NEON). The packed weight is
   [ceil(N/PANEL_MIXED)][K][PANEL_MIXED] bf16, zero-padded past N, each k's columns interleaved
   (`widen`); `linear_mixed_panel` tells Python the panel. Rows go in blocks that stay in L2
   while the panels (split across threads) pass over them. */

int linear_mixed_panel(void) { return PANEL_MIXED; }

/* One k's PANEL_MIXED bf16 at p as two float32 vectors. The panel stores each k's columns
   interleaved, (0, LANES), (1, LANES + 1), ...: one vector load, and in each 32-bit lane the low
   half shifted up is column j's float32 and the high half masked column LANES + j's. Two
   instructions besides the load, on any vector width; zero-extending each half (vpmovzxwd + a
   shift per vector) was four, and on AVX2 the shuffles and shifts take ports from the FMAs. */
KERNEL_INLINE void widen(const uint16_t *p, vf *w0, vf *w1) {
    vu v;
    memcpy(&v, p, sizeof v);
    *w0 = (vf)(v << 16);
    *w1 = (vf)(v & 0xffff0000u);
}

FLOAT_TILE(mixed_tile, uint16_t, widen)
PANEL_ROWS(mixed_panel_rows, mixed_tile, uint16_t)

/* The MT rows (1 or 2) of x against G adjacent panels at once, from panel `first`. One
   panel gives a row two accumulators, two chains of FMAs that cannot cover the FMA's latency (4
   cycles, 2 a cycle: 8 chains), so a lone row ran at the chains' pace rather than memory's: G
   panels give 2 MT G. Each column's sum runs over k in mixed_tile's order, so a row's bits are
   the same alone as in a batch. */
KERNEL_INLINE void mixed_group(const float *x, const uint16_t *w, const float *bias, float *y,
                               int64_t N, int64_t K, int64_t first, int MT, int G) {
    const int64_t panel_size = K * PANEL_MIXED;
    const uint16_t *panel = w + first * panel_size;
    vf acc[4][2][2];
    for (int j = 0; j < G; j++)
        for (int i = 0; i < MT; i++) acc[j][i][0] = acc[j][i][1] = (vf){0};
    const float *xr[8];
    for (int i = 0; i < MT; i++) xr[i] = x + i * K;
    for (int64_t k = 0; k < K; k++)
        for (int j = 0; j < G; j++) {
            vf w0, w1;
            widen(panel + j * panel_size + k * PANEL_MIXED, &w0, &w1);
            add_rows(acc[j], xr, k, w0, w1, MT);
        }
    for (int j = 0; j < G; j++)
        store_rows(acc[j], bias, y, N, 0, (first + j) * PANEL_MIXED, MT);
}

/* the rows of a call of at most GROUP_ROWS rows over G = GROUP(M) panels at a time from `first`
   (fewer at the matrix's end), G and M constants at each call so the 8 accumulators stay in
   registers. Three rows have 6 chains on one panel already: two panels at once measured no
   faster there (Zen 3, avx2: 0.99x), one and two rows 1.12-1.34x and 1.18-1.26x. */
#define GROUP_ROWS 2
#define GROUP(M) ((M) == 1 ? 4 : 2)
static void mixed_groups(const float *x, const uint16_t *w, const float *bias, float *y,
                         int64_t M, int64_t N, int64_t K, int64_t first, int64_t panels) {
    const int64_t g = panels - first < GROUP(M) ? panels - first : GROUP(M);
#define MIXED_GROUP(MT, G) mixed_group(x, w, bias, y, N, K, first, MT, G)
    switch (M * 8 + g) {
        case 8 + 4: MIXED_GROUP(1, 4); break;
        case 8 + 3: MIXED_GROUP(1, 3); break;
        case 8 + 2: MIXED_GROUP(1, 2); break;
        case 8 + 1: MIXED_GROUP(1, 1); break;
        case 16 + 2: MIXED_GROUP(2, 2); break;
        case 16 + 1: MIXED_GROUP(2, 1); break;
        default: break;
    }
#undef MIXED_GROUP
}

/* x [M, K] float32, packed w (above), bias [N] float32 or NULL, y [M, N] float32. */
int linear_mixed(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
                 int64_t K, int num_threads) {
    const float *xs = x, *bs = bias;
    const uint16_t *ws = w;
    float *ys = y;
    const int64_t panels = (N + PANEL_MIXED - 1) / PANEL_MIXED, panel_size = K * PANEL_MIXED;
    const int64_t lines = (panel_size * (int64_t)sizeof *ws + 63) / 64;
    int64_t claimed = 0;
    Stolen stolen;
    const int64_t groups = (panels + GROUP(M) - 1) / GROUP(M);
    stolen_init(&stolen, M <= GROUP_ROWS ? groups : panels, num_threads);
#pragma omp parallel num_threads(num_threads)
    if (M <= GROUP_ROWS) {
        /* one or two streams' decode: each thread its share of the panel groups */
        FOR_STOLEN(t, &stolen, mixed_groups(xs, ws, bs, ys, M, N, K, t * GROUP(M), panels));
    } else if (M > STREAM_ROWS && M <= ROW_BLOCK) {
        /* decode batches: a panel at a time, the tiles asking for the thread's next panel
           meanwhile (its first tile otherwise waits on memory). Zen 4 under the avx2 build,
           `bench linear --dtype float32`: 32 rows 68% -> 85-87% of the FMA peak, 16 rows
           52-53% -> 78-79% */
        FOR_DEALT_AHEAD(t, after, panels, claimed)
            mixed_panel_rows(xs, ws + t * panel_size, bs, ys, 0, M, N, K, t * PANEL_MIXED,
                             after < panels ? ws + after * panel_size : NULL, lines);
    } else {
        /* a few rows (streamed), or prefill's row blocks: there a thread's static share
           goes panel after panel, and the next is asked for meanwhile (the same bench: 64 rows
           78% -> 82-90%, 128 85% -> 90-92%, 512 unchanged) */
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
            FOR_PANELS(t, panels, M, &stolen,
                       mixed_panel_rows(xs, ws + t * panel_size, bs, ys, m0, m1, N, K,
                                        t * PANEL_MIXED,
                                        t + 1 < panels ? ws + (t + 1) * panel_size : NULL,
                                        M > ROW_BLOCK ? lines : 0))
        }
    }
    return 0;
}

/* The build's float32 FMA peak, for `bench linear`: each thread runs 12 independent chains of
   vector FMAs (enough to cover the FMA latency on every target) in registers, `iterations`
   times; returns the floating-point operations done. */
double fma_peak(int64_t iterations, int num_threads) {
    double total = 0.0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        vf acc[12];
        const vf scale = (vf){0} + 0.999999f, step = (vf){0} + 1e-7f;
        for (int i = 0; i < 12; i++) acc[i] = (vf){0} + (float)i;
        for (int64_t it = 0; it < iterations; it++)
            for (int i = 0; i < 12; i++) acc[i] = acc[i] * scale + step;
        float sink = 0.0f;
        for (int i = 0; i < 12; i++)
            for (int l = 0; l < LANES; l++) sink += acc[i][l];
        /* the sum is used, so the chains are computed; it adds nothing measurable */
        total += 2.0 * LANES * 12 * (double)iterations + (sink == 12345.0f ? 1.0 : 0.0);
    }
    return total;
}

/* The same for bf16 compute: the ceiling of `linear_bf16` and of `llama_layers_bf16`'s
   projections in this build. With AMX, the tile product (each instruction: 16 x 16 outputs of
   16 pair products and sums): four accumulator tiles in turn over two tiles of operands (zeros),
   in registers. Else AVX512-BF16's dot product (each instruction: 16 lanes x 2 products and
   sums). 0 where the build has neither. */
double bf16_peak(int64_t iterations, int num_threads) {
    double total = 0.0;
#if HAVE_AMX
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        amx_configure(16, 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t it = 0; it < iterations; it++) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        float sink[16 * 16] __attribute__((aligned(64)));
        _tile_stored(0, sink, 64);
        _tile_release();
        total += 4.0 * 16 * 16 * 32 * 2 * (double)iterations + (sink[0] == 12345.0f ? 1.0 : 0.0);
    }
#elif HAVE_DPBF16
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        __m512 acc[12];
        const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
        for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps((float)i);
        for (int64_t it = 0; it < iterations; it++)
            for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        float sink = 0.0f;
        for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(acc[i]);
        total += 4.0 * 16 * 12 * (double)iterations + (sink == 12345.0f ? 1.0 : 0.0);
    }
#else
    (void)iterations;
    (void)num_threads;
#endif
    return total;
}
