"""Shared-compute servers (model.Server.batch_overhead_s): chains whose servers split their compute
among concurrent sessions take at least their busiest server's busy time, and the paper's model is
unchanged when no server is marked."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from orchestrator.cache_gca import gca
from orchestrator.cluster_io import cluster_from_dict
from orchestrator.model import (
    BlockInterval,
    ChainSpec,
    Cluster,
    InvalidClusterError,
    contended_chains,
    link_time_s,
    saturating_capacity,
    server_busy_s,
)
from orchestrator.placement_gbp_cr import GbpCrSweep, gbp_cr, max_capacity
from orchestrator.planner import plan
from tests.orchestrator_strategies import clusters, make_cluster, placements

overheads = st.floats(min_value=0.0, max_value=3.0, allow_nan=False)


def shared(cluster: Cluster, overhead: list[float] | float) -> Cluster:
    per = overhead if isinstance(overhead, list) else [overhead] * cluster.num_servers
    return replace(cluster, servers=tuple(replace(sv, batch_overhead_s=o) for sv, o in zip(cluster.servers, per)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_papers_servers_are_not_contended(data):
    cl = data.draw(clusters())
    chains = gca(cl, data.draw(placements(cl))).chains
    assert contended_chains(cl, chains) == chains
    assert all(b is None for b in server_busy_s(cl, chains))


def test_busy_time_sums_every_chain_through_a_server():
    cl = shared(make_cluster([10, 10], [1.0, 1.0], [0.5, 0.25], num_blocks=4), [2.0, 0.0])
    a = ChainSpec((0, 1), (BlockInterval(0, 2), BlockInterval(2, 4)), capacity=3, service_time_s=4.5)
    b = ChainSpec((1,), (BlockInterval(0, 4),), capacity=2, service_time_s=2.0)
    # server 0: 2 + 3 x 2 x 0.5 = 5; server 1: 0 + 3 x 2 x 0.25 + 2 x 4 x 0.25 = 3.5
    assert server_busy_s(cl, [a, b]) == pytest.approx([5.0, 3.5])


def test_contended_chains_stop_at_saturation_and_take_the_busiest_servers_time():
    cl = shared(make_cluster([10, 10], [1.0, 1.0], [0.5, 0.25], num_blocks=4), [2.0, 0.0])
    a = ChainSpec((0, 1), (BlockInterval(0, 2), BlockInterval(2, 4)), capacity=9, service_time_s=4.5)
    b = ChainSpec((1,), (BlockInterval(0, 4),), capacity=5, service_time_s=2.0)
    # a: server 0 saturates at n with 2 + n x 1 >= 4.5 -> 3 (server 1: 0.5 n >= 4.5 -> 9); b: 1 x n >= 2 -> 2
    assert saturating_capacity(cl, a) == 3 and saturating_capacity(cl, b) == 2
    ca, cb = contended_chains(cl, [a, b])
    assert (ca.capacity, cb.capacity) == (3, 2)
    # with both full: server 0 busy 2 + 3 x 1 = 5, server 1 busy 3 x 0.5 + 2 x 1 = 3.5
    assert ca.service_time_s == pytest.approx(5.0) and cb.service_time_s == pytest.approx(3.5)
    assert (ca.servers, ca.blocks) == (a.servers, a.blocks)
    assert contended_chains(cl, [ca, cb]) == (ca, cb)  # idempotent (the planner may apply it twice)
    # a chain that never saturates keeps its capacity and the paper's time
    lone = contended_chains(cl, [replace(b, capacity=1)])[0]
    assert lone.capacity == 1 and lone.service_time_s == pytest.approx(2.0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_contended_chains_never_add_capacity_or_speed(data):
    cl = data.draw(clusters())
    cs = shared(
        cl, data.draw(st.lists(st.one_of(st.none(), overheads), min_size=cl.num_servers, max_size=cl.num_servers))
    )
    chains = gca(cs, data.draw(placements(cs))).chains
    assume(chains)
    out = contended_chains(cs, chains)
    for k, o in zip(chains, out):
        assert 1 <= o.capacity <= k.capacity and o.service_time_s >= k.service_time_s
        assert (o.servers, o.blocks) == (k.servers, k.blocks)
    assert contended_chains(cs, out) == out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.data())
def test_gbp_cr_chain_times_are_the_paper_sum_or_the_busiest_server(cl, data):
    c_max = max_capacity(cl)
    assume(c_max >= 1)
    cs = shared(cl, data.draw(st.lists(overheads, min_size=cl.num_servers, max_size=cl.num_servers)))
    sweep = GbpCrSweep(cs)
    for c in sorted(set(data.draw(st.lists(st.integers(1, c_max), min_size=1, max_size=4)))):
        g, paper = sweep(c), gbp_cr(cl, c)
        assert g == gbp_cr(cs, c)  # the sweep's shared runs do not mix different c
        m = [g.placement.num_blocks(j) for j in range(cs.num_servers)]
        for k, t in zip(g.chains, g.chain_times_s):
            total = sum(link_time_s(cs.servers[j], m[j]) for j in k)
            busiest = max(cs.servers[j].batch_overhead_s + c * m[j] * cs.servers[j].tau_p_s for j in k)
            assert t == pytest.approx(max(total, busiest))
        # the same greedy order (line 1/3) with longer chain times: the paper's chains are a prefix,
        # and reaching the target takes at least as many of them
        assert g.chains[: paper.num_chains] == paper.chains[: g.num_chains]
        if paper.meets_target and g.meets_target:
            assert g.num_chains >= paper.num_chains
        if not paper.meets_target:
            assert not g.meets_target


def test_a_cpu_swarm_plan_spreads_over_more_chains_than_the_papers():
    # servers that each hold the whole model with room for many sessions. With c = 4 reserved, one
    # chain meets the target lambda / (rho_bar c) in the paper's model (1 / 0.9 s >= 3 / 2.8); when
    # sessions share a server's compute, 4 sessions keep it busy 0.1 + 4 x 0.4 = 1.7 s > 0.9 s, GBP-CR
    # needs a second chain, and GCA's chains stop where their server saturates (2 sessions)
    cl = make_cluster(
        [100.0] * 4, [0.5] * 4, [0.2] * 4, num_blocks=2, block_size=1.0, cache_size=1.0, arrival_rate=3.0, rho_bar=0.7
    )
    paper, cpu = plan(cl, c=4), plan(shared(cl, 0.1), c=4)

    def used(p):
        return {j for k in p.chains for j in k.servers}

    assert len(used(paper)) == 1 and len(used(cpu)) == 2
    assert [k.capacity for k in paper.chains] == [49] and [k.capacity for k in cpu.chains] == [2, 2]
    assert cpu.total_rate_per_s == pytest.approx(2 * 2 / 0.9) and cpu.total_rate_per_s > cl.arrival_rate_per_s
    for k in cpu.chains:  # 0.1 + 2 x 0.4 = 0.9: saturated exactly at its uncontended time
        assert k.service_time_s == pytest.approx(0.9)


def test_cluster_files_take_batch_overhead_and_reject_bad_values():
    base = {
        "blocks": 2,
        "block_size": 1,
        "cache_size": 0.1,
        "arrival_rate": 1,
        "servers": [{"name": "a", "memory": 4, "tau_c": 1, "tau_p": 0.1, "batch_overhead": 0.5}],
    }
    assert cluster_from_dict(base).servers[0].batch_overhead_s == 0.5
    base["servers"][0]["batch_overhead"] = -1
    with pytest.raises(InvalidClusterError, match="batch_overhead"):
        cluster_from_dict(base)


def test_the_orchestrator_marks_servers_shared_by_its_server_compute_setting():
    from orchestrator.service.registry import (
        ServerRecord,
        batch_overhead_s,
        build_cluster,
    )
    from orchestrator.session_times import SessionShape
    from petals_chain.algorithms.service_fit import ServiceFit
    from petals_chain.wire.records import ServerInfo

    shape = SessionShape(100, 21)
    info = ServerInfo("p", "m", 0, 4, "online", 4000, 100, 10, 2048, 40, 1e-4, 1e-3, name="p")
    bare, fitted = (
        ServerRecord(info, rtt_s=0.01),
        ServerRecord(info, rtt_s=0.01, fit=ServiceFit(2e-4, 1e-3, 0.05, 30, 0.1)),
    )
    assert batch_overhead_s(bare, shape, "auto") is None and batch_overhead_s(bare, shape, "parallel") is None
    assert batch_overhead_s(bare, shape, "shared") == 0.0
    assert batch_overhead_s(fitted, shape, "auto") == pytest.approx(21 * 0.05)
    assert batch_overhead_s(fitted, shape, "parallel") is None
    with pytest.raises(ValueError, match="auto, shared, parallel"):
        batch_overhead_s(fitted, shape, "gpu")
    cluster, _ = build_cluster([fitted], 4, shape, 0.1, 0.7, compute="auto")
    assert cluster.servers[0].batch_overhead_s == pytest.approx(21 * 0.05)


def test_a_batch_pays_the_per_block_part_once():
    # tau_p = 0.5 per block, of which 0.4 a batch pays once per block (the weights), 0.1 per session
    cl = make_cluster([10, 10], [1.0, 1.0], [0.5, 0.5], num_blocks=4)
    cl = replace(cl, servers=tuple(replace(sv, batch_overhead_s=0.2, batch_block_overhead_s=0.4) for sv in cl.servers))
    sv = cl.servers[0]
    assert sv.busy_s(blocks=4, sessions=1) == pytest.approx(0.2 + 4 * 0.5)  # alone: the lone time
    assert sv.busy_s(blocks=4, sessions=3) == pytest.approx(0.2 + 4 * 0.4 + 3 * 4 * 0.1)
    a = ChainSpec((0,), (BlockInterval(0, 4),), capacity=3, service_time_s=3.0)
    b = ChainSpec((0, 1), (BlockInterval(0, 2), BlockInterval(2, 4)), capacity=2, service_time_s=3.0)
    # server 0: blocks 0-3 used (chain b's [0, 2) inside chain a's [0, 4)): the per-block part once for 4 blocks
    assert server_busy_s(cl, [a, b])[0] == pytest.approx(0.2 + 4 * 0.4 + (3 * 4 + 2 * 2) * 0.1)
    # a chain saturates later than with tau_p all per session: spare (4 - 0.2 - 1.6) / (4 x 0.1) -> 6
    k = ChainSpec((0,), (BlockInterval(0, 4),), capacity=10, service_time_s=4.0)
    assert saturating_capacity(cl, k) == 6
    assert (
        saturating_capacity(replace(cl, servers=tuple(replace(s, batch_block_overhead_s=None) for s in cl.servers)), k)
        == 2
    )
    # GBP-CR's chain time for c sessions follows the same busy time
    res = gbp_cr(cl, 3)
    for k in res.chains:
        m = [res.placement.ranges[j].num_blocks for j in k]
        worst = max(cl.servers[j].busy_s(mj, 3) for j, mj in zip(k, m))
        lone = sum(cl.servers[j].tau_c_s + mj * cl.servers[j].tau_p_s for j, mj in zip(k, m))
        assert res.chain_times_s[res.chains.index(k)] == pytest.approx(max(worst, lone))


def test_cluster_files_take_batch_block_overhead_within_tau_p():
    base = {
        "blocks": 2,
        "block_size": 1,
        "cache_size": 0.1,
        "arrival_rate": 1,
        "servers": [
            {"name": "a", "memory": 4, "tau_c": 1, "tau_p": 0.1, "batch_overhead": 0.5, "batch_block_overhead": 0.08}
        ],
    }
    assert cluster_from_dict(base).servers[0].batch_block_overhead_s == 0.08
    base["servers"][0]["batch_block_overhead"] = 0.2  # more than tau_p
    with pytest.raises(InvalidClusterError, match="batch_block_overhead"):
        cluster_from_dict(base)


def test_the_fitted_t_B_goes_into_tau_p_and_is_not_planned_as_shared():
    from orchestrator.service.registry import (
        Overheads,
        ServerRecord,
        build_cluster,
        server_params,
    )
    from orchestrator.session_times import SessionShape
    from petals_chain.algorithms.service_fit import ServiceFit
    from petals_chain.wire.records import ServerInfo

    shape = SessionShape(100, 21)
    info = ServerInfo("p", "m", 0, 4, "online", 4000, 100, 10, 2048, 40, 1e-4, 1e-3, name="p")
    f = ServiceFit(2e-4, 1e-3, 0.05, 30, 0.1, t_B_s=0.01, blocks_separable=True)
    rec = ServerRecord(info, rtt_s=0.01, fit=f)
    tau_c, tau_p = server_params(rec, shape, Overheads())
    assert tau_p == pytest.approx(2e-4 * 100 + 1e-3 * 20 + 21 * 0.01)  # a session alone pays t_B every step
    assert tau_c == pytest.approx(21 * (0.01 + 0.05))  # t_o per step joins the RTT
    cluster, _ = build_cluster([rec], 4, shape, 0.1, 0.7, compute="auto")
    # each session pays t_B (out-of-phase steps on a pipelined server rarely batch): busy = n m tau_p
    assert cluster.servers[0].batch_block_overhead_s is None
    assert cluster.servers[0].busy_s(4, 3) == pytest.approx(21 * 0.05 + 3 * 4 * tau_p)


def test_a_contended_chain_keeps_its_lone_time_for_the_bound_and_jffc():
    from orchestrator.bounds import theorem37_bounds

    # one server holding the whole model: alone a session takes 10 s; 2 sessions keep it busy 18 s each
    lone = ChainSpec((0,), (BlockInterval(0, 4),), capacity=2, service_time_s=10.0)
    full = replace(lone, service_time_s=18.0, lone_time_s=10.0)
    assert full.dispatch_time_s == 10.0 and lone.dispatch_time_s == 10.0
    assert [full.session_time_s(i) for i in (1, 2)] == [10.0, 18.0]
    # at light load one session is in the chain most of the time: the lower bound is near the lone
    # time, not the full chain's 18 s; the chain's rate at capacity (2 / 18) is unchanged
    b = theorem37_bounds([full], 0.01)
    assert 10.0 <= b.lower_s < 11.5 and b.upper_s >= 18.0
    assert theorem37_bounds([full], 0.2).lower_s == math.inf  # 0.2 > 2 / 18: overloaded either way
    # a paper chain (no lone time) keeps the paper's bounds
    assert theorem37_bounds([lone], 0.01).lower_s == pytest.approx(theorem37_bounds([lone], 0.01).upper_s)


def test_contended_chains_record_the_lone_time_they_raised():
    cl = shared(make_cluster([10], [1.0], [0.5], num_blocks=4), [0.0])
    k = ChainSpec((0,), (BlockInterval(0, 4),), capacity=3, service_time_s=3.0)  # busy 3 x 4 x 0.5 = 6 s
    (out,) = contended_chains(cl, [k])
    assert out.lone_time_s == 3.0 and out.service_time_s > 3.0 and out.dispatch_time_s == 3.0
