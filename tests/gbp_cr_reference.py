"""Test oracle: GBP-CR (Alg. 1) run per c as written, the production implementation before the
planner was made fast enough for 10,000 servers (issue 12); orchestrator.placement_gbp_cr's
GbpCrSweep must give identical results."""

from __future__ import annotations

import math

from orchestrator.model import BlockInterval, Cluster, Placement
from orchestrator.placement_gbp_cr import GbpCrResult, blocks_per_server


def gbp_cr_loop(cluster: Cluster, c: int) -> GbpCrResult:
    """Alg. 1 as written. Block indices inside are 1-based like the paper (a = 1 .. L) and are
    converted to 0-based half-open ranges when recorded (start = a_j - 1)."""
    if c < 1:
        raise ValueError(f"capacity requirement c must be >= 1, got {c}")
    L = cluster.service.num_blocks
    m = blocks_per_server(cluster, c)
    t = [sv.tau_c_s + sv.tau_p_s * mj for sv, mj in zip(cluster.servers, m)]  # eq. (9)
    order = sorted((j for j in range(len(m)) if m[j] > 0), key=lambda j: (t[j] / m[j], j))  # line 1, 3
    target = cluster.arrival_rate_per_s / (cluster.rho_bar * c)
    ranges: list[BlockInterval | None] = [None] * len(m)
    chains: list[tuple[int, ...]] = []
    chain_times: list[float] = []
    a, nu, T = 1, 0.0, 0.0  # line 2
    group: list[int] = []
    met = False
    for j in order:
        a_j = min(a, L - m[j] + 1)  # line 4: shift the last server back so it ends at block L
        ranges[j] = BlockInterval(a_j - 1, a_j - 1 + m[j])
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
    return GbpCrResult(
        c=c,
        placement=Placement(tuple(ranges)),
        chains=tuple(chains),
        chain_times_s=tuple(chain_times),
        scaled_rate_per_s=nu,
        meets_target=met,
    )
