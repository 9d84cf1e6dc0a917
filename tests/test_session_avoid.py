"""A session may avoid servers from its start (`open_session(..., avoid=...)`): the Table 1 model probe
measures one chain alone by avoiding every server outside it. The avoided servers reach the chain
provider's `exclude` at open, and stay excluded for every failover of the session."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from petals_chain.client.hop_client import FailoverPolicy
from petals_chain.client.remote_session import RemoteChainSession
from petals_chain.errors import NoChainError


class RecordingProvider:
    def __init__(self):
        self.calls = []

    def find_chain(self, start, end, *, exclude=frozenset(), max_length=0, session_id="", adapter=None):
        self.calls.append(frozenset(exclude))
        raise NoChainError("the test's provider has no chain")


def test_avoided_servers_are_excluded_when_the_session_opens():
    provider = RecordingProvider()
    chain = SimpleNamespace(provider=provider, num_blocks=30, max_failovers=3, model="m")
    with pytest.raises(NoChainError):
        RemoteChainSession(chain, 64, avoid=["peerA", "peerB"])
    assert provider.calls == [frozenset({"peerA", "peerB"})]
    with pytest.raises(NoChainError):
        RemoteChainSession(chain, 64)  # by default nothing is avoided
    assert provider.calls[-1] == frozenset()


def test_avoided_servers_stay_excluded_after_a_failure():
    policy = FailoverPolicy(2, avoid=["peerA"])
    failed = SimpleNamespace(hop=SimpleNamespace(peer_id="peerC", describe=lambda: "peerC[0:30)"), error="reset")
    assert policy.on_failure(failed, "step") is False
    assert policy.exclude == frozenset({"peerA", "peerC"}) and policy.failovers == 1
