"""The server's serving stack: blocks, KV budget, scheduler, admission queue and prefix cache,
built together by one factory (`build_stack`) and swapped as one value (by the server's lifecycle,
`server/lifecycle.py`).

Why one value: the collaborators hold references to one another (admission reserves from the
budget and asks the scheduler's policy; the prefix cache is the budget's reclaimer; the scheduler
reports who waits for memory). Built apart and replaced attribute by attribute, a handler running
during a reload could see the new budget with the old scheduler. Here a handler reads the stack
once (`ServerLifecycle.current`) and keeps it; a session's reservation (`server/reservation.py`)
releases into the stack it was acquired from, even after a swap.

The sessions a stack holds are in its `SessionTable` (one owner: what `info()` counts and what a
reload checks before it moves the server).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from petals_chain.runtime.block_range import BlockRange
from petals_chain.runtime.kv_cache import SessionKV
from petals_chain.wire.prefix_keys import PREFIX_CHUNK_TOKENS
from server.admission import AdmissionQueue
from server.config import ServerConfig
from server.corruption import maybe_corrupted
from server.emulation import maybe_slowed
from server.memory import KVBudget
from server.policies import make_policy
from server.prefix_cache import PrefixCache
from server.scheduler import StepScheduler


class HeldSession(Protocol):
    """What the table reads of an entry (a `server/reservation.py:SessionReservation`, which
    imports this module: the table names only what it uses)."""

    key: str
    kv: SessionKV | None


class SessionTable:
    """The open sessions of one stack, by reservation key (thread-safe: the announcer reads it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_key: dict[str, HeldSession] = {}

    def add(self, reservation: HeldSession) -> None:
        with self._lock:
            self._by_key[reservation.key] = reservation

    def remove(self, key: str) -> None:
        with self._lock:
            self._by_key.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def allocated_bytes(self) -> int:
        """KV bytes the sessions' tensors take, measured independently of the budget's reservations."""
        with self._lock:
            return sum(r.kv.nbytes for r in self._by_key.values() if r.kv is not None)


@dataclass(frozen=True)
class ServingStack:
    block_range: BlockRange
    budget: KVBudget
    scheduler: StepScheduler
    admission: AdmissionQueue
    prefix_cache: PrefixCache | None
    sessions: SessionTable = field(default_factory=SessionTable)

    def stop(self) -> None:
        self.scheduler.stop()


def build_stack(
    config: ServerConfig, path, start: int, end: int, on_batch: Callable[[dict], None] | None = None
) -> ServingStack:
    """The one place the serving collaborators are made and wired to each other."""
    c = config
    block_range = maybe_slowed(
        BlockRange(
            path,
            start,
            end,
            dtype=c.dtype,
            quant=c.quant,
            device=c.device,
            model_path=path,
            cuda_graphs=c.cuda_graphs,
            adapters=c.adapters,
        ),
        c.emulate_slowdown,
    )
    # TEST ONLY (--test-corrupt, off by default): wrong outputs for the client's verification to catch
    block_range = maybe_corrupted(block_range, c.test_corrupt, c.test_corrupt_seed)
    budget = KVBudget(
        c.memory_budget_bytes,
        block_range.block_bytes * (end - start),
        cache_floor_bytes=c.prefix_cache_min_bytes if c.prefix_sharing != "off" else 0,
    )
    admission: AdmissionQueue | None = None  # made below; the scheduler's log asks it who waits for memory
    scheduler = StepScheduler(
        block_range,
        make_policy(c.policy, c.policy_args),
        max_batch_tokens=c.max_batch_tokens,
        gather_fraction=c.batch_gather,
        on_batch=on_batch,
        prefill_tokens_while_decoding=c.prefill_tokens_while_decoding,
        waiting_for_memory=lambda: admission.waiting_clients() if admission is not None else [],
    )
    try:  # the scheduler's thread runs already: a stack that is not made must not leave it behind
        admission = AdmissionQueue(budget, scheduler, max_waiting=c.admission_queue, timeout_s=c.admission_timeout_s)
        prefix_cache = (
            None
            if c.prefix_sharing == "off"
            else PrefixCache(budget, PREFIX_CHUNK_TOKENS, sharing=c.prefix_sharing, max_bytes=c.prefix_cache_max_bytes)
        )
        return ServingStack(block_range, budget, scheduler, admission, prefix_cache)
    except BaseException:
        scheduler.stop()
        raise
