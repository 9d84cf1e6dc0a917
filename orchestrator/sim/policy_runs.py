"""Glue between the core's planner and the engine: plan a cluster under a policy, then simulate it.

`simulate_plan` runs one plan on one workload. The dispatcher is the core's: JFFC (or another
dispatch policy of orchestrator.dispatch) over the plan's chains for "proposed"/"jffc-only", the
baseline's own per-request router for "petals"/"bprr" (orchestrator.planner.make_plan_dispatcher).
"""

from __future__ import annotations

import numpy as np

from orchestrator.planner import Plan, make_plan_dispatcher
from orchestrator.sim.engine import SimResult, job_sizes, poisson_arrivals_s, simulate

DEFAULT_WARMUP_FRACTION = 0.05


def poisson_workload(
    arrival_rate_per_s: float, n_jobs: int, rng: np.random.Generator, size_spec: str = "exp"
) -> tuple[np.ndarray, np.ndarray]:
    """Poisson arrivals and sizes of mean 1 (default Exp(1): the paper's section 4.1.1 workload;
    see engine.job_sizes for the other specs)."""
    arrivals = poisson_arrivals_s(arrival_rate_per_s, n_jobs, rng)
    return arrivals, job_sizes(size_spec, n_jobs, rng)


def simulate_plan(
    plan: Plan,
    cluster,
    arrivals_s: np.ndarray,
    sizes: np.ndarray,
    *,
    dispatch: str = "jffc",
    rng: np.random.Generator | None = None,
    warmup_fraction: float = DEFAULT_WARMUP_FRACTION,
) -> SimResult:
    dispatcher = make_plan_dispatcher(plan, cluster, rng if rng is not None else np.random.default_rng(0), dispatch)
    return simulate(dispatcher, arrivals_s, sizes, warmup_fraction=warmup_fraction)


def simulate_chains(
    chains,
    arrivals_s: np.ndarray,
    sizes: np.ndarray,
    *,
    dispatch: str = "jffc",
    rng: np.random.Generator | None = None,
    warmup_fraction: float = DEFAULT_WARMUP_FRACTION,
) -> SimResult:
    """Simulate a fixed set of chains (core ChainSpecs) under one of the core's dispatch policies."""
    from orchestrator.dispatch import make_dispatcher

    dispatcher = make_dispatcher(dispatch, chains, rng if rng is not None else np.random.default_rng(0))
    return simulate(dispatcher, arrivals_s, sizes, warmup_fraction=warmup_fraction)
