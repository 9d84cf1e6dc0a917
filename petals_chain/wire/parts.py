"""Tensors of any size on the wire: split into parts below one message size, recombined in place.

hivemind's p2p daemon refuses a unary message over 4 MiB (`P2PDaemonError: Message size exceeds
set limit 4194304`), and one huge stream message would hold the whole tensor serialised twice in
memory. So every tensor that crosses the wire (inference steps both ways, forward requests and
replies) travels as parts of at most `MAX_PART_BYTES` payload, the one knob of this module
(PETALS does the same with hivemind's `split_for_streaming`).

A *message group* is what used to be one message: the first message carries the msgpack metadata
(with `PARTS_KEY` = the number of messages when there are more than one) and the first parts;
continuation messages carry only tensor parts, with empty metadata. The first part of each tensor
is a header (dtype, shape, number of parts), as in hivemind's `split_for_streaming`.

Copies: the sender copies each part's bytes once out of the tensor (protobuf needs `bytes`); the
receiver allocates the tensor from its header and copies each part's bytes once into place.
hivemind's `combine_from_streaming` + `deserialize_torch_tensor` copy the whole tensor twice more
(`b"".join`, then `bytearray`).

Raw frames (`RawFrame`): a group of metadata and at most one tensor that fits one part can also
travel as one raw frame on our own framed streams (petals_chain/transport/framed_stream.py: `RAW_MARKER`),
without protobuf: `<I` metadata length, the msgpack metadata, then `<BB` dtype code and number of
dimensions, `<I` per dimension, and the tensor's bytes. Why: a decode step's four codec passes per
hop (the client's step, the server's reading of it, the server's reply, the client's reading of
it) ran ~0.15 ms each with protobuf objects on a core whose caches the forward has just evicted
(scripts/bench_hop_overhead.py); the raw form touches far less code. A server says in its open reply
that it takes them (`Opened.raw_frames`), the client then sends its steps so, and the server answers
a stream's raw steps in raw frames; everyone else keeps the protobuf groups.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hivemind.proto import runtime_pb2

from petals_chain.errors import InvalidRequestError, PetalsChainError
from petals_chain.wire.codec import field_of, pack, unpack

# The one part size: half of hivemind's 4 MiB p2pd message limit (its MAX_UNARY_PAYLOAD_SIZE),
# leaving room for metadata and protobuf framing. A message's tensor payload never exceeds it.
MAX_PART_BYTES = 2 * 2**20
PARTS_KEY = "parts"  # metadata field: number of messages in this group (absent: 1)
# A group may span at most this many messages (8 GiB at 2 MiB a part): a larger count is a lie that
# would keep a stream waiting for parts that never come, so it is refused at once.
MAX_PARTS_PER_GROUP = 4096

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
}

_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_COMPRESSION_NONE = runtime_pb2.CompressionType.NONE  # read once: protobuf's enum lookup costs ~1 us a call
Admit = Callable[[tuple[int, ...], torch.dtype], None]  # raises a typed error to refuse a tensor by its header


@dataclass
class Message:
    """One message group, reassembled: metadata and tensors."""

    meta: dict[str, Any]
    tensors: list[torch.Tensor] = field(default_factory=list)
    raw: bool = False  # it came as a raw frame (its sender takes raw frames back)


def _host_array(t: torch.Tensor) -> np.ndarray:
    """numpy's view of `t`'s values on the host (no copy for a CPU tensor; bfloat16, which numpy lacks,
    as int16 of the same bytes). Why so few torch calls: on a decode step's path each costs tens of
    microseconds (its dispatch code is cold after a forward), and a step's tensor is already a CPU,
    grad-free tensor; only other tensors pay for the conversion."""
    if not t.is_cpu or t.requires_grad:
        t = t.detach().cpu()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def split_tensor(t: torch.Tensor, part_bytes: int = MAX_PART_BYTES) -> list[runtime_pb2.Tensor]:
    """`t` as protobuf parts of at most `part_bytes` bytes; the first part carries the header."""
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise InvalidRequestError(
            f"tensors of dtype {str(t.dtype).removeprefix('torch.')} cannot be sent; use one of {', '.join(DTYPES)}"
        )
    array = np.ascontiguousarray(_host_array(t))  # a copy only for a strided tensor
    raw = memoryview(array).cast("B") if array.size else memoryview(b"")  # a view with a 0 in its shape cannot cast
    n = max(1, math.ceil(len(raw) / part_bytes))
    parts = [
        runtime_pb2.Tensor(
            buffer=raw[:part_bytes].tobytes(), size=list(t.shape), dtype=name, chunks=n, compression=_COMPRESSION_NONE
        )
    ]
    parts += [
        runtime_pb2.Tensor(buffer=raw[i : i + part_bytes].tobytes()) for i in range(part_bytes, len(raw), part_bytes)
    ]
    return parts


def to_messages(
    meta: dict[str, Any], tensors: Iterable[torch.Tensor] = (), *, reply: bool = False, part_bytes: int = MAX_PART_BYTES
) -> list:
    """One message group: ExpertRequests (or ExpertResponses with `reply=True`), each carrying at
    most `part_bytes` of tensor payload (small tensors share a message)."""
    cls = runtime_pb2.ExpertResponse if reply else runtime_pb2.ExpertRequest
    batches: list[list[runtime_pb2.Tensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        for i, part in enumerate(split_tensor(t, part_bytes)):
            part_size = min(part_bytes, nbytes - i * part_bytes)  # not len(part.buffer): upb copies on access
            if batches[-1] and size + part_size > part_bytes:
                batches.append([])
                size = 0
            batches[-1].append(part)
            size += part_size
    head = {**meta, PARTS_KEY: len(batches)} if len(batches) > 1 else meta
    return [cls(metadata=pack(head), tensors=batches[0])] + [cls(tensors=b) for b in batches[1:]]


@dataclass
class RawFrame:
    """One raw frame's body (see the module docstring): what `FramedStream` and `serve_framed` carry
    for `RAW_MARKER` frames, and what `encode_raw` makes and `Assembler.feed` reads."""

    body: bytes


RAW_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64", "int64", "int32")  # the dtype codes
_RAW_CODES: dict[torch.dtype, int] = {DTYPES[name]: code for code, name in enumerate(RAW_DTYPES)}
RAW_MAX_DIMS = 8
_U32 = struct.Struct("<I")
_DTYPE_DIMS = struct.Struct("<BB")
_NUMPY_OF: tuple[np.dtype, ...] = tuple(np.dtype(np.int16 if name == "bfloat16" else name) for name in RAW_DTYPES)
_SHAPES = tuple(struct.Struct(f"<{n}I") for n in range(RAW_MAX_DIMS + 1))  # a tensor's dimensions, by count
_NUMPY_BY_DTYPE: dict[torch.dtype, np.dtype] = {DTYPES[name]: _NUMPY_OF[code] for code, name in enumerate(RAW_DTYPES)}
_BF16_EXPONENT_BITS = 0x7F80  # bfloat16's exponent: all ones is Inf or NaN


def all_finite(values: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether every value of a tensor of `dtype` is finite, given numpy's view of its values (bfloat16,
    which numpy lacks, as int16 of the same bytes; then a value is Inf or NaN exactly when its exponent
    bits are all ones). Why numpy on the decoded bytes: the receiver checks its input here, where numpy
    has just copied them, for a fraction of a torch reduction's cost on a decode step's cold path
    (scripts/bench_hop_overhead.py: a torch `sum(...).item()` was ~60 us of the server's hop)."""
    if not dtype.is_floating_point:
        return True
    if dtype == torch.bfloat16:
        return not ((values & _BF16_EXPONENT_BITS) == _BF16_EXPONENT_BITS).any()
    return bool(np.isfinite(values).all())


def _not_finite_error() -> InvalidRequestError:
    return InvalidRequestError(
        "hidden states contain NaN or Inf; send finite values (a float16 model overflowing "
        "is a common cause: use bfloat16 or float32)"
    )


@dataclass
class RawTensor:
    """A tensor as a raw frame carried it, not decoded: `section` is the frame's tensor part (dtype
    code, number of dimensions, shape, values), which `encode_raw` puts into another raw frame as it is;
    `tensor()` decodes it (once, into memory of its own).

    Why: a client relaying a hop's reply to the next hop (client relay) only forwards the values;
    decoding them into a tensor and encoding that again cost the client ~0.1 ms per hop on a decode
    step's cold path (scripts/bench_hop_overhead.py). It still needs them as a tensor for its history
    (failover replay), and decodes them after the next hop's step is on its way, while that server
    computes (HopClient.step_async)."""

    section: bytes | memoryview
    dtype: torch.dtype
    shape: tuple[int, ...]
    _decoded: torch.Tensor | None = field(default=None, repr=False)

    def tensor(self) -> torch.Tensor:
        if self._decoded is None:
            self._decoded = _raw_values(
                self.section, _RAW_CODES[self.dtype], self.shape, _DTYPE_DIMS.size + 4 * len(self.shape)
            )
        return self._decoded


def as_tensor(x: torch.Tensor | RawTensor) -> torch.Tensor:
    """`x` as a tensor (a RawTensor decoded, once)."""
    return x.tensor() if isinstance(x, RawTensor) else x


def encode_raw(meta: dict[str, Any], tensor: torch.Tensor | RawTensor | None = None) -> RawFrame | None:
    """`meta` and `tensor` as one raw frame, or None when they do not fit one (a tensor over
    MAX_PART_BYTES, of another dtype or more dimensions: send `to_messages` then). A RawTensor's
    section goes in as it came (it fit a raw frame already)."""
    if tensor is None:
        packed = pack(meta)
        return RawFrame(b"".join((_U32.pack(len(packed)), packed, _DTYPE_DIMS.pack(255, 0))))
    if isinstance(tensor, RawTensor):
        packed = pack(meta)
        return RawFrame(b"".join((_U32.pack(len(packed)), packed, tensor.section)))
    code = _RAW_CODES.get(tensor.dtype)
    if code is None or tensor.dim() > RAW_MAX_DIMS:
        return None
    array = _host_array(tensor)  # its size, shape and C-order bytes (`tobytes` orders a strided array)
    if array.nbytes > MAX_PART_BYTES:
        return None
    packed, shape = pack(meta), array.shape
    return RawFrame(
        b"".join(
            (
                _U32.pack(len(packed)),
                packed,
                _DTYPE_DIMS.pack(code, len(shape)),
                _SHAPES[len(shape)].pack(*shape),
                array.tobytes(),
            )
        )
    )


def _parse_raw(frame: RawFrame, admit: Admit | None) -> tuple[dict[str, Any], int, tuple[int, ...], int, int]:
    """(metadata, dtype code, shape, where the tensor part starts, where its values start) of a raw
    frame, checked to hold exactly the values its header declares (code 255: no tensor); a malformed
    frame, or a tensor `admit` refuses, raises a typed error."""
    body = memoryview(frame.body)
    if len(body) < _U32.size + _DTYPE_DIMS.size:
        raise InvalidRequestError(f"a raw frame of {len(body)} bytes is too short to hold a message")
    (meta_bytes,) = _U32.unpack_from(body)
    end = _U32.size + meta_bytes
    if end + _DTYPE_DIMS.size > len(body):
        raise InvalidRequestError(f"a raw frame declares {meta_bytes} bytes of metadata, more than it holds")
    meta = unpack(body[_U32.size : end])
    section = end
    code, dims = _DTYPE_DIMS.unpack_from(body, end)
    end += _DTYPE_DIMS.size
    if code == 255 and dims == 0 and end == len(body):
        return meta, code, (), section, end
    if code >= len(RAW_DTYPES) or dims > RAW_MAX_DIMS:
        raise InvalidRequestError(
            f"a raw frame's tensor has dtype code {code} and {dims} dimensions; codes are "
            f"0..{len(RAW_DTYPES) - 1} ({', '.join(RAW_DTYPES)}), at most {RAW_MAX_DIMS} "
            "dimensions"
        )
    if end + 4 * dims > len(body):
        raise InvalidRequestError("a raw frame ends inside its tensor's shape")
    shape = _SHAPES[dims].unpack_from(body, end)
    end += 4 * dims
    dtype = DTYPES[RAW_DTYPES[code]]
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != len(body) - end:
        raise InvalidRequestError(
            f"a raw frame's tensor of shape {list(shape)} needs {nbytes} bytes, the frame carries {len(body) - end}"
        )
    if admit is not None:
        admit(shape, dtype)
    return meta, code, shape, section, end


def _raw_values(
    buffer: bytes | memoryview, code: int, shape: tuple[int, ...], offset: int, finite: bool = False
) -> torch.Tensor:
    """The tensor of dtype code `code` and `shape` whose values start at `offset` of `buffer` (and run
    to its end, as `_parse_raw` checked); with `finite`, NaN or Inf raises a typed error."""
    dtype = DTYPES[RAW_DTYPES[code]]
    if offset == len(buffer):  # no values (a dimension of 0)
        return torch.empty(shape, dtype=dtype)
    # the one copy: into memory the tensor owns and may write (the frame's bytes are read-only); numpy
    # views the bytes and shapes them (one torch call instead of frombuffer + view); bfloat16, which
    # numpy lacks, as int16 of the same bytes
    array = np.frombuffer(buffer, _NUMPY_OF[code], offset=offset).reshape(shape).copy()
    if finite and not all_finite(array, dtype):
        raise _not_finite_error()
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if code == 1 else tensor


def decode_raw(frame: RawFrame, admit: Admit | None = None, finite: bool = False) -> Message:
    """The group in a raw frame (its tensor copied once into its own memory); a malformed frame, a
    tensor `admit` refuses, or (with `finite`) a float tensor holding NaN or Inf raises a typed error."""
    meta, code, shape, _, end = _parse_raw(frame, admit)
    if code == 255:
        return Message(meta, [], raw=True)
    return Message(meta, [_raw_values(frame.body, code, shape, end, finite)], raw=True)


@dataclass
class _Pending:
    dtype: torch.dtype
    shape: tuple[int, ...]
    # the tensor's bytes, filled part by part; `torch.frombuffer` then makes the tensor on this memory
    # without a copy (half the time of a torch.empty + numpy view + np.frombuffer copy per step)
    raw: bytearray
    parts_left: int
    filled_bytes: int = 0


class Assembler:
    """Rebuilds message groups from a stream of messages (one assembler per stream direction).

    `feed` returns the groups a message completes (a `Message`) and the errors it causes (a typed
    error per bad group, e.g. from `admit`, which sees each tensor's header before its memory is
    allocated). After an error the rest of that group's continuation messages are dropped, so the
    sender gets exactly one reply (the error) per group and the stream stays usable. With `finite`, a
    float tensor holding NaN or Inf is such a bad group too (a server's input: see `all_finite`)."""

    def __init__(self, admit: Admit | None = None, finite: bool = False):
        self.admit = admit
        self.finite = finite
        self._meta: dict[str, Any] | None = None
        self._messages_left = 0
        self._tensors: list[torch.Tensor] = []
        self._pending: _Pending | None = None
        self._skipping = False

    def feed(self, message) -> list[Message | PetalsChainError]:
        out: list[Message | PetalsChainError] = []
        if isinstance(message, RawFrame):  # a whole group in one frame
            if self._meta is not None:
                out.append(
                    InvalidRequestError(
                        f"a message group ended {self._messages_left} message(s) early; "
                        "send every part of a tensor before the next message"
                    )
                )
            self._reset()
            try:
                out.append(decode_raw(message, self.admit, self.finite))
            except PetalsChainError as e:
                out.append(e)
            return out
        if message.metadata:
            if self._meta is not None:
                out.append(
                    InvalidRequestError(
                        f"a message group ended {self._messages_left} message(s) early; "
                        "send every part of a tensor before the next message"
                    )
                )
            self._reset()
            try:
                meta = unpack(message.metadata)
                self._messages_left = field_of(meta, PARTS_KEY, int, default=1)
                if not 1 <= self._messages_left <= MAX_PARTS_PER_GROUP:
                    raise InvalidRequestError(
                        f"field {PARTS_KEY!r} must lie in [1, {MAX_PARTS_PER_GROUP}], got {self._messages_left}"
                    )
                meta.pop(PARTS_KEY, None)
                self._meta = meta
            except PetalsChainError as e:
                self._reset(skipping=True)
                return out + [e]
        elif self._meta is None:
            if not self._skipping:
                out.append(
                    InvalidRequestError(
                        "a message without metadata arrived outside a message group: "
                        "every group starts with a message that carries metadata"
                    )
                )
            return out
        try:
            for part in message.tensors:
                self._add_part(part)
            self._messages_left -= 1
            if self._messages_left == 0:
                if self._pending is not None:
                    raise InvalidRequestError(
                        f"the group ended with {self._pending.parts_left} part(s) of a tensor missing"
                    )
                out.append(Message(self._meta, self._tensors))
                self._reset()
        except PetalsChainError as e:
            self._reset(skipping=self._messages_left > 1)
            out.append(e)
        return out

    def _reset(self, skipping: bool = False) -> None:
        self._meta, self._messages_left, self._tensors, self._pending = None, 0, [], None
        self._skipping = skipping

    def _add_part(self, part: runtime_pb2.Tensor) -> None:
        if self._pending is None:
            self._pending = self._start_tensor(part)
        elif part.dtype or part.size:
            raise InvalidRequestError("a tensor header arrived while another tensor still missed parts")
        p = self._pending
        buffer = part.buffer
        if p.filled_bytes + len(buffer) > len(p.raw):
            raise InvalidRequestError(f"tensor parts carry more than the {len(p.raw)} bytes its header declares")
        # the one copy on this side: the part's bytes straight into the tensor's memory
        memoryview(p.raw)[p.filled_bytes : p.filled_bytes + len(buffer)] = buffer
        p.filled_bytes += len(buffer)
        p.parts_left -= 1
        if p.parts_left == 0:
            if p.filled_bytes != len(p.raw):
                raise InvalidRequestError(
                    f"tensor parts carry {p.filled_bytes} bytes, its header declares {len(p.raw)}"
                )
            if self.finite and not all_finite(np.frombuffer(p.raw, _NUMPY_BY_DTYPE[p.dtype]), p.dtype):
                raise _not_finite_error()
            flat = torch.frombuffer(p.raw, dtype=p.dtype) if p.raw else torch.empty(0, dtype=p.dtype)
            self._tensors.append(flat.view(p.shape))
            self._pending = None

    def _start_tensor(self, part: runtime_pb2.Tensor) -> _Pending:
        if part.dtype not in DTYPES:
            raise InvalidRequestError(f"tensor dtype {part.dtype!r} is not accepted; send one of {', '.join(DTYPES)}")
        if part.compression != _COMPRESSION_NONE:
            raise InvalidRequestError("compressed tensors are not accepted; send raw tensors (compression NONE)")
        shape = tuple(int(d) for d in part.size)  # uint32 on the wire: never negative
        dtype = DTYPES[part.dtype]
        if self.admit is not None:
            self.admit(shape, dtype)  # before allocating: a refused tensor costs no memory
        return _Pending(dtype, shape, bytearray(math.prod(shape) * dtype.itemsize), max(1, part.chunks))


def decode_single(message, admit: Admit | None = None, finite: bool = False) -> Message:
    """A unary RPC's message: one whole group of at most MAX_PART_BYTES in one message (so that the
    reply, of the same size, fits one message too), else a typed error."""
    results = Assembler(admit, finite).feed(message)
    if not results:
        meta = unpack(message.metadata) if message.metadata else {}
        raise InvalidRequestError(
            f"this message is the first of {meta.get(PARTS_KEY, '?')} parts; a unary RPC "
            f"carries at most {MAX_PART_BYTES} bytes of tensors, send larger ones over a "
            "stream"
        )
    if isinstance(results[0], PetalsChainError):
        raise results[0]
    payload_bytes = sum(t.numel() * t.element_size() for t in results[0].tensors)
    if payload_bytes > MAX_PART_BYTES:
        raise InvalidRequestError(
            f"a unary RPC carries at most {MAX_PART_BYTES} bytes of tensors, this one "
            f"{payload_bytes}; send larger ones over a stream in parts (wire_parts.to_messages)"
        )
    return results[0]


async def assembled(
    messages: AsyncIterator, admit: Admit | None = None, finite: bool = False
) -> AsyncIterator[Message | PetalsChainError]:
    """The message groups (or a typed error per bad group) of a stream of messages."""
    assembler = Assembler(admit, finite)
    async for message in messages:
        for result in assembler.feed(message):
            yield result


async def until_none(queue) -> AsyncIterator:
    """The items put on `queue` (an asyncio.Queue) until a None: the outgoing side of a stream that
    its owner feeds message by message (`queue.put(None)` ends the stream)."""
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item


async def drain(messages: AsyncIterator, timeout_s: float | None = None) -> None:
    """Drop what a caller still sends (no work, no memory) until it ends its input: closing a stream
    under a sender that is still writing (its parts, or only its end-of-stream) breaks its pipe, and a
    broken pipe makes its reader raise before it reads a reply already buffered. With `timeout_s`, a
    caller that never ends its input does not hold the stream longer than that."""

    async def drop() -> None:
        async for _ in messages:
            pass

    try:
        await asyncio.wait_for(drop(), timeout_s)
    except asyncio.TimeoutError:
        pass


def decode_raw_lazy(frame: RawFrame) -> Message:
    """A raw frame's group with its tensor left as a `RawTensor` (checked, not decoded)."""
    meta, code, shape, section, _ = _parse_raw(frame, None)
    if code == 255:
        return Message(meta, [], raw=True)
    return Message(meta, [RawTensor(memoryview(frame.body)[section:], DTYPES[RAW_DTYPES[code]], shape)], raw=True)


async def receive_one(
    messages: AsyncIterator, admit: Admit | None = None, finite: bool = False, lazy: bool = False
) -> Message:
    """Read messages until one group is complete (a reply on a stream); a bad group raises its
    typed error, a stream that ends mid-group raises StopAsyncIteration. `lazy` (no `admit` or
    `finite` then): a raw frame's tensor comes as a `RawTensor`, decoded when asked."""
    first = await anext(messages)
    if isinstance(first, RawFrame):  # a whole group (a decode step's reply): no assembler to build
        return decode_raw_lazy(first) if lazy else decode_raw(first, admit, finite)
    assembler = Assembler(admit, finite)
    message = first
    while True:
        for result in assembler.feed(message):
            if isinstance(result, PetalsChainError):
                raise result
            return result
        message = await anext(messages)
