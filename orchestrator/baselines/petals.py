"""PETALS baseline [6]: greedy block selection at join time + per-request min-latency routing.

Our reading of PETALS (petals/server/block_selection.py, client/routing/sequence_manager.py):

Placement. Servers join one at a time, in the cluster's listed order. A joining server takes
  m_j = min(floor(M_j / (s_m + s_c r)), L) blocks, r = ``cache_sessions`` (PETALS reserves
  attn_cache_tokens = 4096 tokens of KV cache per block for non-GQA models, i.e. r = 2 sessions
  of the 2048-token max length behind s_c), and the contiguous window whose *sorted* vector of
  per-block throughputs (sum over servers already holding the block) is lexicographically smallest:
  it covers the weakest blocks first; ties go to the leftmost window. A server's per-block
  throughput is 1 / (tau_p_j + tau_c_j / m_j) sessions/s.
Routing. Each request takes the min-latency path (Dijkstra in PETALS; an exact DP over block ends
  here) with link cost, per decoding step, RTT_j / 2 + 18 ms + m_ij tau_p_j / steps, and +10 s when
  server j has fewer than m_ij free cache slots (PETALS' penalty for a server without cache).
  With no ``rtt_s`` on a server, tau_c_j / steps stands for RTT_j / 2. ``steps`` =
  ``steps_per_session`` (decode steps of a session, default 20).
Options (orchestrator.baselines.options): a per-server block cap, and a fixed cache per hosted
block instead of all leftover memory (the paper authors' simulator).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from orchestrator.baselines.request_router import PerRequestRouter
from orchestrator.model import (
    BlockInterval,
    Cluster,
    InfeasibleClusterError,
    Placement,
    residual_slots,
    robust_floor_div,
)

PETALS_CACHE_SESSIONS = 2.0
PETALS_STEP_OVERHEAD_S = 0.018
PETALS_NO_CACHE_PENALTY_S = 10.0


def petals_blocks(
    cluster: Cluster, cache_sessions: float = PETALS_CACHE_SESSIONS, max_blocks: Sequence[int | None] | None = None
) -> list[int]:
    s = cluster.service
    per_block = s.block_size + s.cache_size * cache_sessions
    m = [min(robust_floor_div(sv.memory, per_block), s.num_blocks) for sv in cluster.servers]
    if max_blocks is not None:
        if len(max_blocks) != len(m):
            raise ValueError(f"max_blocks has {len(max_blocks)} entries for {len(m)} servers")
        m = [mj if cap is None else min(mj, cap) for mj, cap in zip(m, max_blocks)]
    return m


def petals_fixed_slots(cluster: Cluster, placement: Placement, cache_per_block: float) -> list[int]:
    """Cache slots of PETALS servers that keep ``cache_per_block`` per hosted block:
    floor(m_j * it / s_c), at most eq. 3's M~_j."""
    s = cluster.service
    return [
        min(robust_floor_div(placement.num_blocks(j) * cache_per_block, s.cache_size), full)
        for j, full in enumerate(residual_slots(cluster, placement))
    ]


def petals_placement(
    cluster: Cluster,
    cache_sessions: float = PETALS_CACHE_SESSIONS,
    join_order: Sequence[int] | None = None,
    max_blocks: Sequence[int | None] | None = None,
) -> Placement:
    """Join-order greedy placement (see module docstring). ``join_order`` lists server indices
    in the order they join (default: as listed; a simulator may pass rng.permutation(J));
    ``max_blocks`` caps each server's block count."""
    L = cluster.service.num_blocks
    m = petals_blocks(cluster, cache_sessions, max_blocks)
    throughput = np.zeros(L)
    ranges: list[BlockInterval | None] = [None] * len(m)
    order = range(len(m)) if join_order is None else join_order
    if sorted(order) != list(range(len(m))):
        raise ValueError("join_order must be a permutation of the server indices")
    for j in order:
        sv = cluster.servers[j]
        if m[j] == 0:
            continue
        best_start, best_key = 0, None
        for start in range(L - m[j] + 1):
            key = tuple(np.sort(throughput[start : start + m[j]]))
            if best_key is None or key < best_key:
                best_start, best_key = start, key
        ranges[j] = BlockInterval(best_start, best_start + m[j])
        throughput[best_start : best_start + m[j]] += 1.0 / (sv.tau_p_s + sv.tau_c_s / m[j])
    if np.any(throughput == 0):
        missing = int(np.flatnonzero(throughput == 0)[0])
        raise InfeasibleClusterError(f"PETALS placement leaves block {missing} uncovered: add servers or memory")
    return Placement(tuple(ranges))


class PetalsRouter(PerRequestRouter):
    """Min-latency routing per request (see module docstring)."""

    name = "petals"

    def __init__(
        self,
        cluster: Cluster,
        placement: Placement,
        steps_per_session: int = 20,
        fixed_cache_per_block: float | None = None,
        commit_at_arrival: bool = False,
    ):
        slots = None if fixed_cache_per_block is None else petals_fixed_slots(cluster, placement, fixed_cache_per_block)
        self.steps = steps_per_session
        servers = cluster.servers
        half_rtt_s = [sv.rtt_s / 2 if sv.rtt_s is not None else sv.tau_c_s / self.steps for sv in servers]
        self._half_rtt_s = np.array(half_rtt_s)
        self._tau_p_s = np.array([sv.tau_p_s for sv in servers])
        super().__init__(cluster, placement, total_slots=slots, commit_at_arrival=commit_at_arrival)

    def _link_costs(self) -> np.ndarray:
        j, m = self.links.pair_j, self.links.pair_m
        # the same arithmetic, element by element, as half_rtt + overhead + m * tau_p / steps per server
        cost = self._half_rtt_s[j] + PETALS_STEP_OVERHEAD_S + m * self._tau_p_s[j] / self.steps
        free = np.asarray(self.free_slots)[j]
        return cost + np.where(free < m, PETALS_NO_CACHE_PENALTY_S, 0.0)
