import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.baselines.bprr import (
    BprrRouter,
    bprr_placement,
    bprr_target_concurrency,
)
from orchestrator.baselines.jffc_only import jffc_only_chains, jffc_only_placement
from orchestrator.baselines.petals import PetalsRouter, petals_blocks, petals_placement
from orchestrator.model import (
    BlockInterval,
    InfeasibleClusterError,
    Placement,
    residual_slots,
)
from orchestrator.planner import make_baseline_router
from tests.orchestrator_strategies import clusters, make_cluster


def test_petals_covers_weakest_blocks_first():
    # L=4; each server holds 2 blocks with r=2 sessions reserved (1 + 0.1*2 = 1.2 GB per block)
    cl = make_cluster([2.4, 2.4, 2.4], [1.0, 1.0, 1.0], [0.1, 0.2, 0.3], num_blocks=4)
    assert petals_blocks(cl) == [2, 2, 2]
    p = petals_placement(cl)
    # throughputs 1/(0.1 + 1/2) on blocks 0-1 and 1/(0.2 + 1/2) on blocks 2-3: the 3rd server
    # reinforces the weaker window [2, 4) (its sorted vector is lexicographically smaller)
    assert [(r.start, r.end) for r in p.ranges] == [(0, 2), (2, 4), (2, 4)]
    reordered = petals_placement(cl, join_order=[2, 1, 0])  # server 2 first, server 0 last
    assert [(r.start, r.end) for r in reordered.ranges] == [(0, 2), (2, 4), (0, 2)]


def test_petals_uncovered_block_is_an_error():
    cl = make_cluster([1.2], [1.0], [0.1], num_blocks=3)
    with pytest.raises(InfeasibleClusterError, match="uncovered"):
        petals_placement(cl)


def single_block_pair():
    # two one-block servers A (fast) and B (slow) with one session each
    cl = make_cluster([1.1, 1.1], [0.1, 0.5], [0.1, 0.5], num_blocks=1)
    return cl, Placement((BlockInterval(0, 1), BlockInterval(0, 1)))


def test_petals_router_penalises_servers_without_cache():
    cl, p = single_block_pair()
    r = make_baseline_router("petals", cl, p)
    assert isinstance(r, PetalsRouter)
    s0 = r.on_arrival(0)
    assert r.route(s0[0].chain_id).servers == (0,)
    s1 = r.on_arrival(1)
    assert r.route(s1[0].chain_id).servers == (1,)  # A has no cache left: +10 s
    assert r.on_arrival(2) == [] and r.queue_length == 1  # both full: waits on A (cheapest with penalty)
    assert r.on_completion(1) == []  # B freed, but job 2 waits for A
    started = r.on_completion(0)
    assert [s.job_id for s in started] == [2] and r.route(started[0].chain_id).servers == (0,)


def test_bprr_router_weighs_expected_wait():
    cl, p = single_block_pair()
    r = make_baseline_router("bprr", cl, p)
    assert isinstance(r, BprrRouter)
    assert r.route(r.on_arrival(0)[0].chain_id).servers == (0,)
    # A busy with a 0.2 s session: expected wait 0.2 + 0.2 < B's 1.0 s: BPRR waits for A
    assert r.on_arrival(1) == []
    assert [s.job_id for s in r.on_completion(0)] == [1]


def test_bprr_target_concurrency_and_block_count():
    cl = make_cluster([10.0] * 4, [1.0] * 4, [0.1] * 4, num_blocks=4, arrival_rate=2.0)
    # c=1 fastest chain: m = floor(10/1.1)=4 -> T = 1.4; lambda T = 2.8 -> R = ceil(2.8 + 1.67) = 5
    assert bprr_target_concurrency(cl) == 5
    p = bprr_placement(cl)
    assert all(r.num_blocks == 4 for r in p.ranges)  # floor(10 / 1.5) = 6, capped at L = 4
    big = make_cluster([10.0] * 4, [1.0] * 4, [0.1] * 4, num_blocks=4, arrival_rate=1000.0)
    R = bprr_target_concurrency(big)
    assert R == math.floor((40 / 4 - 1.0) / 0.1)  # capped by total memory


def test_bprr_covers_uncovered_blocks_first():
    # 6 blocks, servers of 2 blocks each: the first three must tile the model before any doubles up
    cl = make_cluster([3.0] * 5, [1.0] * 5, [0.1, 0.11, 0.12, 0.13, 0.14], num_blocks=6, arrival_rate=0.1)
    p = bprr_placement(cl, target_concurrency=2)
    first_three = sorted((p.ranges[j].start, p.ranges[j].end) for j in range(3))
    assert first_three == [(0, 2), (2, 4), (4, 6)]


def test_jffc_only():
    cl = make_cluster([4.5, 2.0, 6.0], [1.0, 1.0, 2.0], [0.1, 0.1, 0.1], num_blocks=3)
    p = jffc_only_placement(cl)
    assert [j for j in p.used_servers()] == [0, 2]
    chains = jffc_only_chains(cl, p)
    assert [(k.servers, k.capacity) for k in chains] == [((0,), 5), ((2,), 10)]
    assert chains[0].service_time_s == pytest.approx(1.3)
    with pytest.raises(InfeasibleClusterError):
        jffc_only_placement(make_cluster([2.0], [1.0], [1.0], num_blocks=3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    clusters(max_servers=6, max_blocks=5),
    st.sampled_from(["petals", "bprr"]),
    st.lists(st.booleans(), min_size=1, max_size=60),
    st.integers(0, 1000),
)
def test_router_cache_bookkeeping(cluster, policy, ops, seed):
    try:
        placement = petals_placement(cluster) if policy == "petals" else bprr_placement(cluster)
        router = make_baseline_router(policy, cluster, placement)
    except InfeasibleClusterError:
        return
    total = residual_slots(cluster, placement)
    rng = np.random.default_rng(seed)
    running, started, job = [], set(), 0
    for is_arrival in ops + [False] * 100:
        if is_arrival:
            starts = router.on_arrival(job)
            job += 1
        elif running:
            starts = router.on_completion(running.pop(int(rng.integers(len(running)))))
        else:
            continue
        for s in starts:
            chain = router.route(s.chain_id)
            assert chain.blocks[0].start == 0 and chain.blocks[-1].end == cluster.service.num_blocks
            assert s.job_id not in started
            started.add(s.job_id)
            running.append(s.job_id)
        assert all(0 <= f <= t for f, t in zip(router.free_slots, total))
    assert router.free_slots == total and router.queue_length == 0 and started == set(range(job))
