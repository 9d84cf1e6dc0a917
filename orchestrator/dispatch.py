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

import dataclasses
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from orchestrator.model import ChainSpec
from orchestrator.prefix_index import HopKey, PrefixIndex


@dataclass(frozen=True)
class Start:
    job_id: int
    chain_id: int  # index into the dispatcher's chain list (static chains), or a route id for per-request routers
    service_time_s: float  # mean service time T_k of the job's chain (a job of size r takes r * service_time_s)


QueueOrder = Callable[[list[int]], list[int]]  # waiting job ids (arrival order) -> service order


@dataclass(frozen=True)
class DispatchRequest:
    """What a session tells the dispatcher about its prompt (the live service: from `Acquire`).

    ``prefix_hashes``: the prompt's chained chunk hashes (petals_chain.wire.prefix_keys), or any
    hashable chunk names in the simulator; ``prompt_tokens``: the prompt's length; ``output_tokens``:
    the expected output length (E2's decode load, D2LPM's w_q charge; 0: unknown)."""

    client_id: str = ""
    prefix_hashes: tuple = ()
    prompt_tokens: int = 0
    output_tokens: int = 0


class Dispatcher(ABC):
    """One instance per run (simulator) or per installed plan (service); event driven; no clock read."""

    name: str

    @abstractmethod
    def on_arrival(
        self, job_id: int, allowed: frozenset[int] | None = None, request: DispatchRequest | None = None
    ) -> list[Start]:
        """A job arrives: return the jobs that start now (possibly this one); the rest wait.
        ``allowed``: the chains it may use (None: all). ``request``: what the prompt-aware policies
        (e2, d2lpm, rr-lpm, vtc-rr, below) read; the others ignore it."""

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
            raise ValueError(
                f"chain {i} needs capacity >= 1 and service_time_s > 0, got {k.capacity}, {k.service_time_s}"
            )


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

    def on_arrival(
        self, job_id: int, allowed: frozenset[int] | None = None, request: DispatchRequest | None = None
    ) -> list[Start]:
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
                w = next(
                    (j for j in self._order(list(self._queue)) if self._queue[j] is None or k in self._queue[j]), None
                )
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

    def on_arrival(
        self, job_id: int, allowed: frozenset[int] | None = None, request: DispatchRequest | None = None
    ) -> list[Start]:
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


# -- prompt-aware policies over chains (issue: prefix-aware, fair dispatch) ----------------------
# All four keep JFFC's contract: a central queue, a job starts only on a chain with Z_k < c_k that it
# may use, a finishing job hands its slot to a waiting job that may use that chain. They differ in
# which free chain a newcomer takes and which waiting job takes a freed slot.


@dataclass(frozen=True)
class ServerCost:
    """A server's calibrated per-block, per-token times (the paper's t_I and t_O; Preble's PrefillTime and
    DecodeTime regressions, here linear through 0)."""

    t_in_s: float
    t_out_s: float


@dataclass(frozen=True)
class PrefixParams:
    """Knobs of the prompt-aware policies (defaults: the papers' where they give one).

    - ``window``: E2's history H, as a count of the most recent grants (dispatchers read no clock;
      Preble's H is 3 minutes of requests).
    - ``th_bal``: E2's rebalancing threshold Th_bal (heaviest / lightest server load).
    - ``quantum_client``: DLPM's Q^u (the central queue's per-client deficit quantum), in charge units.
    - ``quantum_chain``: D2LPM's Q^w (per-client, per-chain quantum of SelectWorker).
    - ``w_in``, ``w_out``: the charge w_e * tokens + w_q * output tokens (VTC's, DLPM's weights).
    - ``max_skips``: E2's bound on how often a waiting job may be passed over by longer matches
      (Preble's priority levels avoid starvation): past it, the job goes first at the next freed slot of
      a chain where its match is longest; None: plain LPM (rr-lpm).
    - ``fair_skips``: D2LPM's bound on the same starvation, counted fairly: a waiting job whose client
      holds credit (d_i > 0) and that other clients' grants passed over this many times goes first, by
      E2's rule; None: the DLPM paper's order (the longest match among the clients with credit).
    - ``lookahead``: a freed slot's longest-match search looks at the first `lookahead` candidates of
      the queue (arrival order), so an event costs O(lookahead) lookups however long the queue grows.
    - ``hold_completions``: E2's hold (not the paper's): a newcomer whose prefix only busy chains hold
      (full, or still computing it) waits for one of them for at most this many completions elsewhere;
      0: never (the paper's E2 explores a free chain at once).
    """

    window: int = 256
    th_bal: float = 2.0
    quantum_client: float = 4096.0
    quantum_chain: float = 16384.0
    w_in: float = 1.0
    w_out: float = 2.0
    max_skips: int | None = 16
    fair_skips: int | None = 32
    lookahead: int = 64
    hold_completions: int = 8


STARVING_CHECKED = 8  # starving jobs a freed slot examines (each a match on every chain)


class _PromptAwareDispatcher(Dispatcher):
    """Shared state of the prompt-aware policies: slots per chain, the central queue, the index."""

    uses_index = True

    def __init__(
        self,
        chains: Sequence[ChainSpec],
        *,
        index: PrefixIndex | None = None,
        hop_servers: Sequence[Sequence] | None = None,
        costs: dict | None = None,
        params: PrefixParams | None = None,
    ):
        _check_chains(chains)
        self._chains = list(chains)
        self.params = params or PrefixParams()
        self.index = index if index is not None else PrefixIndex()
        servers = hop_servers if hop_servers is not None else [k.servers for k in chains]
        if len(servers) != len(chains) or any(len(s) != len(k.blocks) for s, k in zip(servers, chains)):
            raise ValueError("hop_servers must name one server per hop of every chain")
        self._hops = [tuple(HopKey(s, b.start) for s, b in zip(ss, k.blocks)) for ss, k in zip(servers, chains)]
        self._blocks = [tuple(b.end - b.start for b in k.blocks) for k in chains]
        self._costs = costs or {}
        self._busy = [0] * len(chains)
        self._disabled: set[int] = set()
        self._queue: OrderedDict[int, tuple[frozenset[int] | None, DispatchRequest]] = OrderedDict()
        self._job_chain: dict[int, int] = {}
        self._job_request: dict[int, DispatchRequest] = {}
        self._skips: dict[int, int] = {}
        # held jobs (see _hold): job -> [the chains it may use, completions elsewhere it still waits for]
        self._held: dict[int, list] = {}
        self.hit_tokens = [0] * len(chains)  # tokens the index expected each chain to reuse
        self.prompt_tokens = [0] * len(chains)

    # -- what subclasses decide ------------------------------------------------------------
    @abstractmethod
    def _choose(self, req: DispatchRequest, free: list[int]) -> int:
        """The free chain a newcomer takes (free: ascending chain ids it may use, non-empty)."""

    @abstractmethod
    def _pick_waiting(self, k: int, waiting: list[int]) -> int:
        """The waiting job (ids in arrival order, all may use chain k) that takes chain k's freed slot."""

    def _granted(self, job_id: int, k: int, req: DispatchRequest, match_tokens: int) -> None:
        """Bookkeeping after a grant (load windows, counters)."""

    def _finished(self, job_id: int, k: int, req: DispatchRequest) -> None:
        """Bookkeeping after a completion."""

    def _hold(self, req: DispatchRequest, allowed: frozenset[int] | None, free: list[int]) -> frozenset[int] | None:
        """Busy chains a newcomer should wait for although `free` chains could take it now (None: start now)."""
        return None

    # -- shared mechanics ------------------------------------------------------------------
    def set_quanta(self, quantum_client: float, quantum_chain: float) -> None:
        """New quanta Q^u and Q^w from the next refill on (the live service keeps them at its expected
        session's charge, which it learns as sessions finish); the deficit counters keep their values."""
        if not (quantum_client > 0 and quantum_chain > 0):
            raise ValueError(f"quanta must be positive (got Q^u {quantum_client}, Q^w {quantum_chain})")
        self.params = dataclasses.replace(self.params, quantum_client=quantum_client, quantum_chain=quantum_chain)

    def match_tokens(self, k: int, req: DispatchRequest) -> int:
        """Tokens chain k can reuse for this prompt (every hop must hold them)."""
        return self.index.chain_match_tokens(self._hops[k], req.client_id, req.prefix_hashes, req.prompt_tokens)

    def _free(self, allowed: frozenset[int] | None) -> list[int]:
        return [
            k
            for k in range(len(self._chains))
            if self._busy[k] < self._chains[k].capacity
            and k not in self._disabled
            and (allowed is None or k in allowed)
        ]

    def _start(self, job_id: int, k: int, req: DispatchRequest) -> Start:
        match = self.match_tokens(k, req)
        self._busy[k] += 1
        self._job_chain[job_id] = k
        self._job_request[job_id] = req
        self.hit_tokens[k] += match
        self.prompt_tokens[k] += req.prompt_tokens
        self._granted(job_id, k, req, match)
        # learned at grant time (D2LPM Alg. 2 line 18): every hop stores the prompt's chunks once it ran them
        self.index.learn(self._hops[k], req.client_id, req.prefix_hashes)
        return Start(job_id, k, self._chains[k].service_time_s)

    def on_arrival(
        self, job_id: int, allowed: frozenset[int] | None = None, request: DispatchRequest | None = None
    ) -> list[Start]:
        req = request if request is not None else DispatchRequest()
        free = self._free(allowed)
        hold = self._hold(req, allowed, free) if free else None
        if not free or hold is not None:
            self._queue[job_id] = (allowed if hold is None else hold, req)
            self._skips[job_id] = 0
            if hold is not None:
                self._held[job_id] = [allowed, self.params.hold_completions]
            self._queued(job_id, req)
            return []
        return [self._start(job_id, self._choose(req, free), req)]

    def _count_holds(self, k: int) -> list[int]:
        """Chain k finished a job: held jobs that do not wait for k waited one completion more; those out of
        patience may use their own chains again (returned, to be started where a chain is free)."""
        out = []
        for j, rec in list(self._held.items()):
            if k in self._queue[j][0]:
                continue
            rec[1] -= 1
            if rec[1] <= 0:
                self._release_hold(j)
                out.append(j)
        return out

    def _release_hold(self, j: int) -> None:
        allowed, _ = self._held.pop(j)
        self._queue[j] = (allowed, self._queue[j][1])

    def _start_released(self, jobs: list[int]) -> list[Start]:
        starts = []
        for j in jobs:
            if j not in self._queue:
                continue
            allowed, req = self._queue[j]
            free = self._free(allowed)
            if free:
                del self._queue[j]
                self._skips.pop(j, None)
                self._left_queue(j, req)
                starts.append(self._start(j, self._choose(req, free), req))
        return starts

    def _queued(self, job_id: int, req: DispatchRequest) -> None:
        """A job starts waiting."""

    def on_completion(self, job_id: int) -> list[Start]:
        k = self._job_chain.pop(job_id)
        req = self._job_request.pop(job_id)
        self._finished(job_id, k, req)
        # the hops ran its prompt by now: what they did not report storing is dropped from here on
        self.index.settle(self._hops[k], req.client_id, req.prefix_hashes)
        released = self._count_holds(k)
        if k in self._disabled:
            return self._start_released(released)
        waiting = [j for j, (allowed, _) in self._queue.items() if allowed is None or k in allowed]
        self._busy[k] -= 1
        starts = []
        if waiting:
            w = self._pick_waiting(k, waiting)
            _, req = self._queue.pop(w)
            self._skips.pop(w, None)
            self._held.pop(w, None)
            self._left_queue(w, req)
            starts.append(self._start(w, k, req))
        return starts + self._start_released(released)

    def _left_queue(self, job_id: int, req: DispatchRequest) -> None:
        """A waiting job was granted (or cancelled)."""

    def _starving_here(self, k: int, starving: Iterable[int]) -> int | None:
        """The first of `starving` (oldest first) that chain k's freed slot serves well: k holds its longest
        match, or no chain holds enough of it to be worth waiting for (E2's exploit rule: matched > missed).
        Forcing the oldest onto whichever chain frees first made it prefill a prompt another chain holds
        and evict that chain's prefixes for it; waiting for one of its own chains costs it about one
        completion there (they run jobs, so one comes) and computes what waiting saves. Examines at most
        STARVING_CHECKED jobs (each a match on every chain; the oldest are served first anyway)."""
        live: list[int] | None = None
        for j in itertools.islice(starving, STARVING_CHECKED):
            if live is None:
                live = [c for c in range(len(self._chains)) if c not in self._disabled]
            allowed, req = self._queue[j]
            here = self.match_tokens(k, req)
            best = max(self.match_tokens(c, req) for c in live if allowed is None or c in allowed)
            if here >= best or best <= req.prompt_tokens - best:
                return j
        return None

    def _lpm(self, k: int, waiting: list[int]) -> int:
        """Longest prefix match on chain k among `waiting` (ties: arrival order), counting how often each
        job was passed over (E2's starvation bound reads the counts: E2Dispatcher._pick_waiting)."""
        best, best_m = waiting[0], -1
        for j in itertools.islice(waiting, self.params.lookahead):
            m = self.match_tokens(k, self._queue[j][1])
            if m > best_m:
                best, best_m = j, m
        for j in waiting:  # every job that arrived before the winner was passed over once more
            if j == best:
                break
            self._skips[j] = self._skips.get(j, 0) + 1
        return best

    def cancel(self, job_id: int) -> None:
        entry = self._queue.pop(job_id, None)
        if entry is not None:
            self._skips.pop(job_id, None)
            self._held.pop(job_id, None)
            self._left_queue(job_id, entry[1])

    def disable(self, chain_ids: Iterable[int]) -> list[Start]:
        gone = set(chain_ids) - self._disabled
        self._disabled |= gone
        for job in [j for j, k in self._job_chain.items() if k in gone]:
            k = self._job_chain.pop(job)
            req = self._job_request.pop(job)
            self.index.settle(self._hops[k], req.client_id, req.prefix_hashes)
        released = []  # held jobs whose every chain it waited for is gone may use their own chains again
        for j in [j for j in self._held if self._queue[j][0] <= self._disabled]:
            self._release_hold(j)
            released.append(j)
        return self._start_released(released)  # no slot freed on a live chain: only those may start

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> tuple[int, ...]:
        return tuple(self._busy)

    @property
    def held(self) -> dict[int, frozenset[int]]:
        """Waiting jobs held for busy chains (see _hold): job -> the chains it waits for."""
        return {j: self._queue[j][0] for j in self._held}

    def hit_rates(self) -> list[float]:
        """Per chain: reused / prompt tokens of its grants, as the index expected them."""
        return [h / p if p else 0.0 for h, p in zip(self.hit_tokens, self.prompt_tokens)]

    def _cost(self, server) -> ServerCost:
        return self._costs.get(server, _UNIT_COST)

    def _round_robin(self, free: list[int]) -> int:
        """The next free chain after the last one granted, cyclically."""
        n = len(self._chains)
        last = getattr(self, "_rr_last", -1)
        k = min(free, key=lambda c: (c - last - 1) % n)
        self._rr_last = k
        return k


_UNIT_COST = ServerCost(1.0, 1.0)


class E2Dispatcher(_PromptAwareDispatcher):
    """Preble's E2 (Algorithms 1-2, papers/preble-distributed-prompt-scheduling.txt) over chains.

    A chain's cached length is its usable prefix: the minimum over its hops (every hop must hold it).
    - exploit (cached > missed): among the free chains with the longest match, the least load cost;
    - explore: the free chain of least load cost, where
      cost_k = sum over hops s of [L_s + m_s t_I(s) missed_k]   (Alg. 2's L + P; the matched prefix free),
      L_s = sum over the last H grants through s of m_s (t_I(s) missed_r + t_O(s) avg_out_H).
    - rebalancing: while the heaviest server's L exceeds Th_bal x the lightest's, a request that would
      exploit a chain through the heaviest server explores instead ("direct future requests that are
      supposed to exploit the heavy GPU to the light GPU").
    - a freed slot goes to the waiting job with the longest match on that chain; a job passed over
      max_skips times goes first at the next slot of a chain where its match is longest (_pick_waiting).
    Not built: Alg. 2's eviction cost M (the orchestrator does not know the servers' eviction order),
    prefix autoscaling and prefill/decode balancing (Alg. 1's DecodeRatio).
    """

    name = "e2"

    def __init__(self, chains: Sequence[ChainSpec], **kw):
        super().__init__(chains, **kw)
        self._window: deque[tuple[tuple, float]] = deque()  # (((server, prefill_s, decode_units), ...), out)
        self._prefill_s: dict = {}  # server -> sum of m_s t_I missed_r over the window
        self._decode_units: dict = {}  # server -> sum of m_s t_O(s) over the window (times avg_out later)
        self._out_sum = 0.0
        self.rebalanced = 0  # requests sent to explore by the rebalancing rule
        self.holds = 0  # newcomers held for busy chains that hold their prefix (_hold)

    def _load(self, server) -> float:
        avg_out = self._out_sum / len(self._window) if self._window else 0.0
        return self._prefill_s.get(server, 0.0) + self._decode_units.get(server, 0.0) * avg_out

    def _chain_cost(self, k: int, missed: int) -> float:
        return sum(
            self._load(h.server) + m * self._cost(h.server).t_in_s * missed
            for h, m in zip(self._hops[k], self._blocks[k])
        )

    def _best_by_cost(self, cands: list[int], req: DispatchRequest, match: dict[int, int]) -> int:
        return min(
            cands, key=lambda k: (self._chain_cost(k, req.prompt_tokens - match[k]), self._chains[k].dispatch_time_s, k)
        )

    def _imbalanced_heaviest(self):
        servers = {h.server for k in range(len(self._chains)) if k not in self._disabled for h in self._hops[k]}
        if len(servers) < 2 or not self._window:
            return None
        loads = {s: self._load(s) for s in servers}
        heavy = max(loads, key=loads.get)
        return heavy if loads[heavy] > self.params.th_bal * min(loads.values()) else None

    def _choose(self, req: DispatchRequest, free: list[int]) -> int:
        match = {k: self.match_tokens(k, req) for k in free}
        cached = max(match.values())
        missed = req.prompt_tokens - cached
        if cached > 0 and missed < cached:  # exploit
            best = [k for k in free if match[k] == cached]
            heavy = self._imbalanced_heaviest()
            if heavy is None or any(heavy not in {h.server for h in self._hops[k]} for k in best):
                best = [k for k in best if heavy is None or heavy not in {h.server for h in self._hops[k]}]
                return self._best_by_cost(best, req, match)
            self.rebalanced += 1
        return self._best_by_cost(free, req, match)

    def _hold(self, req: DispatchRequest, allowed: frozenset[int] | None, free: list[int]) -> frozenset[int] | None:
        """Not the paper's (Preble queues per GPU, without capacities): with GCA's capacities a newcomer whose
        prefix only busy chains hold would explore a free chain, prefill it all there and evict what that
        chain's servers hold for others; or, when its prefix is still being computed by a session on a free
        chain, prefill it a second time alongside. It waits for those chains instead, when what waiting saves
        exceeds what it computes anyway (E2's exploit rule: reused > missed), only for chains where a slot
        is expected sooner than the prefill it saves would take (T_k / c_k < its t_I cost: a chain of long
        sessions is not waited for), and for at most ``hold_completions`` completions elsewhere (then any
        free chain; a completion always comes: the chains it waits for run a job). Rebalancing wins: a
        prefix whose holders all go through the heaviest server is explored as Alg. 1 says."""
        if self.params.hold_completions <= 0:
            return None
        live = [k for k in range(len(self._chains)) if k not in self._disabled and (allowed is None or k in allowed)]
        match = {k: self.match_tokens(k, req) for k in live}
        best = max(match.values())
        if best <= 0 or best <= req.prompt_tokens - best:
            return None
        stored_free = max(
            self.index.chain_match_tokens(
                self._hops[k], req.client_id, req.prefix_hashes, req.prompt_tokens, stored=True
            )
            for k in free
        )
        if best - stored_free <= req.prompt_tokens - best:
            return None  # a free chain holds enough of it now
        holders = frozenset(
            k
            for k in live
            if match[k] == best
            and self._busy[k] > 0
            and self._expected_wait_s(k) < self._prefill_cost_s(k, best - stored_free)
        )
        if not holders:
            return None
        heavy = self._imbalanced_heaviest()
        if heavy is not None and all(heavy in {h.server for h in self._hops[k]} for k in holders):
            return None
        self.holds += 1
        return holders

    def _expected_wait_s(self, k: int) -> float:
        """Until chain k frees a slot, about: its mean session time over its slots (a running session is
        on average halfway, and any of c_k may finish first; for a session still computing the prefix
        the same bound holds)."""
        return self._chains[k].service_time_s / self._chains[k].capacity

    def _prefill_cost_s(self, k: int, tokens: int) -> float:
        """What prefilling `tokens` costs on chain k (Alg. 2's P: m_s t_I per hop)."""
        return sum(m * self._cost(h.server).t_in_s * tokens for h, m in zip(self._hops[k], self._blocks[k]))

    def _pick_waiting(self, k: int, waiting: list[int]) -> int:
        """LPM on chain k, where a job passed over `max_skips` times (starving) goes first, but only to a
        slot where it is best served (`_starving_here`)."""
        bound = self.params.max_skips
        if bound is None:
            return self._lpm(k, waiting)
        starving = (j for j in itertools.islice(waiting, self.params.lookahead) if self._skips.get(j, 0) >= bound)
        j = self._starving_here(k, starving)
        return j if j is not None else self._lpm(k, waiting)

    def _granted(self, job_id: int, k: int, req: DispatchRequest, match_tokens: int) -> None:
        missed = max(0, req.prompt_tokens - match_tokens)
        parts = tuple(
            (h.server, m * self._cost(h.server).t_in_s * missed, m * self._cost(h.server).t_out_s)
            for h, m in zip(self._hops[k], self._blocks[k])
        )
        self._window.append((parts, float(req.output_tokens)))
        self._add(parts, float(req.output_tokens), +1)
        while len(self._window) > self.params.window:
            old, out = self._window.popleft()
            self._add(old, out, -1)

    def _add(self, parts: tuple, out: float, sign: int) -> None:
        for s, prefill, decode in parts:
            self._prefill_s[s] = self._prefill_s.get(s, 0.0) + sign * prefill
            self._decode_units[s] = self._decode_units.get(s, 0.0) + sign * decode
        self._out_sum += sign * out


class D2lpmDispatcher(_PromptAwareDispatcher):
    """D2LPM (Algorithm 2, §5 of papers/dlpm-locality-aware-fair-scheduling.txt) over chains, with the
    central queue served by DLPM (Algorithm 1).

    Arrival on free chains (SelectWorker): G = the free chains with the longest match; G_avail = the free
    chains with q_{i,k} > 0, replenished by Q^w on every chain until non-empty; the least-occupied chain of
    G ∩ G_avail, else of G_avail; then q_{i,k} -= w_e input_tokens (line 16) and, at completion,
    w_q output_tokens (line 22; the expected output length, the dispatcher sees no decode step).

    A freed slot of chain k (DLPM at the central queue): the waiting jobs in order of their match on k,
    the first whose client has deficit d_i > 0; when no waiting client has d_i > 0, every known client
    whose d_i <= 0 gets Q^u (CheckRefill, Alg. 1 lines 3-7: the known clients, not only the waiting
    ones). A grant, through the queue or on a free chain, charges d_i w_e * (prompt - match) + w_q *
    output (the extend tokens: reuse is cheap for whoever gets it). So a client that is idle through a
    round keeps its credit (at most Q^u, since only d_i <= 0 is refilled) and pays off its debt: a light
    client's request that arrives while a flooder's backlog is being served is eligible at once, rather
    than waiting for the flooder to spend its whole quantum (which, at a hit's small extend charge, is
    dozens of grants). This is what gives the bound W_g - W_f <= 2 (U + Q^u) |W| over any window in which
    f stays backlogged (tests/test_prefix_dispatch.py checks it). Not the paper's: among the clients with
    credit, a job that other clients' grants passed over `fair_skips` times goes first (by E2's rule,
    `_starving_here`); only the order among eligible jobs changes, so the bound holds as before. At most
    `MAX_CLIENTS` clients are known; past it the longest-known idle one is forgotten (it comes back as
    new, at 0, Alg. 1 line 12).
    """

    MAX_CLIENTS = 65_536

    name = "d2lpm"

    def __init__(self, chains: Sequence[ChainSpec], **kw):
        super().__init__(chains, **kw)
        self.chain_deficit: dict[tuple[str, int], float] = {}  # q_{i,k}
        self.client_deficit: dict[str, float] = {}  # d_i of the central queue's DLPM, every known client
        self._waiting_of: dict[str, int] = {}
        self._passed: dict[int, int] = {}  # waiting job -> other clients' grants that passed it over (fair_skips)
        self.service: dict[str, float] = {}  # what each client was charged at its grants (for tests, /status)

    def charge(self, req: DispatchRequest, match_tokens: int) -> float:
        p = self.params
        return p.w_in * max(0, req.prompt_tokens - match_tokens) + p.w_out * req.output_tokens

    def _choose(self, req: DispatchRequest, free: list[int]) -> int:
        i = req.client_id
        match = {k: self.match_tokens(k, req) for k in free}
        best = max(match.values())
        group = {k for k in free if best > 0 and match[k] == best}
        q = self.chain_deficit
        avail = [k for k in free if q.get((i, k), 0.0) > 0]
        if not avail:  # lines 5-6, in one step: the fewest rounds of Q^w that make some free chain positive
            rounds = min(int(-q.get((i, k), 0.0) // self.params.quantum_chain) + 1 for k in free)
            for k in range(len(self._chains)):
                q[(i, k)] = q.get((i, k), 0.0) + rounds * self.params.quantum_chain
            avail = [k for k in free if q[(i, k)] > 0]
        cand = [k for k in avail if k in group] or avail
        return min(cand, key=lambda k: (self._busy[k] / self._chains[k].capacity, self._chains[k].dispatch_time_s, k))

    def _pick_waiting(self, k: int, waiting: list[int]) -> int:
        d = self.client_deficit
        eligible = [j for j in waiting if d.get(self._queue[j][1].client_id, 0.0) > 0]
        if not eligible:  # Alg. 1 lines 3-7, repeated in one step until a waiting client may be served
            quantum = self.params.quantum_client
            active = {self._queue[j][1].client_id for j in waiting}
            rounds = min(int(-d.get(c, 0.0) // quantum) + 1 for c in active)
            for c, q in d.items():  # each round refills only those at or below 0: credit stays <= Q^u
                if q <= 0:
                    d[c] = q + quantum * min(rounds, int(-q // quantum) + 1)
            eligible = [j for j in waiting if d[self._queue[j][1].client_id] > 0]
        best = None
        bound = self.params.fair_skips
        if bound is not None:
            passed = self._passed
            starving = (j for j in itertools.islice(eligible, self.params.lookahead) if passed.get(j, 0) >= bound)
            best = self._starving_here(k, starving)
        if best is None:  # Alg. 1 line 3-4: the longest match among the jobs whose client may be served
            best, best_m = eligible[0], -1
            for j in itertools.islice(eligible, self.params.lookahead):
                m = self.match_tokens(k, self._queue[j][1])
                if m > best_m:
                    best, best_m = j, m
        if bound is not None:
            # Why count only other clients' grants, and only while the job's client holds credit: the
            # deficits bound each client's service, not the order among clients with credit, so a light
            # client's miss (a rare tool) loses every freed slot to a flooder's hits for as long as the
            # flooder's quantum lasts (at a hit's small extend charge, dozens of grants, every round).
            # A client's own hits before its own misses is its own locality, and a client in debt waits
            # by DLPM's rule: so a flooder's misses keep waiting (serving them early is what cost
            # throughput when every passed-over job counted) while a light client's tail is bounded.
            winner = self._queue[best][1].client_id
            for j in waiting:
                if j == best:
                    break
                c = self._queue[j][1].client_id
                if c != winner and d.get(c, 0.0) > 0:
                    self._passed[j] = self._passed.get(j, 0) + 1
        return best

    def _known(self, c: str) -> None:
        """Alg. 1 line 12: a client seen for the first time starts at 0; the known set is bounded."""
        d = self.client_deficit
        if c in d:
            return
        # clients waiting or running stay (a running job is charged again at its end): the bound is
        # MAX_CLIENTS or the active clients, whichever is more
        active = None
        while len(d) >= self.MAX_CLIENTS:
            if active is None:
                active = set(self._waiting_of) | {r.client_id for r in self._job_request.values()}
            idle = next((x for x in d if x not in active), None)
            if idle is None:
                break
            del d[idle]
            for k in range(len(self._chains)):  # its q_{i,k} go with it (new again: 0, Alg. 2)
                self.chain_deficit.pop((idle, k), None)
            self.service.pop(idle, None)
        d[c] = 0.0

    def deficits_view(self, limit: int = 64) -> dict:
        """The counters for /status: at most `limit` clients, the waiting ones first."""
        idle = (c for c in self.client_deficit if c not in self._waiting_of)
        clients = list(itertools.islice(itertools.chain(self._waiting_of, idle), limit))
        return {
            "clients_known": len(self.client_deficit),
            "client_deficit": {c: self.client_deficit[c] for c in clients},
            "chain_deficit": {
                (c, k): self.chain_deficit[(c, k)]
                for c in clients
                for k in range(len(self._chains))
                if (c, k) in self.chain_deficit
            },
        }

    def _queued(self, job_id: int, req: DispatchRequest) -> None:
        self._known(req.client_id)
        self._waiting_of[req.client_id] = self._waiting_of.get(req.client_id, 0) + 1

    def _left_queue(self, job_id: int, req: DispatchRequest) -> None:
        self._passed.pop(job_id, None)
        c = req.client_id
        self._waiting_of[c] -= 1
        if not self._waiting_of[c]:
            del self._waiting_of[c]

    def _granted(self, job_id: int, k: int, req: DispatchRequest, match_tokens: int) -> None:
        c = req.client_id
        cost = self.charge(req, match_tokens)
        self.service[c] = self.service.get(c, 0.0) + cost
        self.chain_deficit[(c, k)] = self.chain_deficit.get((c, k), 0.0) - self.params.w_in * req.prompt_tokens
        self._known(c)
        self.client_deficit[c] -= cost

    def _finished(self, job_id: int, k: int, req: DispatchRequest) -> None:
        key = (req.client_id, k)
        self.chain_deficit[key] = self.chain_deficit.get(key, 0.0) - self.params.w_out * req.output_tokens


class RrLpmDispatcher(_PromptAwareDispatcher):
    """The DLPM paper's RR + LPM baseline: round robin over the free chains; a freed slot goes to the
    waiting job with the longest match on it (plain LPM: no starvation bound, no fairness)."""

    name = "rr-lpm"

    def __init__(self, chains: Sequence[ChainSpec], **kw):
        kw["params"] = dataclasses.replace(kw.get("params") or PrefixParams(), max_skips=None)
        super().__init__(chains, **kw)

    def _choose(self, req: DispatchRequest, free: list[int]) -> int:
        return self._round_robin(free)

    def _pick_waiting(self, k: int, waiting: list[int]) -> int:
        return self._lpm(k, waiting)


class VtcRrDispatcher(_PromptAwareDispatcher):
    """The DLPM paper's VTC baseline: round robin over the free chains; a freed slot goes to the waiting
    job of the client with the least virtual token counter (papers/vtc-fairness-in-serving-llms.txt,
    Algorithm 2: charged w_e * input + w_q * output tokens at the grant, prefix-blind; a client that starts
    waiting is lifted to the least counter of the waiting clients); FIFO within a client."""

    name = "vtc-rr"
    uses_index = False

    def __init__(self, chains: Sequence[ChainSpec], **kw):
        super().__init__(chains, **kw)
        self.counter: dict[str, float] = {}
        self._waiting_of: dict[str, int] = {}

    def _choose(self, req: DispatchRequest, free: list[int]) -> int:
        return self._round_robin(free)

    def _pick_waiting(self, k: int, waiting: list[int]) -> int:
        return min(waiting, key=lambda j: self.counter.get(self._queue[j][1].client_id, 0.0))  # min: FIFO ties

    def _queued(self, job_id: int, req: DispatchRequest) -> None:
        c = req.client_id
        if c not in self._waiting_of:
            others = [self.counter.get(x, 0.0) for x in self._waiting_of]
            if others:
                self.counter[c] = max(self.counter.get(c, 0.0), min(others))
        self._waiting_of[c] = self._waiting_of.get(c, 0) + 1

    def _left_queue(self, job_id: int, req: DispatchRequest) -> None:
        c = req.client_id
        self._waiting_of[c] -= 1
        if not self._waiting_of[c]:
            del self._waiting_of[c]

    def _granted(self, job_id: int, k: int, req: DispatchRequest, match_tokens: int) -> None:
        p = self.params
        c = req.client_id
        self.counter[c] = self.counter.get(c, 0.0) + p.w_in * req.prompt_tokens + p.w_out * req.output_tokens


PROMPT_AWARE = {"e2": E2Dispatcher, "d2lpm": D2lpmDispatcher, "rr-lpm": RrLpmDispatcher, "vtc-rr": VtcRrDispatcher}

DISPATCHERS = {
    "jffc": JffcDispatcher,
    "jsq": JsqDispatcher,
    "jiq": JiqDispatcher,
    "sed": SedDispatcher,
    "sa-jsq": SaJsqDispatcher,
    **PROMPT_AWARE,
}


def make_dispatcher(
    name: str,
    chains: Sequence[ChainSpec],
    rng: np.random.Generator | None = None,
    order: QueueOrder | None = None,
    *,
    index: PrefixIndex | None = None,
    hop_servers: Sequence[Sequence] | None = None,
    costs: dict | None = None,
    params: PrefixParams | None = None,
) -> Dispatcher:
    """Factory: ``name`` in DISPATCHERS. ``order`` (JFFC's central queue order) is refused for the others,
    whose queue orders are their own. The prompt-aware policies (e2, d2lpm, rr-lpm, vtc-rr) read and
    teach ``index`` (a PrefixIndex that outlives the dispatcher; None: a private one), name each hop's
    server by ``hop_servers`` (default ChainSpec.servers), cost servers by ``costs`` (server -> ServerCost;
    default 1 and 1) and take ``params``; the others ignore these."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatch policy {name!r}; choose one of {sorted(DISPATCHERS)}")
    if name == "jffc":
        return JffcDispatcher(chains, order)
    if order is not None:
        raise ValueError(
            f"dispatch policy {name!r} orders its own queue; a queue order (e.g. --queue fair) needs --dispatch jffc"
        )
    if name in PROMPT_AWARE:
        return PROMPT_AWARE[name](chains, index=index, hop_servers=hop_servers, costs=costs, params=params)
    return DISPATCHERS[name](chains, rng)
