"""Speculative decoding through the chain: HF's own `prompt_lookup_num_tokens` / `assistant_model`
arguments, verified in one chain step per round, with KV rollback of the rejected drafts.

In-process chains of the tiny random Llama (exactness vs HF, the sampled distribution, rollback of
the session by itself); the live swarm (2 hops, failover) is in test_speculative_live.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.client.speculation import AdaptivePromptLookup, StepCostModel

# a prompt that repeats itself, so prompt lookup finds n-grams to copy from
REPETITIVE = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]
# the same, followed by the start of the loop the random model falls into under greedy decoding
LOOPING = REPETITIVE + [123, 96, 123, 96, 123]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's matrices are too small to gain from threads, and on a loaded machine torch's
    thread pool makes each step ~20x slower; the sampled test runs 300 generations."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    # "constant": every draft as HF's lookup makes it (the adaptive default is tested below)
    out, stats, _ = _generate_with_stats(
        model, ids, max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=k, prompt_lookup_schedule="constant"
    )
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
        session.token_ids = second[0, : first.shape[1] + 2].tolist()
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
    """The first two sampled tokens after a prompt that ends in the model's own loop, over a fixed
    number of seeds: with prompt lookup (drafts verified by sampling, rejected ones rolled back) their
    empirical distribution matches the model's exact one (chi-square, p > 0.001)."""
    hf, model = tiny
    ids = torch.tensor([LOOPING])
    temperature = 0.05  # the random model is flat: sharpen it so that drafts pass now and then
    with torch.inference_mode():
        p1 = torch.softmax(hf(ids).logits[0, -1] / temperature, -1)
        exact: dict[tuple[int, int], float] = {}
        for t1 in torch.argsort(p1, descending=True)[:6].tolist():
            l2 = hf(torch.cat([ids, torch.tensor([[t1]])], dim=1)).logits[0, -1] / temperature
            p2 = torch.softmax(l2, -1)
            for t2 in torch.argsort(p2, descending=True)[:6].tolist():
                exact[(t1, t2)] = float(p1[t1] * p2[t2])
    n_seeds = 300
    counts: dict[tuple[int, int], int] = {}
    accepted = rounds_with_rollback = 0
    for seed in range(n_seeds):
        torch.manual_seed(seed)
        out, stats, _ = _generate_with_stats(
            model,
            ids,
            max_new_tokens=2,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            prompt_lookup_num_tokens=3,
            prompt_lookup_schedule="constant",
        )
        accepted += stats.accepted_draft_tokens
        rounds_with_rollback += stats.accepted_draft_tokens < stats.drafted_tokens
        pair = tuple(out[0, -2:].tolist())
        counts[pair] = counts.get(pair, 0) + 1
    assert accepted > 0 and rounds_with_rollback > 0  # both paths are in the sample
    cells = [(pair, prob) for pair, prob in exact.items() if prob * n_seeds >= 5]
    assert len(cells) >= 4
    observed = [counts.get(pair, 0) for pair, _ in cells]
    expected = [prob * n_seeds for _, prob in cells]
    observed.append(n_seeds - sum(observed))  # every other pair in one cell
    expected.append(n_seeds - sum(expected))
    from scipy.stats import chi2 as chi2_dist

    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    p_value = float(chi2_dist.sf(chi2, df=len(observed) - 1))
    assert p_value > 1e-3, f"chi2={chi2:.1f} over {len(observed)} cells, p={p_value:.2g}: {observed} vs {expected}"


class _SpaceTokenizer:
    """Decodes ids as space-separated numbers (the engine only decodes)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def test_gateway_engine_prompt_lookup_greedy_identical_and_counted(tiny):
    import threading

    from petals_chain.api.engine import SamplingParams, run_generation
    from petals_chain.api.metrics import GatewayMetrics

    _, model = tiny
    kwargs = dict(cancel=threading.Event(), on_text=lambda delta, logprobs: None)
    plain = run_generation(model, _SpaceTokenizer(), REPETITIVE, SamplingParams(max_tokens=30, temperature=0), **kwargs)
    spec = run_generation(
        model,
        _SpaceTokenizer(),
        REPETITIVE,
        SamplingParams(max_tokens=30, temperature=0, prompt_lookup_tokens=4, prompt_lookup_schedule="constant"),
        **kwargs,
    )
    assert spec.text == plain.text and spec.completion_tokens == plain.completion_tokens == 30
    adaptive = run_generation(
        model,
        _SpaceTokenizer(),
        REPETITIVE,
        SamplingParams(max_tokens=30, temperature=0, prompt_lookup_tokens=4),
        **kwargs,
    )
    assert adaptive.text == plain.text and adaptive.accepted_draft_tokens <= adaptive.drafted_tokens
    assert plain.drafted_tokens == 0
    assert 0 < spec.accepted_draft_tokens <= spec.drafted_tokens
    for seed in (0, 1):
        # sampled: the engine draws one sample per position in order, exactly as plain decoding does,
        # so with the same seed the output is the same, not only the distribution
        sampled = [
            run_generation(
                model,
                _SpaceTokenizer(),
                LOOPING,
                SamplingParams(
                    max_tokens=12,
                    temperature=0.05,
                    seed=seed,
                    prompt_lookup_tokens=k,
                    prompt_lookup_schedule="constant",
                ),
                **kwargs,
            )
            for k in (0, 3)
        ]
        assert sampled[0].text == sampled[1].text
    metrics = GatewayMetrics("tiny")
    metrics.generation(
        prompt_tokens=len(REPETITIVE),
        completion_tokens=spec.completion_tokens,
        finish_reason=spec.finish_reason,
        ttft_s=spec.time_to_first_token_s,
        token_times_s=spec.token_times_s,
        e2e_s=1.0,
        hops=spec.hops,
        failovers=spec.failovers,
        prefix_hit_tokens=spec.prefix_hit_tokens,
        drafted_tokens=spec.drafted_tokens,
        accepted_draft_tokens=spec.accepted_draft_tokens,
    )
    text = metrics.render().decode()
    assert f'petals_chain:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {float(spec.drafted_tokens)}' in text
    assert (
        f'petals_chain:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(spec.accepted_draft_tokens)}'
    ) in text


@pytest.mark.parametrize("text,k", [("ngram:4", 4), ("ngram:1", 1)])
def test_api_speculative_flag_parses(text, k):
    from petals_chain.cli.api import parse_speculative

    assert parse_speculative(text) == k


@pytest.mark.parametrize("text", ["ngram:0", "draft:4", "ngram", "ngram:x"])
def test_api_speculative_flag_refuses_bad_values(text):
    import argparse

    from petals_chain.cli.api import parse_speculative

    with pytest.raises(argparse.ArgumentTypeError, match="ngram:K"):
        parse_speculative(text)


@pytest.mark.model
def test_generate_cli_prompt_lookup_same_text_and_stats_line(smollm2_path, capsys):
    import json

    from petals_chain.cli.generate import main

    prompt = (
        "Repeat this list exactly: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, kappa. "
        "alpha, beta, gamma, delta,"
    )
    args = ["--prompt", prompt, "--no-chat", "--max-new-tokens", "24", "--stats"]
    assert main(args) == 0
    plain = capsys.readouterr().out.strip().splitlines()
    assert main([*args, "--prompt-lookup", "4"]) == 0
    spec = capsys.readouterr().out.strip().splitlines()

    def text(lines):
        return lines[: next(i for i, line in enumerate(lines) if line.startswith("[chain: "))]

    assert text(spec) == text(plain) and "".join(text(plain)).strip()  # the same generated text
    plain_stats, spec_stats = json.loads(plain[-1]), json.loads(spec[-1])
    assert set(spec_stats) == {"tokens", "chain_steps", "accepted_draft_tokens"}
    assert plain_stats["chain_steps"] == plain_stats["tokens"] and plain_stats["accepted_draft_tokens"] == 0
    assert spec_stats["tokens"] == plain_stats["tokens"]
    assert spec_stats["accepted_draft_tokens"] > 0
    assert spec_stats["chain_steps"] == spec_stats["tokens"] - spec_stats["accepted_draft_tokens"]


# -- the no-draft path and adaptive draft lengths (client/speculation.py) ----------------------------


class _FixedCosts(StepCostModel):
    """Step times as given, not measured: the tests must not depend on this machine's timings."""

    def __init__(self, single_s: float, multi_s: float):
        super().__init__()
        self.costs = (single_s, multi_s)

    def observe(self, n_tokens: int, seconds: float) -> None:
        pass

    def predict_s(self, n_tokens: int) -> float:
        return self.costs[0] if n_tokens == 1 else self.costs[1]


def _generate_recording_steps(model, ids, costs: StepCostModel | None = None, **kwargs):
    """generate in a session whose chain steps' sizes are recorded; `costs` replaces the measured ones."""
    with model.inference_session(max_length=ids.shape[1] + kwargs["max_new_tokens"] + 16) as session:
        if costs is not None:
            session.step_costs = costs
        sizes: list[int] = []
        step = session.chain.step

        def recording(hidden, start_position=None):
            sizes.append(hidden.shape[0])
            return step(hidden, start_position=start_position)

        session.chain.step = recording
        out = model.generate(ids, **kwargs)
        return out, session.last_generate, sizes


@pytest.mark.parametrize("schedule", ["adaptive", "constant"])
def test_no_lookup_match_is_one_plain_step(tiny, monkeypatch, schedule):
    """A round whose lookup finds nothing sends exactly what plain decoding sends: one 1-token step."""
    from transformers.generation.candidate_generator import (
        PromptLookupCandidateGenerator,
    )

    hf, model = tiny
    ids = torch.tensor([REPETITIVE])
    plain, plain_stats, plain_sizes = _generate_recording_steps(model, ids, max_new_tokens=12, do_sample=False)
    monkeypatch.setattr(
        PromptLookupCandidateGenerator, "get_candidates", lambda self, input_ids, **kw: (input_ids, None)
    )
    out, stats, sizes = _generate_recording_steps(
        model, ids, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=4, prompt_lookup_schedule=schedule
    )
    assert out.tolist() == plain.tolist() == hf.generate(ids, max_new_tokens=12, do_sample=False).tolist()
    assert sizes == plain_sizes and sizes[1:] == [1] * 11  # the prompt, then one token per step
    assert stats.chain_steps == plain_stats.chain_steps == 12 and stats.drafted_tokens == 0


def test_adaptive_sends_no_draft_that_does_not_pay(tiny):
    """Multi-token steps 10x a 1-token step and drafts that are never fully right: every round is a
    plain step (drafts are judged against the tokens that follow, without sending them); output exact."""
    hf, model = tiny
    ids = torch.tensor([LOOPING])
    ref = hf.generate(ids, max_new_tokens=30, do_sample=False)
    out, stats, sizes = _generate_recording_steps(
        model, ids, _FixedCosts(0.1, 1.0), max_new_tokens=30, do_sample=False, prompt_lookup_num_tokens=8
    )
    assert out.tolist() == ref.tolist()
    assert sizes[1:] == [1] * 29 and stats.drafted_tokens == 0


def test_adaptive_drafts_when_steps_cost_alike_and_stays_in_bounds(tiny, monkeypatch):
    """Multi-token steps as cheap as 1-token ones: the random model's loop is drafted and verified
    (fewer steps than tokens), never more than K per round, with HF's exact output."""
    from petals_chain.client import speculation

    hf, model = tiny
    ids = torch.tensor([REPETITIVE])
    ref = hf.generate(ids, max_new_tokens=40, do_sample=False)
    chosen: list[int] = []
    draft = speculation.AdaptivePromptLookup.draft

    def recording(self, input_ids):
        tokens = draft(self, input_ids)
        chosen.append(len(tokens))
        return tokens

    monkeypatch.setattr(speculation.AdaptivePromptLookup, "draft", recording)
    out, stats, sizes = _generate_recording_steps(
        model, ids, _FixedCosts(0.1, 0.1), max_new_tokens=40, do_sample=False, prompt_lookup_num_tokens=8
    )
    assert out.tolist() == ref.tolist()
    assert 0 < stats.accepted_draft_tokens <= stats.drafted_tokens and stats.chain_steps < 40
    assert max(sizes[1:]) <= 8 + 1 and all(0 <= k <= 8 for k in chosen)
    assert len(set(chosen)) > 1  # the length follows the measured acceptance, not a constant


def _drafter(costs: StepCostModel, max_draft_tokens: int = 4):
    from transformers.generation.candidate_generator import (
        PromptLookupCandidateGenerator,
    )

    return AdaptivePromptLookup(
        PromptLookupCandidateGenerator(num_output_tokens=max_draft_tokens, max_length=1000), max_draft_tokens, costs
    )


def test_withheld_draft_is_judged_by_the_tokens_that_follow():
    drafter = _drafter(_FixedCosts(0.1, 1.0))
    ids = [5, 6, 7, 8, 9, 5, 6]
    assert drafter.draft(torch.tensor([ids])) == []  # the draft [7, 8, 9, 5] does not pay at 10x the step
    assert drafter.pending == [(7, [7, 8, 9, 5])]
    drafter.draft(torch.tensor([ids + [7, 8]]))  # the model went on as drafted: 2 matched so far
    assert not drafter.accepted and drafter.pending_matched[0] == 2
    drafter.draft(torch.tensor([ids + [7, 8, 1]]))  # rejected at its third token
    assert list(drafter.accepted)[0] == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 8), max_size=16), st.floats(0.01, 1.0), st.floats(0.01, 1.0), st.integers(0, 8))
def test_chosen_k_within_bounds_and_zero_without_gain(accepted, single_s, multi_s, available):
    assume(multi_s >= single_s)  # a longer step never costs less (StepCostModel's invariant)
    drafter = _drafter(_FixedCosts(single_s, multi_s), max_draft_tokens=8)
    drafter.accepted.extend(accepted)
    k = drafter.choose_k(available)
    assert 0 <= k <= available
    if accepted and max(accepted) == 0:
        assert k == 0  # nothing would be accepted: a plain step
    if accepted and min(accepted) >= available and multi_s == single_s:
        assert k == available  # everything accepted at no extra cost: all of it


def test_step_cost_model_separates_single_and_multi_token_steps():
    costs = StepCostModel()
    assert costs.predict_s(1) is None and costs.predict_s(5) is None
    for _ in range(30):
        costs.observe(1, 0.10)
        costs.observe(3, 0.20)
        costs.observe(9, 0.26)
        costs.observe(500, 9.0)  # a prompt: not a decode-sized step
    assert costs.predict_s(1) == pytest.approx(0.10)
    # the line through the multi-token steps (0.01 s per token), pulled a little towards 0.10 by the prior
    assert 0.18 < costs.predict_s(3) < 0.20 and 0.23 < costs.predict_s(9) < 0.26
    assert costs.predict_s(1) + 0.05 < costs.predict_s(2) < costs.predict_s(3)  # the jump from 1 to 2 tokens is kept
    for _ in range(60):  # drafting stopped: the old measurements fade and verification is tried again
        costs.observe(1, 0.10)
    assert costs.predict_s(9) < 0.11


class _RecordingCosts(StepCostModel):
    """The measured cost model, with every observation's step size kept."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def observe(self, n_tokens: int, seconds: float) -> None:
        self.sizes.append(n_tokens)
        super().observe(n_tokens, seconds)


def test_prompt_step_is_not_a_verification_cost(tiny):
    """A short prompt (here 18 tokens: a chat turn is often under 64) is the prefill, not a draft's
    verification step: only the decode and verification steps feed the cost model."""
    hf, model = tiny
    ids = torch.tensor([REPETITIVE])
    costs = _RecordingCosts()
    out, stats, sizes = _generate_recording_steps(
        model, ids, costs, max_new_tokens=20, do_sample=False, prompt_lookup_num_tokens=4
    )
    assert out.tolist() == hf.generate(ids, max_new_tokens=20, do_sample=False).tolist()
    assert sizes[0] > len(REPETITIVE)  # the prompt went with the first round's draft
    assert costs.sizes == sizes[1:] and max(costs.sizes) <= 4 + 1


def test_one_slow_step_does_not_stop_drafting():
    """A verification step slowed 5x by a load spike (early, when few steps carry the fit) counts as
    at most OUTLIER_RATIO times its prediction: drafting that pays at the usual costs goes on."""
    from petals_chain.client.speculation import OUTLIER_RATIO

    costs = StepCostModel()
    drafter = _drafter(costs, max_draft_tokens=8)
    drafter.accepted.extend([2, 0, 1, 3, 0, 1, 2, 0, 5, 1, 0, 2, 1, 0, 3, 1])  # a patchy quote's acceptance
    costs.observe(1, 0.17)
    k = drafter.choose_k(8)
    assert k > 0
    costs.observe(k + 1, 5 * (0.2 + 0.01 * (k + 1)))  # usually 0.2 s + 10 ms per token
    assert costs.predict_s(k + 1) <= OUTLIER_RATIO * 0.17 + 1e-9
    assert drafter.choose_k(8) > 0
    for _ in range(20):  # a lasting change is followed: the prediction reaches the new cost
        costs.observe(k + 1, 1.5)
    assert costs.predict_s(k + 1) > 1.2
