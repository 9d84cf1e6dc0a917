"""Reachability pieces without a network: circuit addresses in p2pd's binary form, relay routes from
records, the dial-back messages, p2pd's extra flags, the status page's mark, and ServerInfo's new fields."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, PeerID

from petals_chain.errors import InvalidRequestError
from petals_chain.swarm.reachability import (
    DialBackRequest,
    RelayRoutes,
    _ip_port,
    circuit_maddrs,
    encode_circuit,
    p2pd_flags,
    relay_peer_id,
    relayed_dht_kwargs,
    relayed_rtt_s,
)
from petals_chain.wire.records import Reachability, ServerInfo, ServerState

RELAY = "12D3KooWAmCZfRvtmdrqeznXwpfTMDuLpYYeLyAHPUwMU9DivFz7"


def _info(peer: str, reach=Reachability.DIRECT, relays=(), relay_rtt_s=None) -> ServerInfo:
    return ServerInfo(
        peer_id=peer,
        model="m",
        start=0,
        end=2,
        state=ServerState.ONLINE,
        memory_budget_bytes=1,
        block_bytes=1,
        kv_bytes_per_block=1,
        max_length_tokens=8,
        free_kv_slots=1,
        prefill_s_per_token=0.0,
        decode_s_per_token=0.0,
        reachability=reach,
        relay_maddrs=tuple(relays),
        relay_rtt_s=relay_rtt_s or {},
    )


def test_circuit_address_uses_the_bare_multihash_p2pd_parses():
    (maddr,) = circuit_maddrs([f"/ip4/10.213.0.1/tcp/31337/p2p/{RELAY}", "/ip4/10.0.0.1/tcp/1"])  # no id: skipped
    assert maddr == f"/ip4/10.213.0.1/tcp/31337/p2p/{RELAY}/p2p-circuit"
    raw = encode_circuit(maddr).to_bytes()
    mh = PeerID.from_base58(RELAY).to_bytes()
    assert raw.endswith(b"\xa5\x03" + bytes([len(mh)]) + mh + b"\xa2\x02")  # /p2p/<multihash>/p2p-circuit
    assert str(encode_circuit(maddr)) == maddr
    with pytest.raises(ValueError, match="p2p-circuit"):
        encode_circuit(f"/ip4/10.213.0.1/tcp/31337/p2p/{RELAY}")


def test_relay_routes_follow_the_records():
    routes = RelayRoutes()
    circuit = f"/ip4/10.213.0.1/tcp/1/p2p/{RELAY}/p2p-circuit"
    routes.update([_info("a"), _info("b", Reachability.RELAYED, [circuit])])
    assert routes.known == {"a", "b"} and routes.relayed("b") and not routes.relayed("a")
    routes.update([_info("b")])  # it became reachable (restarted with a forwarded port)
    assert not routes.relayed("b")


def test_a_relayed_servers_rtt_is_the_sum_over_its_best_relay():
    assert relay_peer_id(f"/ip4/10.213.0.1/tcp/1/p2p/{RELAY}/p2p-circuit") == RELAY
    assert relay_peer_id(f"/ip4/10.213.0.1/tcp/1/p2p/{RELAY}") == RELAY
    assert relay_peer_id("/ip4/10.0.0.1/tcp/1") is None
    # ours to relay r1 is 10 ms, the server's 20 ms; via r2 12 + 30; r3: we could not reach it
    assert relayed_rtt_s(
        {"r1": 0.010, "r2": 0.012, "r3": None}, {"r1": 0.020, "r2": 0.030, "r3": 0.001}
    ) == pytest.approx(0.030)
    assert relayed_rtt_s({"r1": None}, {"r1": 0.02}) is None  # no relay measured from both ends
    assert relayed_rtt_s({"r1": 0.01}, {"r2": 0.02}) is None
    routes = RelayRoutes()
    circuit = f"/ip4/10.213.0.1/tcp/1/p2p/{RELAY}/p2p-circuit"
    routes.update([_info("b", Reachability.RELAYED, [circuit], {RELAY: 0.015})])
    assert routes.server_to_relay_s == {"b": {RELAY: 0.015}}
    routes.update([_info("b")])  # reachable now: no relayed path to model
    assert routes.server_to_relay_s == {}
    wire = ServerInfo.from_wire(_info("b", Reachability.RELAYED, [circuit], {RELAY: 0.015}).to_wire())
    assert wire.relay_rtt_s == {RELAY: 0.015}


def test_connect_skips_direct_peers_and_redials_at_most_every_interval():
    calls = []

    class FakeClient:
        async def connect(self, peer, maddrs):
            calls.append((str(peer), [str(m) for m in maddrs]))

    class FakeP2P:
        _client = FakeClient()

    now = [100.0]
    routes = RelayRoutes(clock=lambda: now[0])
    peer = "12D3KooWH98L8RfJwyAgAW1TYyVHSN6gAc1XZT3bc3EgA5VLfMt6"
    circuit = f"/ip4/10.213.0.1/tcp/1/p2p/{RELAY}/p2p-circuit"
    routes.update([_info(peer, Reachability.RELAYED, [circuit]), _info(RELAY)])
    run = asyncio.run
    assert run(routes.connect(FakeP2P(), RELAY)) and calls == []  # direct: nothing to do
    assert run(routes.connect(FakeP2P(), peer, min_interval_s=5.0)) and calls == [(peer, [circuit])]
    now[0] += 1.0
    run(routes.connect(FakeP2P(), peer, min_interval_s=5.0))
    assert len(calls) == 1
    now[0] += 5.0
    run(routes.connect(FakeP2P(), peer, min_interval_s=5.0))
    assert len(calls) == 2


def test_dial_back_request_is_bounded():
    assert DialBackRequest.from_wire({"ports": [31337]}).ports == (31337,)
    for bad in ([], [0], [70000], [1, 2, 3, 4, 5]):
        with pytest.raises(InvalidRequestError):
            DialBackRequest.from_wire({"ports": bad})
    assert _ip_port("/ip4/10.213.0.3/tcp/35111") == ("10.213.0.3", 35111)
    assert _ip_port("/ip4/10.213.0.3/udp/1/quic") is None


def test_p2pd_flags_are_added_only_while_active_and_restored():
    before = P2P._make_process_args("p2pd", trustedRelays="x", relay=True)
    with p2pd_flags(relay_service=False):
        args = P2P._make_process_args("p2pd", trustedRelays="x", relay=True)
        plain = P2P._make_process_args("p2pd", relay=True)
    assert "-relayDiscovery=0" in args and "-relayService=0" in args
    assert "-relayDiscovery=0" not in plain and "-relayService=0" in plain
    assert P2P._make_process_args("p2pd", trustedRelays="x", relay=True) == before
    assert "-relayDiscovery=0" not in before
    kw = relayed_dht_kwargs([f"/ip4/10.213.0.1/tcp/1/p2p/{RELAY}"])
    assert kw["client_mode"] and kw["use_auto_relay"] and kw["force_reachability"] == "private"


def test_server_info_carries_reachability_and_old_records_read_as_direct():
    info = _info("b", Reachability.RELAYED, [f"/ip4/10.213.0.1/tcp/1/p2p/{RELAY}/p2p-circuit"])
    back = ServerInfo.from_wire(info.to_wire())
    assert back.reachability == Reachability.RELAYED and back.relay_maddrs == info.relay_maddrs
    old = {k: v for k, v in info.to_wire().items() if k not in ("reachability", "relay_maddrs")}
    assert ServerInfo.from_wire(old).reachability == Reachability.DIRECT
    with pytest.raises(InvalidRequestError, match="reachability"):
        ServerInfo.from_wire({**info.to_wire(), "reachability": "teleported"})


def test_status_page_marks_relayed_servers():
    from orchestrator.service.http import _relayed_mark

    assert 'class="relayed"' in _relayed_mark({"reachability": "relayed"})
    assert _relayed_mark({"reachability": "direct"}) == "" and _relayed_mark({}) == ""
