"""The model follows the relay (footnote 4): with server relay tau_c_j = max_i tau_c_ij, one one-way
leg (RTT_ij / 2) per step from each possible predecessor i (the client, the other servers, whose RTTs
the servers report), and the chain's service time follows."""
from __future__ import annotations

import pytest

from orchestrator.service.registry import Overheads, ServerRecord, build_cluster
from orchestrator.session_times import SessionShape, tau_c_relay_s, tau_c_s
from petals_chain.wire import ServerInfo


def _record(peer: str, rtt_s: float, peer_rtt_s: dict[str, float]) -> ServerRecord:
    info = ServerInfo(peer, "m", 0, 0, "joining", 5000, 100, 10, 2048, 0, 1e-3, 2e-3, extra={"peer_rtt_s": peer_rtt_s})
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
