"""The discrete-event engine: jobs arrive, a dispatcher starts them on chains or queues them.

The engine knows nothing of chains: a dispatcher (orchestrator.dispatch.Dispatcher, or a
baseline's per-request router with the same interface) answers each arrival and each completion
with the jobs that start now, each with the mean service time of the chain it got; a job of size
r on a chain with mean service time T takes r * T. Arrival times and job sizes are arrays drawn
beforehand (Poisson/Exp(1) helpers below, or a trace), so a run is a pure function of its inputs
and the dispatcher's own injected RNG.

Events live in one heap of completions; arrivals are read in order from the sorted array. At equal
times a completion is handled before an arrival.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np


class StartLike(Protocol):
    job_id: int
    chain_id: int
    service_time_s: float


class DispatcherLike(Protocol):
    def on_arrival(self, job_id: int) -> Sequence[StartLike]: ...
    def on_completion(self, job_id: int) -> Sequence[StartLike]: ...


@dataclass(frozen=True)
class SimResult:
    n_jobs: int
    n_measured: int  # jobs after the warm-up that the means are taken over
    mean_response_s: float
    mean_wait_s: float
    mean_service_s: float
    p95_response_s: float
    makespan_s: float  # time of the last completion
    response_s: np.ndarray  # per job, arrival order
    wait_s: np.ndarray
    chain_id: np.ndarray  # chain (or route) each job ran on

    def summary(self) -> dict:
        return {
            "n_jobs": self.n_jobs,
            "n_measured": self.n_measured,
            "mean_response_s": self.mean_response_s,
            "mean_wait_s": self.mean_wait_s,
            "mean_service_s": self.mean_service_s,
            "p95_response_s": self.p95_response_s,
            "makespan_s": self.makespan_s,
        }


class SimulationError(RuntimeError):
    """The dispatcher broke the contract (a job started twice, or never)."""


def poisson_arrivals_s(rate_per_s: float, n_jobs: int, rng: np.random.Generator) -> np.ndarray:
    if rate_per_s <= 0:
        raise ValueError("arrival rate must be positive")
    return np.cumsum(rng.exponential(1.0 / rate_per_s, n_jobs))


def exp_job_sizes(n_jobs: int, rng: np.random.Generator) -> np.ndarray:
    """Job sizes Exp(1): a job of size r on a chain with mean service time T takes r*T."""
    return rng.exponential(1.0, n_jobs)


def job_sizes(spec: str, n_jobs: int, rng: np.random.Generator) -> np.ndarray:
    """Job sizes of mean 1 from a short spec: "exp" (the paper's Exp(1)), "det" (all 1),
    "lognormal:CV" or "gamma:CV" (coefficient of variation CV > 0)."""
    name, _, arg = spec.partition(":")
    if name == "exp" and not arg:
        return exp_job_sizes(n_jobs, rng)
    if name == "det" and not arg:
        return np.ones(n_jobs)
    if name in ("lognormal", "gamma"):
        try:
            cv = float(arg)
        except ValueError:
            cv = float("nan")
        if not (cv > 0 and math.isfinite(cv)):
            raise ValueError(f"job size spec {spec!r}: {name} needs a coefficient of variation > 0, e.g. {name}:2")
        if name == "gamma":
            shape = 1.0 / cv**2
            return rng.gamma(shape, 1.0 / shape, n_jobs)
        sigma2 = math.log1p(cv**2)
        return rng.lognormal(-sigma2 / 2, math.sqrt(sigma2), n_jobs)
    raise ValueError(f"unknown job size spec {spec!r}; use exp, det, lognormal:CV or gamma:CV")


def simulate(
    dispatcher: DispatcherLike,
    arrival_times_s: np.ndarray,
    job_sizes: np.ndarray,
    *,
    warmup_fraction: float = 0.0,
) -> SimResult:
    """Run all jobs through `dispatcher`; job ids are indices into the two arrays (arrival order).

    The means skip the first `warmup_fraction` of jobs (by arrival) to cut the empty-start bias.
    """
    arrivals = np.asarray(arrival_times_s, dtype=float)
    sizes = np.asarray(job_sizes, dtype=float)
    n = len(arrivals)
    if len(sizes) != n:
        raise ValueError("arrival_times_s and job_sizes differ in length")
    if n and np.any(np.diff(arrivals) < 0):
        raise ValueError("arrival times must be sorted")
    arr = arrivals.tolist()
    size = sizes.tolist()
    start = [math.nan] * n
    finish = [math.nan] * n
    chain = [-1] * n
    heap: list[tuple[float, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    on_arrival, on_completion = dispatcher.on_arrival, dispatcher.on_completion
    i = 0
    while i < n or heap:
        if heap and (i >= n or heap[0][0] <= arr[i]):
            now, job = pop(heap)
            finish[job] = now
            starts = on_completion(job)
        else:
            now = arr[i]
            starts = on_arrival(i)
            i += 1
        for s in starts:
            j = s.job_id
            if chain[j] != -1:
                raise SimulationError(f"job {j} started twice")
            chain[j] = s.chain_id
            start[j] = now
            push(heap, (now + size[j] * s.service_time_s, j))
    start_a = np.array(start)
    finish_a = np.array(finish)
    if n and np.isnan(finish_a).any():
        raise SimulationError(f"{int(np.isnan(finish_a).sum())} jobs never started")
    response = finish_a - arrivals
    wait = start_a - arrivals
    skip = min(int(n * warmup_fraction), max(n - 1, 0))
    r, w = response[skip:], wait[skip:]
    return SimResult(
        n_jobs=n,
        n_measured=len(r),
        mean_response_s=float(r.mean()) if len(r) else math.nan,
        mean_wait_s=float(w.mean()) if len(w) else math.nan,
        mean_service_s=float((r - w).mean()) if len(r) else math.nan,
        p95_response_s=float(np.percentile(r, 95)) if len(r) else math.nan,
        makespan_s=float(finish_a.max()) if n else 0.0,
        response_s=response,
        wait_s=wait,
        chain_id=np.array(chain),
    )
