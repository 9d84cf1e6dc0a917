"""`HopClient.receive_while_alive`, the one wait for every reply of a hop (open, step, forward),
driven without a network: a stream that stays silent while the server's liveness probes are
refused fails as the server's `ServerUnavailableError` ("went silent"), not at the open timeout; a
slow server that answers its probes keeps the request until its reply comes."""

from __future__ import annotations

import asyncio

import pytest

from petals_chain.client import hop_client
from petals_chain.client.hop_client import LIVENESS_PROBES, HopClient
from petals_chain.errors import ServerUnavailableError
from petals_chain.wire.messages import Hop, Open

HOP = Hop("QmPeer", 0, 6)


class SilentChannel:
    """A server stream that opens and never answers, like a stream the client's p2p daemon opened on
    a connection to a server SIGKILLed a moment before (nothing resets it)."""

    async def send(self, *messages):
        pass

    async def __anext__(self):
        await asyncio.Event().wait()  # forever

    def abort(self):
        pass


async def silent_channel(dial_hangs: bool) -> SilentChannel:
    """With `dial_hangs` the opening itself never returns (a dial to a dead peer that hangs)."""
    if dial_hangs:
        await asyncio.Event().wait()  # forever
    return SilentChannel()


@pytest.fixture
def fast_liveness(monkeypatch):
    monkeypatch.setattr(hop_client, "LIVENESS_FLOOR_S", 0.05)


@pytest.mark.parametrize("dial_hangs", [False, True], ids=["silent-stream", "hanging-dial"])
def test_an_open_on_a_silent_stream_to_a_dead_server_fails_over_by_its_refused_probes(fast_liveness, dial_hangs):
    hops = HopClient(loop=None, p2p=None, open_timeout_s=600.0)  # the timeout is never what ends it
    probes: list[str] = []

    async def refused(peer_id, timeout_s):
        probes.append(peer_id)
        return "ControlFailure: dial tcp4 127.0.0.1:1: connect: connection refused"

    hops.open_channel = lambda peer_id: silent_channel(dial_hangs)
    hops.probe_error = refused
    with pytest.raises(ServerUnavailableError, match="went silent: no reply to the open.*connection refused"):
        asyncio.run(hops.open_async(HOP, Open("s", 16)))
    assert probes == [HOP.peer_id] * LIVENESS_PROBES


def test_a_slow_server_that_answers_its_probes_keeps_its_request(fast_liveness):
    hops = HopClient(loop=None, p2p=None, open_timeout_s=600.0)

    async def run() -> str:
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        probes = 0

        async def answered(peer_id, timeout_s):
            nonlocal probes
            probes += 1
            if probes == 2 * LIVENESS_PROBES:  # more probes than a dead server gets: the reply comes
                reply.set_result("the reply")
            return None

        hops.probe_error = answered
        return await hops.receive_while_alive(HOP, reply, 0.01, 600.0, "the step")

    assert asyncio.run(run()) == "the reply"


def test_a_reply_wait_ends_at_its_timeout_even_while_the_server_answers_its_probes(fast_liveness):
    """The wait's one timer: the watcher that probes a late reply also ends the wait at the timeout."""
    hops = HopClient(loop=None, p2p=None)

    async def run() -> float:
        loop = asyncio.get_running_loop()
        never: asyncio.Future = loop.create_future()

        async def answered(peer_id, timeout_s):
            return None

        hops.probe_error = answered
        t0 = loop.time()
        with pytest.raises(TimeoutError, match="no reply to the step .* within 0.3 s"):
            await hops.receive_while_alive(HOP, never, 0.05, 0.3, "the step")
        assert asyncio.current_task().cancelling() == 0  # the watcher's cancel did not leak out
        return loop.time() - t0

    assert asyncio.run(run()) >= 0.3  # ended by its timeout, not before


class PushedHopChannel:
    """A hop's stream whose server runs a pushed step: its reply comes after `reply_after_s` whether
    or not the client's copy arrived, or (`push_lost`) only after the copy did."""

    def __init__(self, reply, reply_after_s: float, push_lost: bool = False):
        self.reply, self.reply_after_s, self.push_lost = reply, reply_after_s, push_lost
        self.sent: list = []
        self._copy = asyncio.Event()

    async def send(self, *messages):
        self.send_nowait(*messages)

    def send_nowait(self, *messages):
        self.sent.extend(messages)
        self._copy.set()
        return True

    async def __anext__(self):
        if self.push_lost:
            await self._copy.wait()
        await asyncio.sleep(self.reply_after_s)
        return self.reply


def _step_reply():
    import torch

    from petals_chain.wire import parts as wire_parts
    from petals_chain.wire.messages import StepReply

    return wire_parts.encode_raw(StepReply("s", 1, 2, 0.001, 0.001).to_wire(), torch.zeros(1, 4))


def _stream(channel):
    from petals_chain.client.hop_client import HopStream

    return HopStream(HOP, channel, raw_frames=True)


@pytest.mark.parametrize("push_lost", [False, True], ids=["push-arrives", "push-lost"])
def test_a_held_back_copy_goes_out_only_when_the_pushed_reply_is_late(push_lost):
    """Server relay: a pushed hop's reply usually comes without the client's copy, which then is never
    sent; when the push is lost the copy goes out after `copy_after_s` and the step still completes."""
    import torch

    from petals_chain.wire.messages import Step

    hops = HopClient(loop=None, p2p=None)
    channel = PushedHopChannel(_step_reply(), reply_after_s=0.01, push_lost=push_lost)
    result = asyncio.run(hops.step_async(_stream(channel), Step("s", 1), torch.zeros(1, 4), copy_after_s=0.2))
    assert result.output.shape == (1, 4) and result.reply.step_id == 1
    assert result.copy_sent_late is push_lost
    assert len(channel.sent) == (1 if push_lost else 0)


def test_a_step_without_a_hold_and_one_too_large_for_a_raw_frame_go_at_once():
    import torch

    from petals_chain.wire import parts as wire_parts
    from petals_chain.wire.messages import Step

    hops = HopClient(loop=None, p2p=None)
    channel = PushedHopChannel(_step_reply(), reply_after_s=0.0)
    result = asyncio.run(hops.step_async(_stream(channel), Step("s", 1), torch.zeros(1, 4)))
    assert len(channel.sent) == 1 and not result.copy_sent_late
    big = torch.zeros(wire_parts.MAX_PART_BYTES // 4 + 1, 1)  # over one frame: protobuf parts, never held
    channel = PushedHopChannel(_step_reply(), reply_after_s=0.0)
    asyncio.run(hops.step_async(_stream(channel), Step("s", 2), big, copy_after_s=10.0))
    assert len(channel.sent) >= 2
