"""Hypothesis strategies and small builders shared by the orchestrator tests."""

from __future__ import annotations

import heapq

import numpy as np
from hypothesis import strategies as st

from orchestrator.model import BlockInterval, Cluster, Placement, Server, Service


def make_cluster(
    memories, tau_c, tau_p, num_blocks, block_size=1.0, cache_size=0.1, arrival_rate=1.0, rho_bar=0.7
) -> Cluster:
    servers = tuple(
        Server(f"s{j}", float(m), float(c), float(p)) for j, (m, c, p) in enumerate(zip(memories, tau_c, tau_p))
    )
    return Cluster(
        Service(num_blocks, block_size, cache_size), servers, arrival_rate_per_s=arrival_rate, rho_bar=rho_bar
    )


def fig1_cluster(L=4, tau_c=1.0, tau_p=0.2, lam=100.0):
    # Fig. 1: J = L servers, M_j = (L+1) s_m, s_m = L s_c
    s_c = 0.1
    s_m = L * s_c
    return make_cluster(
        [(L + 1) * s_m] * L,
        [tau_c] * L,
        [tau_p] * L,
        num_blocks=L,
        block_size=s_m,
        cache_size=s_c,
        arrival_rate=lam,
        rho_bar=0.5,
    )


def fig2_cluster(lam):
    eps = 1e-3
    return make_cluster(
        [2, 3, 2, 2, 2],
        [1, 2, 1, 1, 1],
        [k * eps for k in range(1, 6)],
        num_blocks=3,
        block_size=1.0,
        cache_size=0.1,
        arrival_rate=lam,
        rho_bar=0.5,
    )


times = st.floats(min_value=0.01, max_value=5.0, allow_nan=False, allow_infinity=False)


@st.composite
def clusters(draw, max_servers=8, max_blocks=8, homogeneous=False):
    L = draw(st.integers(1, max_blocks))
    J = draw(st.integers(1, max_servers))
    block_size = draw(st.sampled_from([1.0, 1.32, 0.5]))
    cache_size = draw(st.sampled_from([0.1, 0.11, 0.25]))
    if homogeneous:
        mem = draw(st.floats(min_value=0.5, max_value=12.0))
        memories = [mem] * J
    else:
        memories = draw(st.lists(st.floats(min_value=0.0, max_value=12.0), min_size=J, max_size=J))
    tau_c = draw(st.lists(times, min_size=J, max_size=J))
    tau_p = draw(st.lists(times, min_size=J, max_size=J))
    lam = draw(st.floats(min_value=0.01, max_value=50.0))
    rho = draw(st.floats(min_value=0.1, max_value=0.95))
    return make_cluster(memories, tau_c, tau_p, L, block_size, cache_size, lam, rho)


@st.composite
def placements(draw, cluster: Cluster):
    """Any placement: each server gets a random contiguous range that fits its memory, or nothing."""
    L = cluster.service.num_blocks
    ranges = []
    for sv in cluster.servers:
        max_m = min(L, int(sv.memory // cluster.service.block_size))
        if max_m < 1 or draw(st.booleans()) is False and draw(st.booleans()):
            ranges.append(None)
            continue
        m = draw(st.integers(1, max_m))
        start = draw(st.integers(0, L - m))
        ranges.append(BlockInterval(start, start + m))
    return Placement(tuple(ranges))


def simulate(dispatcher, lam, num_jobs, rng):
    """Tiny event-driven M/M/K simulation: Poisson arrivals, job sizes Exp(1) times T_k."""
    events = []
    t = 0.0
    for job in range(num_jobs):
        t += rng.exponential(1 / lam)
        heapq.heappush(events, (t, 1, job))
    arrival, finish = {}, {}
    while events:
        now, kind, job = heapq.heappop(events)
        if kind == 1:
            arrival[job] = now
            starts = dispatcher.on_arrival(job)
        else:
            finish[job] = now
            starts = dispatcher.on_completion(job)
        for s in starts:
            heapq.heappush(events, (now + rng.exponential() * s.service_time_s, 0, s.job_id))
    return np.mean([finish[j] - arrival[j] for j in arrival])
