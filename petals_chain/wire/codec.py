"""One wire format for everything that crosses the network, validated at the boundary.

Messages are hivemind `ExpertRequest`/`ExpertResponse` protobufs: `metadata` holds a msgpack map
(never pickle), `tensors` hold raw tensors in the model dtype, in parts (`wire/parts.py`). Every record is a
`WireRecord` dataclass (`wire/record.py`: one `from_wire`/`to_wire` derived from its fields; the
messages are in `wire/messages.py`, the swarm's records in `wire/records.py`); `from_wire` rejects
missing or mistyped fields with `InvalidRequestError`, so a bad message becomes a typed error reply,
never a crash.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import msgpack
from hivemind.proto import runtime_pb2

from petals_chain.errors import (
    ErrorCode,
    InvalidRequestError,
    PetalsChainError,
    error_from_code,
)
from petals_chain.wire.messages import ErrorReply, MessageType
from petals_chain.wire.record import WireRecord, decode_value

logger = logging.getLogger(__name__)

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


def decode_request(request, kind: type[WireRecord]) -> WireRecord:
    """The typed message of a unary request that carries no tensors and whose `type` (if given) is
    `kind.TYPE`; anything else is a typed error, so a message meant for another RPC is never half-understood."""
    meta = unpack(request.metadata)
    if meta.get("type", kind.TYPE) != kind.TYPE:
        raise InvalidRequestError(f"this RPC takes {str(kind.TYPE)!r} messages, got type {meta.get('type')!r}")
    if len(request.tensors):
        raise InvalidRequestError(f"{str(kind.TYPE)!r} messages carry no tensors, got {len(request.tensors)}")
    return kind.from_wire(meta)


def field_of(
    meta: dict[str, Any], name: str, kind: type | tuple[type, ...], *, default: Any = dataclasses.MISSING
) -> Any:
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
