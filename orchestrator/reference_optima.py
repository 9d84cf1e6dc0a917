"""Reference optima for validating the heuristics on small instances (§4.1.2).

- ``optimal_cache_allocation``: the ILP of §4.1.2 ('Optimal ILP'): fixed chains (e.g. GCA's),
  choose integer capacities c_k >= 0 minimising sum_k c_k (7a) subject to sum_k c_k mu_k >=
  lambda / rho_bar (7b) and the per-server slot budgets (7d); scipy.optimize.milp.
- ``brute_force_disjoint_chains``: exact optimum of (10) by enumerating every grouping of the
  servers into disjoint subsets (tiny J only), used to check Theorem 3.4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from orchestrator.model import ChainSpec, Cluster
from orchestrator.placement_gbp_cr import blocks_per_server


def optimal_cache_allocation(cluster: Cluster, chains: Sequence[ChainSpec], slots: Sequence[int]) -> list[int] | None:
    """Optimal capacities for the given chains, or None if (7b) cannot be met."""
    K = len(chains)
    if K == 0:
        return None
    mu = np.array([1.0 / k.service_time_s for k in chains])
    rows = [mu]
    lb = [cluster.arrival_rate_per_s / cluster.rho_bar]
    ub = [np.inf]
    servers = sorted({j for k in chains for j in k.servers})
    for j in servers:
        row = np.zeros(K)
        for idx, k in enumerate(chains):
            for jj, b in zip(k.servers, k.blocks):
                if jj == j:
                    row[idx] += b.num_blocks
        rows.append(row)
        lb.append(-np.inf)
        ub.append(slots[j])
    res = milp(
        c=np.ones(K),
        constraints=LinearConstraint(np.array(rows), lb, ub),
        integrality=np.ones(K),
        bounds=Bounds(0, np.inf),
    )
    if res.status != 0 or res.x is None:
        return None
    return [int(round(x)) for x in res.x]


@dataclass(frozen=True)
class DisjointOptimum:
    num_chains: int | None  # optimum |K| of (10); None if (10) is infeasible
    groups: tuple[tuple[int, ...], ...]


def brute_force_disjoint_chains(cluster: Cluster, c: int, max_servers: int = 9) -> DisjointOptimum:
    """Exact (10) for required capacity c by enumerating all set partitions (servers may stay unused)."""
    J = cluster.num_servers
    if J > max_servers:
        raise ValueError(f"brute force is for tiny instances (J <= {max_servers}), got J={J}")
    L = cluster.service.num_blocks
    m = blocks_per_server(cluster, c)
    t = [sv.tau_c_s + sv.tau_p_s * mj for sv, mj in zip(cluster.servers, m)]
    target = cluster.arrival_rate_per_s / (cluster.rho_bar * c)
    best: list = [math.inf, ()]

    def rec(j: int, groups: list[list[int]]) -> None:
        if j == J:
            full = [g for g in groups if sum(m[i] for i in g) >= L]
            rate = sum(1.0 / sum(t[i] for i in g) for g in full)
            if rate >= target * (1 - 1e-12) and len(full) < best[0]:
                best[0], best[1] = len(full), tuple(tuple(g) for g in full)
            return
        rec(j + 1, groups)  # unused (or, equivalently, in a group that never completes)
        if m[j] == 0:
            return
        for g in groups:
            g.append(j)
            rec(j + 1, groups)
            g.pop()
        groups.append([j])
        rec(j + 1, groups)
        groups.pop()

    rec(0, [])
    if math.isinf(best[0]):
        return DisjointOptimum(None, ())
    return DisjointOptimum(int(best[0]), best[1])
