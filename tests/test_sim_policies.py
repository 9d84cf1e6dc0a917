"""The simulator with the core's dispatchers: JFFC against the exact CTMC (small K) and within the
Theorem 3.7 bounds on random instances; policies and baselines are deterministic for a seed."""

from __future__ import annotations

import numpy as np
import pytest

from netem.topology import synthetic_rtt_ms
from orchestrator.bounds import exact_ctmc_mean_response_time, theorem37_bounds
from orchestrator.model import BlockInterval, ChainSpec
from orchestrator.planner import plan
from orchestrator.sim.paper_setup import draw_paper_instance, to_cluster
from orchestrator.sim.policy_runs import (
    poisson_workload,
    simulate_chains,
    simulate_plan,
)


def _random_chains(rng: np.random.Generator, k: int) -> list[ChainSpec]:
    times = np.sort(rng.uniform(1.0, 6.0, k))
    caps = rng.integers(1, 6, k)
    return [ChainSpec((i,), (BlockInterval(0, 1),), int(c), float(t)) for i, (t, c) in enumerate(zip(times, caps))]


def _nu(chains) -> float:
    return sum(k.capacity / k.service_time_s for k in chains)


@pytest.mark.parametrize("seed", range(3))
def test_jffc_matches_exact_ctmc(seed):
    rng = np.random.default_rng(seed)
    chains = _random_chains(rng, 2)
    lam = 0.7 * _nu(chains)
    exact = exact_ctmc_mean_response_time(chains, lam)
    arr, sizes = poisson_workload(lam, 150_000, np.random.default_rng(100 + seed))
    res = simulate_chains(chains, arr, sizes, dispatch="jffc")
    assert res.mean_response_s == pytest.approx(exact, rel=0.03)


@pytest.mark.parametrize("seed", range(6))
def test_jffc_lies_between_theorem37_bounds(seed):
    rng = np.random.default_rng(1000 + seed)
    chains = _random_chains(rng, int(rng.integers(2, 6)))
    lam = float(rng.uniform(0.3, 0.85)) * _nu(chains)
    b = theorem37_bounds(chains, lam)
    arr, sizes = poisson_workload(lam, 60_000, np.random.default_rng(seed))
    sim = simulate_chains(chains, arr, sizes, dispatch="jffc").mean_response_s
    # Monte Carlo allowance: 60k jobs put the standard error of the mean near 1%; allow 4%.
    assert b.lower_s * 0.96 <= sim <= b.upper_s * 1.04, (b, sim)


@pytest.mark.parametrize("dispatch", ["jffc", "jsq", "jiq", "sed", "sa-jsq"])
def test_dispatch_policies_deterministic(dispatch):
    chains = _random_chains(np.random.default_rng(5), 4)
    lam = 0.8 * _nu(chains)
    arr, sizes = poisson_workload(lam, 3000, np.random.default_rng(1))
    a = simulate_chains(chains, arr, sizes, dispatch=dispatch, rng=np.random.default_rng(2))
    b = simulate_chains(chains, arr, sizes, dispatch=dispatch, rng=np.random.default_rng(2))
    assert np.array_equal(a.response_s, b.response_s)


def _paper_cluster(seed=0, n=10, eta=0.3):
    rng = np.random.default_rng(seed)
    return to_cluster(draw_paper_instance(synthetic_rtt_ms(40, rng), n, eta, rng))


@pytest.mark.parametrize("policy", ["proposed", "petals", "bprr"])
def test_paper_policies_run_and_are_deterministic(policy):
    cluster = _paper_cluster()
    p = plan(cluster, policy, c=7 if policy == "proposed" else None)
    arr, sizes = poisson_workload(cluster.arrival_rate_per_s, 800, np.random.default_rng(3))
    a = simulate_plan(p, cluster, arr, sizes, rng=np.random.default_rng(4))
    b = simulate_plan(p, cluster, arr, sizes, rng=np.random.default_rng(4))
    assert np.array_equal(a.response_s, b.response_s)
    assert a.mean_response_s >= a.mean_service_s > 0


def test_paper_instance_parameters():
    rng = np.random.default_rng(0)
    inst = draw_paper_instance(synthetic_rtt_ms(50, rng), 20, 0.2, rng)
    assert inst.is_high.sum() == 4
    assert set(inst.memory_gb) == {20.0, 40.0} and set(inst.tau_p_s) == {0.109, 0.175}
    assert np.allclose(inst.tau_c_s, 20 * (inst.rtt_s + 0.018))  # default: the model's tau_c (20 steps)
    literal = draw_paper_instance(
        synthetic_rtt_ms(50, np.random.default_rng(0)), 20, 0.2, np.random.default_rng(0), tau_c_reading="literal"
    )
    assert np.allclose(literal.tau_c_s - literal.rtt_s, 0.018)
    cluster = to_cluster(inst)
    assert cluster.service.num_blocks == 70 and cluster.arrival_rate_per_s == 0.2 and cluster.rho_bar == 0.7
    with pytest.raises(ValueError):
        draw_paper_instance(synthetic_rtt_ms(5, rng), 20, 0.2, rng)


def _max_overlap(starts: np.ndarray, ends: np.ndarray) -> int:
    events = sorted([(t, 1) for t in starts] + [(t, -1) for t in ends], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


@pytest.mark.parametrize("dispatch", ["jffc", "jsq", "sed"])
def test_capacity_respected_and_jffc_is_fifo(dispatch):
    chains = _random_chains(np.random.default_rng(11), 3)
    lam = 0.95 * _nu(chains)
    arr, sizes = poisson_workload(lam, 4000, np.random.default_rng(12))
    res = simulate_chains(chains, arr, sizes, dispatch=dispatch, rng=np.random.default_rng(13), warmup_fraction=0.0)
    start = arr + res.wait_s
    finish = arr + res.response_s
    assert np.all(res.wait_s >= -1e-12) and np.all(finish >= start)
    for k, chain in enumerate(chains):
        on_k = res.chain_id == k
        assert _max_overlap(start[on_k], finish[on_k]) <= chain.capacity
        # service time on chain k is size * T_k
        assert np.allclose((finish - start)[on_k], sizes[on_k] * chain.service_time_s)
    if dispatch == "jffc":  # central FIFO queue: jobs start in arrival order
        assert np.all(np.diff(start) >= -1e-9)
