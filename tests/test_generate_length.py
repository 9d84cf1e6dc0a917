"""`generate` sizes its session the way transformers sizes the generation (README's client snippet
calls it without `max_new_tokens`): exact tokens vs HF, tiny random Llama, in-process ranges."""

from __future__ import annotations

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.errors import InvalidRequestError


@pytest.fixture(scope="module")
def models(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    ours = DistributedModelForCausalLM.from_local_ranges(tiny_llama_path, [(0, 3), (3, 6)])
    return hf, ours


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # transformers' default: 20 new tokens
        {"max_length": 12},  # an explicit max_length means prompt + new tokens, as in HF
        {"max_new_tokens": 4},
        {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1},  # the README's call
    ],
)
def test_generate_without_max_new_tokens_follows_transformers(models, kwargs):
    hf, ours = models
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    torch.manual_seed(1)
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None, **kwargs)
    torch.manual_seed(1)
    got = ours.generate(ids, pad_token_id=0, eos_token_id=None, **kwargs)
    assert got.tolist() == expected.tolist()


def test_a_max_length_below_the_prompt_is_refused_as_transformers_does(models):
    hf, ours = models
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with pytest.raises(ValueError, match="max_length` is set to 3"):
        hf.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_length=3)
    with pytest.raises(ValueError, match="max_length` is set to 3"):
        ours.generate(ids, pad_token_id=0, max_length=3)


def test_local_ranges_must_tile_the_model(tiny_llama_path):
    for ranges in ([(0, 3), (3, 5)], [(0, 3), (3, 9)], []):
        with pytest.raises(InvalidRequestError, match=r"do not tile the model's blocks \[0, 6\)"):
            DistributedModelForCausalLM.from_local_ranges(tiny_llama_path, ranges)
    with pytest.raises(InvalidRequestError, match="must tile the model in order"):
        DistributedModelForCausalLM.from_local_ranges(tiny_llama_path, [(0, 3), (2, 6)])
