"""Speculative decoding through the chain: HF's own `prompt_lookup_num_tokens` / `assistant_model`
arguments, verified in one chain step per round, with KV rollback of the rejected drafts.

In-process chains of the tiny random Llama (exactness vs HF, the sampled distribution, rollback of
the session by itself); the live swarm (2 hops, failover) is in test_speculative_live.py.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from petals_chain.client.model import DistributedModelForCausalLM

# a prompt that repeats itself, so prompt lookup finds n-grams to copy from
REPETITIVE = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    model = DistributedModelForCausalLM.from_local_ranges(tiny_llama_path, [(0, 2), (2, 6)])
    return hf, model


def _generate_with_stats(model, ids, **kwargs):
    with model.inference_session(max_length=ids.shape[1] + kwargs["max_new_tokens"] + 16) as session:
        out = model.generate(ids, **kwargs)
        return out, session.last_generate, session.chain


@pytest.mark.parametrize("k", [2, 4, 8])
def test_prompt_lookup_greedy_identical_to_hf(tiny, k):
    hf, model = tiny
    ids = torch.tensor([REPETITIVE])
    ref = hf.generate(ids, max_new_tokens=40, do_sample=False)
    out, stats, _ = _generate_with_stats(model, ids, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=k)
    assert out.tolist() == ref.tolist()
    assert stats.tokens == 40
    assert stats.drafted_tokens > 0
    # the random model falls into a loop that prompt lookup copies: fewer chain steps than tokens
    assert 0 < stats.accepted_draft_tokens <= stats.drafted_tokens
    assert stats.chain_steps == stats.tokens - stats.accepted_draft_tokens


def test_draft_model_that_is_the_target_accepts_everything(tiny):
    hf, model = tiny
    ids = torch.tensor([[3, 17, 42, 9, 77, 21]])
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False)
    draft = copy.deepcopy(hf)
    # draft 5 tokens a round whatever its confidence (HF's default stops a flat random model's draft early)
    draft.generation_config.num_assistant_tokens = 5
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    out, stats, _ = _generate_with_stats(model, ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    # every draft is accepted: each round adds its 5 drafts plus one token, in one chain step
    assert stats.chain_steps == 4
    assert stats.accepted_draft_tokens == stats.drafted_tokens == 20


def test_truncated_random_draft_is_rejected_but_output_exact(tiny, tiny_llama_path):
    hf, model = tiny
    torch.manual_seed(123)
    config = LlamaConfig.from_pretrained(tiny_llama_path)
    config.num_hidden_layers = 2
    draft = LlamaForCausalLM(config).eval()  # another random model: it mostly guesses wrong
    ids = torch.tensor([[3, 17, 42, 9, 77, 21]])
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False)
    with model.inference_session(max_length=64) as session:
        out = model.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
        stats = session.last_generate
        rollbacks = getattr(session.chain, "rollbacks", None)
    assert out.tolist() == ref.tolist()
    assert stats.accepted_draft_tokens < stats.drafted_tokens  # rejections happened and were rolled back
    assert rollbacks is None  # a local chain has no counter; the remote one is tested live


def test_session_rolls_back_by_itself_and_regenerates_the_last_turn(tiny):
    hf, model = tiny
    prompt = torch.tensor([[3, 17, 42, 9, 77, 21]])
    with model.inference_session(max_length=128) as session:
        first = model.generate(prompt, max_new_tokens=10, do_sample=False)
        second = model.generate(torch.tensor([[4, 5]]), max_new_tokens=10, do_sample=False)
        assert session.position == second.shape[1] - 1  # the last token is not processed yet
        # regenerate the second turn: cut the conversation back to after its user tokens
        session.token_ids = second[0, :first.shape[1] + 2].tolist()
        steps = session.chain_steps
        again = model.generate(torch.tensor([[]], dtype=torch.long), max_new_tokens=10, do_sample=False)
        assert again.tolist() == second.tolist()
        assert session.chain_steps - steps == 10  # one per token: the earlier KV was reused, not recomputed
        # edit the second turn instead: a different user message after the first turn
        session.token_ids = first[0].tolist()
        edited = model.generate(torch.tensor([[6, 7]]), max_new_tokens=10, do_sample=False)
    ref = hf.generate(torch.cat([first, torch.tensor([[6, 7]])], dim=1), max_new_tokens=10, do_sample=False)
    assert edited.tolist() == ref.tolist()


def test_sampled_prompt_lookup_has_the_target_distribution(tiny):
    """The first two sampled tokens after a repetitive prompt, over a fixed number of seeds: with
    prompt lookup (drafts verified by sampling, rejected ones rolled back) their empirical
    distribution matches the model's exact one (chi-square, p > 0.001)."""
    hf, model = tiny
    ids = torch.tensor([REPETITIVE])
    temperature = 0.5  # sharp enough that drafts often pass, so the rollback path is exercised
    with torch.inference_mode():
        logits = hf(ids).logits[0, -1] / temperature
        p1 = torch.softmax(logits, -1)
        top = torch.argsort(p1, descending=True)[:4].tolist()
        exact: dict[tuple[int, int], float] = {}
        for t1 in top:
            l2 = hf(torch.cat([ids, torch.tensor([[t1]])], dim=1)).logits[0, -1] / temperature
            p2 = torch.softmax(l2, -1)
            for t2 in torch.argsort(p2, descending=True)[:4].tolist():
                exact[(t1, t2)] = float(p1[t1] * p2[t2])
    n_seeds = 300
    counts: dict[tuple[int, int], int] = {}
    accepted = 0
    for seed in range(n_seeds):
        torch.manual_seed(seed)
        out, stats, _ = _generate_with_stats(model, ids, max_new_tokens=2, do_sample=True, temperature=temperature,
                                             top_k=0, prompt_lookup_num_tokens=3)
        accepted += stats.accepted_draft_tokens
        pair = tuple(out[0, -2:].tolist())
        counts[pair] = counts.get(pair, 0) + 1
    assert accepted > 0  # drafts were accepted in some runs, so both paths are in the sample
    # chi-square over the likely pairs plus one "other" cell
    cells = [(pair, prob) for pair, prob in exact.items() if prob * n_seeds >= 5]
    other_p = 1.0 - sum(p for _, p in cells)
    observed = [counts.get(pair, 0) for pair, _ in cells] + [n_seeds - sum(counts.get(pair, 0) for pair, _ in cells)]
    expected = [p * n_seeds for _, p in cells] + [other_p * n_seeds]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    from scipy.stats import chi2 as chi2_dist

    p_value = float(chi2_dist.sf(chi2, df=len(observed) - 1))
    assert p_value > 1e-3, f"chi2={chi2:.1f} over {len(observed)} cells, p={p_value:.2g}: {observed} vs {expected}"
    assert not math.isnan(p_value)
