"""A session may avoid servers from its start (`open_session(..., avoid=...)`): the Table 1 model probe
measures one chain alone by avoiding every server outside it. The avoided servers reach the chain
provider's `exclude` at open, and stay excluded for every failover of the session."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from petals_chain.client.hop_client import HopFailed
from petals_chain.client.peer_health import PeerHealth
from petals_chain.client.recovery import Recovery
from petals_chain.client.remote_session import RemoteChainSession
from petals_chain.client.routing import ChainProvider
from petals_chain.client.session_context import SessionContext
from petals_chain.errors import NoChainError, OutOfCacheError, ServerMovingError, ServerUnavailableError
from petals_chain.wire.messages import Hop


def context(provider, *, max_failovers=3, busy_backoff_s=(0.0,), health=None) -> SessionContext:
    """A session's context without a network: these sessions never reach a server's stream."""
    return SessionContext(
        model="m",
        num_blocks=30,
        dtype=None,
        step_timeout_s=1.0,
        max_failovers=max_failovers,
        server_relay=True,
        loop=None,
        hops=None,
        provider=provider,
        peer_health=health if health is not None else PeerHealth(),
        relays=SimpleNamespace(dial=lambda peers: None),
        busy_backoff_s=busy_backoff_s,
    )


class RecordingProvider(ChainProvider):
    def __init__(self):
        self.calls = []

    def find_chain(self, start, end, *, exclude=frozenset(), max_length=0, session_id="", adapter=None):
        self.calls.append(frozenset(exclude))
        raise NoChainError("the test's provider has no chain")


def test_avoided_servers_are_excluded_when_the_session_opens():
    provider = RecordingProvider()
    chain = context(provider)
    with pytest.raises(NoChainError):
        RemoteChainSession(chain, 64, avoid=["peerA", "peerB"])
    assert provider.calls == [frozenset({"peerA", "peerB"})]
    with pytest.raises(NoChainError):
        RemoteChainSession(chain, 64)  # by default nothing is avoided
    assert provider.calls[-1] == frozenset()


def test_avoided_servers_stay_excluded_after_a_failure():
    recovery = Recovery(2, PeerHealth(), avoid=["peerA"])
    failed = SimpleNamespace(hop=SimpleNamespace(peer_id="peerC", describe=lambda: "peerC[0:30)"), error="reset")
    assert recovery.decide(failed, "step").action == "replace"
    assert recovery.exclude() == frozenset({"peerA", "peerC"}) and recovery.failovers == 1


def test_a_server_that_moves_is_replaced_for_the_session_but_banned_by_nobody():
    """A re-plan's forced move closes the session with ServerMovingError: the session fails over (one
    failover of its budget) and avoids that server from then on, but the client's ban list stays empty
    (the server is healthy and serves its new blocks to later sessions), even when the budget is spent."""
    health = PeerHealth()
    recovery = Recovery(1, health)
    moving = SimpleNamespace(
        hop=SimpleNamespace(peer_id="peerM", describe=lambda: "peerM[0:30)"), error=ServerMovingError("moving")
    )
    assert recovery.decide(moving, "step").action == "replace" and recovery.failovers == 1
    assert recovery.exclude() == frozenset({"peerM"}) and health.banned() == frozenset()
    assert recovery.failed_peers == set()
    with pytest.raises(ServerUnavailableError, match="gave up after 1 failovers"):
        recovery.decide(moving, "step")
    assert health.banned() == frozenset() and recovery.failed_peers == set()
    # any other failure still bans
    failed = SimpleNamespace(hop=SimpleNamespace(peer_id="peerC", describe=lambda: "peerC[0:30)"), error="reset")
    Recovery(2, health).decide(failed, "step")
    assert health.banned() == frozenset({"peerC"})


class GrantingProvider(ChainProvider):
    """Grants the same one-hop chain every time; records what the session asked and gave back."""

    def __init__(self):
        self.calls, self.finished = [], 0

    def find_chain(self, start, end, *, exclude=frozenset(), max_length=0, session_id="", adapter=None):
        self.calls.append(frozenset(exclude))
        return [Hop("peerA", 0, 30)]

    def session_finished(self, hops, *, session_id="", **_):
        self.finished += 1


class FullThenFreeSession(RemoteChainSession):
    """Its server refuses the first `full` opens for want of memory (OutOfCacheError), then takes it."""

    full = 2

    def _open_hops(self, hops, prefix_hashes):
        if self.full > 0:
            self.full -= 1
            raise HopFailed(
                hops[0],
                OutOfCacheError(
                    "this session needs 10.53 MiB of KV cache but only 6.57 MiB "
                    "of the server's budget is free; retry later"
                ),
            )
        return []


def test_a_full_server_makes_the_open_wait_not_fail_over():
    """A server that refuses an open for want of KV memory is up, only full: the open gives its grant
    back, waits, and asks again, without spending the failover budget or banning the server (two Table 1
    runs each lost a request that failed over from full server to full server); past its waits it is a
    failure like any other."""
    provider = GrantingProvider()
    health = PeerHealth()
    chain = context(provider, max_failovers=0, busy_backoff_s=(0.0, 0.0), health=health)
    session = FullThenFreeSession(chain, 64)
    assert session.failovers == 0 and session.recovery.busy == 2 and not session.failed_peers and not health.banned()
    assert provider.calls == [frozenset()] * 3 and provider.finished == 2  # the grant went back at each wait
    FullThenFreeSession.full = 3  # one more refusal than waits: then a failure, over a budget of 0
    with pytest.raises(ServerUnavailableError, match="gave up after 0 failovers.*retry later"):
        FullThenFreeSession(chain, 64)
