"""GCA: Greedy Cache Allocation (Alg. 2) over the routing graph G_{a,m}.

Two implementations of the same algorithm:

- ``gca``: the one the planner uses; Alg. 2 literally, on a networkx DiGraph over J_+ with
  Dijkstra (line 5).
- ``gca_end_dp``: an independent cross-check that runs the same shortest-path search as a dynamic
  program over block *ends*: a link (i, j) costs tau^c_j + tau^p_j (end_j - end_i) and is present
  iff M_j >= m_ij = end_j - end_i, both functions of (end_i, j) only, and every link goes from a
  smaller end to a larger one (the graph is a DAG ordered by end). So the best way to reach end e
  is one number D[e], and each server relaxes the window of predecessor ends it can accept.
  (Measured at J=200, L=80 both take about the same time; the per-request routers of the
  baselines use this DP because their costs change at every request.)

Link removal (lines 10-12) is applied to *every* link into a server whose residual M_j fell below
m_ij, not only the links of the chain just built: otherwise a later shortest path could use such a
link and get capacity floor(M_j / m_ij) = 0. Both implementations do this; they agree on instances
without cost ties (tests check that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx
import numpy as np

from orchestrator.model import (SINK, SOURCE, ChainSpec, Cluster, InfeasibleClusterError, Placement,
                                chain_from_path, link_time_s, residual_slots, routing_links)


@dataclass(frozen=True)
class GcaResult:
    """Chains in construction order (non-decreasing service time, Theorem 3.5) and the slots left."""

    chains: tuple[ChainSpec, ...]
    residual_slots_after: tuple[int, ...]


def gca_end_dp(cluster: Cluster, placement: Placement, residual: list[int] | None = None) -> GcaResult:
    """Alg. 2 with the end-indexed shortest path (see module docstring)."""
    L = cluster.service.num_blocks
    M = list(residual_slots(cluster, placement) if residual is None else residual)
    used = [j for j in placement.used_servers()]
    # Servers sorted by end: relaxing in this order is a topological order of the DAG.
    used.sort(key=lambda j: (placement.ranges[j].end, j))
    starts = {j: placement.ranges[j].start for j in used}
    ends = {j: placement.ranges[j].end for j in used}
    tau_c = {j: cluster.servers[j].tau_c_s for j in used}
    tau_p = {j: cluster.servers[j].tau_p_s for j in used}
    end_index = np.arange(L + 1, dtype=float)
    chains: list[ChainSpec] = []
    while True:
        D = np.full(L + 1, math.inf)
        D[0] = 0.0
        best_server = [-1] * (L + 1)
        pred_end: dict[int, int] = {}
        for j in used:
            e_j = ends[j]
            lo = max(starts[j], e_j - M[j])  # links (i, j) with M_j >= m_ij = e_j - e_i (line 2, 10-12)
            if lo >= e_j:
                continue
            window = D[lo:e_j] + tau_p[j] * (e_j - end_index[lo:e_j])
            k = int(np.argmin(window))
            cost = tau_c[j] + float(window[k])
            if cost < D[e_j]:
                D[e_j] = cost
                best_server[e_j] = j
                pred_end[j] = lo + k
        if not math.isfinite(D[L]):  # line 4: j_0 no longer connected to j_{J+1}
            break
        path = []
        e = L
        while e > 0:
            j = best_server[e]
            path.append(j)
            e = pred_end[j]
        path.reverse()
        chains.append(_allocate(cluster, placement, path, M))
    return GcaResult(chains=tuple(chains), residual_slots_after=tuple(M))


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
    """Alg. 2 literally, with networkx Dijkstra on G^{(l-1)} = (J_+, E^{(l-1)}).

    ``residual`` overrides the starting slots M^{(0)}_j (default M~_j of eq. 3)."""
    M = list(residual_slots(cluster, placement) if residual is None else residual)
    g = nx.DiGraph()
    g.add_nodes_from([SOURCE, SINK])
    for i, j, m_ij in routing_links(placement, cluster.service.num_blocks):
        if j == SINK:
            g.add_edge(i, j, weight=0.0, m=0)
        elif M[j] >= m_ij:  # line 2
            g.add_edge(i, j, weight=link_time_s(cluster.servers[j], m_ij), m=m_ij)
    chains: list[ChainSpec] = []
    while True:
        try:
            nodes = nx.dijkstra_path(g, SOURCE, SINK, weight="weight")  # line 5
        except nx.NetworkXNoPath:  # line 4: j_0 no longer connected to j_{J+1}
            break
        path = nodes[1:-1]
        chain = _allocate(cluster, placement, path, M)  # lines 6-8
        chains.append(chain)
        for j in set(path):  # lines 9-12, for every link into a touched server
            for i in list(g.predecessors(j)):
                if M[j] < g.edges[i, j]["m"]:
                    g.remove_edge(i, j)
    return GcaResult(chains=tuple(chains), residual_slots_after=tuple(M))


def gca_or_raise(cluster: Cluster, placement: Placement) -> GcaResult:
    res = gca(cluster, placement)
    if not res.chains:
        raise InfeasibleClusterError("the placement forms no complete chain with a free cache slot: "
                                     "add servers or memory, or lower the cache reservation c")
    return res
