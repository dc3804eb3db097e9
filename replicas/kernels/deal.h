/* How work is dealt to the threads of a parallel region, so that a thread preempted by the
   serving processes beside the engine holds up little of it.

   FOR_DEALT_AHEAD: items one at a time, each thread claiming its next item before it does the
   one it has (OpenMP's dynamic schedule, by hand), so that the item in hand can ask for the next
   one's memory meanwhile: linear_bf16's panels beyond a few rows (at decode batches the last
   chunk of a panel asks for the next panel's first; in prefill every tile a share of it),
   linear_mixed's at decode batches, decode attention's (row, kv head) tasks (a task's value
   sums ask for the next task's blocks). Whichever thread is free takes the next item, so a thread
   preempted by the serving processes holds up one item, not a share.

   FOR_STOLEN: a share of contiguous items per thread, and work stealing (below). */
#pragma once
#include <omp.h>
#include <stdint.h>

/* Inside a parallel region: for each item t < N, with `after` the same thread's next one (N or
   more when there is none). CLAIMED: an int64_t the team shares, 0 before the region. */
#define FOR_DEALT_AHEAD(t, after, N, CLAIMED)                                               \
    for (int64_t t = __atomic_fetch_add(&(CLAIMED), 1, __ATOMIC_RELAXED), after = 0;      \
         t < (N) && ((after = __atomic_fetch_add(&(CLAIMED), 1, __ATOMIC_RELAXED)), 1);   \
         t = after)

/* Work stealing over a matrix's panels, for calls that stream their weights (a few rows): each
   thread owns one contiguous range (a static share: one stretch the prefetchers follow, no
   restart between runs) and takes its panels from the front; a thread whose range is empty takes
   the back half of the fullest other range, and so on down to single panels. So the team ends
   within about a panel of each other, and a thread preempted by the serving processes holds up
   only the panel in its hands: the others take the rest of its range. One row through
   bench-135m's 120 projections, 2 threads, Zen 5 (a one-off driver, median step, the read of the
   same bytes 2.7-4.6 ms): 3.45 -> 3.14 ms where the box read 75-85 GB/s and 4.83 -> 4.64 where
   it read 45-50, against OpenMP's dynamic schedule over 8 runs; beside a process that spins
   50 us every ~0.5 ms or 300 us every ~3 ms (the engine at niceness 5): 3-8% less. */
#define STOLEN_MAX 64
typedef struct {
    uint64_t range[STOLEN_MAX]; /* thread i's next panel | its end << 32 */
    int ranges;
} Stolen;

/* Before the parallel region: `threads` equal ranges of `panels` (a team that turns out smaller
   steals the ranges nobody owns). */
static inline void stolen_init(Stolen *s, int64_t panels, int threads) {
    s->ranges = threads < 1 ? 1 : threads > STOLEN_MAX ? STOLEN_MAX : threads;
    for (int i = 0; i < s->ranges; i++)
        s->range[i] = (uint64_t)(i * panels / s->ranges) |
                      (uint64_t)((i + 1) * panels / s->ranges) << 32;
}

/* The next panel of range i, or -1 where it is empty. */
static inline int64_t stolen_next(Stolen *s, int i) {
    uint64_t v = __atomic_load_n(&s->range[i], __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t n = (uint32_t)v, e = (uint32_t)(v >> 32);
        if (n >= e) return -1;
        if (__atomic_compare_exchange_n(&s->range[i], &v, (uint64_t)(n + 1) | (uint64_t)e << 32,
                                        0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return n;
    }
}

/* Moves the back half of the fullest range other than i (empty) into i; 0 where all are empty. */
static inline int stolen_take(Stolen *s, int i) {
    for (;;) {
        int best = -1;
        uint64_t v = 0;
        uint32_t most = 0;
        for (int k = 1; k < s->ranges; k++) {
            const int j = (i + k) % s->ranges;
            const uint64_t w = __atomic_load_n(&s->range[j], __ATOMIC_RELAXED);
            const uint32_t n = (uint32_t)w, e = (uint32_t)(w >> 32);
            if (e > n && e - n > most) most = e - n, best = j, v = w;
        }
        if (best < 0) return 0;
        const uint32_t n = (uint32_t)v, e = (uint32_t)(v >> 32), mid = e - (most + 1) / 2;
        if (__atomic_compare_exchange_n(&s->range[best], &v, (uint64_t)n | (uint64_t)mid << 32, 0,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            __atomic_store_n(&s->range[i], (uint64_t)mid | (uint64_t)e << 32, __ATOMIC_RELAXED);
            return 1;
        }
    }
}

/* Inside the parallel region: BODY for each panel t, as the ranges of S deal them. A thread
   beyond the ranges (a team larger than STOLEN_MAX) takes none: the others take them all. */
#define FOR_STOLEN(t, S, BODY)                                                                \
    {                                                                                         \
        const int me_ = omp_get_thread_num() < (S)->ranges ? omp_get_thread_num() : -1;       \
        for (;;) {                                                                            \
            int64_t t;                                                                        \
            while (me_ >= 0 && (t = stolen_next((S), me_)) >= 0) BODY;                        \
            if (me_ < 0 || !stolen_take((S), me_)) break;                                     \
        }                                                                                     \
    }
