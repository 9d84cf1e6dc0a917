"""rpc_acquire when a grant races the next poll (found by scripts/overload.py at twice the capacity).

The control thread grants queued sessions (a lease expired, a plan was installed) and hands the grant
to the waiting RPC's future through `call_soon_threadsafe`. A poll that runs before that callback
saw a future not done and a session no longer queued, and answered `InvalidRequestError: session ...
is not waiting`: the client's session failed although it had been granted a chain.
"""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from orchestrator.service.dispatch_state import DispatchState
from orchestrator.service.rpc import OrchestratorRpc
from petals_chain import wire


def hops(*peers):
    return tuple((p, i * 10, (i + 1) * 10) for i, p in enumerate(peers))


class FakeOrchestrator:
    """What `OrchestratorRpc` reads of `orchestrator.service.core.Orchestrator`, without a network."""

    def __init__(self):
        self.lock = threading.RLock()
        self.ds = DispatchState(lease_ttl_s=10.0)
        self.ds.install_chains([(hops("a", "b"), 1, 1.0, 4096)], 1, 0.0)
        self.waiters: dict = {}
        self.now_s = 0.0
        self.current = SimpleNamespace(installed=True)
        self.plan_error = None
        self.config = SimpleNamespace(max_acquire_timeout_s=600.0, lease_ttl_s=10.0)
        self.delivered: list = []
        self.loop = asyncio.new_event_loop()  # one loop, as the real handlers share one (futures belong to it)

    def clock(self) -> float:
        return self.now_s

    def deliver(self, grants) -> None:
        self.delivered.extend(grants)  # never resolves futures: the callback is "still on its way"

    def name_of(self, peer_id: str) -> str:
        return peer_id


def acquire(rpc: OrchestratorRpc, sid: str, poll_s: float = 0.01) -> dict:
    request = wire.request({"type": "acquire", "session_id": sid, "max_length": 16, "timeout_s": 60.0,
                            "poll_s": poll_s})
    response = rpc.orch.loop.run_until_complete(rpc.acquire(request, SimpleNamespace(remote_id="client")))
    return wire.unpack(response.metadata)


def test_a_poll_that_races_the_delivery_of_its_grant_gets_the_grant():
    orch = FakeOrchestrator()
    rpc = OrchestratorRpc(orch)
    assert acquire(rpc, "first")["type"] == "granted"
    assert acquire(rpc, "second")["type"] == "queued"
    assert "second" in orch.waiters and not orch.waiters["second"].done()
    with orch.lock:  # the control thread: the first session's lease expires, the second is granted
        orch.now_s = 11.0
        expired, grants = orch.ds.expire(orch.now_s)
    assert expired == ["first"] and [g.session_id for g in grants] == ["second"]
    orch.deliver(grants)  # ... and its future is not resolved yet when the client polls again
    reply = acquire(rpc, "second")
    assert reply["type"] == "granted", reply
    assert reply["grant"]["chain_id"] == grants[0].chain_id and "second" not in orch.waiters


def in_flight_poll(rpc: OrchestratorRpc, orch: FakeOrchestrator, sid: str, meanwhile) -> dict:
    """A poll of `sid` that is waiting on its future while `meanwhile()` runs (as the control thread would)."""
    async def scenario():
        request = wire.request({"type": "acquire", "session_id": sid, "max_length": 16, "timeout_s": 60.0,
                                "poll_s": 0.2})
        task = asyncio.create_task(rpc.acquire(request, SimpleNamespace(remote_id="client")))
        await asyncio.sleep(0)  # the handler runs up to its wait on the future
        with orch.lock:
            meanwhile()
        return wire.unpack((await task).metadata)

    return orch.loop.run_until_complete(scenario())


def test_a_waiting_poll_whose_grant_is_not_delivered_yet_returns_the_grant():
    orch = FakeOrchestrator()
    rpc = OrchestratorRpc(orch)
    assert acquire(rpc, "first")["type"] == "granted"
    assert acquire(rpc, "second")["type"] == "queued"

    def expire_first():
        orch.now_s = 11.0
        orch.deliver(orch.ds.expire(orch.now_s)[1])

    reply = in_flight_poll(rpc, orch, "second", expire_first)
    assert reply["type"] == "granted" and reply["grant"]["session_id"] == "second", reply


def test_a_waiting_poll_whose_session_left_the_queue_gets_a_typed_timeout():
    orch = FakeOrchestrator()
    rpc = OrchestratorRpc(orch)
    assert acquire(rpc, "first")["type"] == "granted"
    assert acquire(rpc, "second")["type"] == "queued"

    def abandon_second():
        orch.now_s = 30.0  # before its 60 s deadline
        assert orch.ds.abandoned(orch.now_s, 25.0) == ["second"]

    reply = in_flight_poll(rpc, orch, "second", abandon_second)
    assert reply["type"] == "error" and reply["code"] == "acquire_timeout", reply
