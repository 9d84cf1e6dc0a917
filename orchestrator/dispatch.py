"""The one dispatch core: online dispatch policies over static chains (§3.2, §4.1.2), behind one
event-driven interface that the simulator (orchestrator.sim.engine) and the live service
(orchestrator.service.sessions) both drive.

- ``jffc``: Join-the-Fastest-Free-Chain (Alg. 3): a central queue; an arrival takes a slot on
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

What the live service needs beyond the paper, as optional arguments that leave the paper's
decisions unchanged when unused (the simulator never passes them):
- ``allowed``: the chain indices a job may use (a failing-over session excludes a server; a
  session asks for a longer max_length than some chains accept). JFFC then serves its central
  queue in order among the jobs a freed chain can take.
- ``order``: JFFC's central queue order; None is FIFO (the paper); the service's fair queue passes
  a key over its per-client counters.
- ``cancel``: a waiting job leaves (its client timed out or vanished).
- ``disable``: chains lost a server; they take no job again; their running jobs are forgotten.

Dispatchers read no clock; the caller (simulator or online service) feeds events in time order.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from orchestrator.model import ChainSpec


@dataclass(frozen=True)
class Start:
    job_id: int
    chain_id: int  # index into the dispatcher's chain list (static chains), or a route id for per-request routers
    service_time_s: float  # mean service time T_k of the chain the job runs on (a job of size r takes r * service_time_s)


QueueOrder = Callable[[list[int]], list[int]]  # waiting job ids (arrival order) -> service order


class Dispatcher(ABC):
    """One instance per run (simulator) or per installed plan (service); event driven; no clock read."""

    name: str

    @abstractmethod
    def on_arrival(self, job_id: int, allowed: frozenset[int] | None = None) -> list[Start]:
        """A job arrives: return the jobs that start now (possibly this one); the rest wait.
        ``allowed``: the chains it may use (None: all)."""

    @abstractmethod
    def on_completion(self, job_id: int) -> list[Start]:
        """A running job finished: free its resources and return the jobs that start now."""

    @abstractmethod
    def cancel(self, job_id: int) -> None:
        """A waiting job leaves without starting. Unknown ids are ignored."""

    def disable(self, chain_ids: Iterable[int]) -> list[Start]:
        """Chains lost a server: they never take a job again, their running jobs are forgotten (no
        on_completion follows), and jobs waiting for them are dispatched again. Returns the starts."""
        raise NotImplementedError(f"{self.name} routes per request: install a new router over the surviving servers")

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
    """Alg. 3 (JFFC) with a central queue; O(log K) per event without ``allowed`` sets."""

    name = "jffc"

    def __init__(self, chains: Sequence[ChainSpec], order: QueueOrder | None = None):
        _check_chains(chains)
        self._chains = list(chains)
        self._busy = [0] * len(chains)  # Z_k
        self._free_heap = [(k.service_time_s, i) for i, k in enumerate(chains)]
        heapq.heapify(self._free_heap)
        self._queue: OrderedDict[int, frozenset[int] | None] = OrderedDict()  # job -> allowed, arrival order
        self._job_chain: dict[int, int] = {}
        self._disabled: set[int] = set()
        self._order = order

    def _start(self, job_id: int, k: int) -> Start:
        self._job_chain[job_id] = k
        return Start(job_id, k, self._chains[k].service_time_s)

    def _take(self, k: int) -> None:
        self._busy[k] += 1
        if self._busy[k] == self._chains[k].capacity:
            self._free_heap.remove((self._chains[k].service_time_s, k))
            heapq.heapify(self._free_heap)

    def _fastest_free(self, allowed: frozenset[int] | None) -> int | None:
        if not self._free_heap:
            return None
        if allowed is None:
            return self._free_heap[0][1]  # line 2: fastest chain with Z_k < c_k
        ok = [e for e in self._free_heap if e[1] in allowed]
        return min(ok)[1] if ok else None

    def on_arrival(self, job_id: int, allowed: frozenset[int] | None = None) -> list[Start]:
        # Why the queue need not be consulted: after every event no waiting job can use a free chain,
        # so a free chain the newcomer may use is one no earlier job wanted.
        k = self._fastest_free(allowed)
        if k is None:  # line 5-6
            self._queue[job_id] = allowed
            return []
        if allowed is None:  # k is the heap's top: O(log K)
            self._busy[k] += 1
            if self._busy[k] == self._chains[k].capacity:
                heapq.heappop(self._free_heap)
        else:
            self._take(k)
        return [self._start(job_id, k)]

    def on_completion(self, job_id: int) -> list[Start]:
        k = self._job_chain.pop(job_id)
        if k in self._disabled:
            return []
        # line 7-8: the first waiting job (in queue order) that may use chain k takes the freed slot
        if self._queue:
            if self._order is None:  # FIFO: no copy of the queue per event (the simulator's hot path)
                w = next((j for j, allowed in self._queue.items() if allowed is None or k in allowed), None)
            else:
                w = next((j for j in self._order(list(self._queue))
                          if self._queue[j] is None or k in self._queue[j]), None)
            if w is not None:
                del self._queue[w]
                return [self._start(w, k)]
        self._busy[k] -= 1
        if self._busy[k] == self._chains[k].capacity - 1:
            heapq.heappush(self._free_heap, (self._chains[k].service_time_s, k))
        return []

    def cancel(self, job_id: int) -> None:
        self._queue.pop(job_id, None)

    def disable(self, chain_ids: Iterable[int]) -> list[Start]:
        gone = set(chain_ids) - self._disabled
        self._disabled |= gone
        self._free_heap = [e for e in self._free_heap if e[1] not in gone]
        heapq.heapify(self._free_heap)
        for job in [j for j, k in self._job_chain.items() if k in gone]:
            del self._job_chain[job]
        return []  # no slot freed on a live chain: nobody waiting can start

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
        self._job_allowed: dict[int, frozenset[int] | None] = {}
        self._live = np.ones(len(chains), dtype=bool)
        self._rng = rng if rng is not None else np.random.default_rng(0)

    @abstractmethod
    def _choose(self, candidates: np.ndarray) -> int:
        """The chain for a new job among ``candidates`` (indices, ascending)."""

    def _random_among(self, candidates: np.ndarray) -> int:
        return int(candidates[0] if len(candidates) == 1 else self._rng.choice(candidates))

    def _candidates(self, allowed: frozenset[int] | None) -> np.ndarray:
        mask = self._live.copy()
        if allowed is not None:
            keep = np.zeros(len(self._chains), dtype=bool)
            keep[[k for k in allowed if 0 <= k < len(self._chains)]] = True
            mask &= keep
        return np.flatnonzero(mask)

    def on_arrival(self, job_id: int, allowed: frozenset[int] | None = None) -> list[Start]:
        cand = self._candidates(allowed)
        if not len(cand):
            raise ValueError(f"{self.name}: job {job_id} may use no live chain; check fits before dispatching")
        k = self._choose(cand)
        self._job_chain[job_id] = k
        self._job_allowed[job_id] = allowed
        self._n[k] += 1
        if self._n[k] <= self._cap[k]:
            return [Start(job_id, k, self._chains[k].service_time_s)]
        self._queues[k].append(job_id)
        self._queued += 1
        return []

    def on_completion(self, job_id: int) -> list[Start]:
        k = self._job_chain.pop(job_id)
        self._job_allowed.pop(job_id, None)
        self._n[k] -= 1
        if self._queues[k]:
            self._queued -= 1
            nxt = self._queues[k].popleft()
            return [Start(nxt, k, self._chains[k].service_time_s)]
        return []

    def cancel(self, job_id: int) -> None:
        k = self._job_chain.get(job_id)
        if k is None or job_id not in self._queues[k]:
            return
        self._queues[k].remove(job_id)
        self._queued -= 1
        self._n[k] -= 1
        del self._job_chain[job_id]
        self._job_allowed.pop(job_id, None)

    def disable(self, chain_ids: Iterable[int]) -> list[Start]:
        gone = [k for k in set(chain_ids) if self._live[k]]
        redo: list[int] = []
        for k in gone:
            self._live[k] = False
            redo.extend(self._queues[k])
            self._queued -= len(self._queues[k])
            self._queues[k].clear()
            self._n[k] = 0
            for job in [j for j, c in self._job_chain.items() if c == k]:
                del self._job_chain[job]
        starts: list[Start] = []
        for job in redo:  # waiting jobs of a lost chain choose again, in their arrival order
            allowed = self._job_allowed.pop(job, None)
            if len(self._candidates(allowed)):
                starts.extend(self.on_arrival(job, allowed))
        return starts

    @property
    def queue_length(self) -> int:
        return self._queued


class JsqDispatcher(_DedicatedQueueDispatcher):
    name = "jsq"

    def _choose(self, cand: np.ndarray) -> int:
        load = self._n[cand] / self._cap[cand]
        return self._random_among(cand[load == load.min()])


class JiqDispatcher(_DedicatedQueueDispatcher):
    name = "jiq"

    def _choose(self, cand: np.ndarray) -> int:
        idle = cand[self._n[cand] < self._cap[cand]]
        if len(idle):
            return self._random_among(idle)
        if len(cand) == len(self._chains):  # the paper's draw, unchanged when every chain may be used
            return int(self._rng.integers(len(self._chains)))
        return int(self._rng.choice(cand))


class SedDispatcher(_DedicatedQueueDispatcher):
    name = "sed"

    def _choose(self, cand: np.ndarray) -> int:
        n, cap, mu = self._n[cand], self._cap[cand], self._mu[cand]
        delay = np.maximum(0, n + 1 - cap) / (cap * mu) + 1.0 / mu
        best = np.flatnonzero(delay == delay.min())
        return int(cand[best[np.argmax(mu[best])]])


class SaJsqDispatcher(_DedicatedQueueDispatcher):
    name = "sa-jsq"

    def _choose(self, cand: np.ndarray) -> int:
        load = self._n[cand] / self._cap[cand]
        best = np.flatnonzero(load == load.min())
        return int(cand[best[np.argmax(self._mu[cand][best])]])


DISPATCHERS = {"jffc": JffcDispatcher, "jsq": JsqDispatcher, "jiq": JiqDispatcher,
               "sed": SedDispatcher, "sa-jsq": SaJsqDispatcher}


def make_dispatcher(name: str, chains: Sequence[ChainSpec], rng: np.random.Generator | None = None,
                    order: QueueOrder | None = None) -> Dispatcher:
    """Factory: ``name`` in {"jffc", "jsq", "jiq", "sed", "sa-jsq"}. ``order`` (JFFC's central queue
    order) is refused for the per-chain-queue policies, whose queues are FIFO by definition."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatch policy {name!r}; choose one of {sorted(DISPATCHERS)}")
    if name == "jffc":
        return JffcDispatcher(chains, order)
    if order is not None:
        raise ValueError(f"dispatch policy {name!r} keeps a FIFO queue per chain; a queue order "
                         "(e.g. --queue fair) needs --dispatch jffc")
    return DISPATCHERS[name](chains, rng)
