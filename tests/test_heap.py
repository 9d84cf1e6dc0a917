"""freeze_startup_heap: the collector stops walking the start-up heap, and a replaced heap's cycles
are still collected at the next freeze (a server's stack after a move)."""

from __future__ import annotations

import gc
import weakref

from petals_chain.process.heap import freeze_startup_heap


class Node:
    other: "Node"


def garbage_cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_frozen_heap_is_out_of_the_collectors_way_until_the_next_freeze():
    try:
        dropped = garbage_cycle()  # garbage before the freeze: collected by it
        held = Node()
        held.other = held
        held_ref = weakref.ref(held)
        frozen = freeze_startup_heap("test")
        assert frozen == gc.get_freeze_count() > 0
        assert dropped() is None
        del held
        gc.collect()
        assert held_ref() is not None  # frozen while alive: a full collection does not walk it
        later = garbage_cycle()  # made after the freeze: collected as usual
        gc.collect()
        assert later() is None
        freeze_startup_heap("test, after a move")  # unfreezes and collects what the last freeze held
        assert held_ref() is None
    finally:
        gc.unfreeze()
