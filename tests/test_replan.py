"""Re-planning a loaded swarm (orchestrator/replan.py, placement_gbp_cr.gbp_cr_fixed, the drain of
orchestrator/service/installed.py and Sessions.stop_granting): relabelling of equivalent servers, fixed
servers, the never-worse invariant, the move budget, the gain threshold and the drain state machine."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from orchestrator.model import BlockInterval, Placement
from orchestrator.placement_gbp_cr import gbp_cr, gbp_cr_fixed, max_capacity
from orchestrator.planner import plan
from orchestrator.replan import (
    constrained_placement,
    decide,
    equivalent_classes,
    evaluate,
    movers,
    not_worse,
    relabel,
)
from orchestrator.service.installed import Drain
from orchestrator.service.sessions import Sessions
from petals_chain.wire.messages import Hop
from tests.orchestrator_strategies import clusters, make_cluster, placements

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _twins(k: int, L: int = 4, lam: float = 3.0):
    """2k servers in k classes of two identical twins each (memories differ between classes)."""
    mem = [2.0 + 0.7 * (i // 2) for i in range(2 * k)]
    tc = [0.1 + 0.05 * (i // 2) for i in range(2 * k)]
    tp = [0.2 + 0.03 * (i // 2) for i in range(2 * k)]
    return make_cluster(mem, tc, tp, num_blocks=L, block_size=0.4, cache_size=0.05, arrival_rate=lam, rho_bar=0.7)


def _swap_twins(p: Placement, swaps: list[bool]) -> Placement:
    r = list(p.ranges)
    for i, s in enumerate(swaps):
        if s:
            r[2 * i], r[2 * i + 1] = r[2 * i + 1], r[2 * i]
    return Placement(tuple(r))


@settings(max_examples=60, **SETTINGS)
@given(st.integers(1, 4), st.data())
def test_a_plan_equal_up_to_swapped_twins_moves_nothing(k, data):
    cl = _twins(k)
    p = plan(cl, "proposed")
    swapped = _swap_twins(p.placement, data.draw(st.lists(st.booleans(), min_size=k, max_size=k)))
    assert equivalent_classes(cl, 0.0) == [i // 2 for i in range(2 * k)]
    assert relabel(swapped, p.placement, equivalent_classes(cl, 0.0)) == p.placement
    d = decide(cl, p.placement, evaluate(cl, swapped, p.c), installed_c=p.c)
    assert d.movers == () and not d.install and "nothing moves" in d.reason


@settings(max_examples=80, **SETTINGS)
@given(clusters(max_servers=7, max_blocks=6), st.data())
def test_relabelling_keeps_each_class_multiset_and_never_moves_more(cluster, data):
    target = data.draw(placements(cluster))
    installed = data.draw(placements(cluster))
    rel = data.draw(st.sampled_from([0.0, 0.1, 10.0]))
    cls = equivalent_classes(cluster, rel)
    out = relabel(target, installed, cls)
    for k in set(cls):
        a = sorted((r.start, r.end) if r else (-1, -1) for j, r in enumerate(target.ranges) if cls[j] == k)
        b = sorted((r.start, r.end) if r else (-1, -1) for j, r in enumerate(out.ranges) if cls[j] == k)
        assert a == b
    assert len(movers(installed, out)) <= len(movers(installed, target))
    # no server of a class could keep its range and does not: the matching is maximal
    for j, r in enumerate(installed.ranges):
        if r is not None and out.ranges[j] != r:
            kept = sum(1 for i, x in enumerate(out.ranges) if cls[i] == cls[j] and x == r and installed.ranges[i] == r)
            offered = sum(1 for i, x in enumerate(target.ranges) if cls[i] == cls[j] and x == r)
            assert kept == offered


@settings(max_examples=80, **SETTINGS)
@given(clusters(max_servers=8, max_blocks=6), st.integers(1, 6))
def test_gbp_cr_fixed_without_fixed_servers_is_alg1(cluster, c):
    assert gbp_cr_fixed(cluster, c, {}) == gbp_cr(cluster, c).placement


@settings(max_examples=80, **SETTINGS)
@given(clusters(max_servers=8, max_blocks=6), st.integers(1, 6), st.data())
def test_fixed_servers_keep_their_ranges_and_free_ones_get_alg1_sizes(cluster, c, data):
    L = cluster.service.num_blocks
    fixed = {}
    for j in data.draw(st.sets(st.integers(0, cluster.num_servers - 1), max_size=3)):
        m = data.draw(st.integers(1, L))
        s = data.draw(st.integers(0, L - m))
        fixed[j] = BlockInterval(s, s + m)
    p = gbp_cr_fixed(cluster, c, fixed)
    from orchestrator.placement_gbp_cr import blocks_per_server

    m = blocks_per_server(cluster, c)
    for j, r in enumerate(p.ranges):
        if j in fixed:
            assert r == fixed[j]
        elif r is not None:
            assert r.end - r.start == m[j] and 0 <= r.start < r.end <= L


def test_two_busy_servers_of_one_chain_keep_a_whole_chain_and_the_idle_ones_make_the_second():
    """Issue 54's case: 4 servers of two speeds, two chains [0,15)+[15,30); the loaded chain's servers are
    busy. The planner with them fixed keeps their chain and pairs the idle two into the other half each
    (never three on one half)."""
    cl = make_cluster(
        [2.2, 2.2, 2.2, 2.2],
        [0.1, 0.1, 0.12, 0.12],
        [0.2, 0.21, 0.3, 0.31],
        num_blocks=30,
        block_size=0.06,
        cache_size=0.001,
        arrival_rate=2.0,
        rho_bar=0.7,
    )
    fixed = {0: BlockInterval(0, 15), 1: BlockInterval(15, 30)}
    ev = constrained_placement(cl, fixed, 2, "lower")
    assert ev.placement.ranges[0] == fixed[0] and ev.placement.ranges[1] == fixed[1]
    halves = sorted((r.start, r.end) for r in ev.placement.ranges if r is not None)
    assert halves.count((0, 15)) <= 2 and halves.count((15, 30)) <= 2
    assert len(ev.chains) >= 1 and all(k.capacity >= 1 for k in ev.chains)


@settings(max_examples=60, **SETTINGS)
@given(clusters(max_servers=7, max_blocks=5), st.data())
def test_an_installed_decision_is_never_worse_than_the_installed_plan(cluster, data):
    """With no server lost: the step installed has no less total capacity and no higher model mean
    response (the tuning objective) than the installed placement on the same cluster; the step moves at
    most max_moves servers; below the gain threshold nothing moves."""
    installed = data.draw(placements(cluster))
    try:
        p = plan(cluster, "proposed")
    except ValueError:
        assume(False)
    fresh = evaluate(cluster, p.placement, p.c, p.chains)
    max_moves = data.draw(st.sampled_from([None, 1, 2]))
    min_gain = data.draw(st.sampled_from([0.0, 0.02, 0.5]))
    d = decide(cluster, installed, fresh, min_gain=min_gain, max_moves=max_moves, installed_c=p.c)
    base = evaluate(cluster, installed)
    assume(installed.used_servers())
    if d.install:
        assert not_worse(d.step, base, "lower")
        assert d.step.capacity >= base.capacity
        if d.movers:
            assert d.gain >= min_gain
            if max_moves is not None and d.pending_movers:
                assert len(d.movers) <= max_moves
        assert set(movers(installed, d.step.placement)) == set(d.movers)
    else:
        assert d.reason


def _three_servers():
    """The calibration test's swarm (tests/test_calibration.py) once its model moved: shared compute."""
    from orchestrator.model import Cluster, Server, Service

    sv = tuple(Server(n, m, 0.08, 0.0994, 0.002, 0.048) for n, m in (("pa", 1000.0), ("pb", 1200.0), ("pc", 1400.0)))
    return Cluster(Service(4, 100.0, 10.0), sv, 0.5, 0.7)


def test_the_gain_threshold_decides_whether_a_move_is_installed():
    """Installed: pa alone on [0, 4); the fresh plan splits it over pa and pb (4.7 % lower bound): moved at a
    threshold of 2 %, not at 10 % (the reason says so); an installed move is never worse."""
    cl = _three_servers()
    p = plan(cl, "proposed")
    installed = Placement((BlockInterval(0, 4), None, None))
    fresh = evaluate(cl, p.placement, p.c, p.chains)
    d = decide(cl, installed, fresh, installed_c=1, min_gain=0.02)
    assert d.install and d.movers == (0,) and d.gain == pytest.approx(0.0465, abs=1e-3)
    assert not_worse(d.step, d.baseline, "lower") and d.step.capacity > d.baseline.capacity
    d = decide(cl, installed, fresh, installed_c=1, min_gain=0.1)
    assert not d.install and not d.movers and "below the threshold 0.1" in d.reason


def test_the_drain_state_machine_honours_its_deadline_with_an_injected_clock():
    busy = {"a": 1, "b": 0}
    d = Drain(frozenset({"a", "b"}), started_s=10.0, deadline_s=70.0, pending=None)
    assert d.state(10.0, busy.get) == "draining"
    assert d.state(69.999, busy.get) == "draining"
    assert d.state(70.0, busy.get) == "deadline" and d.busy(busy.get) == ["a"]
    busy["a"] = 0
    assert d.state(20.0, busy.get) == "drained"
    with pytest.raises(ValueError):
        Drain(frozenset(), 10.0, 5.0, None)


def _chains():
    a, b, c, d = "pa", "pb", "pc", "pd"
    return [
        ((Hop(a, 0, 2), Hop(b, 2, 4)), 2, 1.0, 512),
        ((Hop(c, 0, 2), Hop(d, 2, 4)), 2, 2.0, 512),
        ((Hop(a, 0, 2), Hop(d, 2, 4)), 1, 1.5, 512),
    ]


@settings(max_examples=60, **SETTINGS)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["acq", "rel", "drain"]), st.integers(0, 7), st.sampled_from(["pa", "pb", "pc", "pd"])
        ),
        min_size=1,
        max_size=40,
    ),
    st.sampled_from(["jffc", "jsq", "sed"]),
)
def test_a_session_is_never_granted_on_a_draining_server(events, dispatch):
    s = Sessions(lease_ttl_s=100.0)
    s.install_chains(_chains(), 1, 0.0, dispatch=dispatch)
    draining: set[str] = set()
    t = 0.0
    live: set[str] = set()

    def check(grants):
        for g in grants:
            assert not {h.peer_id for h in g.hops} & draining, (g, draining)

    for kind, k, peer in events:
        t += 1.0
        sid = f"s{k}"
        if kind == "acq" and sid not in live and sid not in s.queue:
            mine, others = s.acquire(sid, "c", 64, t, timeout_s=1000)
            check([g for g in (mine, *others) if g is not None])
            live.add(sid)
        elif kind == "rel" and sid in live:
            check(s.release(sid, t))
            live.discard(sid)
        elif kind == "drain":
            draining.add(peer)
            check(s.stop_granting({peer}, t))
        for ch in s.chains.values():  # capacity is never exceeded, draining chains take no session
            assert ch.in_use <= ch.capacity
            if set(ch.peers) & draining:
                assert not ch.dispatchable
    for sid in list(live):
        check(s.release(sid, t + 1))


def test_sessions_on_an_identical_chain_are_carried_into_a_new_plan():
    """A re-plan that keeps a chain: its sessions count on the new chain (no slot granted twice)."""
    s = Sessions(lease_ttl_s=100.0)
    s.install_chains(_chains()[:1], 1, 0.0)
    g1, _ = s.acquire("s1", "c", 64, 0.0, timeout_s=100)
    g2, _ = s.acquire("s2", "c", 64, 0.0, timeout_s=100)
    assert g1 and g2
    s.install_chains(_chains()[:1], 2, 1.0)
    live = [c for c in s.chains.values() if c.dispatchable]
    assert len(live) == 1 and live[0].in_use == 2 and len(s.chains) == 1
    g3, _ = s.acquire("s3", "c", 64, 2.0, timeout_s=100)
    assert g3 is None  # capacity 2, both slots held
    s.release("s1", 3.0)
    assert s.take_grant("s3") is not None


def test_max_capacity_constrained_plan_tunes_c():
    cl = _twins(2)
    ev = constrained_placement(cl, {0: BlockInterval(0, 2)}, None, "lower")
    assert ev is not None and 1 <= ev.c <= max_capacity(cl) and math.isfinite(ev.lower_s)


def test_an_incremental_replan_never_composes_fewer_slots_than_the_installed_placement():
    """GCA is greedy, not monotone in the placement: here the joined copy of s5 would take blocks [0, 1) and
    GCA compose 19 slots from what formed 20 without it (a counterexample the property test below found);
    the repair leaves the joined server idle instead."""
    from dataclasses import replace

    from orchestrator.replan import incremental

    cluster = make_cluster([0, 0, 0, 3.0, 8.0, 1.25, 0, 0], [1.0] * 8, [1.0] * 8, num_blocks=3, rho_bar=0.5)
    p = plan(cluster, "proposed")
    cl = replace(cluster, servers=(*cluster.servers, replace(cluster.servers[5], name="joined")))
    inst = Placement((*p.placement.ranges, None))
    inc = incremental(cl, inst, p.c)
    before = evaluate(cl, inst, p.c)
    assert not movers(inst, inc.placement) and not_worse(inc, before, "lower")
    assert inc.capacity >= before.capacity == 20


@settings(max_examples=60, **SETTINGS)
@given(clusters(max_servers=8, max_blocks=5), st.data())
def test_an_incremental_replan_after_a_leave_or_join_is_held_to_the_whole_replan(cluster, data):
    """After one server leaves or joins an installed plan: the incremental re-plan (placed servers fixed)
    moves nobody and is never worse than the plan it repairs; decide() replaces it by the whole re-plan
    unless that gains less than min_gain, so what stays installed is within 1 / (1 - min_gain) of the
    whole re-plan's objective, or the whole re-plan has less total capacity (the stated bound)."""
    from dataclasses import replace

    try:
        p = plan(cluster, "proposed")
    except ValueError:
        assume(False)
    leave = data.draw(st.booleans())
    if leave:
        assume(cluster.num_servers >= 2)
        lost = data.draw(st.integers(0, cluster.num_servers - 1))
        keep = [j for j in range(cluster.num_servers) if j != lost]
        cl = replace(cluster, servers=tuple(cluster.servers[j] for j in keep))
        inst = Placement(tuple(p.placement.ranges[j] for j in keep))
    else:
        new = data.draw(st.sampled_from(cluster.servers))
        cl = replace(cluster, servers=(*cluster.servers, replace(new, name="joined")))
        inst = Placement((*p.placement.ranges, None))
    assume(inst.used_servers())
    from orchestrator.replan import incremental

    inc = incremental(cl, inst, p.c)
    assert not movers(inst, inc.placement)
    before = evaluate(cl, inst, p.c)
    assert not_worse(inc, before, "lower") or not inc.chains and not before.chains
    try:
        w = plan(cl, "proposed")
    except ValueError:
        return
    whole = evaluate(cl, w.placement, w.c, w.chains)
    min_gain = 0.05
    d = decide(cl, inst, whole, min_gain=min_gain, installed_c=p.c)
    got = d.step if d.install else before
    assert not_worse(got, before, "lower")
    if not d.movers:
        o_w, o_got = whole.objective("lower"), got.objective("lower")
        assert (
            whole.capacity < before.capacity
            or not not_worse(whole, before, "lower")
            or not math.isfinite(o_w)
            or o_got <= o_w / (1 - min_gain) * (1 + 1e-9)
            or whole.placement == got.placement
        )


def test_a_move_budget_moves_at_most_that_many_servers_per_step():
    """Four servers that hold two blocks each, all on [0, 2) (no chain); the plan wants two chains
    [0, 2) + [2, 4): two servers move. With a budget of 1, one moves (the step's chain is whole), one is
    left for the next re-plan; the step is never worse than the installed placement."""
    cl = make_cluster(
        [1.0] * 4,
        [0.1, 0.11, 0.12, 0.13],
        [0.2] * 4,
        num_blocks=4,
        block_size=0.4,
        cache_size=0.05,
        arrival_rate=3.0,
        rho_bar=0.7,
    )
    p = plan(cl, "proposed", c=1)
    assert sorted((r.start, r.end) for r in p.placement.ranges if r) == [(0, 2), (0, 2), (2, 4), (2, 4)]
    inst = Placement((BlockInterval(0, 2),) * 4)
    fresh = evaluate(cl, p.placement, p.c, p.chains)
    d = decide(cl, inst, fresh, installed_c=1)
    assert d.install and len(d.movers) == 2 and not d.pending_movers
    d = decide(cl, inst, fresh, installed_c=1, max_moves=1)
    assert d.install and len(d.movers) == 1 and len(d.pending_movers) == 1
    assert d.step.capacity >= 1 and not_worse(d.step, d.baseline, "lower")
    assert set(movers(inst, d.step.placement)) == set(d.movers)
