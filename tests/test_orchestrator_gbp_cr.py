import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.model import InfeasibleClusterError
from orchestrator.placement_gbp_cr import (
    blocks_per_server,
    gbp_cr,
    gbp_cr_or_raise,
    max_capacity,
)
from orchestrator.reference_optima import brute_force_disjoint_chains
from tests.orchestrator_strategies import (
    clusters,
    fig1_cluster,
    fig2_cluster,
    make_cluster,
    times,
)


@pytest.mark.parametrize("L", [3, 4, 5, 7])
def test_fig1_c1_gives_L_single_server_chains(L):
    cl = fig1_cluster(L)
    assert blocks_per_server(cl, 1) == [L] * L
    g = gbp_cr(cl, 1)
    assert g.num_chains == L and all(len(k) == 1 for k in g.chains)
    assert all(t == pytest.approx(1.0 + L * 0.2) for t in g.chain_times_s)  # T^(1) = tau_c + L tau_p


@pytest.mark.parametrize("L", [3, 4, 5, 7])
def test_fig1_c_L2_gives_one_L_server_chain(L):
    cl = fig1_cluster(L)
    assert blocks_per_server(cl, L * L) == [1] * L
    g = gbp_cr(cl, L * L)
    assert g.num_chains == 1 and len(g.chains[0]) == L
    assert g.chain_times_s[0] == pytest.approx(L * 1.0 + L * 0.2)  # T^(2) = L tau_c + L tau_p
    assert sorted((r.start, r.end) for r in g.placement.ranges) == [(b, b + 1) for b in range(L)]


def test_fig2_gbp_cr_two_chains():
    g = gbp_cr(fig2_cluster(100.0), 1)
    assert g.chains == ((0, 1), (2, 3, 4))  # j1->j2 and j3->j4->j5
    assert [(r.start, r.end) for r in g.placement.ranges] == [(0, 1), (1, 3), (0, 1), (1, 2), (2, 3)]
    assert g.chain_times_s == pytest.approx((3 + 5e-3, 3 + 12e-3))  # denominators of eq. (15)
    assert not g.meets_target and g.unused_servers == ()


def test_stops_when_target_met_and_reports_unused():
    g = gbp_cr(fig2_cluster(0.01), 1)
    assert g.meets_target and g.chains == ((0, 1),)
    assert g.unused_servers == (2, 3, 4)


def test_last_server_shifted_back_and_m_capped_at_L():
    # servers with 3, 3 blocks for L=4: second one is shifted to [1, 4)
    cl = make_cluster([3.3, 3.3, 100.0], [1, 1, 50], [0.1, 0.1, 0.1], num_blocks=4, arrival_rate=100)
    assert blocks_per_server(cl, 1) == [3, 3, 4]  # 100/1.1 blocks, capped at L=4
    g = gbp_cr(cl, 1)
    assert (g.placement.ranges[0].start, g.placement.ranges[0].end) == (0, 3)
    assert (g.placement.ranges[1].start, g.placement.ranges[1].end) == (1, 4)
    assert g.chains[0] == (0, 1)


def test_infeasible_is_a_clear_error():
    cl = make_cluster([1.0, 1.0], [1, 1], [1, 1], num_blocks=5)
    assert gbp_cr(cl, 1).num_chains == 0
    with pytest.raises(InfeasibleClusterError, match="add servers or memory"):
        gbp_cr_or_raise(cl, 1)


def test_max_capacity():
    cl = make_cluster([2.0, 3.0], [1, 1], [1, 1], num_blocks=2, block_size=1.0, cache_size=0.1)
    assert max_capacity(cl) == 20


@st.composite
def homogeneous_instances(draw):
    """Homogeneous memory M sized for m(c) blocks per server, demand around what J servers give."""
    L = draw(st.integers(1, 6))
    J = draw(st.integers(1, 7))
    c = draw(st.integers(1, 12))
    m = draw(st.integers(1, L))
    s_m, s_c = 1.0, 0.1
    memory = m * (s_m + s_c * c) + draw(st.floats(0.0, 0.99)) * (s_m + s_c * c)
    tau_c = draw(st.lists(times, min_size=J, max_size=J))
    tau_p = draw(st.lists(times, min_size=J, max_size=J))
    n = -(-L // m)  # servers per chain
    mean_t = (sum(tau_c) + m * sum(tau_p)) / J
    scale = draw(st.floats(0.05, 1.5))
    lam = 0.5 * c * scale * max(1, J // n) / (n * mean_t)
    cl = make_cluster([memory] * J, tau_c, tau_p, L, s_m, s_c, arrival_rate=lam, rho_bar=0.5)
    return cl, c


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(homogeneous_instances())
def test_theorem_3_4_homogeneous_memory_gbp_cr_is_optimal(instance):
    """Theorem 3.4: with M_j = M, GBP-CR attains the optimum of (10) (brute force)."""
    cluster, c = instance
    opt = brute_force_disjoint_chains(cluster, c)
    g = gbp_cr(cluster, c)
    if opt.num_chains is None:
        assert not g.meets_target
    else:
        assert g.meets_target and g.num_chains == opt.num_chains


@settings(max_examples=60, deadline=None)
@given(clusters(), st.integers(1, 30))
def test_gbp_cr_chains_are_valid(cluster, c):
    g = gbp_cr(cluster, c)
    L = cluster.service.num_blocks
    m = blocks_per_server(cluster, c)
    for j, r in enumerate(g.placement.ranges):
        if r is not None:
            assert r.num_blocks == m[j] and 0 <= r.start and r.end <= L
            # blocks plus c slots per block fit in memory (eq. 8)
            assert (
                m[j] * (cluster.service.block_size + cluster.service.cache_size * c) <= cluster.servers[j].memory + 1e-9
            )
    for chain in g.chains:
        covered = 0
        for j in chain:  # consecutive servers leave no gap
            r = g.placement.ranges[j]
            assert r.start <= covered
            covered = max(covered, r.end)
        assert covered == L
    assert set(g.unused_servers).isdisjoint({j for k in g.chains for j in k})
