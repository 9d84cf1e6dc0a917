"""A serving process's start-up heap and Python's cyclic garbage collector.

After start-up a server holds hundreds of thousands of long-lived objects (torch, transformers and
hivemind's modules, the model): 401k tracked objects in a SmolLM2 server. A full collection walks
them all (~0.2 s on this machine) and runs whenever the objects surviving younger collections
reach a quarter of that heap, which a server serving for minutes does (service records, sessions,
log lines): a decode step that meets one stalls by that much. Freezing the heap after start-up (as
vLLM's engine and CPython's docs for pre-fork servers do) moves it to the permanent generation, so
full collections walk only what came after: the same collector, without the start-up heap.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(what: str) -> int:
    """Collect, then freeze every object alive now (`gc.freeze`); returns how many are frozen.
    Call it again after replacing a large part of the heap (a server's stack after a move): what an
    earlier call froze is unfrozen and collected first, so a replaced stack's cycles are not kept."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d objects of the start-up heap frozen (out of the collector's way) in %.0f ms",
        what,
        frozen,
        (time.perf_counter() - t0) * 1e3,
    )
    return frozen
