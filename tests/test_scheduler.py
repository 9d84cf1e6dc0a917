"""The scheduler contract with a fake block range and an injected clock: policy-owned queue,
chunked prefill, broken policies failing work with typed errors instead of killing the loop."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from petals_chain.errors import (
    InvalidRequestError,
    SchedulerPolicyError,
    SessionClosedError,
)
from server.policies import (
    FCFSPolicy,
    VTCPolicy,
    WorkItem,
    make_policy,
    parse_policy_args,
)
from server.scheduler import StepScheduler
from server.step_request import StepRequest


@dataclass
class FakeKV:
    past_tokens: int = 0


class FakeRange:
    """forward: row r of a step -> hidden[r] + its absolute position (so chunk order shows)."""

    def __init__(self, clock=None):
        self.batches: list[list[tuple[int, int]]] = []  # [(id(kv), n_tokens)] per batch
        self.clock = clock

    def forward(self, steps):
        self.batches.append([(id(s.kv), s.hidden.shape[0]) for s in steps])
        if self.clock is not None:
            self.clock.advance(0.01 * sum(s.hidden.shape[0] for s in steps))
        outs = []
        for s in steps:
            n = s.hidden.shape[0]
            outs.append(s.hidden + torch.arange(s.kv.past_tokens, s.kv.past_tokens + n).unsqueeze(1).float())
            s.kv.past_tokens += n
        return outs


class FakeClock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self):
        return self.now_s

    def advance(self, dt_s):
        self.now_s += dt_s


class Results:
    def __init__(self):
        self.got: dict[str, list] = {}
        self.event = threading.Event()

    def deliver(self, name):
        def cb(result, error):
            self.got.setdefault(name, []).append((result, error))
            self.event.set()

        return cb

    def result(self, name):
        [(result, error)] = self.got[name]
        assert error is None, error
        return result

    def error(self, name):
        [(result, error)] = self.got[name]
        assert result is None
        return error


def make(policy=None, budget=128):
    clock = FakeClock()
    rng = FakeRange(clock)
    sched = StepScheduler(
        rng, FCFSPolicy() if policy is None else policy, max_batch_tokens=budget, clock=clock, start_thread=False
    )
    return sched, rng, clock


def submit(sched, res, name, kv, n, client="c"):
    sched.submit(StepRequest(kv, torch.zeros(n, 2), key=name, client_id=client), res.deliver(name))


def run_all(sched, limit=20000):
    for _ in range(limit):
        if not sched.run_once():
            return
    raise AssertionError("scheduler did not drain")


def test_fcfs_batches_in_arrival_order_within_budget():
    sched, rng, _ = make(budget=128)
    res = Results()
    kvs = [FakeKV(5) for _ in range(3)]
    for i, kv in enumerate(kvs):
        submit(sched, res, f"s{i}", kv, 1)
    assert sched.run_once() == 3
    assert rng.batches == [[(id(kvs[0]), 1), (id(kvs[1]), 1), (id(kvs[2]), 1)]]
    assert [float(res.result(f"s{i}")[0, 0]) for i in range(3)] == [5.0, 5.0, 5.0]
    assert sched.queue_length == 0


def test_chunked_prefill_interleaves_decodes_and_delivers_rows_in_order():
    sched, rng, _ = make(budget=128)
    res = Results()
    long_kv, a, b = FakeKV(0), FakeKV(3), FakeKV(7)
    submit(sched, res, "long", long_kv, 300)
    submit(sched, res, "a", a, 1)
    submit(sched, res, "b", b, 1)
    run_all(sched)
    assert all(sum(n for _, n in batch) <= 128 for batch in rng.batches)
    # the decodes ran before the prompt finished: they joined the second batch
    assert (id(a), 1) in rng.batches[1] and (id(b), 1) in rng.batches[1]
    assert sum(n for batch in rng.batches for kid, n in batch if kid == id(long_kv)) == 300
    out = res.result("long")
    assert out.shape == (300, 2)
    assert out[:, 0].tolist() == [float(i) for i in range(300)]  # every row at its own position, in order
    assert long_kv.past_tokens == 300
    assert sched.stats.steps == 3 and sched.stats.tokens == 302


def test_fcfs_remainder_keeps_its_place_in_arrival_order():
    """A cut prompt's remainder arrives when it is cut: after what waited then, before what comes later."""
    sched, rng, _ = make(budget=128)
    res = Results()
    long_kv, a, b = FakeKV(0), FakeKV(3), FakeKV(7)
    submit(sched, res, "long", long_kv, 300)
    submit(sched, res, "a", a, 1)
    sched.run_once()  # long's first 128 rows; its remainder queues behind a
    submit(sched, res, "b", b, 1)  # arrives after the cut
    sched.run_once()
    assert rng.batches[1] == [(id(a), 1), (id(long_kv), 127)]  # b waits: the remainder was first
    sched.run_once()
    assert rng.batches[2][0] == (id(b), 1)


def test_cancel_session_fails_its_waiting_work():
    sched, _, _ = make()
    res = Results()
    submit(sched, res, "x", FakeKV(0), 500)
    sched.run_once()  # the first chunk ran; the rest waits
    sched.cancel_session("x")
    assert isinstance(res.error("x"), SessionClosedError)
    assert sched.queue_length == 0 and sched.run_once() == 0


class BrokenPolicy(FCFSPolicy):
    """FCFS that misbehaves in a chosen way while `broken` is set."""

    name = "broken"

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.broken = True

    def select(self, max_batch_tokens):
        if not self.broken:
            return super().select(max_batch_tokens)
        if self.mode == "raise":
            raise ZeroDivisionError("bug")
        if self.mode == "empty":
            return []
        if self.mode == "foreign":
            return [WorkItem(999, "ghost", "c", 1, 0, 0.0)]
        if self.mode == "over_budget":
            return list(self._queue.values())
        if self.mode == "two_of_one_session":
            first = next(iter(self._queue.values()))
            return [first, first]
        raise AssertionError(self.mode)


@pytest.mark.parametrize("mode", ["raise", "empty", "foreign", "over_budget", "two_of_one_session"])
def test_broken_policy_fails_waiting_work_with_typed_error_and_loop_survives(mode):
    policy = BrokenPolicy(mode)
    sched, _, _ = make(policy, budget=4)
    res = Results()
    for i in range(3):
        submit(sched, res, f"s{i}", FakeKV(0), 3)
    assert sched.run_once() == 0
    for i in range(3):
        err = res.error(f"s{i}")
        assert isinstance(err, SchedulerPolicyError) and "--policy fcfs" in str(err)
    assert sched.queue_length == 0 and sched.stats.policy_failures == 1
    policy.broken = False
    submit(sched, res, "later", FakeKV(0), 2)
    run_all(sched)
    assert res.result("later").shape == (2, 2)


def test_broken_policy_in_the_real_thread_keeps_serving():
    policy = BrokenPolicy("raise")
    rng = FakeRange()
    sched = StepScheduler(rng, policy, max_batch_tokens=16)
    try:
        res = Results()
        submit(sched, res, "a", FakeKV(0), 2)
        assert res.event.wait(10)
        assert isinstance(res.error("a"), SchedulerPolicyError)
        policy.broken = False
        res.event.clear()
        submit(sched, res, "b", FakeKV(0), 2)
        assert res.event.wait(10)
        assert res.result("b").shape == (2, 2)
        assert sched._thread.is_alive()
    finally:
        sched.stop()


def test_enqueue_failure_fails_the_step_not_the_caller():
    class BadEnqueue(FCFSPolicy):
        def enqueue(self, item):
            raise KeyError("oops")

    sched, _, _ = make(BadEnqueue())
    res = Results()
    submit(sched, res, "a", FakeKV(0), 1)
    assert isinstance(res.error("a"), SchedulerPolicyError)


def test_stop_fails_waiting_work():
    sched, _, _ = make()
    res = Results()
    submit(sched, res, "a", FakeKV(0), 1)
    sched.stop()
    assert res.error("a").code == "server_unavailable"


def test_injected_clock_sets_enqueue_time_and_busy_time():
    sched, _, clock = make(budget=64)
    res = Results()
    clock.advance(3.0)
    submit(sched, res, "a", FakeKV(0), 10)
    run_all(sched)
    assert sched.stats.busy_s == pytest.approx(0.10)


# -- VTC ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy_name", ["fcfs", "vtc"])
def test_vtc_serves_a_newcomer_in_the_next_batch_fcfs_does_not(policy_name):
    policy = make_policy(policy_name, {"w_in": 1.0, "w_out": 2.0} if policy_name == "vtc" else {})
    sched, rng, _ = make(policy, budget=128)
    res = Results()
    for i in range(5):
        submit(sched, res, f"h{i}", FakeKV(0), 100, client="heavy")
    sched.run_once()  # heavy gets 128 tokens of prompt
    light = FakeKV(4)
    submit(sched, res, "l", light, 1, client="light")
    if policy_name == "vtc":
        assert policy.counters["heavy"] == 128
        assert policy.counters["light"] == 128  # lifted to the smallest active counter: no credit for idling
    sched.run_once()
    assert ((id(light), 1) in rng.batches[1]) == (policy_name == "vtc")
    if policy_name == "vtc":
        assert policy.counters["light"] == 130  # one decode token at w_out = 2
        assert policy.served == {"heavy": 128 + 127, "light": 2}


def test_vtc_max_client_share_caps_a_client_while_another_is_mid_round_trip():
    vtc = VTCPolicy(max_client_share=0.25)
    sched, rng, _ = make(vtc, budget=128)
    res = Results()
    light = FakeKV(3)
    submit(sched, res, "l", light, 1, client="light")
    sched.run_once()  # light's step ran; its client is now computing its next token
    for i in range(3):
        submit(sched, res, f"h{i}", FakeKV(0), 200, client="heavy")
    sched.run_once()
    assert sum(n for _, n in rng.batches[1]) == 32  # heavy capped at 0.25 x 128 while light is active
    sched.run_once()
    assert sum(n for _, n in rng.batches[2]) == 128  # light did not come back: the whole budget again
    with pytest.raises(InvalidRequestError):
        VTCPolicy(max_client_share=0.0)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 300), st.booleans()), min_size=1, max_size=60
    ),
    budget=st.integers(8, 256),
    w_in=st.sampled_from([1.0, 0.5]),
    w_out=st.sampled_from([2.0, 1.0, 4.0]),
)
def test_vtc_counter_spread_of_active_clients_stays_within_one_charge(ops, budget, w_in, w_out):
    """Lemma 4.3 (eq. 2) at step granularity: while work waits, the counters of the clients with
    waiting work differ by at most U = max(w_in * budget, w_out) (the largest single charge)."""
    assume(any(run for _, _, run in ops))
    vtc = VTCPolicy(w_in=w_in, w_out=w_out)
    sched, _, _ = make(vtc, budget=budget)
    res = Results()
    u = max(w_in * budget, w_out)
    for k, (client, n, run) in enumerate(ops):
        submit(sched, res, f"{client}{k}", FakeKV(0 if n > 1 else 5), n, client=client)
        if run:
            sched.run_once()
        active = [vtc.counters[c] for c in vtc._by_client]
        if active:
            assert max(active) - min(active) <= u + 1e-9
    run_all(sched)
    assert len(vtc) == 0


def test_policy_args_are_validated():
    assert parse_policy_args("vtc", ["w_in=1", "w_out=3"]) == {"w_in": 1.0, "w_out": 3.0}
    for bad in (["w_out"], ["speed=2"], ["w_in=abc"], ["w_in=-1"]):
        with pytest.raises(InvalidRequestError):
            parse_policy_args("vtc", bad)
    with pytest.raises(InvalidRequestError):
        parse_policy_args("fcfs", ["w_in=1"])
    with pytest.raises(InvalidRequestError):
        make_policy("lottery")
    with pytest.raises(InvalidRequestError):
        make_policy("vtc", {"w_in": 0.0, "w_out": 0.0})


def _two_sessions_in_step(gather_fraction: float):
    """Sessions a and b ran two rounds together (1 ms client round trips, 20 ms batches); a is
    back for round three, b is due 1 ms later. Returns (sched, rng, clock, res, kvs)."""
    sched, rng, clock = make()
    sched.gather_fraction = gather_fraction
    res, kvs = Results(), {"a": FakeKV(), "b": FakeKV()}
    for _ in range(2):
        for name in "ab":
            submit(sched, res, name, kvs[name], 1)
        run_all(sched)
        clock.advance(0.001)
    submit(sched, res, "a", kvs["a"], 1)
    return sched, rng, clock, res, kvs


def _gather_in_thread(sched) -> threading.Thread:
    def gather():
        with sched._cond:
            sched._gather()

    thread = threading.Thread(target=gather, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("gather_fraction, batch", [(0.0, ["a"]), (0.5, ["a", "b"])])
def test_gathering_waits_for_a_session_expected_back(gather_fraction, batch):
    sched, rng, clock, res, kvs = _two_sessions_in_step(gather_fraction)
    thread = _gather_in_thread(sched)
    thread.join(0.2)
    assert thread.is_alive() == bool(gather_fraction)  # waiting for b only when gathering
    if not gather_fraction:
        sched.run_once()  # the loop runs a at once, alone
    submit(sched, res, "b", kvs["b"], 1)  # b's step arrives: a wait ends (no timeout involved)
    thread.join(10)
    assert not thread.is_alive() and sched.gather_waits == int(bool(gather_fraction))
    if gather_fraction:
        sched.run_once()
    assert [k for k, _ in rng.batches[2]] == [id(kvs[n]) for n in batch]


def test_gathering_never_waits_past_its_window_and_forgets_overdue_sessions():
    sched, rng, clock, res, kvs = _two_sessions_in_step(0.5)
    thread = _gather_in_thread(sched)
    thread.join(0.2)
    assert thread.is_alive()
    clock.advance(0.011)  # past the window (half of the 20 ms batches): b does not come
    with sched._cond:
        sched._cond.notify_all()  # what the wait's own timeout does in real time
    thread.join(10)
    assert not thread.is_alive()
    sched.run_once()
    assert [k for k, _ in rng.batches[-1]] == [id(kvs["a"])]
    clock.advance(0.05)  # b is now overdue by more than a window: no batch waits for it any more
    submit(sched, res, "a", kvs["a"], 1)
    with sched._cond:
        sched._gather()  # returns at once (a thread would hang here if it waited)
    assert "b" not in sched._delivered_s
