"""One Monte Carlo run of each of the paper's section 4.1 figures, as pure functions.

Every `figN_run(rtt_ms, run, cfg)` draws its own cluster (section 4.1.1: orchestrator + J servers
at random RIPE Atlas anchors, a fraction eta high-performance) from a generator seeded by
(cfg.seed, figure, run, ...), calls only the core's algorithms (GBP-CR, GCA, tuning, bounds, ILP,
dispatchers, baselines), simulates with orchestrator.sim.engine, and returns plain JSON-able data.
`scripts/reproduce_paper.py` fans the runs out over processes and aggregates them.

Choices the paper leaves open (documented in docs/simulator.md and docs/results.md):
- Fig. 3/4/5 need more load than the default lambda = 0.2 to say anything: at lambda = 0.2 and
  c = 7 a single chain meets lambda / (rho_bar c), so every feasible placement has c K(c) = 7. Fig. 3
  is therefore drawn at several arrival rates; Figs. 4/5 use the placement GBP-CR (c = 7) makes
  when it may use every server (its stopping rule switched off by an unreachable target), and
  express load in percent of the total service rate of GCA's chains on it, as the paper does.
- Random feasible placements (Fig. 3): the servers in a uniformly random order, grouped greedily
  (each with m_j(c) blocks, eq. 8) into chains that cover all L blocks, until the scaled rate target
  of (10b) is met; orders that never meet it are redrawn (up to 20 x the requested count).
- Policies in a run share one workload (common random numbers): same arrivals and job sizes.
- tau_c: cfg.tau_c_reading ("model": 20 x (RTT + 18 ms), default; "literal": RTT + 18 ms), see
  paper_setup; cfg.authors switches in the authors' code's choices (authors_setup).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from orchestrator.baselines.options import BaselineOptions
from orchestrator.bounds import theorem37_bounds
from orchestrator.cache_gca import gca
from orchestrator.model import (
    InfeasibleClusterError,
    residual_slots,
    total_service_rate_per_s,
)
from orchestrator.placement_gbp_cr import blocks_per_server, gbp_cr
from orchestrator.planner import plan
from orchestrator.reference_optima import optimal_cache_allocation
from orchestrator.sim.authors_setup import (
    AUTHORS_JOBS_PER_RUN,
    AUTHORS_PETALS_CACHE_GB_PER_BLOCK,
    AUTHORS_PETALS_LOW_BLOCK_CAP,
    AuthorsChoices,
)
from orchestrator.sim.paper_setup import draw_paper_instance, to_cluster
from orchestrator.sim.policy_runs import (
    DEFAULT_WARMUP_FRACTION,
    poisson_workload,
    simulate_chains,
    simulate_plan,
)
from orchestrator.tuning import evaluate_c, tune_c

FIG_IDS = {"fig3": 3, "fig4": 4, "fig5": 5, "fig67": 6, "fig8": 8, "fig8x": 9, "leftover": 8}
DISPATCH_POLICIES = ("jffc", "jsq", "jiq", "sed", "sa-jsq")
FIG8_POLICIES = ("proposed", "petals", "bprr")
UNREACHABLE_RATE_PER_S = 1e9  # GBP-CR target that is never met: place on every server


@dataclass(frozen=True)
class PaperConfig:
    seed: int = 2026
    runs: int = 20
    num_servers: int = 20
    eta: float = 0.2
    arrival_rate_per_s: float = 0.2
    rho_bar: float = 0.7
    c_fixed: int = 7
    tau_c_reading: str = "model"
    authors: AuthorsChoices = AuthorsChoices()
    # Fig. 3
    fig3_servers: tuple[int, ...] = (20, 40)
    fig3_etas: tuple[float, ...] = (0.0, 0.2)
    fig3_rates_per_s: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.6, 2.0, 2.4)
    fig3_random_placements: int = 100
    # Fig. 4 / 5 (percent of GCA's total service rate)
    fig4_loads: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
    fig5_loads: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    fig5_jobs: int = 20000
    # Fig. 6 / 7
    fig67_rates_per_s: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0)
    fig67_jobs: int = 5000
    # Fig. 8
    fig8_servers: tuple[int, ...] = (10, 20, 30, 40)
    fig8_etas: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4)
    fig8_jobs: int = 5000
    # Fig. 8 beyond the paper: the J=20, eta=0.2 point at higher arrival rates
    fig8x_setting: tuple[int, float] = (20, 0.2)
    fig8x_rates_per_s: tuple[float, ...] = (0.5, 1.0)
    # Ablation of the authors' choices (Fig. 8 settings it runs at)
    ablation_settings: tuple[tuple[int, float], ...] = ((10, 0.2), (20, 0.2))

    @classmethod
    def quick(cls, seed: int = 2026) -> "PaperConfig":
        return cls(
            seed=seed,
            runs=3,
            fig3_random_placements=30,
            fig5_jobs=3000,
            fig67_jobs=1500,
            fig67_rates_per_s=(0.1, 0.2, 0.5, 1.0, 2.0),
            fig8_jobs=1500,
            fig5_loads=(0.1, 0.3, 0.5, 0.7, 0.9),
        )


def _rng(cfg: PaperConfig, fig: str, run: int, *extra: int) -> np.random.Generator:
    return np.random.default_rng([cfg.seed, FIG_IDS[fig], run, *extra])


def _instance(rtt_ms, cfg, rng, *, num_servers=None, eta=None, rate=None):
    return draw_paper_instance(
        rtt_ms,
        num_servers or cfg.num_servers,
        cfg.eta if eta is None else eta,
        rng,
        arrival_rate_per_s=rate or cfg.arrival_rate_per_s,
        rho_bar=cfg.rho_bar,
        tau_c_reading=cfg.tau_c_reading,
        authors=cfg.authors,
    )


def _cluster(rtt_ms, cfg, rng, *, num_servers=None, eta=None, rate=None):
    return to_cluster(_instance(rtt_ms, cfg, rng, num_servers=num_servers, eta=eta, rate=rate))


def baseline_options(authors: AuthorsChoices, is_high) -> BaselineOptions:
    """The baselines' knobs for the authors' choices that are on (authors_setup)."""
    return BaselineOptions(
        petals_max_blocks=tuple(None if h else AUTHORS_PETALS_LOW_BLOCK_CAP for h in is_high)
        if authors.petals_block_cap
        else None,
        petals_fixed_cache_per_block=AUTHORS_PETALS_CACHE_GB_PER_BLOCK if authors.petals_fixed_cache else None,
        bprr_wait="active-mean" if authors.bprr_active_wait else "order-statistics",
        commit_at_arrival=authors.commit_at_arrival,
    )


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


# ---------------------------------------------------------------- Fig. 3: GBP-CR vs random placements


def random_disjoint_chains_objective(cluster, c: int, rng: np.random.Generator) -> int | None:
    """c * (number of chains) of one random feasible solution of (10), or None if this random
    order never meets the rate target (see module docstring)."""
    L = cluster.service.num_blocks
    m = blocks_per_server(cluster, c)
    t = [sv.tau_c_s + sv.tau_p_s * mj for sv, mj in zip(cluster.servers, m)]
    target = cluster.arrival_rate_per_s / (cluster.rho_bar * c)
    order = [j for j in rng.permutation(len(m)) if m[j] > 0]
    covered, T, nu, chains = 0, 0.0, 0.0, 0
    for j in order:
        covered += m[j]
        T += t[j]
        if covered >= L:
            chains += 1
            nu += 1.0 / T
            if nu >= target * (1 - 1e-12):
                return c * chains
            covered, T = 0, 0.0
    return None


def fig3_run(rtt_ms, run: int, cfg: PaperConfig) -> dict:
    out = []
    for J, (ei, eta) in ((J, e) for J in cfg.fig3_servers for e in enumerate(cfg.fig3_etas)):
        base = _cluster(rtt_ms, cfg, _rng(cfg, "fig3", run, J, ei), num_servers=J, eta=eta)
        for rate in cfg.fig3_rates_per_s:
            cluster = replace(base, arrival_rate_per_s=rate)
            g = gbp_cr(cluster, cfg.c_fixed)
            gbp = cfg.c_fixed * g.num_chains if g.meets_target else None
            rng = _rng(cfg, "fig3", run, J, ei, int(rate * 1000))
            randoms: list[int] = []
            tries = 0
            while len(randoms) < cfg.fig3_random_placements and tries < 20 * cfg.fig3_random_placements:
                tries += 1
                v = random_disjoint_chains_objective(cluster, cfg.c_fixed, rng)
                if v is not None:
                    randoms.append(v)
            out.append({"J": J, "eta": eta, "rate": rate, "gbp_cr": gbp, "random": randoms})
    return {"run": run, "points": out}


# ---------------------------------------------------------------- Fig. 4 / 5: fixed GBP-CR placement


def _full_placement_chains(cluster, c: int):
    """GBP-CR with c on every server (target unreachable), then GCA: (gbp result, gca chains)."""
    g = gbp_cr(replace(cluster, arrival_rate_per_s=UNREACHABLE_RATE_PER_S), c)
    if g.num_chains == 0:
        raise InfeasibleClusterError(f"GBP-CR with c={c} forms no chain")
    return g, gca(cluster, g.placement).chains


def job_servers_for_rate(chains, required_rate_per_s: float) -> int | None:
    """Fewest job servers of `chains` (fastest first, as JFFC uses them) whose rates sum to the
    requirement; None if all of them fall short."""
    acc, n = 0.0, 0
    for k in sorted(chains, key=lambda k: k.service_time_s):
        mu = 1.0 / k.service_time_s
        need = required_rate_per_s - acc
        if need <= k.capacity * mu * (1 + 1e-12):
            return n + max(0, math.ceil(need / mu - 1e-9))
        acc += k.capacity * mu
        n += k.capacity
    return None


def fig4_run(rtt_ms, run: int, cfg: PaperConfig) -> dict:
    cluster = _cluster(rtt_ms, cfg, _rng(cfg, "fig4", run))
    g, chains = _full_placement_chains(cluster, cfg.c_fixed)
    nu = total_service_rate_per_s(chains)
    mu1 = max(1.0 / k.service_time_s for k in chains)
    slots = residual_slots(cluster, g.placement)
    points = []
    for load in cfg.fig4_loads:
        lam = load * nu
        required = lam / cfg.rho_bar
        prefix, k_chains = 0.0, None
        for idx, t in enumerate(g.chain_times_s):  # K(c), eq. (13), on the fixed placement
            prefix += 1.0 / t
            if prefix >= lam / (cfg.rho_bar * cfg.c_fixed) * (1 - 1e-12):
                k_chains = idx + 1
                break
        ilp = optimal_cache_allocation(replace(cluster, arrival_rate_per_s=lam), chains, slots)
        points.append(
            {
                "load": load,
                "rate": lam,
                "gca": job_servers_for_rate(chains, required),
                "cK": cfg.c_fixed * k_chains if k_chains is not None else None,
                "lower_bound": math.ceil(required / mu1 - 1e-9),
                "ilp": sum(ilp) if ilp is not None else None,
            }
        )
    return {"run": run, "total_rate": nu, "num_chains": len(chains), "points": points}


def fig5_run(rtt_ms, run: int, cfg: PaperConfig) -> dict:
    cluster = _cluster(rtt_ms, cfg, _rng(cfg, "fig5", run))
    g, chains = _full_placement_chains(cluster, cfg.c_fixed)
    nu = total_service_rate_per_s(chains)
    points = []
    for li, load in enumerate(cfg.fig5_loads):
        lam = load * nu
        arrivals, sizes = poisson_workload(lam, cfg.fig5_jobs, _rng(cfg, "fig5", run, li))
        b = theorem37_bounds(chains, lam)
        row = {"load": load, "rate": lam, "lower": _finite(b.lower_s), "upper": _finite(b.upper_s)}
        for pi, pol in enumerate(DISPATCH_POLICIES):
            res = simulate_chains(chains, arrivals, sizes, dispatch=pol, rng=_rng(cfg, "fig5", run, li, 100 + pi))
            row[pol] = res.mean_response_s
            if pol == "jffc":
                row["jffc_service_share"] = res.mean_service_s / res.mean_response_s
        points.append(row)
    return {"run": run, "total_rate": nu, "points": points}


# ---------------------------------------------------------------- Fig. 6 / 7: tuning c


def fig67_run(rtt_ms, run: int, cfg: PaperConfig) -> dict:
    base = _cluster(rtt_ms, cfg, _rng(cfg, "fig67", run))
    per_rate = []
    for ri, rate in enumerate(cfg.fig67_rates_per_s):
        cluster = replace(base, arrival_rate_per_s=rate)
        _, table = tune_c(cluster, "lower")
        arrivals, sizes = poisson_workload(rate, cfg.fig67_jobs, _rng(cfg, "fig67", run, ri))
        sim_by_placement: dict = {}
        cache: dict = {}
        rows = []
        for row in table:
            cand = evaluate_c(cluster, row.c, cache)
            sim = None
            if cand is not None and row.total_rate_per_s > rate:
                key = cand.gbp.placement.key()
                if key not in sim_by_placement:
                    sim_by_placement[key] = simulate_chains(
                        cand.gca.chains, arrivals, sizes, rng=_rng(cfg, "fig67", run, ri, row.c)
                    ).mean_response_s
                sim = sim_by_placement[key]
            rows.append(
                {
                    "c": row.c,
                    "surrogate_s": _finite(row.surrogate / rate),
                    "lower_s": _finite(row.lower_s),
                    "upper_s": _finite(row.upper_s),
                    "sim_s": _finite(sim) if sim is not None else None,
                }
            )
        per_rate.append({"rate": rate, "rows": rows})
    return {"run": run, "rates": per_rate}


# ---------------------------------------------------------------- Fig. 8: overall comparison


def fig8_run(rtt_ms, run: int, cfg: PaperConfig, num_servers: int, eta: float, rate: float | None = None) -> dict:
    """One run of Fig. 8 at (J, eta); `rate` overrides lambda (the "fig8x" load sensitivity)."""
    inst = _instance(
        rtt_ms, cfg, _rng(cfg, "fig8", run, num_servers, int(eta * 100)), num_servers=num_servers, eta=eta, rate=rate
    )
    cluster = to_cluster(inst)
    n_jobs, warmup = (AUTHORS_JOBS_PER_RUN, 0.0) if cfg.authors.short_runs else (cfg.fig8_jobs, DEFAULT_WARMUP_FRACTION)
    arrivals, sizes = poisson_workload(
        cluster.arrival_rate_per_s, n_jobs, _rng(cfg, "fig8", run, num_servers, int(eta * 100), 1)
    )
    opts = baseline_options(cfg.authors, inst.is_high)
    out = {"run": run, "J": num_servers, "eta": eta, "rate": cluster.arrival_rate_per_s, "n_jobs": n_jobs}
    for pol, c in (("proposed", cfg.c_fixed), ("petals", None), ("bprr", None), ("proposed-c*", None)):
        try:
            p = plan(cluster, "proposed" if pol == "proposed-c*" else pol, c=c, baseline=opts)
        except InfeasibleClusterError as e:
            out[pol] = {"feasible": False, "reason": str(e)}
            continue
        res = simulate_plan(
            p,
            cluster,
            arrivals,
            sizes,
            rng=_rng(cfg, "fig8", run, num_servers, int(eta * 100), 2),
            warmup_fraction=warmup,
        )
        out[pol] = {
            "feasible": True,
            "mean_response_s": res.mean_response_s,
            "mean_wait_s": res.mean_wait_s,
            "mean_service_s": res.mean_service_s,
            "c": p.c,
            "total_rate": p.total_rate_per_s,
        }
    return out


# ---------------------------------------------------------------- beyond the paper: idle servers

LEFTOVER_VARIANTS = (("c=7", 7, False), ("c=7 + leftover", 7, True), ("c*", None, False), ("c* + leftover", None, True))


def leftover_run(rtt_ms, run: int, cfg: PaperConfig, num_servers: int, eta: float) -> dict:
    """The proposed stack with and without blocks for GBP-CR's idle servers (placement_leftover),
    on Fig. 8's instances and workload (same seeds as fig8_run)."""
    cluster = _cluster(
        rtt_ms, cfg, _rng(cfg, "fig8", run, num_servers, int(eta * 100)), num_servers=num_servers, eta=eta
    )
    arrivals, sizes = poisson_workload(
        cluster.arrival_rate_per_s, cfg.fig8_jobs, _rng(cfg, "fig8", run, num_servers, int(eta * 100), 1)
    )
    out = {"run": run, "J": num_servers, "eta": eta, "rate": cluster.arrival_rate_per_s}
    for name, c, leftover in LEFTOVER_VARIANTS:
        try:
            p = plan(cluster, "proposed", c=c, leftover=leftover)
        except InfeasibleClusterError as e:
            out[name] = {"feasible": False, "reason": str(e)}
            continue
        res = simulate_plan(p, cluster, arrivals, sizes, rng=_rng(cfg, "fig8", run, num_servers, int(eta * 100), 2))
        out[name] = {
            "feasible": True,
            "mean_response_s": res.mean_response_s,
            "total_rate": p.total_rate_per_s,
            "idle": len(p.unused_servers),
            "placed": len(p.leftover_servers),
            "c": p.c,
        }
    return out
