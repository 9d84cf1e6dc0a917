"""BPRR baseline (ref. [29]: Sun, He, Ji, Parag 2025): block placement + request routing.

Our reading (the paper's §4.1.3 and the issue describe it; details are our choices):

1. Target concurrency R: the number of sessions in service on the fastest chain is about
   Poisson(lambda T) (M/G/inf), so R = ceil(lambda T + sqrt(lambda T)) (mean plus one standard
   deviation), T = service time of the fastest chain GBP-CR forms with c = 1. R is capped by what
   total memory allows, L (s_m + s_c R) <= sum_j M_j, and by what the largest server allows
   (s_m + s_c R <= max_j M_j); R >= 1.
2. Conservative block count m_j = min(floor(M_j / (s_m + s_c R)), L).
3. Servers in increasing order of amortised time (tau_c_j + tau_p_j m_j) / m_j.
4. CG-BP greedy placement, one server at a time. Each block b has a capacity cap_b = sum of the
   session capacities floor(M~_j / m_j) of the servers holding it, and a per-block time
   1 / sum_j (cap_j / (tau_p_j + tau_c_j / m_j)) (infinite while uncovered). While some block has
   cap_b < R the server goes to the window with the largest summed per-block time (most uncovered
   blocks first, then the largest finite sum); afterwards to the window whose sorted capacity
   vector is lexicographically smallest. Ties go to the leftmost window.
5. WS-RR routing per request: shortest path with link cost tau_c_j + tau_p_j m_ij + W_j(m_ij), where
   W_j is the expected wait until server j has m_ij free slots: with d = m_ij + pending_j - free_j
   slots missing, n_j sessions running on j holding s-bar slots each on average and completing at
   mean rate mu-bar, W_j = sum_{r = n_j - q + 1}^{n_j} 1 / (r mu-bar) for q = min(n_j, ceil(d / s-bar))
   sessions to finish (exponential order statistics), plus one mean service time per session still
   missing beyond n_j. With ``wait="active-mean"`` (the paper authors' simulator) W_j is instead
   0 if j has m_ij free slots, else (tau_c_j + tau_p_j m_j) / h_j with h_j the sessions holding
   cache on j (the whole mean service time if none).
"""

from __future__ import annotations

import math

import numpy as np

from orchestrator.baselines.request_router import PerRequestRouter
from orchestrator.model import (
    BlockInterval,
    Cluster,
    InfeasibleClusterError,
    Placement,
    robust_floor_div,
)
from orchestrator.placement_gbp_cr import gbp_cr, max_capacity


def bprr_target_concurrency(cluster: Cluster) -> int:
    """R of step 1."""
    s = cluster.service
    g = gbp_cr(cluster, 1)
    if not g.chains:
        raise InfeasibleClusterError(
            "BPRR: the servers cannot hold one chain of the model even with one "
            "cache slot per block; add servers or memory"
        )
    x = cluster.arrival_rate_per_s * min(g.chain_times_s)
    r = math.ceil(x + math.sqrt(x))
    cap_total = robust_floor_div(sum(sv.memory for sv in cluster.servers) / s.num_blocks - s.block_size, s.cache_size)
    return max(1, min(r, cap_total, max_capacity(cluster)))


def bprr_placement(cluster: Cluster, target_concurrency: int | None = None) -> Placement:
    """Steps 2-4 (CG-BP)."""
    s = cluster.service
    L = s.num_blocks
    R = bprr_target_concurrency(cluster) if target_concurrency is None else target_concurrency
    per_block = s.block_size + s.cache_size * R
    m = [min(robust_floor_div(sv.memory, per_block), L) for sv in cluster.servers]
    order = sorted(
        (j for j in range(len(m)) if m[j] > 0),
        key=lambda j: ((cluster.servers[j].tau_c_s + cluster.servers[j].tau_p_s * m[j]) / m[j], j),
    )
    cap = np.zeros(L)
    rate = np.zeros(L)
    ranges: list[BlockInterval | None] = [None] * len(m)
    for j in order:
        sv = cluster.servers[j]
        sessions = robust_floor_div(sv.memory - s.block_size * m[j], s.cache_size) // m[j]
        starts = range(L - m[j] + 1)
        if np.any(cap < R):
            with np.errstate(divide="ignore"):
                block_time = np.where(rate > 0, 1.0 / np.where(rate > 0, rate, 1.0), math.inf)

            def key(a):
                w = block_time[a : a + m[j]]
                inf = np.isinf(w)
                return (-int(inf.sum()), -float(w[~inf].sum()))
        else:

            def key(a):
                return tuple(np.sort(cap[a : a + m[j]]))

        start = min(starts, key=lambda a: (key(a), a))
        ranges[j] = BlockInterval(start, start + m[j])
        cap[start : start + m[j]] += sessions
        rate[start : start + m[j]] += sessions / (sv.tau_p_s + sv.tau_c_s / m[j])
    if np.any(cap == 0):
        raise InfeasibleClusterError(
            f"BPRR placement leaves block {int(np.flatnonzero(cap == 0)[0])} "
            f"without cache (target concurrency R={R}); add servers or memory"
        )
    return Placement(tuple(ranges))


class BprrRouter(PerRequestRouter):
    """WS-RR (step 5)."""

    name = "bprr"

    def __init__(
        self, cluster: Cluster, placement: Placement, wait: str = "order-statistics", commit_at_arrival: bool = False
    ):
        self.wait = wait
        self._tau_c_s = np.array([sv.tau_c_s for sv in cluster.servers])
        self._tau_p_s = np.array([sv.tau_p_s for sv in cluster.servers])
        blocks = np.array([placement.num_blocks(j) for j in range(cluster.num_servers)])
        self._mean_service_s = self._tau_c_s + self._tau_p_s * blocks  # a server's whole range, one session
        super().__init__(cluster, placement, commit_at_arrival=commit_at_arrival)

    def _active_mean_wait_s(self) -> np.ndarray:
        j, m = self.links.pair_j, self.links.pair_m
        holders = np.asarray(self.holders_on)[j]
        mean_s = self._mean_service_s[j]
        wait_s = np.where(holders > 0, mean_s / np.maximum(holders, 1), mean_s)  # over the holders, if any
        return np.where(np.asarray(self.free_slots)[j] >= m, 0.0, wait_s)

    def _expected_wait_s(self) -> np.ndarray:
        """Per link: the expected wait for the slots it lacks on its server (0 where they are free)."""
        if self.wait == "active-mean":
            return self._active_mean_wait_s()
        links = self.links
        j_of, m_of = links.pair_j, links.pair_m
        missing = m_of + (np.asarray(self.pending_slots) - np.asarray(self.free_slots))[j_of]
        out = np.zeros(len(m_of))
        if not np.any(missing > 0):
            return out
        for i, j in enumerate(links.order):
            lo, hi = links.offsets[i], links.offsets[i + 1]
            if not np.any(missing[lo:hi] > 0):
                continue
            n = self.sessions_on[j]
            used = self.total_slots[j] - self.free_slots[j]
            if n > 0:
                mean_rate = self.rate_sum_on[j] / n
                avg_slots = used / n
            else:
                mean_rate = 1.0 / max(r.service_time_s for r in self._routes) if self._routes else 1.0
                avg_slots = float(max(1, int(m_of[lo:hi].max())))
            for idx in range(lo, hi):
                d = missing[idx]
                if d <= 0:
                    continue
                q = math.ceil(d / avg_slots)
                within = min(q, n)
                w = sum(1.0 / (r * mean_rate) for r in range(n - within + 1, n + 1))
                out[idx] = w + (q - within) / mean_rate
        return out

    def _link_costs(self) -> np.ndarray:
        j = self.links.pair_j
        return self._tau_c_s[j] + self._tau_p_s[j] * self.links.pair_m + self._expected_wait_s()
