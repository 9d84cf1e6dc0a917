"""One wire format for everything that crosses the network, validated at the boundary.

Messages are hivemind `ExpertRequest`/`ExpertResponse` protobufs: `metadata` holds a msgpack map
(never pickle), `tensors` hold raw tensors in the model dtype, in parts (`wire_parts`). Every record has explicit
`to_wire()` / `from_wire()`; `from_wire` rejects missing or mistyped fields with
`InvalidRequestError`, so a bad message becomes a typed error reply, never a crash.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack
from hivemind.proto import runtime_pb2

from petals_chain.errors import InvalidRequestError, PetalsChainError, error_from_code

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = "petals-chain/1"
SERVER_STATES = ("joining", "online", "offline")
MAX_METADATA_BYTES = 64 * 1024


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


def unpack_request(request, kind: str) -> dict[str, Any]:
    """The metadata of a unary request that carries no tensors and whose `type` (if given) is `kind`;
    anything else is a typed error, so a message meant for another RPC is never half-understood."""
    meta = unpack(request.metadata)
    if meta.get("type", kind) != kind:
        raise InvalidRequestError(f"this RPC takes {kind!r} messages, got type {meta.get('type')!r}")
    if len(request.tensors):
        raise InvalidRequestError(f"{kind!r} messages carry no tensors, got {len(request.tensors)}")
    return meta


def field_of(meta: dict[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = dataclasses.MISSING) -> Any:
    """Read `meta[name]` and check its type (bool is not accepted where int is asked)."""
    if name not in meta:
        if default is dataclasses.MISSING:
            raise InvalidRequestError(f"message lacks field {name!r}")
        return default
    value = meta[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise InvalidRequestError(f"field {name!r} must be {kind}, got bool")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds):
        raise InvalidRequestError(f"field {name!r} must be {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def request(meta: dict[str, Any]) -> runtime_pb2.ExpertRequest:
    """A message without tensors (those go through `wire_parts.to_messages`, in parts)."""
    return runtime_pb2.ExpertRequest(metadata=pack(meta))


def response(meta: dict[str, Any]) -> runtime_pb2.ExpertResponse:
    return runtime_pb2.ExpertResponse(metadata=pack(meta))


def error_response(error: Exception) -> runtime_pb2.ExpertResponse:
    code = error.code if isinstance(error, PetalsChainError) else "error"
    return response({"type": "error", "code": code, "message": str(error)})


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
    if meta.get("type") == "error":
        raise error_from_code(str(meta.get("code", "error")), str(meta.get("message", "")))


@dataclass
class ServerInfo:
    """What a server announces in the DHT (and returns from rpc_info).

    A server started with `--blocks auto` first announces itself as `joining` with
    `start == end == 0` (no blocks yet) and its budget and measured t_I/t_O, so that the
    orchestrator can plan with it; every other record has `0 <= start < end`."""

    peer_id: str
    model: str
    start: int  # first block, 0-based
    end: int  # one past the last block
    state: str  # joining | online | offline
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

    def __post_init__(self):
        if self.max_step_tokens <= 0:
            self.max_step_tokens = self.max_length_tokens

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> "ServerInfo":
        if not isinstance(data, dict):
            raise InvalidRequestError(f"ServerInfo must be a map, got {type(data).__name__}")
        kinds = {"peer_id": str, "model": str, "start": int, "end": int, "state": str, "memory_budget_bytes": int,
                 "block_bytes": int, "kv_bytes_per_block": int, "max_length_tokens": int, "free_kv_slots": int,
                 "prefill_s_per_token": float, "decode_s_per_token": float}
        values = {name: field_of(data, name, kind) for name, kind in kinds.items()}
        optional = {"dtype": str, "quant": str, "name": str, "active_sessions": int, "version": str, "extra": dict,
                    "max_step_tokens": int}
        for name, kind in optional.items():
            if name in data:
                values[name] = field_of(data, name, kind)
        info = cls(**values)
        if info.state not in SERVER_STATES:
            raise InvalidRequestError(f"unknown server state {info.state!r}")
        if info.state == "joining" and info.start == info.end == 0:
            return info  # a server that waits for its assignment holds no blocks yet
        if not 0 <= info.start < info.end:
            raise InvalidRequestError(f"bad block range [{info.start}, {info.end})")
        return info

    @property
    def has_blocks(self) -> bool:
        return self.end > self.start

    @property
    def num_blocks(self) -> int:
        return self.end - self.start
