"""The remote chain backend: relays a session's hidden states through servers over hivemind.

The client relays, as PETALS does: it sends the embeddings to the first server, its output to the
second, and so on (the paper's tau_c model assumes this). Each hop keeps the history of the inputs
it was sent, so when a server fails the client asks its `ChainProvider` for a replacement of the
chain from that hop on, replays the history through the replacement to rebuild its KV cache, and
continues: the output is identical to a run without the failure.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from petals_chain import wire, wire_parts
from petals_chain.background_loop import BackgroundLoop
from petals_chain.process_signals import start_dht
from petals_chain.client.chain import ChainBackend, ChainSession
from petals_chain.client.orchestrated import OrchestratorChainProvider
from petals_chain.client.routing import ChainProvider, DhtChainProvider
from petals_chain.dht_records import fetch_servers, model_key
from petals_chain.errors import (
    InvalidRequestError,
    MaxLengthExceededError,
    OutOfCacheError,
    PetalsChainError,
    ServerUnavailableError,
    SessionIdleTimeoutError,
)
from petals_chain.messages import Close, Forward, Hop, Open, Opened, Step, StepReply
from petals_chain.orchestrator_records import find_orchestrator
from petals_chain.protocol import BlockService, ping_block_server_s
from petals_chain.swarm_identity import SwarmIdentity, swarm_validators

logger = logging.getLogger(__name__)

# Errors that are the caller's fault: retrying on another server would fail the same way.
CALLER_ERRORS = (InvalidRequestError, MaxLengthExceededError)
# What a dead, slow or unreachable server looks like to the transport. Anything else raised while
# talking to a server is a local error (a bug or misuse in this process, e.g. two threads reading
# one stream) and propagates as it is: it must never get a healthy server banned.
TRANSPORT_ERRORS = (TimeoutError, asyncio.TimeoutError, StopAsyncIteration, ConnectionError, EOFError, OSError,
                    P2PHandlerError, P2PDaemonError)


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


class _HopFailed(Exception):
    """A hop of a stateless forward failed in a way another server may not (internal to forward)."""

    def __init__(self, hop: Hop, error: PetalsChainError):
        super().__init__(str(error))
        self.hop, self.error = hop, error


@dataclass(frozen=True)
class HopTiming:
    """One step through one hop, timed by the client: `client_s` from sending the hidden states to
    the reply, `server_s` the server's own time for it (queue + compute; None from servers that do
    not report it), so `client_s - server_s` is the network's part."""

    hop_index: int
    peer_id: str
    blocks: int
    tokens: int
    client_s: float
    server_s: float | None


@dataclass
class HopStream:
    hop: Hop
    queue: asyncio.Queue
    responses: object  # async iterator of ExpertResponse
    inputs: list[torch.Tensor] = field(default_factory=list)  # everything sent to this hop, for replay


class RemoteChain(ChainBackend):
    def __init__(self, model: str, config, initial_peers: list[str], dtype: torch.dtype = torch.float32, *,
                 provider: ChainProvider | None = None, step_timeout_s: float = 30.0, open_timeout_s: float = 15.0,
                 max_failovers: int = 3, wait_for_chain_s: float = 20.0, use_orchestrator: bool = True,
                 acquire_timeout_s: float = 120.0, allowed_servers: frozenset[str] | list[str] | None = None,
                 identity_path: str | None = None):
        self.model = model_key(model)
        self.num_blocks = config.num_hidden_layers
        self.dtype = dtype
        self.step_timeout_s = step_timeout_s
        self.open_timeout_s = open_timeout_s
        self.max_failovers = max_failovers
        # `identity_path`: a stable peer id, e.g. to be listed in a private swarm's --allowed-peers
        identity = ({"record_validators": swarm_validators()} if identity_path is None
                    else SwarmIdentity.load_or_create(identity_path).dht_kwargs())
        self.dht = start_dht(initial_peers=initial_peers, client_mode=True, **identity)
        self.loop = BackgroundLoop("client-p2p")
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout_s=30)
        # a private swarm: records of servers (and of an orchestrator) not on this list are ignored
        allowed = None if allowed_servers is None else frozenset(allowed_servers)
        self.orchestrator = (find_orchestrator(self.dht, self.model, allowed)
                             if provider is None and use_orchestrator else None)
        if provider is None and self.orchestrator is not None:
            provider = OrchestratorChainProvider(
                self.loop, self.p2p, self.orchestrator.peer_id, acquire_timeout_s=acquire_timeout_s,
                rediscover=lambda: getattr(find_orchestrator(self.dht, self.model, allowed), "peer_id", None))
        self.provider = provider or DhtChainProvider(lambda: fetch_servers(self.dht, self.model, allowed=allowed), self.ping_s,
                                                     wait_for_chain_s=wait_for_chain_s)

    def stub(self, peer_id: str):
        return BlockService.get_stub(self.p2p, PeerID.from_base58(peer_id))

    def ping_s(self, peer_id: str) -> float | None:
        """Round trip of rpc_info, or None when the peer does not answer within 3 s."""
        return ping_block_server_s(self.loop, self.p2p, peer_id)

    def server_info(self, peer_id: str) -> wire.ServerInfo:
        resp = self.loop.run(self.stub(peer_id).rpc_info(wire.request(wire.InfoRequest()), timeout=5.0), timeout_s=7.0)
        return wire.decode_reply(wire.unpack(resp.metadata), wire.InfoReply).info

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Stateless forward of [batch, seq, hidden] through a whole chain (rpc_forward); with an
        orchestrator it holds a chain slot for the call's duration."""
        sid = "forward-" + uuid.uuid4().hex
        banned: set[str] = set()
        retried: set[str] = set()
        hops = self.provider.find_chain(0, self.num_blocks, max_length=hidden.shape[1], session_id=sid)
        failovers = 0
        try:
            while True:
                try:
                    return self._forward_through(hops, hidden)
                except _HopFailed as failed:
                    failovers += 1
                    if failovers > self.max_failovers:
                        raise ServerUnavailableError(f"forward gave up after {self.max_failovers} failovers; last: "
                                                     f"{failed.error}") from failed.error
                    peer = failed.hop.peer_id
                    # a stateless forward has no cache to rebuild, so it simply runs again: on the same
                    # chain once if the server still answers (a stream that broke on a live server), else
                    # on a chain without it (the same session id keeps an orchestrator's lease)
                    if peer not in retried and self.ping_s(peer) is not None:
                        retried.add(peer)
                        logger.warning("forward: server %s failed (%s) but answers; retrying it once",
                                       failed.hop.describe(), failed.error)
                        continue
                    logger.warning("forward: server %s failed (%s); retrying on another chain",
                                   failed.hop.describe(), failed.error)
                    banned.add(peer)
                    hops = self.provider.find_chain(0, self.num_blocks, exclude=frozenset(banned),
                                                    max_length=hidden.shape[1], session_id=sid)
        finally:
            self.provider.session_finished(hops, session_id=sid)

    def _forward_through(self, hops: list[Hop], hidden: torch.Tensor) -> torch.Tensor:
        for hop in hops:
            try:
                hidden = self.loop.run(self._forward_hop(hop, hidden.to(self.dtype)), timeout_s=self.step_timeout_s + 2)
            except CALLER_ERRORS:
                raise
            except Exception as e:
                error = as_server_error(e, self.step_timeout_s)
                if error is None:
                    raise  # a local error: nobody's fault over there
                if isinstance(error, (ServerUnavailableError, OutOfCacheError)):
                    raise _HopFailed(hop, error) from e
                if error is e:
                    raise
                raise error from e
        return hidden

    async def _forward_hop(self, hop: Hop, hidden: torch.Tensor) -> torch.Tensor:
        """One hop of a forward: unary when the tensor fits one message, else the streaming RPC."""
        requests = wire_parts.to_messages(Forward(hop.start).to_wire(), (hidden,))
        stub = self.stub(hop.peer_id)
        if len(requests) == 1:
            reply = wire_parts.decode_single(await stub.rpc_forward(requests[0], timeout=self.step_timeout_s))
        else:
            async def outgoing():
                for request in requests:
                    yield request

            replies = await stub.rpc_forward_stream(outgoing())
            try:
                reply = await asyncio.wait_for(wire_parts.receive_one(replies), self.step_timeout_s)
            except StopAsyncIteration:  # the stream ended before a whole reply: the server or the link went away
                raise ServerUnavailableError(f"server {hop.describe()} closed the forward stream before its reply "
                                             "(it died or the connection broke)") from None
            except InvalidRequestError as e:  # the reply's parts do not fit together: the server's fault
                raise ServerUnavailableError(f"server {hop.describe()} sent a malformed forward reply: {e}") from e
            finally:
                await replies.aclose()  # stops sending parts the server refused (early error reply)
        wire.raise_if_error(reply.meta)
        if len(reply.tensors) != 1:
            raise ServerUnavailableError(f"server {hop.describe()} sent a malformed forward reply")
        return reply.tensors[0]

    def open_session(self, max_length: int) -> "RemoteChainSession":
        return RemoteChainSession(self, max_length)

    def shutdown(self) -> None:
        self.provider.close()
        try:
            self.loop.run(self.p2p.shutdown(), timeout_s=5)
        except Exception:
            logger.debug("p2p shutdown failed", exc_info=True)
        try:
            self.dht.shutdown()
        finally:
            self.loop.stop()


class RemoteChainSession(ChainSession):
    def __init__(self, chain: RemoteChain, max_length: int):
        self.chain = chain
        self.max_length = max_length
        self.session_id = uuid.uuid4().hex
        self.position = 0
        self.failovers = 0
        self.reopens = 0  # streams reopened after the server's session_idle_timeout (not failovers)
        self.banned: set[str] = set()
        self.streams: list[HopStream] = []
        self._step_id = 0
        self.input_tokens = 0  # tokens of the first step (the prompt)
        self.steps = 0
        self.hop_timings: list[HopTiming] = []
        hops = chain.provider.find_chain(0, chain.num_blocks, max_length=max_length, session_id=self.session_id)
        try:
            while True:
                try:
                    self.streams = self._open_hops(hops)
                    break
                except _HopFailed as failed:  # e.g. a server killed moments ago that the records still list
                    self.failovers += 1
                    if self.failovers > chain.max_failovers:
                        raise ServerUnavailableError(f"no chain opened after {chain.max_failovers} failovers; last: "
                                                     f"{failed.error}") from failed.error
                    logger.warning("server %s failed while opening session %s (%s); asking for another chain",
                                   failed.hop.describe(), self.session_id[:8], failed.error)
                    self.banned.add(failed.hop.peer_id)
                    hops = chain.provider.find_chain(0, chain.num_blocks, exclude=frozenset(self.banned),
                                                     max_length=max_length, session_id=self.session_id)
        except Exception:
            chain.provider.session_finished(hops, session_id=self.session_id)
            raise

    # -- stream plumbing (runs on the background loop) ----------------------------------------
    async def _open_one(self, hop: Hop) -> HopStream:
        queue: asyncio.Queue = asyncio.Queue()
        responses = await self.chain.stub(hop.peer_id).rpc_inference(wire_parts.until_none(queue))
        await queue.put(wire.request(Open(self.session_id, self.max_length, hop.start)))
        meta = wire.unpack((await asyncio.wait_for(anext(responses), self.chain.open_timeout_s)).metadata)
        try:
            wire.decode_reply(meta, Opened)
        except PetalsChainError as e:
            await queue.put(None)
            if isinstance(e, InvalidRequestError) and meta.get("type") != "error":  # not its typed refusal
                raise ServerUnavailableError(f"server {hop.describe()} sent a malformed open reply: {e}") from e
            raise
        return HopStream(hop, queue, responses)

    async def _call(self, stream: HopStream, hidden: torch.Tensor) -> torch.Tensor:
        self._step_id += 1
        t0 = time.perf_counter()
        for request in wire_parts.to_messages(Step(self.session_id, self._step_id).to_wire(), (hidden,)):
            await stream.queue.put(request)
        try:
            reply = await asyncio.wait_for(wire_parts.receive_one(stream.responses), self.chain.step_timeout_s)
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
        self.hop_timings.append(HopTiming(
            next((i for i, s in enumerate(self.streams) if s is stream), len(self.streams)), stream.hop.peer_id,
            stream.hop.num_blocks, hidden.shape[0], client_s, meta.server_s))
        return reply.tensors[0]

    def _run(self, coro, timeout_s: float):
        try:
            return self.chain.loop.run(coro, timeout_s=timeout_s)
        except Exception as e:
            server_error = as_server_error(e, timeout_s)
            if server_error is None or server_error is e:
                raise
            raise server_error from e

    def _open_hops(self, hops: list[Hop]) -> list[HopStream]:
        """Streams opened on `hops`; a server's failure raises `_HopFailed` naming the hop (what was
        opened is closed again)."""
        opened: list[HopStream] = []
        hop = hops[0]
        try:
            for hop in hops:
                opened.append(self._run(self._open_one(hop), self.chain.open_timeout_s + 2))
        except (ServerUnavailableError, OutOfCacheError) as e:
            self._close_streams(opened)
            raise _HopFailed(hop, e) from e
        except BaseException:
            self._close_streams(opened)
            raise
        return opened

    def _close_streams(self, streams: list[HopStream]) -> None:
        async def close(s: HopStream):
            await s.queue.put(wire.request(Close()))
            await s.queue.put(None)

        for s in streams:
            try:
                self.chain.loop.run(close(s), timeout_s=2)
            except Exception:
                pass

    # -- the session API ------------------------------------------------------------------------
    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.position + hidden.shape[0] > self.max_length:
            raise MaxLengthExceededError(f"session opened with max_length={self.max_length} cannot take "
                                         f"{self.position + hidden.shape[0]} tokens")
        x = x0 = hidden.to(self.chain.dtype)
        i = 0
        done_this_step: list[HopStream] = []
        reopened_this_step: set[str] = set()
        while i < len(self.streams):
            stream = self.streams[i]
            try:
                try:
                    out = self._run(self._call(stream, x), self.chain.step_timeout_s + 2)
                except SessionIdleTimeoutError as e:
                    # the server closed a stream we left idle past its --session-idle-timeout: a healthy
                    # server, so reopen there and replay (no ban, no failover); twice in a step is a fault
                    if stream.hop.peer_id in reopened_this_step:
                        raise ServerUnavailableError(f"server {stream.hop.describe()} closed the reopened "
                                                     f"session at once: {e}") from e
                    reopened_this_step.add(stream.hop.peer_id)
                    self._reopen(i, e)
                    continue  # retry hop i (reopened, cache rebuilt) with the same input
            except CALLER_ERRORS:
                raise
            except (ServerUnavailableError, OutOfCacheError) as e:
                if self.chain.provider.whole_chain_failover:
                    for s in done_this_step:  # the replay covers past steps; this one restarts at hop 0
                        s.inputs.pop()
                    done_this_step = []
                    self._failover(i, e)
                    i, x = 0, x0
                    continue
                self._failover(i, e)
                continue  # retry hop i (now a replacement) with the same input
            stream.inputs.append(x)
            done_this_step.append(stream)
            x = out
            i += 1
        self.position += hidden.shape[0]
        if self.steps == 0:
            self.input_tokens = hidden.shape[0]
        self.steps += 1
        return x

    def _reopen(self, index: int, error: Exception) -> None:
        """Open hop `index` again on the same server and replay what it had received (its KV cache
        was freed when the server closed the idle stream). The chain and any lease stay as they are."""
        old = self.streams[index]
        self.reopens += 1
        logger.info("server %s closed idle session %s (%s); reopening it and replaying %d tokens", old.hop.describe(),
                    self.session_id[:8], error, sum(x.shape[0] for x in old.inputs))
        self._close_streams([old])
        try:
            (new,) = self._open_hops([old.hop])
        except _HopFailed as failed:  # the step's caller fails it over
            raise failed.error from failed
        if old.inputs:
            history = torch.cat(old.inputs)
            self._run(self._call(new, history), self.chain.step_timeout_s + 2)
            new.inputs.append(history)
        self.streams[index] = new

    def _failover(self, index: int, error: Exception) -> None:
        """Replace the failed hop `index` and rebuild the KV caches by replaying the inputs it had
        received. With client-side routing only the failed span is replaced: the new hops end at
        the start of a later hop, which is kept with its cache (or at the last block). An
        orchestrator's provider replaces the whole chain, replayed from block 0, so the session
        always runs on the chain it is counted on. A replacement that fails while it is opened or
        replayed (e.g. a server killed moments ago that the records still list) is itself failed
        over, within the same `max_failovers`."""
        failed_peer = self.streams[index].hop.peer_id
        while True:
            self.failovers += 1
            if self.failovers > self.chain.max_failovers:
                raise ServerUnavailableError(f"giving up after {self.chain.max_failovers} failovers; last: "
                                             f"{error}") from error
            self.banned.add(failed_peer)
            try:
                self._replace(index, error)
                return
            except _HopFailed as failed:
                failed_peer, error = failed.hop.peer_id, failed.error

    def _replace(self, index: int, error: Exception) -> None:
        failed = self.streams[index]
        if self.chain.provider.whole_chain_failover:
            index, failed = 0, self.streams[0]
            new_hops = self.chain.provider.find_chain(0, self.chain.num_blocks, exclude=frozenset(self.banned),
                                                      max_length=self.max_length, session_id=self.session_id)
        else:
            ends = frozenset({s.hop.start for s in self.streams[index + 1:]} | {self.chain.num_blocks})
            new_hops = self.chain.provider.find_span(failed.hop.start, ends, exclude=frozenset(self.banned),
                                                     max_length=self.max_length, session_id=self.session_id)
        new_end = new_hops[-1].end
        keep_from = next((i for i in range(index + 1, len(self.streams)) if self.streams[i].hop.start == new_end),
                         len(self.streams))
        logger.warning("server %s failed (%s); replacing blocks [%d, %d) with %s", failed.hop.describe(), error,
                       failed.hop.start, new_end, " -> ".join(h.describe() for h in new_hops))
        self._close_streams(self.streams[index:keep_from])
        history = torch.cat(failed.inputs) if failed.inputs else None
        replacement = self._open_hops(new_hops)  # raises _HopFailed: _failover tries another
        try:
            if history is not None:
                x = history
                for stream in replacement:
                    hop = stream.hop
                    x_out = self._run(self._call(stream, x), self.chain.step_timeout_s + 2)
                    stream.inputs.append(x)
                    x = x_out
        except (ServerUnavailableError, OutOfCacheError) as e:
            self._close_streams(replacement)
            raise _HopFailed(hop, e) from e
        except BaseException:
            self._close_streams(replacement)
            raise
        self.streams = self.streams[:index] + replacement + self.streams[keep_from:]

    @property
    def hops(self) -> list[Hop]:
        return [s.hop for s in self.streams]

    def describe(self) -> str:
        return " -> ".join(h.describe() for h in self.hops)

    def close(self) -> None:
        hops = self.hops
        self._close_streams(self.streams)
        self.streams = []
        self.chain.provider.session_finished(hops, session_id=self.session_id, input_tokens=self.input_tokens,
                                             output_tokens=self.steps)
