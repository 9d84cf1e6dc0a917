"""Checking what servers compute: cheap checks of every reply, and spot checks by redundancy.

Every hop reply a session gets passes `SessionVerifier.on_reply` (one call in `RemoteChainSession`'s
step path, `_call_async`, which every step and replay goes through):

1. **Cheap checks, always on**: a reply whose shape is not its input's, whose dtype is not the
   chain's, that holds NaN/Inf, or whose rows' RMS is more than `norm_margin` (10) times above the
   largest or below the smallest RMS seen in *verified* replies of the same block range (learned
   per range once 16 verified rows were seen) is refused at once: a `BadReplyError`, which the
   session's failover handles as a dead server (banned for the session, replaced, replayed).
2. **Spot checks** (`check_probability` p > 0, or `prompt_check_share`): after a step's last hop
   replied, with probability p (and always at the prompt step of a sampled share of sessions) every
   hop of the chain is audited in a background thread, off the critical path: its whole input
   history goes as a stateless forward (`rpc_forward`) through a second path of servers covering the
   same blocks (`min_latency_chain` over the DHT records, without the hop's server), and the rows
   since the hop's last audit are compared with what the hop returned (`hidden_compare`: relative
   row error against a per-dtype bound calibrated from honest pairs). A stateless forward needs no
   KV on the checker, and one audit covers every row since the last, so a server corrupting rarely
   is found at the next audit after it did, not only if the corrupted step itself was sampled.
   **Probation** (`probation`, on with spot checks): the first step a session sends through a server
   this process has not audited yet is always audited (that hop alone; one probation audit per
   server at a time, whatever the number of sessions on it), so a server that corrupts every step is
   caught at its first step, by construction, at any p. A server leaves probation once one audit of
   its work ran; after that only p finds it (a server honest at first, corrupting later).
3. **A mismatch is settled before anyone is blamed**: by the client's own computation when it holds
   the blocks (`local_model`), else by a third path avoiding both servers. Two that agree against
   the third convict it: `wrong_output` (the session's server) or `wrong_check` (the checker lied).
   With no third opinion, or three different answers, nobody is convicted: the session only avoids
   its server from the first mismatching row on.
4. **A catch**: the convicted server goes on the client's ban list for good (`PeerHealth.convict`:
   every later session and failover leaves it out), the session raises `VerificationRollback(q)` at
   its next hop reply (or in `settle`), q the first wrong row; every other session of the process that
   used the server rolls back too, to the first of its rows no audit verified (0 if it kept none):
   `DistributedModelForCausalLM.generate` rolls back to q
   (the KV rollback speculative decoding uses), the step through the convicted server fails over
   (`BadReplyError`), and generation continues from the last trusted token, so the output is what
   honest servers give (the gateway's decode loop does the same: api/engine.py). A signed report
   goes to the orchestrator (`VerificationReport`), which counts it per reporting peer after checking
   its evidence itself (orchestrator/service/reports.py).

A checker may declare another dtype than the session's (a mixed-dtype swarm): it is sent the rows
in its own dtype, and the two are compared within the looser dtype's bound (`Verification.tolerance`) by
the median of the rows' errors (honest float32 and bfloat16 rows differ with a heavy tail of isolated
rows: `hidden_compare`). Checkers of the session's own dtype are preferred where the swarm has them.
The session's own hops may declare another dtype too (a server casts a step in and its reply back;
a chain takes one where the swarm has no server of the session's dtype, or after a failover): every
comparison is judged by the dtypes of the parties on both sides (`Verification.dtypes_of`).

What this does not guarantee: a server corrupting steps no audit covered before the session ended
changes that session's output unnoticed (p trades cost for the detection latency 1/p steps; `settle`
at the end of `generate` waits only for audits already running); a swarm where every server of a
span colludes agrees with itself; a cached prompt prefix cannot be audited from the session's own
history, so spot checks turn prefix reuse off for their sessions.
"""

from __future__ import annotations

import base64
import logging
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from petals_chain.algorithms.hidden_compare import digest, first_mismatch, row_errors, tolerance_for
from petals_chain.client.hop_client import HopFailed
from petals_chain.client.peer_health import PeerHealth
from petals_chain.client.routing import min_latency_chain
from petals_chain.errors import (
    BadReplyError,
    InvalidRequestError,
    NoChainError,
    PetalsChainError,
    VerificationRollback,
)
from petals_chain.wire import parts as wire_parts
from petals_chain.wire.messages import Hop, Verdict, VerificationReport

if TYPE_CHECKING:
    from petals_chain.client.hop_client import HopStream
    from petals_chain.wire.records import ServerInfo

# the session (`RemoteChainSession`) and chain (`RemoteChain`) this module serves: named, not imported,
# since both import it
RemoteChain = RemoteChainSession = Any

logger = logging.getLogger(__name__)

NORM_MARGIN = 10.0  # a row's RMS this many times outside the verified range of its block range is impossible
MIN_LEARNED_ROWS = 16  # verified rows of a block range before its norm bounds apply
LOCAL = "local"  # the client's own computation, as an opinion's name
CROSS_DTYPE_PENALTY = 1e3  # a checker path's cost per server of another dtype than the chain's (jitter < 1 each)
MAX_OPINIONS = 8  # besides the session's own servers, asked until two agree on the first disagreeing row


@dataclass(frozen=True)
class VerificationConfig:
    """What a client checks (`DistributedModelForCausalLM.from_pretrained(verification=...)`,
    `petals-chain api --verify-probability`). Cheap checks are always on; spot checks run when
    `check_probability` > 0 or `prompt_check_share` > 0."""

    check_probability: float = 0.0  # p: chance that a step is followed by an audit of every hop
    prompt_check_share: float = 0.0  # share of sessions whose prompt step is always audited
    seed: int | None = None  # of the sampling (None: fresh randomness)
    tolerance: float | None = None  # relative row error bound (None: hidden_compare's per-dtype table)
    norm_margin: float = NORM_MARGIN
    local_model: str | Path | None = None  # the client's own copy of the blocks: the third opinion
    report: bool = True  # send signed reports to the orchestrator (when there is one)
    # probation: the first step a session sends through a server this process has not audited yet is
    # always audited (its hop alone), so a server that corrupts every step is caught at its first step
    probation: bool = True
    settle_timeout_s: float = 120.0  # most `settle` waits for a session's running audits

    def __post_init__(self):
        for name in ("check_probability", "prompt_check_share"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise InvalidRequestError(f"verification {name} must be in [0, 1], got {value}")
        if not self.norm_margin > 1.0:
            raise InvalidRequestError(f"verification norm_margin must be > 1, got {self.norm_margin}")

    @property
    def spot_checks(self) -> bool:
        return self.check_probability > 0 or self.prompt_check_share > 0


class ReplyBounds:
    """Per block range, the smallest and largest row RMS seen in verified replies (thread-safe: the
    audit thread learns, the loop checks)."""

    def __init__(self, margin: float = NORM_MARGIN, min_rows: int = MIN_LEARNED_ROWS):
        self.margin = margin
        self.min_rows = min_rows
        self._lock = threading.Lock()
        self._spans: dict[tuple[int, int], list[float]] = {}  # (start, end) -> [min_rms, max_rms, rows]

    def learn(self, span: tuple[int, int], rows: torch.Tensor) -> None:
        rms = rows.float().pow(2).mean(-1).sqrt()
        if rms.numel() == 0 or not bool(torch.isfinite(rms).all()):
            return
        lo, hi = float(rms.min()), float(rms.max())
        with self._lock:
            cur = self._spans.get(span)
            self._spans[span] = (
                [lo, hi, rms.numel()] if cur is None else [min(cur[0], lo), max(cur[1], hi), cur[2] + rms.numel()]
            )

    def bounds(self, span: tuple[int, int]) -> tuple[float, float] | None:
        """The RMS range a reply's rows must fall in (None: not learned yet)."""
        with self._lock:
            cur = self._spans.get(span)
        if cur is None or cur[2] < self.min_rows:
            return None
        return cur[0] / self.margin, cur[1] * self.margin

    def why_impossible(
        self,
        hop: Hop,
        hidden_in: torch.Tensor | wire_parts.RawTensor,
        output: torch.Tensor | wire_parts.RawTensor,
        dtype: torch.dtype,
    ) -> str | None:
        """Why `output` cannot be the hop's answer to `hidden_in`, or None."""
        shape_in = tuple(hidden_in.shape)
        if tuple(output.shape) != shape_in:
            return f"a reply of shape {list(output.shape)} to a step of shape {list(shape_in)}"
        if output.dtype != dtype:
            return f"a reply of dtype {output.dtype} on a chain of dtype {dtype}"
        out = wire_parts.as_tensor(output)
        # one reduction: the per-row mean of squares is finite exactly when the row is (or overflows)
        rms = out.float().pow(2).mean(-1).sqrt()
        if not bool(torch.isfinite(rms).all()):
            return "NaN or Inf in its hidden states"
        limits = self.bounds((hop.start, hop.end))
        if limits is not None:
            lo, hi = float(rms.min()), float(rms.max())
            if lo < limits[0] or hi > limits[1]:
                return (
                    f"row norms (RMS {lo:.4g}..{hi:.4g}) outside {self.margin:g}x the range verified replies of "
                    f"blocks [{hop.start}, {hop.end}) had ({limits[0] * self.margin:.4g}.."
                    f"{limits[1] / self.margin:.4g})"
                )
        return None


@dataclass
class Catch:
    """A server convicted by a spot check (what a benchmark and the report need)."""

    peer_id: str
    start: int
    end: int
    position: int  # the first wrong row
    verdict: Verdict
    agreeing: tuple[str, ...]
    session_id: str
    detected_at_step: int  # the session's steps when the audit that found it was scheduled
    convicted_at_step: int = 0  # the session's steps when the verdict was in (the rollback comes at the next reply)
    probation: bool = False  # found by a probation audit (the server's first audited step in this process)
    reported: str = ""  # the orchestrator's answer, or why none went


@dataclass
class VerificationStats:
    audits: int = 0  # hops audited
    probation_audits: int = 0  # of them, audits of servers on probation (new to this process)
    rows_verified: int = 0
    outlier_rows: int = 0  # rows over the bound in cross-dtype audits whose median row was within it
    unchecked: int = 0  # audits skipped: no second path, or it failed
    mismatches: int = 0
    inconclusive: int = 0
    cheap_rejections: int = 0
    catches: list[Catch] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "audits": self.audits,
            "probation_audits": self.probation_audits,
            "rows_verified": self.rows_verified,
            "outlier_rows": self.outlier_rows,
            "unchecked": self.unchecked,
            "mismatches": self.mismatches,
            "inconclusive": self.inconclusive,
            "cheap_rejections": self.cheap_rejections,
            "catches": [
                {
                    "peer_id": c.peer_id,
                    "blocks": [c.start, c.end],
                    "position": c.position,
                    "verdict": str(c.verdict),
                    "step": c.detected_at_step,
                    "convicted_at_step": c.convicted_at_step,
                    "probation": c.probation,
                    "reported": c.reported,
                }
                for c in self.catches
            ],
        }


class LocalReference:
    """The client's own copy of blocks, built per span on first use: the third opinion it trusts."""

    def __init__(self, model: str | Path, dtype: torch.dtype):
        from petals_chain.models.checkpoint import resolve_model_path

        self.path = resolve_model_path(model)
        self.dtype = dtype
        self._lock = threading.Lock()
        self._ranges: dict[tuple[int, int], object] = {}

    def forward(self, start: int, end: int, hidden: torch.Tensor) -> torch.Tensor:
        from petals_chain.runtime.block_range import BlockRange

        with self._lock:
            block_range = self._ranges.get((start, end))
            if block_range is None:
                block_range = self._ranges[(start, end)] = BlockRange(self.path, start, end, dtype=self.dtype)
            return block_range.forward_stateless(hidden.unsqueeze(0))[0]


class Verification:
    """One client process's verification (one per `RemoteChain`): the shared norm bounds, the audit
    thread, the servers on probation, the stats, and the reports it sends. Convicted servers go on
    the client's `PeerHealth` (its one ban list: every session and failover of the client avoids them)."""

    def __init__(
        self,
        config: VerificationConfig,
        chain: RemoteChain,
        send_report: Callable[[VerificationReport, tuple[torch.Tensor, ...]], str] | None = None,
        peer_health: PeerHealth | None = None,
    ):
        self.config = config
        self.chain = chain
        self.bounds = ReplyBounds(config.norm_margin)
        self.rng = random.Random(config.seed)
        self._lock = threading.Lock()
        self.peer_health = peer_health if peer_health is not None else PeerHealth()
        # probation: servers whose probation audit ran (vetted), and those whose probation audit is running
        self._vetted: set[str] = set()
        self._probing: dict[str, Future] = {}
        self._dtypes: dict[str, torch.dtype] = {}  # servers' declared dtypes, from the records second_path read
        self.stats = VerificationStats()
        # one audit at a time: on a few cores more would only compete with the sessions' own steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verification")
        self.local = LocalReference(config.local_model, chain.dtype) if config.local_model is not None else None
        self.send_report = send_report

    def session(self, session: RemoteChainSession) -> SessionVerifier:
        with self._lock:
            sampled = self.rng.random() < self.config.prompt_check_share
        return SessionVerifier(self, session, prompt_audit=sampled)

    def avoided(self) -> frozenset[str]:
        """The servers convicted in this process (the client's `PeerHealth` holds them)."""
        return self.peer_health.convicted()

    def convict(self, peer_id: str) -> bool:
        """Ban `peer_id` for good; True if it was not convicted before."""
        return self.peer_health.convict(peer_id)

    def forget(self, *, probation: bool = True) -> None:
        """Forget convictions and catches, and (`probation`) which servers passed probation: benchmarks
        and tests whose next trial meets every server as a new client would."""
        self.peer_health.forget_convictions()
        with self._lock:
            if probation:
                self._vetted.clear()
            self.stats.catches.clear()

    # -- probation ----------------------------------------------------------------------------------
    def on_probation(self, peer_id: str) -> bool:
        """Whether `peer_id`'s work was never audited in this process, nor is being audited."""
        with self._lock:
            return peer_id not in self._vetted and peer_id not in self._probing

    def start_probation(self, peer_ids: set[str]) -> Future:
        """`peer_ids`' probation audit is under way (the future is done when it ran)."""
        done: Future = Future()
        with self._lock:
            for p in peer_ids:
                self._probing[p] = done
        return done

    def end_probation(self, peer_ids: set[str], done: Future) -> None:
        """Their probation audit ran. Whatever its outcome they leave probation (a catch bans the server;
        a server no other one can check cannot be held on probation for ever: spot checks go on)."""
        with self._lock:
            for p in peer_ids:
                if self._probing.get(p) is done:
                    del self._probing[p]
                    self._vetted.add(p)
        done.set_result(None)

    def probing(self, peer_ids) -> list[Future]:
        """The probation audits running on any of `peer_ids` (any session's)."""
        with self._lock:
            return [f for p in peer_ids if (f := self._probing.get(p)) is not None and not f.done()]

    def draw(self) -> float:
        with self._lock:
            return self.rng.random()

    def count(self, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def submit(self, fn: Callable[[], None]) -> Future:
        return self._pool.submit(fn)

    def second_path(self, start: int, end: int, exclude: frozenset[str]) -> list[Hop] | None:
        """Servers other than `exclude` that together compute exactly blocks [start, end) (each ends
        within the span: a stateless forward runs to its server's last block), or None."""
        chain = self.chain
        servers = [s for s in self._learn_dtypes() if s.end <= end]
        with self._lock:
            dtypes = {s.peer_id: self._dtypes.get(s.peer_id, chain.dtype) for s in servers}
        try:
            # a random cost per server: the checker is drawn among those that can compute the span, so a
            # server cannot tell which of its peers will check it; servers of the chain's own dtype first
            # (a cross-dtype opinion is a weaker one: a looser bound, and rows judged by their median), so the
            # penalty outweighs any sum of jitters
            cost = {
                peer: self.draw() + (CROSS_DTYPE_PENALTY if dtype != chain.dtype else 0.0)
                for peer, dtype in dtypes.items()
            }
            return min_latency_chain(servers, start, end, lambda peer: cost[peer], exclude=exclude | self.avoided())
        except NoChainError:
            return None

    def _learn_dtypes(self) -> list[ServerInfo]:
        """The model's servers from the DHT, their declared dtypes remembered."""
        from petals_chain.swarm.records import fetch_servers

        chain = self.chain
        servers = fetch_servers(chain.dht, chain.model, allowed=chain.allowed_servers)
        with self._lock:
            self._dtypes.update({s.peer_id: getattr(torch, s.dtype, chain.dtype) for s in servers})
        return servers

    def dtype_of(self, peer_id: str) -> torch.dtype:
        """The dtype `peer_id` computes in (its declared one; the client's own blocks, LOCAL, and a server
        whose record is gone: the chain's). The session's hops may declare another dtype than the session
        (a mixed-dtype swarm: such a server casts a step in and its reply back)."""
        if peer_id == LOCAL:
            return self.chain.dtype
        with self._lock:
            known = self._dtypes.get(peer_id)
        if known is None:
            self._learn_dtypes()  # a hop not met in a record yet: once per new server
            with self._lock:
                known = self._dtypes.setdefault(peer_id, self.chain.dtype)
        return known

    def dtypes_of(self, peer_ids) -> set[torch.dtype]:
        """The dtypes that computed the opinions of `peer_ids` (the session's hops, checkers, LOCAL)."""
        return {self.dtype_of(p) for p in peer_ids} or {self.chain.dtype}

    def tolerance(self, peer_ids) -> float:
        """The bound for comparing hidden states computed by `peer_ids` (both sides of a comparison): the
        loosest of their dtypes' (a float32 hop checked by a bfloat16 server: bfloat16's)."""
        if self.config.tolerance is not None:
            return self.config.tolerance
        return tolerance_for(*self.dtypes_of(peer_ids))

    def cross_dtype(self, peer_ids) -> bool:
        """Whether the parties `peer_ids` (both sides of a comparison) computed in more than one dtype."""
        return len(self.dtypes_of(peer_ids)) > 1

    def run_path(self, path: list[Hop], hidden: torch.Tensor) -> torch.Tensor:
        """A stateless forward of `hidden` through `path`, each server sent its own dtype (a checker
        may declare another than the session's: a mixed-dtype swarm)."""
        x = hidden.unsqueeze(0)
        for hop in path:
            x = self.chain.hops.forward(hop, x.to(self.dtype_of(hop.peer_id)))
        return x[0]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _HopRecord:
    """What one hop (stream) of a session was sent and answered, row by row from position 0."""

    hop: Hop
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    rows: int = 0
    verified_rows: int = 0  # rows [0, verified_rows) agreed with a second opinion
    epoch: int = 0  # how often rows were cut (an audit of rows cut meanwhile marks nothing verified)

    def cut(self, rows: int) -> None:
        if rows >= self.rows:
            return
        self.epoch += 1
        keep_in, keep_out, n = [], [], 0
        for x, y in zip(self.inputs, self.outputs):
            if n >= rows:
                break
            take = min(x.shape[0], rows - n)
            keep_in.append(x[:take])
            keep_out.append(y[:take])
            n += take
        self.inputs, self.outputs, self.rows = keep_in, keep_out, rows
        self.verified_rows = min(self.verified_rows, rows)


@dataclass
class _Snapshot:
    """A hop's record as an audit sees it (taken on the loop, read on the audit thread)."""

    hop: Hop
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    rows: int
    verified: int
    record: _HopRecord
    epoch: int


class SessionVerifier:
    """One session's checks (see the module docstring); its `on_reply` runs on the client's loop, its
    audits on the verification thread, so its state is under one lock."""

    def __init__(self, verification: Verification, session: RemoteChainSession, *, prompt_audit: bool):
        self.v = verification
        self.session = session
        self.prompt_audit = prompt_audit
        self._lock = threading.Lock()
        self._records: dict[int, tuple[HopStream, _HopRecord]] = {}  # id(stream) -> (stream, record)
        self._catch: int | None = None  # the first wrong row of a catch not yet raised to the caller
        self._avoid: set[str] = set()  # servers this session must fail over around (caught or unsettled)
        self._running: list[Future] = []
        self.steps = 0  # chain steps whose last hop replied
        # p of this session (`generate(check_probability=...)` may set it for its session)
        self.check_probability = verification.config.check_probability

    @property
    def spot_checks(self) -> bool:
        return self.check_probability > 0 or self.prompt_audit

    # -- on the loop: every hop reply -------------------------------------------------------
    def on_reply(self, stream: HopStream, hidden_in, output, start_position: int | None, replay: bool = False) -> None:
        """Check a hop's reply and record it; raises `BadReplyError` (the session fails the hop over)
        or, outside a failover's replay, `VerificationRollback` (a catch: the caller must roll back)."""
        peer = stream.hop.peer_id
        with self._lock:
            if self._catch is not None and not replay:
                q, self._catch = self._catch, None
                raise VerificationRollback(
                    f"a spot check caught a server returning wrong hidden states from "
                    f"position {q}; roll the session back there",
                    trusted_position=q,
                )
            avoid = peer in self._avoid
        if not avoid and peer in self.v.avoided():
            # convicted by another session's audit (or one of this session's for another hop) while this
            # session used it: its rows since the hop's last verified one are untrusted here too
            q = self._untrusted_from(stream)
            with self._lock:
                self._avoid.add(peer)
            if q is not None and not replay:
                raise VerificationRollback(
                    f"server {stream.hop.describe()} was caught returning wrong hidden states; roll the "
                    f"session back to position {q}, the first of its rows not verified",
                    trusted_position=q,
                )
            avoid = True
        if avoid:
            raise BadReplyError(
                f"server {stream.hop.describe()} was caught returning wrong hidden states; failing over around it"
            )
        why = self.v.bounds.why_impossible(stream.hop, hidden_in, output, self.session.ctx.dtype)
        if why is not None:
            self.v.count(cheap_rejections=1)
            raise BadReplyError(f"server {stream.hop.describe()} sent an impossible reply: {why}")
        if not self.spot_checks:
            return
        x, y = wire_parts.as_tensor(hidden_in), wire_parts.as_tensor(output)
        with self._lock:
            key = id(stream)
            entry = self._records.get(key)
            if entry is None or entry[0] is not stream:
                entry = self._records[key] = (stream, _HopRecord(stream.hop))
            record = entry[1]
            if start_position is not None:
                record.cut(start_position)
            elif replay:
                record.cut(0)  # a replay rebuilds the hop from position 0
            record.inputs.append(x)
            record.outputs.append(y)
            record.rows += x.shape[0]
        streams = self.session.streams
        if streams and stream is streams[-1]:
            self._after_step()

    def _untrusted_from(self, stream: HopStream) -> int | None:
        """The first row `stream`'s hop answered that no audit verified (0 when this session keeps no
        record of it: nothing of it is trusted), None when every row it answered was verified."""
        with self._lock:
            entry = self._records.get(id(stream))
            if entry is None or entry[0] is not stream:
                return 0 if self.session.position > 0 or self.steps > 0 else None
            record = entry[1]
            return record.verified_rows if record.rows > record.verified_rows else None

    def _after_step(self) -> None:
        self.steps += 1
        first = self.steps == 1
        sampled = (first and self.prompt_audit) or self.v.draw() < self.check_probability
        probation: set[str] = set()
        if self.v.config.probation:
            probation = {s.hop.peer_id for s in self.session.streams if self.v.on_probation(s.hop.peer_id)}
        if not sampled and not probation:
            return
        with self._lock:
            live = {id(s) for s in self.session.streams}
            self._records = {k: v for k, v in self._records.items() if k in live}
            # the chain's hops in order (a group of consecutive hops may be audited as one span)
            snapshot = [
                _Snapshot(r.hop, list(r.inputs), list(r.outputs), r.rows, r.verified_rows, r, r.epoch)
                for r in (self._records[id(s)][1] for s in self.session.streams if id(s) in self._records)
            ]
        if any(s.rows > s.verified for s in snapshot):
            step = self.steps
            # a sampled step audits every hop; a probation audit alone only the hops of servers on probation
            only = None if sampled else probation
            probed = self.v.start_probation(probation) if probation else None
            future = self.v.submit(lambda: self._audit_all(snapshot, step, only, probation, probed))
            with self._lock:
                self._running = [f for f in self._running if not f.done()] + [future]

    # -- on the verification thread -----------------------------------------------------------
    def _audit_all(
        self,
        snapshot: list[_Snapshot],
        step: int,
        only: set[str] | None = None,
        probation: set[str] = frozenset(),
        probed: Future | None = None,
    ) -> None:
        """Audit every hop (`only`: the hops of these servers): alone where other servers compute exactly
        its blocks, else together with the hops after it, compared at the end of the group (a server
        holding more blocks than one hop). `probation`: the servers on probation among them, whose
        probation `probed` ends when this audit ran."""
        i = 0
        try:
            while i < len(snapshot):
                done = i + 1
                if only is not None and snapshot[i].hop.peer_id not in only:
                    i = done
                    continue
                try:
                    for j in range(i, len(snapshot)):
                        group = snapshot[i : j + 1]
                        if all(s.rows <= s.verified for s in group) or self._distrusted(group):
                            break  # nothing new, or a server the session already fails over around
                        if self._audit(group, step, probation=bool(probation & {s.hop.peer_id for s in group})):
                            done = j + 1
                            break
                    else:
                        self.v.count(unchecked=1)  # no other servers compute these blocks
                except Exception:
                    logger.exception("auditing server %s failed", snapshot[i].hop.describe())
                i = done
        finally:
            if probed is not None:
                self.v.end_probation(probation, probed)

    def _audit(self, group: list[_Snapshot], step: int, probation: bool = False) -> bool:
        """Audit one hop or a group of consecutive hops; False when no second opinion covers its span."""
        v = self.v
        start, end = group[0].hop.start, group[-1].hop.end
        peers = frozenset(s.hop.peer_id for s in group)
        rows, verified = min(s.rows for s in group), min(s.verified for s in group)
        x, y = torch.cat(group[0].inputs)[:rows], torch.cat(group[-1].outputs)[:rows]
        check, checker_ids = self._opinion(start, end, x, peers)
        if check is None:
            return False
        v.count(audits=1, probation_audits=int(probation))
        # across dtypes honest rows have a heavy tail: judged by their median (hidden_compare); the
        # session's hops may declare other dtypes than the session's (a mixed-dtype chain), and their
        # replies come back in the session's
        parties = (*peers, LOCAL, *checker_ids)  # LOCAL: the session's own dtype, its rows' rounding
        across = v.cross_dtype(parties)
        bound = v.tolerance(parties)
        bad = first_mismatch(y[verified:], check[verified:], bound, across_dtypes=across)
        if across and bad is None:
            v.count(outlier_rows=int((row_errors(y[verified:], check[verified:]) > bound).sum()))
        if bad is None:
            for s in group:
                self._mark_verified(s.record, rows, s.epoch)
            v.bounds.learn((start, end), check[verified:])
            v.count(rows_verified=rows - verified)
            return True
        v.count(mismatches=1)
        q = verified + bad
        rq = slice(q, q + 1)
        err = float(row_errors(y[rq], check[rq])[0])
        if len(group) > 1 and v.local is not None:
            # the client's own blocks say which hop of the group went wrong
            for s in group:
                hx, hy = torch.cat(s.inputs)[:rows], torch.cat(s.outputs)[:rows]
                local = v.local.forward(s.hop.start, s.hop.end, hx)
                pair = (s.hop.peer_id, LOCAL)
                hop_bad = first_mismatch(
                    hy[verified:], local[verified:], v.tolerance(pair), across_dtypes=v.cross_dtype(pair)
                )
                if hop_bad is not None:
                    q = verified + hop_bad
                    self._convict(
                        s.hop.peer_id,
                        Verdict.WRONG_OUTPUT,
                        s.hop.start,
                        s.hop.end,
                        q,
                        hx,
                        hy,
                        local,
                        (LOCAL,),
                        step,
                        probation=probation,
                    )
                    return True
            # every hop computed what the client's own blocks do: the check was wrong
            for s in group:
                self._mark_verified(s.record, rows, s.epoch)
            if len(checker_ids) == 1:
                self._convict(checker_ids[0], Verdict.WRONG_CHECK, start, end, q, x, check, y, (LOCAL,), step)
            return True

        def agree(a: tuple[tuple[str, ...], torch.Tensor], b: tuple[tuple[str, ...], torch.Tensor]) -> bool:
            # within the loosest bound of the dtypes that computed them (a mixed-dtype swarm); one row,
            # the first disagreeing, within a dtype, and all rows since the audit's first across dtypes
            # (their median: hidden_compare)
            ids = (*computed_by(a), *computed_by(b))
            if v.cross_dtype(ids):
                return first_mismatch(a[1][verified:], b[1][verified:], v.tolerance(ids), across_dtypes=True) is None
            return first_mismatch(a[1][rq], b[1][rq], v.tolerance(ids)) is None

        def computed_by(o: tuple[tuple[str, ...], torch.Tensor]) -> tuple[str, ...]:
            # the session's rows came back cast to the session's dtype (a hop of another dtype casts its
            # reply back): that rounding is one more party (LOCAL stands for the session's dtype)
            return (*o[0], LOCAL) if o is session_opinion else o[0]

        # more opinions until two agree at the first disagreeing row (the session's servers count as one)
        session_opinion = (tuple(sorted(peers)), y)
        opinions: list[tuple[tuple[str, ...], torch.Tensor]] = [(checker_ids, check)]
        used = set(peers) | set(checker_ids)
        reference: tuple[tuple[str, ...], torch.Tensor] | None = None
        while True:
            if any(agree(o, session_opinion) for o in opinions):
                reference = session_opinion
                break
            pair = next(((a, b) for i, a in enumerate(opinions) for b in opinions[i + 1 :] if agree(a, b)), None)
            if pair is not None:
                reference = pair[0]
                break
            if len(opinions) >= MAX_OPINIONS:
                break
            if v.local is not None and not any(ids == (LOCAL,) for ids, _ in opinions):
                opinions.append(((LOCAL,), v.local.forward(start, end, x)))
                continue
            more, more_ids = self._opinion(start, end, x, frozenset(used))
            if more is None:
                break
            opinions.append((more_ids, more))
            used |= set(more_ids)
        if reference is None:
            v.count(inconclusive=1)
            logger.warning(
                "blocks [%d, %d): servers %s and %d other opinion(s) disagree at position %d (relative "
                "error %.3g) and no two agree: nobody is blamed; the session avoids them from there",
                start,
                end,
                ",".join(sorted(peers)),
                len(opinions),
                q,
                err,
            )
            self._roll_back_around(peers, q)
            return True
        agreeing = tuple(p for o in opinions if agree(o, reference) for p in o[0])
        for o in opinions:  # every opinion against the reference is wrong (convicted when one server gave it)
            ids = o[0]
            if not agree(o, reference) and len(ids) == 1 and ids != (LOCAL,):
                self._convict(
                    ids[0],
                    Verdict.WRONG_CHECK,
                    start,
                    end,
                    q,
                    x,
                    o[1],
                    reference[1],
                    (*(sorted(peers) if reference is session_opinion else ()), *agreeing),
                    step,
                )
        if reference is session_opinion:
            for s in group:  # the session's servers were right: their rows are trusted
                self._mark_verified(s.record, rows, s.epoch)
            return True
        if len(group) == 1:
            self._convict(
                group[0].hop.peer_id,
                Verdict.WRONG_OUTPUT,
                start,
                end,
                q,
                x,
                y,
                reference[1],
                agreeing,
                step,
                probation=probation,
            )
        else:
            v.count(inconclusive=1)
            logger.warning(
                "blocks [%d, %d): the hops %s computed wrong hidden states at position %d, and no "
                "opinion says which: nobody is blamed; the session avoids them from there",
                start,
                end,
                ",".join(sorted(peers)),
                q,
            )
            self._roll_back_around(peers, q)
        return True

    def _convict(
        self,
        accused: str,
        verdict: Verdict,
        start: int,
        end: int,
        q: int,
        x: torch.Tensor,
        wrong: torch.Tensor,
        reference: torch.Tensor,
        agreeing: tuple[str, ...],
        step: int,
        *,
        probation: bool = False,
    ) -> None:
        """Ban `accused` in this process (the client's `PeerHealth`), roll the session back around it
        (its own server), report it."""
        v = self.v
        if verdict == Verdict.WRONG_OUTPUT:
            self._roll_back_around({accused}, q)
        if not v.convict(accused):
            return  # caught before (in another audit): banned and reported once
        err = float(row_errors(wrong[q : q + 1], reference[q : q + 1])[0])
        logger.warning(
            "spot check: server %s returned wrong hidden states for blocks [%d, %d) at position %d "
            "(%s, relative error %.3g; %s agree on the reference): banned",
            accused,
            start,
            end,
            q,
            verdict,
            err,
            ", ".join(agreeing),
        )
        catch = Catch(
            accused,
            start,
            end,
            q,
            verdict,
            tuple(agreeing),
            self.session.session_id,
            step,
            convicted_at_step=self.steps,
            probation=probation,
        )
        if v.config.report and v.send_report is not None:
            # the evidence in the session's dtype (a checker of another dtype computed one of the rows)
            catch.reported = self._report(
                catch, x[: q + 1], wrong[q : q + 1].to(x.dtype), reference[q : q + 1].to(x.dtype)
            )
        with v._lock:
            v.stats.catches.append(catch)

    def _distrusted(self, group: list[_Snapshot]) -> bool:
        avoided = self.v.avoided()
        with self._lock:
            return any(s.hop.peer_id in self._avoid or s.hop.peer_id in avoided for s in group)

    def _mark_verified(self, record: _HopRecord, rows: int, epoch: int) -> None:
        with self._lock:
            if record.epoch == epoch:  # not cut meanwhile (a rollback): the rows audited are still the record's
                record.verified_rows = max(record.verified_rows, rows)

    def _opinion(
        self, start: int, end: int, x: torch.Tensor, exclude: frozenset[str]
    ) -> tuple[torch.Tensor | None, tuple[str, ...]]:
        """Blocks [start, end)'s output for `x` from servers outside `exclude` (two paths tried), and who
        computed it."""
        for _ in range(2):
            path = self.v.second_path(start, end, exclude)
            if path is None:
                return None, ()
            try:
                return self.v.run_path(path, x), tuple(h.peer_id for h in path)
            except HopFailed as failed:
                exclude = exclude | {failed.hop.peer_id}
            except PetalsChainError as e:
                logger.info("a spot check's forward failed (%s)", e)
                return None, ()
        return None, ()

    def _third_opinion(
        self, start: int, end: int, x: torch.Tensor, exclude: frozenset[str]
    ) -> tuple[torch.Tensor | None, tuple[str, ...]]:
        if self.v.local is not None:
            return self.v.local.forward(start, end, x), (LOCAL,)
        return self._opinion(start, end, x, exclude)

    def _roll_back_around(self, peer_ids, q: int) -> None:
        with self._lock:
            self._avoid.update(peer_ids)
            self._catch = q if self._catch is None else min(self._catch, q)

    def _report(self, catch: Catch, inputs: torch.Tensor, wrong: torch.Tensor, reference: torch.Tensor) -> str:
        report = VerificationReport(
            model=self.session.ctx.model,
            accused=catch.peer_id,
            agreeing=list(catch.agreeing),
            start=catch.start,
            end=catch.end,
            position=catch.position,
            dtype=str(inputs.dtype).removeprefix("torch."),
            input_digest=digest(inputs),
            accused_digest=digest(wrong),
            reference_digest=digest(reference),
            verdict=catch.verdict,
            reporter_key="",
        )
        try:
            return self.v.send_report(report, (inputs, wrong, reference))
        except Exception as e:  # a report that cannot go is logged, never a session's failure
            logger.warning("the verification report on %s could not be sent: %s", catch.peer_id, e)
            return f"not sent: {e}"

    # -- the session's caller -------------------------------------------------------------------
    def _wait(self, future: Future) -> None:
        try:
            future.result(timeout=self.v.config.settle_timeout_s)
        except Exception:
            logger.warning("a spot check did not finish in time; its result is not waited for")

    def holding(self) -> bool:
        """Whether what the session computed may yet be found wrong soon: a probation audit of one of its
        servers is running (any session's), one of them is convicted, or a catch waits to be raised. A
        gateway streaming text holds it back meanwhile, so a server that corrupts every step is caught
        before any of its text is shown."""
        peers = {s.hop.peer_id for s in self.session.streams}
        with self._lock:
            if self._catch is not None:
                return True
        return bool(peers & self.v.avoided()) or bool(self.v.probing(peers))

    def before_step(self) -> None:
        """On the session's thread, before each step: a probation audit of one of its servers (any
        session's) is waited for, so its verdict is in before the session's second step through a new
        server; then a catch is raised (`VerificationRollback`), also one another session's audit made
        of a server this session used (rolled back to the first of its rows no audit verified)."""
        for future in self.v.probing({s.hop.peer_id for s in self.session.streams} - self.v.avoided()):
            self._wait(future)
        with self._lock:
            if self._catch is not None:
                q, self._catch = self._catch, None
                raise VerificationRollback(
                    f"a spot check caught a server returning wrong hidden states from position {q}", trusted_position=q
                )
        convicted = self.v.avoided()
        for stream in self.session.streams:  # convicted by another session's audit while this one used it
            peer = stream.hop.peer_id
            with self._lock:
                known = peer in self._avoid
            if peer not in convicted or known:
                continue
            q = self._untrusted_from(stream)
            with self._lock:
                self._avoid.add(peer)
            if q is not None:
                raise VerificationRollback(
                    f"server {stream.hop.describe()} was caught returning wrong hidden states from position {q}",
                    trusted_position=q,
                )

    def settle(self) -> None:
        """Wait for this session's running audits and the probation audits of its servers (at most
        `settle_timeout_s` each); raises `VerificationRollback` when one caught a server whose rows the
        session used (the caller rolls back and continues)."""
        with self._lock:
            running = list(self._running)
        for future in running:
            self._wait(future)
        self.before_step()


def sign_report(report: VerificationReport, identity) -> VerificationReport:
    """`report` signed by `identity` (a `SwarmIdentity`: the key is the peer's libp2p identity)."""
    public = identity.private_key.get_public_key().to_bytes()
    report.reporter_key = base64.b64encode(public).decode()
    report.signature = base64.b64encode(identity.private_key.sign(report.signed_bytes())).decode()
    return report
