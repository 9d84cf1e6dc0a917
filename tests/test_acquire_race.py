"""rpc_acquire: a poll that is waiting when another thread changes its session's state.

The control thread grants queued sessions (a lease expired, a plan was installed) under the lock and
delivers the grants after it; it also drops waiters whose client stopped polling. A poll whose wait
ended in between used to look its session up in the queue and fail with an untyped `ValueError`
(found at twice the capacity by scripts/overload.py, next to the "is not waiting" race that
tests/test_orchestrator_grant_race.py covers). Real handler and orchestrator methods; no network.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from orchestrator.service.rpc import OrchestratorRpc
from petals_chain import wire
from tests.test_orchestrator_grant_race import bare_orchestrator

CTX = SimpleNamespace(remote_id="client-peer")


def acquire_request(sid: str, poll_s: float) -> object:
    return wire.request({"type": "acquire", "session_id": sid, "max_length": 64, "timeout_s": 60.0,
                         "poll_s": poll_s})


async def poll_while(rpc: OrchestratorRpc, orch, sid: str, meanwhile) -> dict:
    """A poll of `sid` that waits on its future while `meanwhile()` runs under the lock (the control
    thread's work, between two of the poll's instructions)."""
    task = asyncio.create_task(rpc.acquire(acquire_request(sid, 0.2), CTX))
    await asyncio.sleep(0)  # the handler runs up to its wait on the future
    with orch.lock:
        meanwhile()
    return wire.unpack((await task).metadata)


def test_a_waiting_poll_granted_but_not_yet_delivered_is_asked_to_poll_again_then_granted():
    now = [0.0]
    orch = bare_orchestrator(lambda: now[0])
    rpc = OrchestratorRpc(orch)
    grants = []

    async def scenario():
        assert wire.unpack((await rpc.acquire(acquire_request("x", 0.01), CTX)).metadata)["type"] == "granted"
        assert wire.unpack((await rpc.acquire(acquire_request("y", 0.01), CTX)).metadata)["type"] == "queued"

        def expire_x():  # x's lease expires; y is granted, its delivery comes later
            now[0] = 31.0
            grants.extend(orch.ds.expire(now[0])[1])

        reply = await poll_while(rpc, orch, "y", expire_x)
        assert [g.session_id for g in grants] == ["y"]
        assert reply["type"] == "queued" and reply["position"] == 0, reply
        orch.deliver(grants)
        reply = wire.unpack((await rpc.acquire(acquire_request("y", 0.2), CTX)).metadata)
        assert reply["type"] == "granted" and reply["grant"]["session_id"] == "y", reply
        await asyncio.sleep(0)
        assert "y" not in orch.waiters and "y" not in orch.delivered

    asyncio.run(scenario())


def test_a_waiting_poll_whose_session_left_the_queue_gets_a_typed_timeout():
    now = [0.0]
    orch = bare_orchestrator(lambda: now[0])
    rpc = OrchestratorRpc(orch)

    async def scenario():
        assert wire.unpack((await rpc.acquire(acquire_request("x", 0.01), CTX)).metadata)["type"] == "granted"
        assert wire.unpack((await rpc.acquire(acquire_request("y", 0.01), CTX)).metadata)["type"] == "queued"

        def abandon_y():  # before y's 60 s deadline, its client counts as gone
            now[0] = 30.0
            assert orch.ds.abandoned(now[0], 25.0) == ["y"]

        reply = await poll_while(rpc, orch, "y", abandon_y)
        assert reply["type"] == "error" and reply["code"] == "acquire_timeout", reply

    asyncio.run(scenario())
