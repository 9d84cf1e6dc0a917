"""One model object used from several threads: per-thread sessions, cross-session batching of the
client's head (RowBatcher), LM head only where generation needs it, local errors never taken for
a server failure. Exactness against transformers on in-process block ranges (the swarm version
is in test_swarm.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.client.remote import as_server_error
from petals_chain.errors import OutOfCacheError, ServerUnavailableError
from petals_chain.runtime.row_batcher import RowBatcher
from tests.swarm_helpers import wait_for

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The sun is a"]


def test_row_batcher_coalesces_concurrent_callers_and_keeps_rows_apart():
    release = threading.Event()
    first_started = threading.Event()
    weight = torch.arange(12, dtype=torch.float64).reshape(3, 4)

    def fn(rows):
        if not first_started.is_set():
            first_started.set()
            release.wait(10)  # hold the first batch so the others queue up behind it
        return rows @ weight

    batcher = RowBatcher(fn)
    inputs = [torch.full((i + 1, 3), float(i), dtype=torch.float64) for i in range(4)]
    results: dict[int, torch.Tensor] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, batcher(inputs[i]))) for i in range(4)]
    threads[0].start()
    assert first_started.wait(10)
    for t in threads[1:]:
        t.start()
    wait_for(lambda: len(batcher._pending) == 3, 10.0, "three callers pending in the batcher", period_s=0.005)
    release.set()
    for t in threads:
        t.join(10)
    for i in range(4):
        assert torch.equal(results[i], inputs[i] @ weight)
    assert (batcher.batches, batcher.batched_calls, batcher.rows) == (2, 4, 10)  # 1 alone, then 3 together
    assert not batcher._running and not batcher._pending


def test_row_batcher_error_reaches_every_caller_of_the_batch_and_batcher_recovers():
    batcher = RowBatcher(lambda rows: rows[:, 5])  # IndexError for 2-column rows
    with pytest.raises(IndexError):
        batcher(torch.zeros(2, 2))
    assert torch.equal(batcher(torch.ones(1, 6)), torch.ones(1))


def test_client_head_logits_match_hf_lm_head_at_every_batch_size(smollm2_path, smollm2_hf):
    """The head computes through a oneDNN-packed LM head on the CPU (faster at every batch size): a
    batch's rows agree with HF's `lm_head(norm(h))` to float32 rounding, with the same argmax. The
    result is an ordinary tensor that callers may edit in place (HF's assisted decoding does)
    without a copy."""
    from petals_chain.runtime.client_head import ClientHead
    from petals_chain.runtime.packed_linear import PackedLinear, packing_available

    head = ClientHead(smollm2_path)
    assert isinstance(head.lm_head, PackedLinear) == packing_available()
    torch.manual_seed(0)
    for rows in (1, 3, 8, 9, 33):
        hidden = torch.randn(rows, head.config.hidden_size) * 3
        with torch.no_grad():
            ref = smollm2_hf.lm_head(smollm2_hf.model.norm(hidden))
        out = head.logits(hidden)
        assert out.shape == ref.shape and out.is_contiguous() and not out.is_inference()
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-4)
        assert torch.equal(out.argmax(-1), ref.argmax(-1))
        out[0, 0] = 0.0  # outside inference mode, as HF's assisted decoding edits its logits


def _gathering_batcher(sizes: list[int]) -> RowBatcher:
    """A RowBatcher whose gathering window is long (its first call takes 20 ms, the fraction is
    large): a leader waits for expected callers until they call or give up, not for a timer."""
    first = threading.Event()

    def fn(rows):
        if not first.is_set():
            first.set()
            threading.Event().wait(0.02)
        sizes.append(rows.shape[0])
        return rows * 2

    batcher = RowBatcher(fn, gather_fraction=500.0)  # window: 500 x ~20 ms
    batcher(torch.zeros(1, 2))  # measures fn's time
    return batcher


def test_row_batcher_leader_waits_for_expected_callers_and_runs_them_in_one_batch():
    sizes: list[int] = []
    batcher = _gathering_batcher(sizes)
    results: dict[str, torch.Tensor] = {}
    in_step = threading.Barrier(2)
    second_may_call = threading.Event()

    def session(name: str, value: float, release_other: bool):
        with batcher.expecting():  # the chain step in flight
            in_step.wait(10)
        if release_other:
            second_may_call.set()
        else:
            second_may_call.wait(10)
        results[name] = batcher(torch.full((1, 2), value), expected=True)

    threads = [
        threading.Thread(target=session, args=("a", 1.0, True)),
        threading.Thread(target=session, args=("b", 2.0, False)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(results["a"], torch.full((1, 2), 2.0)) and torch.equal(results["b"], torch.full((1, 2), 4.0))
    assert sizes[1:] == [2]  # the first reply's caller waited for the second: one batch, not two
    assert batcher.gather_waits >= 1 and batcher._expected == 0 and not batcher._running


def test_row_batcher_stops_waiting_for_an_expected_caller_whose_step_failed():
    sizes: list[int] = []
    batcher = _gathering_batcher(sizes)
    leader_waiting = threading.Event()
    failed = threading.Event()

    def failing_session():
        try:
            with batcher.expecting():
                leader_waiting.wait(10)
                raise RuntimeError("the server went away")
        except RuntimeError:
            failed.set()

    with batcher.expecting():
        t = threading.Thread(target=failing_session)
        t.start()
    wait_for(lambda: batcher._expected == 2, 10.0, "both sessions expected", period_s=0.005)
    caller = threading.Thread(target=lambda: sizes.append(-int(batcher(torch.ones(1, 2), expected=True)[0, 0])))
    caller.start()
    wait_for(lambda: batcher.gather_waits == 1, 10.0, "the leader waiting for the other session", period_s=0.005)
    leader_waiting.set()
    caller.join(30)
    t.join(10)
    assert failed.is_set() and not caller.is_alive()
    assert sizes[1:] == [1, -2]  # ran alone once the other session gave up
    assert batcher._expected == 0 and not batcher._running


def test_local_errors_are_not_server_failures():
    assert as_server_error(RuntimeError("anext(): asynchronous generator is already running"), 1.0) is None
    assert as_server_error(ValueError("local bug"), 1.0) is None
    assert isinstance(as_server_error(asyncio_timeout(), 3.0), ServerUnavailableError)
    assert isinstance(as_server_error(ConnectionResetError("peer reset"), 3.0), ServerUnavailableError)
    assert isinstance(as_server_error(P2PHandlerError("handler died"), 3.0), ServerUnavailableError)
    assert isinstance(as_server_error(StopAsyncIteration(), 3.0), ServerUnavailableError)
    typed = OutOfCacheError("full")
    assert as_server_error(typed, 3.0) is typed


def asyncio_timeout():
    import asyncio

    return asyncio.TimeoutError()


@pytest.fixture(scope="module")
def local_model(smollm2_path):
    return DistributedModelForCausalLM.from_local_ranges(smollm2_path, [(0, 15), (15, 30)])


@pytest.mark.model
def test_generate_runs_lm_head_on_last_prefill_position_only(local_model, smollm2_tokenizer):
    ids = smollm2_tokenizer(
        "A long prompt: " + "one two three four five six seven eight " * 4, return_tensors="pt"
    ).input_ids
    assert ids.shape[1] > 30
    before = local_model.head.logits_batched.rows
    out = local_model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
    assert local_model.head.logits_batched.rows - before == 3  # prefill: 1 position, then 2 decode steps
    # a plain forward still returns every position, and the kept one equals the full one's last row
    full = local_model(ids).logits
    last = local_model(ids, logits_to_keep=1).logits
    assert full.shape == (1, ids.shape[1], local_model.config.vocab_size) and last.shape[1] == 1
    torch.testing.assert_close(last[0, -1], full[0, -1], atol=1e-4, rtol=1e-4)  # one row vs many: GEMM rounding


@pytest.mark.model
def test_threads_on_one_model_object_each_get_their_own_session(local_model, smollm2_hf, smollm2_tokenizer):
    refs = []
    for p in PROMPTS:
        ids = smollm2_tokenizer(p, return_tensors="pt").input_ids
        refs.append((ids, smollm2_hf.generate(ids, max_new_tokens=10, do_sample=False)))
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(refs))

    def run(i):
        try:
            start.wait(30)
            results[i] = local_model.generate(refs[i][0], max_new_tokens=10, do_sample=False).tolist()
        except BaseException as e:  # surfaced below
            errors.append(e)

    calls_before = local_model.head.logits_batched.batched_calls
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(refs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [results[i] for i in range(len(refs))] == [ref.tolist() for _, ref in refs]
    assert local_model.head.logits_batched.batched_calls - calls_before == len(refs) * 10
    assert local_model._session is None  # nothing leaked onto this (the main) thread
