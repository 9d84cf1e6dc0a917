import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.bounds import exact_ctmc_mean_response_time, theorem37_bounds
from orchestrator.dispatch import DISPATCHERS, Start, make_dispatcher
from orchestrator.model import BlockInterval, ChainSpec
from tests.orchestrator_strategies import simulate


def chain(t, c):
    return ChainSpec((0,), (BlockInterval(0, 1),), c, t)


def test_jffc_algorithm_3_by_hand():
    d = make_dispatcher("jffc", [chain(3.0, 1), chain(1.0, 2)])  # chain 1 is the fastest
    assert d.on_arrival(0) == [Start(0, 1, 1.0)]
    assert d.on_arrival(1) == [Start(1, 1, 1.0)]
    assert d.on_arrival(2) == [Start(2, 0, 3.0)]  # fastest chain full: next fastest free one
    assert d.on_arrival(3) == [] and d.on_arrival(4) == [] and d.queue_length == 2
    assert d.on_completion(2) == [Start(3, 0, 3.0)]  # line 8: queue head takes the freed chain
    assert d.on_completion(0) == [Start(4, 1, 1.0)]
    assert d.queue_length == 0
    assert d.on_completion(4) == [] and d.on_completion(1) == [] and d.busy == (1, 0)
    assert d.on_arrival(5) == [Start(5, 1, 1.0)]  # the fast chain is preferred again


def test_unknown_policy_and_bad_chains():
    with pytest.raises(ValueError, match="unknown dispatch policy"):
        make_dispatcher("random", [chain(1.0, 1)])
    with pytest.raises(ValueError):
        make_dispatcher("jffc", [])
    with pytest.raises(ValueError):
        make_dispatcher("jsq", [chain(1.0, 0)])


def test_sa_jsq_and_sed_prefer_fast_chains_on_ties():
    for name in ("sa-jsq", "sed"):
        d = make_dispatcher(name, [chain(5.0, 1), chain(1.0, 1)])
        assert d.on_arrival(0)[0].chain_id == 1


def test_sed_weighs_queue_by_speed():
    d = make_dispatcher("sed", [chain(1.0, 1), chain(10.0, 1)])
    # job n on chain 0 expects n + 1 s (n ahead of it), chain 1 expects 10 s; ties go to the faster
    assert d.on_arrival(0)[0].chain_id == 0
    for n in range(1, 10):
        assert d.on_arrival(n) == []
    assert d.on_arrival(10)[0].chain_id == 1
    assert d.queue_length == 9


def test_jffc_simulation_matches_exact_ctmc_and_bounds():
    chains = [chain(1.0, 2), chain(2.5, 3)]
    lam = 2.0
    rng = np.random.default_rng(7)
    sims = [simulate(make_dispatcher("jffc", chains), lam, 20_000, rng) for _ in range(2)]
    exact = exact_ctmc_mean_response_time(chains, lam)
    b = theorem37_bounds(chains, lam)
    assert b.lower_s < exact < b.upper_s
    assert np.mean(sims) == pytest.approx(exact, rel=0.05)


@pytest.mark.parametrize("name", sorted(DISPATCHERS))
def test_all_policies_serve_every_job_in_simulation(name):
    chains = [chain(1.0, 2), chain(2.5, 3), chain(4.0, 1)]
    d = make_dispatcher(name, chains, np.random.default_rng(1))
    mean = simulate(d, 1.5, 3000, np.random.default_rng(2))
    assert mean >= 1.0 * 0.8 and d.queue_length == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.1, 10.0), st.integers(1, 4)), min_size=1, max_size=5),
    st.lists(st.booleans(), min_size=1, max_size=120),
    st.sampled_from(sorted(DISPATCHERS)),
    st.integers(0, 10**6),
)
def test_dispatch_invariants(pairs, ops, name, seed):
    """Random arrival/completion sequences: capacities hold, every job starts once, and JFFC is
    work conserving, FIFO and picks the fastest free chain."""
    chains = [chain(t, c) for t, c in pairs]
    d = make_dispatcher(name, chains, np.random.default_rng(seed))
    rng = np.random.default_rng(seed)
    running: dict[int, int] = {}
    started_order: list[int] = []
    waiting_order: list[int] = []
    busy = [0] * len(chains)
    next_job = 0

    def apply(starts):
        for s in starts:
            assert s.job_id not in running and s.service_time_s == chains[s.chain_id].service_time_s
            running[s.job_id] = s.chain_id
            busy[s.chain_id] += 1
            assert busy[s.chain_id] <= chains[s.chain_id].capacity
            started_order.append(s.job_id)
            if s.job_id in waiting_order:
                waiting_order.remove(s.job_id)

    for is_arrival in ops + [False] * 200:
        if is_arrival:
            free_before = [k for k in range(len(chains)) if busy[k] < chains[k].capacity]
            starts = d.on_arrival(next_job)
            if name == "jffc":
                if free_before:
                    fastest = min(chains[k].service_time_s for k in free_before)
                    assert len(starts) == 1 and chains[starts[0].chain_id].service_time_s == fastest
                else:
                    assert starts == []
            if not starts:
                waiting_order.append(next_job)
            apply(starts)
            next_job += 1
        elif running:
            job = sorted(running)[int(rng.integers(len(running)))]
            k = running.pop(job)
            busy[k] -= 1
            before = list(waiting_order)
            starts = d.on_completion(job)
            if name == "jffc" and before:
                assert [s.job_id for s in starts] == [before[0]]  # FIFO head, onto the freed chain
                assert starts[0].chain_id == k
            apply(starts)
        assert d.queue_length == len(waiting_order)
        if name == "jffc" and d.queue_length:
            assert all(busy[k] == chains[k].capacity for k in range(len(chains)))
    assert not running and d.queue_length == 0 and sorted(started_order) == list(range(next_job))
