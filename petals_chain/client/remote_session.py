"""A session's relay through a chain of servers, and its recovery (used by `RemoteChain`).

Each hop keeps the history of the inputs it was sent, so when a server fails the session asks its
`ChainProvider` for a replacement of the chain from that hop on (with an orchestrator: the whole
chain), replays the history through the replacement to rebuild its KV cache, and continues: the
output is identical to a run without the failure. A stream the server closed for idleness is
reopened on the same server and replayed. `as_server_error` says which failures are a server's.

Prefix reuse: a session opened with its prompt (`PromptPrefix`) sends the prompt's chained chunk
hashes with every hop's `open`; each hop answers how many tokens of it its cache holds
(`prefix_match_tokens`); the chain uses the minimum over its hops (in whole chunks, leaving one
prompt token), tells every hop that number with its first step (`prefix_tokens`), and sends only
the rest of the prompt. A hop opened later (a replacement, a reopened idle stream) takes nothing
from a cache: its input for the reused prefix is rebuilt by running the prefix's embeddings
statelessly through the hops before it, and replayed ahead of its history.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from petals_chain import wire, wire_parts
from petals_chain.client.chain import ChainSession, PromptPrefix
from petals_chain.errors import (
    InvalidRequestError,
    MaxLengthExceededError,
    NotAllowedError,
    OutOfCacheError,
    PetalsChainError,
    ServerUnavailableError,
    SessionIdleTimeoutError,
)
from petals_chain.messages import Close, Hop, Open, Opened, Step, StepReply
from petals_chain.prefix_keys import PREFIX_CHUNK_TOKENS, prefix_hashes, usable_prefix_tokens

if TYPE_CHECKING:
    from petals_chain.client.remote import RemoteChain

logger = logging.getLogger(__name__)

# Liveness of an open session's hops (`_receive_while_alive`): a step pending longer than
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
# Errors of one server that another may not have: the hop fails over (the server is banned for the
# session). NotAllowedError: a members-only server (--allowed-peers) in an open swarm refuses this
# client, which then uses the swarm's other servers instead of failing.
HOP_FAILURES = (ServerUnavailableError, OutOfCacheError, NotAllowedError)
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


def _first_rows(tensors: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """The first `rows` rows of the concatenation of `tensors`, kept as a list of (cut) tensors."""
    kept: list[torch.Tensor] = []
    for t in tensors:
        if rows <= 0:
            break
        kept.append(t[:rows])
        rows -= t.shape[0]
    return kept


class HopFailed(Exception):
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
    prefix_match_tokens: int = 0  # of the prompt, what this hop's prefix cache holds (its open reply)
    prefix_tokens: int | None = None  # to send with its first step (then None): the chain's reuse
    prefix_in_inputs: bool = False  # `inputs` start with the reused prefix (a hop rebuilt by replay)


class RemoteChainSession(ChainSession):
    def __init__(self, chain: RemoteChain, max_length: int, prefix: PromptPrefix | None = None,
                 adapter: str | None = None, *, session_id: str | None = None):
        self.chain = chain
        self.max_length = max_length
        self.adapter = adapter  # the LoRA adapter every hop runs this session with (None: base model)
        self.prefix = prefix
        self.prefix_hashes = prefix_hashes(prefix.token_ids, chain.model) if prefix is not None else []
        self.prefix_tokens = 0  # tokens of the prompt every hop took from its cache
        self.session_id = session_id or uuid.uuid4().hex
        self.position = 0
        self.failovers = 0
        self.reopens = 0  # streams reopened after the server's session_idle_timeout (not failovers)
        self.rollbacks = 0  # steps that restarted below `position` (rejected drafts, an edited last turn)
        self.banned: set[str] = set()
        self.streams: list[HopStream] = []
        self._step_id = 0
        self.input_tokens = 0  # tokens of the first step (the prompt)
        self.steps = 0
        self.hop_timings: list[HopTiming] = []
        hops = chain.provider.find_chain(0, chain.num_blocks, max_length=max_length, session_id=self.session_id,
                                         adapter=adapter)
        try:
            while True:
                try:
                    self.streams = self._open_hops(hops, self.prefix_hashes)
                    break
                except HopFailed as failed:  # e.g. a server killed moments ago that the records still list
                    self.failovers += 1
                    if self.failovers > chain.max_failovers:
                        raise ServerUnavailableError(f"no chain opened after {chain.max_failovers} failovers; last: "
                                                     f"{failed.error}") from failed.error
                    logger.warning("server %s failed while opening session %s (%s); asking for another chain",
                                   failed.hop.describe(), self.session_id[:8], failed.error)
                    self.banned.add(failed.hop.peer_id)
                    hops = chain.provider.find_chain(0, chain.num_blocks, exclude=frozenset(self.banned),
                                                     max_length=max_length, session_id=self.session_id,
                                                     adapter=adapter)
        except Exception:
            chain.provider.session_finished(hops, session_id=self.session_id)
            raise
        if self.prefix_hashes:
            self.prefix_tokens = usable_prefix_tokens([s.prefix_match_tokens for s in self.streams],
                                                      len(self.prefix.token_ids))
            for s in self.streams:
                s.prefix_tokens = self.prefix_tokens
            self.position = self.prefix_tokens  # the first step starts after the reused prefix

    # -- stream plumbing (runs on the background loop) ----------------------------------------
    async def _open_one(self, hop: Hop, hashes: list[str]) -> HopStream:
        queue: asyncio.Queue = asyncio.Queue()
        responses = await self.chain.stub(hop.peer_id).rpc_inference(wire_parts.until_none(queue))
        await queue.put(wire.request(Open(self.session_id, self.max_length, hop.start, prefix_hashes=hashes or None,
                                          adapter=self.adapter)))
        meta = wire.unpack((await asyncio.wait_for(anext(responses), self.chain.open_timeout_s)).metadata)
        try:
            opened = wire.decode_reply(meta, Opened)
        except PetalsChainError as e:
            await queue.put(None)
            if isinstance(e, InvalidRequestError) and meta.get("type") != "error":  # not its typed refusal
                raise ServerUnavailableError(f"server {hop.describe()} sent a malformed open reply: {e}") from e
            raise
        match = opened.prefix_match_tokens or 0
        # a server without a cache (or another chunk size) does not answer: nothing reused on this chain
        if opened.prefix_chunk_tokens != PREFIX_CHUNK_TOKENS or not 0 <= match <= len(hashes) * PREFIX_CHUNK_TOKENS:
            match = 0
        return HopStream(hop, queue, responses, prefix_match_tokens=match)

    async def _call(self, stream: HopStream, hidden: torch.Tensor, start_position: int | None = None) -> torch.Tensor:
        self._step_id += 1
        t0 = time.perf_counter()
        step = Step(self.session_id, self._step_id, prefix_tokens=stream.prefix_tokens, start_position=start_position)
        stream.prefix_tokens = None  # only its first step takes cached tokens
        for request in wire_parts.to_messages(step.to_wire(), (hidden,)):
            await stream.queue.put(request)
        try:
            reply = await self._receive_while_alive(stream)
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
        if start_position is not None and meta.position != start_position + hidden.shape[0]:
            # after a rollback every hop must hold exactly what the client does
            raise ServerUnavailableError(f"server {stream.hop.describe()} holds {meta.position} tokens after a step "
                                         f"from {start_position} with {hidden.shape[0]}; it ignored the rollback")
        self.hop_timings.append(HopTiming(
            next((i for i, s in enumerate(self.streams) if s is stream), len(self.streams)), stream.hop.peer_id,
            stream.hop.num_blocks, hidden.shape[0], client_s, meta.server_s))
        return reply.tensors[0]

    def _liveness_after_s(self, peer_id: str) -> float:
        """How long a step may wait for this hop's reply before the client asks whether the server
        still answers: LIVENESS_STEP_FACTOR times the median of its last steps' round trips in this
        session (a prompt's long step does not stretch it), at least LIVENESS_FLOOR_S."""
        recent = sorted(t.client_s for t in self.hop_timings[-4 * LIVENESS_RECENT_STEPS:]
                        if t.peer_id == peer_id)[-LIVENESS_RECENT_STEPS:]
        typical_s = recent[len(recent) // 2] if recent else 0.0
        return max(LIVENESS_FLOOR_S, LIVENESS_STEP_FACTOR * typical_s)

    async def _answers_probe(self, peer_id: str, timeout_s: float) -> bool:
        """Whether the server replies to an `rpc_info` (any reply, a typed refusal included) within
        `timeout_s`: it runs on the server's RPC loop, not behind the compute, so a busy server answers."""
        try:
            await asyncio.wait_for(self.chain.stub(peer_id).rpc_info(wire.request(wire.InfoRequest()), timeout=timeout_s),
                                   timeout_s + 0.5)
        except P2PHandlerError:
            return True  # its handler ran and raised: the host is there
        except Exception:
            return False
        return True

    async def _receive_while_alive(self, stream: HopStream) -> wire_parts.Message:
        """The hop's reply to the step just sent. While it is pending past `_liveness_after_s` the
        server is probed (`rpc_info`); LIVENESS_PROBES probes in a row without an answer within
        LIVENESS_PROBE_S each mean it is gone (a host that vanished without closing its connections,
        a frozen process: nothing resets the stream), and the step fails over then instead of at the
        step timeout. So a silent server is noticed within about `_liveness_after_s` +
        LIVENESS_PROBES x LIVENESS_PROBE_S (10 s for steps under half a second); a slow server that
        answers its probes keeps its step until `step_timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.chain.step_timeout_s
        receive = asyncio.ensure_future(wire_parts.receive_one(stream.responses))
        failed_probes = 0
        try:
            while True:
                wait_s = 0.0 if failed_probes else self._liveness_after_s(stream.hop.peer_id)
                done, _ = await asyncio.wait({receive}, timeout=max(0.0, min(wait_s, deadline - loop.time())))
                if done:
                    return receive.result()
                if loop.time() >= deadline:
                    raise asyncio.TimeoutError
                waited_s = self.chain.step_timeout_s - (deadline - loop.time())
                if await self._answers_probe(stream.hop.peer_id, max(0.5, min(LIVENESS_PROBE_S, deadline - loop.time()))):
                    failed_probes = 0
                    continue
                if receive.done():  # the reply came while the probe waited
                    return receive.result()
                failed_probes += 1
                if failed_probes >= LIVENESS_PROBES:
                    raise ServerUnavailableError(
                        f"server {stream.hop.describe()} went silent: no reply to the step for {waited_s:.1f} s and "
                        f"none to {LIVENESS_PROBES} liveness probes in a row ({LIVENESS_PROBE_S:.0f} s each)")
        finally:
            if not receive.done():
                receive.cancel()

    def _run(self, coro, timeout_s: float):
        try:
            return self.chain.loop.run(coro, timeout_s=timeout_s)
        except Exception as e:
            server_error = as_server_error(e, timeout_s)
            if server_error is None or server_error is e:
                raise
            raise server_error from e

    def _open_hops(self, hops: list[Hop], hashes: list[str] | None = None) -> list[HopStream]:
        """Streams opened on `hops` (offering the prompt's `hashes`); a server's failure raises
        `HopFailed` naming the hop (what was opened is closed again)."""
        opened: list[HopStream] = []
        hop = hops[0]
        self.chain.dial_relayed([h.peer_id for h in hops])  # servers behind NATs: through their relays
        try:
            for hop in hops:
                opened.append(self._run(self._open_one(hop, hashes or []), self.chain.open_timeout_s + 2))
        except HOP_FAILURES as e:
            self._close_streams(opened)
            raise HopFailed(hop, e) from e
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
    @property
    def num_hops(self) -> int:
        return len(self.streams)

    def step(self, hidden: torch.Tensor, start_position: int | None = None) -> torch.Tensor:
        start = self.check_start(start_position)
        if start + hidden.shape[0] > self.max_length:
            raise MaxLengthExceededError(f"session opened with max_length={self.max_length} cannot take "
                                         f"{start + hidden.shape[0]} tokens")
        rollback = start < self.position
        if rollback:
            self._roll_back(start)
        x = x0 = hidden.to(self.chain.dtype)
        i = 0
        done_this_step: list[HopStream] = []
        reopened_this_step: set[str] = set()
        while i < len(self.streams):
            stream = self.streams[i]
            try:
                try:
                    # a rollback step tells every hop where it starts (a replacement replayed meanwhile
                    # already holds exactly that many tokens, so it is right for it too)
                    out = self._run(self._call(stream, x, start if rollback else None), self.chain.step_timeout_s + 2)
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
            except HOP_FAILURES as e:
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

    def _roll_back(self, start: int) -> None:
        """Cut what the session remembers to the first `start` tokens, so a replay after a later
        failover or reopen rebuilds exactly what the hops hold after the rollback step: every hop's
        replay history, and the reused prompt prefix when the rollback reaches into it. The hops
        themselves roll back with the step, which carries `start_position`."""
        for stream in self.streams:
            held_before = 0 if stream.prefix_in_inputs else self.prefix_tokens  # positions not in `inputs`
            stream.inputs = _first_rows(stream.inputs, max(0, start - held_before))
        self.prefix_tokens = min(self.prefix_tokens, start)
        self.position = start
        self.rollbacks += 1

    def _reopen(self, index: int, error: Exception) -> None:
        """Open hop `index` again on the same server and replay what it had received (its KV cache
        was freed when the server closed the idle stream). The chain and any lease stay as they are."""
        old = self.streams[index]
        self.reopens += 1
        logger.info("server %s closed idle session %s (%s); reopening it and replaying %d tokens", old.hop.describe(),
                    self.session_id[:8], error, sum(x.shape[0] for x in old.inputs))
        self._close_streams([old])
        inputs = self._with_prefix_input(index, old)  # before the new stream takes index's place
        try:
            (new,) = self._open_hops([old.hop])
        except HopFailed as failed:  # the step's caller fails it over
            raise failed.error from failed
        if inputs:
            history = torch.cat(inputs)
            self._run(self._call(new, history), self.chain.step_timeout_s + 2)
            new.inputs.append(history)
            new.prefix_in_inputs = bool(self.prefix_tokens)
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
            except HopFailed as failed:
                logger.warning("replacement %s failed too (%s)", failed.hop.describe(), failed.error)
                failed_peer, error = failed.hop.peer_id, failed.error

    def _replace(self, index: int, error: Exception) -> None:
        failed = self.streams[index]
        if self.chain.provider.whole_chain_failover:
            index, failed = 0, self.streams[0]
            new_hops = self.chain.provider.find_chain(0, self.chain.num_blocks, exclude=frozenset(self.banned),
                                                      max_length=self.max_length, session_id=self.session_id,
                                                      adapter=self.adapter)
        else:
            ends = frozenset({s.hop.start for s in self.streams[index + 1:]} | {self.chain.num_blocks})
            new_hops = self.chain.provider.find_span(failed.hop.start, ends, exclude=frozenset(self.banned),
                                                     max_length=self.max_length, session_id=self.session_id,
                                                     adapter=self.adapter)
        new_end = new_hops[-1].end
        keep_from = next((i for i in range(index + 1, len(self.streams)) if self.streams[i].hop.start == new_end),
                         len(self.streams))
        logger.warning("server %s failed (%s); replacing blocks [%d, %d) with %s", failed.hop.describe(), error,
                       failed.hop.start, new_end, " -> ".join(h.describe() for h in new_hops))
        self._close_streams(self.streams[index:keep_from])
        inputs = self._with_prefix_input(index, failed)
        history = torch.cat(inputs) if inputs else None
        replacement = self._open_hops(new_hops)  # raises HopFailed: _failover tries another
        try:
            if history is not None:
                x = history
                for stream in replacement:
                    hop = stream.hop
                    x_out = self._run(self._call(stream, x), self.chain.step_timeout_s + 2)
                    stream.inputs.append(x)
                    stream.prefix_in_inputs = bool(self.prefix_tokens)
                    x = x_out
        except HOP_FAILURES as e:
            self._close_streams(replacement)
            raise HopFailed(hop, e) from e
        except BaseException:
            self._close_streams(replacement)
            raise
        self.streams = self.streams[:index] + replacement + self.streams[keep_from:]

    def _with_prefix_input(self, index: int, stream: HopStream) -> list[torch.Tensor]:
        """The inputs of hop `index` (`stream`) to replay, preceded by its input for the prefix the
        hops took from their caches when it never received those tokens: the prefix's embeddings
        run statelessly (`rpc_forward`) through the hops before it."""
        if not self.prefix_tokens or stream.prefix_in_inputs:
            return list(stream.inputs)
        x = self.prefix.hidden[:self.prefix_tokens].to(self.chain.dtype)
        for before in self.streams[:index]:
            x = self._run(self.chain._forward_hop(before.hop, x.unsqueeze(0), self.adapter),
                          self.chain.step_timeout_s + 2)[0]
        return [x, *stream.inputs]

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
                                             output_tokens=self.steps, hop_timings=tuple(self.hop_timings))
