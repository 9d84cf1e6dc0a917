"""The block server's RPCs on hivemind P2P: rpc_info, rpc_inference (stream), rpc_forward.

Every message is validated at this boundary; a bad one gets a typed error reply and the stream
(and the server) keeps serving. The client's identity for accounting is `context.remote_id`, the
libp2p peer id authenticated by the transport, never a self-declared string.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from petals_chain import wire, wire_parts
from petals_chain.messages import Close, Forward, Open, Opened, Step, StepReply, decode_tagged
from petals_chain.wire import ServerState
from petals_chain.errors import (
    InvalidRequestError,
    MaxLengthExceededError,
    PetalsChainError,
    RequestTooLargeError,
    ServerUnavailableError,
    SessionIdleTimeoutError,
    UnknownSessionError,
)
from petals_chain.runtime.block_range import StepInput
from petals_chain.runtime.kv_cache import SessionKV
from petals_chain.runtime.lora import check_adapter
from server.memory import KVBudget
from server.prefix_cache import PrefixPin
from server.scheduler import StepScheduler

logger = logging.getLogger(__name__)


@dataclass
class OpenSession:
    session_id: str
    client_id: str
    kv: SessionKV
    reservation_key: str  # unique per stream: the scheduler's and the budget's key of this session
    prefix_namespace: str = ""
    prefix_hashes: list[str] = field(default_factory=list)  # chained chunk hashes of its prompt (client's)
    prefix_pin: PrefixPin | None = None  # the cached prefix matched at open, until the first step
    prefix_tokens: int = 0  # tokens its first step took from the cache
    prefix_stored: int = 0  # chunks of its prompt offered to the cache so far


class BlockServicer:
    """Implementation behind `petals_chain.protocol.BlockService`."""

    def __init__(self, server):
        self.server = server  # server.server.BlockServer (info, block range, budget, scheduler)

    @property
    def scheduler(self) -> StepScheduler:
        return self.server.scheduler

    @property
    def budget(self) -> KVBudget:
        return self.server.budget

    async def info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:  # any request gets the info; a well-formed one may also ask for the measured batches
            since = wire.decode_request(request, wire.InfoRequest).service_since_seq
        except PetalsChainError:
            since = None
        return wire.response(wire.InfoReply(self.server.info(), self.server.meter.since(since)))

    # -- inference stream ---------------------------------------------------------------------
    async def inference(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                            context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        client_id = str(context.remote_id)
        session: OpenSession | None = None
        incoming = wire_parts.assembled(requests, admit=self._admit).__aiter__()  # tensors arrive in parts
        idle_timeout_s = self.server.session_idle_timeout_s
        try:
            while True:
                try:
                    # a client that went silent must not hold its KV reservation forever
                    message = await asyncio.wait_for(anext(incoming), idle_timeout_s)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    logger.info("closing a session of %s idle for %.0f s", client_id, idle_timeout_s)
                    yield wire.error_response(SessionIdleTimeoutError(
                        f"the server closed this stream: nothing arrived for {idle_timeout_s:.0f} s "
                        "(its --session-idle-timeout); open a new session, and send steps or close sooner"))
                    return
                try:
                    if isinstance(message, PetalsChainError):  # a bad group (refused by its header, or malformed)
                        raise message
                    msg = decode_tagged(message.meta, Open, Step, Close)
                    if isinstance(msg, Open):
                        if session is not None:
                            raise InvalidRequestError("this stream already has an open session")
                        session = await self._open(msg, client_id)
                        pin = session.prefix_pin  # how much of the prompt this hop holds
                        yield wire.response(Opened(session.session_id, session.kv.first_block, session.kv.end_block,
                                                   prefix_match_tokens=None if pin is None else pin.tokens,
                                                   prefix_chunk_tokens=None if pin is None else pin.chunk_tokens))
                    elif isinstance(msg, Step):
                        if session is None:
                            raise UnknownSessionError("step before open: send an 'open' message first")
                        if msg.session_id != session.session_id:
                            raise UnknownSessionError(f"unknown session {msg.session_id!r} on this stream")
                        if len(message.tensors) != 1:
                            raise InvalidRequestError(f"a step carries exactly one tensor, got {len(message.tensors)}")
                        t0 = time.perf_counter()
                        out = await self._step(session, message.tensors[0], msg.prefix_tokens or 0, msg.start_position)
                        # server_s: this step's time inside the server (queue + batch compute), so a
                        # client can tell server time from network time (the Table 1 model check)
                        reply = StepReply(msg.session_id, msg.step_id, session.kv.past_tokens, time.perf_counter() - t0)
                        for response in wire_parts.to_messages(reply.to_wire(), (out,), reply=True):
                            yield response
                    else:  # Close
                        return
                except PetalsChainError as e:
                    yield wire.error_response(e)
                except Exception as e:  # a bug must not take the server down: report it to this client
                    logger.exception("unexpected error in rpc_inference")
                    yield wire.error_response(e)
        finally:
            if session is not None:
                self._close(session)

    def _close(self, session: OpenSession) -> None:
        if session.prefix_pin is not None and self.server.prefix_cache is not None:
            self.server.prefix_cache.unpin(session.prefix_pin)
        self.scheduler.cancel_session(session.reservation_key)
        self.server.on_session_closed(session)  # before the release: allocated KV never exceeds reserved
        self.budget.release(session.reservation_key)
        self.server.admission.on_release()

    def _admit(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Refuse a step's or forward's hidden states by their header, before the rest arrives or
        any memory is allocated: the limit is `max_step_tokens` (advertised in rpc_info)."""
        block_range = self.server.block_range
        if block_range is None:
            raise ServerUnavailableError("this server holds no blocks right now; use another server")
        if len(shape) not in (2, 3) or shape[-1] != block_range.hidden_size:
            raise InvalidRequestError(f"hidden states must be [tokens, {block_range.hidden_size}] (a step) or "
                                      f"[batch, seq, {block_range.hidden_size}] (a forward), got {list(shape)}")
        tokens = math.prod(shape[:-1])
        if tokens > self.server.max_step_tokens:
            raise RequestTooLargeError(
                f"{tokens} tokens in one request exceed this server's max_step_tokens={self.server.max_step_tokens} "
                "(advertised in rpc_info); send the prompt in several steps, fewer forward rows at a time, or use "
                "a server started with a larger --max-step-tokens")

    async def _open(self, msg: Open, client_id: str) -> OpenSession:
        block_range = self.server.block_range
        if block_range is None or self.server.state != ServerState.ONLINE:
            raise ServerUnavailableError("this server holds no blocks right now (waiting for or loading its "
                                         "assignment); use another server")
        session_id, max_length = msg.session_id, msg.max_length
        first_block = block_range.start if msg.entry_block is None else msg.entry_block
        if max_length > self.server.max_length_tokens:
            raise MaxLengthExceededError(
                f"max_length={max_length} exceeds this server's limit of {self.server.max_length_tokens} tokens; "
                "use a smaller max_length or a server started with a larger --max-length")
        if not block_range.start <= first_block < block_range.end:
            raise InvalidRequestError(
                f"entry_block {first_block} is outside this server's blocks [{block_range.start}, {block_range.end})")
        check_adapter(msg.adapter, block_range.adapters)  # before any memory is reserved
        nbytes = block_range.kv_bytes_per_block(max_length) * (block_range.end - first_block)
        wait_s = msg.admission_wait_s
        key = f"{client_id}/{session_id}/{uuid.uuid4().hex[:8]}"
        cache = self.server.prefix_cache
        hashes = list(msg.prefix_hashes or ())  # checked by Open.check
        # a prefix's KV depends on the adapter it was computed with: never shared across adapters
        namespace = cache.namespace(client_id, first_block, msg.adapter) if cache is not None else ""
        match = (lambda: cache.match(namespace, hashes) * cache.chunk_tokens) if cache is not None and hashes else None
        # waits in the admission queue while memory is full (OutOfCacheError / AdmissionTimeoutError)
        await self.server.admission.reserve(key, nbytes, session_id, client_id, wait_s, prefix_match=match)
        try:
            kv = block_range.allocate_kv(max_length, first_block, msg.adapter)
        except Exception:
            self.budget.release(key)
            self.server.admission.on_release()
            raise
        session = OpenSession(session_id, client_id, kv, key, namespace, hashes)
        if cache is not None and hashes:
            # pinned until the first step says how much of it the whole chain can use
            session.prefix_pin = cache.pin(namespace, hashes, client_id)
            cache.count_asked(client_id, len(hashes) * cache.chunk_tokens)
        self.server.on_session_opened(session)
        # the session id carries an API gateway's request id: this line ties a request to this server
        logger.info("session %s of %s opened on blocks [%d, %d) for %d tokens", session_id, client_id, first_block,
                    block_range.end, max_length)
        return session

    async def _step(self, session: OpenSession, hidden: torch.Tensor, prefix_tokens: int = 0,
                    start_position: int | None = None) -> torch.Tensor:
        cache = self.server.prefix_cache
        if session.prefix_pin is not None and not session.prefix_pin.released:
            # the first step: copy the part of the cached prefix that every hop holds (the client
            # sends the minimum of the hops' matches), then let the cache evict it again
            session.prefix_tokens = cache.take(session.prefix_pin, prefix_tokens, session.kv, session.client_id)
        elif prefix_tokens:
            raise InvalidRequestError("prefix_tokens is only valid in the first step of a session whose open sent "
                                      "prefix_hashes to a server with a prefix cache (its open reply says so)")
        if start_position is not None:
            self._roll_back(session, start_position)
        out = await self._run_step(session, hidden)
        if cache is not None and session.prefix_stored < len(session.prefix_hashes):
            # offer the prompt's full chunks this session computed (no other step of it runs now)
            cache.insert(session.prefix_namespace, session.prefix_hashes, session.kv)
            session.prefix_stored = min(len(session.prefix_hashes), session.kv.past_tokens // cache.chunk_tokens)
        return out

    def _roll_back(self, session: OpenSession, start_position: int) -> None:
        """KV rollback: the step starts at `start_position` (at most the session's length). The static
        cache stays allocated and the step overwrites it from there; the prompt's chunk hashes are cut to
        the chunks still below it, so positions that now hold other tokens are never offered to the
        prefix cache under the prompt's keys (chunks offered earlier are copies, still valid)."""
        kv = session.kv
        if not 0 <= start_position <= kv.past_tokens:
            raise InvalidRequestError(
                f"start_position={start_position} is past this session's {kv.past_tokens} processed tokens; a step "
                "may only restart at or before the current position (send the missing tokens first)")
        kv.past_tokens = start_position
        cache = self.server.prefix_cache
        kept = start_position // cache.chunk_tokens if cache is not None else 0
        if kept < len(session.prefix_hashes):
            del session.prefix_hashes[kept:]
            session.prefix_stored = min(session.prefix_stored, kept)

    async def _run_step(self, session: OpenSession, hidden: torch.Tensor) -> torch.Tensor:
        step = StepInput(session.kv, hidden)
        self.server.block_range.validate_step(step)
        if hidden.dtype != self.server.block_range.dtype:
            raise InvalidRequestError(f"hidden states must be {self.server.block_range.dtype}, got {hidden.dtype}")
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(result, error):
            def settle():
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
            loop.call_soon_threadsafe(settle)

        self.scheduler.submit(session.reservation_key, session.client_id, step, deliver,
                              prefix_tokens=session.prefix_tokens)
        return await future

    # -- stateless forward ----------------------------------------------------------------
    @wire.replies_with_typed_errors
    async def forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Forward of whole sequences [batch, seq, hidden] without keeping a cache, in one message of
        at most MAX_PART_BYTES of tensors (larger ones come over forward_stream)."""
        message = wire_parts.decode_single(request, admit=self._admit)
        (reply,) = wire_parts.to_messages(Forward().to_wire(), (await self._forward(message, context),), reply=True)
        return reply

    async def forward_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest],
                             context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The same forward for tensors of any size: one message group in, one out."""
        try:
            message = await wire_parts.receive_one(requests, admit=self._admit)
            out = await self._forward(message, context)
        except StopAsyncIteration:
            # the input ended mid-request: a caller that only half-closed still reads, and must get a
            # typed error rather than a stream that ends without a word (if it is gone, this is dropped)
            yield wire.error_response(InvalidRequestError(
                "the forward stream ended before a whole request arrived; send every part of the hidden states "
                "(wire_parts.to_messages) before ending the stream"))
            return
        except Exception as e:
            if not isinstance(e, PetalsChainError):  # a bug must not take the server down: report it to this caller
                logger.exception("unexpected error in rpc_forward_stream")
            yield wire.error_response(e)
            await wire_parts.drain(requests)  # the parts still on their way
            return
        for response in wire_parts.to_messages(Forward().to_wire(), (out,), reply=True):
            yield response

    async def _forward(self, message: wire_parts.Message, context: P2PContext) -> torch.Tensor:
        client_id = str(context.remote_id)
        block_range = self.server.block_range
        if block_range is None:
            raise ServerUnavailableError("this server holds no blocks yet; use another server")
        if message.meta.get("type", Forward.TYPE) != Forward.TYPE:
            raise InvalidRequestError(f"rpc_forward takes 'forward' messages, got type {message.meta.get('type')!r}")
        request = Forward.from_wire(message.meta)
        entry_block = request.entry_block
        check_adapter(request.adapter, block_range.adapters)
        first_block = block_range.start if entry_block is None else entry_block
        if len(message.tensors) != 1:
            raise InvalidRequestError(f"rpc_forward carries exactly one tensor, got {len(message.tensors)}")
        hidden = message.tensors[0]
        if hidden.dim() != 3 or hidden.shape[0] < 1:
            raise InvalidRequestError(f"rpc_forward takes [batch, seq, {block_range.hidden_size}], got {tuple(hidden.shape)}")
        if hidden.shape[1] > self.server.max_length_tokens:
            raise MaxLengthExceededError(f"sequence of {hidden.shape[1]} tokens exceeds this server's "
                                         f"limit of {self.server.max_length_tokens}")
        outputs = []
        for row, seq in enumerate(hidden):
            key = f"{client_id}/forward-{uuid.uuid4().hex[:8]}-{row}"
            self.budget.reserve(key, block_range.kv_bytes_per_block(seq.shape[0]) * (block_range.end - first_block))
            try:
                temp = OpenSession(key, client_id, block_range.allocate_kv(seq.shape[0], first_block, request.adapter),
                                   key)
                outputs.append(await self._run_step(temp, seq))
            finally:
                self.budget.release(key)
                self.server.admission.on_release()
        return torch.stack(outputs)
