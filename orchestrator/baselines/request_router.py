"""Per-request routing over a placement with live cache bookkeeping (used by PETALS and BPRR).

A router is a Dispatcher (orchestrator.dispatch): on each arrival it computes one route, a
shortest path through the routing graph E_{a,m} (§2.1.1) whose link costs depend on the current
free cache slots; the route gets an id (``Start.chain_id``; ``route(chain_id)`` returns its
ChainSpec with capacity 1). If every server on the route has m_ij free slots the job starts and
takes them; otherwise it waits on that route (the PETALS server would block the allocation) in a
FIFO list. A completion frees the job's slots and starts, in FIFO order, every waiting job whose
route now fits. Links into a server whose *total* slots M~_j are fewer than m_ij are never used
(the job could never start).

With ``commit_at_arrival`` (the paper authors' simulator, orchestrator.sim.authors_setup) a job
takes its route's slots at arrival, holds them while it waits, and starts once the jobs that
arrived before it (running or waiting) leave room on every server of its route; free slots may
go negative meanwhile, and link costs see them.

Shortest paths run as a dynamic program over block ends, as in cache_gca: a link (i, j) only
depends on (end_i, j).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass

import numpy as np

from orchestrator.dispatch import Dispatcher, Start
from orchestrator.model import (
    ChainSpec,
    Cluster,
    InfeasibleClusterError,
    Placement,
    chain_from_path,
    residual_slots,
)


@dataclass(frozen=True)
class RouteLinks:
    """Every link of a fixed placement's routing graph, flattened: link k enters server `pair_j[k]` from
    block end `pair_lo[k]` with `pair_m[k]` blocks to process there. Server `order[i]` (used servers by
    (end, index), the DP's order) owns links `offsets[i] : offsets[i + 1]`, one per start in its range."""

    order: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    offsets: tuple[int, ...]
    pair_j: np.ndarray
    pair_lo: np.ndarray
    pair_m: np.ndarray

    @classmethod
    def of(cls, placement: Placement) -> "RouteLinks":
        order = tuple(sorted(placement.used_servers(), key=lambda j: (placement.ranges[j].end, j)))
        starts = tuple(placement.ranges[j].start for j in order)
        ends = tuple(placement.ranges[j].end for j in order)
        lengths = [b - a for a, b in zip(starts, ends)]
        offsets = tuple(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist())
        pair_j = np.repeat(np.array(order, dtype=np.int64), lengths)
        pair_lo = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)]) if order else np.zeros(0, np.int64)
        pair_m = np.repeat(np.array(ends, dtype=np.int64), lengths) - pair_lo
        return cls(order, starts, ends, offsets, pair_j, pair_lo, pair_m)


def end_dp_shortest_path(links: RouteLinks, num_blocks: int, costs: np.ndarray) -> list[int] | None:
    """Shortest source->sink server path; `costs[k]` is link k's cost (inf = no link). Servers in (end,
    index) order; a server wins its end only with a strictly smaller cost, and a window's first minimum
    is its entry point, so ties go to the lower index and the earlier start (as a per-server loop would)."""
    D = np.full(num_blocks + 1, math.inf)
    D[0] = 0.0
    best = [-1] * (num_blocks + 1)
    pred: dict[int, int] = {}
    for i, j in enumerate(links.order):
        start, end = links.starts[i], links.ends[i]
        window = D[start:end] + costs[links.offsets[i] : links.offsets[i + 1]]
        k = int(window.argmin())
        if window[k] < D[end]:
            D[end] = window[k]
            best[end] = j
            pred[j] = start + k
    if not math.isfinite(D[num_blocks]):
        return None
    path, e = [], num_blocks
    while e > 0:
        j = best[e]
        path.append(j)
        e = pred[j]
    return path[::-1]


class PerRequestRouter(Dispatcher):
    """Shared bookkeeping: free slots per server, route registry, waiting list."""

    name = "per-request"

    def __init__(
        self,
        cluster: Cluster,
        placement: Placement,
        total_slots: list[int] | None = None,
        commit_at_arrival: bool = False,
    ):
        self.cluster = cluster
        self.placement = placement
        self.total_slots = residual_slots(cluster, placement) if total_slots is None else list(total_slots)
        self.commit_at_arrival = commit_at_arrival
        self.free_slots = list(self.total_slots)
        self.sessions_on = [0] * cluster.num_servers  # running sessions per server
        self.holders_on = [0] * cluster.num_servers  # sessions holding cache (running, or committed and waiting)
        self.rate_sum_on = [0.0] * cluster.num_servers  # sum of 1/T over running sessions per server
        self.pending_slots = [0] * cluster.num_servers  # slots wanted by waiting jobs per server
        self._routes: list[ChainSpec] = []
        self._demand: list[tuple[tuple[int, int], ...]] = []
        self._route_ids: dict[tuple[int, ...], int] = {}
        self._waiting: deque[tuple[int, int]] = deque()
        self._job_route: dict[int, int] = {}
        self.links = RouteLinks.of(placement)
        self._total_per_link = np.asarray(self.total_slots, dtype=np.int64)[self.links.pair_j]
        if self._path() is None:
            raise InfeasibleClusterError(
                f"{self.name}: the placement has no complete chain with enough "
                "cache for one session; add servers or memory"
            )

    @abstractmethod
    def _link_costs(self) -> np.ndarray:
        """Cost of every link of `self.links` (entering server pair_j with pair_m blocks to process) under
        the current state, one vectorised evaluation per route (the simulator's hot path for PETALS and BPRR)."""

    def _path(self) -> list[int] | None:
        # links into a server whose total slots are fewer than m_ij are never used (the job could never start)
        costs = np.where(self.links.pair_m <= self._total_per_link, self._link_costs(), math.inf)
        return end_dp_shortest_path(self.links, self.cluster.service.num_blocks, costs)

    def route(self, chain_id: int) -> ChainSpec:
        """The chain behind a route id returned in Start.chain_id."""
        return self._routes[chain_id]

    def _route_id(self, path: list[int]) -> int:
        key = tuple(path)
        if key not in self._route_ids:
            spec = chain_from_path(self.cluster, self.placement, path, 1)
            self._route_ids[key] = len(self._routes)
            self._routes.append(spec)
            self._demand.append(tuple((j, b.num_blocks) for j, b in zip(spec.servers, spec.blocks)))
        return self._route_ids[key]

    def _fits(self, rid: int) -> bool:
        return all(self.free_slots[j] >= m for j, m in self._demand[rid])

    def _start(self, job_id: int, rid: int) -> Start:
        mu = 1.0 / self._routes[rid].service_time_s
        for j, m in self._demand[rid]:
            if not self.commit_at_arrival:  # committed jobs took their slots at arrival
                self.free_slots[j] -= m
                self.holders_on[j] += 1
            self.sessions_on[j] += 1
            self.rate_sum_on[j] += mu
        self._job_route[job_id] = rid
        return Start(job_id, rid, self._routes[rid].service_time_s)

    def on_arrival(self, job_id: int, allowed: frozenset[int] | None = None, request=None) -> list[Start]:
        # a route is computed per request over live slots; ``allowed`` (chain indices) has no meaning here
        path = self._path()
        if path is None:  # cannot happen after the constructor's check; keep the error explicit
            raise InfeasibleClusterError(f"{self.name}: no route")
        rid = self._route_id(path)
        if self.commit_at_arrival:
            fits = self._fits(rid)
            for j, m in self._demand[rid]:
                self.free_slots[j] -= m
                self.holders_on[j] += 1
            if fits:  # room next to every holder, earlier waiting jobs included
                return [self._start(job_id, rid)]
            self._waiting.append((job_id, rid))
            return []
        if self._fits(rid):
            return [self._start(job_id, rid)]
        self._waiting.append((job_id, rid))
        for j, m in self._demand[rid]:
            self.pending_slots[j] += m
        return []

    def on_completion(self, job_id: int) -> list[Start]:
        rid = self._job_route.pop(job_id)
        mu = 1.0 / self._routes[rid].service_time_s
        for j, m in self._demand[rid]:
            self.free_slots[j] += m
            self.holders_on[j] -= 1
            self.sessions_on[j] -= 1
            self.rate_sum_on[j] -= mu
        if self.commit_at_arrival:
            return self._start_committed()
        started = []
        still: deque[tuple[int, int]] = deque()
        for wjob, wrid in self._waiting:
            if self._fits(wrid):
                for j, m in self._demand[wrid]:
                    self.pending_slots[j] -= m
                started.append(self._start(wjob, wrid))
            else:
                still.append((wjob, wrid))
        self._waiting = still
        return started

    def _start_committed(self) -> list[Start]:
        """Commit mode: a waiting job starts when the running jobs plus the jobs that arrived before
        it and still wait (all of them hold slots) leave room for its own demand on every server of
        its route (the authors' wait: until enough earlier holders complete, v4:1557-1590)."""
        used = [t - f for t, f in zip(self.total_slots, self.free_slots)]  # all holders, incl. waiting
        waiting_held = [0] * len(used)
        for _, wrid in self._waiting:
            for j, m in self._demand[wrid]:
                waiting_held[j] += m
        running = [u - w for u, w in zip(used, waiting_held)]
        earlier = [0] * len(used)
        started: list[Start] = []
        still: deque[tuple[int, int]] = deque()
        for wjob, wrid in self._waiting:
            demand = self._demand[wrid]
            if all(running[j] + earlier[j] + m <= self.total_slots[j] for j, m in demand):
                started.append(self._start(wjob, wrid))
            else:
                still.append((wjob, wrid))
            for j, m in demand:
                earlier[j] += m
        self._waiting = still
        return started

    def cancel(self, job_id: int) -> None:
        """A waiting job gives up (e.g. its client timed out): forget it. Unknown ids are ignored."""
        for item in self._waiting:
            if item[0] == job_id:
                self._waiting.remove(item)
                for j, m in self._demand[item[1]]:
                    if self.commit_at_arrival:
                        self.free_slots[j] += m
                        self.holders_on[j] -= 1
                    else:
                        self.pending_slots[j] -= m
                return

    @property
    def queue_length(self) -> int:
        return len(self._waiting)
