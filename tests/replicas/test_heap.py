"""freeze_startup_heap: what exists is frozen, what comes after is still collected."""

import gc

from replicas.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: object = self


def test_the_startup_heap_is_frozen_and_later_cycles_are_still_collected() -> None:
    kept = [_Node() for _ in range(1000)]  # alive at "startup"
    try:
        frozen = freeze_startup_heap()
        # (a frozen object another thread of the test session frees meanwhile leaves the
        # permanent generation: the count may only have dropped since)
        assert frozen >= gc.get_freeze_count() >= len(kept)
        collectable = {id(o) for o in gc.get_objects()}  # the frozen are out of its reach
        assert not any(id(n) in collectable for n in kept)
        for _ in range(100):  # garbage made after startup: cycles only the collector frees
            _Node()
        assert gc.collect() >= 100
    finally:
        gc.unfreeze()
