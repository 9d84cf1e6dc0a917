"""The model follows the relay (footnote 4): with server relay tau_c_j = max_i tau_c_ij, one one-way
leg (RTT_ij / 2) per step from each possible predecessor i (the client, the other servers, whose RTTs
the servers report), and the chain's service time follows."""

from __future__ import annotations

import pytest

from orchestrator.service.registry import Overheads, ServerRecord, build_cluster
from orchestrator.session_times import SessionShape, tau_c_relay_s, tau_c_s
from petals_chain.wire.records import ServerInfo


def _record(peer: str, rtt_s: float, peer_rtt_s: dict[str, float]) -> ServerRecord:
    info = ServerInfo(peer, "m", 0, 0, "joining", 5000, 100, 10, 2048, 0, 1e-3, 2e-3, peer_rtt_s=peer_rtt_s)
    return ServerRecord(info, rtt_s)


def test_tau_c_relay_is_the_worst_predecessors_one_way_legs():
    shape = SessionShape(10, 8)
    assert tau_c_relay_s([0.05, 0.02, 0.08], shape, 0.001) == pytest.approx(8 * (0.04 + 0.001))
    assert tau_c_relay_s([0.05], shape) == pytest.approx(tau_c_s(0.05, shape) / 2)
    with pytest.raises(ValueError):
        tau_c_relay_s([], shape)


def test_registry_uses_reported_server_to_server_rtts_with_server_relay():
    shape = SessionShape(10, 5)
    # a-b are close (10 ms both ways, reported by one side only), c is far from both (120 ms)
    recs = [_record("a", 0.05, {"b": 0.01, "c": 0.12}), _record("b", 0.05, {"c": 0.12}), _record("c", 0.03, {})]
    client, _ = build_cluster(recs, 30, shape, 0.5, 0.7, Overheads(0.0, 0.0), relay="client")
    server, peers = build_cluster(recs, 30, shape, 0.5, 0.7, Overheads(0.0, 0.0), relay="server")
    assert peers == ["a", "b", "c"]
    assert [s.tau_c_s for s in client.servers] == pytest.approx([5 * 0.05, 5 * 0.05, 5 * 0.03])
    # max over predecessors of RTT / 2 per step: the far server c dominates everyone's worst case
    assert [s.tau_c_s for s in server.servers] == pytest.approx([5 * 0.06, 5 * 0.06, 5 * 0.06])
    with pytest.raises(ValueError):
        build_cluster(recs, 30, shape, 0.5, 0.7, relay="carrier-pigeon")


def _info(peer: str, start: int, end: int) -> ServerInfo:
    return ServerInfo(peer, "m", start, end, "online" if end > start else "joining", 5000, 100, 10, 2048, 0, 1e-3, 2e-3)


def test_servers_probe_the_peers_a_chain_can_pass_to_first_and_stay_bounded():
    from server.peer_rtts import can_adjoin, choose_peers

    me = (10, 20)
    infos = [
        _info("me", *me),
        _info("next", 20, 30),
        _info("prev", 0, 10),
        _info("overlap-end", 15, 25),
        _info("inside", 12, 18),
        _info("far", 25, 30),
        _info("auto", 0, 0),
    ]
    adjoin = {i.peer_id for i in infos[1:] if can_adjoin(*me, i)}
    # next/prev: the usual chain; overlap-end: entered at 20 after me, or (ends at 25) not before me;
    # inside: ends at 18, so I can be entered there after it; auto: no blocks yet, may go anywhere
    assert adjoin == {"next", "prev", "overlap-end", "inside", "auto"}
    assert choose_peers("me", *me, infos, 8) == ["auto", "inside", "next", "overlap-end", "prev", "far"]
    assert choose_peers("me", *me, infos, 2) == ["auto", "inside"]
    assert choose_peers("me", 0, 0, infos, 3) == ["auto", "far", "inside"]  # no blocks yet: anyone, by id


def test_peer_rtts_keep_the_median_reprobe_when_due_and_forget_departed_peers():
    from server.peer_rtts import PeerRtts

    rtts = PeerRtts(max_peers=4, probes=3, period_s=30.0)
    pings = {"a": iter([0.5, 0.02, 0.03]), "b": iter([None, None, None])}  # a: the first ping dials
    assert rtts.due(["a", "b"], now_s=0.0) == ["a", "b"]
    assert rtts.measure("a", lambda p: next(pings[p]), 0.0) == pytest.approx(0.03)
    assert rtts.measure("b", lambda p: next(pings[p]), 0.0) is None
    assert rtts.view() == {"a": pytest.approx(0.03)}  # a silent peer is not reported
    assert rtts.due(["a", "b"], now_s=10.0) == []
    assert rtts.due(["a", "b"], now_s=30.0) == ["a", "b"]
    assert rtts.due(["b"], now_s=31.0) == ["b"] and rtts.view() == {}  # a left the DHT (or the bound)
    with pytest.raises(ValueError):
        PeerRtts(probes=0)


def test_reported_peer_rtts_reach_the_planned_tau_c():
    """Two servers 80 ms apart by their own reports: with server relay each one's tau_c is the far
    predecessor's leg (40 ms per step), not the client's (10 ms); client relay ignores the reports."""
    shape = SessionShape(10, 4)
    recs = [_record("a", 0.02, {"b": 0.08}), _record("b", 0.02, {})]
    server, _ = build_cluster(recs, 30, shape, 0.5, 0.7, Overheads(0.0, 0.0), relay="server")
    assert [s.tau_c_s for s in server.servers] == pytest.approx([4 * 0.04, 4 * 0.04])
    recs = [_record("a", 0.02, {}), _record("b", 0.02, {})]
    unreported, _ = build_cluster(recs, 30, shape, 0.5, 0.7, Overheads(0.0, 0.0), relay="server")
    assert [s.tau_c_s for s in unreported.servers] == pytest.approx([4 * 0.01, 4 * 0.01])
