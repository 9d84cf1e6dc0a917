"""The records a swarm's peers announce and exchange: a server's `ServerInfo` (its DHT record and
its `rpc_info` reply) and the online orchestrator's `OrchestratorInfo`. Where they live in the DHT is
`petals_chain/swarm/records.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from petals_chain.errors import InvalidRequestError
from petals_chain.wire.messages import MessageType
from petals_chain.wire.record import WireRecord

PROTOCOL_VERSION = "petals-chain/1"


class ServerState(enum.StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"


class Reachability(enum.StrEnum):
    """How peers reach a server (petals_chain/swarm/reachability.py)."""

    DIRECT = "direct"  # at its own addresses
    RELAYED = "relayed"  # behind a NAT/firewall: through the libp2p relays in `relay_maddrs`
    UNKNOWN = "unknown"  # no peer could check; it runs as a direct peer


@dataclass
class ServerInfo(WireRecord):
    """What a server announces in the DHT (and returns from rpc_info).

    A server started with `--blocks auto` first announces itself as `joining` with
    `start == end == 0` (no blocks yet) and its budget and measured t_I/t_O, so that the
    orchestrator can plan with it; every other record has `0 <= start < end`."""

    peer_id: str
    model: str
    start: int  # first block, 0-based
    end: int  # one past the last block
    state: ServerState
    memory_budget_bytes: int  # M_j
    block_bytes: int  # s_m
    kv_bytes_per_block: int  # s_c at max_length_tokens
    max_length_tokens: int
    free_kv_slots: int  # sessions using all of this server's blocks that still fit
    prefill_s_per_token: float  # t_I, per block
    decode_s_per_token: float  # t_O, per block
    dtype: str = "float32"
    quant: str = "none"
    name: str = ""
    active_sessions: int = 0
    version: str = PROTOCOL_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    # most tokens (rows x sequence) one inference step or forward request may carry; larger ones get
    # RequestTooLargeError before any work (0 when constructed: the same as max_length_tokens)
    max_step_tokens: int = 0
    adapters: list[str] = field(default_factory=list)  # LoRA adapters served (names sessions open with)
    # how peers reach it, from its dial-back check at start; a relayed server lists `<relay>/p2p-circuit`
    # addresses that clients and the orchestrator connect through (petals_chain/swarm/reachability.py)
    reachability: Reachability = Reachability.DIRECT
    relay_maddrs: tuple[str, ...] = ()
    # median rpc_info round trips (s) to other servers, by peer id, measured by this server
    # (server/peer_rtts.py): footnote 4's RTT_ij for the orchestrator's tau_c with server relay
    peer_rtt_s: dict[str, float] = field(default_factory=dict)
    # a relayed server's median RTTs (s) to its relays, by relay peer id (DHT pings): the orchestrator
    # adds its own RTT to the relay, the path a client's traffic takes (petals_chain/swarm/reachability.py)
    relay_rtt_s: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.max_step_tokens <= 0:
            self.max_step_tokens = self.max_length_tokens

    def check(self) -> None:
        if self.state == ServerState.JOINING and self.start == self.end == 0:
            return  # a server that waits for its assignment holds no blocks yet
        if not 0 <= self.start < self.end:
            raise InvalidRequestError(f"bad block range [{self.start}, {self.end})")

    @property
    def has_blocks(self) -> bool:
        return self.end > self.start

    @property
    def num_blocks(self) -> int:
        return self.end - self.start


@dataclass
class BatchService(WireRecord):
    """One batch a server ran, as it measured it (on CUDA after a synchronize): the orchestrator's
    calibrated service model (orchestrator/service/calibration.py) fits these. A block-token is one
    token through one block (a step entering mid-range runs fewer blocks)."""

    seq: int  # per server process, from 0: the orchestrator reads by cursor
    wall_s: float
    cpu_s: float  # CPU seconds the server process used during the batch (all its threads)
    sessions: int
    blocks: int  # most blocks one step of the batch ran
    prefill_tokens: int
    decode_tokens: int
    prefill_block_tokens: int
    decode_block_tokens: int


@dataclass
class InfoRequest(WireRecord):
    TYPE = MessageType.INFO
    # with a cursor, the reply carries the batches after it (None: none; -1: all the server keeps)
    service_since_seq: int | None = None
    # with a cursor, the reply carries the prefix cache's inserts and evictions from it (server/prefix_report.py)
    prefix_since_seq: int | None = None
    prefix_epoch: str | None = None


@dataclass
class PrefixDelta(WireRecord):
    """A server's prefix-cache changes since a cursor: [namespace, hash] pairs it stored and dropped; with
    `full`, `inserted` is everything it holds (the cursor was from another epoch or too old)."""

    epoch: str
    next_seq: int
    full: bool
    inserted: list[list[str]]
    evicted: list[list[str]]


@dataclass
class InfoReply(WireRecord):
    """rpc_info's answer (the server answers any request with it)."""

    TYPE = MessageType.INFO
    info: ServerInfo
    service: list[BatchService] | None = None  # batches after the request's cursor, oldest first
    prefix: PrefixDelta | None = None  # the prefix cache's changes after the request's prefix cursor


@dataclass
class OrchestratorInfo(WireRecord):
    """The online orchestrator's DHT record, announced under `orchestrator_key(model)`, so servers and
    clients of the same model find it with no extra flag (its RPCs' messages are in `messages.py`)."""

    peer_id: str
    model: str
    policy: str
    plan_version: int = 0
    http_port: int = 0
    version: str = PROTOCOL_VERSION
