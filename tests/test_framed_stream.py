"""petals_chain/transport/framed_stream.py: the per-step streams speak hivemind's stream bytes with one write
per message, so they interoperate with hivemind's own stubs and handlers both ways (two real p2p
daemons on 127.0.0.1), end cleanly, and carry a handler's failure as hivemind does."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import runtime_pb2

from petals_chain.transport.framed_stream import (
    FramedStream,
    add_framed_handler,
    read_frame,
)

pytestmark = [pytest.mark.integration]


def request(i: int) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(metadata=str(i).encode(), tensors=[runtime_pb2.Tensor(buffer=bytes(2304))])


async def echo(requests, context):
    """Answers each request with its metadata; a request "fail" makes the handler raise."""
    async for r in requests:
        if r.metadata == b"fail":
            raise ValueError("the handler failed on purpose")
        yield runtime_pb2.ExpertResponse(metadata=r.metadata, tensors=r.tensors)
    yield runtime_pb2.ExpertResponse(metadata=b"ended")  # the caller's end of input reached the handler


def run_with_two_peers(body):
    async def main():
        server = await P2P.create()
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        try:
            return await asyncio.wait_for(body(server, client), 60)
        finally:
            await client.shutdown()
            await server.shutdown()

    return asyncio.run(main())


def test_framed_streams_interoperate_with_hivemind_both_ways_and_end_cleanly():
    async def body(server: P2P, client: P2P):
        await add_framed_handler(server, "framed", echo)
        await server.add_protobuf_handler(
            "hivemind", echo, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True
        )
        # hivemind's stub -> a framed handler
        queue: asyncio.Queue = asyncio.Queue()

        async def until_none():
            while (item := await queue.get()) is not None:
                yield item

        replies = await client.iterate_protobuf_handler(
            server.peer_id, "framed", until_none(), runtime_pb2.ExpertResponse
        )
        for i in range(3):
            await queue.put(request(i))
            reply = await anext(replies)
            assert reply.metadata == str(i).encode() and reply.tensors[0].buffer == bytes(2304)
        await queue.put(None)
        assert (await anext(replies)).metadata == b"ended"
        # a framed caller -> hivemind's handler and -> a framed handler: the same conversation
        for name in ("hivemind", "framed"):
            stream = await FramedStream.open(client, str(server.peer_id), name)
            for i in range(3):
                await stream.send(request(i))
                assert (await anext(stream)).metadata == str(i).encode()
            stream.end()
            assert (await anext(stream)).metadata == b"ended"
            with pytest.raises(StopAsyncIteration):  # the server ended the stream
                await anext(stream)
            # a handler's failure reaches the caller as hivemind's stubs report it
            stream = await FramedStream.open(client, str(server.peer_id), name)
            await stream.send(runtime_pb2.ExpertRequest(metadata=b"fail"))
            with pytest.raises(P2PHandlerError, match="failed on purpose"):
                await anext(stream)
            stream.abort()

    run_with_two_peers(body)


class RecordingWriter:
    def __init__(self):
        self.writes: list[bytes] = []
        self.transport = self

    def get_write_buffer_size(self) -> int:
        return 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16384, 65536

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def drain(self) -> None:
        pass


def test_each_message_is_one_write_in_hivemind_framing():
    async def body():
        writer = RecordingWriter()
        stream = FramedStream(asyncio.StreamReader(), writer, "x")
        await stream.send(request(1), request(2))
        assert len(writer.writes) == 2  # not marker, length and body apart (hivemind's three writes)
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(writer.writes))
        for i in (1, 2):
            marker, body_bytes = await read_frame(reader)
            assert marker == P2P.MESSAGE_MARKER and runtime_pb2.ExpertRequest.FromString(body_bytes) == request(i)

    asyncio.run(body())
