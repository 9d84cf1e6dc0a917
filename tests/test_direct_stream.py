"""Direct TCP streams (petals_chain/transport/direct_stream.py): a ticket binds a connection to the peer id it was
issued to; anything else (no ticket, a wrong one, garbage, an oversized or missing hello, an unknown
stream) is refused with a typed error or closed, and the listener goes on serving; the dialer falls back
to p2p and keeps doing so for a while. Over a real swarm: exact tokens with both relays over direct
streams, pushes between servers go direct, and a SIGKILLed hop fails over with identical output."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from petals_chain.errors import DirectRefusedError
from petals_chain.transport import direct_stream
from petals_chain.transport.direct_stream import (
    DirectDialer,
    DirectListener,
    offered_hosts,
)
from petals_chain.transport.framed_stream import frame, read_frame
from petals_chain.wire import codec as wire
from petals_chain.wire.messages import DirectHello, DirectOffer

PEER = "QmNXgtEeWZ2VmJiDu8GHUg19hBAF9gwQcUTUvDXwx4P6g5"  # a well-formed peer id (the caller's)
ME = "QmP9pyB1tm7rzJtDZ6xQBdh9vkcKZ5v9bUxSooUnVf1ALE"
STREAM = "test_stream"


class FakeP2P:
    peer_id = PeerID.from_base58(ME)


async def echo(requests, context):
    """Replies with the caller's peer id and each request's metadata, as the handlers see them."""
    async for request in requests:
        yield runtime_pb2.ExpertResponse(metadata=str(context.remote_id).encode() + b"|" + request.metadata)


class Recorder:
    def __init__(self):
        self.p2p_opens = []

    async def open_p2p(self, peer_id, name):
        self.p2p_opens.append((peer_id, name))
        return "p2p-stream"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def dialer_with_offer(offer_of, **kwargs) -> DirectDialer:
    """A dialer that has asked for its offer already: its first stream to ME went over p2p meanwhile."""
    rec = kwargs.pop("recorder", Recorder())
    dialer = DirectDialer(FakeP2P(), ask_offer=lambda p: asyncio.sleep(0, offer_of()), open_p2p=rec.open_p2p, **kwargs)
    assert await dialer.open(ME, STREAM) == "p2p-stream"  # the first stream: p2p while the offer is asked for
    await dialer.asked()
    return dialer


async def assert_serves_a_good_caller(listener: DirectListener) -> None:
    dialer = await dialer_with_offer(lambda: listener.offer(PEER))
    stream = await dialer.open(ME, STREAM)
    await stream.send(runtime_pb2.ExpertRequest(metadata=b"ok"))
    assert (await anext(stream)).metadata == f"{PEER}|ok".encode()
    stream.abort()


async def started_listener():
    listener = DirectListener(FakeP2P(), ["127.0.0.1"], bind_host="127.0.0.1")
    await listener.start({STREAM: (echo, runtime_pb2.ExpertRequest)})
    return listener


def test_a_ticket_binds_the_stream_to_the_peer_it_was_issued_to():
    async def main():
        listener = await started_listener()
        try:
            offer = listener.offer(PEER)
            assert listener.offer(PEER) == offer and listener.offer(ME).ticket != offer.ticket
            rec = Recorder()
            dialer = await dialer_with_offer(lambda: offer, recorder=rec)
            stream = await dialer.open(ME, STREAM)
            await stream.send(runtime_pb2.ExpertRequest(metadata=b"one"), runtime_pb2.ExpertRequest(metadata=b"two"))
            assert (await anext(stream)).metadata == f"{PEER}|one".encode()
            assert (await anext(stream)).metadata == f"{PEER}|two".encode()
            stream.end()
            with pytest.raises(StopAsyncIteration):
                await anext(stream)  # the server ended the stream after END_OF_STREAM
            assert dialer.direct_opened == 1 and rec.p2p_opens == [(ME, STREAM)]  # only the first
        finally:
            await listener.close()

    run(main())


def test_a_wrong_ticket_is_refused_and_the_dialer_falls_back_to_p2p_for_a_while():
    async def main():
        listener = await started_listener()
        try:
            forged = DirectOffer(["127.0.0.1"], listener.port, "00" * 16)
            rec = Recorder()
            now = [0.0]
            asked = []

            async def ask(peer):
                asked.append(peer)
                return forged

            dialer = DirectDialer(FakeP2P(), ask_offer=ask, open_p2p=rec.open_p2p, clock=lambda: now[0])
            assert await dialer.open(ME, STREAM) == "p2p-stream"  # first: p2p while asking
            await dialer.asked()
            assert await dialer.open(ME, STREAM) == "p2p-stream"  # the forged ticket is refused: p2p
            assert listener.refused == 1 and dialer.direct_opened == 0
            now[0] = direct_stream.NO_DIRECT_RETRY_S - 1  # still p2p only: no new ask, no dial
            assert await dialer.open(ME, STREAM) == "p2p-stream"
            await dialer.asked()
            assert asked == [ME] and listener.refused == 1
            now[0] = direct_stream.NO_DIRECT_RETRY_S + 1  # then it asks again
            await dialer.open(ME, STREAM)
            await dialer.asked()
            assert asked == [ME, ME]
            await assert_serves_a_good_caller(listener)  # the listener still serves a real ticket
        finally:
            await listener.close()

    run(main())


def test_a_server_without_an_offer_or_without_the_rpc_is_used_over_p2p():
    async def main():
        rec = Recorder()

        async def no_rpc(peer):
            raise ConnectionError("no handler rpc_direct")

        for ask in (lambda p: asyncio.sleep(0, DirectOffer()), no_rpc):
            dialer = DirectDialer(FakeP2P(), ask_offer=ask, open_p2p=rec.open_p2p)
            for _ in range(2):
                assert await dialer.open(ME, STREAM) == "p2p-stream" and dialer.direct_opened == 0
                await dialer.asked()
        asked = []
        dialer = DirectDialer(FakeP2P(), ask_offer=lambda p: asked.append(p), open_p2p=rec.open_p2p, enabled=False)
        assert await dialer.open(ME, STREAM) == "p2p-stream"
        await dialer.asked()
        assert asked == []  # turned off: not even asked
        # an offered address where nothing listens: refused at once, p2p instead
        closed = DirectOffer(["127.0.0.1"], 1, "aa" * 16)
        dialer = await dialer_with_offer(lambda: closed, recorder=rec)
        assert await dialer.open(ME, STREAM) == "p2p-stream" and dialer.direct_opened == 0
        assert len(rec.p2p_opens) == 7

    run(main())


async def raw_exchange(port: int, data: bytes) -> bytes | None:
    """Send `data` on a fresh connection, then what comes back until the server closes (None: nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        got = await reader.read()
    finally:
        writer.close()
    return got or None


@pytest.mark.parametrize("case", ["garbage", "oversized", "not_a_hello", "unknown_stream", "bad_field", "silent"])
def test_bad_hellos_are_refused_and_the_listener_keeps_serving(case, monkeypatch):
    monkeypatch.setattr(direct_stream, "HELLO_TIMEOUT_S", 0.5)

    async def main():
        listener = await started_listener()
        try:
            ticket = listener.offer(PEER).ticket
            data = {
                "garbage": b"\x00\x01\x02" * 40,
                "oversized": P2P.MESSAGE_MARKER + (10**9).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER),
                "not_a_hello": frame(wire.request({"type": "step", "session_id": "x"})),
                "unknown_stream": frame(wire.request(DirectHello(ticket, "rpc_other"))),
                "bad_field": frame(wire.request({"type": "direct_hello", "ticket": 5, "stream": STREAM})),
                "silent": b"",
            }[case]
            got = await raw_exchange(listener.port, data)
            if got is not None and case != "garbage":  # a typed refusal, then the close
                marker, body = await read_frame(_reader_of(got))
                meta = wire.unpack(runtime_pb2.ExpertResponse.FromString(body).metadata)
                with pytest.raises(DirectRefusedError):
                    wire.raise_if_error(meta)
            assert listener.refused == 1
            await assert_serves_a_good_caller(listener)
        finally:
            await listener.close()

    run(main())


@given(st.binary(max_size=300), st.booleans())
@settings(max_examples=40, deadline=None)
def test_any_bytes_before_the_hello_leave_the_listener_serving(data, framed):
    """Random bytes (raw, or as a framed message) are refused or closed; a good caller is served after."""
    direct_stream.HELLO_TIMEOUT_S, saved = 0.3, direct_stream.HELLO_TIMEOUT_S
    try:

        async def main():
            listener = await started_listener()
            try:
                payload = frame(runtime_pb2.ExpertRequest(metadata=data)) if framed else data
                await raw_exchange(listener.port, payload)
                assert listener.refused == 1
                await assert_serves_a_good_caller(listener)
            finally:
                await listener.close()

        run(main())
    finally:
        direct_stream.HELLO_TIMEOUT_S = saved


def _reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_offers_before_start_and_offered_hosts():
    listener = DirectListener(FakeP2P(), ["127.0.0.1"])
    assert listener.offer(PEER) == DirectOffer()  # not listening yet: no offer
    with pytest.raises(ValueError):
        DirectListener(FakeP2P(), [])
    assert offered_hosts([], ["/ip4/0.0.0.0/tcp/0"], ["/ip4/127.0.0.1/tcp/1", "/ip4/10.0.0.5/tcp/1"]) == (
        "0.0.0.0",
        ["10.0.0.5", "127.0.0.1"],
    )
    assert offered_hosts(["/ip4/203.0.113.7/tcp/31337"], ["/ip4/0.0.0.0/tcp/31337"], []) == ("0.0.0.0", ["203.0.113.7"])
    assert offered_hosts([], ["/ip4/127.0.0.1/tcp/0"], []) == ("127.0.0.1", ["127.0.0.1"])
    assert offered_hosts([], ["/ip6/::/tcp/0"], []) == ("0.0.0.0", ["127.0.0.1"])


# -- over a real swarm ---------------------------------------------------------------------------
RANGES = [(0, 2), (2, 4), (4, 6), (2, 4), (2, 4)]  # a chain of three and two spare middle hops (one per SIGKILL case)


@pytest.fixture(scope="module")
def swarm(tiny_llama_path):
    from petals_chain.swarm.local import LocalSwarm

    with LocalSwarm(str(tiny_llama_path), RANGES, server_args=["--num-threads", "1", "--direct-port", "0"]) as s:
        yield s


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def _model(tiny_llama_path, swarm, relay, direct=True):
    from petals_chain.client.model import DistributedModelForCausalLM

    return DistributedModelForCausalLM.from_pretrained(
        str(tiny_llama_path), initial_peers=swarm.initial_peers, step_timeout_s=60.0, relay=relay, direct_streams=direct
    )


def _direct_view(model, peer_id) -> dict:
    return model.backend.server_info(peer_id).extra["direct_streams"]


@pytest.mark.integration
@pytest.mark.parametrize("relay", ["server", "client"])
def test_exact_tokens_over_direct_streams_with_either_relay(swarm, hf, tiny_llama_path, relay):
    model = _model(tiny_llama_path, swarm, relay)
    try:
        ids = torch.tensor([[2, 4, 6, 8, 10]])
        ref = hf.generate(ids, max_new_tokens=10, do_sample=False)
        # the first session opens its streams over p2p while the offers are asked for; so do the servers'
        # first pushes to their next hops
        assert model.generate(ids, max_new_tokens=3, do_sample=False).tolist() == ref[:, : ids.shape[1] + 3].tolist()
        dialer = model.backend.hops.dialer
        first_p2p = dialer.p2p_opened
        model.backend.loop.run(dialer.asked(), timeout_s=10)
        with model.inference_session(max_length=32) as session:
            out = model.generate(ids, max_new_tokens=10, do_sample=False)
            hops = [h.peer_id for h in session.chain.hops]
        assert out.tolist() == ref.tolist()
        assert dialer.direct_opened >= 3 and dialer.p2p_opened == first_p2p, (dialer.direct_opened, dialer.p2p_opened)
        if relay == "server":  # the first two hops pushed to their next hop over direct streams
            for peer in hops[:2]:
                view = _direct_view(model, peer)
                assert view["opened_direct"] >= 1, view
    finally:
        model.backend.shutdown()


@pytest.mark.integration
def test_a_client_that_turns_direct_streams_off_uses_p2p(swarm, hf, tiny_llama_path):
    model = _model(tiny_llama_path, swarm, "client", direct=False)
    try:
        ids = torch.tensor([[3, 5, 7]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        assert out.tolist() == hf.generate(ids, max_new_tokens=6, do_sample=False).tolist()
        dialer = model.backend.hops.dialer
        assert dialer.direct_opened == 0 and dialer.p2p_opened >= 3
    finally:
        model.backend.shutdown()


@pytest.mark.integration
@pytest.mark.parametrize("relay", ["server", "client"])
def test_sigkill_of_a_hop_on_direct_streams_fails_over_with_identical_output(swarm, hf, tiny_llama_path, relay):
    """The dead hop's direct connection resets (or the liveness probe finds it), the span is replaced by
    the spare, and the tokens equal HF's. Each case kills the middle hop in use; the spare takes over."""
    from transformers.generation.streamers import BaseStreamer

    model = _model(tiny_llama_path, swarm, relay)
    model.backend.provider.whole_chain_failover = False
    alive = [sp for sp in swarm.servers if sp.process.poll() is None]
    if sum(1 for sp in alive if (sp.start, sp.end) == (2, 4)) < 2:
        pytest.skip("an earlier case took the spare middle hop")

    class KillMiddle(BaseStreamer):
        def __init__(self, session):
            self.session, self.seen, self.killed = session, -1, None

        def put(self, value):
            self.seen += 1
            if self.seen == 4 and self.killed is None:
                peer = self.session.chain.hops[1].peer_id
                self.killed = next(sp for sp in swarm.servers if sp.peer_id == peer)
                swarm.kill_server(self.killed)

        def end(self):
            pass

    try:
        ids = torch.tensor([[2, 4, 6, 8, 10]])
        ref = hf.generate(ids, max_new_tokens=12, do_sample=False)
        model.generate(ids, max_new_tokens=2, do_sample=False)  # learns the servers' offers
        model.backend.loop.run(model.backend.hops.dialer.asked(), timeout_s=10)
        with model.inference_session(max_length=32) as session:
            killer = KillMiddle(session)
            out = model.generate(ids, max_new_tokens=12, do_sample=False, streamer=killer)
            assert killer.killed is not None and session.chain.failovers == 1
            assert killer.killed.peer_id not in [h.peer_id for h in session.chain.hops]
        assert out.tolist() == ref.tolist()
        # the session's three hops were direct (a replacement never contacted before opens over p2p while
        # its offer is asked for)
        assert model.backend.hops.dialer.direct_opened >= 3
    finally:
        model.backend.shutdown()


@pytest.mark.integration
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "p2p"])
def test_a_server_answers_raw_steps_in_raw_frames_and_refuses_bad_ones_typed(swarm, tiny_llama_path, direct):
    """The open reply offers raw frames; a step sent raw is answered raw with the same output as the
    same step sent in protobuf parts; a malformed raw frame gets a typed error and the stream serves on."""
    import uuid

    from petals_chain.wire import parts as wire_parts
    from petals_chain.wire.messages import Open, Step, StepReply
    from petals_chain.wire.parts import RawFrame

    model = _model(tiny_llama_path, swarm, "client", direct=direct)
    try:
        backend = model.backend
        if direct:  # the first stream to each server goes over p2p while its offer is asked
            backend.loop.run(backend.hops.dialer.asked(), timeout_s=10)
        hop = backend.provider.find_chain(
            0, backend.num_blocks, exclude=frozenset(), max_length=16, session_id="raw-test", adapter=None
        )[0]
        x = torch.randn(3, 64)

        async def one_step(raw: bool, garbage_first: bool = False):
            session_id = uuid.uuid4().hex
            stream = await backend.hops.open_async(hop, Open(session_id, 16, hop.start))
            try:
                assert stream.raw_frames
                errors = []
                if garbage_first:
                    await stream.channel.send(RawFrame(b"\x01\x02"))  # too short for any message
                    errors.append(wire.unpack((await anext(stream.channel)).metadata))
                step = Step(session_id, 1).to_wire()
                await stream.channel.send(
                    wire_parts.encode_raw(step, x) if raw else wire_parts.to_messages(step, (x,))[0]
                )
                return await anext(stream.channel), errors
            finally:
                stream.channel.end()

        raw_reply, _ = backend.loop.run(one_step(True), timeout_s=30)
        pb_reply, _ = backend.loop.run(one_step(False), timeout_s=30)
        assert isinstance(raw_reply, RawFrame) and isinstance(pb_reply, runtime_pb2.ExpertResponse)
        raw_msg = wire_parts.decode_raw(raw_reply)
        (pb_msg,) = wire_parts.Assembler().feed(pb_reply)
        assert StepReply.from_wire(raw_msg.meta).position == StepReply.from_wire(pb_msg.meta).position == 3
        assert torch.equal(raw_msg.tensors[0], pb_msg.tensors[0])
        after_garbage, errors = backend.loop.run(one_step(True, garbage_first=True), timeout_s=30)
        assert errors[0]["type"] == "error" and "raw frame" in errors[0]["message"], errors
        assert torch.equal(wire_parts.decode_raw(after_garbage).tensors[0], raw_msg.tensors[0])
    finally:
        model.backend.shutdown()
