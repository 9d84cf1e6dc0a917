"""The policy registry: name -> (placement, dispatcher). The planner, the simulator, the online
service and the experiment read policies from here and nowhere else.

- "proposed": GBP-CR (Alg. 1) with c (tuned by brute force when None, §3.1.3/§3.2.3) + GCA
  (Alg. 2); dispatched by JFFC (Alg. 3) or any chain dispatcher of orchestrator.dispatch.
  With ``leftover`` the servers GBP-CR leaves idle get blocks where GCA is tightest
  (orchestrator.placement_leftover).
- "jffc-only": whole model on every server that can hold it, JFFC (§4.2.3).
- "petals", "bprr": the baselines' placements, routed per request by the baseline's router
  (``per_request``). The chains GCA finds on their placement are kept as a reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from orchestrator.baselines.bprr import (
    BprrRouter,
    bprr_placement,
    bprr_target_concurrency,
)
from orchestrator.baselines.jffc_only import jffc_only_chains, jffc_only_placement
from orchestrator.baselines.options import BaselineOptions
from orchestrator.baselines.petals import PetalsRouter, petals_placement
from orchestrator.cache_gca import gca
from orchestrator.dispatch import Dispatcher, QueueOrder, make_dispatcher
from orchestrator.model import ChainSpec, Cluster, InfeasibleClusterError, Placement
from orchestrator.placement_gbp_cr import max_capacity
from orchestrator.placement_leftover import place_leftover, tune_c_with_leftover
from orchestrator.tuning import TuningRow, evaluate_c, tune_c


@dataclass(frozen=True)
class PlacementRequest:
    c: int | None = None  # proposed: fixed c (None: tuned)
    tuning: str = "lower"
    leftover: bool = False
    baseline: BaselineOptions = BaselineOptions()


@dataclass(frozen=True)
class Placed:
    placement: Placement
    chains: tuple[ChainSpec, ...]
    c: int | None
    tuning: str | None = None
    table: tuple[TuningRow, ...] = ()
    leftover_servers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Policy:
    name: str
    place: Callable[[Cluster, PlacementRequest], Placed]
    per_request: bool  # routes each session with the baseline's router instead of dispatching over chains
    tunes_c: bool = False  # takes --c / --tuning

    def dispatcher(
        self,
        cluster: Cluster,
        placement: Placement,
        chains,
        rng: np.random.Generator | None = None,
        dispatch: str = "jffc",
        baseline: BaselineOptions | None = None,
        order: QueueOrder | None = None,
    ) -> Dispatcher:
        """The dispatcher this policy runs with: ``dispatch`` over ``chains``, or the per-request router
        over ``placement``."""
        if not self.per_request:
            return make_dispatcher(dispatch, chains, rng, order)
        o = baseline or BaselineOptions()
        if self.name == "petals":
            return PetalsRouter(
                cluster,
                placement,
                fixed_cache_per_block=o.petals_fixed_cache_per_block,
                commit_at_arrival=o.commit_at_arrival,
            )
        return BprrRouter(cluster, placement, wait=o.bprr_wait, commit_at_arrival=o.commit_at_arrival)


def _place_proposed(cluster: Cluster, req: PlacementRequest) -> Placed:
    if req.c is None and req.leftover:
        # ties of the objective go to the widest plan after the leftover step (orchestrator.placement_leftover)
        choice, rows = tune_c_with_leftover(cluster, req.tuning)
        lo = choice.result
        return Placed(lo.placement, tuple(lo.gca.chains), choice.c, req.tuning, tuple(rows), lo.placed)
    if req.c is None:
        cand, table = tune_c(cluster, req.tuning)
        table = tuple(table)
    else:
        if req.c < 1:
            raise ValueError(f"c must be >= 1, got {req.c}")
        cand = evaluate_c(cluster, req.c)
        if cand is None:
            raise InfeasibleClusterError(
                f"with c={req.c} GBP-CR forms no complete chain (c_max = {max_capacity(cluster)}); "
                "lower c, or add servers or memory"
            )
        table = (cand.row,)
    placement, chains, placed = cand.gbp.placement, cand.gca.chains, ()
    if req.leftover:
        lo = place_leftover(cluster, placement, cand.row.c, cand.gca)
        placement, chains, placed = lo.placement, lo.gca.chains, lo.placed
    return Placed(placement, tuple(chains), cand.row.c, req.tuning if req.c is None else None, table, placed)


def _place_jffc_only(cluster: Cluster, req: PlacementRequest) -> Placed:
    placement = jffc_only_placement(cluster)
    return Placed(placement, tuple(jffc_only_chains(cluster, placement)), None)


def _place_petals(cluster: Cluster, req: PlacementRequest) -> Placed:
    placement = petals_placement(cluster, max_blocks=req.baseline.petals_max_blocks)
    return Placed(placement, tuple(gca(cluster, placement).chains), None)


def _place_bprr(cluster: Cluster, req: PlacementRequest) -> Placed:
    r = bprr_target_concurrency(cluster)
    placement = bprr_placement(cluster, r)
    return Placed(placement, tuple(gca(cluster, placement).chains), r)


REGISTRY: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("proposed", _place_proposed, per_request=False, tunes_c=True),
        Policy("petals", _place_petals, per_request=True),
        Policy("bprr", _place_bprr, per_request=True),
        Policy("jffc-only", _place_jffc_only, per_request=False),
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(REGISTRY)


def get_policy(name: str) -> Policy:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
