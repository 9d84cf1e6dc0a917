import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.cache_gca import gca, gca_or_raise
from orchestrator.model import (
    BlockInterval,
    InfeasibleClusterError,
    Placement,
    chain_slot_usage,
    residual_slots,
)
from orchestrator.placement_gbp_cr import gbp_cr
from orchestrator.reference_optima import optimal_cache_allocation
from tests.gca_reference import gca_networkx
from tests.orchestrator_strategies import (
    clusters,
    fig2_cluster,
    make_cluster,
    placements,
)


def test_fig2_gca_three_chains_of_capacity_5():
    cl = fig2_cluster(100.0)
    res = gca(cl, gbp_cr(cl, 1).placement)
    assert [k.servers for k in res.chains] == [(0, 1), (0, 3, 4), (2, 3, 4)]  # j1j2, j1j4j5, j3j4j5
    assert [k.capacity for k in res.chains] == [5, 5, 5]
    assert [k.service_time_s for k in res.chains] == pytest.approx([3.005, 3.010, 3.012])  # eq. (16)
    assert res.residual_slots_after == (0, 0, 5, 0, 0)


def test_every_link_into_an_exhausted_server_is_removed():
    # Server 2 ([1, 3)) is entered from server 0 (m=2) or from server 1 (m=1). The first chain
    # 1->2 takes 3 of server 2's 4 slots; the link 0->2 (m=2, not on that chain) must go too,
    # otherwise the next shortest path 0->2 would get capacity floor(1/2) = 0.
    cl = make_cluster([1.1, 2.6, 2.4], [1.0, 1.0, 1.0], [0.5, 0.1, 0.1], num_blocks=3, block_size=1.0, cache_size=0.1)
    p = Placement((BlockInterval(0, 1), BlockInterval(0, 2), BlockInterval(1, 3)))
    assert residual_slots(cl, p) == [1, 6, 4]
    for impl in (gca, gca_networkx):
        res = impl(cl, p)
        assert [(k.servers, k.capacity) for k in res.chains] == [((1, 2), 3)]
        assert res.residual_slots_after == (1, 0, 1)


def test_no_chain_is_an_error():
    cl = make_cluster([1.0], [1.0], [1.0], num_blocks=2)
    p = Placement((BlockInterval(0, 1),))
    assert gca(cl, p).chains == ()
    with pytest.raises(InfeasibleClusterError):
        gca_or_raise(cl, p)


def _check_chains(cluster, placement, chains):
    L = cluster.service.num_blocks
    for k in chains:
        assert isinstance(k.capacity, int) and k.capacity >= 1
        assert k.blocks[0].start == 0 and k.blocks[-1].end == L
        for a, b in zip(k.blocks, k.blocks[1:]):
            assert a.end == b.start  # blocks 0..L-1 in order, each once
        for j, b in zip(k.servers, k.blocks):
            r = placement.ranges[j]
            assert r.start <= b.start and b.end == r.end  # processed blocks lie on the server
    used = chain_slot_usage(chains, cluster.num_servers)
    slots = residual_slots(cluster, placement)
    assert all(u <= s for u, s in zip(used, slots))  # eq. (3): memory never over-committed


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_theorem_3_5_and_memory_on_any_placement(data):
    cluster = data.draw(clusters(max_servers=7, max_blocks=6))
    placement = data.draw(placements(cluster))
    res = gca(cluster, placement)
    _check_chains(cluster, placement, res.chains)
    times = [k.service_time_s for k in res.chains]
    assert all(a <= b + 1e-12 for a, b in zip(times, times[1:]))  # Theorem 3.5: non-decreasing
    # no complete chain with a free slot is left (the while loop of Alg. 2 ran to the end)
    for impl in (gca, gca_networkx):
        assert impl(cluster, placement, residual=list(res.residual_slots_after)).chains == ()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_end_dp_gca_matches_networkx_oracle(data):
    cluster = data.draw(clusters(max_servers=7, max_blocks=6))
    placement = data.draw(placements(cluster))
    fast, ref = gca(cluster, placement), gca_networkx(cluster, placement)
    assert [k.capacity for k in fast.chains] == [k.capacity for k in ref.chains]
    assert [k.service_time_s for k in fast.chains] == pytest.approx([k.service_time_s for k in ref.chains])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_servers=6, max_blocks=5), st.integers(1, 10))
def test_ilp_is_feasible_and_no_worse_than_gca(cluster, c):
    g = gbp_cr(cluster, c)
    res = gca(cluster, g.placement)
    if not res.chains:
        return
    slots = residual_slots(cluster, g.placement)
    caps = optimal_cache_allocation(cluster, res.chains, slots)
    nu_gca = sum(k.capacity / k.service_time_s for k in res.chains)
    target = cluster.arrival_rate_per_s / cluster.rho_bar
    if caps is None:
        assert nu_gca < target * (1 + 1e-9)  # if GCA's allocation met the target, the ILP is feasible
        return
    assert sum(x / k.service_time_s for x, k in zip(caps, res.chains)) >= target * (1 - 1e-6)
    chains = [type(k)(k.servers, k.blocks, x, k.service_time_s) for k, x in zip(res.chains, caps) if x > 0]
    used = chain_slot_usage(chains, cluster.num_servers)
    assert all(u <= s for u, s in zip(used, slots))
    if nu_gca >= target:
        assert sum(caps) <= sum(k.capacity for k in res.chains)
