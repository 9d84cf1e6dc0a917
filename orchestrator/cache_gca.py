"""GCA: Greedy Cache Allocation (Alg. 2) over the routing graph G_{a,m}.

Line 5's shortest path runs as a dynamic program over block *ends*: a link (i, j) costs
tau^c_j + tau^p_j (end_j - end_i) and is present iff M_j >= m_ij = end_j - end_i, both functions
of (end_i, j) only, and every link goes from a smaller end to a larger one (the graph is a DAG
ordered by end). So the best way to reach end e is one number D[e]; the servers ending at e are
relaxed together: per end, the cheapest link from each predecessor end is kept in an array and
refreshed only when a server of that end lost slots, so one shortest path costs O(L) numpy work
instead of Dijkstra over O(J^2 / L) links. A link's cost is added as D[e_i] + (tau^c_j +
tau^p_j m_ij), the order Dijkstra sums in.

Link removal (lines 10-12) is applied to *every* link into a server whose residual M_j fell below
m_ij, not only the links of the chain just built: otherwise a later shortest path could use such a
link and get capacity floor(M_j / m_ij) = 0. (Alg. 2 read literally with networkx Dijkstra is kept
as the test oracle, tests/gca_reference.py; the two agree chain for chain on instances without
cost ties.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from orchestrator.model import (
    ChainSpec,
    Cluster,
    InfeasibleClusterError,
    Placement,
    chain_from_path,
    residual_slots,
)


@dataclass(frozen=True)
class GcaResult:
    """Chains in construction order (non-decreasing service time, Theorem 3.5) and the slots left."""

    chains: tuple[ChainSpec, ...]
    residual_slots_after: tuple[int, ...]


def _allocate(cluster: Cluster, placement: Placement, path: list[int], M: list[int]) -> ChainSpec:
    """Lines 7-8: capacity = min_j floor(M_j / m_ij); take the slots from each server."""
    prev_end = 0
    demand = []
    for j in path:
        e = placement.ranges[j].end
        demand.append((j, e - prev_end))
        prev_end = e
    cap = min(M[j] // m for j, m in demand)
    if cap < 1:  # cannot happen: every link kept satisfies M_j >= m_ij
        raise AssertionError(f"GCA built a chain of capacity {cap}")
    for j, m in demand:
        M[j] -= cap * m
    return chain_from_path(cluster, placement, path, cap)


def gca(cluster: Cluster, placement: Placement, residual: list[int] | None = None) -> GcaResult:
    """Alg. 2 with the end-indexed shortest path (see module docstring).

    ``residual`` overrides the starting slots M^{(0)}_j (default M~_j of eq. 3)."""
    L = cluster.service.num_blocks
    M = list(residual_slots(cluster, placement) if residual is None else residual)
    groups = _end_groups(cluster, placement, M)
    where = {int(j): (g, r) for g in groups for r, j in enumerate(g.servers)}  # server -> (its group, row)
    chains: list[ChainSpec] = []
    while True:
        path = _shortest_path(groups, L)
        if path is None:  # line 4: j_0 no longer connected to j_{J+1}
            break
        chains.append(_allocate(cluster, placement, path, M))  # lines 6-8
        touched: dict[int, tuple[_EndGroup, list[int]]] = {}
        for j in path:  # lines 9-12: every link into a touched server
            g, r = where[j]
            touched.setdefault(id(g), (g, []))[1].append(r)
        for g, rows in touched.values():
            g.refresh(M, rows)
    return GcaResult(chains=tuple(chains), residual_slots_after=tuple(M))


class _EndGroup:
    """The servers whose range ends at ``end``, and the cheapest way into ``end`` from each
    predecessor end e' < end over their links still present: f[e'] = min_j tau^c_j + tau^p_j
    (end - e') over servers j with M_j >= end - e' and start_j <= e'; via[e'] = that j's row.
    D[end] = min_e' D[e'] + f[e'] (rounding is monotone, so this equals the minimum over all
    links). A server's lowest accepted e' (lo_j) only grows as its slots go, so a link once gone
    never returns: each column keeps its servers sorted by cost and a pointer to the cheapest one
    still linked, which only moves forward (O(n_e w log n_e) per GCA run, not per chain)."""

    def __init__(
        self, end: int, servers: list[int], starts: list[int], tau_c_s: list[float], tau_p_s: list[float], M: list[int]
    ):
        self.end = end
        self.servers = np.array(servers)
        self.starts = np.array(starts)
        self.lo_min = int(self.starts.min())
        self._ends = np.arange(self.lo_min, end)
        m = end - self._ends  # m_ij when entering from end e' (int, as link_time_s multiplies)
        self._cost = np.array(tau_c_s)[:, None] + np.array(tau_p_s)[:, None] * m[None, :]
        self._order = np.argsort(self._cost, axis=0, kind="stable")  # ties: the smaller row first
        self._ptr = np.zeros(len(self._ends), dtype=np.int64)
        self._cols = np.arange(len(self._ends))
        self.refresh(M)

    def refresh(self, M: list[int], rows: list[int] | None = None) -> None:
        """Re-read the slots of ``rows`` (default all) from M and move the column pointers on."""
        if rows is None:
            self._lo = np.maximum(self.starts, self.end - np.array([M[j] for j in self.servers]))  # line 2, 10-12
        else:
            for r in rows:
                self._lo[r] = max(self.starts[r], self.end - M[self.servers[r]])
        n = len(self.servers)
        while True:
            best = self._order[np.minimum(self._ptr, n - 1), self._cols]
            gone = (self._ptr < n) & (self._lo[best] > self._ends)
            if not gone.any():
                break
            self._ptr[gone] += 1
        self.via = best
        self.f = np.where(self._ptr < n, self._cost[best, self._cols], math.inf)


def _end_groups(cluster: Cluster, placement: Placement, M: list[int]) -> list[_EndGroup]:
    by_end: dict[int, list[int]] = {}
    for j in placement.used_servers():
        by_end.setdefault(placement.ranges[j].end, []).append(j)
    return [
        _EndGroup(
            e,
            js,
            [placement.ranges[j].start for j in js],
            [cluster.servers[j].tau_c_s for j in js],
            [cluster.servers[j].tau_p_s for j in js],
            M,
        )
        for e, js in sorted(by_end.items())
    ]


def _shortest_path(groups: list[_EndGroup], L: int) -> list[int] | None:
    """Line 5: the cheapest source -> sink path over the links still present."""
    D = np.full(L + 1, math.inf)
    D[0] = 0.0
    best_server: dict[int, int] = {}
    pred_end: dict[int, int] = {}
    for g in groups:
        vals = D[g.lo_min : g.end] + g.f
        k = int(np.argmin(vals))
        if vals[k] < D[g.end]:
            D[g.end] = vals[k]
            j = int(g.servers[g.via[k]])
            best_server[g.end] = j
            pred_end[j] = g.lo_min + k
    if not math.isfinite(D[L]):
        return None
    path, e = [], L
    while e > 0:
        j = best_server[e]
        path.append(j)
        e = pred_end[j]
    return path[::-1]


def gca_or_raise(cluster: Cluster, placement: Placement) -> GcaResult:
    res = gca(cluster, placement)
    if not res.chains:
        raise InfeasibleClusterError(
            "the placement forms no complete chain with a free cache slot: "
            "add servers or memory, or lower the cache reservation c"
        )
    return res
