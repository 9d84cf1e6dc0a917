"""Hidden states larger than hivemind's 4 MiB message limit cross a live swarm (issue 15).

SmolLM2 at 2,048 tokens in float32 is a 4.5 MiB hidden state; a 7B model's 4,096-token prefill in
bfloat16 is 32 MiB, covered by a one-block test model of hidden size 4,096 whose block is the
identity (its output projections are zero), so the reply must equal the request bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.client.remote import RemoteChain
from petals_chain.errors import RequestTooLargeError
from petals_chain.models.checkpoint import load_config
from petals_chain.swarm.local import LocalSwarm
from petals_chain.wire.parts import MAX_PART_BYTES

pytestmark = [pytest.mark.integration]

SMOL_ARGS = ["--num-threads", "1", "--memory-budget", "300MiB", "--max-length", "4096"]
PROMPT_TOKENS = 2048


@pytest.fixture(scope="module")
def smol_client(smollm2_path):
    with LocalSwarm("smollm2-135m", [(0, 10), (10, 20), (20, 30)], server_args=SMOL_ARGS) as swarm:
        model = DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=swarm.initial_peers)
        try:
            yield swarm, model
        finally:
            model.backend.shutdown()


def _long_prompt(tokenizer) -> torch.Tensor:
    text = " ".join(
        f"Paragraph {i}: the lighthouse keeper counted {i * 7} ships passing in the fog." for i in range(400)
    )
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    assert ids.shape[1] == PROMPT_TOKENS
    return ids


@pytest.mark.model
def test_2048_token_forward_and_prefill_cross_the_chain(smol_client, smollm2_tokenizer):
    _, client = smol_client
    hidden = client.head.embed_tokens(_long_prompt(smollm2_tokenizer)[0])
    assert hidden.dtype == torch.float32 and hidden.numel() * 4 > 4 * 2**20  # above hivemind's unary limit
    stateless = client.backend.forward(hidden.unsqueeze(0))[0]  # over rpc_forward_stream, in parts
    with client.inference_session(max_length=PROMPT_TOKENS) as session:
        prefill = session.chain.step(hidden)  # one inference step of 2,048 tokens, in parts both ways
    assert stateless.shape == prefill.shape == (PROMPT_TOKENS, 576)
    # two RPCs, two batching paths on the servers: the same numbers up to summation order
    torch.testing.assert_close(stateless, prefill, atol=1e-5, rtol=0)


@pytest.mark.model
def test_2048_token_prompt_through_3_servers_equals_hf(smol_client, smollm2_hf, smollm2_tokenizer):
    _, client = smol_client
    ids = _long_prompt(smollm2_tokenizer)
    ref = smollm2_hf.generate(ids, max_new_tokens=8, do_sample=False)
    with client.inference_session(max_length=PROMPT_TOKENS + 8) as session:
        out = client.generate(ids, max_new_tokens=8, do_sample=False)
        assert [h.start for h in session.chain.hops] == [0, 10, 20]
    assert out.tolist() == ref.tolist()


@pytest.mark.model
def test_limit_is_advertised_and_enforced_with_a_typed_error(smol_client, smollm2_tokenizer):
    swarm, client = smol_client
    info = client.backend.server_info(swarm.servers[0].peer_id)
    assert info.max_step_tokens == info.max_length_tokens == 4096
    too_many = torch.zeros(2, 2100, 576)  # 4,200 tokens in one forward, 9.8 MB
    with pytest.raises(RequestTooLargeError, match="max_step_tokens=4096"):
        client.backend.forward(too_many)
    small = client.head.embed_tokens(smollm2_tokenizer("still serving", return_tensors="pt").input_ids[0])
    assert client.backend.forward(small.unsqueeze(0)).shape == (1, small.shape[0], 576)  # the unary path


@pytest.fixture(scope="module")
def wide_identity_path(tmp_path_factory):
    """One Llama block of hidden size 4,096 (a 7B model's width) that is the identity: its attention
    and MLP output projections are zero, so each residual adds exactly 0. Tiny elsewhere (one head of
    8 dims, intermediate size 16), so it costs little to run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=4096,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
    path = tmp_path_factory.mktemp("wide") / "wide-identity-4096"
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def test_32_mib_bfloat16_hidden_state_roundtrips_bit_exactly(wide_identity_path):
    args = [
        "--num-threads",
        "1",
        "--max-length",
        "8192",
        "--max-step-tokens",
        "4096",
        "--dtype",
        "bfloat16",
        "--memory-budget",
        "512MiB",
    ]
    with LocalSwarm(str(wide_identity_path), [(0, 1)], server_args=args) as swarm:
        chain = RemoteChain(
            str(wide_identity_path),
            load_config(wide_identity_path),
            swarm.initial_peers,
            dtype=torch.bfloat16,
            use_orchestrator=False,
            step_timeout_s=120.0,
        )
        try:
            hidden = torch.randn(1, 4096, 4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            assert hidden.numel() * 2 == 32 * 2**20 == 16 * MAX_PART_BYTES
            assert chain.server_info(swarm.servers[0].peer_id).max_step_tokens == 4096  # advertised
            out = chain.forward(hidden)
            assert out.dtype == torch.bfloat16 and torch.equal(out, hidden)
            session = chain.open_session(8192)
            try:
                with pytest.raises(RequestTooLargeError, match="max_step_tokens=4096"):  # refused by its header
                    session.step(torch.zeros(4097, 4096, dtype=torch.bfloat16))
                stepped = session.step(hidden[0])  # the same stream goes on
            finally:
                session.close()
            assert torch.equal(stepped, hidden[0])
            with pytest.raises(RequestTooLargeError, match="max_step_tokens=4096"):  # refused by its header
                chain.forward(torch.zeros(2, 4096, 4096, dtype=torch.bfloat16))
        finally:
            chain.shutdown()
