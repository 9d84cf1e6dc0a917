"""Blocks for the servers GBP-CR leaves idle (issue 12; beyond the paper).

GBP-CR (Alg. 1) places disjoint chains and stops once their scaled rate meets lambda / (rho_bar c);
servers after the stop, or that cannot complete one more chain, get no blocks. GCA can only compose
chains from servers that hold blocks, so donated memory sits unused. Here each idle server (in
GBP-CR's order, fastest per block first, eq. 9) gets m_j(c) blocks (eq. 8; m_j(1) if m_j(c) = 0)
on the window where GCA's allocation is tightest: per block b, the spare sessions
s_b = sum over servers j holding b of (slots j has left after GCA) / m_j; the window whose sorted
spare vector is lexicographically smallest (a min-cut proxy: chains through the window are
limited by its weakest blocks; ties to the leftmost). The server keeps the range only if GCA on the
new placement has a total service rate nu (eq. 4) no lower and a Theorem 3.7 lower bound on JFFC's
mean response time no higher than before; otherwise it stays idle. So by construction the rate
GBP-CR + GCA achieve never drops (tests/test_leftover_placement.py checks it on random clusters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from orchestrator.bounds import theorem37_bounds
from orchestrator.cache_gca import GcaResult, gca
from orchestrator.model import (
    BlockInterval,
    Cluster,
    Placement,
    contended_chains,
    total_service_rate_per_s,
)
from orchestrator.placement_gbp_cr import blocks_per_server
from orchestrator.tuning import TUNINGS, TuningRow, candidates


@dataclass(frozen=True)
class LeftoverResult:
    placement: Placement
    gca: GcaResult
    placed: tuple[int, ...]  # idle servers that got (and kept) a range
    rejected: tuple[int, ...]  # idle servers tried and left idle (their range lowered nu or raised the bound)


def _spare_sessions(cluster: Cluster, placement: Placement, residual_after: tuple[int, ...]) -> np.ndarray:
    L = cluster.service.num_blocks
    spare = np.zeros(L)
    for j, r in enumerate(placement.ranges):
        if r is not None:
            spare[r.start : r.end] += residual_after[j] / r.num_blocks
    return spare


def _tightest_window(spare: np.ndarray, m: int) -> int:
    L = len(spare)
    return min(range(L - m + 1), key=lambda a: (tuple(np.sort(spare[a : a + m])), a))


def place_leftover(cluster: Cluster, placement: Placement, c: int, base: GcaResult | None = None) -> LeftoverResult:
    """Ranges for the servers without one in ``placement`` (GBP-CR's for capacity requirement c);
    see the module docstring. ``base``: GCA on ``placement`` if the caller has it."""
    cur = base or gca(cluster, placement)
    lam = cluster.arrival_rate_per_s
    rate = total_service_rate_per_s(cur.chains)
    bound = theorem37_bounds(cur.chains, lam).lower_s if cur.chains else float("inf")
    m_c, m_1 = blocks_per_server(cluster, c), blocks_per_server(cluster, 1)
    t = [sv.tau_c_s + sv.tau_p_s * max(m, 1) for sv, m in zip(cluster.servers, m_c)]
    idle = [j for j in placement.unused_servers() if (m_c[j] or m_1[j]) > 0]
    idle.sort(key=lambda j: (t[j] / max(m_c[j], 1) if m_c[j] else t[j] / m_1[j], j))
    ranges = list(placement.ranges)
    placed, rejected = [], []
    for j in idle:
        m = m_c[j] or m_1[j]
        start = _tightest_window(_spare_sessions(cluster, Placement(tuple(ranges)), cur.residual_slots_after), m)
        trial = list(ranges)
        trial[j] = BlockInterval(start, start + m)
        trial_placement = Placement(tuple(trial))
        res = gca(cluster, trial_placement)
        new_rate = total_service_rate_per_s(res.chains)
        new_bound = theorem37_bounds(res.chains, lam).lower_s if res.chains else float("inf")
        # keep only what does not lower nu nor raise the lower bound (1e-12: float noise of equal plans)
        if new_rate >= rate * (1 - 1e-12) and new_bound <= bound * (1 + 1e-12):
            ranges, cur, rate, bound = trial, res, new_rate, new_bound
            placed.append(j)
        else:
            rejected.append(j)
    return LeftoverResult(Placement(tuple(ranges)), cur, tuple(placed), tuple(rejected))


# Two c whose tuning objective differs by less than this (relative) are a tie. Why 1 %: the bounds are
# computed from fitted service times whose error against the live swarm is ~10 % (the model check),
# and on a lightly loaded cluster the Theorem 3.7 bound is the fastest chains' service time for every
# c that keeps them whole: c = 1 and c = 5 differed by 1.6e-5 relative in a Table 1 plan (docs/results.md).
TIE_REL = 0.01


@dataclass(frozen=True)
class LeftoverChoice:
    """The tuned c, its installed plan (GBP-CR + leftover + GCA), the tuning objective of c (§3.2.3:
    GBP-CR + GCA's, as ``tune_c`` ranks it) and the installed plan's total service rate nu (eq. 4)."""

    c: int
    result: LeftoverResult
    objective: float
    rate_per_s: float


def tune_c_with_leftover(
    cluster: Cluster, tuning: str = "lower", tie_rel: float = TIE_REL
) -> tuple[LeftoverChoice, list[TuningRow]]:
    """c* when the leftover step runs (beyond the paper): c ranked by the paper's objective, as
    ``tune_c`` does, but the c whose objective is within ``tie_rel`` of the best are a tie, won by the
    installed plan (after the leftover step) with the larger nu, then the smaller c. Why: tied
    objectives predict the same mean response at the planned lambda, while the leftover step can give
    one c's plan many more sessions than another's (idle servers join chains only for some c), and
    the larger nu has that headroom for what the planned lambda leaves out (the trace's bursts, a
    lambda estimated low). Why not rank by the installed plan's bound: in the simulator on the paper's
    Fig. 8 instances that chose a c with a lower bound but 40 % less nu, 7 % faster under Poisson
    arrivals and up to 2.3x slower under the Azure trace's (docs/results.md).
    Returns the choice and the per-c table, as ``tune_c`` does."""
    if tuning not in TUNINGS:
        raise ValueError(f"tuning must be one of {TUNINGS}, got {tuning!r}")
    if not tie_rel >= 0:
        raise ValueError(f"tie_rel must be >= 0, got {tie_rel}")
    cands = candidates(cluster)
    objective = [cand.row.objective(tuning) for cand in cands]
    best = min(objective)
    # every c ties when all are infinite (an overloaded cluster): the widest plan wins, as in tune_c
    tied = [i for i, o in enumerate(objective) if not math.isfinite(best) or o <= best * (1 + tie_rel)]
    seen: dict = {}
    options: list[LeftoverChoice] = []
    for i in tied:
        cand = cands[i]
        # the leftover step depends on c through GBP-CR's placement and m_j(c) of the idle servers
        key = (cand.gbp.placement.key(), tuple(blocks_per_server(cluster, cand.row.c)))
        if key not in seen:
            res = place_leftover(cluster, cand.gbp.placement, cand.row.c, cand.gca)
            seen[key] = (res, total_service_rate_per_s(contended_chains(cluster, res.gca.chains)))
        res, rate = seen[key]
        options.append(LeftoverChoice(cand.row.c, res, objective[i], rate))
    return max(options, key=lambda o: (o.rate_per_s, -o.c)), [cand.row for cand in cands]
