"""Handlers behind `petals_chain.protocol.OrchestratorService`: acquire, release, heartbeat, assignment.

acquire long-polls: one call waits at most `poll_s` (<= 10 s) and answers `queued` if the session
still waits; the client calls again with the same session id and keeps its place in the FIFO queue.
So a client notices a dead orchestrator within one poll, and a waiting session gives up with
`AcquireTimeoutError` after its own `timeout_s`.
"""
from __future__ import annotations

import asyncio
import logging

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from petals_chain import wire
from petals_chain.errors import AcquireTimeoutError, InvalidRequestError, MaxLengthExceededError, NoChainError
from petals_chain.orchestrator_records import ChainGrant, GrantHop

logger = logging.getLogger(__name__)

MAX_POLL_S = 10.0


class OrchestratorRpc:
    def __init__(self, orch):
        self.orch = orch  # orchestrator.service.core.Orchestrator

    def _grant_wire(self, g) -> dict:
        hops = [GrantHop(p, s, e, self.orch.name_of(p)) for p, s, e in g.hops]
        return {"type": "granted", "grant": ChainGrant(g.session_id, g.chain_id, g.plan_version, hops,
                                                       g.service_time_s, self.orch.config.lease_ttl_s,
                                                       g.wait_s, extra={"seq": g.seq}).to_wire()}

    @wire.replies_with_typed_errors
    async def acquire(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        orch = self.orch
        meta = wire.unpack_request(request, "acquire")
        sid = wire.field_of(meta, "session_id", str)
        client_id = str(context.remote_id)
        max_length = wire.field_of(meta, "max_length", int)
        timeout_s = min(wire.field_of(meta, "timeout_s", float, default=60.0), orch.config.max_acquire_timeout_s)
        poll_s = min(wire.field_of(meta, "poll_s", float, default=5.0), MAX_POLL_S)
        exclude = wire.field_of(meta, "exclude", list, default=[])
        if not sid or len(sid) > 128:
            raise InvalidRequestError("session_id must be a non-empty string of at most 128 characters")
        if max_length < 1:
            raise InvalidRequestError(f"max_length must be >= 1, got {max_length}")
        if not all(isinstance(p, str) for p in exclude):
            raise InvalidRequestError("exclude must be a list of peer ids")
        now = orch.clock()
        with orch.lock:
            fut = orch.waiters.get(sid)
            if fut is not None and fut.done():  # granted between two polls
                orch.waiters.pop(sid, None)
                if fut.result() is not None:
                    return wire.response(self._grant_wire(fut.result()))
                fut = None
            if fut is None:  # a new request (or a replacement after failover)
                if orch.current is None and orch.plan_error:
                    raise NoChainError(f"the orchestrator cannot plan for the servers it knows: {orch.plan_error}")
                has_chains = orch.current is not None and (orch.current.installed or bool(orch.ds.chains))
                # without chains yet, or none dispatchable right now: queue for the next plan
                if has_chains and orch.ds.refuses_length(max_length):
                    raise MaxLengthExceededError(
                        f"max_length={max_length} exceeds what every chain's servers accept; use a smaller max_length")
                if sid in orch.ds.queue:
                    orch.ds.cancel(sid)
                fut = asyncio.get_running_loop().create_future()
                orch.waiters[sid] = fut
                grant, others = orch.ds.acquire(sid, client_id, max_length, now, timeout_s=timeout_s,
                                                exclude=frozenset(exclude))
                if grant is not None:
                    fut.set_result(grant)
                orch.deliver(others)
            elif sid not in orch.ds.queue:
                # granted by another thread (the control loop) whose delivery to `fut` is still on its
                # way through call_soon_threadsafe: answer with the grant the lease records
                grant = orch.ds.granted(sid)
                if grant is None:
                    raise InvalidRequestError(f"session {sid!r} is not waiting")
                orch.waiters.pop(sid, None)
                return wire.response(self._grant_wire(grant))
            orch.ds.touch(sid, now)
            deadline = orch.ds.queue[sid].deadline_s if sid in orch.ds.queue else now
        wait = max(0.0, min(poll_s, deadline - now))
        try:
            grant = await asyncio.wait_for(asyncio.shield(fut), wait) if not fut.done() else fut.result()
        except asyncio.TimeoutError:
            with orch.lock:
                if fut.done():
                    grant = fut.result()
                elif sid not in orch.ds.queue and orch.ds.granted(sid) is not None:
                    grant = orch.ds.granted(sid)  # granted; the delivery to `fut` is still on its way
                elif sid not in orch.ds.queue:  # another thread took it out (deadline, abandoned)
                    orch.waiters.pop(sid, None)
                    raise AcquireTimeoutError("the session left the orchestrator's queue (its deadline passed or "
                                              "its client stopped polling); retry later or raise the timeout")
                elif orch.clock() >= deadline:
                    orch.ds.cancel(sid)
                    orch.ds.metrics.timed_out += 1
                    orch.waiters.pop(sid, None)
                    raise AcquireTimeoutError(
                        f"no chain slot freed within {timeout_s:.0f} s (queue length {orch.ds.queue_length}); "
                        "retry later or raise the timeout") from None
                else:
                    orch.ds.touch(sid, orch.clock())
                    pos = list(orch.ds.queue).index(sid) + 1
                    return wire.response({"type": "queued", "position": pos, "queue_length": orch.ds.queue_length})
        with orch.lock:
            orch.waiters.pop(sid, None)
        if grant is None:
            raise AcquireTimeoutError("the session waited too long without polling and left the queue")
        return wire.response(self._grant_wire(grant))

    @wire.replies_with_typed_errors
    async def release(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        orch = self.orch
        meta = wire.unpack_request(request, "release")
        sid = wire.field_of(meta, "session_id", str)
        input_tokens = wire.field_of(meta, "input_tokens", int, default=0)
        output_tokens = wire.field_of(meta, "output_tokens", int, default=0)
        with orch.lock:
            known = sid in orch.ds.leases
            if sid in orch.ds.queue:
                orch.ds.cancel(sid)
                fut = orch.waiters.pop(sid, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            grants = orch.ds.release(sid, orch.clock(), input_tokens=input_tokens, output_tokens=output_tokens)
            if known:
                orch.lengths.observe(input_tokens, output_tokens)
                shape = orch.lengths.shape
                orch.ds.expected_tokens = (shape.mean_input_tokens, shape.mean_output_tokens)
        orch.deliver(grants)
        return wire.response({"type": "released", "known": known})

    @wire.replies_with_typed_errors
    async def heartbeat(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        orch = self.orch
        meta = wire.unpack_request(request, "heartbeat")
        sids = wire.field_of(meta, "session_ids", list)
        if not all(isinstance(s, str) for s in sids):
            raise InvalidRequestError("session_ids must be a list of strings")
        now = orch.clock()
        with orch.lock:
            unknown = [s for s in sids if not orch.ds.heartbeat(s, now) and s not in orch.ds.queue]
        return wire.response({"type": "heartbeat", "unknown": unknown, "lease_ttl_s": orch.config.lease_ttl_s})

    @wire.replies_with_typed_errors
    async def assignment(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        wire.unpack_request(request, "assignment")
        a = self.orch.assignment_for(str(context.remote_id))
        return wire.response({"type": "assignment", "assignment": a.to_wire()})

