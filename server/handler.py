"""The block server's RPCs on hivemind P2P: rpc_info, rpc_inference (stream), rpc_forward.

Every message is validated at this boundary; a bad one gets a typed error reply and the stream
(and the server) keeps serving. The client's identity for accounting is `context.remote_id`, the
libp2p peer id authenticated by the transport, never a self-declared string.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from petals_chain.errors import (
    InvalidRequestError,
    MaxLengthExceededError,
    PetalsChainError,
    RequestTooLargeError,
    ServerUnavailableError,
    SessionIdleTimeoutError,
    UnknownSessionError,
)
from petals_chain.runtime.kv_cache import SessionKV
from petals_chain.runtime.lora import check_adapter
from petals_chain.transport.direct_stream import DirectDialer, DirectListener
from petals_chain.wire import codec as wire
from petals_chain.wire import parts as wire_parts
from petals_chain.wire import records as wire_records
from petals_chain.wire.messages import (
    Close,
    DirectOffer,
    DirectRequest,
    Forward,
    Open,
    Opened,
    Push,
    Step,
    StepReply,
    decode_tagged,
)
from petals_chain.wire.records import ServerInfo
from server import relay
from server.lifecycle import ServerLifecycle
from server.prefix_cache import PrefixPin
from server.prefix_report import prefix_delta
from server.relay import RelayInbox, RelayIndex, RelayLinks
from server.reservation import SessionReservation
from server.service_meter import ServiceMeter
from server.serving_stack import ServingStack
from server.step_request import StepRequest

logger = logging.getLogger(__name__)

INLINE_MAX_TOKENS = 16  # the largest step run on the event loop itself (decode and speculative verify steps)
# An inline batch's service record is written this long after its reply, not at once: the kernel tends
# to wake a reply's reader on its writer's core (they talk to each other), so work this process does
# right after the write delays the client it just woke (measured on loopback: 0.22 -> 0.17 ms to the
# client's read); the record waits for an idle moment instead.
OBSERVE_AFTER_S = 0.002
FORWARD_LINGER_S = 10.0  # how long a forward stream waits, after its reply, for the caller to end its input


@dataclass(frozen=True)
class ServicerLimits:
    """What the servicer enforces besides its stack's budget (advertised in rpc_info)."""

    max_length_tokens: int
    max_step_tokens: int
    session_idle_timeout_s: float


@dataclass
class OpenSession:
    """One stream's session: what it holds (`reservation`) and where its prefix reuse stands."""

    session_id: str
    reservation: SessionReservation
    inbox: RelayInbox  # its stream's messages and pushed steps; `claim` runs each step id once
    links: RelayLinks  # its push streams to the next hops
    prefix_namespace: str = ""
    prefix_hashes: list[str] = field(default_factory=list)  # chained chunk hashes of its prompt (client's)
    prefix_tokens: int = 0  # tokens its first step took from the cache
    prefix_stored: int = 0  # chunks of its prompt offered to the cache so far
    stop_pushes: Callable[[], None] | None = None  # undoes its relay index entry
    raw_replies: bool = False  # its client sends raw frames: its replies go so too (wire_parts.RawFrame)

    @property
    def stack(self) -> ServingStack:
        return self.reservation.stack

    @property
    def kv(self) -> SessionKV:
        return self.reservation.kv

    @property
    def client_id(self) -> str:
        return self.reservation.client_id

    @property
    def prefix_pin(self) -> PrefixPin | None:
        return self.reservation.prefix_pin


def the_tensor(message: wire_parts.Message, what: str) -> torch.Tensor:
    """The one tensor a step, a push or a forward carries (`what`: e.g. "a step carries")."""
    if len(message.tensors) != 1:
        raise InvalidRequestError(f"{what} exactly one tensor, got {len(message.tensors)}")
    return message.tensors[0]


class BlockServicer:
    """Implementation behind `petals_chain.transport.protocol.BlockService`. It sees the server through five
    typed things only: its limits, the server's `lifecycle` (the current serving stack, and opens
    through it: `ServerLifecycle.opening`), `info()` and the service `meter` for rpc_info, its `dialer`
    for pushing to next hops (server/relay.py), and its `direct` listener (None: no direct streams).

    One step's way: its message (`Step`, or a pushed `Push`) and its tensor become one `StepRequest`,
    checked once (`_request`: the session's rules, then the range's in `StepRequest.checked`) before
    anything of the session changes; `_step` applies its prefix reuse and KV rollback and runs it;
    `_compute` is the one place its output comes back from the scheduler (steps, pushed steps and
    forward rows alike)."""

    def __init__(
        self,
        limits: ServicerLimits,
        lifecycle: ServerLifecycle,
        info: Callable[[], ServerInfo],
        meter: ServiceMeter,
        dialer: DirectDialer,
        direct: DirectListener | None = None,
    ):
        self.limits = limits
        self.lifecycle = lifecycle
        self._info = info
        self.meter = meter
        self.dialer = dialer  # streams to the next hop: direct where it offers them, else p2p
        self.direct_listener = direct
        self.relay_index = RelayIndex()  # which session takes pushes from which peer
        # the streams' sessions by reservation key (on the loop only): what `evict` closes
        self._open_sessions: dict[str, OpenSession] = {}

    def _stack(self, what: str) -> ServingStack:
        stack = self.lifecycle.current
        if stack is None:
            raise ServerUnavailableError(f"this server holds no blocks right now ({what}); use another server")
        return stack

    async def info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        try:  # any request gets the info; a well-formed one may also ask for the measured batches
            req = wire.decode_request(request, wire_records.InfoRequest)
        except PetalsChainError:
            req = wire_records.InfoRequest()
        return wire.response(
            wire_records.InfoReply(
                self._info(), self.meter.since(req.service_since_seq), prefix_delta(self.lifecycle.current, req)
            )
        )

    @wire.replies_with_typed_errors
    async def direct(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        wire.decode_request(request, DirectRequest)
        offer = DirectOffer() if self.direct_listener is None else self.direct_listener.offer(str(context.remote_id))
        return wire.response(offer)

    # -- inference stream ---------------------------------------------------------------------
    async def inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        client_id = str(context.remote_id)
        session: OpenSession | None = None
        # one inbox per stream: its client's messages (tensors arrive in parts, reassembled) and the
        # steps the previous hop pushes (server relay), consumed in arrival order
        idle_timeout_s = self.limits.session_idle_timeout_s
        # a client that went silent must not hold its KV reservation forever
        inbox = RelayInbox(wire_parts.assembled(requests, admit=self._admit, finite=True), idle_timeout_s)
        try:
            while True:
                try:
                    kind, message = await inbox.next()
                except TimeoutError:
                    logger.info("closing a session of %s idle for %.0f s", client_id, idle_timeout_s)
                    yield wire.error_response(
                        SessionIdleTimeoutError(
                            f"the server closed this stream: nothing arrived for {idle_timeout_s:.0f} s "
                            "(its --session-idle-timeout); open a new session, and send steps or close sooner"
                        )
                    )
                    return
                if kind == relay.END:
                    return
                if kind == relay.EVICTED:  # the server moves (`evict`): the client fails this session over
                    logger.info("closing a session of %s: %s", client_id, message)
                    yield wire.error_response(message)
                    return
                if kind == relay.FAILED:
                    raise message
                try:
                    if kind == relay.PUSHED:  # claimed by rpc_push already
                        push, hidden = message
                        for response in await self._run_and_reply(session, push, hidden):
                            yield response
                        continue
                    if isinstance(message, PetalsChainError):  # a bad group (refused by its header, or malformed)
                        raise message
                    msg = decode_tagged(message.meta, Open, Step, Close)
                    if isinstance(msg, Open):
                        if session is not None:
                            raise InvalidRequestError("this stream already has an open session")
                        session = await self._open(msg, client_id, inbox)
                        self._open_sessions[session.reservation.key] = session
                        pin = session.prefix_pin  # how much of the prompt this hop holds
                        yield wire.response(
                            Opened(
                                session.session_id,
                                session.kv.first_block,
                                session.kv.end_block,
                                prefix_match_tokens=None if pin is None else pin.tokens,
                                prefix_chunk_tokens=None if pin is None else pin.chunk_tokens,
                                raw_frames=True,
                            )
                        )
                    elif isinstance(msg, Step):
                        if session is None:
                            raise UnknownSessionError("step before open: send an 'open' message first")
                        if msg.session_id != session.session_id:
                            raise UnknownSessionError(f"unknown session {msg.session_id!r} on this stream")
                        hidden = the_tensor(message, "a step carries")
                        if msg.relay_from is not None:  # the previous hop changed (the client failed it over)
                            self._take_pushes_from(session, msg.relay_from)
                        session.raw_replies = message.raw
                        if not session.inbox.claim(msg.step_id):
                            self.relay_index.copies_skipped += 1
                            continue  # its pushed copy ran already (and was answered): run each step once
                        for response in await self._run_and_reply(session, msg, hidden):
                            yield response
                    else:  # Close
                        return
                except PetalsChainError as e:
                    yield wire.error_response(e)
                except Exception as e:  # a bug must not take the server down: report it to this client
                    logger.exception("unexpected error in rpc_inference")
                    yield wire.error_response(e)
        finally:
            inbox.close()
            if session is not None:
                self._open_sessions.pop(session.reservation.key, None)
                self._close(session)

    async def evict(self, error: Exception) -> int:
        """Close every open session's stream with `error` (a forced move: `ServerMovingError`), each after
        its running step, if any, is answered; and refuse the opens waiting for memory in admission with
        it. Run on the loop; returns how many streams and waiters it closed. The caller has refused new
        opens already (`ServerLifecycle.begin_move`)."""
        for session in list(self._open_sessions.values()):
            session.inbox.evict(error)
        stack = self.lifecycle.current
        waiting = stack.admission.fail_waiting(error) if stack is not None else 0
        return len(self._open_sessions) + waiting

    async def _run_and_reply(
        self, session: OpenSession, msg: Step | Push, hidden: torch.Tensor
    ) -> list[runtime_pb2.ExpertResponse | wire_parts.RawFrame]:
        """Run one step (the client's `Step` or a pushed `Push`, with its tensor), push its output on
        and build its reply."""
        t0 = time.perf_counter()
        request = self._request(
            session, hidden, msg.prefix_tokens if isinstance(msg, Step) else None, msg.start_position
        )
        out, compute_s = await self._step(session, request, msg.start_position)
        if msg.push_route and msg.step_id is not None:
            # the next hop gets it first (server relay), with the step's rollback; this reply feeds
            # the client's history
            session.links.push_soon(msg.push_route, msg.step_id, out, msg.start_position)
        # server_s: this step's time inside the server (queue + batch compute), so a client can tell
        # server time from network time (the Table 1 model check)
        reply = StepReply(session.session_id, msg.step_id, session.kv.past_tokens, time.perf_counter() - t0, compute_s)
        meta = reply.to_wire()
        raw = wire_parts.encode_raw(meta, out) if session.raw_replies else None
        return [raw] if raw is not None else wire_parts.to_messages(meta, (out,), reply=True)

    def _take_pushes_from(self, session: OpenSession, peer: str) -> None:
        if session.stop_pushes is not None:
            session.stop_pushes()
        session.stop_pushes = self.relay_index.register(session.session_id, peer, session.inbox)
        session.inbox.take_pushes()

    async def push(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """A previous hop's relay stream: each message group is one pushed step (`Push`), queued
        for its session, or refused with a typed error reply. A taken push gets no reply: an
        acknowledgement written here would go out before the step runs (this task holds the loop until
        it waits for the next push), putting a reply's encode and socket write, and the pusher's
        wake-up to read it, on the chain's critical path for nothing the pusher needs."""
        from_peer = str(context.remote_id)
        async for message in wire_parts.assembled(requests, admit=self._admit, finite=True):
            try:
                if isinstance(message, PetalsChainError):
                    raise message
                push = Push.from_wire(message.meta)
                self.relay_index.deliver(push, the_tensor(message, "a push carries"), from_peer)
            except PetalsChainError as e:
                yield wire.error_response(e)

    def _close(self, session: OpenSession) -> None:
        session.reservation.release()

    def _admit(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Refuse a step's or forward's hidden states by their header, before the rest arrives or
        any memory is allocated: the limit is `max_step_tokens` (advertised in rpc_info)."""
        block_range = self._stack("waiting for or loading its assignment").block_range
        if len(shape) not in (2, 3) or shape[-1] != block_range.hidden_size:
            raise InvalidRequestError(
                f"hidden states must be [tokens, {block_range.hidden_size}] (a step) or "
                f"[batch, seq, {block_range.hidden_size}] (a forward), got {list(shape)}"
            )
        tokens = math.prod(shape[:-1])
        if tokens > self.limits.max_step_tokens:
            raise RequestTooLargeError(
                f"{tokens} tokens in one request exceed this server's max_step_tokens={self.limits.max_step_tokens} "
                "(advertised in rpc_info); send the prompt in several steps, fewer forward rows at a time, or use "
                "a server started with a larger --max-step-tokens"
            )

    async def _open(self, msg: Open, client_id: str, inbox: RelayInbox) -> OpenSession:
        # counted as opening from the accepting check until it is in the session table or gave up
        # (a wait for memory included): a move of the server waits for it (ServerLifecycle.begin_move)
        with self.lifecycle.opening() as stack:
            block_range = stack.block_range
            session_id, max_length = msg.session_id, msg.max_length
            first_block = block_range.start if msg.entry_block is None else msg.entry_block
            if max_length > self.limits.max_length_tokens:
                raise MaxLengthExceededError(
                    f"max_length={max_length} exceeds this server's limit of {self.limits.max_length_tokens} tokens; "
                    "use a smaller max_length or a server started with a larger --max-length"
                )
            if not block_range.start <= first_block < block_range.end:
                raise InvalidRequestError(
                    f"entry_block {first_block} is outside this server's blocks "
                    f"[{block_range.start}, {block_range.end})"
                )
            check_adapter(msg.adapter, block_range.adapters)  # before any memory is reserved
            nbytes = block_range.kv_bytes_per_block(max_length) * (block_range.end - first_block)
            cache = stack.prefix_cache
            hashes = list(msg.prefix_hashes or ()) if cache is not None else []  # checked by Open.check
            # a prefix's KV depends on the adapter it was computed with: never shared across adapters
            namespace = cache.namespace(client_id, first_block, msg.adapter) if cache is not None else ""
            # waits in the admission queue while memory is full (OutOfCacheError / AdmissionTimeoutError)
            reservation = await SessionReservation.acquire(
                stack,
                key=f"{client_id}/{session_id}/{uuid.uuid4().hex[:8]}",
                session_id=session_id,
                client_id=client_id,
                nbytes=nbytes,
                max_length=max_length,
                first_block=first_block,
                adapter=msg.adapter,
                wait_s=msg.admission_wait_s,
                prefix_namespace=namespace,
                prefix_hashes=hashes,
            )
        session = OpenSession(session_id, reservation, inbox, RelayLinks(self.dialer, session_id), namespace, hashes)
        reservation.hold("relay streams", session.links.close)
        reservation.hold("relay index entry", lambda: session.stop_pushes() if session.stop_pushes else None)
        if msg.relay_from is not None:
            try:
                self._take_pushes_from(session, msg.relay_from)
            except BaseException:
                reservation.release()
                raise
        # the session id carries an API gateway's request id: this line ties a request to this server
        logger.info(
            "session %s of %s opened on blocks [%d, %d) for %d tokens",
            session_id,
            client_id,
            first_block,
            block_range.end,
            max_length,
        )
        return session

    def _request(
        self, session: OpenSession, hidden: torch.Tensor, prefix_tokens: int | None, start_position: int | None
    ) -> StepRequest:
        """The step as the scheduler runs it, checked once, before anything of the session changes
        (a refused step loses nothing: no prefix taken, no rollback): the session's rules here (the
        prefix reuse of its first step, the KV rollback's bound), the range's in `StepRequest.checked`."""
        kv, pin = session.kv, session.prefix_pin
        first = pin is not None and not pin.released
        prefix_tokens = prefix_tokens or 0
        if first:
            # the first step: it takes the part of the cached prefix that every hop holds (the client
            # sends the minimum of the hops' matches)
            session.stack.prefix_cache.check_take(pin, prefix_tokens, kv)
            held = prefix_tokens
        elif prefix_tokens:
            raise InvalidRequestError(
                "prefix_tokens is only valid in the first step of a session whose open sent "
                "prefix_hashes to a server with a prefix cache (its open reply says so)"
            )
        else:
            held = kv.past_tokens
        if start_position is not None and not 0 <= start_position <= held:
            raise InvalidRequestError(
                f"start_position={start_position} is past this session's {held} processed tokens; a step "
                "may only restart at or before the current position (send the missing tokens first)"
            )
        return StepRequest.checked(
            session.stack.block_range,
            kv,
            hidden,
            key=session.reservation.key,
            client_id=session.client_id,
            start_tokens=held if start_position is None else start_position,
            prefix_tokens=prefix_tokens if first else session.prefix_tokens,
        )

    async def _step(
        self, session: OpenSession, request: StepRequest, start_position: int | None = None
    ) -> tuple[torch.Tensor, float]:
        """Run a checked step: take its prefix from the cache (a first step), roll the session back
        to `start_position`, compute, offer the prompt's new chunks to the cache."""
        cache = session.stack.prefix_cache
        if session.prefix_pin is not None and not session.prefix_pin.released:
            # copy the prefix in, then let the cache evict it again
            session.prefix_tokens = cache.take(session.prefix_pin, request.prefix_tokens, session.kv, session.client_id)
        if start_position is not None:
            self._roll_back(session, start_position)
        out, compute_s = await self._compute(session.stack, request)
        if cache is not None and session.prefix_stored < len(session.prefix_hashes):
            # offer the prompt's full chunks this session computed (no other step of it runs now)
            cache.insert(session.prefix_namespace, session.prefix_hashes, session.kv)
            session.prefix_stored = min(len(session.prefix_hashes), session.kv.past_tokens // cache.chunk_tokens)
        return out, compute_s

    @staticmethod
    def _roll_back(session: OpenSession, start_position: int) -> None:
        """KV rollback (its bound checked by `_request`): the step starts at `start_position`. The static
        cache stays allocated and the step overwrites it from there; the prompt's chunk hashes are cut to
        the chunks still below it, so positions that now hold other tokens are never offered to the
        prefix cache under the prompt's keys (chunks offered earlier are copies, still valid)."""
        session.kv.past_tokens = start_position
        cache = session.stack.prefix_cache
        kept = start_position // cache.chunk_tokens if cache is not None else 0
        if kept < len(session.prefix_hashes):
            del session.prefix_hashes[kept:]
            session.prefix_stored = min(session.prefix_stored, kept)

    async def _compute(self, stack: ServingStack, request: StepRequest) -> tuple[torch.Tensor, float]:
        """Run a checked request through the stack's scheduler: the step's output and the forward time
        of the batches it ran in. The one place a step's output tensor comes back to the handler."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        loop_thread = threading.get_ident()

        def deliver(result, error):
            def settle():
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            if threading.get_ident() == loop_thread:
                settle()  # run inline on this loop: the await below returns without a loop iteration
            else:
                loop.call_soon_threadsafe(settle)

        # a lone session's small step runs inline on this loop when the scheduler is idle (no thread
        # hop); with several sessions, steps go through the scheduler thread so their batches form. A
        # long step (a prompt) never runs inline: it would hold this loop for seconds, and with it the
        # rpc_info liveness probes (a client then takes the busy server for a dead one: a 2,048-token
        # prefill at load 10 did), pushes and other streams; next to its compute the hop is nothing
        inline = len(stack.sessions) <= 1 and request.n_tokens <= INLINE_MAX_TOKENS
        # an inline batch's service record is written after this step's reply is on its way
        job = stack.scheduler.submit(
            request, deliver, inline=inline, defer=lambda observe: loop.call_later(OBSERVE_AFTER_S, observe)
        )
        out = await future
        if request.wire_dtype is not None:  # a mixed-dtype chain: the reply in the dtype the step came in
            out = out.to(request.wire_dtype)
        return out, job.compute_s

    # -- stateless forward ----------------------------------------------------------------
    @wire.replies_with_typed_errors
    async def forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Forward of whole sequences [batch, seq, hidden] without keeping a cache, in one message of
        at most MAX_PART_BYTES of tensors (larger ones come over forward_stream)."""
        message = wire_parts.decode_single(request, admit=self._admit, finite=True)
        (reply,) = wire_parts.to_messages(Forward().to_wire(), (await self._forward(message, context),), reply=True)
        return reply

    async def forward_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """The same forward for tensors of any size: one message group in, one out."""
        try:
            message = await wire_parts.receive_one(requests, admit=self._admit, finite=True)
            out = await self._forward(message, context)
        except StopAsyncIteration:
            # the input ended mid-request: a caller that only half-closed still reads, and must get a
            # typed error rather than a stream that ends without a word (if it is gone, this is dropped)
            yield wire.error_response(
                InvalidRequestError(
                    "the forward stream ended before a whole request arrived; send every part of the hidden states "
                    "(wire_parts.to_messages) before ending the stream"
                )
            )
            return
        except Exception as e:
            if not isinstance(e, PetalsChainError):  # a bug must not take the server down: report it to this caller
                logger.exception("unexpected error in rpc_forward_stream")
            yield wire.error_response(e)
            await wire_parts.drain(requests, FORWARD_LINGER_S)  # the parts still on their way
            return
        for response in wire_parts.to_messages(Forward().to_wire(), (out,), reply=True):
            yield response
        # the reply is sent, but the caller's end-of-stream may still be on its way: closing now would
        # break its pipe and lose the reply in its buffer (wire_parts.drain)
        await wire_parts.drain(requests, FORWARD_LINGER_S)

    async def _forward(self, message: wire_parts.Message, context: P2PContext) -> torch.Tensor:
        client_id = str(context.remote_id)
        stack = self._stack("waiting for or loading its assignment")
        block_range = stack.block_range
        if message.meta.get("type", Forward.TYPE) != Forward.TYPE:
            raise InvalidRequestError(f"rpc_forward takes 'forward' messages, got type {message.meta.get('type')!r}")
        request = Forward.from_wire(message.meta)
        entry_block = request.entry_block
        check_adapter(request.adapter, block_range.adapters)
        first_block = block_range.start if entry_block is None else entry_block
        hidden = the_tensor(message, "rpc_forward carries")
        if hidden.dim() != 3 or hidden.shape[0] < 1:
            raise InvalidRequestError(
                f"rpc_forward takes [batch, seq, {block_range.hidden_size}], got {tuple(hidden.shape)}"
            )
        if hidden.shape[1] > self.limits.max_length_tokens:
            raise MaxLengthExceededError(
                f"sequence of {hidden.shape[1]} tokens exceeds this server's limit of {self.limits.max_length_tokens}"
            )
        outputs = []
        for row, seq in enumerate(hidden):
            key = f"{client_id}/forward-{uuid.uuid4().hex[:8]}-{row}"
            # no wait for memory: a forward that does not fit now is refused (OutOfCacheError)
            row_reservation = await SessionReservation.acquire(
                stack,
                key=key,
                session_id=key,
                client_id=client_id,
                nbytes=block_range.kv_bytes_per_block(seq.shape[0]) * (block_range.end - first_block),
                max_length=seq.shape[0],
                first_block=first_block,
                adapter=request.adapter,
                wait_s=0.0,
                register=False,
            )
            try:
                request = StepRequest.checked(
                    block_range, row_reservation.kv, seq, key=key, client_id=client_id, start_tokens=0
                )
                outputs.append((await self._compute(stack, request))[0])
            finally:
                row_reservation.release()
        return torch.stack(outputs)
