"""GBP-CR: Greedy Block Placement with Cache Reservation (Alg. 1, eqs 8, 9, 12, 13)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.model import BlockRange, Cluster, InfeasibleClusterError, Placement, robust_floor_div


@dataclass(frozen=True)
class GbpCrResult:
    """Outcome of Alg. 1 for one capacity requirement c.

    ``chains`` are GBP-CR's disjoint server groups that completed all L blocks (k_1(c), k_2(c), ...
    of eq. 13) in construction order; ``chain_times_s`` their sum_j t_j(c). ``num_chains`` is K(c)
    when ``meets_target`` (nu >= lambda/(rho_bar c)), else the number of complete chains formed
    before running out of servers. ``unused_servers`` got no blocks (loop stopped before them, or
    m_j(c) = 0). Servers of a trailing incomplete group keep their blocks, as Alg. 1 leaves them.
    """

    c: int
    placement: Placement
    chains: tuple[tuple[int, ...], ...]
    chain_times_s: tuple[float, ...]
    scaled_rate_per_s: float  # nu of Alg. 1 = sum_k 1 / sum_{j in k} t_j(c)
    meets_target: bool
    unused_servers: tuple[int, ...]

    @property
    def num_chains(self) -> int:
        return len(self.chains)


def blocks_per_server(cluster: Cluster, c: int) -> list[int]:
    """m_j(c) = min(floor(M_j / (s_m + s_c c)), L) (eq. 8), robust to float noise."""
    s = cluster.service
    per_block_gb = s.block_size_gb + s.cache_size_gb * c
    return [min(robust_floor_div(sv.memory_gb, per_block_gb), s.num_blocks) for sv in cluster.servers]


def max_capacity(cluster: Cluster) -> int:
    """c_max = floor((max_j M_j - s_m) / s_c) (§3.1.3); 0 if no server can hold one block+slot."""
    s = cluster.service
    best = max(sv.memory_gb for sv in cluster.servers)
    return max(0, robust_floor_div(best - s.block_size_gb, s.cache_size_gb))


def gbp_cr(cluster: Cluster, c: int) -> GbpCrResult:
    """Alg. 1 as written. Block indices inside are 1-based like the paper (a = 1 .. L) and are
    converted to 0-based half-open ranges when recorded (start = a_j - 1)."""
    if c < 1:
        raise ValueError(f"capacity requirement c must be >= 1, got {c}")
    L = cluster.service.num_blocks
    m = blocks_per_server(cluster, c)
    t = [sv.tau_c_s + sv.tau_p_s * mj for sv, mj in zip(cluster.servers, m)]  # eq. (9)
    order = sorted((j for j in range(len(m)) if m[j] > 0), key=lambda j: (t[j] / m[j], j))  # line 1, 3
    target = cluster.arrival_rate_per_s / (cluster.rho_bar * c)
    ranges: list[BlockRange | None] = [None] * len(m)
    chains: list[tuple[int, ...]] = []
    chain_times: list[float] = []
    a, nu, T = 1, 0.0, 0.0  # line 2
    group: list[int] = []
    met = False
    for j in order:
        a_j = min(a, L - m[j] + 1)  # line 4: shift the last server back so it ends at block L
        ranges[j] = BlockRange(a_j - 1, a_j - 1 + m[j])
        group.append(j)
        T += t[j]  # line 5
        a = min(a + m[j] - 1, L) + 1  # line 6
        if a > L:  # line 7
            nu += 1.0 / T if T > 0 else math.inf  # line 8
            chains.append(tuple(group))
            chain_times.append(T)
            if nu >= target * (1 - 1e-12):  # line 9-10 (relative tolerance against float noise)
                met = True
                break
            a, T, group = 1, 0.0, []  # line 12
    unused = tuple(j for j in range(len(m)) if ranges[j] is None)
    return GbpCrResult(c=c, placement=Placement(tuple(ranges)), chains=tuple(chains),
                       chain_times_s=tuple(chain_times), scaled_rate_per_s=nu, meets_target=met,
                       unused_servers=unused)


def gbp_cr_or_raise(cluster: Cluster, c: int) -> GbpCrResult:
    """gbp_cr, raising InfeasibleClusterError when not even one complete chain forms."""
    res = gbp_cr(cluster, c)
    if res.num_chains == 0:
        s = cluster.service
        total = sum(blocks_per_server(cluster, c))
        raise InfeasibleClusterError(
            f"with cache reservation c={c} the servers hold {total} blocks in total (each block needs "
            f"{s.block_size_gb + s.cache_size_gb * c:.6g} GB), fewer than the model's {s.num_blocks}: "
            f"add servers or memory, or lower c")
    return res
