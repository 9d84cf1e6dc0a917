"""`petals-chain experiment prefix`'s own logic (experiments/prefix.py), without a swarm: the servers' sizing
(the planner's capacity and the server's admission agree), the blocks the policies alternate on, the
arrivals' rescaling, the HF sample and the goal's verdict."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments import prefix as P
from orchestrator.model import robust_floor_div
from petals_chain.errors import OutOfCacheError
from server.memory import KVBudget


class _Cfg:
    num_hidden_layers = 4
    num_attention_heads = 4
    num_key_value_heads = 2
    hidden_size = 64
    head_dim = None


class _Model:
    """What server_sizes reads of an HF model: its config and one decoder layer's tensors."""

    def __init__(self):
        import torch

        self.config = _Cfg()
        layer = torch.nn.Linear(64, 64)
        self.model = type("M", (), {"layers": [layer]})()


@settings(max_examples=60, deadline=None)
@given(sessions=st.integers(1, 8), session_tokens=st.integers(64, 1024), cache_tokens=st.integers(16, 4096))
def test_planner_and_server_both_count_exactly_the_sessions_asked_for(sessions, session_tokens, cache_tokens):
    model = _Model()
    sizes = P.server_sizes(model, session_tokens, sessions, cache_tokens)
    kv_token = sizes["kv_token_bytes"]
    weights = model.config.num_hidden_layers * (64 * 64 + 64) * 4
    # the planner (orchestrator.model.residual_slots): floor((M - weights) / s_c(max_length))
    planned = robust_floor_div(sizes["memory_budget_bytes"] - weights, sizes["server_max_length"] * kv_token)
    assert planned == sessions
    assert sizes["server_max_length"] >= session_tokens  # every session of the workload is accepted
    # the server: sessions of the longest length are admitted next to the set-aside cache, one more is not
    budget = KVBudget(sizes["memory_budget_bytes"], weights, cache_floor_bytes=sizes["cache_bytes"])
    for i in range(sessions):
        budget.reserve(f"s{i}", session_tokens * kv_token, reclaim=False)
    with pytest.raises(OutOfCacheError):
        budget.reserve("one more", session_tokens * kv_token, reclaim=False)


def test_blocks_are_bounded_by_count_and_span_and_rounds_rotate():
    arrivals = [0.0, 0.1, 0.2, 50.0, 50.1, 50.2, 50.3, 90.0]
    blocks = P.blocks_of(arrivals, block=3, span_s=30.0)
    assert [list(b) for b in blocks] == [[0, 1, 2], [3, 4, 5], [6], [7]]
    assert [i for b in blocks for i in b] == list(range(len(arrivals)))
    order = P.rounds(blocks, ["a", "b", "c"])
    assert [(j, p) for j, p, _ in order][:6] == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a")]
    assert all(sorted(i for j, p, idx in order if p == pol for i in idx) == list(range(8)) for pol in "abc")


def test_arrivals_rescaled_over_their_own_span():
    a = P.segment_arrivals(np.array([5.0, 6.0, 6.5, 9.0, 100.0]), 4, rate_per_s=2.0)
    assert a[0] == 0 and a[-1] == pytest.approx(1.5)  # 3 gaps at 2 per second
    assert np.all(np.diff(a) >= 0) and a[1] / a[3] == pytest.approx(1 / 4)  # the shape is kept


def test_hf_sample_spreads_over_the_finished_requests():
    recs = [{"i": i} for i in range(10)] + [{"i": 10, "error": "x"}]
    assert [r["i"] for r in P.check_sample(recs, 3)] == [0, 4, 9]  # first, middle, last; the failed one never
    assert P.check_sample(recs, 0) == [] and len(P.check_sample(recs, 50)) == 10


def _summary(jffc_mean, e2_mean, jffc_reused, e2_reused, failed=0, equal=True):
    def pol(mean, reused, f):
        return {
            "mean_response_s": mean,
            "prefill_tokens_reused": reused,
            "failed": f,
            "hf_check": [{"equal_to_hf": equal}],
        }

    return {"policies": {"jffc": pol(jffc_mean, jffc_reused, 0), "e2": pol(e2_mean, e2_reused, failed)}}


def test_goal_needs_every_part():
    assert P.goal(_summary(10.0, 6.0, 100, 200))["met"]
    assert not P.goal(_summary(10.0, 6.1, 100, 200))["met"]  # mean over 0.6x
    assert not P.goal(_summary(10.0, 5.0, 100, 199))["met"]  # reuse under 2x
    assert not P.goal(_summary(10.0, 5.0, 100, 300, failed=1))["met"]  # a request lost
    assert not P.goal(_summary(10.0, 5.0, 100, 300, equal=False))["met"]  # an output not HF's


def test_summary_reports_the_flooders_neighbours_apart():
    def rec(i, client, response_s):
        return {
            "i": i,
            "client": client,
            "response_s": response_s,
            "reused_tokens": 0,
            "prompt_tokens": 10,
            "chain": ["s0"],
            "client_queue_s": 0.0,
            "open_s": 0.0,
            "session_s": response_s,
        }

    records = [rec(i, 0, 10.0 + i) for i in range(8)] + [
        rec(8, 1, 1.0),
        rec(9, 2, 3.0),
        {"i": 10, "client": 1, "error": "x"},
    ]
    s = P.summarize(records, output_tokens=4, flooder=0)
    assert s["well_behaved"]["n"] == 2 and s["well_behaved"]["mean_s"] == pytest.approx(2.0)
    assert s["response_by_client"]["0"]["n"] == 8 and s["response_by_client"]["1"]["mean_s"] == 1.0
    assert s["finished"] == 10 and s["failed"] == 1
    assert P.summarize(records, output_tokens=4)["well_behaved"] is None  # no flooder: not split


class _WordTokenizer:
    """One id per word (what `workload` reads of a tokenizer: `input_ids`, as a tensor or a list)."""

    def __call__(self, text, return_tensors=None):
        import torch

        ids = [sum(map(ord, w)) for w in text.split()]
        return type("Enc", (), {"input_ids": torch.tensor([ids])})() if return_tensors else {"input_ids": ids}


def _args(workload):
    a = P.build_parser().parse_args(["--workload", workload, "--requests", "40", "--clients", "3"])
    a.zipf = P.default_zipf(workload)
    return a


def test_unique_workload_shares_no_prefix_chunk_and_the_others_share_their_segments():
    from petals_chain.wire.prefix_keys import PREFIX_CHUNK_TOKENS as CHUNK
    from petals_chain.wire.prefix_keys import prefix_hashes

    arrivals = np.arange(40, dtype=float)
    first_chunks = {}
    for name in ("tooluse", "longdoc", "unique"):
        reqs, head_tokens, seg_tokens = P.workload(_args(name), _WordTokenizer(), arrivals)
        assert len(reqs) == 40 and seg_tokens > CHUNK
        hashes = [prefix_hashes(r["ids"][0].tolist(), "m") for r in reqs]
        past_head = head_tokens // CHUNK + 1  # the first chunk wholly inside the tool, document or text
        first_chunks[name] = len({h[past_head] for h in hashes})
        if name == "unique":
            assert sorted(r["tool"] for r in reqs) == list(range(40))
            assert len({h for hs in hashes for h in hs}) == sum(len(hs) for hs in hashes)  # no chunk twice
    assert first_chunks["unique"] == 40
    assert first_chunks["tooluse"] <= 12 and first_chunks["longdoc"] <= 12  # --segments 12: shared
