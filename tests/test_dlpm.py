"""DLPM (deficit counters, quantum Q, prefix locality) with a fake block range and an injected clock."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from petals_chain.errors import InvalidRequestError
from server.policies import DLPMPolicy, make_policy, parse_policy_args
from server.policy_base import AdmissionRequest, WorkItem
from tests.test_scheduler import FakeKV, Results, make, run_all, submit


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.sampled_from(["f", "g", "h"]), st.sampled_from([1, 1, 1, 2, 7, 40, 300])), min_size=3, max_size=60
    ),
    budget=st.integers(4, 64),
    q=st.sampled_from([1.0, 16.0, 100.0, 1000.0]),
    w_in=st.sampled_from([1.0, 0.5]),
    w_out=st.sampled_from([2.0, 1.0]),
)
def test_dlpm_service_gap_of_backlogged_clients_within_2_u_plus_q(sizes, budget, q, w_in, w_out):
    """Theorem 4.1: two continuously backlogged clients' service over any interval differs by at
    most 2(U + Q); and q_i stays in (-U, Q] (eq. 1-2 of Theorem A.1). Every client keeps more
    sessions waiting than a batch can take, so it stays backlogged inside every select too."""
    assume(len({c for c, _ in sizes}) >= 2)
    dlpm = DLPMPolicy(q=q, w_in=w_in, w_out=w_out)
    sched, _, clock = make(dlpm, budget=budget)
    res = Results()
    clients = sorted({c for c, _ in sizes})
    pending = {c: [n for cc, n in sizes if cc == c] for c in clients}
    u = max(w_in * budget, w_out)
    sessions: dict[str, tuple[str, FakeKV]] = {}
    for c in clients:
        for s in range(budget + 1):
            name = f"{c}-{s}"
            sessions[name] = (c, FakeKV(5))
            submit(sched, res, name, sessions[name][1], 1, client=c)
    snapshots = [dict.fromkeys(clients, 0.0)]
    for _ in range(25):
        assert sched.run_once() > 0
        for c in clients:
            assert -u < dlpm.deficit[c] <= q + 1e-9
        snapshots.append({c: dlpm.served.get(c, 0.0) for c in clients})
        # what was delivered comes back with its next step (prompts of the drawn sizes, then decodes)
        for name in [n for n in list(res.got) if res.got[n]]:
            c, kv = sessions[name]
            res.got[name] = []
            n = pending[c].pop(0) if pending[c] else 1
            kv.past_tokens = 0 if n > 1 else 5
            submit(sched, res, name, kv, n, client=c)
    bound = dlpm.bound(budget)
    assert bound == 2 * (u + q)
    worst = max(
        abs((b[f] - a[f]) - (b[g] - a[g]))
        for i, a in enumerate(snapshots)
        for b in snapshots[i + 1 :]
        for f in clients
        for g in clients
    )
    assert worst <= bound + 1e-9, f"gap {worst} over 2(U+Q) = {bound}"
    assert clock() > 0  # the injected clock moved with the fake compute, nothing else did
    dlpm.drain()


def test_dlpm_prefers_the_longest_cached_prefix_among_clients_with_credit():
    dlpm = DLPMPolicy(q=100.0)
    sched, rng, _ = make(dlpm, budget=8)
    res = Results()
    kvs = {n: FakeKV(0) for n in ("plain", "hit")}
    sched.submit(_step(kvs["plain"], 8, "plain", "a"), res.deliver("plain"))
    sched.submit(_step(kvs["hit"], 8, "hit", "b", prefix_tokens=64), res.deliver("hit"))
    sched.run_once()
    assert rng.batches[0] == [(id(kvs["hit"]), 8)]  # arrived later, but its session reused 64 tokens
    run_all(sched)


def test_dlpm_deficit_rotates_clients_by_quantum():
    """Algorithm 1 by hand (Q=4, unit costs, 2 tokens a batch): a client with credit keeps the
    batch until its quantum is spent; refill happens only when no waiting client has credit."""
    dlpm = DLPMPolicy(q=4.0, w_in=1.0, w_out=1.0)
    sched, rng, _ = make(dlpm, budget=2)
    res = Results()
    names = {}
    for client in "ab":
        for i in range(6):
            kv = FakeKV(5)
            names[id(kv)] = f"{client}{i}"
            submit(sched, res, f"{client}{i}", kv, 1, client=client)
    run_all(sched)
    batches = [[names[k] for k, _ in batch] for batch in rng.batches]
    assert batches == [["a0", "a1"], ["a2", "a3"], ["b0", "b1"], ["b2", "b3"], ["a4", "a5"], ["b4", "b5"]]
    assert dlpm.served == {"a": 6.0, "b": 6.0} and dlpm.refills == 2


def test_dlpm_admits_credit_first_then_longest_prefix_then_arrival():
    dlpm = DLPMPolicy(q=10.0)
    dlpm.deficit.update({"rich": 5.0, "rich2": 5.0, "broke": -3.0})
    reqs = [
        AdmissionRequest(0, "s0", "broke", 10, 0.0, prefix_match_tokens=512),
        AdmissionRequest(1, "s1", "rich", 10, 0.0, prefix_match_tokens=0),
        AdmissionRequest(2, "s2", "rich2", 10, 0.0, prefix_match_tokens=64),
    ]
    for r in reqs:
        dlpm.on_admission_wait(r)
    assert dlpm.admit(reqs).session_id == "s2"
    assert dlpm.admit(reqs[:2]).session_id == "s1"
    # only the broke client fits: the others still wait with credit, so no refill, but memory is not left idle
    assert dlpm.admit(reqs[:1]).session_id == "s0" and dlpm.deficit["broke"] == -3.0
    for r in reqs[1:]:
        dlpm.on_admission_end(r)
    assert dlpm.admit(reqs[:1]).session_id == "s0" and dlpm.deficit["broke"] == 7.0  # CheckRefill: nobody has credit


def test_dlpm_client_waiting_for_memory_holds_back_refills_but_not_the_batch():
    """A running client out of credit is not refilled while another client waits for memory with
    credit; its steps still use the batch room nobody with credit can use (charged below zero)."""
    dlpm = DLPMPolicy(q=4.0, w_in=1.0, w_out=1.0)
    sched, rng, _ = make(dlpm, budget=4)
    res = Results()
    dlpm.on_admission_wait(AdmissionRequest(0, "w", "waiter", 10, 0.0))
    dlpm.deficit["waiter"] = 4.0
    dlpm.deficit["runner"] = 0.0
    submit(sched, res, "r0", FakeKV(0), 3, client="runner")
    sched.run_once()
    assert rng.batches[0][0][1] == 3 and dlpm.deficit["runner"] == -3.0 and dlpm.refills == 0


def test_dlpm_params_are_validated():
    assert parse_policy_args("dlpm", ["q=256", "w_out=2"]) == {"q": 256.0, "w_out": 2.0}
    for bad in (["q=0"], ["q=-5"], ["quantum=3"]):
        with pytest.raises(InvalidRequestError):
            parse_policy_args("dlpm", bad)
    with pytest.raises(InvalidRequestError):
        make_policy("dlpm", {"w_in": 0.0, "w_out": 0.0})
    assert isinstance(make_policy("dlpm", {"q": 8.0}), DLPMPolicy)


def test_work_item_split_keeps_the_prefix_locality():
    item = WorkItem(0, "s", "c", 10, 0, 0.0, prefix_tokens=32)
    tail = item.split(4, 1)
    assert tail.prefix_tokens == 32 and tail.is_prefill and tail.past_tokens == 4


def _step(kv, n, key, client_id, prefix_tokens=0):
    import torch

    from server.step_request import StepRequest

    return StepRequest(kv, torch.zeros(n, 2), key=key, client_id=client_id, prefix_tokens=prefix_tokens)
