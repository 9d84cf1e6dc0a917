"""The block server's lifecycle has one owner (server/lifecycle.py), its start-up is a stack of
resources, and its races are closed: shutdown during a move leaves the DHT record offline, a start-up
failing at any stage leaves no process, port or thread behind, a move waits for sessions that wait
for memory in admission, and a bad step is refused before it changes anything of its session.

The races are driven by events and hooks (a move held inside its load, shutdown's `offline`
announcement held until the mover is done), never by sleeps.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from petals_chain.errors import (
    InvalidRequestError,
    MaxLengthExceededError,
    ServerMovingError,
    ServerUnavailableError,
    error_from_code,
)
from petals_chain.process.signals import start_dht
from petals_chain.runtime.block_range import BlockRange
from petals_chain.swarm.identity import swarm_validators
from petals_chain.swarm.records import fetch_servers
from petals_chain.wire import parts as wire_parts
from petals_chain.wire.messages import Open, Step
from petals_chain.wire.records import ServerState
from server import block_server, relay
from server.block_server import BlockServer
from server.config import ServerConfig
from server.handler import BlockServicer, OpenSession, ServicerLimits
from server.lifecycle import ServerLifecycle
from server.relay import RelayInbox
from server.service_meter import ServiceMeter
from server.serving_stack import build_stack
from tests.swarm_helpers import wait_for

MAX_LENGTH = 32


def _fake_stack(sessions: int = 0, waiting: int = 0):
    return SimpleNamespace(sessions=[None] * sessions, admission=[None] * waiting)


# -- the lifecycle alone ------------------------------------------------------------------------
def test_shutdown_is_final_and_hands_the_stack_out_once():
    life = ServerLifecycle()
    old, new = _fake_stack(), _fake_stack()
    assert life.install(old, None, None) is None and life.go_online() and life.accepting
    assert life.begin_move() and not life.accepting
    assert life.shut_down() == (True, old)
    # the move finishes after the shutdown: its stack comes back to be stopped, and nothing goes online
    assert life.install(new, None, None) is new and life.current is old
    assert life.end_move() is False and life.go_online() is False
    assert life.snapshot().state == ServerState.OFFLINE and not life.accepting
    assert life.shut_down() == (False, None)
    with pytest.raises(ServerUnavailableError):
        with life.opening():
            pass


def test_a_move_waits_for_open_sessions_admission_waiters_and_opens_in_flight():
    life = ServerLifecycle()
    life.install(_fake_stack(sessions=1), None, None)
    life.go_online()
    assert not life.begin_move()  # a session is open
    life.install(_fake_stack(waiting=1), None, None)
    assert not life.begin_move()  # a session waits for memory in admission
    life.install(_fake_stack(), None, None)
    with life.opening():
        assert not life.begin_move()  # an open is in flight
    assert life.begin_move() and life.snapshot().state == ServerState.JOINING
    with pytest.raises(ServerUnavailableError):  # no open starts during a move
        with life.opening():
            pass
    assert not life.begin_move()  # one move at a time
    assert life.end_move() and life.accepting


def test_no_open_is_in_flight_while_a_move_runs():
    """Openers and a mover on threads: the invariant holds on every interleaving they meet."""
    life = ServerLifecycle()
    life.install(_fake_stack(), None, None)
    life.go_online()
    count_lock, state = threading.Lock(), {"opening": 0, "moving": False, "broken": 0, "moves": 0, "opens": 0}
    stop = threading.Event()

    def opener():
        while not stop.is_set():
            try:
                with life.opening():
                    with count_lock:
                        state["opening"] += 1
                        state["opens"] += 1
                        state["broken"] += state["moving"]
                    with count_lock:
                        state["opening"] -= 1
            except ServerUnavailableError:
                pass

    def mover():
        while not stop.is_set():
            if life.begin_move():
                with count_lock:
                    state["moving"] = True
                    state["moves"] += 1
                    state["broken"] += state["opening"] > 0
                with count_lock:
                    state["moving"] = False
                life.end_move()

    threads = [threading.Thread(target=opener) for _ in range(3)] + [threading.Thread(target=mover)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: state["moves"] >= 200 and state["opens"] >= 200, 60, "200 moves and 200 opens", period_s=0.01)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert state["moves"] >= 200 and state["opens"] >= 200
    assert state["broken"] == 0


# -- the move guard and the step path on a real stack -------------------------------------------
@pytest.fixture(scope="module")
def one_session_stack(tiny_llama_path):
    """A real serving stack of blocks [0, 2) whose budget holds one session of MAX_LENGTH tokens."""
    probe = BlockRange(tiny_llama_path, 0, 2)
    session_bytes = probe.kv_bytes_per_block(MAX_LENGTH) * 2
    config = ServerConfig(
        model=str(tiny_llama_path),
        start=0,
        end=2,
        initial_peers=[],
        prefix_sharing="off",
        memory_budget_bytes=probe.block_bytes * 2 + session_bytes * 3 // 2,
    )
    del probe
    stack = build_stack(config, tiny_llama_path, 0, 2)
    life = ServerLifecycle()
    life.install(stack, None, None)
    life.go_online()
    servicer = BlockServicer(
        ServicerLimits(MAX_LENGTH, MAX_LENGTH, 300.0), life, lambda: None, ServiceMeter(), dialer=None
    )
    yield SimpleNamespace(stack=stack, life=life, servicer=servicer, session_bytes=session_bytes)
    stack.stop()


async def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


def test_the_move_guard_counts_a_session_waiting_for_memory_in_admission(one_session_stack):
    s = one_session_stack
    stack, life, servicer = s.stack, s.life, s.servicer

    async def scenario():
        stack.budget.reserve("hog", s.session_bytes)  # memory held by no session: the table stays empty
        waiting = asyncio.create_task(servicer._open(Open("b", MAX_LENGTH, admission_wait_s=60.0), "client-b", None))
        await _until(lambda: len(stack.admission) == 1, "the open did not start waiting for memory")
        assert len(stack.sessions) == 0
        assert not life.begin_move()  # it waits in admission: no move
        stack.budget.release("hog")
        stack.admission.on_release()  # hands the memory to the waiting open, which has not resumed yet
        assert len(stack.admission) == 0 and len(stack.sessions) == 0
        assert not life.begin_move()  # admitted but not yet in the table: still in flight
        session = await waiting
        assert len(stack.sessions) == 1 and not life.begin_move()
        servicer._close(session)
        assert life.begin_move()
        assert life.end_move()

    asyncio.run(scenario())


def test_a_bad_step_is_refused_before_it_changes_the_session(one_session_stack):
    s = one_session_stack
    servicer, br = s.servicer, s.stack.block_range

    async def scenario():
        session: OpenSession = await servicer._open(Open("c", MAX_LENGTH), "client-c", None)
        try:
            x = torch.randn(5, br.hidden_size)
            await servicer._step(session, servicer._request(session, x, None, None))
            assert session.kv.past_tokens == 5
            # a rollback with a step that is refused (wrong dtype, too long): the session stays at 5 tokens
            with pytest.raises(InvalidRequestError, match="must be one of"):  # float16 would be cast in
                servicer._request(session, x.to(torch.float64), None, 0)
            with pytest.raises(MaxLengthExceededError):
                servicer._request(session, torch.randn(MAX_LENGTH, br.hidden_size), None, 2)
            with pytest.raises(InvalidRequestError, match="start_position=6 is past"):
                servicer._request(session, x, None, 6)
            with pytest.raises(InvalidRequestError, match=r"hidden states must have shape"):
                servicer._request(session, torch.randn(1, 2, br.hidden_size), None, None)
            assert session.kv.past_tokens == 5
            # a good rollback still runs, from where it says
            out, _ = await servicer._step(session, servicer._request(session, x[:2], None, 3), 3)
            assert out.shape == (2, br.hidden_size) and session.kv.past_tokens == 5
        finally:
            servicer._close(session)

    asyncio.run(scenario())


async def _settled(coro, what: str, timeout_s: float = 10.0):
    """`coro`'s result, failing if it is not done within `timeout_s` (unlike `wait_for`, the wait does not
    cancel it: a cancel would reach the code under test as if it were its own)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if task not in done:
        task.cancel()
        pytest.fail(what)
    return task.result()


def test_a_forced_move_closes_open_sessions_and_waiting_opens_with_server_moving(one_session_stack):
    """The drain deadline's forced move (server side): new opens are refused at once, the open session's
    stream gets a typed `ServerMovingError` reply after its running step is answered and ends (its KV
    freed), the open waiting for memory in admission is refused with it, and then the server is quiet
    (what `_move_to` waits for before it reloads). An unforced move still waits."""
    s = one_session_stack
    stack, life, servicer, br = s.stack, s.life, s.servicer, s.stack.block_range

    async def scenario():
        requests: asyncio.Queue = asyncio.Queue()
        responses = servicer.inference(wire_parts.until_none(requests), SimpleNamespace(remote_id="client-a"))
        (open_a,) = wire_parts.to_messages(Open("a", MAX_LENGTH).to_wire(), ())
        await requests.put(open_a)
        opened = await wire_parts.receive_one(responses)
        assert opened.meta["type"] == "opened" and len(stack.sessions) == 1
        (step,) = wire_parts.to_messages(Step("a", step_id=1).to_wire(), (torch.randn(3, br.hidden_size),))
        await requests.put(step)
        reply = await wire_parts.receive_one(responses)
        assert reply.meta["type"] == "step" and reply.tensors[0].shape == (3, br.hidden_size)
        # a second session waits for memory (the budget holds one and a half)
        waiting = asyncio.create_task(servicer._open(Open("b", MAX_LENGTH, admission_wait_s=60.0), "client-b", None))
        await _until(lambda: len(stack.admission) == 1, "the second open did not wait for memory")
        assert not life.begin_move()  # unforced: a move waits for both
        assert life.begin_move(force=True) and not life.accepting and not life.quiet()
        with pytest.raises(ServerUnavailableError):  # new opens are refused from the forced move's start
            with life.opening():
                pass
        assert await servicer.evict(ServerMovingError("moving to blocks [2, 4)")) == 2
        closed = await _settled(wire_parts.receive_one(responses), "the open stream got no reply")
        assert closed.meta["type"] == "error"
        err = error_from_code(closed.meta["code"], closed.meta["message"])
        assert isinstance(err, ServerMovingError) and "[2, 4)" in str(err)
        with pytest.raises(StopAsyncIteration):  # the server ended the stream
            await anext(responses)
        with pytest.raises(ServerMovingError):
            await waiting
        await _until(life.quiet, "the forced move's sessions did not close")
        assert len(stack.sessions) == 0 and len(stack.admission) == 0 and stack.budget.reserved_bytes == 0
        assert life.end_move() and life.accepting

    asyncio.run(scenario())


def test_an_inbox_evicted_mid_wait_or_before_it_ends_with_the_error():
    async def run():
        never: asyncio.Queue = asyncio.Queue()

        async def client():
            while (item := await never.get()) is not None:
                yield item

        inbox = RelayInbox(client(), idle_timeout_s=30.0)
        loop = asyncio.get_running_loop()
        error = ServerMovingError("moving")
        loop.call_later(0.05, inbox.evict, error)
        assert await _settled(inbox.next(), "the read was not interrupted") == (relay.EVICTED, error)
        assert await inbox.next() == (relay.EVICTED, error)  # and stays so
        inbox.close()
        quiet = RelayInbox(client(), idle_timeout_s=30.0)
        quiet.evict(error)  # before any read (a step was running): the next read ends at once
        assert await quiet.next() == (relay.EVICTED, error)
        quiet.close()
        assert not asyncio.current_task().cancelling()  # our cancels were taken back

    asyncio.run(run())


# -- a live server: start-up stages and shutdown during a move -----------------------------------
def _config(path, **kw) -> ServerConfig:
    # loopback only (no dial-back check); a direct port, so a start-up has a listening port to leak;
    # no periodic announcements during a test (each is driven by the test)
    return ServerConfig(
        model=str(path),
        start=0,
        end=2,
        initial_peers=[],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        memory_budget_bytes=256 * 2**20,
        max_length_tokens=64,
        direct_port=0,
        num_threads=1,
        announce_period_s=600.0,
        record_ttl_s=600.0,
        peer_rtt_check_s=600.0,
        prefix_sharing="off",
        **kw,
    )


class Leftovers:
    """What a process holds that a start-up may leave behind: child processes, listening ports, threads."""

    def __init__(self):
        me = psutil.Process()
        self.children = {p.pid for p in me.children(recursive=True)}
        self.ports = self._ports(me)
        self.threads = set(threading.enumerate())

    @staticmethod
    def _ports(me) -> set[int]:
        return {c.laddr.port for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}

    def left(self) -> dict:
        me = psutil.Process()
        children = []
        for p in me.children(recursive=True):
            try:
                if p.pid not in self.children and p.status() != psutil.STATUS_ZOMBIE:
                    children.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        return {
            "children": children,
            "ports": sorted(self._ports(me) - self.ports),
            "threads": sorted(t.name for t in set(threading.enumerate()) - self.threads if t.is_alive()),
        }

    def wait_clean(self, timeout_s: float = 60.0, kinds=("children", "ports", "threads")) -> dict:
        """Poll until none of `kinds` is left (a DHT child takes a moment to be reaped) or the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = {k: v for k, v in self.left().items() if k in kinds}
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            time.sleep(0.1)


NOTHING = {"children": [], "ports": [], "threads": []}


@pytest.fixture(scope="module")
def warm(tiny_llama_path):
    """One whole start and shutdown first: the profile gets cached, and the process-wide helpers of
    hivemind and torch exist (hivemind's MPFuture backend thread, torch's shared-memory manager
    process), so what later tests count is what their start-up left."""
    server = BlockServer(_config(tiny_llama_path))
    assert server.state == ServerState.ONLINE and server.block_range.start == 0
    server.shutdown()
    return tiny_llama_path


class InjectedFailure(Exception):
    pass


@pytest.mark.integration
@pytest.mark.parametrize("stage", BlockServer.STARTUP)
def test_a_start_up_failing_after_any_stage_leaves_no_process_port_or_thread(warm, monkeypatch, stage):
    real = getattr(BlockServer, f"_start_{stage}")

    def failing(self, resources):
        real(self, resources)  # the stage's resources are up: the failure must tear them down too
        raise InjectedFailure(stage)

    monkeypatch.setattr(BlockServer, f"_start_{stage}", failing)
    before = Leftovers()
    with pytest.raises(InjectedFailure):
        BlockServer(_config(warm))
    assert before.wait_clean() == NOTHING


@pytest.mark.integration
def test_shutdown_during_a_move_leaves_the_record_offline(warm, monkeypatch):
    before = Leftovers()
    server = BlockServer(_config(warm))
    reader = None
    try:
        reader = start_dht(
            initial_peers=[str(m) for m in server.dht.get_visible_maddrs()],
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            record_validators=swarm_validators(),
        )
        in_load, offline_stored, mover_done = threading.Event(), threading.Event(), threading.Event()
        announced: list[ServerState] = []
        real_announce, real_build = block_server.announce_server, block_server.build_stack

        def announce(dht, info, *args, **kwargs):
            announced.append(info.state)
            stored = real_announce(dht, info, *args, **kwargs)
            if info.state == ServerState.OFFLINE:
                offline_stored.set()
                mover_done.wait(60)  # the mover finishes its move while the DHT still runs
            return stored

        def build(*args, **kwargs):
            in_load.set()
            assert offline_stored.wait(60), "shutdown never announced offline"
            return real_build(*args, **kwargs)

        monkeypatch.setattr(block_server, "announce_server", announce)
        monkeypatch.setattr(block_server, "build_stack", build)
        moved = []

        def move():
            try:
                moved.append(server._move_to(2, 4, "a test's move"))
            finally:
                mover_done.set()

        mover = threading.Thread(target=move, name="test-mover")
        mover.start()
        assert in_load.wait(60), "the move never started loading"
        server.shutdown()
        mover.join(60)
        assert not mover.is_alive() and moved == [False]
        assert announced[0] == ServerState.JOINING  # the move's own announcement
        assert ServerState.OFFLINE in announced
        assert set(announced[announced.index(ServerState.OFFLINE) :]) == {ServerState.OFFLINE}, announced
        records = {i.peer_id: i for i in fetch_servers(reader, server.model_name, states=tuple(ServerState))}
        assert records[server.peer_id].state == ServerState.OFFLINE
        assert server.lifecycle.current.block_range.start == 0  # the move's stack never went in place
    finally:
        if reader is not None:
            reader.shutdown()
    # the move's stack was stopped with everything else
    assert before.wait_clean() == NOTHING


class MoveServingServer(BaseStreamer):
    """At the `n`-th new token, the server holding the session is told to move at once (the orchestrator's
    drain deadline with --force-replan: `_move_to(..., force=True)`), on its own thread as its assignment
    poller would; the next step is sent once the server closed the session's stream (a client between two
    steps, the common case)."""

    def __init__(self, servers, session, n):
        self.servers, self.session, self.n, self.seen = servers, session, n, -1
        self.mover: threading.Thread | None = None
        self.moved: list[bool] = []
        self.moved_peer: str | None = None

    def put(self, value):
        self.seen += 1  # the first put is the prompt
        if self.seen == self.n and self.mover is None:
            self.moved_peer = self.session.chain.hops[0].peer_id
            server = next(s for s in self.servers if s.peer_id == self.moved_peer)
            self.mover = threading.Thread(
                target=lambda: self.moved.append(server._move_to(0, 6, "a test's forced move", force=True))
            )
            self.mover.start()
            # the next step must meet the closed stream: wait (with a deadline) until the server closed it
            wait_for(
                lambda: not server.lifecycle.accepting and server.lifecycle.quiet(),
                30,
                "the forced move to close the session",
                period_s=0.01,
            )

    def end(self):
        pass


@pytest.mark.integration
def test_a_forced_move_fails_the_session_over_with_hf_tokens_and_bans_nobody(warm):
    """Live (two in-process whole-model servers, a client routing itself): the server a session runs on is
    moved by force mid-generation; the client gets ServerMovingError, fails over to the other server
    (replaying the session) without banning the moved one, and the tokens equal HF's greedy ones."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from petals_chain.client.model import DistributedModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(warm, dtype=torch.float32).eval()
    prompt = torch.tensor([[2, 5, 7, 11]])
    ref = hf.generate(prompt, max_new_tokens=12, do_sample=False)
    servers, model = [], None
    try:
        servers.append(BlockServer(replace(_config(warm), end=6)))
        peers = [str(m) for m in servers[0].dht.get_visible_maddrs()]
        servers.append(BlockServer(replace(_config(warm), end=6, initial_peers=peers)))
        model = DistributedModelForCausalLM.from_pretrained(str(warm), initial_peers=peers, step_timeout_s=60.0)
        with model.inference_session(max_length=32) as session:
            mover = MoveServingServer(servers, session, 4)
            out = model.generate(prompt, max_new_tokens=12, do_sample=False, streamer=mover)
            assert mover.mover is not None
            mover.mover.join(60)
            assert mover.moved == [True]
            assert session.chain.hops[0].peer_id != mover.moved_peer  # failed over to the other server
            assert session.chain.failovers == 1
            assert model.backend.peer_health.banned() == frozenset()  # the moved server was banned by nobody
        assert out.tolist() == ref.tolist()
    finally:
        if model is not None:
            model.backend.shutdown()
        for s in servers:
            s.shutdown()
