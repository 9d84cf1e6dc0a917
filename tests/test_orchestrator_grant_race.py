"""A grant delivered by another thread reaches a waiter that polls before its future is resolved.

The orchestrator's control thread (or a release) hands grants to waiting sessions by scheduling
`future.set_result` on the event loop; a poll of the same session that runs first used to find it
neither queued nor resolved and failed with "session ... is not waiting" (seen in the Table 1 runs).
The handler and the orchestrator's methods are the real ones; only the DHT start is skipped.
"""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from orchestrator.service.core import Orchestrator, OrchestratorConfig
from orchestrator.service.dispatch_state import DispatchState
from orchestrator.service.rpc import OrchestratorRpc
from petals_chain import wire
from petals_chain.messages import Hop


def bare_orchestrator(clock) -> Orchestrator:
    orch = Orchestrator.__new__(Orchestrator)  # no DHT, no control thread: the RPC logic only
    orch.config = OrchestratorConfig(model="m", initial_peers=[], num_blocks=30, lease_ttl_s=30.0)
    orch.clock = clock
    orch.lock = threading.RLock()
    orch.records, orch.waiters, orch.delivered = {}, {}, {}
    orch.current, orch.plan_error = SimpleNamespace(installed=True), None
    orch.ds = DispatchState(lease_ttl_s=30.0)
    orch.ds.install_chains([((Hop("a", 0, 30),), 1, 1.0, 4096)], 1, clock())
    return orch


def acquire_request(sid: str) -> object:
    return wire.request({"type": "acquire", "session_id": sid, "max_length": 64, "timeout_s": 60.0, "poll_s": 0.01})


def test_a_grant_delivered_before_the_future_resolves_is_returned_to_the_next_poll():
    now = [0.0]
    orch = bare_orchestrator(lambda: now[0])
    rpc = OrchestratorRpc(orch)
    ctx = SimpleNamespace(remote_id="client-peer")

    async def scenario():
        first = wire.unpack((await rpc.acquire(acquire_request("x"), ctx)).metadata)
        assert first["type"] == "granted"  # x holds the only slot
        queued = wire.unpack((await rpc.acquire(acquire_request("y"), ctx)).metadata)
        assert queued["type"] == "queued"
        with orch.lock:  # what the control thread does when x's slot frees: y's future resolves later
            grants = orch.ds.release("x", now[0])
        orch.deliver(grants)
        assert not orch.waiters["y"].done()
        # y polls before the loop ran the scheduled set_result (the await runs synchronously up to
        # its first suspension, so the order is deterministic)
        reply = wire.unpack((await rpc.acquire(acquire_request("y"), ctx)).metadata)
        assert reply["type"] == "granted", reply
        assert reply["grant"]["session_id"] == "y"
        await asyncio.sleep(0)  # the scheduled set_result runs now and finds the future taken care of
        assert "y" not in orch.waiters and "y" not in orch.delivered
        assert set(orch.ds.leases) == {"y"}

    asyncio.run(scenario())
