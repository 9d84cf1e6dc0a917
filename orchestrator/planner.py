"""The one entry point the CLI, the online service and the simulator call: ``plan``.

    plan(cluster, policy="proposed", c=None, tuning="lower") -> Plan
    make_plan_dispatcher(plan, cluster, rng=None, dispatch="jffc") -> Dispatcher

Policies come from the registry (orchestrator.policies: name -> placement, dispatcher), which the
simulator and the online service read too. For "petals" and "bprr" the Plan still lists the chains
GCA finds on their placement and the Theorem 3.7 bounds of JFFC over those chains, as a reference
of what the placement could support; ``c`` is None for PETALS and BPRR's target concurrency R for
BPRR. ``baseline`` (BaselineOptions) carries the baselines' optional knobs (the paper authors'
simulator choices); the Plan keeps it so that make_plan_dispatcher builds the matching router.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from orchestrator.baselines.options import BaselineOptions
from orchestrator.baselines.request_router import PerRequestRouter
from orchestrator.bounds import ResponseTimeBounds, theorem37_bounds
from orchestrator.dispatch import Dispatcher
from orchestrator.model import (
    ChainSpec,
    Cluster,
    InfeasibleClusterError,
    Placement,
    contended_chains,
    total_service_rate_per_s,
)
from orchestrator.policies import POLICY_NAMES, PlacementRequest, get_policy
from orchestrator.tuning import TUNINGS, TuningRow

POLICIES: tuple[str, ...] = POLICY_NAMES  # the registry's names (orchestrator.policies)


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


def plan(
    cluster: Cluster,
    policy: str = "proposed",
    c: int | None = None,
    tuning: str = "lower",
    baseline: BaselineOptions | None = None,
    leftover: bool = False,
) -> Plan:
    """Placement + chains + bounds for ``cluster`` under ``policy`` (see module docstring)."""
    spec = get_policy(policy)
    if tuning not in TUNINGS:
        raise ValueError(f"unknown tuning {tuning!r}; choose one of {TUNINGS}")
    opts = baseline or BaselineOptions()
    placed = spec.place(cluster, PlacementRequest(c if spec.tunes_c else None, tuning, leftover and spec.tunes_c, opts))
    p = _finish(
        cluster,
        policy,
        placed.c,
        placed.placement,
        placed.chains,
        placed.tuning,
        placed.table,
        opts if spec.per_request else BaselineOptions(),
    )
    return replace(p, leftover_servers=placed.leftover_servers)


def _finish(cluster, policy, c, placement, chains, tuning, table, baseline=BaselineOptions()) -> Plan:
    chains = contended_chains(cluster, chains)  # identity for the paper's servers
    if not chains:
        raise InfeasibleClusterError(
            f"{policy}: the placement forms no complete chain with a free cache slot; add servers or memory"
        )
    return Plan(
        policy=policy,
        c=c,
        placement=placement,
        chains=chains,
        total_rate_per_s=total_service_rate_per_s(chains),
        bounds=theorem37_bounds(chains, cluster.arrival_rate_per_s),
        unused_servers=tuple(placement.unused_servers()),
        tuning=tuning,
        table=table,
        baseline=baseline,
    )


def make_baseline_router(
    policy: str,
    cluster: Cluster,
    placement: Placement,
    rng: np.random.Generator | None = None,
    options: BaselineOptions | None = None,
) -> PerRequestRouter:
    """Per-request router for "petals" or "bprr" (a Dispatcher; ``route(chain_id)`` gives the
    ChainSpec of a Start). Both routers are deterministic."""
    spec = get_policy(policy)
    if not spec.per_request:
        raise ValueError(f"no per-request router for policy {policy!r} (use 'petals' or 'bprr')")
    return spec.dispatcher(cluster, placement, (), rng, baseline=options)


def make_plan_dispatcher(
    plan_: Plan, cluster: Cluster, rng: np.random.Generator | None = None, dispatch: str = "jffc"
) -> Dispatcher:
    """The dispatcher a policy runs with (the registry's): JFFC (or ``dispatch``) over the plan's chains
    for "proposed" and "jffc-only"; the per-request router for "petals" and "bprr"."""
    return get_policy(plan_.policy).dispatcher(cluster, plan_.placement, plan_.chains, rng, dispatch, plan_.baseline)
