"""Decode steps first under the batch token budget: the scheduler's limit on prompt rows while sessions
decode (`prefill_tokens_while_decoding`), the policies' decode-first order within a client, and the
gathering that waits for a client the policy serves first. Fake block range, injected clock."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from server.policies import DLPMPolicy, FCFSPolicy, VTCPolicy, make_policy
from server.scheduler import StepScheduler
from tests.test_scheduler import FakeClock, FakeKV, FakeRange, Results, run_all, submit


def make(policy, budget=128, cap=None):
    clock = FakeClock()
    rng = FakeRange(clock)
    sched = StepScheduler(
        rng, policy, max_batch_tokens=budget, clock=clock, start_thread=False, prefill_tokens_while_decoding=cap
    )
    return sched, rng, clock


def prefill_rows(batch, kvs_prefill):
    return sum(n for k, n in batch if k in kvs_prefill)


@pytest.mark.parametrize("policy_name", ["fcfs", "vtc", "dlpm"])
def test_prompt_rows_are_limited_while_a_session_decodes(policy_name):
    sched, rng, _ = make(make_policy(policy_name), budget=128, cap=16)
    res = Results()
    light = FakeKV(4)
    submit(sched, res, "l", light, 1, client="light")
    sched.run_once()  # the light session's decode step ran; its next one is due after a round trip
    heavy = [FakeKV(0) for _ in range(3)]
    for i, kv in enumerate(heavy):
        submit(sched, res, f"h{i}", kv, 200, client="heavy")
    sched.run_once()
    assert sum(n for _, n in rng.batches[1]) == 16  # not 128: the light session decodes
    submit(sched, res, "l", light, 1, client="light")
    sched.run_once()
    assert (id(light), 1) in rng.batches[2] and prefill_rows(rng.batches[2], {id(k) for k in heavy}) == 16
    sched.cancel_session("l")  # the light session closed: nobody decodes, the whole budget again
    sched.run_once()
    assert sum(n for _, n in rng.batches[3]) == 128
    run_all(sched)
    assert all(res.result(f"h{i}").shape == (200, 2) for i in range(3)) and sched.stats.policy_failures == 0


def test_without_the_limit_batches_take_the_whole_budget():
    sched, rng, _ = make(VTCPolicy(), budget=128, cap=None)
    res = Results()
    submit(sched, res, "l", FakeKV(4), 1, client="light")
    sched.run_once()
    submit(sched, res, "h", FakeKV(0), 300, client="heavy")
    sched.run_once()
    assert sum(n for _, n in rng.batches[1]) == 128
    with pytest.raises(ValueError):
        StepScheduler(FakeRange(), VTCPolicy(), max_batch_tokens=8, start_thread=False, prefill_tokens_while_decoding=0)
    assert (
        StepScheduler(
            FakeRange(), VTCPolicy(), max_batch_tokens=8, start_thread=False, prefill_tokens_while_decoding=8
        ).prefill_tokens_while_decoding
        is None
    )  # >= budget: off


def test_vtc_takes_a_clients_decode_steps_before_its_own_prompt_chunks():
    vtc = VTCPolicy()
    sched, rng, _ = make(vtc, budget=4)
    res = Results()
    prompt, dec = FakeKV(0), FakeKV(7)
    submit(sched, res, "p", prompt, 100, client="h")  # arrived first
    submit(sched, res, "d", dec, 1, client="h")
    sched.run_once()
    assert rng.batches[0] == [(id(dec), 1), (id(prompt), 3)]


def test_decode_steps_take_the_room_the_prompt_limit_leaves():
    sched, rng, _ = make(FCFSPolicy(), budget=32, cap=8)
    res = Results()
    prompt = FakeKV(0)
    submit(sched, res, "p", prompt, 100, client="h")
    decs = [FakeKV(3) for _ in range(5)]
    for i, kv in enumerate(decs):
        submit(sched, res, f"d{i}", kv, 1, client=f"c{i}")
    sched.run_once()
    assert rng.batches[0] == [(id(prompt), 8)] + [(id(kv), 1) for kv in decs]


def _light_in_round_trips(policy):
    """A light session ran two decode steps with 1 ms round trips (its return gap is known) while a
    heavy client's prompts wait, enough to fill a batch; the light session is now due back."""
    sched, rng, clock = make(policy, budget=128)
    res = Results()
    light = FakeKV(4)
    for _ in range(2):
        submit(sched, res, "l", light, 1, client="light")
        run_all(sched)
        clock.advance(0.001)
    for i in range(3):
        submit(sched, res, f"h{i}", FakeKV(0), 300, client="heavy")
    return sched, rng, clock, res, light


@pytest.mark.parametrize("policy_name, waits", [("vtc", True), ("fcfs", False)])
def test_gathering_waits_for_a_client_served_first_even_when_the_batch_is_full(policy_name, waits):
    from tests.test_scheduler import _gather_in_thread

    policy = make_policy(policy_name)
    sched, rng, clock, res, light = _light_in_round_trips(policy)
    if policy_name == "vtc":
        policy.vtc.counters["heavy"] = 1000.0  # the heavy client was served long before (a tie would go to it)
    thread = _gather_in_thread(sched)
    thread.join(0.2)
    assert thread.is_alive() == waits  # FCFS would put the light step behind the prompts: no point waiting
    submit(sched, res, "l", light, 1, client="light")
    thread.join(10)
    assert not thread.is_alive()
    sched.run_once()
    assert ((id(light), 1) in rng.batches[-1]) == waits
    run_all(sched)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.one_of(st.just(1), st.integers(2, 300)), st.booleans()),
        min_size=1,
        max_size=60,
    ),
    budget=st.integers(8, 256),
    cap_fraction=st.floats(0.01, 1.0),
    w_in=st.sampled_from([1.0, 0.5]),
    w_out=st.sampled_from([2.0, 1.0, 4.0]),
)
def test_vtc_counter_spread_stays_within_one_charge_with_the_prompt_limit(ops, budget, cap_fraction, w_in, w_out):
    """Lemma 4.3 (eq. 2), so Theorem 4.4's 2U, with decode steps first and prompt rows limited while
    sessions decode: the counters of the clients with waiting work differ by at most
    U = max(w_in * L_input, w_out * M) with L_input and M both the batch token budget here (one batch may
    hold `budget` decode rows of one client: each is charged w_out); and every batch keeps the limit (the
    scheduler checks it)."""
    assume(any(run for _, _, run in ops) and any(n == 1 for _, n, _ in ops))
    cap = max(1, int(cap_fraction * budget))
    vtc = VTCPolicy(w_in=w_in, w_out=w_out)
    sched, _, _ = make(vtc, budget=budget, cap=cap)
    res = Results()
    u = max(w_in * budget, w_out * budget)
    for k, (client, n, run) in enumerate(ops):
        submit(sched, res, f"{client}{k}", FakeKV(0 if n > 1 else 5), n, client=client)
        if run:
            sched.run_once()
        active = [vtc.counters[c] for c in vtc._by_client]
        if active:
            assert max(active) - min(active) <= u + 1e-9
    run_all(sched)
    assert len(vtc) == 0 and sched.stats.policy_failures == 0
    assert all(err is None for got in res.got.values() for _, err in got)


@settings(max_examples=40, deadline=None)
@given(
    decoders=st.integers(1, 3),
    sessions=st.integers(1, 12),
    prompt=st.integers(2, 400),
    budget=st.integers(4, 64),
    cap_fraction=st.floats(0.01, 1.0),
    policy_name=st.sampled_from(["fcfs", "vtc"]),
    w_out=st.sampled_from([1.0, 2.0, 4.0]),
)
def test_a_prompt_is_not_starved_by_sessions_that_keep_decoding(
    decoders, sessions, prompt, budget, cap_fraction, policy_name, w_out
):
    """Clients whose sessions decode every batch (each step back at once) never hold a waiting prompt
    back for good: FCFS runs a chunk of at least one row, then (the remainder re-enters at the back) at most
    ceil(k * sessions / budget) batches of the decode steps that arrived before the cut; under VTC it finishes within
    ceil(n / cap) * (k * ceil((U + w_out) / w_out) + 1) batches, k the decoding clients (whenever the
    prompt's client has the smallest counter it gets the first room, and the others can run ahead of
    it by at most U + w_out each, Lemma 4.3); both after the decode steps that arrived before it ran
    (at most ceil(k * sessions / budget) batches)."""
    cap = max(1, int(cap_fraction * budget))
    assume(decoders * sessions <= 4 * budget)
    policy = FCFSPolicy() if policy_name == "fcfs" else VTCPolicy(w_in=1.0, w_out=w_out)
    sched, _, _ = make(policy, budget=budget, cap=cap)
    res = Results()
    kvs = {f"d{c}-{s}": (f"dec{c}", FakeKV(5)) for c in range(decoders) for s in range(sessions)}
    for name, (client, kv) in kvs.items():
        submit(sched, res, name, kv, 1, client=client)
    sched.run_once()  # the decoders are running before the prompt arrives
    submit(sched, res, "p", FakeKV(0), prompt, client="prompt")
    u = max(1.0 * budget, w_out)
    # a chunk takes the room the steps ahead of it in the batch leave: under FCFS that can be a single row
    # (decode steps that arrived before the remainder re-entered fill the rest), so FCFS's bound counts
    # rounds of at least one row; VTC gives the prompt's client the first room when its counter is least
    chunks = prompt if policy_name == "fcfs" else math.ceil(prompt / min(cap, budget))
    before = math.ceil(decoders * sessions / budget)
    bound = before + chunks * (1 + before if policy_name == "fcfs" else decoders * math.ceil((u + w_out) / w_out) + 1)
    for batches in range(1, bound + 1):
        for name in [n for n, got in res.got.items() if got and n != "p"]:
            res.got[name] = []
            submit(sched, res, name, kvs[name][1], 1, client=kvs[name][0])
        assert sched.run_once() > 0
        if res.got.get("p"):
            break
    assert res.result("p").shape == (prompt, 2), f"the prompt did not finish within {bound} batches"
    for name in list(kvs):
        sched.cancel_session(name)
    assert sched.stats.policy_failures == 0


def test_dlpm_keeps_the_prompt_limit_and_its_bound():
    """DLPM under the limit: its counters stay in (-U, Q] (the premise of Theorem 4.1's 2(U + Q))."""
    dlpm = DLPMPolicy(q=64.0)
    sched, rng, _ = make(dlpm, budget=32, cap=8)
    res = Results()
    submit(sched, res, "l", FakeKV(3), 1, client="light")
    sched.run_once()
    for i in range(4):
        submit(sched, res, f"h{i}", FakeKV(0), 90, client="heavy")
    submit(sched, res, "l", FakeKV(4), 1, client="light")
    for _ in range(40):
        if not sched.run_once():
            break
        assert all(-max(32.0, 2.0) < q <= 64.0 for q in dlpm.deficit.values())
    assert sched.stats.policy_failures == 0
    run_all(sched)


@pytest.mark.parametrize("policy", ["vtc", "dlpm"])
def test_decode_first_batches_match_hf_tiny(tiny_llama_path, policy):
    """The limit changes only how rows are grouped into batches: tokens and logits still equal HF's
    (tiny random Llama, real blocks, the scheduler thread, sessions decoding while others prefill)."""
    import torch
    from transformers import AutoModelForCausalLM

    from petals_chain.runtime.block_range import BlockRange
    from petals_chain.runtime.client_head import ClientHead
    from tests.exactness_helpers import hf_logits_per_step
    from tests.test_chunked_prefill import _run_concurrently

    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
        head = ClientHead(tiny_llama_path, model_path=tiny_llama_path)
        rng = BlockRange(tiny_llama_path, 0, 6, model_path=tiny_llama_path, config=head.config)
        sched = StepScheduler(rng, make_policy(policy), max_batch_tokens=9, prefill_tokens_while_decoding=3)
        try:
            gen = torch.Generator().manual_seed(2)
            prompts = {f"s{n}": torch.randint(2, 128, (n,), generator=gen) for n in (37, 2, 19, 1)}
            out = _run_concurrently(sched, head, rng, prompts, steps=6)
        finally:
            sched.stop()
        assert sched.stats.max_batch_tokens_seen <= 9 and sched.stats.policy_failures == 0
        for name, ids in prompts.items():
            ref_logits, ref_tokens = hf_logits_per_step(hf, ids, 6)
            logits, tokens = out[name]
            assert tokens == ref_tokens
            worst = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
            assert worst <= 1e-4, f"{name}: max abs logit diff {worst}"
