"""One wire format for everything that crosses the network, validated at the boundary.

Messages are hivemind `ExpertRequest`/`ExpertResponse` protobufs: `metadata` holds a msgpack map
(never pickle), `tensors` hold raw tensors in the model dtype, in parts (`wire_parts`). Every record is a
`WireRecord` dataclass (`wire_record.py`: one `from_wire`/`to_wire` derived from its fields; the
messages are in `messages.py`); `from_wire` rejects missing or mistyped fields with
`InvalidRequestError`, so a bad message becomes a typed error reply, never a crash.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack
from hivemind.proto import runtime_pb2

from petals_chain.errors import ErrorCode, InvalidRequestError, PetalsChainError, error_from_code
from petals_chain.messages import ErrorReply, MessageType
from petals_chain.wire_record import WireRecord, decode_value

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = "petals-chain/1"
MAX_METADATA_BYTES = 64 * 1024


class ServerState(enum.StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"


class Reachability(enum.StrEnum):
    """How peers reach a server (petals_chain/reachability.py)."""
    DIRECT = "direct"  # at its own addresses
    RELAYED = "relayed"  # behind a NAT/firewall: through the libp2p relays in `relay_maddrs`
    UNKNOWN = "unknown"  # no peer could check; it runs as a direct peer


def pack(meta: dict[str, Any]) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_METADATA_BYTES:
        raise InvalidRequestError(f"metadata of {len(data)} bytes exceeds the {MAX_METADATA_BYTES}-byte limit")
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types on garbage
        raise InvalidRequestError(f"metadata is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(meta, dict):
        raise InvalidRequestError(f"metadata must be a msgpack map, got {type(meta).__name__}")
    return meta


def decode_request(request, kind: type[WireRecord]) -> WireRecord:
    """The typed message of a unary request that carries no tensors and whose `type` (if given) is
    `kind.TYPE`; anything else is a typed error, so a message meant for another RPC is never half-understood."""
    meta = unpack(request.metadata)
    if meta.get("type", kind.TYPE) != kind.TYPE:
        raise InvalidRequestError(f"this RPC takes {str(kind.TYPE)!r} messages, got type {meta.get('type')!r}")
    if len(request.tensors):
        raise InvalidRequestError(f"{str(kind.TYPE)!r} messages carry no tensors, got {len(request.tensors)}")
    return kind.from_wire(meta)


def field_of(meta: dict[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = dataclasses.MISSING) -> Any:
    """Read `meta[name]` and check it as a record field of type `kind` would be (`wire_record.decode_value`)."""
    if name not in meta:
        if default is dataclasses.MISSING:
            raise InvalidRequestError(f"message lacks field {name!r}")
        return default
    return decode_value(name, meta[name], kind)


def _meta(message: WireRecord | dict[str, Any]) -> dict[str, Any]:
    return message.to_wire() if isinstance(message, WireRecord) else message  # a raw map: fuzzers, old peers


def request(message: WireRecord | dict[str, Any]) -> runtime_pb2.ExpertRequest:
    """A message without tensors (those go through `wire_parts.to_messages`, in parts)."""
    return runtime_pb2.ExpertRequest(metadata=pack(_meta(message)))


def response(message: WireRecord | dict[str, Any]) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=pack(_meta(message)))


def error_response(error: Exception) -> runtime_pb2.ExpertResponse:
    code = error.code if isinstance(error, PetalsChainError) else ErrorCode.ERROR
    return response(ErrorReply(code, str(error)))


def replies_with_typed_errors(handler):
    """Decorator for unary RPC handlers: a `PetalsChainError` becomes its typed error reply, any other
    exception is logged and replied as a generic error; the server keeps serving either way."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except PetalsChainError as e:
            return error_response(e)
        except Exception as e:  # a bug must not take the server down: report it to this caller
            logger.exception("unexpected error in %s", handler.__qualname__)
            return error_response(e)

    return wrapper


def raise_if_error(meta: dict[str, Any]) -> None:
    if meta.get("type") == MessageType.ERROR:
        raise error_from_code(str(meta.get("code", ErrorCode.ERROR)), str(meta.get("message", "")))


def decode_reply(meta: dict[str, Any], kind: type[WireRecord]) -> WireRecord:
    """A peer's reply as `kind` (its typed error raised as such); a reply that does not parse is the
    peer's fault, so it surfaces as `InvalidRequestError` naming the field."""
    raise_if_error(meta)
    if meta.get("type") != kind.TYPE:
        raise InvalidRequestError(f"expected a {str(kind.TYPE)!r} reply, got type {str(meta.get('type'))[:64]!r}")
    return kind.from_wire(meta)


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
    # addresses that clients and the orchestrator connect through (petals_chain/reachability.py)
    reachability: Reachability = Reachability.DIRECT
    relay_maddrs: tuple[str, ...] = ()
    # median rpc_info round trips (s) to other servers, by peer id, measured by this server
    # (server/peer_rtts.py): footnote 4's RTT_ij for the orchestrator's tau_c with server relay
    peer_rtt_s: dict[str, float] = field(default_factory=dict)
    # a relayed server's median RTTs (s) to its relays, by relay peer id (DHT pings): the orchestrator
    # adds its own RTT to the relay, the path a client's traffic takes (petals_chain/reachability.py)
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


@dataclass
class InfoReply(WireRecord):
    """rpc_info's answer (the server answers any request with it)."""

    TYPE = MessageType.INFO
    info: ServerInfo
    service: list[BatchService] | None = None  # batches after the request's cursor, oldest first
