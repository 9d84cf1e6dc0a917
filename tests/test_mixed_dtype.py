"""A mixed-dtype swarm: a session runs through servers of another dtype than its own (each casts a step's
hidden states in and its reply back), prefers servers of its own dtype, keeps its prefix cache entries
apart from other dtypes' sessions, and is spot-checked without false positives across the dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from petals_chain.algorithms.hidden_compare import row_errors, tolerance_for
from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.client.remote import RemoteChain
from petals_chain.client.routing import min_latency_chain
from petals_chain.client.verification import VerificationConfig
from petals_chain.errors import InvalidRequestError
from petals_chain.models.checkpoint import load_config
from petals_chain.runtime.block_range import BlockRange, StepInput
from petals_chain.swarm.local import LocalSwarm
from petals_chain.wire.prefix_keys import prefix_hashes
from petals_chain.wire.records import ServerInfo, ServerState
from server.step_request import StepRequest
from tests.swarm_helpers import ListedChains


def _info(peer: str, dtype: str, decode_s: float = 0.001) -> ServerInfo:
    return ServerInfo(
        peer_id=peer,
        model="m",
        start=0,
        end=4,
        state=ServerState.ONLINE,
        memory_budget_bytes=1 << 30,
        block_bytes=1 << 20,
        kv_bytes_per_block=1 << 16,
        max_length_tokens=512,
        free_kv_slots=4,
        prefill_s_per_token=decode_s,
        decode_s_per_token=decode_s,
        dtype=dtype,
    )


@given(st.floats(0.0001, 0.05), st.floats(0.0001, 0.05))
def test_a_session_prefers_servers_of_its_dtype_and_uses_another_only_without_one(f32_s, bf16_s):
    servers = [_info("f32", "float32", f32_s), _info("bf16", "bfloat16", bf16_s)]
    for dtype, peer in (("float32", "f32"), ("bfloat16", "bf16")):
        assert [h.peer_id for h in min_latency_chain(servers, 0, 4, lambda p: 0.001, dtype=dtype)] == [peer]
        other = "bf16" if peer == "f32" else "f32"
        chain = min_latency_chain(servers, 0, 4, lambda p: 0.001, dtype=dtype, exclude=frozenset({peer}))
        assert [h.peer_id for h in chain] == [other]  # the only server left serves it, casting


def test_prefix_hashes_of_sessions_of_other_dtypes_never_match():
    ids = list(range(64))
    assert prefix_hashes(ids, "m") == prefix_hashes(ids, "m", dtype="float32")
    f32, bf16 = prefix_hashes(ids, "m"), prefix_hashes(ids, "m", dtype="bfloat16")
    assert len(f32) == len(bf16) == 4 and not set(f32) & set(bf16)


def test_a_step_in_another_float_dtype_is_cast_in_and_refused_otherwise(tiny_llama_path):
    block_range = BlockRange(tiny_llama_path, 0, 2, dtype=torch.bfloat16)
    kv = block_range.allocate_kv(16)
    hidden = torch.randn(3, block_range.hidden_size)
    request = StepRequest.checked(block_range, kv, hidden, key="k", client_id="c", start_tokens=0)
    assert request.hidden.dtype == torch.bfloat16 and request.wire_dtype == torch.float32
    assert torch.equal(request.hidden, hidden.to(torch.bfloat16))
    same = StepRequest.checked(block_range, kv, hidden.bfloat16(), key="k", client_id="c", start_tokens=0)
    assert same.wire_dtype is None
    with pytest.raises(InvalidRequestError, match="must be one of"):
        StepRequest.checked(block_range, kv, hidden.double(), key="k", client_id="c", start_tokens=0)
    half = BlockRange(tiny_llama_path, 0, 2, dtype=torch.float16)
    huge = torch.full((1, half.hidden_size), 1e6)
    with pytest.raises(InvalidRequestError, match="overflow this server's float16"):
        StepRequest.checked(half, half.allocate_kv(16), huge, key="k", client_id="c", start_tokens=0)


def _mixed_reference(path, hidden_steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a float32 session through blocks [0, 2) in float32 and [2, 4) in bfloat16 computes."""
    a = BlockRange(path, 0, 2, dtype=torch.float32)
    b = BlockRange(path, 2, 4, dtype=torch.bfloat16)
    kv_a, kv_b = a.allocate_kv(64), b.allocate_kv(64)
    outs = []
    for h in hidden_steps:
        (y,) = a.forward([StepInput(kv_a, h)])
        (z,) = b.forward([StepInput(kv_b, y.to(torch.bfloat16))])
        outs.append(z.float())
    return outs


@pytest.mark.parametrize("relay", ["client", "server"])
def test_a_float32_session_runs_through_a_bfloat16_hop(tiny_llama_path, relay):
    config = load_config(tiny_llama_path)
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(7, config.hidden_size, generator=gen)] + [
        torch.randn(1, config.hidden_size, generator=gen) for _ in range(4)
    ]
    reference = _mixed_reference(tiny_llama_path, steps)
    per_server = [["--dtype", "float32"], ["--dtype", "bfloat16"]]
    with LocalSwarm(
        str(tiny_llama_path), [(0, 2), (2, 4)], server_args=["--num-threads", "1"], per_server_args=per_server
    ) as swarm:
        chain = RemoteChain(
            str(tiny_llama_path),
            config,
            swarm.initial_peers,
            dtype=torch.float32,
            use_orchestrator=False,
            relay=relay,
            provider=ListedChains([sp.peer_id for sp in swarm.servers], config.num_hidden_layers),
        )
        try:
            session = chain.open_session(64)
            try:
                outs = [session.step(h) for h in steps]
            finally:
                session.close()
            forward = chain.forward(steps[0].unsqueeze(0))[0]
        finally:
            chain.shutdown()
    bound = tolerance_for(torch.bfloat16)
    for out, ref in zip(outs, reference):
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert float(row_errors(out, ref).max()) <= bound
    assert forward.dtype == torch.float32 and float(row_errors(forward, reference[0]).max()) <= bound


@pytest.fixture(scope="module")
def mixed_smollm2_swarm(smollm2_path):
    """SmolLM2 servers with all 30 blocks: one bfloat16, two float32 (peer ids by name)."""
    dtypes = ["bfloat16", "float32", "float32"]
    with LocalSwarm(
        str(smollm2_path),
        [(0, 30)] * 3,
        server_args=["--num-threads", "1"],
        per_server_args=[["--dtype", d] for d in dtypes],
    ) as swarm:
        peers = {"bf16": swarm.servers[0].peer_id, "f32": swarm.servers[1].peer_id, "f32b": swarm.servers[2].peer_id}
        yield swarm, peers


@pytest.mark.parametrize(
    ("session_dtype", "hop", "checker"),
    [("float32", "bf16", "f32"), ("bfloat16", "f32", "f32b")],
    ids=["float32-session-bfloat16-hop", "bfloat16-session-float32-hop-float32-checker"],
)
def test_spot_checks_of_a_hop_of_another_dtype_find_no_fault(
    mixed_smollm2_swarm, smollm2_path, smollm2_tokenizer, session_dtype, hop, checker
):
    """A session served by a server of another dtype, every step checked: each comparison is judged by
    the dtypes of both sides (the hop's, the session's that its reply comes back in, the checker's), not
    by one dtype's exact bound, so an honest swarm gives no mismatch."""
    swarm, peers = mixed_smollm2_swarm
    prompt = smollm2_tokenizer("The three primary colors are", return_tensors="pt").input_ids
    outputs, stats = [], None
    for check_probability in (0.0, 1.0):
        model = DistributedModelForCausalLM.from_pretrained(
            str(smollm2_path),
            initial_peers=swarm.initial_peers,
            provider=ListedChains([peers[hop], peers[checker]], 30),
            allowed_servers=[peers[hop], peers[checker]],
            prefix_reuse=False,
            dtype=session_dtype,
            verification=VerificationConfig(check_probability=check_probability, seed=3),
        )
        try:
            with model.inference_session(max_length=prompt.shape[1] + 12) as session:
                outputs.append(model.generate(prompt, max_new_tokens=12, do_sample=False).tolist())
                assert [h.peer_id for h in session.chain.hops] == [peers[hop]]
            stats = model.backend.verification.stats
        finally:
            model.backend.shutdown()
    assert stats.audits >= 1 and stats.rows_verified >= prompt.shape[1]
    assert stats.mismatches == 0 and not stats.catches
    assert outputs[0] == outputs[1]  # the audits changed nothing
