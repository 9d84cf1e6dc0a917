"""EMULATION, off by default: `launch-server --emulate-slowdown K` makes this server a slower device.

Every forward of the block range (each scheduler batch) runs for real, then sleeps (K - 1) times
its measured compute time: the batch takes K times as long, the CPU does the same work. The server
announces K times the t_I, t_O of the real device (the same cached measurement a server without
emulation uses, so fast and slow servers differ by exactly K however busy the machine was when it
was taken). Used by the Table 1 experiment to give "slow" servers the paper's slow/fast GPU ratio
on one CPU; never on unless asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from petals_chain.runtime.block_range import BlockRange, StepInput
from server.profiling import BlockTimes


class SlowedBlockRange:
    """Wraps a `BlockRange`: `forward` takes `factor` x its compute time; everything else is the range's."""

    def __init__(
        self,
        inner: BlockRange,
        factor: float,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not factor >= 1.0:
            raise ValueError(f"--emulate-slowdown must be >= 1 (a slower device), got {factor}")
        self.inner = inner
        self.factor = factor
        self.clock = clock
        self.sleep = sleep

    def forward(self, steps: list[StepInput]):
        t0 = self.clock()
        out = self.inner.forward(steps)
        self.sleep((self.factor - 1.0) * (self.clock() - t0))
        return out

    def __getattr__(self, name: str):  # start, end, dtype, allocate_kv, validate_step, ... of the real range
        return getattr(self.inner, name)


def maybe_slowed(block_range: BlockRange, factor: float):
    return block_range if factor == 1.0 else SlowedBlockRange(block_range, factor)


def real_range(block_range) -> BlockRange:
    """The real range under any wrapper (this emulation, server/corruption.py's test mode): what profiling
    measures. Every wrapper keeps the range it wraps as `inner`."""
    while (inner := getattr(block_range, "inner", None)) is not None:
        block_range = inner
    return block_range


def slowed_times(times: BlockTimes, factor: float) -> BlockTimes:
    """t_I, t_O of the emulated device: K times the real one's (the definition of the emulation)."""
    return BlockTimes(times.prefill_s_per_token * factor, times.decode_s_per_token * factor)
