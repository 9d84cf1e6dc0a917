"""A chain of block ranges that together cover the whole model, as the client sees it.

`ChainBackend.open_session(max_length)` returns a `ChainSession` whose `step` takes the embedded
new tokens of one sequence [n, hidden] and returns the last block's output [n, hidden]. The local
backend runs block ranges in this process (used by `petals-chain generate --local` and tests); the
remote backend (`petals_chain.client.remote`) relays through servers over hivemind.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from petals_chain.runtime.block_range import BlockRange, StepInput


class ChainSession(ABC):
    """One generation session open on a whole chain."""

    position: int = 0  # tokens already processed by every block

    @abstractmethod
    def step(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def close(self) -> None: ...

    def describe(self) -> str:
        return type(self).__name__


class ChainBackend(ABC):
    @abstractmethod
    def open_session(self, max_length: int) -> ChainSession: ...

    def shutdown(self) -> None:
        """Release whatever the backend holds (network peers, threads)."""


class LocalChainSession(ChainSession):
    def __init__(self, ranges: list[BlockRange], max_length: int):
        self.ranges = ranges
        self.kvs = [r.allocate_kv(max_length) for r in ranges]
        self.position = 0

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        for block_range, kv in zip(self.ranges, self.kvs):
            hidden = block_range.forward([StepInput(kv, hidden)])[0]
        self.position += hidden.shape[0]
        return hidden

    def close(self) -> None:
        self.kvs = []

    def describe(self) -> str:
        return " -> ".join(f"local[{r.start}:{r.end})" for r in self.ranges)


class LocalChain(ChainBackend):
    """Block ranges in this process, chained in order (they must tile [0, L))."""

    def __init__(self, ranges: list[BlockRange]):
        expected = 0
        for r in ranges:
            if r.start != expected:
                raise ValueError(f"block ranges must tile the model in order; got [{r.start}, {r.end}) after block {expected}")
            expected = r.end
        self.ranges = ranges

    def open_session(self, max_length: int) -> ChainSession:
        return LocalChainSession(self.ranges, max_length)
