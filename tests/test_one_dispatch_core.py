"""One dispatch core: the simulator and the live service run the same dispatcher and make the same
decisions on the same events; the RPC's long poll returns grants made by any thread (pure, no network).
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.dispatch import DISPATCHERS, make_dispatcher
from orchestrator.service.sessions import Queued, Sessions, chain_specs
from orchestrator.sim.engine import simulate
from petals_chain.errors import AcquireTimeoutError
from petals_chain.wire import codec as wire
from petals_chain.wire.messages import Hop


def live_chains(caps_times):
    return [((Hop(f"p{i}a", 0, 10), Hop(f"p{i}b", 10, 20)), cap, t, 4096) for i, (cap, t) in enumerate(caps_times)]


@settings(max_examples=40, deadline=None)
@given(
    caps_times=st.lists(st.tuples(st.integers(1, 3), st.floats(0.5, 4.0)), min_size=1, max_size=4),
    name=st.sampled_from(sorted(DISPATCHERS)),
    seed=st.integers(0, 10**6),
    n_jobs=st.integers(1, 60),
)
def test_simulator_and_service_make_identical_decisions(caps_times, name, seed, n_jobs):
    chains = live_chains(caps_times)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.4, n_jobs))
    sizes = rng.exponential(1.0, n_jobs)
    sim = simulate(make_dispatcher(name, chain_specs(chains), np.random.default_rng(seed + 1)), arrivals, sizes)
    start_s = arrivals + sim.wait_s
    finish_s = arrivals + sim.response_s

    sessions = Sessions(lease_ttl_s=1e9)
    sessions.install_chains(chains, 1, 0.0, dispatch=name, rng=np.random.default_rng(seed + 1))
    index_of = {c.chain_id: c.index for c in sessions.chains.values()}
    # the engine's event order: by time, a completion before an arrival, completions by job id
    events = sorted(
        [(float(t), 1, j) for j, t in enumerate(arrivals)] + [(float(t), 0, j) for j, t in enumerate(finish_s)]
    )
    got_chain, got_start = {}, {}
    for t, kind, j in events:
        if kind == 1:
            mine, others = sessions.acquire(str(j), "client", 64, t, timeout_s=1e9)
            grants = ([mine] if mine else []) + others
        else:
            grants = sessions.release(str(j), t)
        for g in grants:
            got_chain[int(g.session_id)] = index_of[g.chain_id]
            got_start[int(g.session_id)] = t
    assert [got_chain[j] for j in range(n_jobs)] == sim.chain_id.tolist()
    assert [got_start[j] for j in range(n_jobs)] == pytest.approx(start_s.tolist())
    assert sessions.queue_length == 0 and not sessions.leases


# -- the RPC side: decode -> owner -> encode, and the long poll -----------------------------------


def bare_orchestrator(clock):
    """The orchestrator's RPC-facing surface without a DHT or control thread."""
    from orchestrator.service.core import Orchestrator, OrchestratorConfig

    orch = Orchestrator.offline(OrchestratorConfig(model="m", initial_peers=[], num_blocks=20, lease_ttl_s=30.0), clock)
    orch.sessions.install_chains(live_chains([(1, 1.0)]), 1, clock())
    return orch


CTX = SimpleNamespace(remote_id="client-peer")


def acquire_request(sid: str, poll_s: float):
    return wire.request({"type": "acquire", "session_id": sid, "max_length": 64, "timeout_s": 60.0, "poll_s": poll_s})


def test_a_grant_made_by_another_thread_wakes_the_waiting_poll():
    now = [0.0]
    orch = bare_orchestrator(lambda: now[0])
    from orchestrator.service.rpc import OrchestratorRpc

    rpc = OrchestratorRpc(orch)

    async def scenario():
        first = wire.unpack((await rpc.acquire(acquire_request("x", 0.01), CTX)).metadata)
        assert first["type"] == "granted"
        assert wire.unpack((await rpc.acquire(acquire_request("y", 0.01), CTX)).metadata)["type"] == "queued"
        task = asyncio.create_task(rpc.acquire(acquire_request("y", 10.0), CTX))
        await asyncio.sleep(0)  # the poll runs up to its wait
        # the control thread: x's lease expires, y is granted on another thread
        t = threading.Thread(target=lambda: orch.sessions.expire(31.0))
        now[0] = 31.0
        t.start()
        t.join()
        reply = wire.unpack((await asyncio.wait_for(task, 5.0)).metadata)
        assert reply["type"] == "granted" and reply["grant"]["session_id"] == "y", reply
        assert set(orch.sessions.leases) == {"y"} and orch.sessions.take_grant("y") is None

    asyncio.run(scenario())


def test_a_grant_made_between_two_polls_is_returned_by_the_next_poll():
    now = [0.0]
    orch = bare_orchestrator(lambda: now[0])
    from orchestrator.service.rpc import OrchestratorRpc

    rpc = OrchestratorRpc(orch)

    async def scenario():
        assert wire.unpack((await rpc.acquire(acquire_request("x", 0.01), CTX)).metadata)["type"] == "granted"
        assert wire.unpack((await rpc.acquire(acquire_request("y", 0.01), CTX)).metadata)["type"] == "queued"
        released = wire.unpack(
            (
                await rpc.release(
                    wire.request({"type": "release", "session_id": "x", "input_tokens": 10, "output_tokens": 5}), CTX
                )
            ).metadata
        )
        assert released["type"] == "released" and released["known"] is True
        reply = wire.unpack((await rpc.acquire(acquire_request("y", 0.01), CTX)).metadata)
        assert reply["type"] == "granted" and reply["grant"]["session_id"] == "y", reply

    asyncio.run(scenario())


def test_a_waiting_poll_whose_session_left_the_queue_gets_a_typed_timeout():
    now = [0.0]
    orch = bare_orchestrator(lambda: now[0])

    async def scenario():
        g = await orch.sessions.poll("x", "c", 64, timeout_s=60, poll_s=0.01, exclude=frozenset(), clock=orch.clock)
        assert g.session_id == "x"
        q = await orch.sessions.poll("y", "c", 64, timeout_s=60, poll_s=0.01, exclude=frozenset(), clock=orch.clock)
        assert q == Queued(1, 1)
        task = asyncio.create_task(
            orch.sessions.poll("y", "c", 64, timeout_s=60, poll_s=10.0, exclude=frozenset(), clock=orch.clock)
        )
        await asyncio.sleep(0)
        now[0] = 30.0
        assert orch.sessions.abandoned(now[0], 25.0) == ["y"]  # last seen at 0: counted as gone
        with pytest.raises(AcquireTimeoutError):
            await asyncio.wait_for(task, 5.0)

    asyncio.run(scenario())


def test_a_grant_whose_poll_reply_went_unread_is_given_to_the_sessions_next_poll():
    # the client's wait for a poll ended before that poll's reply came (its timeout): the poll took the
    # grant and its reply went to nobody. The session's next poll gets the same grant (not a new place at
    # the back of the queue); a poll that excludes a server of that chain is a failover and does not
    now = [0.0]
    orch = bare_orchestrator(lambda: now[0])
    s = orch.sessions

    def poll(sid, poll_s=0.01, exclude=frozenset()):
        return s.poll(
            sid,
            "c",
            64,
            timeout_s=60,
            poll_s=poll_s,  # noqa: E731
            exclude=exclude,
            clock=orch.clock,
        )

    async def scenario():
        unread = await poll("x")  # granted, and its reply lost on the way
        again = await poll("x")
        assert again == unread and s.metrics.admitted == 1 and set(s.leases) == {"x"}
        # a poll waiting while an older poll of the session takes the grant
        assert await poll("y") == Queued(1, 1)
        waiting = asyncio.create_task(poll("y", poll_s=10.0))
        await asyncio.sleep(0)  # it waits for its event
        s.release("x", now[0])  # y's grant is made and its waiting poll woken ...
        taken_by_the_older_poll = s.take_grant("y")  # ... but an older poll of y takes it first
        got = await asyncio.wait_for(waiting, 5.0)
        assert got == taken_by_the_older_poll and got.session_id == "y"
        # failover: excluding a server of the held chain gives the lease back and queues again
        failover = await poll("y", exclude=frozenset({got.hops[0].peer_id}))
        assert isinstance(failover, Queued) and "y" not in s.leases and s.metrics.released == 2

    asyncio.run(scenario())
