"""c* tuning (§3.1.3 eq. 13-14 and §3.2.3): brute force over c in [1, c_max].

Objectives per c:
- ``surrogate``: c K(c) (eq. 14), K(c) from GBP-CR (eq. 13); infinite when GBP-CR cannot reach
  lambda / (rho_bar c) with all servers;
- ``lower`` / ``upper``: the Theorem 3.7 lower / upper bound on JFFC's mean response time for the
  chains GCA builds on GBP-CR's placement for that c (infinite when lambda >= nu).
Default ``lower``, as §4.1.2 recommends. GCA runs once per distinct placement (many c share one).
Ties go to the smaller c; if every c is infinite under the objective, the c with the largest total
service rate nu (after GCA) is chosen, so an overloaded cluster still gets its best plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

from orchestrator.bounds import theorem37_bounds
from orchestrator.cache_gca import GcaResult, gca
from orchestrator.model import (
    Cluster,
    InfeasibleClusterError,
    contended_chains,
    total_service_rate_per_s,
)
from orchestrator.placement_gbp_cr import GbpCrResult, GbpCrSweep, max_capacity

Tuning = Literal["lower", "upper", "surrogate"]
TUNINGS: tuple[str, ...] = ("lower", "upper", "surrogate")


@dataclass(frozen=True)
class TuningRow:
    """One row of the per-c table."""

    c: int
    gbp_chains: int  # complete disjoint chains built by GBP-CR (K(c) when meets_target)
    meets_target: bool
    surrogate: float  # c K(c), inf when the target is not met
    gca_chains: int
    total_rate_per_s: float  # nu after GCA (eq. 4)
    lower_s: float
    upper_s: float

    def objective(self, tuning: str) -> float:
        return {"lower": self.lower_s, "upper": self.upper_s, "surrogate": self.surrogate}[tuning]


@dataclass(frozen=True)
class CandidatePlan:
    row: TuningRow
    gbp: GbpCrResult
    gca: GcaResult


def evaluate_c(
    cluster: Cluster, c: int, cache: dict | None = None, sweep: GbpCrSweep | None = None
) -> CandidatePlan | None:
    """GBP-CR + GCA + bounds for one c; None if GBP-CR forms no complete chain. ``cache`` (GCA
    result per distinct placement, keyed by the placement's value) and ``sweep`` (GbpCrSweep of the
    cluster) are for callers trying many c."""
    g = (sweep or GbpCrSweep(cluster))(c)
    if g.num_chains == 0:
        return None
    key = g.placement.key()
    if cache is not None and key in cache:
        gc, rate, b = cache[key]
    else:
        gc, rate, b = _gca_of(cluster, g)
        if cache is not None:
            cache[key] = (gc, rate, b)
    return _candidate(c, g, gc, rate, b)


def _gca_of(cluster: Cluster, g: GbpCrResult):
    gc = gca(cluster, g.placement)
    gc = replace(gc, chains=contended_chains(cluster, gc.chains))  # identity for the paper's servers
    return gc, total_service_rate_per_s(gc.chains), theorem37_bounds(gc.chains, cluster.arrival_rate_per_s)


def _candidate(c: int, g: GbpCrResult, gc: GcaResult, rate: float, b) -> CandidatePlan:
    row = TuningRow(
        c=c,
        gbp_chains=g.num_chains,
        meets_target=g.meets_target,
        surrogate=c * g.num_chains if g.meets_target else math.inf,
        gca_chains=len(gc.chains),
        total_rate_per_s=rate,
        lower_s=b.lower_s,
        upper_s=b.upper_s,
    )
    return CandidatePlan(row=row, gbp=g, gca=gc)


def iter_candidates(cluster: Cluster, c_max: int | None = None) -> Iterator[CandidatePlan]:
    """GBP-CR + GCA + bounds for every c in [1, c_max] (default max_capacity) that forms a complete
    chain, in c order, one at a time. GCA runs once per distinct placement: the sweep hands the c that
    share one the same object, and they come one after another (GbpCrSweep), so the last one is all
    that needs remembering. Nothing of a c is kept once the caller drops it: at J = 10^6 the c_max
    candidates' placements kept together took gigabytes."""
    hi = max_capacity(cluster) if c_max is None else min(c_max, max_capacity(cluster))
    sweep = GbpCrSweep(cluster)
    last = None  # (placement object, its GCA result, nu, bounds)
    for c in range(1, hi + 1):
        g = sweep(c)
        if g.num_chains == 0:
            continue
        if last is None or last[0] is not g.placement:
            last = (g.placement, *_gca_of(cluster, g))
        yield _candidate(c, g, *last[1:])


def _none_formed(cluster: Cluster, c_max: int | None) -> InfeasibleClusterError:
    hi = max_capacity(cluster) if c_max is None else min(c_max, max_capacity(cluster))
    s = cluster.service
    return InfeasibleClusterError(
        f"no complete chain for any c in [1, {hi}]: the servers cannot hold the model's "
        f"{s.num_blocks} blocks of size {s.block_size:.6g} plus one cache slot each; "
        f"add servers or memory"
    )


def candidates(cluster: Cluster, c_max: int | None = None) -> list[CandidatePlan]:
    """`iter_candidates` as a list; InfeasibleClusterError if no c forms a complete chain."""
    out = list(iter_candidates(cluster, c_max))
    if not out:
        raise _none_formed(cluster, c_max)
    return out


def tune_c(cluster: Cluster, tuning: str = "lower", c_max: int | None = None) -> tuple[CandidatePlan, list[TuningRow]]:
    """Brute-force c* (eq. 14 / §3.2.3). Returns the chosen candidate and the whole table. Keeps only the
    best candidate so far and the table's rows."""
    if tuning not in TUNINGS:
        raise ValueError(f"tuning must be one of {TUNINGS}, got {tuning!r}")
    best, rows = None, []
    for cand in iter_candidates(cluster, c_max):
        rows.append(cand.row)
        if best is None or _better(cand.row, best.row, tuning):
            best = cand
    if best is None:
        raise _none_formed(cluster, c_max)
    return best, rows


def _better(a: TuningRow, b: TuningRow, tuning: str) -> bool:
    va, vb = a.objective(tuning), b.objective(tuning)
    if math.isfinite(va) or math.isfinite(vb):
        return va < vb
    return a.total_rate_per_s > b.total_rate_per_s
