"""The per-step streams (`rpc_inference`, `rpc_push`) with one socket write per message.

hivemind's protobuf streams (`P2P._iterate_protobuf_stream_handler`, `_add_protobuf_stream_handler`)
write each message as three writes (marker, 8-byte length, body) to the p2p daemon's socket. Each
write can wake the daemon, which forwards what it has read as its own frame, so one message crosses
the daemons as up to three frames and wakes every process on the path up to three times; the
receiving side also makes one task per message and a writer task behind a queue on the caller's side.

Besides hivemind's frames, our own ends also carry raw frames (`RAW_MARKER`, petals_chain/wire/parts.py:
`RawFrame`): a decode step's small group without protobuf, sent only to a server that said in its
open reply that it takes them, and answered so only to a caller that sent them.

This module speaks the same bytes (hivemind's `P2P.MESSAGE_MARKER` / `ERROR_MARKER`, `HEADER_LEN`-byte
big-endian length, the protobuf; `END_OF_STREAM` ends the input) over hivemind's public binary-stream
API (`P2P.call_binary_stream_handler`, `P2P.add_binary_stream_handler`), with each message written
in one write and read with two reads, inline in the caller's coroutine. Either side interoperates
with hivemind's own (a hivemind stub can call a handler served here and the other way round:
tests/test_framed_stream.py), so nothing of hivemind is patched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from petals_chain.wire.parts import RawFrame

logger = logging.getLogger(__name__)

_HEADER_BYTES = 1 + P2P.HEADER_LEN  # marker + length
_END_FRAME = (
    P2P.ERROR_MARKER
    + len(P2P.END_OF_STREAM.SerializeToString()).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER)
    + P2P.END_OF_STREAM.SerializeToString()
)
RAW_MARKER = b"\x02"  # ours, beside hivemind's MESSAGE_MARKER (0) and ERROR_MARKER (1): a RawFrame's body
CLOSE_WAIT_S = 5.0  # an ended stream's socket is dropped this long after (the server ends it sooner)


def frame(message, marker: bytes = P2P.MESSAGE_MARKER) -> bytes:
    """`message` (a protobuf, or a RawFrame) as one frame of hivemind's stream format."""
    if isinstance(message, RawFrame):
        return RAW_MARKER + len(message.body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + message.body
    body = message.SerializeToString()
    return marker + len(body).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + body


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(marker, body) of the next frame; raises asyncio.IncompleteReadError at the stream's end."""
    header = await reader.readexactly(_HEADER_BYTES)
    return header[:1], await reader.readexactly(int.from_bytes(header[1:], P2P.BYTEORDER))


class FramedStream:
    """The caller's side of one stream: `send` writes a message (one write), `async for`/`anext`
    reads the replies (`StopAsyncIteration` when the server ended the stream; a server-side handler
    failure raises `P2PHandlerError`, as hivemind's stub does). Used from one event loop."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        name: str,
        response_type=runtime_pb2.ExpertResponse,
    ):
        self._reader, self._writer = reader, writer
        self.name = name
        self.response_type = response_type
        self._ended = False

    @classmethod
    async def open(cls, p2p: P2P, peer_id: str, name: str) -> FramedStream:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
        return cls(reader, writer, name)

    async def send(self, *messages) -> None:
        """Write `messages`, each in one write (a step's single message: one write in all), waiting
        only while the socket's buffer is over its high-water mark (a large prompt's parts).

        A small message never waits here, and that matters: when the server has closed the stream,
        the failed write makes asyncio set an error on our reader on its next iteration, and from then
        the reader raises that error instead of returning what the server sent before it closed (its
        idle-timeout reply, which makes the client reopen instead of failing the server over). Not
        yielding here lets the caller read that reply first, as it could with hivemind's stubs."""
        transport = self._writer.transport
        for message in messages:
            self._writer.write(frame(message))
            if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
                await self._writer.drain()

    def send_nowait(self, *messages) -> bool:
        """Write `messages` now if the socket's buffer is below its high-water mark (then True);
        False, writing nothing, when it is over it (use `send`, which waits) or the stream is closing."""
        transport = self._writer.transport
        if transport.is_closing() or transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
            return False
        for message in messages:
            self._writer.write(frame(message))
        return True

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            marker, body = await read_frame(self._reader)
        except asyncio.IncompleteReadError:  # the server closed the stream
            raise StopAsyncIteration from None
        if marker == P2P.MESSAGE_MARKER:
            return self.response_type.FromString(body)
        if marker == RAW_MARKER:
            return RawFrame(body)
        if marker == P2P.ERROR_MARKER:
            raise P2PHandlerError(f"Failed to call handler `{self.name}`: {RPCError.FromString(body).message}")
        raise ConnectionError(f"stream {self.name}: invalid frame marker {marker!r}")

    def end(self) -> None:
        """End the input (the server's request iterator stops, and the server ends the stream); the
        socket is dropped CLOSE_WAIT_S later (whoever reads meanwhile sees the server's end).
        Idempotent, never raises."""
        if self._ended:
            return
        self._ended = True
        try:
            self._writer.write(_END_FRAME)
            asyncio.get_running_loop().call_later(CLOSE_WAIT_S, self._writer.close)
        except Exception:  # the socket is gone already, or no loop runs here (shutdown)
            self._writer.close()

    def abort(self) -> None:
        """Drop the stream at once (a failed open)."""
        self._ended = True
        self._writer.close()


Handler = Callable[[AsyncIterator, P2PContext], AsyncIterator]


async def serve_framed(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    context: P2PContext,
    handler: Handler,
    request_type=runtime_pb2.ExpertRequest,
) -> None:
    """Run `handler(requests, context)` on one stream: the requests read in the handler's own coroutine
    (no reader task or queue per stream), each response written in one write; the socket is closed at
    the end. Used by the p2p handlers below and by the direct streams (petals_chain/transport/direct_stream.py)."""
    name = context.handle_name

    async def requests():
        while True:
            try:
                marker, body = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):  # the caller went away
                return
            if marker == RAW_MARKER:
                yield RawFrame(body)
                continue
            if marker != P2P.MESSAGE_MARKER:  # END_OF_STREAM (hivemind's stubs and ours end so)
                return
            yield request_type.FromString(body)

    try:
        responses = handler(requests(), context)
        try:
            async for response in responses:
                writer.write(frame(response))
                await writer.drain()
        except (ConnectionError, BrokenPipeError):  # the caller is gone: nothing to tell it
            logger.debug("stream %s: the caller went away", name)
        except Exception as e:  # as hivemind does: the caller gets the error, the server goes on
            logger.warning("stream handler %s failed", name, exc_info=True)
            try:
                writer.write(frame(RPCError(message=str(e)), P2P.ERROR_MARKER))
                await writer.drain()
            except Exception:
                pass
        finally:
            await responses.aclose()
    finally:
        writer.close()


async def add_framed_handler(p2p: P2P, name: str, handler: Handler, request_type=runtime_pb2.ExpertRequest) -> None:
    """Serve `handler(requests, context)` (an async generator of responses, as hivemind's stream
    handlers are) under `name` on the p2p daemon, through `serve_framed`."""

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        await serve_framed(reader, writer, context, handler, request_type)

    await p2p.add_binary_stream_handler(name, handle)
