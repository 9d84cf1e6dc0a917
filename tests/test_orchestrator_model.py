import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.model import (
    SINK,
    SOURCE,
    BlockInterval,
    InvalidClusterError,
    Placement,
    chain_from_path,
    residual_slots,
    robust_floor_div,
    routing_links,
)
from tests.orchestrator_strategies import make_cluster


def test_floor_div_snaps_float_noise():
    assert 0.3 / 0.1 < 3 and 0.7 / 0.1 < 7  # the traps
    assert robust_floor_div(2 - 1, 0.1) == 10
    assert robust_floor_div(1.32 * 3 + 0.33, 1.32 + 0.11) == 3  # quotient is 2.9999999999999996
    assert robust_floor_div(0.3, 0.1) == 3
    assert robust_floor_div(0.7, 0.1) == 7
    assert robust_floor_div(0.99, 0.1) == 9
    assert robust_floor_div(0.0, 0.1) == 0


@given(st.integers(0, 10_000), st.sampled_from([0.1, 0.11, 0.3, 1.32, 0.7]))
def test_floor_div_exact_multiples(k, step):
    assert robust_floor_div(k * step, step) == k
    assert robust_floor_div(k * step + step / 2, step) == k


def test_residual_slots_eq3():
    cl = make_cluster([2.0, 3.0, 0.5], [1, 1, 1], [0.1, 0.1, 0.1], num_blocks=3, block_size=1.0, cache_size=0.1)
    p = Placement((BlockInterval(0, 1), BlockInterval(1, 3), None))
    assert residual_slots(cl, p) == [10, 10, 0]


def test_routing_links_match_paper_condition():
    # a_j <= a_i + m_i <= a_j + m_j - 1  <=>  start_j <= end_i < end_j
    p = Placement((BlockInterval(0, 2), BlockInterval(1, 3), BlockInterval(2, 3), BlockInterval(0, 3)))
    links = {(i, j): m for i, j, m in routing_links(p, 3)}
    assert links[(SOURCE, 0)] == 2 and links[(SOURCE, 3)] == 3
    assert (SOURCE, 1) not in links and (SOURCE, 2) not in links
    assert links[(0, 1)] == 1 and links[(0, 2)] == 1 and links[(0, 3)] == 1
    assert (1, 2) not in links  # server 1 ends at 3: nothing left for server 2
    assert (1, SINK) in links and (2, SINK) in links and (3, SINK) in links and (0, SINK) not in links


def test_chain_service_time_eq2():
    cl = make_cluster([5, 5], [1.0, 2.0], [0.5, 0.25], num_blocks=4)
    p = Placement((BlockInterval(0, 3), BlockInterval(1, 4)))
    k = chain_from_path(cl, p, [0, 1], capacity=2)
    assert [b.num_blocks for b in k.blocks] == [3, 1]  # each block at the first server hosting it
    assert k.service_time_s == pytest.approx(1.0 + 3 * 0.5 + 2.0 + 1 * 0.25)
    with pytest.raises(ValueError):
        chain_from_path(cl, p, [1], capacity=1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(memories=[-1.0]), "memory"),
        (dict(tau_c=[-0.1]), "tau_c"),
        (dict(arrival_rate=0.0), "arrival_rate"),
        (dict(rho_bar=1.0), "rho_bar"),
        (dict(num_blocks=0), "blocks"),
    ],
)
def test_invalid_cluster_messages(kwargs, match):
    args = dict(memories=[4.0], tau_c=[1.0], tau_p=[0.1], num_blocks=2)
    args.update(kwargs)
    with pytest.raises(InvalidClusterError, match=match):
        make_cluster(**args)


def test_duplicate_names_rejected():
    from orchestrator.model import Cluster, Server, Service

    with pytest.raises(InvalidClusterError, match="twice"):
        Cluster(Service(2, 1.0, 0.1), (Server("a", 4, 1, 1), Server("a", 4, 1, 1)), 1.0)
