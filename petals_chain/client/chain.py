"""A chain of block ranges that together cover the whole model, as the client sees it.

`ChainBackend.open_session(max_length)` returns a `ChainSession` whose `step` takes the embedded
new tokens of one sequence [n, hidden] and returns the last block's output [n, hidden]. The local
backend runs block ranges in this process (used by `petals-chain generate --local` and tests); the
remote backend (`petals_chain.client.remote`) relays through servers over hivemind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from petals_chain.errors import InvalidRequestError
from petals_chain.runtime.block_range import BlockRange, StepInput


@dataclass(frozen=True)
class PromptPrefix:
    """The prompt a session opens with, so a chain can reuse its hops' cached prefix KV: token ids
    (hashed into prefix keys, `petals_chain/wire/prefix_keys.py`) and their embeddings (the input a hop
    replacing a failed one needs to rebuild the skipped prefix)."""

    token_ids: list[int]
    hidden: torch.Tensor  # [len(token_ids), hidden]


class ChainSession(ABC):
    """One generation session open on a whole chain."""

    # tokens already processed by every block; after an open that reused a cached prompt prefix
    # it starts at that prefix's length, so the first step carries only the rest of the prompt
    position: int = 0
    failovers: int = 0  # hops replaced after a server failed
    # checks of the servers' replies (client/verification.py:SessionVerifier): None for local chains
    verifier = None

    @property
    def num_hops(self) -> int:
        """Servers (or local block ranges) the session's chain runs through."""
        return 1

    @abstractmethod
    def step(self, hidden: torch.Tensor, start_position: int | None = None) -> torch.Tensor:
        """Run `hidden` [n, hidden] at positions `[start, start + n)` and return the last block's output.
        `start_position` (default: `position`) may be below `position`: the chain rolls back to it first
        (KV rollback: every hop overwrites its cache from there), e.g. to drop rejected draft tokens."""

    def check_start(self, start_position: int | None) -> int:
        """The step's start position, validated: at most what the chain holds."""
        if start_position is None:
            return self.position
        if not 0 <= start_position <= self.position:
            raise InvalidRequestError(
                f"a step may start at a position in [0, {self.position}] (what the chain holds), got {start_position}"
            )
        return start_position

    @abstractmethod
    def close(self) -> None: ...

    def describe(self) -> str:
        return type(self).__name__


class ChainBackend(ABC):
    @abstractmethod
    def open_session(
        self,
        max_length: int,
        prefix: PromptPrefix | None = None,
        adapter: str | None = None,
        *,
        session_id: str | None = None,
    ) -> ChainSession:
        """`prefix`: the prompt, offered for prefix reuse (backends without a cache ignore it);
        `adapter`: the LoRA adapter every hop runs this session with (None: the base model).
        `session_id`: the id the chain's orchestrator and servers know (and log) the session by
        (an API request's id in it ties their logs to the request); default a fresh random one."""

    def unready_reason(self) -> str | None:
        """Why a session could not be served now (e.g. no full chain of servers), or None when it
        could: a readiness probe (`petals-chain api`'s /ready). Blocking; may ask the network."""
        return None

    def shutdown(self) -> None:
        """Release whatever the backend holds (network peers, threads)."""


class LocalChainSession(ChainSession):
    def __init__(self, ranges: list[BlockRange], max_length: int, adapter: str | None = None):
        self.ranges = ranges
        self.kvs = [r.allocate_kv(max_length, adapter=adapter) for r in ranges]
        self.position = 0

    @property
    def num_hops(self) -> int:
        return len(self.ranges)

    def step(self, hidden: torch.Tensor, start_position: int | None = None) -> torch.Tensor:
        start = self.check_start(start_position)
        for kv in self.kvs:
            kv.past_tokens = start  # the static caches are overwritten from there
        self.position = start
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
                raise InvalidRequestError(
                    f"block ranges must tile the model in order; got [{r.start}, {r.end}) after block {expected}"
                )
            expected = r.end
        self.ranges = ranges

    def open_session(
        self,
        max_length: int,
        prefix: PromptPrefix | None = None,
        adapter: str | None = None,
        *,
        session_id: str | None = None,
    ) -> ChainSession:
        return LocalChainSession(self.ranges, max_length, adapter)
