"""Chaining block ranges reproduces the full HF model; batching does not change results."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.runtime.block_range import StepInput
from tests.exactness_helpers import (
    chain_logits_per_step,
    chain_ranges,
    hf_logits_per_step,
)

QUANT_TOLERANCE = {"nf4": 0.35, "int8": 0.12}  # relative L2 error of the final hidden state, stated in README


@pytest.mark.model
@torch.inference_mode()
def test_three_ranges_match_hf_smollm2(smollm2_path, smollm2_hf, smollm2_tokenizer):
    ids = smollm2_tokenizer("The three primary colors are", return_tensors="pt").input_ids[0]
    ref_logits, ref_tokens = hf_logits_per_step(smollm2_hf, ids, steps=20)
    head, ranges = chain_ranges(smollm2_path, [(0, 10), (10, 20), (20, 30)])
    logits, tokens = chain_logits_per_step(head, ranges, ids, steps=20, max_length=64)
    worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    assert worst <= 1e-4, f"max abs logit diff {worst}"
    assert tokens == ref_tokens


@pytest.mark.model
def test_greedy_generate_identical_to_hf(smollm2_path, smollm2_hf, smollm2_tokenizer):
    ids = smollm2_tokenizer("Write a haiku about the sea.", return_tensors="pt").input_ids
    model = DistributedModelForCausalLM.from_local_ranges(smollm2_path, [(0, 10), (10, 20), (20, 30)])
    ours = model.generate(ids, max_new_tokens=24, do_sample=False)
    ref = smollm2_hf.generate(ids, max_new_tokens=24, do_sample=False)
    assert ours.tolist() == ref.tolist()


@pytest.mark.model
def test_float16_greedy_generate_identical_to_hf_in_float16(smollm2_path, smollm2_tokenizer):
    """`--dtype float16` (on this CPU ~2x float32's decode speed: half the weight bytes streamed per
    token) gives transformers' own float16 tokens, and its hidden states stay float16 on every hop."""
    ids = smollm2_tokenizer("Tell me a short story about a lighthouse keeper.", return_tensors="pt").input_ids
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float16).eval()
    model = DistributedModelForCausalLM.from_local_ranges(smollm2_path, [(0, 10), (10, 20), (20, 30)], dtype="float16")
    ours = model.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    ref = hf.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert ours.tolist() == ref.tolist()


@pytest.mark.model
def test_generation_options_match_hf(smollm2_path, smollm2_hf, smollm2_tokenizer):
    """Repetition penalty, eos and seeded sampling go through transformers' own generate code."""
    ids = smollm2_tokenizer("List three fruits:", return_tensors="pt").input_ids
    model = DistributedModelForCausalLM.from_local_ranges(smollm2_path, [(0, 15), (15, 30)])
    kw = dict(max_new_tokens=16, do_sample=False, repetition_penalty=1.3)
    assert model.generate(ids, **kw).tolist() == smollm2_hf.generate(ids, **kw).tolist()
    eos = int(smollm2_hf.generate(ids, max_new_tokens=3, do_sample=False)[0, -1])  # stop at the 3rd token
    out = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos)
    assert out.shape[1] == ids.shape[1] + 3 and int(out[0, -1]) == eos
    torch.manual_seed(7)
    a = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9)
    torch.manual_seed(7)
    b = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9)
    assert a.tolist() == b.tolist() and a.shape[1] == ids.shape[1] + 12


@torch.inference_mode()
def test_tiny_llama_ranges_match_hf_and_entry_midrange(tiny_llama_path):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    ids = torch.randint(2, 128, (11,), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_tokens = hf_logits_per_step(hf, ids, steps=8)
    head, ranges = chain_ranges(tiny_llama_path, [(0, 2), (2, 5), (5, 6)])
    logits, tokens = chain_logits_per_step(head, ranges, ids, steps=8, max_length=32)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) <= 1e-4
    assert tokens == ref_tokens
    # A session that enters a server's range mid-way ([0,3) elsewhere, then blocks 3..5 of a [2,6) server)
    # computes the same thing: the server skips the blocks before its entry block.
    head2, (first, second) = chain_ranges(tiny_llama_path, [(0, 3), (2, 6)])
    kv1, kv2 = first.allocate_kv(32), second.allocate_kv(32, first_block=3)
    assert kv2.num_blocks == 3
    x = first.forward([StepInput(kv1, head2.embed_tokens(ids))])[0]
    x = second.forward([StepInput(kv2, x)])[0]
    assert float((head2.logits(x) - ref_logits[0]).abs().max()) <= 1e-4


@torch.inference_mode()
def test_batched_decode_equals_separate_runs(tiny_llama_path):
    """3 sessions with different prompt lengths: one batched step per token == 3 separate runs."""
    head, (rng,) = chain_ranges(tiny_llama_path, [(0, 6)])
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 128, (n,), generator=gen) for n in (3, 9, 5)]

    def decode(batched: bool):
        kvs = [rng.allocate_kv(40) for _ in prompts]
        last = []
        for kv, p in zip(kvs, prompts):
            last.append(int(head.logits(rng.forward([StepInput(kv, head.embed_tokens(p))])[0])[-1].argmax()))
        history = [list(last)]
        for _ in range(10):
            steps = [StepInput(kv, head.embed_tokens(torch.tensor([t]))) for kv, t in zip(kvs, last)]
            outs = rng.forward(steps) if batched else [rng.forward([s])[0] for s in steps]
            last = [int(head.logits(o)[-1].argmax()) for o in outs]
            history.append(list(last))
        return history, [kv.past_tokens for kv in kvs]

    assert decode(batched=True) == decode(batched=False)


@torch.inference_mode()
def test_mixed_prefill_and_decode_in_one_batch(tiny_llama_path):
    """A prefill of one session and a decode step of another in the same call stay independent."""
    head, (rng,) = chain_ranges(tiny_llama_path, [(0, 6)])
    a, b = torch.randint(2, 128, (7,)), torch.randint(2, 128, (4,))
    kv_a, kv_b = rng.allocate_kv(16), rng.allocate_kv(16)
    rng.forward([StepInput(kv_a, head.embed_tokens(a[:-1]))])
    mixed = rng.forward([StepInput(kv_a, head.embed_tokens(a[-1:])), StepInput(kv_b, head.embed_tokens(b))])
    solo_a = rng.forward([StepInput(rng.allocate_kv(16), head.embed_tokens(a))])[0][-1:]
    solo_b = rng.forward([StepInput(rng.allocate_kv(16), head.embed_tokens(b))])[0]
    torch.testing.assert_close(mixed[0], solo_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1], solo_b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("quant", ["nf4", "int8"])
@torch.inference_mode()
def test_quantized_blocks_within_tolerance(tiny_llama_path, quant):
    head, (full,) = chain_ranges(tiny_llama_path, [(0, 6)])
    _, (quantized,) = chain_ranges(tiny_llama_path, [(0, 6)], quant=quant)
    assert quantized.block_bytes < full.block_bytes
    x = head.embed_tokens(torch.randint(2, 128, (12,), generator=torch.Generator().manual_seed(3)))
    ref = full.forward_stateless(x.unsqueeze(0))[0]
    got = quantized.forward_stateless(x.unsqueeze(0))[0]
    rel = float((got - ref).norm() / ref.norm())
    assert rel <= QUANT_TOLERANCE[quant], f"{quant}: relative error {rel:.3f}"


@torch.inference_mode()
def test_bfloat16_close_to_float32(tiny_llama_path):
    head, (full,) = chain_ranges(tiny_llama_path, [(0, 6)])
    _, (half,) = chain_ranges(tiny_llama_path, [(0, 6)], dtype="bfloat16")
    x = head.embed_tokens(torch.randint(2, 128, (8,)))
    ref = full.forward_stateless(x.unsqueeze(0))[0]
    got = half.forward_stateless(x.to(torch.bfloat16).unsqueeze(0))[0].float()
    assert got.dtype == torch.float32 and float((got - ref).norm() / ref.norm()) < 0.05
    assert half.block_bytes * 2 == full.block_bytes
