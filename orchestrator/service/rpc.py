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

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from orchestrator.dispatch import DispatchRequest
from orchestrator.service.sessions import MAX_POLL_S
from orchestrator.service.sessions import Queued as Waiting
from petals_chain.errors import BadReportError, PetalsChainError, ServerUnavailableError
from petals_chain.swarm.identity import peer_id_of_public_key
from petals_chain.transport.protocol import BlockService
from petals_chain.wire import codec as wire
from petals_chain.wire import parts as wire_parts
from petals_chain.wire.messages import (
    Acquire,
    AssignmentReply,
    AssignmentRequest,
    ChainGrant,
    Forward,
    Granted,
    Heartbeat,
    HeartbeatReply,
    Queued,
    Release,
    Released,
    VerificationReport,
)
from petals_chain.wire.records import ServerState

logger = logging.getLogger(__name__)

__all__ = ["OrchestratorRpc", "MAX_POLL_S"]


def _verify_signature(public_key: bytes, data: bytes, signature: bytes) -> bool:
    from hivemind.utils.crypto import RSAPublicKey

    try:
        return RSAPublicKey.from_bytes(public_key).verify(data, signature)
    except Exception:
        return False


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
        request = DispatchRequest(
            client_id,
            tuple(msg.prefix_hashes or ()),
            int(msg.prompt_tokens or 0),
            int(round(orch.sessions.expected_tokens[1])),
        )
        out = await orch.sessions.poll(
            msg.session_id,
            client_id,
            msg.max_length,
            timeout_s=min(msg.timeout_s, orch.config.max_acquire_timeout_s),
            poll_s=min(msg.poll_s, MAX_POLL_S),
            exclude=exclude,
            clock=orch.clock,
            request=request,
        )
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
    async def report(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A client's signed verification report (orchestrator/service/reports.py)."""
        message = wire_parts.decode_single(request)
        msg = VerificationReport.from_wire(message.meta)
        caller = str(context.remote_id)
        orch = self.orch
        tensors = [t.to(torch.float32) if t.dtype == torch.float64 else t for t in message.tensors]
        try:
            orch.reports.check_report(msg, tensors, caller, orch.model, peer_id_of_public_key, _verify_signature)
        except BadReportError:
            with orch.reports._lock:
                orch.reports.refused += 1
            raise
        with orch.lock:
            servers = [
                (p, r.info.start, r.info.end)
                for p, r in orch.records.items()
                if r.info.state == ServerState.ONLINE and r.info.has_blocks
            ]

        async def forward(peer: str, entry_block: int, hidden: torch.Tensor) -> torch.Tensor:
            (req,) = wire_parts.to_messages(Forward(entry_block).to_wire(), (hidden.unsqueeze(0),))
            stub = BlockService.get_stub(orch.p2p, PeerID.from_base58(peer))
            try:
                reply = wire_parts.decode_single(await stub.rpc_forward(req, timeout=60.0))
            except PetalsChainError:
                raise
            except Exception as e:
                raise ServerUnavailableError(f"server {peer} did not answer the forward ({type(e).__name__})") from e
            wire.raise_if_error(reply.meta)
            return reply.tensors[0][0]

        out = await orch.reports.add(msg, tensors, caller, servers, forward)
        if out.excluded:
            orch.log_event(f"server {msg.accused[-8:]} excluded: {out.reporters} peers reported wrong hidden states")
        return wire.response(out)

    @wire.replies_with_typed_errors
    async def assignment(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        wire.decode_request(request, AssignmentRequest)
        return wire.response(AssignmentReply(self.orch.assignment_for(str(context.remote_id))))
