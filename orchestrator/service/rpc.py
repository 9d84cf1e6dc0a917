"""Handlers behind `petals_chain.transport.protocol.OrchestratorService`: acquire, release, heartbeat, assignment.
Each is decode -> owner -> encode: the sessions' owner (orchestrator.service.sessions.Sessions) or
the orchestrator (orchestrator.service.core) does the work under its one lock.

acquire long-polls: one call waits at most `poll_s` (<= 10 s) and answers `queued` if the session
still waits; the client calls again with the same session id and keeps its place in the queue.
So a client notices a dead orchestrator within one poll, and a waiting session gives up with
`AcquireTimeoutError` after its own `timeout_s`.
"""
from __future__ import annotations

import dataclasses
import logging

from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from orchestrator.dispatch import DispatchRequest
from orchestrator.service.sessions import MAX_POLL_S
from orchestrator.service.sessions import Queued as Waiting
from petals_chain.wire import codec as wire
from petals_chain.wire.messages import (
    Acquire,
    AssignmentReply,
    AssignmentRequest,
    ChainGrant,
    Granted,
    Heartbeat,
    HeartbeatReply,
    Queued,
    Release,
    Released,
)

logger = logging.getLogger(__name__)

__all__ = ["OrchestratorRpc", "MAX_POLL_S"]


class OrchestratorRpc:
    def __init__(self, orch):
        self.orch = orch  # orchestrator.service.core.Orchestrator

    def _granted(self, g: ChainGrant) -> runtime_pb2.ExpertResponse:
        """The grant as sent: its hops carry the servers' names (for the client's logs)."""
        hops = tuple(dataclasses.replace(h, name=self.orch.name_of(h.peer_id)) for h in g.hops)
        return wire.response(Granted(dataclasses.replace(g, hops=hops)))

    @wire.replies_with_typed_errors
    async def acquire(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        msg = wire.decode_request(request, Acquire)
        orch = self.orch
        exclude = frozenset(msg.exclude)
        if msg.adapter is not None:  # JFFC picks among chains whose every server serves the adapter
            exclude |= orch.peers_without_adapter(msg.adapter)
        client_id = str(context.remote_id)  # the authenticated peer: the servers' --prefix-sharing client scope
        request = DispatchRequest(client_id, tuple(msg.prefix_hashes or ()), int(msg.prompt_tokens or 0),
                                  int(round(orch.sessions.expected_tokens[1])))
        out = await orch.sessions.poll(msg.session_id, client_id, msg.max_length,
                                       timeout_s=min(msg.timeout_s, orch.config.max_acquire_timeout_s),
                                       poll_s=min(msg.poll_s, MAX_POLL_S), exclude=exclude,
                                       clock=orch.clock, request=request)
        if isinstance(out, Waiting):
            return wire.response(Queued(out.position, out.queue_length))
        return self._granted(out)

    @wire.replies_with_typed_errors
    async def release(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        msg = wire.decode_request(request, Release)
        return wire.response(Released(self.orch.release(msg.session_id, msg.input_tokens, msg.output_tokens, msg.hops)))

    @wire.replies_with_typed_errors
    async def heartbeat(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        sids = wire.decode_request(request, Heartbeat).session_ids
        unknown = self.orch.sessions.unknown(list(sids), self.orch.clock())
        return wire.response(HeartbeatReply(unknown, self.orch.config.lease_ttl_s))

    @wire.replies_with_typed_errors
    async def assignment(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        wire.decode_request(request, AssignmentRequest)
        return wire.response(AssignmentReply(self.orch.assignment_for(str(context.remote_id))))
