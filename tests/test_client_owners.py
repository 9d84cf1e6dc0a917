"""One owner for each piece of the client's shared state (DESIGN.md, the client's paragraphs):

- `PeerHealth`: a failed server's ban doubles with each failure in a row, expires, and is forgotten;
- `Lease`: a session's hold on its chain is released once, whatever closes it and how often;
- a long-lived provider (a gateway's) keeps nothing of a session after it ended: 1,000 sessions
  leave its containers as they were after the first ones;
- a server that failed one session is tried by no later session of the client until its ban expires
  (the live version, on real servers, is tests/test_stream_recovery.py's dead-replacement test).

The sessions here are real `RemoteChainSession`s on a real `OrchestratorChainProvider` and a real
event loop; what is faked is the network's far side: the orchestrator's replies at the provider's
RPC boundary (`_call`) and the servers at the `HopClient`'s (`open_async`, `step_async`).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from petals_chain.client.hop_client import HopClient, HopStream, StepResult
from petals_chain.client.lease import Lease
from petals_chain.client.orchestrated import OrchestratorChainProvider
from petals_chain.client.peer_health import PeerHealth
from petals_chain.client.remote_session import RemoteChainSession
from petals_chain.client.session_context import RelayDialer, SessionContext
from petals_chain.errors import OrchestratorUnavailableError, OutOfCacheError, ServerUnavailableError
from petals_chain.process.loop import BackgroundLoop
from petals_chain.wire import parts as wire_parts
from petals_chain.wire.messages import ChainGrant, Granted, HeartbeatReply, Hop, Release, Released, StepReply

NUM_BLOCKS = 4
HIDDEN = 8


class Clock:
    def __init__(self, now_s: float = 1000.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


# -- PeerHealth --------------------------------------------------------------------------------


def test_a_ban_doubles_with_each_failure_in_a_row_and_expires():
    clock = Clock()
    health = PeerHealth(base_ban_s=15.0, backoff_rate=2.0, max_ban_s=60.0, clock=clock)
    assert health.report_failure("A") == 15.0
    clock.now_s += 14.9
    assert health.banned() == {"A"}
    clock.now_s += 0.1
    assert health.banned() == frozenset()  # expired
    assert health.report_failure("A") == 30.0  # failed again once tried: doubled
    clock.now_s += 29.9
    assert "A" in health.banned()
    clock.now_s += 0.1
    assert health.report_failure("A") == 60.0 and health.standing("A").failures == 3
    clock.now_s += 60.0
    assert health.report_failure("A") == 60.0  # capped at max_ban_s
    health.report_success(["A"])  # it served a request: its failures are forgotten
    assert health.banned() == frozenset() and health.report_failure("A") == 15.0


def test_failures_seen_while_a_ban_runs_are_the_same_outage():
    """Sessions that held the dead server before it was banned each fail on it: one outage, one ban."""
    clock = Clock()
    health = PeerHealth(clock=clock)
    barrier = threading.Barrier(16)

    def fail() -> None:
        barrier.wait()
        health.report_failure("A")

    threads = [threading.Thread(target=fail) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert health.standing("A").failures == 1 and health.standing("A").until_s == clock.now_s + 15.0


def test_an_expired_ban_is_forgotten_after_a_while_so_the_list_stays_short():
    clock = Clock()
    health = PeerHealth(base_ban_s=15.0, forget_after_s=100.0, clock=clock)
    for p in ("A", "B", "C"):
        health.report_failure(p)
    clock.now_s += 15.0 + 99.0
    assert len(health) == 3 and health.banned() == frozenset()  # remembered: a new failure doubles
    clock.now_s += 1.0
    assert health.banned() == frozenset() and len(health) == 0
    assert health.report_failure("A") == 15.0  # a fresh start


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["fail", "success", "wait"]), st.sampled_from("ABC"), st.floats(0.0, 100.0)),
        max_size=40,
    )
)
def test_a_failed_server_is_banned_at_least_base_and_at_most_max_ban_s(ops):
    clock = Clock(0.0)
    health = PeerHealth(base_ban_s=10.0, max_ban_s=80.0, forget_after_s=50.0, clock=clock)
    last_failure: dict[str, float] = {}
    for op, peer, dt in ops:
        if op == "fail":
            health.report_failure(peer)
            last_failure.setdefault(peer, clock.now_s)
        elif op == "success":
            health.report_success([peer])
            last_failure.pop(peer, None)
        else:
            clock.now_s += dt
        banned = health.banned()
        for p, since_s in list(last_failure.items()):
            if clock.now_s < since_s + 10.0:
                assert p in banned  # at least base_ban_s after the failure that banned it
            if clock.now_s >= since_s + 80.0:
                assert p not in banned  # at most max_ban_s
                last_failure.pop(p)  # a later failure starts a new ban
        assert banned <= set("ABC") and len(health) <= 3


# -- a session's lease, through a real provider and loop ----------------------------------------


class FakeOrchestrator:
    """The orchestrator's side of rpc_acquire / rpc_release / rpc_heartbeat, at the provider's RPC
    boundary: grants the first of `peers` (one hop each) outside the request's exclude, moves a held
    lease on a second acquire of the same session, and counts what it was sent."""

    def __init__(self, peers: list[str]):
        self.peers = peers
        self.lock = threading.Lock()
        self.leases: dict[str, ChainGrant] = {}
        self.acquires: Counter[str] = Counter()
        self.releases: Counter[str] = Counter()
        self.excludes: list[frozenset[str]] = []
        self.unknown_releases = 0  # a release of a lease not held: a double release

    def call(self, method, meta, timeout_s):
        with self.lock:
            if method == "rpc_acquire":
                self.acquires[meta.session_id] += 1
                self.excludes.append(frozenset(meta.exclude))
                peer = next(p for p in self.peers if p not in meta.exclude)
                grant = ChainGrant(
                    meta.session_id,
                    chain_id=self.peers.index(peer),
                    plan_version=1,
                    hops=(Hop(peer, 0, NUM_BLOCKS),),
                    service_time_s=1.0,
                    lease_ttl_s=15.0,
                    wait_s=0.25,
                )
                self.leases[meta.session_id] = grant
                return Granted(grant).to_wire()
            if method == "rpc_release":
                self.releases[meta.session_id] += 1
                known = self.leases.pop(meta.session_id, None) is not None
                self.unknown_releases += not known
                return Released(known).to_wire()
            if method == "rpc_heartbeat":
                return HeartbeatReply([s for s in meta.session_ids if s not in self.leases], 15.0).to_wire()
        raise AssertionError(method)


class FakeServers(HopClient):
    """Servers at the HopClient's boundary: every live one computes the same function of its input
    (so a failover's replay gives the same output); a dead one resets the connection, a full one
    refuses an open for want of memory."""

    def __init__(self, loop: BackgroundLoop):
        self.loop = loop
        self.step_timeout_s = self.open_timeout_s = 5.0
        self.lock = threading.Lock()
        self.dead: set[str] = set()
        self.full: Counter[str] = Counter()  # opens each refuses before it takes one
        self.opens: Counter[str] = Counter()

    def kill(self, peer: str) -> None:
        with self.lock:
            self.dead.add(peer)

    def _is_dead(self, peer: str) -> bool:
        with self.lock:
            return peer in self.dead

    async def open_async(self, hop, open_msg):
        with self.lock:
            self.opens[hop.peer_id] += 1
            full = self.full[hop.peer_id] > 0
            if full:
                self.full[hop.peer_id] -= 1
        if self._is_dead(hop.peer_id):
            raise ConnectionResetError(f"{hop.peer_id} is gone")
        if full:
            raise OutOfCacheError("the server's KV budget is full; retry later")
        return HopStream(hop, channel=None)

    async def step_async(self, stream, step, hidden, liveness_after_s=0.0, copy_after_s=None):
        if self._is_dead(stream.hop.peer_id):
            raise ConnectionResetError(f"{stream.hop.peer_id} is gone")
        x = wire_parts.as_tensor(hidden)
        return StepResult(torch.tanh(x * 1.5 + 0.25), StepReply(step.session_id, step.step_id), 0.001)

    def close(self, streams):
        pass


@pytest.fixture(scope="module")
def loop():
    background = BackgroundLoop("test-client-owners")
    yield background
    background.stop()


@pytest.fixture
def swarm(loop, monkeypatch):
    """A provider on a fake orchestrator, fake servers A, B, C, and a `context(health)` for sessions."""
    orchestrator = FakeOrchestrator(["A", "B", "C"])
    provider = OrchestratorChainProvider(loop=None, p2p=None, orchestrator_peer_id="orch")
    monkeypatch.setattr(provider, "_call", orchestrator.call)
    servers = FakeServers(loop)
    relays = RelayDialer(loop, None, lambda: [])

    def context(health: PeerHealth, max_failovers: int = 3) -> SessionContext:
        return SessionContext(
            model="m",
            num_blocks=NUM_BLOCKS,
            dtype=torch.float32,
            step_timeout_s=5.0,
            max_failovers=max_failovers,
            server_relay=False,
            loop=loop,
            hops=servers,
            provider=provider,
            peer_health=health,
            relays=relays,
            busy_backoff_s=(0.0, 0.0),
        )

    try:
        yield orchestrator, provider, servers, context
    finally:
        provider.close()


def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * 1.5 + 0.25)


def test_a_lease_is_released_once_however_often_the_session_is_closed(swarm):
    orchestrator, provider, servers, context = swarm
    session = RemoteChainSession(context(PeerHealth()), 16)
    session.step(torch.randn(3, HIDDEN))
    assert session.grant is not None and session.grant.wait_s == 0.25 and session.lease.granted_at_s is not None
    closers = [threading.Thread(target=session.close) for _ in range(8)]  # e.g. a gateway's cancel and its worker
    for t in closers:
        t.start()
    for t in closers:
        t.join()
    session.close()
    assert orchestrator.releases[session.session_id] == 1 and orchestrator.unknown_releases == 0
    assert session.lease.releases == 1 and not session.lease.held and provider.held_leases() == 0


def test_a_failed_open_and_a_full_server_release_each_hold_once(swarm):
    orchestrator, provider, servers, context = swarm
    # full twice, then it takes the session: each wait gives the grant back, the close the last one
    servers.full["A"] = 2
    session = RemoteChainSession(context(PeerHealth()), 16)
    session.close()
    sid = session.session_id
    assert orchestrator.acquires[sid] == 3 and orchestrator.releases[sid] == 3 and orchestrator.unknown_releases == 0
    assert session.failovers == 0  # full is not failed
    # every server dead: the open gives up, released once, and a close after that sends nothing
    for p in "ABC":
        servers.kill(p)
    health = PeerHealth()
    with pytest.raises(ServerUnavailableError, match="gave up after 2 failovers"):
        RemoteChainSession(context(health, max_failovers=2), 16, session_id="doomed-session")
    assert orchestrator.releases["doomed-session"] == 1 and orchestrator.unknown_releases == 0
    assert health.banned() == {"A", "B", "C"} and provider.held_leases() == 0


def test_a_lease_released_while_it_acquires_is_released_again_at_once(swarm):
    """A close from another thread while the open still waits for its grant: the grant that comes
    back is released at once (it would otherwise be renewed by the heartbeat forever)."""
    orchestrator, provider, servers, context = swarm
    lease = Lease(provider, "racing-session", num_blocks=NUM_BLOCKS, max_length=16)
    real_acquire = provider.acquire

    def slow_acquire(*args, **kwargs):
        out = real_acquire(*args, **kwargs)
        lease.release([])  # the close lands while the grant is on its way
        return out

    provider.acquire = slow_acquire
    try:
        with pytest.raises(Exception, match="closed while it acquired"):
            lease.acquire(frozenset())
    finally:
        del provider.acquire
    assert orchestrator.releases["racing-session"] == 1 and provider.held_leases() == 0


def test_a_thousand_sessions_leave_the_providers_memory_flat(swarm):
    """A gateway-shaped load: 8 worker threads run 1,000 sessions (open, two steps, close) through one
    provider, some failing over from a server that dies and comes back. What the provider holds is
    counted (entries, not RSS): after the 1,000 it is what it was after the first 100."""
    orchestrator, provider, servers, context = swarm
    clock = Clock()
    health = PeerHealth(clock=clock)
    errors: list[str] = []

    def containers(obj) -> dict[str, int]:
        return {k: len(v) for k, v in vars(obj).items() if isinstance(v, (dict, list, set, tuple, Counter))}

    def run(n: int) -> None:
        try:
            for _ in range(n):
                session = RemoteChainSession(context(health), 16)
                try:
                    x = torch.randn(2, HIDDEN)
                    out = session.step(x)
                    torch.testing.assert_close(out, reference(x))
                    session.step(torch.randn(1, HIDDEN))
                finally:
                    session.close()
        except Exception as e:  # reported below
            errors.append(repr(e))

    def wave(sessions: int) -> None:
        workers = [threading.Thread(target=run, args=(sessions // 8,)) for _ in range(8)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()

    wave(96)
    servers.kill("A")  # dies: the sessions that held it fail over, later ones avoid it
    wave(8)
    before = containers(provider)
    with servers.lock:
        servers.dead.clear()
    clock.now_s += 1e4  # its ban long over
    wave(896)
    assert not errors, errors[:3]
    sessions = len(orchestrator.acquires)
    assert sessions == 1000 and orchestrator.unknown_releases == 0
    assert all(orchestrator.releases[s] == 1 for s in orchestrator.acquires)
    assert containers(provider) == before and provider.held_leases() == 0 == before["grants"]
    assert len(health) <= 3


def test_a_server_that_failed_is_tried_by_no_later_session_until_its_ban_expires(swarm):
    orchestrator, provider, servers, context = swarm
    clock = Clock()
    health = PeerHealth(base_ban_s=15.0, clock=clock)
    first = RemoteChainSession(context(health), 16)
    x = torch.randn(3, HIDDEN)
    first.step(x)
    assert first.hops[0].peer_id == "A"
    servers.kill("A")  # mid-run
    y = torch.randn(1, HIDDEN)
    torch.testing.assert_close(first.step(y), reference(y))  # failed over to B, history replayed
    assert first.failovers == 1 and first.hops[0].peer_id == "B" and first.failed_peers == {"A"}
    first.close()
    # later sessions, on other threads, within the ban: A is excluded from their first acquire
    opened: list[RemoteChainSession] = []

    def open_one() -> None:
        opened.append(RemoteChainSession(context(health), 16))

    asked_before = len(orchestrator.excludes)
    workers = [threading.Thread(target=open_one) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert len(opened) == 4 and all(s.failovers == 0 and s.hops[0].peer_id == "B" for s in opened)
    assert all("A" in e for e in orchestrator.excludes[asked_before:])
    assert servers.opens["A"] == 1  # only the first session's open, before it died
    for s in opened:
        s.close()
    clock.now_s += 14.9  # just within the ban
    still = RemoteChainSession(context(health), 16)
    assert still.hops[0].peer_id == "B" and servers.opens["A"] == 1
    still.close()
    # the ban expired: the next session is offered A again, fails on it, and A's ban doubles
    clock.now_s += 0.1
    late = RemoteChainSession(context(health), 16)
    assert late.failovers == 1 and late.hops[0].peer_id == "B" and health.standing("A").failures == 2
    assert health.standing("A").until_s == pytest.approx(clock.now_s + 30.0)
    late.close()


def test_the_orchestrators_address_moves_once_when_many_threads_find_it_gone(monkeypatch, caplog):
    provider = OrchestratorChainProvider(loop=None, p2p=None, orchestrator_peer_id="old", rediscover=lambda: "new")
    asked: list[str] = []

    def call_once(peer_id, method, meta, timeout_s):
        asked.append(peer_id)
        if peer_id == "old":
            raise OrchestratorUnavailableError("the orchestrator old did not answer")
        return Released(True).to_wire()

    monkeypatch.setattr(provider, "_call_once", call_once)
    barrier = threading.Barrier(12)

    def release() -> None:
        barrier.wait()
        provider._call("rpc_release", Release("s"), 1.0)

    try:
        with caplog.at_level(logging.WARNING, logger="petals_chain.client.orchestrated"):
            threads = [threading.Thread(target=release) for _ in range(12)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        provider.close()
    assert provider.orchestrator_peer_id == "new" and asked.count("new") == 12
    assert sum("is gone; using" in r.getMessage() for r in caplog.records) == 1
