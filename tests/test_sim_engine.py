"""The simulator engine against closed forms, with a central-queue test double (no core needed)."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import pytest

from orchestrator.sim.engine import (
    SimulationError,
    exp_job_sizes,
    poisson_arrivals_s,
    simulate,
)


@dataclass(frozen=True)
class _Start:
    job_id: int
    chain_id: int
    service_time_s: float


class _CentralQueue:
    """Test double: chains (service time, capacity); a job takes the fastest chain with a free slot,
    else waits in a FIFO queue (so identical chains = M/M/C)."""

    name = "test-central-queue"

    def __init__(self, chains: list[tuple[float, int]]):
        self.chains = sorted(chains)
        self.busy = [0] * len(chains)
        self.where: dict[int, int] = {}
        self.queue: deque[int] = deque()

    def _start(self, job_id: int, k: int) -> _Start:
        self.busy[k] += 1
        self.where[job_id] = k
        return _Start(job_id, k, self.chains[k][0])

    def on_arrival(self, job_id):
        for k, (_, cap) in enumerate(self.chains):
            if self.busy[k] < cap:
                return [self._start(job_id, k)]
        self.queue.append(job_id)
        return []

    def on_completion(self, job_id):
        k = self.where.pop(job_id)
        self.busy[k] -= 1
        if self.queue:
            return [self._start(self.queue.popleft(), k)]
        return []

    @property
    def queue_length(self):
        return len(self.queue)


def erlang_c_mean_response_s(lam: float, mu: float, c: int) -> float:
    a = lam / mu
    rho = a / c
    terms = sum(a**k / math.factorial(k) for k in range(c))
    last = a**c / math.factorial(c) / (1 - rho)
    p_wait = last / (terms + last)
    return p_wait / (c * mu - lam) + 1 / mu


def _run(chains, lam, n, seed, warmup=0.02):
    rng = np.random.default_rng(seed)
    arr = poisson_arrivals_s(lam, n, rng)
    sizes = exp_job_sizes(n, rng)
    return simulate(_CentralQueue(chains), arr, sizes, warmup_fraction=warmup)


@pytest.mark.parametrize("c,rho", [(4, 0.7), (10, 0.8)])
def test_identical_chains_match_erlang_c(c, rho):
    service_s = 2.0
    lam = rho * c / service_s
    res = _run([(service_s, c)], lam, 200_000, seed=1)
    expected = erlang_c_mean_response_s(lam, 1 / service_s, c)
    assert res.mean_response_s == pytest.approx(expected, rel=0.03)
    assert res.mean_service_s == pytest.approx(service_s, rel=0.02)


def test_single_chain_capacity_one_is_mm1():
    lam, mu = 0.6, 1.0
    res = _run([(1 / mu, 1)], lam, 200_000, seed=2)
    assert res.mean_response_s == pytest.approx(1 / (mu - lam), rel=0.03)


def test_deterministic_for_a_seed():
    a = _run([(1.0, 2), (1.5, 3)], 2.0, 5000, seed=7)
    b = _run([(1.0, 2), (1.5, 3)], 2.0, 5000, seed=7)
    c = _run([(1.0, 2), (1.5, 3)], 2.0, 5000, seed=8)
    assert np.array_equal(a.response_s, b.response_s) and np.array_equal(a.chain_id, b.chain_id)
    assert a.mean_response_s != c.mean_response_s


def test_200k_jobs_take_seconds():
    t0 = time.perf_counter()
    _run([(1.0, 8)], 6.0, 200_000, seed=3)
    assert time.perf_counter() - t0 < 10.0


class _Lazy:
    def on_arrival(self, job_id):
        return []

    def on_completion(self, job_id):
        return []


class _Greedy:
    def on_arrival(self, job_id):
        return [_Start(job_id, 0, 1.0), _Start(job_id, 0, 1.0)]

    def on_completion(self, job_id):
        return []


def test_contract_violations_are_reported():
    arr, sizes = np.arange(3.0), np.ones(3)
    with pytest.raises(SimulationError, match="never started"):
        simulate(_Lazy(), arr, sizes)
    with pytest.raises(SimulationError, match="twice"):
        simulate(_Greedy(), arr, sizes)
    with pytest.raises(ValueError):
        simulate(_Lazy(), np.array([1.0, 0.0]), np.ones(2))


@pytest.mark.parametrize("spec,cv", [("exp", 1.0), ("det", 0.0), ("lognormal:2", 2.0), ("gamma:0.5", 0.5)])
def test_job_size_specs_have_mean_one(spec, cv):
    from orchestrator.sim.engine import job_sizes

    x = job_sizes(spec, 400_000, np.random.default_rng(0))
    assert x.mean() == pytest.approx(1.0, rel=0.02)
    assert x.std() == pytest.approx(cv, abs=0.1 * max(cv, 0.1))


@pytest.mark.parametrize("spec", ["pareto", "lognormal", "gamma:-1", "exp:2"])
def test_bad_job_size_spec(spec):
    from orchestrator.sim.engine import job_sizes

    with pytest.raises(ValueError):
        job_sizes(spec, 10, np.random.default_rng(0))
