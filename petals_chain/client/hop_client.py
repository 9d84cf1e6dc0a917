"""How the client talks to one server (`HopClient`: stub, timeouts, error mapping, forward/open/step/
close); what a failure then leads to is `recovery.py`'s.

Only transport errors and a server's typed "unavailable"/"out of cache" replies count as the
server's failure (`as_server_error`); a local error propagates unchanged and bans nobody.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from petals_chain.errors import (
    InvalidRequestError,
    MaxLengthExceededError,
    NotAllowedError,
    OutOfCacheError,
    PetalsChainError,
    ServerUnavailableError,
)
from petals_chain.transport.direct_stream import DirectDialer
from petals_chain.transport.framed_stream import FramedStream
from petals_chain.transport.protocol import BlockService
from petals_chain.wire import codec as wire
from petals_chain.wire import parts as wire_parts
from petals_chain.wire import records as wire_records
from petals_chain.wire.messages import (
    Close,
    Forward,
    Hop,
    Open,
    Opened,
    Step,
    StepReply,
)
from petals_chain.wire.prefix_keys import PREFIX_CHUNK_TOKENS

logger = logging.getLogger(__name__)

# Liveness of an open session's hops (`HopClient.receive_while_alive`): a step pending longer than
# max(LIVENESS_FLOOR_S, LIVENESS_STEP_FACTOR x the hop's median recent round trip) makes the client
# probe the server (rpc_info); LIVENESS_PROBES probes in a row unanswered within LIVENESS_PROBE_S
# each fail the hop over. Generous next to a live server's rpc_info round trip (what clients already
# route by, with a 3-s cutoff) because a false verdict costs a failover; two in a row, so that one
# probe lost to a moment of CPU starvation (a loaded machine leaves a process unscheduled for
# seconds) is no verdict. A killed server is noticed sooner still, by its reset stream.
LIVENESS_FLOOR_S = 2.0
LIVENESS_STEP_FACTOR = 4.0
LIVENESS_RECENT_STEPS = 5
LIVENESS_PROBE_S = 4.0
LIVENESS_PROBES = 2

# Errors that are the caller's fault: retrying on another server would fail the same way.
CALLER_ERRORS = (InvalidRequestError, MaxLengthExceededError)
# What a dead, slow or unreachable server looks like to the transport. Anything else raised while
# talking to a server is a local error (a bug or misuse in this process, e.g. two threads reading
# one stream) and propagates as it is: it must never get a healthy server banned.
TRANSPORT_ERRORS = (
    TimeoutError,
    asyncio.TimeoutError,
    StopAsyncIteration,
    ConnectionError,
    EOFError,
    OSError,
    P2PHandlerError,
    P2PDaemonError,
)
# A server's failures that another server may not have: the hop is failed over (the server is banned
# for the session). NotAllowedError: a members-only server (--allowed-peers) in an open swarm refuses
# this client, which then uses the swarm's other servers instead of failing.
FAILOVER_ERRORS = (ServerUnavailableError, OutOfCacheError, NotAllowedError)


def as_server_error(error: Exception, timeout_s: float) -> PetalsChainError | None:
    """The typed error a failure while talking to a server stands for, or None for a local error
    (which the caller re-raises unchanged, so no failover bans the server for it)."""
    if isinstance(error, PetalsChainError):
        return error  # the server's typed reply, or ours: the caller decides what it means
    if isinstance(error, (TimeoutError, asyncio.TimeoutError)):
        return ServerUnavailableError(f"no reply within {timeout_s:.0f} s")
    if isinstance(error, StopAsyncIteration):
        return ServerUnavailableError("the server closed the stream")
    if isinstance(error, TRANSPORT_ERRORS):  # connection reset, peer gone, p2p daemon errors
        return ServerUnavailableError(f"{type(error).__name__}: {error}")
    return None


class HopFailed(Exception):
    """A hop failed in a way another server may not (`FAILOVER_ERRORS`): the failover policy decides."""

    def __init__(self, hop: Hop, error: PetalsChainError):
        super().__init__(str(error))
        self.hop, self.error = hop, error


@dataclass
class HopStream:
    """A session's open `rpc_inference` stream on one hop, and what the client keeps for it."""

    hop: Hop
    channel: FramedStream  # the stream: `send` writes requests, iterating reads ExpertResponses
    inputs: list[torch.Tensor] = field(default_factory=list)  # everything sent to this hop, for replay
    prefix_match_tokens: int = 0  # of the prompt, what this hop's prefix cache holds (its open reply)
    prefix_tokens: int | None = None  # to send with its first step (then None): the chain's reuse
    prefix_in_inputs: bool = False  # `inputs` start with the reused prefix (a hop rebuilt by replay)
    relay_from: str | None = None  # server relay: the peer whose pushes this hop's server takes
    raw_frames: bool = False  # its server takes steps as raw frames (its open reply said so)
    late_copies: int = 0  # server relay: steps whose held-back copy had to go out (see step_async)


@dataclass(frozen=True)
class StepResult:
    # a decode step's reply in a raw frame stays a RawTensor: the next hop gets its bytes as they came
    # (client relay), and `wire_parts.as_tensor` decodes it where the values are needed
    output: torch.Tensor | wire_parts.RawTensor
    reply: StepReply
    client_s: float  # from sending the hidden states to the whole reply
    copy_sent_late: bool = False  # a held-back copy (`copy_after_s`) went out before the reply came


class HopClient:
    """The client's side of the block-server RPCs for any hop: each call runs on `loop` (a
    `BackgroundLoop`) within its timeout, and a failure comes out as the server's typed error
    (`run`), so callers see `PetalsChainError`s or local errors, never raw transport ones."""

    def __init__(
        self, loop, p2p, *, step_timeout_s: float = 30.0, open_timeout_s: float = 15.0, direct_streams: bool = True
    ):
        self.loop = loop
        self.p2p = p2p
        self.step_timeout_s = step_timeout_s
        self.open_timeout_s = open_timeout_s
        # session streams direct to servers that offer them (--direct-port), else over p2p; used on `loop` only
        self.dialer = DirectDialer(p2p, enabled=direct_streams)

    def stub(self, peer_id: str):
        return BlockService.get_stub(self.p2p, PeerID.from_base58(peer_id))

    async def open_channel(self, peer_id: str) -> FramedStream:
        """A new `rpc_inference` stream to `peer_id` (one socket write per message): a direct TCP stream
        where the server offers one (petals_chain/transport/direct_stream.py), else through the p2p daemons."""
        return await self.dialer.open(peer_id, BlockService.handle_name("rpc_inference"))

    def run(self, coro, timeout_s: float):
        """Run `coro` on the loop; a server's failure is raised as its typed error."""
        try:
            return self.loop.run(coro, timeout_s=timeout_s)
        except Exception as e:
            server_error = as_server_error(e, timeout_s)
            if server_error is None or server_error is e:
                raise
            raise server_error from e

    def run_hop(self, hop: Hop, coro, timeout_s: float):
        """`run`, with a failure another server may not have raised as `HopFailed` naming `hop`."""
        try:
            return self.run(coro, timeout_s)
        except FAILOVER_ERRORS as e:
            raise HopFailed(hop, e) from e

    @staticmethod
    def hop_error(hop: Hop, error: Exception, timeout_s: float) -> Exception:
        """What `run_hop` raises for `error` (caught on the loop): HopFailed, another typed error, or
        `error` itself when it is local."""
        mapped = as_server_error(error, timeout_s)
        if mapped is None:
            return error
        if isinstance(mapped, FAILOVER_ERRORS):
            failed = HopFailed(hop, mapped)
            failed.__cause__ = error
            return failed
        if mapped is not error:
            mapped.__cause__ = error
        return mapped

    # -- stateless forward ----------------------------------------------------------------
    def forward(self, hop: Hop, hidden: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        return self.run_hop(hop, self.forward_async(hop, hidden, adapter), self.step_timeout_s + 2)

    async def forward_async(self, hop: Hop, hidden: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """One hop of a forward (with the LoRA `adapter` if given): unary when the tensor fits one
        message, else the streaming RPC."""
        requests = wire_parts.to_messages(Forward(hop.start, adapter).to_wire(), (hidden,))
        stub = self.stub(hop.peer_id)
        if len(requests) == 1:
            reply = wire_parts.decode_single(
                await self.receive_while_alive(
                    hop,
                    stub.rpc_forward(requests[0], timeout=self.step_timeout_s),
                    LIVENESS_FLOOR_S,
                    self.step_timeout_s,
                    "the forward",
                )
            )
        else:

            async def outgoing():
                for request in requests:
                    yield request

            async def reply_on_stream() -> wire_parts.Message:
                replies = await stub.rpc_forward_stream(outgoing())
                try:
                    return await wire_parts.receive_one(replies)
                finally:
                    await replies.aclose()  # stops sending parts the server refused (early error reply)

            try:
                # the stream's opening too: a dial to a dead peer can hang as well as its reply
                reply = await self.receive_while_alive(
                    hop, reply_on_stream(), LIVENESS_FLOOR_S, self.step_timeout_s, "the forward"
                )
            except StopAsyncIteration:  # the stream ended before a whole reply: the server or the link went away
                raise ServerUnavailableError(
                    f"server {hop.describe()} closed the forward stream before its reply "
                    "(it died or the connection broke)"
                ) from None
            except InvalidRequestError as e:  # the reply's parts do not fit together: the server's fault
                raise ServerUnavailableError(f"server {hop.describe()} sent a malformed forward reply: {e}") from e
        wire.raise_if_error(reply.meta)
        if len(reply.tensors) != 1:
            raise ServerUnavailableError(f"server {hop.describe()} sent a malformed forward reply")
        return reply.tensors[0]

    # -- session streams ------------------------------------------------------------------
    def open(self, hop: Hop, open_msg: Open) -> HopStream:
        return self.run_hop(hop, self.open_async(hop, open_msg), self.open_timeout_s + 2)

    async def open_async(self, hop: Hop, open_msg: Open) -> HopStream:
        opened_channel: list[FramedStream] = []

        async def open_stream():
            channel = await self.open_channel(hop.peer_id)
            opened_channel.append(channel)
            await channel.send(wire.request(open_msg))
            return channel, await anext(channel)

        try:
            # the stream's opening too: the client's p2p daemon can hang dialling a dead peer (seen
            # while another server was frozen) as well as open a stream that is never answered
            channel, first = await self.receive_while_alive(
                hop, open_stream(), LIVENESS_FLOOR_S, self.open_timeout_s, "the open"
            )
        except BaseException:
            for channel in opened_channel:  # the stream, if it was opened
                channel.abort()
            raise
        meta = wire.unpack(first.metadata)
        try:
            opened = wire.decode_reply(meta, Opened)
        except PetalsChainError as e:
            channel.end()
            if isinstance(e, InvalidRequestError) and meta.get("type") != "error":  # not its typed refusal
                raise ServerUnavailableError(f"server {hop.describe()} sent a malformed open reply: {e}") from e
            raise
        hashes = open_msg.prefix_hashes or []
        match = opened.prefix_match_tokens or 0
        # a server without a cache (or another chunk size) does not answer: nothing reused on this chain
        if opened.prefix_chunk_tokens != PREFIX_CHUNK_TOKENS or not 0 <= match <= len(hashes) * PREFIX_CHUNK_TOKENS:
            match = 0
        return HopStream(
            hop, channel, prefix_match_tokens=match, relay_from=open_msg.relay_from, raw_frames=bool(opened.raw_frames)
        )

    def step(
        self,
        stream: HopStream,
        step: Step,
        hidden: torch.Tensor | wire_parts.RawTensor,
        liveness_after_s: float = LIVENESS_FLOOR_S,
    ) -> StepResult:
        return self.run_hop(
            stream.hop, self.step_async(stream, step, hidden, liveness_after_s), self.step_timeout_s + 2
        )

    async def step_async(
        self,
        stream: HopStream,
        step: Step,
        hidden: torch.Tensor | wire_parts.RawTensor,
        liveness_after_s: float = LIVENESS_FLOOR_S,
        copy_after_s: float | None = None,
    ) -> StepResult:
        """One step on `stream`; its reply awaited with liveness probes after `liveness_after_s`.

        `hidden` may be the previous hop's reply as it came (a `RawTensor`): a raw frame carries its
        bytes on as they are, and it is decoded (for the caller's history) only once this step is on
        its way, while the server computes. The reply's output is a RawTensor when it came as a raw
        frame.

        `copy_after_s` (server relay, a hop whose input the hop before pushes to it): the step is sent
        only if the reply has not come within that many seconds. The server answers a pushed step on
        this stream as it answers the client's copy, so while pushes arrive the copy is never needed:
        held back, it costs neither side an encode, a socket write and a wake-up per hop and step
        (on 2 shared cores, CPU taken from the hop computing). A lost or refused push delays that
        step by `copy_after_s`; `StepResult.copy_sent_late` tells the caller, who stops holding copies
        back for a hop whose pushes keep missing. Only a step that fits one raw frame (a decode step)
        is held back; the rest go at once."""
        t0 = time.perf_counter()
        # a raw frame where the server takes one and the step fits it (a decode step), else protobuf parts
        meta = step.to_wire()
        raw = wire_parts.encode_raw(meta, hidden) if stream.raw_frames else None
        requests = [raw] if raw is not None else wire_parts.to_messages(meta, (wire_parts.as_tensor(hidden),))
        hold_s = copy_after_s if raw is not None else None  # only a one-frame step is held back
        copied: list[bool] = []

        def send_copy() -> None:
            copied.append(True)
            # a small frame: written at once unless the stream is closing (then its reply wait fails anyway)
            stream.channel.send_nowait(*requests)

        async def exchange() -> wire_parts.Message:
            if hold_s is None:
                await stream.channel.send(*requests)  # waits only when the socket is full (a large prompt)
                wire_parts.as_tensor(hidden)  # off the critical path now: the server has the step
                return await wire_parts.receive_one(stream.channel, lazy=True)
            held = asyncio.get_running_loop().call_later(hold_s, send_copy)
            try:
                wire_parts.as_tensor(hidden)
                return await wire_parts.receive_one(stream.channel, lazy=True)
            finally:
                held.cancel()

        try:
            reply = await self.receive_while_alive(stream.hop, exchange(), liveness_after_s, self.step_timeout_s)
        except InvalidRequestError as e:  # the reply's parts do not fit together: the server's fault
            raise ServerUnavailableError(f"server {stream.hop.describe()} sent a malformed step reply: {e}") from e
        client_s = time.perf_counter() - t0
        wire.raise_if_error(reply.meta)
        try:
            meta = StepReply.from_wire(reply.meta)
        except InvalidRequestError as e:
            raise ServerUnavailableError(f"server {stream.hop.describe()} sent a malformed step reply: {e}") from e
        if len(reply.tensors) != 1:
            raise ServerUnavailableError(f"server {stream.hop.describe()} sent a malformed step reply")
        return StepResult(reply.tensors[0], meta, client_s, bool(copied))

    async def probe_error(self, peer_id: str, timeout_s: float) -> str | None:
        """None when the server replies to an `rpc_info` (any reply, a typed refusal included) within
        `timeout_s`, else why not (a refused dial, a timeout): it runs on the server's RPC loop, not
        behind the compute, so a busy server answers."""
        try:
            await self.stub(peer_id).rpc_info(wire.request(wire_records.InfoRequest()), timeout=timeout_s)
        except P2PHandlerError:
            return None  # its handler ran and raised: the host is there
        except (TimeoutError, asyncio.TimeoutError):
            return f"no answer within {timeout_s:.1f} s"
        except Exception as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return None

    async def receive_while_alive(
        self, hop: Hop, reply, liveness_after_s: float, timeout_s: float, what: str = "the step"
    ):
        """The result of `reply` (an awaitable: the server's reply to the request just sent). While it
        is pending past `liveness_after_s` the server is probed (`rpc_info`); LIVENESS_PROBES probes in
        a row without an answer within LIVENESS_PROBE_S each mean it is gone, and the request fails
        over then instead of at `timeout_s`. So a silent server is noticed within about
        `liveness_after_s` + LIVENESS_PROBES x LIVENESS_PROBE_S (10 s for steps under half a second),
        a dead one (its probes' dials are refused) within `liveness_after_s`; a slow server that
        answers its probes keeps its request until `timeout_s`.

        Every reply a hop awaits (open, step, forward) goes through here, because a stream can be
        silent without any error: a host that vanished without closing its connections, a frozen
        process, and a server SIGKILLed a moment before the request: the client's p2p daemon had not
        yet seen that connection close, opened the stream on it and never resets it, so the open of
        a replacement killed just before waited for its whole open timeout (15 s) with either relay."""
        # Why no task for the reply: the reply is awaited in this task, and a timer starts the probing
        # beside it only once the reply is late. A task per reply (and `asyncio.wait` on it) cost each
        # hop of every decode step two more event-loop iterations; the probes are the rare case. One
        # timer per reply, not two: the watcher also ends the wait at the timeout (`asyncio.timeout_at`
        # around the wait was a second timer armed and cancelled per hop and step).
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        deadline = loop.time() + timeout_s
        verdict: list[Exception] = []  # set by the watcher: the server is gone, or the timeout passed
        watcher: list[asyncio.Task] = []

        def end_wait(error: Exception) -> None:
            verdict.append(error)
            task.cancel()

        async def watch() -> None:
            """Probe while the reply is late; after LIVENESS_PROBES failures in a row, or at the
            deadline, cancel the wait."""
            failed_probes = 0
            while (left_s := deadline - loop.time()) > 0:
                waited_s = timeout_s - left_s
                probe_error = await self.probe_error(hop.peer_id, max(0.5, min(LIVENESS_PROBE_S, left_s)))
                if probe_error is None:
                    failed_probes = 0
                    # it answers: a slow server keeps its request (until the deadline)
                    await asyncio.sleep(max(0.0, min(liveness_after_s, deadline - loop.time())))
                    continue
                failed_probes += 1
                if failed_probes >= LIVENESS_PROBES:
                    end_wait(
                        ServerUnavailableError(
                            f"server {hop.describe()} went silent: no reply to {what} for {waited_s:.1f} s and "
                            f"none to {LIVENESS_PROBES} liveness probes in a row ({LIVENESS_PROBE_S:.0f} s each; "
                            f"last: {probe_error})"
                        )
                    )
                    return
            end_wait(TimeoutError(f"no reply to {what} from {hop.describe()} within {timeout_s:.1f} s"))

        late = loop.call_later(min(liveness_after_s, timeout_s), lambda: watcher.append(asyncio.ensure_future(watch())))
        try:
            return await reply
        except asyncio.CancelledError:
            if not verdict:
                raise  # cancelled from outside
            task.uncancel()  # the watcher's cancel, turned into its verdict
            raise verdict[0] from None
        finally:
            late.cancel()
            for w in watcher:
                w.cancel()

    def close(self, streams: list[HopStream]) -> None:
        """Close `streams` (best effort: a dead server's stream is gone anyway)."""

        async def close(s: HopStream):
            try:
                await s.channel.send(wire.request(Close()))
            finally:
                s.channel.end()

        for s in streams:
            try:
                self.loop.run(close(s), timeout_s=2)
            except Exception:
                pass
