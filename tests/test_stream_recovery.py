"""Streams that end early or go idle: the client gets the reply or a typed error, and recovers.

- a forward stream whose input ends mid-request gets a typed error reply (it used to end in silence,
  which the caller saw as `StopAsyncIteration`);
- a stateless forward whose server is dead runs again on another chain (typed errors only);
- a session whose server dies, and whose first replacement is dead too, fails over twice and goes on
  (with either relay);
- a multi-turn session left idle past the servers' `--session-idle-timeout` reopens its streams on
  the same servers and replays its history: the next turn equals HF, nobody is banned.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.client.peer_health import PeerHealth
from petals_chain.errors import InvalidRequestError, error_from_code
from petals_chain.swarm.local import LocalSwarm
from petals_chain.wire import parts as wire_parts
from tests.swarm_helpers import ListedChains, wait_for

pytestmark = [pytest.mark.integration]

IDLE_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def swarm(tiny_llama_path):
    with LocalSwarm(
        str(tiny_llama_path),
        [(0, 6)] * 7,
        server_args=["--num-threads", "1", "--session-idle-timeout", str(IDLE_TIMEOUT_S)],
    ) as s:
        yield s


@pytest.fixture(scope="module")
def clients(swarm, tiny_llama_path):
    """`clients(relay)`: this module's client with that relay ("server" or "client"), made on first use."""
    made: dict[str, DistributedModelForCausalLM] = {}

    def get(relay: str) -> DistributedModelForCausalLM:
        if relay not in made:
            # bans that outlast the module: a server seen failing stays out of every later chain of
            # that client however slowly a loaded machine runs the tests
            made[relay] = DistributedModelForCausalLM.from_pretrained(
                str(tiny_llama_path),
                initial_peers=swarm.initial_peers,
                step_timeout_s=60.0,
                relay=relay,
                peer_health=PeerHealth(base_ban_s=3600.0, max_ban_s=3600.0),
            )
        return made[relay]

    try:
        yield get
    finally:
        for model in made.values():
            model.backend.shutdown()


@pytest.fixture(scope="module")
def client(clients):
    return clients("server")


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def test_forward_stream_cut_mid_request_gets_a_typed_error(swarm, client):
    chain = client.backend
    hidden = torch.randn(1, 40, client.config.hidden_size)
    messages = wire_parts.to_messages({"type": "forward"}, (hidden,), part_bytes=2048)
    assert len(messages) > 2

    async def cut_stream():
        async def outgoing():
            for m in messages[:-1]:  # the last part never comes; the stream ends (half-closed) instead
                yield m

        replies = await chain.stub(swarm.servers[0].peer_id).rpc_forward_stream(outgoing())
        try:
            return await asyncio.wait_for(wire_parts.receive_one(replies), 20)
        finally:
            await replies.aclose()

    reply = chain.loop.run(cut_stream(), timeout_s=25)
    assert reply.meta.get("type") == "error"
    error = error_from_code(reply.meta["code"], reply.meta["message"])
    assert isinstance(error, InvalidRequestError) and "ended before a whole request" in str(error)
    # the server keeps serving whole requests
    assert chain.forward(hidden).shape == hidden.shape


def test_idle_session_reopens_and_replays_after_the_servers_idle_timeout(swarm, client, hf):
    chain = client.backend
    first, second = [5, 17, 33, 9], [44, 2]
    with client.inference_session(max_length=64) as session:
        out1 = client.generate(torch.tensor([first]), max_new_tokens=5, do_sample=False)
        peers = [h.peer_id for h in session.chain.hops]
        # the servers close the silent session after IDLE_TIMEOUT_S: wait until they have (polling)
        wait_for(
            lambda: all(chain.server_info(p).active_sessions == 0 for p in peers),
            30 + IDLE_TIMEOUT_S,
            "the servers to close the idle session",
        )
        out2 = client.generate(torch.tensor([second]), max_new_tokens=5, do_sample=False)
        assert session.chain.reopens == len(peers) and session.chain.failovers == 0
        assert not session.chain.failed_peers and [h.peer_id for h in session.chain.hops] == peers
    ref1 = hf.generate(torch.tensor([first]), max_new_tokens=5, do_sample=False)
    ref2 = hf.generate(torch.tensor([ref1[0].tolist() + second]), max_new_tokens=5, do_sample=False)
    assert out1.tolist() == ref1.tolist()
    assert out2.tolist() == ref2.tolist()


def test_idle_reopen_after_prefix_reuse_replays_the_prefix(swarm, client, hf):
    """A hop that took the prompt's prefix from its cache and is then reopened after the idle
    timeout never received those tokens: the client replays the prefix's input ahead of its history."""
    chain = client.backend
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(5))  # 2 full chunks of 16
    for _ in range(len(swarm.servers) + 1):  # each session teaches the server it used; one soon reuses
        with client.inference_session(max_length=64, prompt_ids=ids[0]) as session:
            out1 = client.generate(ids, max_new_tokens=3, do_sample=False)
            if session.chain.prefix_tokens == 0:
                continue
            peers = [h.peer_id for h in session.chain.hops]
            wait_for(
                lambda: all(chain.server_info(p).active_sessions == 0 for p in peers),
                30 + IDLE_TIMEOUT_S,
                "the servers to close the idle session",
            )
            out2 = client.generate(torch.tensor([[7, 8]]), max_new_tokens=3, do_sample=False)
            assert session.chain.reopens == len(peers) and session.chain.failovers == 0
            break
    else:
        raise AssertionError("no session reused the cached prefix")
    ref1 = hf.generate(ids, max_new_tokens=3, do_sample=False)
    ref2 = hf.generate(torch.tensor([ref1[0].tolist() + [7, 8]]), max_new_tokens=3, do_sample=False)
    assert out1.tolist() == ref1.tolist() and out2.tolist() == ref2.tolist()


def test_stateless_forward_fails_over_from_a_dead_server(swarm, client):
    chain = client.backend
    hidden = torch.randn(1, 12, client.config.hidden_size)
    dead, alive = swarm.servers[4], swarm.servers[3]
    expected = chain.forward(hidden)
    swarm.kill_server(dead)
    provider = ListedChains([dead.peer_id, alive.peer_id], chain.num_blocks)
    previous, chain.provider = chain.provider, provider
    try:
        out = chain.forward(hidden)  # the dead server first: a typed failure, then the other one
    finally:
        chain.provider = previous
    assert provider.excludes == [frozenset(), frozenset({dead.peer_id})]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("relay", ["server", "client"])
def test_a_dead_replacement_is_failed_over_too(swarm, clients, hf, caplog, relay):
    """The server of a session dies, and so does the first replacement its provider offers (a record
    that outlives its server): the session fails over again instead of failing; a new session of the
    same client is not offered the dead servers at all (the client's peer-health list bans them for
    every session) and opens on the live one, with either relay. Death is noticed from the closed
    stream, the refused dial or the refused liveness probes (a stream opened to a server killed a
    moment before is never reset: tests/test_hop_client.py), never by waiting for a timeout."""
    client = clients(relay)
    chain = client.backend
    # each relay's case kills its own two servers; the live third is shared
    first, second = (swarm.servers[0], swarm.servers[1]) if relay == "server" else (swarm.servers[5], swarm.servers[6])
    third = swarm.servers[2]
    provider = ListedChains([first.peer_id, second.peer_id, third.peer_id], chain.num_blocks)
    previous, chain.provider = chain.provider, provider
    prompt = [7, 21, 3, 60, 12]
    try:
        with client.inference_session(max_length=32) as session:
            out1 = client.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
            assert [h.peer_id for h in session.chain.hops] == [first.peer_id]
            swarm.kill_server(first)
            swarm.kill_server(second)
            out2 = client.generate(torch.tensor([[9]]), max_new_tokens=3, do_sample=False)
            assert session.chain.failovers == 2 and session.chain.failed_peers == {first.peer_id, second.peer_id}
            assert [h.peer_id for h in session.chain.hops] == [third.peer_id]
        asked_before = len(provider.excludes)
        with client.inference_session(max_length=32) as fresh:
            out3 = client.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
            assert fresh.chain.failovers == 0 and [h.peer_id for h in fresh.chain.hops] == [third.peer_id]
        assert provider.excludes[asked_before] >= {first.peer_id, second.peer_id}  # excluded at the fresh open
    finally:
        chain.provider = previous
    ref1 = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
    ref2 = hf.generate(torch.tensor([ref1[0].tolist() + [9]]), max_new_tokens=3, do_sample=False)
    assert out1.tolist() == ref1.tolist() and out2.tolist() == ref2.tolist() and out3.tolist() == ref1.tolist()
    reasons = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(reasons) >= 2 and not any("no reply within" in r for r in reasons), reasons


def test_a_silent_server_is_failed_over_by_the_liveness_probe(swarm, client, hf, caplog):
    """A server that goes silent without closing anything (its processes stopped: a host cut off the
    network or frozen, where no stream is reset) is noticed by the client's liveness probe, long
    before the step timeout (60 s for this client): the step fails over and the text equals HF."""
    import psutil

    chain = client.backend
    silent, spares = swarm.servers[3], [swarm.servers[4].peer_id, swarm.servers[2].peer_id]
    provider = ListedChains([silent.peer_id, *spares], chain.num_blocks)  # two spares: an open may time out under load
    previous, chain.provider = chain.provider, provider
    prompt = [5, 17, 40, 2, 88]
    frozen: list[psutil.Process] = []
    try:
        with client.inference_session(max_length=32) as session:
            out1 = client.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
            assert [h.peer_id for h in session.chain.hops] == [silent.peer_id]
            root = psutil.Process(silent.process.pid)
            frozen = [root, *root.children(recursive=True)]  # the server, its DHT child and p2pd
            for p in frozen:
                p.suspend()
            out2 = client.generate(torch.tensor([[9]]), max_new_tokens=3, do_sample=False)
            assert silent.peer_id in session.chain.failed_peers and session.chain.hops[0].peer_id in spares
    finally:
        chain.provider = previous
        for p in frozen:
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass
    ref1 = hf.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
    ref2 = hf.generate(torch.tensor([ref1[0].tolist() + [9]]), max_new_tokens=3, do_sample=False)
    assert out1.tolist() == ref1.tolist() and out2.tolist() == ref2.tolist()
    reasons = [r.getMessage() for r in caplog.records if "replacing blocks" in r.getMessage()]
    silent_name = f"{silent.peer_id[-6:]}[0:6)"
    assert f"server {silent_name} failed (server {silent_name} went silent" in reasons[0], reasons
    # no wait ran to a timeout: a dead spare offered next (servers[4], killed by the forward test, unless
    # this client's ban list already excludes it) is failed over by its probes too, even when the dial
    # to it hangs (it did, for the whole open timeout, while the silent server was frozen)
    assert not any("no reply within" in r for r in reasons), reasons
