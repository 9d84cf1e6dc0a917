"""The one entry point the CLI, the online service and the simulator call: ``plan``.

    plan(cluster, policy="proposed", c=None, tuning="lower") -> Plan
    make_plan_dispatcher(plan, cluster, rng=None, dispatch="jffc") -> Dispatcher

Policies:
- "proposed": GBP-CR (Alg. 1) with c (tuned by brute force when None, §3.1.3/§3.2.3) + GCA
  (Alg. 2); dispatched by JFFC (Alg. 3) or any policy of orchestrator.dispatch.
  With ``leftover=True`` the servers GBP-CR leaves idle get blocks where GCA is tightest, kept
  only if that lowers neither nu nor raises the Theorem 3.7 lower bound (placement_leftover).
- "jffc-only": whole model on every server that can hold it, JFFC (§4.2.3).
- "petals", "bprr": the baselines' placements; they route per request (make_baseline_router).
  Their Plan still lists the chains GCA finds on their placement and the Theorem 3.7 bounds of
  JFFC over those chains, as a reference of what the placement could support; ``c`` is None for
  PETALS and BPRR's target concurrency R for BPRR. ``baseline`` (BaselineOptions) carries the
  baselines' optional knobs (the paper authors' simulator choices); the Plan keeps it so that
  make_plan_dispatcher builds the matching router.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from orchestrator.baselines.bprr import BprrRouter, bprr_placement, bprr_target_concurrency
from orchestrator.baselines.options import BaselineOptions
from orchestrator.baselines.jffc_only import jffc_only_chains, jffc_only_placement
from orchestrator.baselines.petals import PetalsRouter, petals_placement
from orchestrator.baselines.request_router import PerRequestRouter
from orchestrator.bounds import ResponseTimeBounds, theorem37_bounds
from orchestrator.cache_gca import gca
from orchestrator.dispatch import Dispatcher, make_dispatcher
from orchestrator.model import ChainSpec, Cluster, InfeasibleClusterError, Placement, total_service_rate_per_s
from orchestrator.placement_gbp_cr import max_capacity
from orchestrator.placement_leftover import place_leftover
from orchestrator.tuning import TUNINGS, TuningRow, evaluate_c, tune_c

POLICIES: tuple[str, ...] = ("proposed", "petals", "bprr", "jffc-only")


@dataclass(frozen=True)
class Plan:
    policy: str
    c: int | None
    placement: Placement
    chains: tuple[ChainSpec, ...]  # sorted by service time (GCA order), capacities >= 1
    total_rate_per_s: float  # nu (eq. 4)
    bounds: ResponseTimeBounds  # Theorem 3.7, JFFC over ``chains``
    unused_servers: tuple[int, ...]
    tuning: str | None = None
    table: tuple[TuningRow, ...] = ()
    baseline: BaselineOptions = BaselineOptions()
    leftover_servers: tuple[int, ...] = ()  # idle servers the leftover step gave blocks ("proposed", leftover=True)


def plan(cluster: Cluster, policy: str = "proposed", c: int | None = None, tuning: str = "lower",
         baseline: BaselineOptions | None = None, leftover: bool = False) -> Plan:
    """Placement + chains + bounds for ``cluster`` under ``policy`` (see module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    if tuning not in TUNINGS:
        raise ValueError(f"unknown tuning {tuning!r}; choose one of {TUNINGS}")
    if policy == "proposed":
        if c is None:
            cand, table = tune_c(cluster, tuning)
            table = tuple(table)
        else:
            if c < 1:
                raise ValueError(f"c must be >= 1, got {c}")
            cand = evaluate_c(cluster, c)
            if cand is None:
                raise InfeasibleClusterError(f"with c={c} GBP-CR forms no complete chain (c_max = {max_capacity(cluster)}); "
                                             "lower c, or add servers or memory")
            table = (cand.row,)
        placement, chains, placed = cand.gbp.placement, cand.gca.chains, ()
        if leftover:
            lo = place_leftover(cluster, placement, cand.row.c, cand.gca)
            placement, chains, placed = lo.placement, lo.gca.chains, lo.placed
        p = _finish(cluster, policy, cand.row.c, placement, chains, tuning if c is None else None, table)
        return replace(p, leftover_servers=placed)
    if policy == "jffc-only":
        placement = jffc_only_placement(cluster)
        return _finish(cluster, policy, None, placement, tuple(jffc_only_chains(cluster, placement)), None, ())
    opts = baseline or BaselineOptions()
    if policy == "petals":
        placement = petals_placement(cluster, max_blocks=opts.petals_max_blocks)
        return _finish(cluster, policy, None, placement, gca(cluster, placement).chains, None, (), opts)
    r = bprr_target_concurrency(cluster)
    placement = bprr_placement(cluster, r)
    return _finish(cluster, policy, r, placement, gca(cluster, placement).chains, None, (), opts)


def _finish(cluster, policy, c, placement, chains, tuning, table, baseline=BaselineOptions()) -> Plan:
    chains = tuple(chains)
    if not chains:
        raise InfeasibleClusterError(f"{policy}: the placement forms no complete chain with a free cache slot; "
                                     "add servers or memory")
    return Plan(policy=policy, c=c, placement=placement, chains=chains,
                total_rate_per_s=total_service_rate_per_s(chains),
                bounds=theorem37_bounds(chains, cluster.arrival_rate_per_s),
                unused_servers=tuple(placement.unused_servers()), tuning=tuning, table=table, baseline=baseline)


def make_baseline_router(policy: str, cluster: Cluster, placement: Placement,
                         rng: np.random.Generator | None = None,
                         options: BaselineOptions | None = None) -> PerRequestRouter:
    """Per-request router for "petals" or "bprr" (a Dispatcher; ``route(chain_id)`` gives the
    ChainSpec of a Start). ``rng`` is accepted for a uniform signature; both routers are
    deterministic."""
    o = options or BaselineOptions()
    if policy == "petals":
        return PetalsRouter(cluster, placement, fixed_cache_per_block=o.petals_fixed_cache_per_block,
                            commit_at_arrival=o.commit_at_arrival)
    if policy == "bprr":
        return BprrRouter(cluster, placement, wait=o.bprr_wait, commit_at_arrival=o.commit_at_arrival)
    raise ValueError(f"no per-request router for policy {policy!r} (use 'petals' or 'bprr')")


def make_plan_dispatcher(plan_: Plan, cluster: Cluster, rng: np.random.Generator | None = None,
                         dispatch: str = "jffc") -> Dispatcher:
    """The dispatcher a policy runs with: JFFC (or ``dispatch``) over the plan's chains for
    "proposed" and "jffc-only"; the per-request router for "petals" and "bprr"."""
    if plan_.policy in ("petals", "bprr"):
        return make_baseline_router(plan_.policy, cluster, plan_.placement, rng, plan_.baseline)
    return make_dispatcher(dispatch, plan_.chains, rng)
