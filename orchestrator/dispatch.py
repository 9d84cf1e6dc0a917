"""Online dispatch policies over static chains (§3.2, §4.1.2), behind one event-driven interface.

- ``jffc``: Join-the-Fastest-Free-Chain (Alg. 3): a central FIFO queue; an arrival takes a slot on
  the fastest chain with Z_k < c_k (a heap keyed by (T_k, k): O(log K)); a completion hands its
  slot to the queue head (line 7-8) or frees it.
- ``jsq``, ``jiq``, ``sed``, ``sa-jsq``: classical policies with a dedicated FIFO queue per chain,
  extended to chains that run c_k jobs at once (a chain is c_k parallel job servers of rate mu_k;
  N_k = jobs running + queued on chain k):
  - JSQ: the chain with the least N_k / c_k (jobs per slot); ties at random.
  - JIQ: a random chain with an idle slot (Z_k < c_k); if none, a random chain.
  - SED: the chain with the smallest expected delay of the new job,
    max(0, N_k + 1 - c_k) / (c_k mu_k) + 1 / mu_k; ties to the faster chain.
  - SA-JSQ (speed-aware JSQ, [5]): among the chains with the least N_k / c_k, the fastest.
  The random choices use the injected ``numpy.random.Generator``; with None a generator seeded
  with 0 is made, so runs stay reproducible.

Dispatchers read no clock; the caller (simulator or online service) feeds events in time order.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from orchestrator.model import ChainSpec


@dataclass(frozen=True)
class Start:
    job_id: int
    chain_id: int  # index into the dispatcher's chain list (static chains), or a route id for per-request routers
    service_time_s: float  # mean service time T_k of the chain the job runs on (a job of size r takes r * service_time_s)


class Dispatcher(ABC):
    """One instance per run; event driven; no clock read."""

    name: str

    @abstractmethod
    def on_arrival(self, job_id: int) -> list[Start]:
        """A job arrives: return the jobs that start now (possibly this one); the rest wait."""

    @abstractmethod
    def on_completion(self, job_id: int) -> list[Start]:
        """A running job finished: free its resources and return the jobs that start now."""

    @property
    @abstractmethod
    def queue_length(self) -> int:
        """Jobs waiting (arrived, not started)."""


def _check_chains(chains: Sequence[ChainSpec]) -> None:
    if not chains:
        raise ValueError("a dispatcher needs at least one chain")
    for i, k in enumerate(chains):
        if k.capacity < 1 or not k.service_time_s > 0:
            raise ValueError(f"chain {i} needs capacity >= 1 and service_time_s > 0, got {k.capacity}, {k.service_time_s}")


class JffcDispatcher(Dispatcher):
    """Alg. 3 (JFFC) with a central FIFO queue; O(log K) per event."""

    name = "jffc"

    def __init__(self, chains: Sequence[ChainSpec]):
        _check_chains(chains)
        self._chains = list(chains)
        self._busy = [0] * len(chains)  # Z_k
        self._free_heap = [(k.service_time_s, i) for i, k in enumerate(chains)]
        heapq.heapify(self._free_heap)
        self._queue: deque[int] = deque()
        self._job_chain: dict[int, int] = {}

    def _start(self, job_id: int, k: int) -> Start:
        self._job_chain[job_id] = k
        return Start(job_id, k, self._chains[k].service_time_s)

    def on_arrival(self, job_id: int) -> list[Start]:
        if not self._free_heap:  # line 5-6
            self._queue.append(job_id)
            return []
        _, k = self._free_heap[0]  # line 2: fastest chain with Z_k < c_k
        self._busy[k] += 1
        if self._busy[k] == self._chains[k].capacity:
            heapq.heappop(self._free_heap)
        return [self._start(job_id, k)]

    def on_completion(self, job_id: int) -> list[Start]:
        k = self._job_chain.pop(job_id)
        if self._queue:  # line 7-8: the queue head takes the freed slot on chain k
            return [self._start(self._queue.popleft(), k)]
        self._busy[k] -= 1
        if self._busy[k] == self._chains[k].capacity - 1:
            heapq.heappush(self._free_heap, (self._chains[k].service_time_s, k))
        return []

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> tuple[int, ...]:
        """Z_k per chain (for tests and monitoring)."""
        return tuple(self._busy)


class _DedicatedQueueDispatcher(Dispatcher):
    """Shared bookkeeping of the per-chain-queue policies."""

    def __init__(self, chains: Sequence[ChainSpec], rng: np.random.Generator | None):
        _check_chains(chains)
        self._chains = list(chains)
        self._cap = np.array([k.capacity for k in chains], dtype=np.int64)
        self._mu = np.array([1.0 / k.service_time_s for k in chains])
        self._n = np.zeros(len(chains), dtype=np.int64)  # N_k: running + queued
        self._queues: list[deque[int]] = [deque() for _ in chains]
        self._queued = 0
        self._job_chain: dict[int, int] = {}
        self._rng = rng if rng is not None else np.random.default_rng(0)

    @abstractmethod
    def _choose(self) -> int: ...

    def _random_among(self, candidates: np.ndarray) -> int:
        return int(candidates[0] if len(candidates) == 1 else self._rng.choice(candidates))

    def on_arrival(self, job_id: int) -> list[Start]:
        k = self._choose()
        self._job_chain[job_id] = k
        self._n[k] += 1
        if self._n[k] <= self._cap[k]:
            return [Start(job_id, k, self._chains[k].service_time_s)]
        self._queues[k].append(job_id)
        self._queued += 1
        return []

    def on_completion(self, job_id: int) -> list[Start]:
        k = self._job_chain.pop(job_id)
        self._n[k] -= 1
        if self._queues[k]:
            self._queued -= 1
            nxt = self._queues[k].popleft()
            return [Start(nxt, k, self._chains[k].service_time_s)]
        return []

    @property
    def queue_length(self) -> int:
        return self._queued


class JsqDispatcher(_DedicatedQueueDispatcher):
    name = "jsq"

    def _choose(self) -> int:
        load = self._n / self._cap
        return self._random_among(np.flatnonzero(load == load.min()))


class JiqDispatcher(_DedicatedQueueDispatcher):
    name = "jiq"

    def _choose(self) -> int:
        idle = np.flatnonzero(self._n < self._cap)
        if len(idle):
            return self._random_among(idle)
        return int(self._rng.integers(len(self._chains)))


class SedDispatcher(_DedicatedQueueDispatcher):
    name = "sed"

    def _choose(self) -> int:
        wait = np.maximum(0, self._n + 1 - self._cap) / (self._cap * self._mu)
        delay = wait + 1.0 / self._mu
        best = np.flatnonzero(delay == delay.min())
        return int(best[np.argmax(self._mu[best])])


class SaJsqDispatcher(_DedicatedQueueDispatcher):
    name = "sa-jsq"

    def _choose(self) -> int:
        load = self._n / self._cap
        best = np.flatnonzero(load == load.min())
        return int(best[np.argmax(self._mu[best])])


DISPATCHERS = {"jffc": JffcDispatcher, "jsq": JsqDispatcher, "jiq": JiqDispatcher,
               "sed": SedDispatcher, "sa-jsq": SaJsqDispatcher}


def make_dispatcher(name: str, chains: Sequence[ChainSpec], rng: np.random.Generator | None = None) -> Dispatcher:
    """Factory: ``name`` in {"jffc", "jsq", "jiq", "sed", "sa-jsq"}."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatch policy {name!r}; choose one of {sorted(DISPATCHERS)}")
    if name == "jffc":
        return JffcDispatcher(chains)
    return DISPATCHERS[name](chains, rng)
