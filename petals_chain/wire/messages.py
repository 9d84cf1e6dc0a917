"""The typed messages of the inference stream and of the orchestrator's RPCs, and the chain type.

Every message is a `WireRecord` dataclass (one generic `from_wire`/`to_wire`, `wire_record.py`)
whose `TYPE` is the `type` tag on the wire; the wire format is the msgpack map it always was.

- inference stream (server/handler.py <-> client/remote.py): `Open` -> `Opened`, `Step` -> `StepReply`
  (with the hidden states as the group's tensor), `Close`; stateless `Forward`;
- orchestrator (orchestrator/service/rpc.py <-> client/orchestrated.py): `Acquire` -> `Granted` |
  `Queued`, `Release` -> `Released`, `Heartbeat` -> `HeartbeatReply`, `AssignmentRequest` ->
  `AssignmentReply`; any RPC may answer `ErrorReply`.
- `Hop` and `ChainGrant`: the one chain type shared by the orchestrator's dispatch state, its grants
  on the wire and the client's routes (a route is a list of hops).

Pure (no hivemind), so every package may import it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from petals_chain.errors import InvalidRequestError
from petals_chain.wire.prefix_keys import PREFIX_CHUNK_TOKENS, check_prefix_hashes
from petals_chain.wire.record import WireRecord

MAX_SESSION_ID_CHARS = 128


class MessageType(enum.StrEnum):
    OPEN = "open"
    OPENED = "opened"
    STEP = "step"
    CLOSE = "close"
    FORWARD = "forward"
    INFO = "info"
    ERROR = "error"
    ACQUIRE = "acquire"
    GRANTED = "granted"
    QUEUED = "queued"
    RELEASE = "release"
    RELEASED = "released"
    HEARTBEAT = "heartbeat"
    ASSIGNMENT = "assignment"
    PUSH = "push"
    DIRECT = "direct"
    DIRECT_OFFER = "direct_offer"
    DIRECT_HELLO = "direct_hello"
    DIRECT_READY = "direct_ready"
    REPORT = "report"


class AssignmentStatus(enum.StrEnum):
    """`pending`: no plan covers this server yet (ask again); `assigned`: load [start, end);
    `unused`: the plan leaves this server without blocks (ask again later)."""

    PENDING = "pending"
    ASSIGNED = "assigned"
    UNUSED = "unused"


def decode_tagged(meta: dict[str, Any], *kinds: type[WireRecord]) -> WireRecord:
    """The message `meta` as the one of `kinds` whose TYPE its `type` tag names."""
    if not isinstance(meta, dict):
        raise InvalidRequestError(f"a message must be a map, got {type(meta).__name__}")
    if "type" not in meta:
        raise InvalidRequestError("message lacks field 'type'")
    tag = meta["type"]
    for kind in kinds:
        if tag == kind.TYPE:
            return kind.from_wire(meta)
    raise InvalidRequestError(
        f"unknown message type {str(tag)[:64]!r} (expected {', '.join(str(k.TYPE) for k in kinds)})"
    )


def _check_session_id(session_id: str) -> None:
    if not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
        raise InvalidRequestError(f"session_id must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters")


def _check_max_length(max_length: int) -> None:
    if max_length < 1:
        raise InvalidRequestError(f"max_length must be >= 1, got {max_length}")


# -- chains -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hop(WireRecord):
    """One server of a chain and the blocks `[start, end)` a session runs there."""

    peer_id: str
    start: int
    end: int
    name: str = ""

    def check(self) -> None:
        if not 0 <= self.start < self.end:
            raise InvalidRequestError(f"bad hop range [{self.start}, {self.end})")

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        return f"{self.name or self.peer_id[-6:]}[{self.start}:{self.end})"


def check_chain(hops: tuple[Hop, ...] | list[Hop]) -> None:
    """At least one hop, each starting where the previous one ends."""
    if not hops:
        raise InvalidRequestError("a chain needs at least one hop")
    for a, b in zip(hops, hops[1:]):
        if a.end != b.start:
            raise InvalidRequestError(f"hops must be contiguous: [{a.start}, {a.end}) then [{b.start}, {b.end})")


@dataclass(frozen=True)
class ChainGrant(WireRecord):
    """The chain a session may run on, with its lease (made by the dispatch state, sent by rpc_acquire).
    `extra["seq"]` is the admission order (1, 2, ...), which FIFO checks read (`seq`)."""

    session_id: str
    chain_id: int
    plan_version: int
    hops: tuple[Hop, ...]
    service_time_s: float
    lease_ttl_s: float
    wait_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        check_chain(self.hops)

    @property
    def seq(self) -> int:
        seq = self.extra.get("seq", 0)
        return seq if isinstance(seq, int) else 0


# -- inference stream ---------------------------------------------------------------------------
@dataclass
class Open(WireRecord):
    """Open a session on this stream: reserve KV cache for `max_length` tokens from `entry_block`
    (default: the server's first block) to its last; wait at most `admission_wait_s` for memory.
    `prefix_hashes`: the prompt's chained chunk hashes (`prefix_keys.prefix_hashes`), asking how
    much of it the server's prefix cache holds."""

    TYPE = MessageType.OPEN
    session_id: str
    max_length: int
    entry_block: int | None = None
    admission_wait_s: float | None = None
    prefix_hashes: list[str] | None = None
    adapter: str | None = None  # the LoRA adapter (a name the server lists) the session runs with
    # server-to-server relay: the peer (the previous hop) whose pushed steps this session takes
    relay_from: str | None = None

    def check(self) -> None:
        _check_max_length(self.max_length)
        if self.prefix_hashes is not None:
            check_prefix_hashes(self.prefix_hashes)


@dataclass
class Opened(WireRecord):
    """`prefix_match_tokens` (with `prefix_chunk_tokens`): how much of the open's prefix this server
    holds; absent when the open asked nothing or the server keeps no prefix cache."""

    TYPE = MessageType.OPENED
    session_id: str
    first_block: int
    end_block: int
    prefix_match_tokens: int | None = None
    prefix_chunk_tokens: int | None = None
    raw_frames: bool | None = None  # True: the server takes this stream's steps as raw frames (wire_parts.RawFrame)


@dataclass
class Step(WireRecord):
    """One step's hidden states (the group's one tensor) for the open session. The first step may
    carry `prefix_tokens`: how many tokens of its cached prefix the server takes first (the minimum
    of the chain's hops' matches); the hidden states are then the prompt after them.
    `start_position`: the position of this step's first token. Below the session's current length it
    rolls the session back (KV rollback): the server keeps its static cache and overwrites from there,
    so speculative decoding can drop rejected draft tokens and a chat client can regenerate its last
    turn without reopening. Absent: continue where the session is."""

    TYPE = MessageType.STEP
    session_id: str
    step_id: int | None = None
    prefix_tokens: int | None = None
    start_position: int | None = None
    # server-to-server relay: the peers after this hop, in order; the server pushes its output to
    # the first with the rest of the route (empty or None: no push). Step ids then increase per
    # session, so a step that arrives twice (pushed and the client's copy) runs once
    push_route: list[str] | None = None
    relay_from: str | None = None  # the session's previous hop changed (failover): take pushes from it

    def check(self) -> None:
        if self.start_position is not None and self.start_position < 0:
            raise InvalidRequestError(f"start_position must be >= 0, got {self.start_position}")


@dataclass
class StepReply(WireRecord):
    """`server_s`: the step's time inside the server (queue + batch compute), so a client can tell
    server time from network time (None from servers that do not report it)."""

    TYPE = MessageType.STEP
    session_id: str
    step_id: int | None = None
    position: int = 0
    server_s: float | None = None
    compute_s: float | None = None  # the forward time of the batches the step ran in (framework cost = rest)


@dataclass
class Push(WireRecord):
    """A step's hidden states (the group's one tensor) pushed by the previous hop's server over its
    relay stream (`rpc_push`) to session `session_id` here; `push_route`: where this hop's output goes
    next (see `Step`)."""

    TYPE = MessageType.PUSH
    session_id: str
    step_id: int
    push_route: list[str] = field(default_factory=list)
    # the step's KV rollback (`Step.start_position`) travels with the push: every hop rolls back alike
    start_position: int | None = None

    def check(self) -> None:
        if self.start_position is not None and self.start_position < 0:
            raise InvalidRequestError(f"start_position must be >= 0, got {self.start_position}")


@dataclass
class Close(WireRecord):
    """End the session (the server frees its cache); anything else in the message is ignored."""

    TYPE = MessageType.CLOSE


@dataclass
class Forward(WireRecord):
    """A stateless forward of [batch, seq, hidden] from `entry_block` (default: the first block);
    the reply is a `Forward` with the output as its tensor."""

    TYPE = MessageType.FORWARD
    entry_block: int | None = None
    adapter: str | None = None


# -- direct streams (petals_chain/transport/direct_stream.py) ------------------------------------------------
@dataclass
class DirectRequest(WireRecord):
    """Ask a server (over p2p: the caller's peer id is authenticated) for a ticket to its direct streams."""

    TYPE = MessageType.DIRECT


@dataclass
class DirectOffer(WireRecord):
    """Where the server takes direct streams (`hosts` to try in order, `port`) and the caller's ticket;
    `port` 0: the server offers none (use the p2p streams)."""

    TYPE = MessageType.DIRECT_OFFER
    hosts: list[str] = field(default_factory=list)
    port: int = 0
    ticket: str = ""

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in 0..65535, got {self.port}")
        if self.port and (not self.hosts or not self.ticket):
            raise InvalidRequestError("an offer with a port needs hosts and a ticket")


@dataclass
class DirectHello(WireRecord):
    """The first frame of a direct stream: the caller's ticket and the stream it opens."""

    TYPE = MessageType.DIRECT_HELLO
    ticket: str
    stream: str


@dataclass
class DirectReady(WireRecord):
    """The server took the hello: the stream is open (a refusal is a typed `DirectRefusedError`)."""

    TYPE = MessageType.DIRECT_READY


@dataclass
class ErrorReply(WireRecord):
    TYPE = MessageType.ERROR
    code: str
    message: str


# -- orchestrator -------------------------------------------------------------------------------
@dataclass
class Acquire(WireRecord):
    """Ask for a chain; `poll_s` bounds one long poll, `timeout_s` the whole wait in the queue."""

    TYPE = MessageType.ACQUIRE
    session_id: str
    max_length: int
    timeout_s: float = 60.0
    poll_s: float = 5.0
    exclude: list[str] = field(default_factory=list)
    adapter: str | None = None  # only chains whose every server serves this LoRA adapter
    # the prompt, for prompt-aware dispatch (--dispatch e2, d2lpm, ...): its chained chunk hashes
    # (prefix_keys.prefix_hashes: its full chunks, the first MAX_PREFIX_HASHES) and its length in tokens
    prefix_hashes: list[str] | None = None
    prompt_tokens: int | None = None

    def check(self) -> None:
        _check_session_id(self.session_id)
        _check_max_length(self.max_length)
        if self.prefix_hashes is not None:
            check_prefix_hashes(self.prefix_hashes)
        if self.prompt_tokens is not None and not 0 <= self.prompt_tokens <= self.max_length:
            raise InvalidRequestError(
                f"prompt_tokens={self.prompt_tokens} must lie in [0, max_length="
                f"{self.max_length}]: the session's max_length must hold its prompt"
            )
        if self.prefix_hashes:
            if self.prompt_tokens is None:
                raise InvalidRequestError("prefix_hashes need prompt_tokens (the prompt's length in tokens)")
            if len(self.prefix_hashes) * PREFIX_CHUNK_TOKENS > self.prompt_tokens:
                raise InvalidRequestError(
                    f"{len(self.prefix_hashes)} prefix hashes cover {len(self.prefix_hashes) * PREFIX_CHUNK_TOKENS} "
                    f"tokens, more than prompt_tokens={self.prompt_tokens}: hash only the prompt's full chunks "
                    "(petals_chain.wire.prefix_keys.prefix_hashes)"
                )


@dataclass
class Granted(WireRecord):
    TYPE = MessageType.GRANTED
    grant: ChainGrant


@dataclass
class Queued(WireRecord):
    TYPE = MessageType.QUEUED
    position: int
    queue_length: int


@dataclass
class HopReport(WireRecord):
    """A finished session's network time with one server: the sum over its decode-sized steps of
    (client time - server time), so the orchestrator learns the per-hop framework cost beyond its RTT
    probe; and the same over its prompt steps with their tokens, so it learns the time to move a
    token's hidden states (the paper's Fig. 10: prefill communication grows with the input length)."""

    peer_id: str
    steps: int
    comm_s: float
    prompt_steps: int = 0
    prompt_tokens: int = 0
    prompt_comm_s: float = 0.0


@dataclass
class Release(WireRecord):
    """The session ended; its lengths refine the orchestrator's tau estimates and fair counters,
    its hops' network times the per-hop cost in tau_c."""

    TYPE = MessageType.RELEASE
    session_id: str
    input_tokens: int = 0
    output_tokens: int = 0
    hops: list[HopReport] | None = None


@dataclass
class Released(WireRecord):
    TYPE = MessageType.RELEASED
    known: bool


@dataclass
class Heartbeat(WireRecord):
    TYPE = MessageType.HEARTBEAT
    session_ids: list[str]


@dataclass
class HeartbeatReply(WireRecord):
    """`unknown`: the sessions the orchestrator holds no lease (nor queue place) for."""

    TYPE = MessageType.HEARTBEAT
    unknown: list[str]
    lease_ttl_s: float


@dataclass
class Assignment(WireRecord):
    """The block range the orchestrator assigned to a server (see `AssignmentStatus`). `force`: move
    now even while sessions are open (a re-plan's drain deadline passed): the server closes them with
    `ServerMovingError` and the clients fail over; without it a server moves only once it holds none."""

    status: AssignmentStatus
    plan_version: int
    start: int = 0
    end: int = 0
    force: bool = False

    def check(self) -> None:
        if self.status == AssignmentStatus.ASSIGNED and not 0 <= self.start < self.end:
            raise InvalidRequestError(f"bad assigned range [{self.start}, {self.end})")


@dataclass
class AssignmentRequest(WireRecord):
    TYPE = MessageType.ASSIGNMENT


@dataclass
class AssignmentReply(WireRecord):
    TYPE = MessageType.ASSIGNMENT
    assignment: Assignment


# -- verification reports (petals_chain/client/verification.py -> orchestrator/service/reports.py) --------


class Verdict(enum.StrEnum):
    """What a report says: the accused server's output disagreed with two others that agreed
    (`wrong_output`), or the accused was the second opinion and lied (`wrong_check`)."""

    WRONG_OUTPUT = "wrong_output"
    WRONG_CHECK = "wrong_check"


@dataclass
class VerificationReport(WireRecord):
    """A client's signed report of a server caught returning wrong hidden states for blocks
    `[start, end)`. Its tensors: the span's inputs for positions `[0, position]` (the history up to and
    including the first wrong row), the accused's output row at `position` and the reference row (what
    the opinions that agreed computed), named by their digests (`hidden_compare.digest`). `signature`
    (base64) is the reporter's RSA signature of `signed_bytes()` with `reporter_key` (base64 OpenSSH
    public key), whose libp2p peer id must be the caller's."""

    TYPE = MessageType.REPORT
    model: str
    accused: str
    agreeing: list[str]  # peer ids of the opinions that agreed with the reference ("local": the client's own)
    start: int
    end: int
    position: int
    dtype: str
    input_digest: str
    accused_digest: str
    reference_digest: str
    verdict: Verdict
    reporter_key: str
    signature: str = ""

    def check(self) -> None:
        if not 0 <= self.start < self.end:
            raise InvalidRequestError(f"bad report span [{self.start}, {self.end})")
        if self.position < 0:
            raise InvalidRequestError(f"report position must be >= 0, got {self.position}")
        for name in ("input_digest", "accused_digest", "reference_digest"):
            value = getattr(self, name)
            if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
                raise InvalidRequestError(f"{name} must be a sha256 hex digest, got {value[:80]!r}")

    def signed_bytes(self) -> bytes:
        """What the signature covers: every field but the signature, in a fixed order."""
        fields = self.to_wire()
        fields.pop("signature", None)
        return "|".join(f"{k}={fields[k]}" for k in sorted(fields)).encode()


@dataclass
class ReportReply(WireRecord):
    """`counted`: the report's evidence held against the orchestrator's own third opinion and counts;
    `reporters`: distinct peers whose reports about the accused count; `excluded`: the orchestrator no
    longer plans the accused; `detail`: why a report did not count (e.g. no third server to check it)."""

    TYPE = MessageType.REPORT
    counted: bool
    reporters: int
    excluded: bool
    detail: str = ""
