"""Pure tests of the online orchestrator's sessions owner, measurements and registry (no network)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.cluster_io import cluster_from_dict
from orchestrator.planner import make_baseline_router, plan
from orchestrator.service.measurements import LengthEstimator
from orchestrator.service.registry import (
    Overheads,
    ServerRecord,
    build_cluster,
    cluster_to_dict,
)
from orchestrator.service.sessions import Sessions
from orchestrator.session_times import SessionShape, tau_c_s, tau_p_s
from petals_chain.wire.messages import Hop
from petals_chain.wire.records import ServerInfo


def hops(*peers):
    n = len(peers)
    return tuple(Hop(p, i * 10, (i + 1) * 10) for i, p in enumerate(peers)) if n else ()


def chains_cap6():
    # total capacity 6: fast chain (a,b,c) cap 2, mid (d,e,f) cap 3, slow (g,h,i) cap 1
    return [
        (hops("a", "b", "c"), 2, 1.0, 4096),
        (hops("d", "e", "f"), 3, 2.0, 4096),
        (hops("g", "h", "i"), 1, 3.0, 4096),
    ]


def test_capacity_never_exceeded_and_fifo_with_12_sessions():
    ds = Sessions(lease_ttl_s=30)
    ds.install_chains(chains_cap6(), 1, 0.0)
    granted, order = {}, []
    for i in range(12):
        g, others = ds.acquire(f"s{i}", "c", 64, float(i), timeout_s=100)
        assert not others
        if g:
            granted[g.session_id] = g.chain_id
    assert len(granted) == 6 and ds.queue_length == 6
    # fastest chain first: s0,s1 on the fast chain, s2..s4 on mid, s5 on slow
    fast = [c for c in ds.chains.values() if c.service_time_s == 1.0][0].chain_id
    assert granted["s0"] == granted["s1"] == fast
    rng = np.random.default_rng(1)
    t = 12.0
    running = list(granted)
    while running:
        for ch in ds.chains.values():
            assert ch.in_use <= ch.capacity
        done = running.pop(int(rng.integers(len(running))))
        t += 1
        grants = ds.release(done, t)
        for g in grants:
            order.append(g.session_id)
            running.append(g.session_id)
            assert g.chain_id == granted[done]  # the head takes exactly the freed slot (Alg. 3 line 7-8)
            granted[g.session_id] = g.chain_id
    assert order == [f"s{i}" for i in range(6, 12)]  # FIFO
    assert ds.metrics.admitted == 12 and all(c.in_use == 0 for c in ds.chains.values())


def test_lease_expiry_returns_slot_to_queue_head():
    ds = Sessions(lease_ttl_s=5)
    ds.install_chains([(hops("a"), 1, 1.0, 4096)], 1, 0.0)
    g, _ = ds.acquire("crashed", "c1", 8, 0.0, timeout_s=100)
    assert g is not None
    assert ds.acquire("next", "c2", 8, 1.0, timeout_s=100)[0] is None
    assert ds.heartbeat("crashed", 4.0)  # renewed until 9.0
    assert ds.expire(8.0) == ([], [])
    expired, grants = ds.expire(9.5)
    assert expired == ["crashed"] and [x.session_id for x in grants] == ["next"]
    assert grants[0].wait_s == pytest.approx(8.5)
    assert not ds.heartbeat("crashed", 10.0)  # the crashed client's lease is gone
    assert ds.metrics.expired == 1


def test_waiter_timeout_and_exclusion_and_max_length():
    ds = Sessions()
    ds.install_chains([(hops("a", "b"), 1, 1.0, 128), (hops("c", "d"), 1, 2.0, 4096)], 1, 0.0)
    g, _ = ds.acquire("s1", "c", 8, 0.0, timeout_s=10, exclude=frozenset({"a"}))
    assert g.hops[0].peer_id == "c"  # the fast chain holds an excluded server
    g2, _ = ds.acquire("s2", "c", 1000, 0.0, timeout_s=10)  # too long for the fast chain
    assert g2 is None and ds.fits_any(1000) and not ds.fits_any(5000)
    assert ds.timeouts(9.0) == [] and ds.timeouts(10.0) == ["s2"] and ds.queue_length == 0
    # failover: a session that holds a lease re-acquires excluding its failed server
    g3, _ = ds.acquire("s1", "c", 8, 11.0, timeout_s=10, exclude=frozenset({"d"}))
    assert g3.hops[0].peer_id == "a" and len(ds.leases) == 1


def test_dropped_server_takes_its_chains_and_leases():
    ds = Sessions()
    ds.install_chains(chains_cap6(), 1, 0.0)
    for i in range(6):
        ds.acquire(f"s{i}", "c", 8, 0.0, timeout_s=10)
    dropped, grants = ds.drop_servers({"e"})
    assert grants == []
    assert sorted(dropped) == ["s2", "s3", "s4"]
    assert all("e" not in c.peers for c in ds.chains.values())
    g, _ = ds.acquire("new", "c", 8, 1.0, timeout_s=10)
    assert g is None  # the survivors are full
    assert [x.session_id for x in ds.release("s0", 2.0)] == ["new"]


def test_no_live_chain_queues_instead_of_refusing_the_length():
    """Churn can take a server out of every chain at once: that says nothing about lengths, so a new
    session must queue for the next plan, not get MaxLengthExceededError (the soak's 100 failures)."""
    ds = Sessions()
    ds.install_chains([(hops("a", "b"), 2, 1.0, 256)], 1, 0.0)
    assert ds.refuses_length(300) and not ds.refuses_length(20)
    ds.drop_servers({"b"})
    assert not ds.chains and not ds.fits_any(20)
    assert not ds.refuses_length(20) and not ds.refuses_length(300)
    g, _ = ds.acquire("s", "c", 20, 1.0, timeout_s=10)
    assert g is None and ds.queue_length == 1
    grants = ds.install_chains([(hops("c", "d"), 1, 1.0, 256)], 2, 2.0)
    assert [x.session_id for x in grants] == ["s"]


def test_replan_drains_old_chains():
    ds = Sessions()
    ds.install_chains([(hops("a"), 2, 1.0, 4096)], 1, 0.0)
    ds.acquire("old", "c", 8, 0.0, timeout_s=10)
    ds.install_chains([(hops("b"), 1, 1.0, 4096)], 2, 1.0)
    old = [c for c in ds.chains.values() if not c.dispatchable]
    assert len(old) == 1 and old[0].in_use == 1 and old[0].capacity == 1
    g, _ = ds.acquire("x", "c", 8, 1.0, timeout_s=10)
    assert g.hops[0].peer_id == "b" and g.plan_version == 2
    assert ds.acquire("y", "c", 8, 1.0, timeout_s=10)[0] is None  # the draining chain takes no one
    ds.release("old", 2.0)
    assert all(c.dispatchable for c in ds.chains.values())


def small_cluster():
    return cluster_from_dict(
        {
            "blocks": 4,
            "block_size": 1,
            "cache_size": 1,
            "arrival_rate": 0.5,
            "servers": [
                {"name": "p0", "memory": 6, "tau_c": 0.1, "tau_p": 0.05, "rtt": 0.01},
                {"name": "p1", "memory": 6, "tau_c": 0.2, "tau_p": 0.05, "rtt": 0.02},
                {"name": "p2", "memory": 8, "tau_c": 0.1, "tau_p": 0.1, "rtt": 0.01},
            ],
        }
    )


@pytest.mark.parametrize("policy", ["petals", "bprr"])
def test_router_mode_admits_and_queues(policy):
    cluster = small_cluster()
    p = plan(cluster, policy)
    router = make_baseline_router(policy, cluster, p.placement)
    ds = Sessions()
    ds.install_router(router, ["p0", "p1", "p2"], {"p0": 4096, "p1": 4096, "p2": 4096}, 1, 0.0)
    admitted, queued = [], []
    for i in range(12):
        g, _ = ds.acquire(f"s{i}", "c", 8, 0.0, timeout_s=10)
        (admitted if g else queued).append(f"s{i}")
    assert admitted and queued
    assert router.queue_length == ds.queue_length == len(queued)
    assert all(s >= 0 for s in router.free_slots)
    ds.timeouts(10.0)
    assert router.queue_length == 0 and ds.queue_length == 0
    for s in admitted:
        ds.release(s, 11.0)
    assert router.free_slots == router.total_slots


def test_footnote11_and_lengths():
    shape = SessionShape(100, 20)
    assert tau_p_s(1e-3, 2e-3, shape, 1e-3) == pytest.approx(1e-3 + 0.1 + 0.038)
    assert tau_c_s(0.01, shape, 0.002) == pytest.approx(20 * 0.012)
    est = LengthEstimator(SessionShape(100, 20), prior_weight=1)
    est.observe(300, 40)
    est.observe(0, 0)  # ignored
    assert est.shape == SessionShape(200, 30)
    # a prior stated for a whole workload (250 sessions' worth) is moved little by a few sessions
    heavy = LengthEstimator(SessionShape(100, 20), prior_weight=250)
    for _ in range(14):
        heavy.observe(160, 14)
    assert heavy.shape.mean_output_tokens == pytest.approx((250 * 20 + 14 * 14) / 264)
    assert 19.5 < heavy.shape.mean_output_tokens < 20


def test_registry_builds_plan_input():
    def info(peer, mem):
        return ServerInfo(peer, "m", 0, 0, "joining", mem, 100, 10, 2048, 0, 1e-3, 2e-3)

    recs = [
        ServerRecord(info("zz", 5000), 0.01),
        ServerRecord(info("aa", 3000), 0.02),
        ServerRecord(info("mm", 1), None),
    ]
    cluster, peers = build_cluster(recs, 30, SessionShape(10, 5), 0.5, 0.7, Overheads(0.001, 0.0))
    assert peers == ["aa", "zz"]  # unmeasured servers are left out; sorted by peer id
    assert cluster.servers[0].tau_c_s == pytest.approx(5 * 0.02)
    assert cluster.servers[1].tau_p_s == pytest.approx(0.001 + 1e-3 * 10 + 2e-3 * 4)
    assert cluster_from_dict(cluster_to_dict(cluster)) == cluster


def test_joining_record_without_blocks_is_valid_only_when_joining():
    from petals_chain.errors import InvalidRequestError

    joining = ServerInfo("p", "m", 0, 0, "joining", 1, 1, 1, 1, 0, 0.1, 0.1)
    assert ServerInfo.from_wire(joining.to_wire()) == joining and not joining.has_blocks
    with pytest.raises(InvalidRequestError):
        ServerInfo.from_wire({**joining.to_wire(), "state": "online"})


def test_replan_keeps_busy_and_fixed_servers_unless_forced():
    from orchestrator.model import BlockInterval as R
    from orchestrator.service.registry import HeldRange, keep_held_ranges

    fresh = [R(0, 10), R(10, 30), None, R(0, 30)]
    peers = ["busy", "idle", "fixed", "same"]
    held = {
        "busy": HeldRange(5, 20, busy=True),
        "idle": HeldRange(0, 5),
        "fixed": HeldRange(20, 30, fixed=True),
        "same": HeldRange(0, 30, busy=True),
    }
    out, pinned = keep_held_ranges(fresh, peers, held)
    assert out == [R(5, 20), R(10, 30), R(20, 30), R(0, 30)] and pinned == ["busy", "fixed"]
    out, pinned = keep_held_ranges(fresh, peers, held, force=True)
    assert out == [R(0, 10), R(10, 30), R(20, 30), R(0, 30)] and pinned == ["fixed"]  # --blocks START:END never moves


def test_metrics_text_and_status_page_render_without_a_network():
    import threading
    from types import SimpleNamespace

    from orchestrator.service.http import PALETTE, metrics_text, status_html

    ds = Sessions()
    ds.install_chains(chains_cap6(), 3, 0.0)
    for i in range(8):
        ds.acquire(f"s{i}", "c", 8, float(i), timeout_s=100)
    ds.release("s0", 20.0)  # s6 waited 14 s
    orch = SimpleNamespace(lock=threading.RLock(), sessions=ds, current=SimpleNamespace(version=3))
    text = metrics_text(orch)
    assert "petals_chain_sessions_admitted_total 7" in text and "petals_chain_plan_version 3" in text
    assert "petals_chain_queue_length 1" in text
    buckets = [
        int(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("petals_chain_queue_wait_seconds_bucket")
    ]
    assert buckets == sorted(buckets) and buckets[-1] == 7  # cumulative; +Inf = all admitted
    assert 'petals_chain_queue_wait_seconds_bucket{le="10.0"} 6' in text  # s6's 14 s wait is above 10 s
    for line in text.splitlines():  # every sample line is "name{labels} value" or "name value"
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value)
            assert (
                name.replace("_", "a")
                .replace("{", "")
                .replace("}", "")
                .replace('"', "")
                .replace("=", "")
                .replace(".", "")
                .replace("+", "")
                .isalnum()
            )
    status = {
        "model": "m",
        "policy": "proposed",
        "plan_version": 3,
        "plan_installed": True,
        "c": 3,
        "sessions": 6,
        "queue_length": 1,
        "num_blocks": 30,
        "events": ["x <b>"],
        "servers": [
            {
                "peer_id": p,
                "name": p,
                "start": 10 * i,
                "end": 10 * i + 10,
                "state": "online",
                "memory": 2**28,
                "rtt": 0.001,
                "tau_c": 0.03,
                "tau_p": 0.05,
                "active_sessions": 1,
            }
            for i, p in enumerate("abc")
        ],
        "chains": ds.chain_views(),
    }
    page = status_html(status)
    assert page.count(f"background:{PALETTE[0]}") >= 10 and "x &lt;b&gt;" in page and "queue length" in page


def test_a_waiter_whose_client_stops_polling_leaves_the_queue():
    ds = Sessions()
    ds.install_chains([(hops("a"), 1, 1.0, 4096)], 1, 0.0)
    ds.acquire("running", "c", 8, 0.0, timeout_s=100)
    ds.acquire("crashed", "c", 8, 0.0, timeout_s=100)
    ds.acquire("alive", "c", 8, 0.0, timeout_s=100)
    ds.touch("alive", 20.0)
    assert ds.abandoned(24.0, 25.0) == []
    assert ds.abandoned(30.0, 25.0) == ["crashed"]
    assert [g.session_id for g in ds.release("running", 31.0)] == ["alive"]


def test_first_plan_waits_for_the_expected_servers_measured_or_the_expected_wait():
    from orchestrator.service.core import first_plan_due

    # 9 expected, 6 measured (3 missed their RTT probes while loading), settled: wait
    assert not first_plan_due(
        100.0, 6, 9, last_change_s=10.0, settle_s=5.0, first_registration_s=0.0, expected_wait_s=180.0
    )
    assert first_plan_due(
        100.0, 9, 9, last_change_s=99.0, settle_s=5.0, first_registration_s=0.0, expected_wait_s=180.0
    )  # all measured: at once, settled or not
    assert first_plan_due(
        181.0, 6, 9, last_change_s=10.0, settle_s=5.0, first_registration_s=0.0, expected_wait_s=180.0
    )  # gave up waiting: plan with the measured ones
    assert not first_plan_due(
        181.0, 6, 9, last_change_s=179.0, settle_s=5.0, first_registration_s=0.0, expected_wait_s=180.0
    )  # ... but not while servers still arrive
    # without --expected-servers: settling decides
    assert not first_plan_due(
        12.0, 3, 0, last_change_s=10.0, settle_s=5.0, first_registration_s=0.0, expected_wait_s=180.0
    )
    assert first_plan_due(15.0, 3, 0, last_change_s=10.0, settle_s=5.0, first_registration_s=0.0, expected_wait_s=180.0)


def test_a_grant_is_logged_with_the_session_id(caplog):
    """An API gateway puts its request id into session ids: the orchestrator's log names it."""
    ds = Sessions(lease_ttl_s=30)
    ds.install_chains(chains_cap6(), 1, 0.0)
    with caplog.at_level("INFO", logger="orchestrator.service.sessions"):
        grant, _ = ds.acquire("trace-7f3a.0.1234abcd", "gateway", 64, 0.0, timeout_s=10)
    assert grant is not None
    assert any(
        "session trace-7f3a.0.1234abcd of gateway" in r.getMessage()
        and f"chain {grant.chain_id} granted" in r.getMessage()
        for r in caplog.records
    )
