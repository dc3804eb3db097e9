/* Work dealt to the threads of a parallel region one item at a time, each thread claiming its
   next item before it does the one it has (OpenMP's dynamic schedule, by hand), so that the item
   in hand can ask for the next one's memory meanwhile: linear_bf16's panels at decode batches
   (the last chunk of a panel asks for the next panel's first), decode attention's (row, kv head)
   tasks (a task's value sums ask for the next task's blocks). Whichever thread is free takes the
   next item, so a thread preempted by the serving processes holds up one item, not a share. */
#pragma once
#include <stdint.h>

/* Inside a parallel region: for each item t < N, with `after` the same thread's next one (N or
   more when there is none). CLAIMED: an int64_t the team shares, 0 before the region. */
#define FOR_DEALT_AHEAD(t, after, N, CLAIMED)                                               \
    for (int64_t t = __atomic_fetch_add(&(CLAIMED), 1, __ATOMIC_RELAXED), after = 0;      \
         t < (N) && ((after = __atomic_fetch_add(&(CLAIMED), 1, __ATOMIC_RELAXED)), 1);   \
         t = after)
