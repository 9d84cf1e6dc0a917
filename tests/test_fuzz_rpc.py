"""Fuzzing a live server and orchestrator: every broken message gets a typed error, nothing dies,
and a well-behaved client's greedy output stays identical to HF (scripts/fuzz_rpc.py: the long run)."""

from __future__ import annotations

import random

import pytest
import torch
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.client.remote import RemoteChain
from petals_chain.models.checkpoint import load_config
from petals_chain.swarm.local import LocalSwarm
from petals_chain.wire import codec as wire
from petals_chain.wire import parts as wire_parts
from tests.fuzz_messages import ORCHESTRATOR_RPCS, SERVER_RPCS, RpcFuzzer, fuzz
from tests.swarm_helpers import get_json, wait_for

PROMPT = torch.tensor([[5, 9, 17, 33]])


@given(
    seed=st.integers(0, 2**32 - 1),
    rpc=st.sampled_from(["open", "step", "close", "forward", "acquire", "release", "heartbeat", "assignment"]),
)
@settings(max_examples=200, deadline=None)
def test_generator_always_yields_sendable_messages(seed, rpc):
    fuzzed = fuzz(rpc, random.Random(seed), hidden=64, session_id="s")
    assert fuzzed.messages and all(m.ByteSize() < 4 * 2**20 for m in fuzzed.messages)


@pytest.fixture(scope="module")
def live(tiny_llama_path):
    config = load_config(tiny_llama_path)
    with LocalSwarm(
        str(tiny_llama_path),
        [None],
        server_args=["--num-threads", "1", "--memory-budget", "100MiB", "--max-length", "64"],
        orchestrator_args=["--expected-servers", "1", "--lease-ttl", "5"],
    ) as swarm:
        wait_for(lambda: get_json(swarm.orchestrator_url + "status")["plan_installed"], 90, "the plan")
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
        reference = hf.generate(PROMPT, max_new_tokens=5, do_sample=False).tolist()
        raw = RemoteChain(str(tiny_llama_path), config, swarm.initial_peers, use_orchestrator=False)
        client = DistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=swarm.initial_peers)
        fuzzer = RpcFuzzer(
            raw,
            swarm.servers[0].peer_id,
            swarm.orchestrator_peer_id,
            config.hidden_size,
            random.Random(0),
            reply_timeout_s=8.0,
        )
        try:
            yield swarm, fuzzer, client, reference
        finally:
            fuzzer.release_grants()
            client.backend.shutdown()
            raw.shutdown()


@pytest.mark.integration
@given(seed=st.integers(0, 2**32 - 1), rpc=st.sampled_from(SERVER_RPCS + ORCHESTRATOR_RPCS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)
def test_fuzzed_messages_get_typed_errors(live, seed, rpc):
    swarm, fuzzer, _, _ = live
    fuzzer.rng.seed(seed)
    outcome = fuzzer.run(rpc)
    assert outcome not in ("untyped_error", "no_reply", "silent"), (
        rpc,
        fuzzer.untyped[-1:],
        fuzzer.last_no_reply,
        dict(fuzzer.by_kind),
    )
    assert fuzzer.outcomes["stream_broken"] == 0, dict(fuzzer.by_kind)


@pytest.mark.integration
def test_after_fuzzing_everything_still_serves(live):
    swarm, fuzzer, client, reference = live
    fuzzer.storm(30)
    fuzzer.release_grants()
    assert all(sp.alive for sp in swarm.servers) and swarm.orchestrator_process.poll() is None
    assert client.generate(PROMPT, max_new_tokens=5, do_sample=False).tolist() == reference


@pytest.mark.integration
def test_a_forward_stream_stays_open_after_its_reply_until_the_caller_ends_it(live):
    """The server waits, after a forward stream's reply, for the caller to end its input: closing at
    once makes the caller's end-of-stream write into a closed stream, and that broken pipe makes its
    reader raise before it reads the reply already buffered (seen under load as lost replies)."""
    import asyncio

    from hivemind.p2p import P2P, PeerID

    from petals_chain.transport.protocol import BlockService

    swarm, fuzzer, _, _ = live
    p2p = fuzzer.chain.p2p

    async def exchange():
        _, reader, writer = await p2p.call_binary_stream_handler(
            PeerID.from_base58(fuzzer.server_peer), BlockService.handle_name("rpc_forward_stream")
        )
        try:
            (request,) = wire_parts.to_messages({"type": "forward"}, (torch.randn(1, 3, 64, dtype=torch.float16),))
            await P2P.send_protobuf(request, writer)
            reply, err = await P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader)
            assert err is None and wire.unpack(reply.metadata)["type"] == "forward"
            # without our end the stream must still be open: no end of it (b"") while we wait
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(1), 2.0)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)  # no broken pipe
            return await asyncio.wait_for(reader.read(1), 10.0)  # and then the server ends it
        finally:
            writer.close()

    assert fuzzer.chain.loop.run(exchange(), timeout_s=20) == b""
