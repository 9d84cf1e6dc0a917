"""The client's lease heartbeat tells a released lease (a race, not a loss) from a lost one."""

from __future__ import annotations

import logging

import pytest

from petals_chain.client.orchestrated import OrchestratorChainProvider
from petals_chain.wire.messages import ChainGrant, HeartbeatReply


def _grant(chain_id: int) -> ChainGrant:
    return ChainGrant(session_id="s", chain_id=chain_id, plan_version=1, hops=[], service_time_s=1.0, lease_ttl_s=15.0)


@pytest.fixture
def provider():
    p = OrchestratorChainProvider(loop=None, p2p=None, orchestrator_peer_id="orch")
    yield p
    p.close()


def test_release_during_heartbeat_is_not_a_lost_lease(provider, monkeypatch, caplog):
    provider.grants = {"released": _grant(1), "refailed": _grant(2), "lost": _grant(3)}

    def fake_call(method, meta, timeout_s):
        assert method == "rpc_heartbeat" and sorted(meta.session_ids) == ["lost", "refailed", "released"]
        # while the heartbeat is in flight: one session is released, another fails over to a new grant
        provider.grants.pop("released")
        provider.grants["refailed"] = _grant(4)
        return HeartbeatReply(["released", "refailed", "lost"], lease_ttl_s=15.0).to_wire()

    monkeypatch.setattr(provider, "_call", fake_call)
    with caplog.at_level(logging.WARNING, logger="petals_chain.client.orchestrated"):
        assert provider.heartbeat_once() == ["lost"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "lost"[:8] in warnings[0]
    assert "lost" not in provider.grants and "refailed" in provider.grants  # a lost lease is reported once


def test_no_heartbeat_without_leases(provider, monkeypatch):
    monkeypatch.setattr(provider, "_call", lambda *a: pytest.fail("no lease, no heartbeat RPC"))
    assert provider.heartbeat_once() == []
