"""A session's relay through a chain of servers, and its recovery (opened by `RemoteChain`, which
hands it a frozen `SessionContext`: the session reads nothing else of the client).

Each hop keeps the history of the inputs it was sent, so when a server fails the session asks its
`ChainProvider` for a replacement of the chain from that hop on (with an orchestrator: the whole
chain, and the session's `Lease` moves to it), replays the history through the replacement to
rebuild its KV cache, and continues: the output is identical to a run without the failure. A stream
the server closed for idleness is reopened on the same server and replayed. Open and steps (and the
reopens inside a step) fail over by one loop with one budget (`recovery.py:Recovery.run`), banning
failed servers in the client's `PeerHealth`. `as_server_error` says which failures are a server's.

Prefix reuse: a session opened with its prompt (`PromptPrefix`) sends the prompt's chained chunk
hashes with every hop's `open`; each hop answers how many tokens of it its cache holds
(`prefix_match_tokens`); the chain uses the minimum over its hops (in whole chunks, leaving one
prompt token), tells every hop that number with its first step (`prefix_tokens`), and sends only
the rest of the prompt. A hop opened later (a replacement, a reopened idle stream) takes nothing
from a cache: its input for the reused prefix is rebuilt by running the prefix's embeddings
statelessly through the hops before it, and replayed ahead of its history.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from petals_chain.client.chain import ChainSession, PromptPrefix
from petals_chain.client.hop_client import (
    LIVENESS_FLOOR_S,
    LIVENESS_RECENT_STEPS,
    LIVENESS_STEP_FACTOR,
    HopFailed,
    HopStream,
    StepResult,
)
from petals_chain.client.lease import Lease
from petals_chain.client.recovery import Action, Decision, Recovery
from petals_chain.client.session_context import SessionContext
from petals_chain.errors import (
    MaxLengthExceededError,
    ServerUnavailableError,
    SessionIdleTimeoutError,
)
from petals_chain.wire import parts as wire_parts
from petals_chain.wire.messages import Hop, Open, Step
from petals_chain.wire.prefix_keys import prefix_hashes, usable_prefix_tokens

logger = logging.getLogger(__name__)

# Server relay: the client's copy of a step that the hop before pushes on (its fallback for a lost
# push) is held back (`HopClient.step_async(copy_after_s=...)`) by COPY_GRACE_FACTOR times the hop's
# median time from request to reply over its last COPY_HISTORY_STEPS pushed steps, at least
# COPY_GRACE_FLOOR_S. Until the hop has that history (its first steps, each replacement's) and after
# COPY_LATE_MAX copies had to go out late (its pushes keep missing: a refusing or unreachable pusher),
# the copy goes at once. A generous factor: waiting too little costs only a copy, too long only
# delays a step whose push was lost.
COPY_GRACE_FACTOR = 3.0
COPY_GRACE_FLOOR_S = 0.05
COPY_HISTORY_STEPS = 3
COPY_LATE_MAX = 2


def _first_rows(tensors: list[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """The first `rows` rows of the concatenation of `tensors`, kept as a list of (cut) tensors."""
    kept: list[torch.Tensor] = []
    for t in tensors:
        if rows <= 0:
            break
        kept.append(t[:rows])
        rows -= t.shape[0]
    return kept


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
    # the server's batch forward time for it: client_s - compute_s is framework + network
    compute_s: float | None = None
    # its input was pushed to it by the hop before (server relay): the client's copy often arrives after
    # the pushed step ran, so client_s - server_s is not a round trip and says nothing of the hop's cost
    pushed: bool = False


@dataclass(frozen=True)
class StepTiming:
    """One step through the whole chain, timed by the client: `client_s` from `step` being called to
    its output (every hop, either relay; a failover's replay included); its hops' timings are
    `hop_timings[first_hop:end_hop]`. Under server relay the hops' own times overlap (a hop computes
    while the client reads the hop before's reply), so only this says what a step cost."""

    tokens: int
    client_s: float
    first_hop: int
    end_hop: int


@dataclass
class _StepRun:
    """Where one `step` stands while it runs, fails and is repaired: the hop it continues from, that
    hop's input, the step id the chain runs it under, the hops that already ran it (whose history a
    whole-chain failover takes back) and the servers reopened during it."""

    x0: torch.Tensor
    x: torch.Tensor | wire_parts.RawTensor
    step_id: int
    rollback_start: int | None
    i: int = 0
    done: list[HopStream] = field(default_factory=list)
    reopened: set[str] = field(default_factory=set)


class RemoteChainSession(ChainSession):
    def __init__(
        self,
        ctx: SessionContext,
        max_length: int,
        prefix: PromptPrefix | None = None,
        adapter: str | None = None,
        *,
        session_id: str | None = None,
        avoid: Iterable[str] = (),
    ):
        self.ctx = ctx
        self.max_length = max_length
        self.adapter = adapter  # the LoRA adapter every hop runs this session with (None: base model)
        self.prefix = prefix
        self.prefix_hashes = (
            prefix_hashes(prefix.token_ids, ctx.model, dtype=str(ctx.dtype).removeprefix("torch."))
            if prefix is not None
            else []
        )
        self.prefix_tokens = 0  # tokens of the prompt every hop took from its cache
        self.session_id = session_id or uuid.uuid4().hex
        self.position = 0
        # one budget for open and steps; `avoid`: servers this session must not use from the start (the
        # Table 1 model probe measures one chain alone by avoiding every server outside it)
        self.recovery = Recovery(ctx.max_failovers, ctx.peer_health, avoid=avoid, busy_backoff_s=ctx.busy_backoff_s)
        # the session's hold on its chain (with an orchestrator: its lease and grant), released in `close`
        self.lease = Lease(
            ctx.provider,
            self.session_id,
            num_blocks=ctx.num_blocks,
            max_length=max_length,
            adapter=adapter,
            prompt=self._prompt(),
        )
        self.reopens = 0  # streams reopened after the server's session_idle_timeout (not failovers)
        self.rollbacks = 0  # steps that restarted below `position` (rejected drafts, an edited last turn)
        self.streams: list[HopStream] = []
        self._step_id = 0
        self.input_tokens = 0  # tokens of the first step (the prompt)
        self.steps = 0
        self.hop_timings: list[HopTiming] = []
        self.step_timings: list[StepTiming] = []
        try:
            self.recovery.ask(self.lease.acquire)
            self.streams = self.recovery.run(
                lambda: self._open_hops(self.lease.hops, self.prefix_hashes),
                self._repair_open,
                f"opening session {self.session_id[:8]}",
                busy_waits=True,
            )
        except BaseException:
            self.close()
            raise
        if self.prefix_hashes:
            self.prefix_tokens = usable_prefix_tokens(
                [s.prefix_match_tokens for s in self.streams], len(self.prefix.token_ids)
            )
            for s in self.streams:
                s.prefix_tokens = self.prefix_tokens
            self.position = self.prefix_tokens  # the first step starts after the reused prefix

    def _repair_open(self, failed: HopFailed, decision: Decision) -> None:
        """A chain failed at open (e.g. a server killed moments ago that the records still list): ask
        for another; a full server (WAIT) gets the grant back meanwhile (another session may fit where
        this one did not) and the open waits, the server's memory freeing as its sessions end."""
        if decision.action is Action.WAIT:
            self.lease.give_back()
            self.recovery.sleep(decision.wait_s)
        self.recovery.ask(self.lease.acquire)

    @property
    def grant(self):
        """The orchestrator's grant of this session's chain (`ChainGrant`: its wait, chain id, plan
        version), None with client-side routing."""
        return self.lease.grant

    def _prompt(self) -> dict:
        """The prompt for a provider that dispatches by it (an orchestrator running e2 or d2lpm)."""
        if not self.ctx.provider.takes_prompt or self.prefix is None:
            return {}
        return {"prefix_hashes": self.prefix_hashes, "prompt_tokens": len(self.prefix.token_ids)}

    # -- stream plumbing ----------------------------------------------------------------------
    @property
    def failovers(self) -> int:
        return self.recovery.failovers

    @property
    def failed_peers(self) -> set[str]:
        """Servers this session failed over from (banned for every session of the client meanwhile)."""
        return self.recovery.failed_peers

    def _new_step_id(self) -> int:
        """Step ids increase over the session on every hop: a hop runs each id once (server relay's
        dedup), so a replay, and the step continued after it, take fresh ones."""
        self._step_id += 1
        return self._step_id

    def _route(self, index: int) -> list[str] | None:
        """Server relay: the peers hop `index` pushes this step on to, in order. It stops before a
        hop whose step carries more than the tensor (the first step's cached-prefix count), and
        before a server behind a NAT (reached through a libp2p relay): the hop before it could not
        dial it, so the client relays that leg itself, as with `relay="client"`."""
        if not self.ctx.server_relay:
            return None
        route = []
        for s in self.streams[index + 1 :]:
            if not self._takes_pushes(s):
                break
            route.append(s.hop.peer_id)
        return route

    def _takes_pushes(self, stream: HopStream) -> bool:
        """Whether the hop before `stream` pushes this step to it (see `_route`)."""
        return not stream.prefix_tokens and not self.ctx.relays.relayed(stream.hop.peer_id)

    def _call(self, stream: HopStream, hidden: torch.Tensor) -> torch.Tensor:
        """One step of `stream`'s hop alone, with a fresh step id (replays); raises HopFailed or the
        server's other typed errors."""
        return wire_parts.as_tensor(
            self.ctx.hops.run_hop(stream.hop, self._call_async(stream, hidden), self.ctx.step_timeout_s + 2)
        )

    async def _call_async(
        self,
        stream: HopStream,
        hidden: torch.Tensor | wire_parts.RawTensor,
        step_id: int | None = None,
        index: int | None = None,
        start_position: int | None = None,
    ) -> torch.Tensor | wire_parts.RawTensor:
        """One step of `stream`'s hop, on the loop; its output as the reply carried it (a RawTensor
        from a raw frame: `wire_parts.as_tensor` decodes it). With `index` (its place in the chain) and server
        relay on, the step names the route on, and tells the hop its previous peer when that
        changed; the hop may have run it already from a push, and then answers at once.
        `start_position`: a rollback step (every hop, and every push, carries it)."""
        step = Step(
            self.session_id,
            self._new_step_id() if step_id is None else step_id,
            prefix_tokens=stream.prefix_tokens,
            start_position=start_position,
        )
        pushed = False
        if index is not None and self.ctx.server_relay:
            step.push_route = self._route(index)
            # before this hop's prefix count is spent below: the route of the hop before named it
            pushed = index > 0 and self._takes_pushes(stream)
            before = self.streams[index - 1].hop.peer_id if index > 0 else None
            if before is not None and stream.relay_from != before:
                step.relay_from = stream.relay_from = before
        stream.prefix_tokens = None  # only its first step takes cached tokens
        # a step that registers the hop's new pusher (relay_from) must go now: the push is refused until it lands
        copy_after_s = self._copy_after_s(stream) if pushed and step.relay_from is None else None
        # within the step timeout: step_async's reply wait covers its send too
        result = await self.ctx.hops.step_async(
            stream, step, hidden, self._liveness_after_s(stream.hop.peer_id), copy_after_s
        )
        return self._received(stream, step, hidden, result, pushed, replay=index is None)

    def _received(
        self,
        stream: HopStream,
        step: Step,
        hidden: torch.Tensor | wire_parts.RawTensor,
        result: StepResult,
        pushed: bool,
        *,
        replay: bool = False,
    ) -> torch.Tensor | wire_parts.RawTensor:
        """Every reply to a step of this session comes through here, once per hop and step (the
        chain's steps and the replays of failovers and reopens alike), on the loop, before its output
        goes on to the next hop: the one place to check a reply. Raising `ServerUnavailableError`
        here fails the hop over (the step coroutine maps it to `HopFailed`)."""
        if result.copy_sent_late:
            stream.late_copies += 1
        if step.start_position is not None and result.reply.position != step.start_position + hidden.shape[0]:
            # after a rollback every hop must hold exactly what the client does
            raise ServerUnavailableError(
                f"server {stream.hop.describe()} holds {result.reply.position} tokens after a "
                f"step from {step.start_position} with {hidden.shape[0]}; it ignored the "
                "rollback"
            )
        self.hop_timings.append(
            HopTiming(
                next((i for i, s in enumerate(self.streams) if s is stream), len(self.streams)),
                stream.hop.peer_id,
                stream.hop.num_blocks,
                hidden.shape[0],
                result.client_s,
                result.reply.server_s,
                result.reply.compute_s,
                pushed,
            )
        )
        if self.verifier is not None:  # checks of the reply (client/verification.py); raising fails the hop over
            self.verifier.on_reply(stream, hidden, result.output, step.start_position, replay=replay)
        return result.output

    def _copy_after_s(self, stream: HopStream) -> float | None:
        """How long a pushed step's copy to `stream` is held back (None: sent at once); see COPY_GRACE_FACTOR."""
        if stream.late_copies >= COPY_LATE_MAX:
            return None
        recent = [
            t.client_s
            for t in self.hop_timings[-4 * COPY_HISTORY_STEPS * max(1, len(self.streams)) :]
            if t.peer_id == stream.hop.peer_id and t.pushed
        ][-COPY_HISTORY_STEPS:]
        if len(recent) < COPY_HISTORY_STEPS:
            return None
        return max(COPY_GRACE_FLOOR_S, COPY_GRACE_FACTOR * sorted(recent)[len(recent) // 2])

    def _liveness_after_s(self, peer_id: str) -> float:
        """How long a step may wait for this hop's reply before the client asks whether the server
        still answers (`HopClient.receive_while_alive`): LIVENESS_STEP_FACTOR times the median of its
        last steps' round trips in this session (a prompt's long step does not stretch it), at least
        LIVENESS_FLOOR_S."""
        recent = sorted(t.client_s for t in self.hop_timings[-4 * LIVENESS_RECENT_STEPS :] if t.peer_id == peer_id)[
            -LIVENESS_RECENT_STEPS:
        ]
        typical_s = recent[len(recent) // 2] if recent else 0.0
        return max(LIVENESS_FLOOR_S, LIVENESS_STEP_FACTOR * typical_s)

    def _open_hops(
        self, hops: list[Hop], hashes: list[str] | None = None, before: str | None = None
    ) -> list[HopStream]:
        """Streams opened on `hops` (offering the prompt's `hashes`); a server's failure raises
        `HopFailed` naming the hop (what was opened is closed again). With server relay each hop
        takes pushes from the one before it (`before`: the peer before the first)."""
        opened: list[HopStream] = []
        self.ctx.relays.dial([h.peer_id for h in hops])  # servers behind NATs: through their relays
        try:
            for hop in hops:
                relay_from = before if self.ctx.server_relay else None
                opened.append(
                    self.ctx.hops.open(
                        hop,
                        Open(
                            self.session_id,
                            self.max_length,
                            hop.start,
                            prefix_hashes=hashes or None,
                            adapter=self.adapter,
                            relay_from=relay_from,
                        ),
                    )
                )
                before = hop.peer_id
        except BaseException:
            self._close_streams(opened)
            raise
        self.ctx.peer_health.report_success(h.peer_id for h in hops)  # they answered: their failures are past
        return opened

    def _close_streams(self, streams: list[HopStream]) -> None:
        if streams:
            self.ctx.hops.close(streams)

    # -- the session API ------------------------------------------------------------------------
    @property
    def num_hops(self) -> int:
        return len(self.streams)

    def step(self, hidden: torch.Tensor, start_position: int | None = None) -> torch.Tensor:
        if self.verifier is not None:  # a probation audit's verdict first; a catch is raised here
            self.verifier.before_step()
        t0_s, first_hop = time.perf_counter(), len(self.hop_timings)
        start = self.check_start(start_position)
        if start + hidden.shape[0] > self.max_length:
            raise MaxLengthExceededError(
                f"session opened with max_length={self.max_length} cannot take {start + hidden.shape[0]} tokens"
            )
        rollback = start < self.position
        if rollback:
            self._roll_back(start)
        # a rollback step tells every hop where it starts (a replacement replayed meanwhile already
        # holds exactly that many tokens, so it is right for it too)
        rollback_start = start if rollback else None
        x0 = hidden.to(self.ctx.dtype)
        run = _StepRun(
            x0=x0,
            x=x0,
            step_id=self._new_step_id(),  # one id along the chain: a hop runs it once, pushed or sent
            rollback_start=rollback_start,
        )
        x = self.recovery.run(
            lambda: self._attempt_step(run),
            lambda failed, _: self._repair_step(run, failed),
            f"session {self.session_id[:8]}",
        )
        self.position += hidden.shape[0]
        if self.steps == 0:
            self.input_tokens = hidden.shape[0]
        self.steps += 1
        output = wire_parts.as_tensor(x)  # the last hop's reply, decoded for the caller (the LM head)
        self.step_timings.append(
            StepTiming(hidden.shape[0], time.perf_counter() - t0_s, first_hop, len(self.hop_timings))
        )
        return output

    def _attempt_step(self, run: _StepRun) -> torch.Tensor | wire_parts.RawTensor:
        """The step's hops from `run.i` on; a server's failure is raised as `HopFailed` for the
        recovery loop. A stream the server closed for idleness (past its --session-idle-timeout) is
        no failure: the server is healthy, so hop `run.i` is reopened there and replayed, and the step
        goes on (a reopen that fails is a failure; twice in a step on one server is a fault)."""
        while True:
            # the happy path runs every hop in one coroutine on the loop (no thread hand-off per hop)
            # and stops at the first failure
            run.i, run.x, error = self.ctx.loop.run(
                self._relay_async(run.i, run.x, run.step_id, run.done, run.rollback_start),
                timeout_s=(self.ctx.step_timeout_s + 3) * (len(self.streams) - run.i) + 2,
            )
            if error is None:
                return run.x
            if not isinstance(error, SessionIdleTimeoutError):
                raise error
            stream = self.streams[run.i]
            if stream.hop.peer_id in run.reopened:
                raise HopFailed(
                    stream.hop,
                    ServerUnavailableError(
                        f"server {stream.hop.describe()} closed the reopened session at once: {error}"
                    ),
                ) from error
            run.reopened.add(stream.hop.peer_id)
            self._reopen(run.i, error)
            run.step_id = self._new_step_id()  # after the replay's

    def _repair_step(self, run: _StepRun, failed: HopFailed) -> None:
        """Replace the failed hop (`run.i`) and replay; the step then goes on from the replacement,
        with its input. A whole-chain failover (an orchestrator's) restarts the step at hop 0: the
        replay rebuilds past steps, so this step's input leaves the history of the hops it ran on."""
        if self.ctx.provider.whole_chain_failover:
            for s in run.done:
                s.inputs.pop()
            run.done = []
            self._replace(0, failed.error)
            run.i, run.x = 0, run.x0
        else:
            self._replace(run.i, failed.error)
        run.step_id = self._new_step_id()  # after the replay's

    async def _relay_async(
        self,
        i: int,
        x: torch.Tensor | wire_parts.RawTensor,
        step_id: int,
        done: list[HopStream],
        start_position: int | None = None,
    ) -> tuple[int, torch.Tensor | wire_parts.RawTensor, Exception | None]:
        """Hops `i`.. of one step; returns where it stopped, that hop's input and its error (as
        `HopClient.run_hop` would raise it), or (len, output, None). A hop's reply goes on to the
        next hop as it came (a RawTensor); each hop's history keeps its input as a tensor, decoded
        by `step_async` while that hop computed."""
        while i < len(self.streams):
            stream = self.streams[i]
            try:
                out = await self._call_async(stream, x, step_id, index=i, start_position=start_position)
            except Exception as e:
                return i, x, self.ctx.hops.hop_error(stream.hop, e, self.ctx.step_timeout_s)
            stream.inputs.append(wire_parts.as_tensor(x))
            done.append(stream)
            x, i = out, i + 1
        return i, x, None

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
        logger.info(
            "server %s closed idle session %s (%s); reopening it and replaying %d tokens",
            old.hop.describe(),
            self.session_id[:8],
            error,
            sum(x.shape[0] for x in old.inputs),
        )
        self._close_streams([old])
        inputs = self._with_prefix_input(index, old)  # before the new stream takes index's place
        before = self.streams[index - 1].hop.peer_id if index > 0 else None
        (new,) = self._open_hops([old.hop], before=before)  # HopFailed: the step's caller fails it over
        if inputs:
            history = torch.cat(inputs)
            self._call(new, history)
            new.inputs.append(history)
            new.prefix_in_inputs = bool(self.prefix_tokens)
        self.streams[index] = new

    def _replace(self, index: int, error: Exception) -> None:
        """Replace the failed hop `index` and rebuild the KV caches by replaying the inputs it had
        received. With client-side routing only the failed span is replaced: the new hops end at the
        start of a later hop, which is kept with its cache (or at the last block). An orchestrator's
        provider replaces the whole chain (the lease moves to it), replayed from block 0, so the
        session always runs on the chain it is counted on. A replacement that fails while it is
        opened or replayed raises `HopFailed`: the recovery loop counts it and replaces again."""
        failed = self.streams[index]
        if self.ctx.provider.whole_chain_failover:
            index, failed = 0, self.streams[0]
            new_hops = self.recovery.ask(self.lease.acquire)
        else:
            ends = frozenset({s.hop.start for s in self.streams[index + 1 :]} | {self.ctx.num_blocks})
            new_hops = self.recovery.ask(lambda exclude: self.lease.find_span(failed.hop.start, ends, exclude))
        new_end = new_hops[-1].end
        keep_from = next(
            (i for i in range(index + 1, len(self.streams)) if self.streams[i].hop.start == new_end), len(self.streams)
        )
        logger.warning(
            "server %s failed (%s); replacing blocks [%d, %d) with %s",
            failed.hop.describe(),
            error,
            failed.hop.start,
            new_end,
            " -> ".join(h.describe() for h in new_hops),
        )
        self._close_streams(self.streams[index:keep_from])
        inputs = self._with_prefix_input(index, failed)
        history = torch.cat(inputs) if inputs else None
        before = self.streams[index - 1].hop.peer_id if index > 0 else None
        replacement = self._open_hops(new_hops, before=before)  # raises HopFailed: the recovery loop tries another
        try:
            if history is not None:
                x = history
                for stream in replacement:
                    x_out = self._call(stream, x)
                    stream.inputs.append(x)
                    stream.prefix_in_inputs = bool(self.prefix_tokens)
                    x = x_out
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
        x = self.prefix.hidden[: self.prefix_tokens].to(self.ctx.dtype)
        for before in self.streams[:index]:
            x = self.ctx.hops.forward(before.hop, x.unsqueeze(0), self.adapter)[0]
        return [x, *stream.inputs]

    @property
    def hops(self) -> list[Hop]:
        return [s.hop for s in self.streams]

    def describe(self) -> str:
        return " -> ".join(h.describe() for h in self.hops)

    def close(self) -> None:
        """Close the streams and release the lease (once: a second close sends nothing)."""
        hops = self.hops
        self._close_streams(self.streams)
        self.streams = []
        self.lease.release(
            hops, input_tokens=self.input_tokens, output_tokens=self.steps, hop_timings=tuple(self.hop_timings)
        )
