"""Handlers behind `petals_chain.protocol.OrchestratorService`: acquire, release, heartbeat, assignment.

acquire long-polls: one call waits at most `poll_s` (<= 10 s) and answers `queued` if the session
still waits; the client calls again with the same session id and keeps its place in the FIFO queue.
So a client notices a dead orchestrator within one poll, and a waiting session gives up with
`AcquireTimeoutError` after its own `timeout_s`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from petals_chain import wire
from petals_chain.errors import AcquireTimeoutError, InvalidRequestError, MaxLengthExceededError, NoChainError
from petals_chain.messages import (Acquire, AssignmentReply, AssignmentRequest, ChainGrant, Granted, Heartbeat,
                                   HeartbeatReply, Queued, Release, Released)

logger = logging.getLogger(__name__)

MAX_POLL_S = 10.0


class OrchestratorRpc:
    def __init__(self, orch):
        self.orch = orch  # orchestrator.service.core.Orchestrator

    def _granted(self, g: ChainGrant) -> runtime_pb2.ExpertResponse:
        """The grant as sent: its hops carry the servers' names (for the client's logs)."""
        hops = tuple(dataclasses.replace(h, name=self.orch.name_of(h.peer_id)) for h in g.hops)
        return wire.response(Granted(dataclasses.replace(g, hops=hops)))

    @wire.replies_with_typed_errors
    async def acquire(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        orch = self.orch
        msg = wire.decode_request(request, Acquire)
        sid, max_length, exclude = msg.session_id, msg.max_length, set(msg.exclude)
        client_id = str(context.remote_id)
        timeout_s = min(msg.timeout_s, orch.config.max_acquire_timeout_s)
        poll_s = min(msg.poll_s, MAX_POLL_S)
        now = orch.clock()
        with orch.lock:
            fut = orch.waiters.get(sid)
            delivered = orch.take_delivered(sid)
            if delivered is not None:  # granted between two polls (its future may not be resolved yet)
                orch.waiters.pop(sid, None)
                return self._granted(delivered)
            if fut is not None and fut.done():  # resolved between two polls
                orch.waiters.pop(sid, None)
                if fut.result() is not None:
                    return self._granted(fut.result())
                fut = None  # it left the queue without a grant (timed out, abandoned): a new request
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
                if msg.adapter is not None:  # JFFC picks among chains whose every server serves the adapter
                    exclude |= orch.peers_without_adapter(msg.adapter)
                grant, others = orch.ds.acquire(sid, client_id, max_length, now, timeout_s=timeout_s,
                                                exclude=frozenset(exclude))
                if grant is not None:
                    fut.set_result(grant)
                orch.deliver(others)
            elif sid not in orch.ds.queue and sid not in orch.ds.leases:
                raise InvalidRequestError(f"session {sid!r} is not waiting")
            orch.ds.touch(sid, now)
            if sid in orch.ds.queue:
                deadline = orch.ds.queue[sid].deadline_s
            elif not fut.done() and sid in orch.ds.leases:  # granted on another thread, not delivered yet
                deadline = now + poll_s
            else:
                deadline = now
        wait = max(0.0, min(poll_s, deadline - now))
        try:
            grant = await asyncio.wait_for(asyncio.shield(fut), wait) if not fut.done() else fut.result()
        except asyncio.TimeoutError:
            with orch.lock:
                delivered = orch.take_delivered(sid)
                if fut.done():
                    grant = fut.result()
                elif delivered is not None:  # delivered by another thread; `fut` is resolved later
                    grant = delivered
                elif sid not in orch.ds.queue and sid in orch.ds.leases:
                    # granted on another thread that has not delivered yet: the next poll gets it
                    return wire.response(Queued(0, orch.ds.queue_length))
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
                    return wire.response(Queued(pos, orch.ds.queue_length))
        with orch.lock:
            orch.waiters.pop(sid, None)
            orch.take_delivered(sid)
        if grant is None:
            raise AcquireTimeoutError("the session waited too long without polling and left the queue")
        return self._granted(grant)

    @wire.replies_with_typed_errors
    async def release(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        orch = self.orch
        msg = wire.decode_request(request, Release)
        sid, input_tokens, output_tokens = msg.session_id, msg.input_tokens, msg.output_tokens
        with orch.lock:
            known = sid in orch.ds.leases
            orch.delivered.pop(sid, None)
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
        return wire.response(Released(known))

    @wire.replies_with_typed_errors
    async def heartbeat(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        orch = self.orch
        sids = wire.decode_request(request, Heartbeat).session_ids
        now = orch.clock()
        with orch.lock:
            unknown = [s for s in sids if not orch.ds.heartbeat(s, now) and s not in orch.ds.queue]
        return wire.response(HeartbeatReply(unknown, orch.config.lease_ttl_s))

    @wire.replies_with_typed_errors
    async def assignment(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        wire.decode_request(request, AssignmentRequest)
        return wire.response(AssignmentReply(self.orch.assignment_for(str(context.remote_id))))

