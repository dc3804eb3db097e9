/* The float32 vector types of this build's ISA level (GCC vector extensions: the same source gets
   each level's width), the panel and row tile the float32 linears share, and their tail-tile
   switch. Included by linear.c (bf16 weights widened in registers) and quant_linear.c
   (block-quantized weights unpacked in registers). */
#pragma once
#include <stdint.h>
#include <string.h>

#include "deal.h"
#include "dtype.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
/* VREGS: the vector registers of the level (MIXED_ROWS, the row tile, follows from them) */
#if defined(__AVX512F__)
#define VBYTES 64
#define VREGS 32
#elif defined(__AVX__)
#define VBYTES 32
#define VREGS 16
#elif defined(__aarch64__)
#include <arm_neon.h>
#define VBYTES 16
#define VREGS 32
#else
#define VBYTES 16
#define VREGS 16
#endif
#define MIXED_ROWS (VREGS == 32 ? 8 : 6)
#define LANES (VBYTES / 4)
#define PANEL_MIXED (2 * LANES) /* output columns per panel: two vectors */
#define ROW_BLOCK 48 /* rows of x per block: 48 x 1536 floats is 288 KiB */

/* Inside a parallel region, BODY for each panel t < PANELS, split across the team. Calls of a few
   rows stream their weights from memory: each thread streams its own contiguous share, a stretch
   the prefetchers follow (panels dealt one at a time made single-stream decode steps 15-60%
   slower), and a thread that runs out takes the back half of the fullest share left (STOLEN, a
   `Stolen` set up before the region: deal.h), so a thread preempted by the serving processes
   holds up one panel rather than a static half of the matrix that the whole team waits for at
   the region's end. (OpenMP's dynamic schedule over 8 runs a matrix did that too, but each run
   was a new stream: 4-9% slower.) Decode batches are compute-bound: their panels go one at a
   time. With several row blocks (prefill) each thread keeps the same panels from block to block,
   in its own L2. STOLEN is used only for calls of up to STREAM_ROWS rows, one row block. */
#define STREAM_ROWS 8
enum { DEAL_STOLEN, DEAL_ONE, DEAL_STATIC };
#define DEAL_PANELS(t, PANELS, MODE, STOLEN, BODY)                                            \
    if ((MODE) == DEAL_STOLEN) {                                                              \
        FOR_STOLEN(t, STOLEN, BODY)                                                           \
    } else if ((MODE) == DEAL_ONE) {                                                          \
        _Pragma("omp for schedule(dynamic, 1) nowait")                                       \
        for (int64_t t = 0; t < (PANELS); t++) BODY;                                          \
    } else {                                                                                  \
        _Pragma("omp for schedule(static) nowait")                                           \
        for (int64_t t = 0; t < (PANELS); t++) BODY;                                          \
    }
#define FOR_PANELS(t, PANELS, M, STOLEN, BODY)                                                  \
    DEAL_PANELS(t, PANELS,                                                                      \
                (M) <= STREAM_ROWS ? DEAL_STOLEN : (M) <= ROW_BLOCK ? DEAL_ONE : DEAL_STATIC,   \
                STOLEN, BODY)
/* A tile's share of the next panel's (or chunk's) cache lines, asked of memory a line every
   few steps of its pass rather than all at once: misses asked for in a burst queue behind each
   other and stall the core (linear.c's panel_rows). */
typedef struct {
    const char *at;
    int64_t lines, due;
} Ahead;

/* rows r .. r+MT of a call's R rows: their share of `lines` lines from `next` (none if NULL) */
KERNEL_INLINE Ahead ahead_share(const void *next, int64_t lines, int64_t r, int64_t MT,
                                int64_t R) {
    const int64_t first = r * lines / R;
    const Ahead a = {next ? (const char *)next + first * 64 : NULL,
                     next ? (r + MT) * lines / R - first : 0, 0};
    return a;
}

/* one step of a pass of `steps`: the lines that fall due */
KERNEL_INLINE void ahead_step(Ahead *a, int64_t steps) {
    for (a->due += a->lines; a->due >= steps; a->due -= steps, a->at += 64)
        __builtin_prefetch(a->at, 0, 3);
}

typedef float vf __attribute__((vector_size(VBYTES)));
typedef uint32_t vu __attribute__((vector_size(VBYTES)));
typedef int32_t vi __attribute__((vector_size(VBYTES)));
typedef uint8_t vb __attribute__((vector_size(VBYTES / 4)));
typedef int8_t vsb __attribute__((vector_size(VBYTES / 4)));

/* TILE(..., MT) for the 1..7 rows left after the whole tiles, MT a constant at each call so the
   tile's accumulators stay in registers */
#define TAIL_TILES(TILE, LEFT, ...)            \
    switch (LEFT) {                            \
        case 7: TILE(__VA_ARGS__, 7); break;   \
        case 6: TILE(__VA_ARGS__, 6); break;   \
        case 5: TILE(__VA_ARGS__, 5); break;   \
        case 4: TILE(__VA_ARGS__, 4); break;   \
        case 3: TILE(__VA_ARGS__, 3); break;   \
        case 2: TILE(__VA_ARGS__, 2); break;   \
        case 1: TILE(__VA_ARGS__, 1); break;   \
        default: break;                        \
    }

/* a tile's accumulators (+ bias) into rows m0 .. m0+MT of y, columns n0 .. n0+PANEL_MIXED (those
   below N) */
KERNEL_INLINE void store_rows(vf acc[8][2], const float *bias, float *y, int64_t N, int64_t m0,
                              int64_t n0, int MT) {
    for (int h = 0; h < 2; h++) {
        const int64_t c0 = n0 + LANES * h;
        if (c0 >= N) break;
        vf b = (vf){0};
        if (bias) {
            if (N - c0 >= LANES) memcpy(&b, bias + c0, sizeof b);
            else for (int64_t c = c0; c < N; c++) b[c - c0] = bias[c];
        }
        for (int i = 0; i < MT; i++) {
            const vf v = acc[i][h] + b;
            float *row = y + (m0 + i) * N + c0;
            if (N - c0 >= LANES) memcpy(row, &v, sizeof v);
            else for (int64_t c = c0; c < N; c++) row[c - c0] = v[c - c0];
        }
    }
}

/* acc = rows m0 .. m0+MT of y, columns n0 .. n0+PANEL_MIXED (those below N): partial sums a
   tile goes on from */
KERNEL_INLINE void load_rows(vf acc[8][2], const float *y, int64_t N, int64_t m0, int64_t n0,
                             int MT) {
    for (int h = 0; h < 2; h++) {
        const int64_t c0 = n0 + LANES * h;
        if (c0 >= N) break;
        for (int i = 0; i < MT; i++) {
            const float *row = y + (m0 + i) * N + c0;
            if (N - c0 >= LANES) memcpy(&acc[i][h], row, sizeof(vf));
            else for (int64_t c = c0; c < N; c++) acc[i][h][c - c0] = row[c - c0];
        }
    }
}

/* acc[m] += x[m][k] * (w0, w1) for the tile's MT rows */
KERNEL_INLINE void add_rows(vf acc[8][2], const float *const xr[8], int64_t k, vf w0, vf w1,
                            int MT) {
    for (int m = 0; m < MT; m++) {
        acc[m][0] += xr[m][k] * w0;
        acc[m][1] += xr[m][k] * w1;
    }
}

/* NAME(x, panel, bias, y, m0, m1, N, K, n0, next, lines): rows m0 .. m1 of x against one panel
   of W, in tiles of MIXED_ROWS and a tail, the tiles asking for `lines` cache lines from `next`
   (the thread's next panel, or NULL) meanwhile, each its rows' share. A tail of 1-3 rows (2-6
   accumulators) cannot cover the FMA's latency (4 cycles, 2 a cycle: 8 chains), so beyond one
   tile it goes with the last whole tile as two tiles of about half each: 32 rows on AVX2 are 6,
   6, 6, 6, 4, 4 rather than 6 x 5 + 2. */
#define PANEL_ROWS(NAME, TILE, W)                                                        \
    static void NAME(const float *x, const W *panel, const float *bias, float *y,           \
                     int64_t m0, int64_t m1, int64_t N, int64_t K, int64_t n0,              \
                     const void *next, int64_t lines) {                                     \
        const int64_t left = (m1 - m0) % MIXED_ROWS;                                         \
        const int64_t split = left > 0 && left < 4 && m1 - m0 > MIXED_ROWS;                 \
        const int64_t whole_end = m1 - left - split * MIXED_ROWS;                            \
        int64_t m = m0;                                                                      \
        for (; m < whole_end; m += MIXED_ROWS)                                               \
            TILE(x, panel, bias, y, N, K, m, n0,                                             \
                 ahead_share(next, lines, m - m0, MIXED_ROWS, m1 - m0), MIXED_ROWS);         \
        if (split) {                                                                         \
            const int64_t half = (m1 - m + 1) / 2;                                           \
            TAIL_TILES(TILE, half, x, panel, bias, y, N, K, m, n0,                           \
                       ahead_share(next, lines, m - m0, half, m1 - m0))                      \
            m += half;                                                                       \
        }                                                                                    \
        TAIL_TILES(TILE, m1 - m, x, panel, bias, y, N, K, m, n0,                             \
                   ahead_share(next, lines, m - m0, m1 - m, m1 - m0))                        \
    }

/* NAME(x, panel, bias, y, N, K, m0, n0, ahead, MT): rows m0 .. m0+MT of x times one panel of W,
   whose k-th run of PANEL_MIXED weights LOAD2 turns into float32 (LOAD2(p, &w0, &w1): columns 0
   .. LANES in w0, the rest in w1), into y, asking for `ahead`'s lines over the pass. MT is a
   constant at each call (PANEL_ROWS), so the 2 MT accumulators stay in registers. */
#define FLOAT_TILE(NAME, W, LOAD2)                                                            \
    KERNEL_INLINE void NAME(const float *x, const W *panel, const float *bias, float *y,     \
                            int64_t N, int64_t K, int64_t m0, int64_t n0, Ahead ahead,       \
                            int MT) {                                                         \
        vf acc[8][2]; /* room for any tail (TAIL_TILES); only MT of them are used */          \
        for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = (vf){0};                        \
        const float *xr[8];                                                                   \
        for (int i = 0; i < MT; i++) xr[i] = x + (m0 + i) * K;                               \
        for (int64_t k = 0; k < K; k++) {                                                     \
            ahead_step(&ahead, K);                                                            \
            vf w0, w1;                                                                        \
            LOAD2(panel + k * PANEL_MIXED, &w0, &w1);                                         \
            add_rows(acc, xr, k, w0, w1, MT);                                                 \
        }                                                                                     \
        store_rows(acc, bias, y, N, m0, n0, MT);                                              \
    }
