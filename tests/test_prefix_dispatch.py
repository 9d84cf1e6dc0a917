"""The prompt-aware dispatch policies (orchestrator.dispatch: e2, d2lpm, rr-lpm, vtc-rr), the global prefix
index (orchestrator.prefix_index) and the prefix-aware simulator (orchestrator.sim.prefix_engine)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from orchestrator.dispatch import (
    PROMPT_AWARE,
    D2lpmDispatcher,
    DispatchRequest,
    PrefixParams,
    ServerCost,
    Start,
    make_dispatcher,
)
from orchestrator.model import BlockInterval, ChainSpec
from orchestrator.prefix_index import HopKey, PrefixIndex, namespace
from orchestrator.sim.prefix_engine import LruPrefixCache, jain_index, simulate_prefix
from orchestrator.sim.prefix_workloads import PromptRequest, prompt_requests

POLICIES = sorted(PROMPT_AWARE)


def chains_of(n: int, capacity: int = 2, hops: int = 2) -> list[ChainSpec]:
    blocks = tuple(BlockInterval(4 * h, 4 * h + 4) for h in range(hops))
    return [ChainSpec(tuple(hops * k + h for h in range(hops)), blocks, capacity, 1.0 + 0.1 * k) for k in range(n)]


def prompt(prefix: int, n_chunks: int, unique: int) -> tuple:
    """Chunk names: a shared prefix family `prefix`, then one unique chunk."""
    return tuple(("p", prefix, i) for i in range(n_chunks)) + (("u", unique),)


# -- the index ----------------------------------------------------------------------------------
def test_chain_match_is_the_minimum_over_hops_and_scoped_by_client():
    idx = PrefixIndex(sharing="client")
    h = [f"{i:032x}" for i in range(10)]
    a, b = HopKey("s0", 0), HopKey("s1", 4)
    for x in h:
        idx.insert("s0", namespace("client", "alice", 0), x)
    for x in h[:5]:
        idx.insert("s1", namespace("client", "alice", 4), x)
    assert idx.chain_match_tokens([a, b], "alice", h, 10 * 16 + 3) == 5 * 16
    assert idx.chain_match_tokens([a], "alice", h, 10 * 16) == 9 * 16  # one token is always left to run
    assert idx.chain_match_tokens([a, b], "bob", h, 200) == 0  # client scope: bob never sees alice's prefixes
    swarm = PrefixIndex(sharing="swarm")
    swarm.learn([a, b], "alice", h)
    assert swarm.chain_match_tokens([a, b], "bob", h, 200) == 10 * 16


def test_index_is_bounded_lru_and_evictions_prune():
    idx = PrefixIndex(sharing="swarm", max_entries=4)
    ns = namespace("swarm", "x", 0)
    for i in range(6):
        idx.insert("s", ns, i)
    assert len(idx) == 4 and idx.held_by("s") == {(ns, i) for i in range(2, 6)} and idx.dropped_lru == 2
    idx.apply("s", inserted=[(ns, 9)], evicted=[(ns, 3), (ns, 9)])
    assert idx.held_by("s") == {(ns, 4), (ns, 5)} and idx.dropped_lru == 3  # 9 pushed 2 out, then was evicted
    idx.replace_server("s", [(ns, 7)])
    assert idx.held_by("s") == {(ns, 7)}


def test_learned_entries_wait_for_their_session_before_reports_can_drop_them():
    """A server stores a prompt's chunks once it ran them: reports during a long prefill must not drop what
    the grant taught (the requests sharing the prefix meanwhile would be dispatched as if nothing held it);
    two reports after the session ended, an unconfirmed entry goes; one that never settles, after a bound."""
    from orchestrator.prefix_index import PENDING_MAX_REPORTS, PROVISIONAL_REPORTS

    chains = chains_of(2, capacity=4, hops=1)
    idx = PrefixIndex(sharing="swarm")
    d = make_dispatcher("e2", chains, index=idx, params=PrefixParams(hold_completions=0))  # no holds here
    for server in (0, 1):
        idx.apply(server, [], [])  # both servers report (their first, empty, reports)
    d.on_arrival(0, None, DispatchRequest("a", prompt(4, 20, 0), 21 * 16, 4))  # load on one server
    shared = prompt(3, 20, 0)[:-1]
    [first] = d.on_arrival(1, None, DispatchRequest("a", shared + (("u", 1),), 21 * 16, 4))  # explores the other
    for _ in range(3 * PROVISIONAL_REPORTS):  # the prefill is still running: nothing confirmed yet
        idx.apply(first.chain_id, [], [])
    [second] = d.on_arrival(2, None, DispatchRequest("a", shared + (("u", 2),), 21 * 16, 4))
    assert second.chain_id == first.chain_id  # exploits the prefix the first request is computing there
    d.on_completion(1)
    for _ in range(PROVISIONAL_REPORTS):  # job 2 still runs on the same hop and keeps the shared entries
        idx.apply(first.chain_id, [], [])
    assert d.match_tokens(first.chain_id, DispatchRequest("a", shared, 20 * 16, 4)) == 19 * 16
    d.on_completion(2)
    idx.apply(first.chain_id, [], [])
    assert d.match_tokens(first.chain_id, DispatchRequest("a", shared, 20 * 16, 4)) == 19 * 16
    idx.apply(first.chain_id, [], [])  # the server never reported storing them: gone
    assert d.match_tokens(first.chain_id, DispatchRequest("a", shared, 20 * 16, 4)) == 0
    assert idx.dropped_unconfirmed == 21 + 1
    # a session that never settles (its dispatcher replaced) keeps its entries for a bounded number of reports
    idx.learn([HopKey(first.chain_id, 0)], "a", shared)
    for _ in range(PENDING_MAX_REPORTS - 1):
        idx.apply(first.chain_id, [], [])
    assert d.match_tokens(first.chain_id, DispatchRequest("a", shared, 20 * 16, 4)) == 19 * 16
    idx.apply(first.chain_id, [], [])
    assert d.match_tokens(first.chain_id, DispatchRequest("a", shared, 20 * 16, 4)) == 0


# -- every policy keeps JFFC's contract ----------------------------------------------------------
events = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "complete", "cancel"]),
        st.integers(0, 3),
        st.integers(0, 6),
        st.integers(0, 3),
        st.booleans(),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), evs=events, n_chains=st.integers(1, 4))
def test_policies_respect_capacity_allowed_sets_and_the_central_queue(policy, evs, n_chains):
    check_contract(make_dispatcher(policy, chains_of(n_chains), index=PrefixIndex(sharing="swarm")), evs, n_chains)


# about one example in five holds a job (the rest are discarded by `assume`): the filter is expected
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(evs=events, n_chains=st.integers(2, 3), capacity=st.integers(1, 2))
def test_e2_holds_keep_the_contract_and_every_held_job_starts(evs, n_chains, capacity):
    """Two long prefix families and few slots: e2 holds newcomers for busy chains (the contract's one
    exception to work conservation), and every held job still starts (draining finishes all). No
    rebalancing (an idle server in E2's window would send every such newcomer to explore instead)."""
    params = PrefixParams(th_bal=float("inf"))
    d = make_dispatcher("e2", chains_of(n_chains, capacity), index=PrefixIndex(sharing="swarm"), params=params)
    check_contract(d, evs, n_chains, capacity, families=2)
    assume(d.holds > 0)


def check_contract(d, evs, n_chains: int, capacity: int = 2, families: int = 3) -> None:
    chains = chains_of(n_chains, capacity)
    running: dict[int, int] = {}
    waiting: dict[int, frozenset | None] = {}
    job = 0

    def started(starts):
        for s in starts:
            assert s.job_id in waiting, "a job started that was not waiting"
            allowed = waiting.pop(s.job_id)
            assert allowed is None or s.chain_id in allowed
            running[s.job_id] = s.chain_id

    for kind, client, prefix, chain, restrict in evs:
        if kind == "arrive":
            job += 1
            allowed = frozenset({chain % n_chains}) if restrict else None
            waiting[job] = allowed
            n = prefix if families == 3 else 12
            started(
                d.on_arrival(
                    job,
                    allowed,
                    DispatchRequest(f"c{client}", prompt(prefix % families, n, job), 16 * (n + 1) + 5, 4),
                )
            )
        elif kind == "complete" and running:
            j = sorted(running)[prefix % len(running)]
            del running[j]
            started(d.on_completion(j))
        elif kind == "cancel" and waiting:
            j = sorted(waiting)[prefix % len(waiting)]
            del waiting[j]
            d.cancel(j)
        busy = [sum(1 for k in running.values() if k == c) for c in range(n_chains)]
        assert all(b <= ch.capacity for b, ch in zip(busy, chains))
        assert list(d.busy) == busy and d.queue_length == len(waiting)
        held = getattr(d, "held", {})
        for j, allowed in waiting.items():  # work conserving: nobody waits while a chain it may use is free...
            if j in held:  # ... but a job e2 holds for busy chains that hold its prefix (one of them runs a job)
                assert held[j] and (allowed is None or held[j] <= allowed) and any(busy[c] for c in held[j])
                continue
            assert all(busy[c] == chains[c].capacity for c in range(n_chains) if allowed is None or c in allowed)
    while running:  # draining finishes every waiting job
        j = min(running)
        del running[j]
        started(d.on_completion(j))
    assert not waiting


# -- E2 ----------------------------------------------------------------------------------------
def test_e2_exploits_the_longest_usable_match_and_explores_by_load_cost():
    chains = chains_of(3, capacity=4)
    idx = PrefixIndex(sharing="swarm")
    d = make_dispatcher("e2", chains, index=idx)
    long_prefix = prompt(7, 20, 0)[:-1]
    # chain 2 holds the prefix on both hops, chain 1 only on its first hop: a chain reuses the minimum
    idx.learn(d._hops[2], "a", long_prefix)
    idx.learn(d._hops[1][:1], "a", long_prefix)
    [s] = d.on_arrival(1, None, DispatchRequest("a", long_prefix + (("u", 1),), 21 * 16, 4))
    assert s.chain_id == 2  # exploit: 320 matched > 16 missed
    # a prompt with nothing matched explores: the chain of least load (chain 2 now carries job 1's load)
    [s] = d.on_arrival(2, None, DispatchRequest("a", prompt(8, 20, 1), 21 * 16, 4))
    assert s.chain_id != 2


def test_e2_holds_a_newcomer_for_the_busy_chain_that_holds_its_prefix_within_a_bound():
    chains = chains_of(2, capacity=1, hops=1)
    idx = PrefixIndex(sharing="swarm")
    d = make_dispatcher("e2", chains, index=idx, params=PrefixParams(hold_completions=2))
    for server in (0, 1):
        idx.apply(server, [], [])
    doc, other, third = (prompt(p, 20, 0)[:-1] for p in (5, 6, 7))

    def req(hashes, j):
        return DispatchRequest("a", hashes + (("u", j),), 21 * 16, 4)

    [o] = d.on_arrival(0, None, req(other, 0))
    [a] = d.on_arrival(1, None, req(doc, 1))  # explores the other chain
    d.on_completion(0)  # both servers carry load in E2's window (no rebalancing below)
    # the document again while job 1 still computes it on a busy chain, the other chain free: it waits
    assert d.on_arrival(2, None, req(doc, 2)) == []
    assert d.held == {2: frozenset({a.chain_id})} and d.holds == 1
    [b] = d.on_arrival(3, None, req(third, 3))  # an unrelated prompt does not wait: it takes the free chain
    assert b.chain_id == o.chain_id
    [s] = d.on_completion(1)  # job 1 ran the document: job 2 goes where it is now
    assert (s.job_id, s.chain_id) == (2, a.chain_id) and not d.held
    # held again, its chain stays busy: after hold_completions completions elsewhere it takes a free chain
    assert d.on_completion(3) == []  # chain o free again, job 2 still runs on chain a
    assert d.on_arrival(4, None, req(doc, 4)) == [] and d.held == {4: frozenset({a.chain_id})}
    for j in (5, 6):
        [c] = d.on_arrival(j, None, req(third, j))
        assert c.chain_id == o.chain_id
        starts = d.on_completion(j)  # a completion elsewhere
    assert starts == [Start(4, o.chain_id, chains[o.chain_id].service_time_s)] and not d.held
    # no hold: the paper's E2 (hold_completions=0); or chains whose slot is expected later (T_k / c_k = 1 s)
    # than the prefill saved would take (t_I = 1 us per block and token: 320 tokens x 4 blocks = 1.3 ms)
    cheap = {0: ServerCost(1e-6, 1e-6), 1: ServerCost(1e-6, 1e-6)}
    for kw in ({"params": PrefixParams(hold_completions=0)}, {"costs": cheap}):
        d0 = make_dispatcher("e2", chains, index=PrefixIndex(sharing="swarm"), **kw)
        for server in (0, 1):
            d0.index.apply(server, [], [])
        d0.on_arrival(0, None, req(other, 0))
        [x] = d0.on_arrival(1, None, req(doc, 1))
        d0.on_completion(0)
        [y] = d0.on_arrival(2, None, req(doc, 2))
        assert x.chain_id != y.chain_id and d0.holds == 0


def test_e2_sends_a_starving_job_to_the_chain_that_holds_its_prefix_not_the_first_that_frees():
    """Past max_skips a waiting job goes first, at the next slot of a chain where its match is longest:
    not onto another chain that frees first, where it would prefill what its own chain holds."""
    chains = chains_of(2, capacity=1, hops=1)
    idx = PrefixIndex(sharing="swarm")
    params = PrefixParams(max_skips=1, hold_completions=0, th_bal=float("inf"))
    d = make_dispatcher("e2", chains, index=idx, params=params)
    for server in (0, 1):
        idx.apply(server, [], [])
    doc_a, doc_b = prompt(1, 20, 0)[:-1], prompt(2, 20, 0)[:-1]

    def req(hashes, j):
        return DispatchRequest("a", hashes + (("u", j),), 21 * 16, 4)

    [a] = d.on_arrival(1, None, req(doc_a, 1))
    [b] = d.on_arrival(2, None, req(doc_b, 2))
    assert a.chain_id != b.chain_id
    assert d.on_arrival(3, None, req(doc_a, 3)) == [] and d.on_arrival(4, None, req(doc_b, 4)) == []
    [s] = d.on_completion(2)  # b's chain frees: job 4 matches there, job 3 is passed over (now starving)
    assert (s.job_id, s.chain_id) == (4, b.chain_id)
    assert d.on_arrival(5, None, req(doc_b, 5)) == []
    # b's chain frees again: job 3 is starving but holds nothing there; job 5 (a match) takes it
    [s] = d.on_completion(4)
    assert (s.job_id, s.chain_id) == (5, b.chain_id)
    assert d.on_arrival(6, None, req(doc_a, 6)) == []
    # a's chain frees: job 3 goes first there, before job 6's equal match (and it reuses its prefix)
    [s] = d.on_completion(1)
    assert (s.job_id, s.chain_id) == (3, a.chain_id)
    assert d.match_tokens(a.chain_id, req(doc_a, 3)) == 20 * 16
    # a starving job that no chain holds enough of to be worth waiting for (a's chain holds 5 of its 20
    # chunks: matched < missed) takes the first slot that frees, wherever
    [s] = d.on_completion(5)  # b's chain: job 6 (nothing matched there) takes it
    assert (s.job_id, s.chain_id) == (6, b.chain_id)
    partly_a = doc_a[:5] + tuple(("q", i) for i in range(15))
    assert d.on_arrival(7, None, req(partly_a, 7)) == [] and d.on_arrival(8, None, req(doc_a, 8)) == []
    [s] = d.on_completion(3)  # a's chain: job 8 (320 matched) passes job 7 (80) over: job 7 starves
    assert (s.job_id, s.chain_id) == (8, a.chain_id)
    assert d.on_arrival(9, None, req(doc_b, 9)) == []
    [s] = d.on_completion(6)  # b's chain: job 7 goes, before job 9's longer match there
    assert (s.job_id, s.chain_id) == (7, b.chain_id)


def test_e2_rebalances_away_from_a_server_over_th_bal():
    chains = chains_of(2, capacity=50, hops=1)
    costs = {0: ServerCost(1.0, 1.0), 1: ServerCost(1.0, 1.0)}
    d = make_dispatcher("e2", chains, costs=costs, params=PrefixParams(th_bal=2.0))
    hot = prompt(1, 10, 0)[:-1]
    starts = [d.on_arrival(j, None, DispatchRequest("a", hot + (("u", j),), 11 * 16, 1))[0] for j in range(20)]
    on = [s.chain_id for s in starts]
    # the second would exploit chain 0, whose server's load is over 2x the idle one's: it explores chain 1;
    # from then on both chains hold the prefix and exploitation picks the lower load cost
    assert on[:2] == [0, 1] and d.rebalanced >= 1 and abs(on.count(0) - on.count(1)) <= 2


# -- D2LPM ---------------------------------------------------------------------------------------
def test_d2lpm_select_worker_spreads_a_client_once_its_chain_quantum_is_spent():
    chains = chains_of(2, capacity=100, hops=1)
    d = make_dispatcher("d2lpm", chains, params=PrefixParams(quantum_chain=100.0))
    hot = prompt(1, 4, 0)[:-1]
    on = [d.on_arrival(j, None, DispatchRequest("a", hot + (("u", j),), 5 * 16, 1))[0].chain_id for j in range(6)]
    # q_{a,k} starts at 0: replenished by 100, spent 80 per request, so the client moves between chains
    assert set(on) == {0, 1}


def test_d2lpm_serves_a_light_client_before_a_flooders_backlog():
    chains = chains_of(1, capacity=1, hops=1)
    d = make_dispatcher("d2lpm", chains, params=PrefixParams(quantum_client=20.0))
    req = DispatchRequest("flood", prompt(1, 4, 0), 5 * 16, 4)
    d.on_arrival(0, None, req)
    for j in range(1, 20):
        d.on_arrival(j, None, DispatchRequest("flood", prompt(1, 4, j), 5 * 16, 4))
    d.on_arrival(99, None, DispatchRequest("light", prompt(2, 4, 99), 5 * 16, 4))
    served = []
    running = 0
    for _ in range(4):
        [s] = d.on_completion(running)
        served.append(s.job_id)
        running = s.job_id
    assert 99 in served[:2]  # FIFO would serve it 20th; a flooder request (24) spends its quantum (20)


def test_d2lpm_a_client_idle_through_a_round_keeps_its_credit():
    """Alg. 1's CheckRefill refills every known client at or below 0, not only the waiting ones: a light
    client that was idle while the flooder's backlog was refilled comes back eligible and is served at the
    next freed slot, not after the flooder has spent another whole quantum on its cached prefix."""
    chains = chains_of(1, capacity=1, hops=1)
    d = make_dispatcher("d2lpm", chains, params=PrefixParams(quantum_client=100.0))
    assert d.on_arrival(0, None, DispatchRequest("light", prompt(2, 4, 0), 5 * 16, 4))  # on the free chain: -88
    for j in range(1, 30):
        assert not d.on_arrival(j, None, DispatchRequest("flood", prompt(1, 4, j), 5 * 16, 4))
    [s] = d.on_completion(0)  # nobody waiting may be served: a refill (light -88 -> 12, flood 0 -> 100)
    assert s.job_id == 1 and abs(d.client_deficit["light"] - 12.0) < 1e-9
    [s] = d.on_completion(1)  # the flooder's hits cost 16 + 8 each: its quantum lasts several grants
    assert not d.on_arrival(99, None, DispatchRequest("light", prompt(2, 4, 99), 5 * 16, 4))
    served = []
    running = s.job_id
    for _ in range(6):
        [s] = d.on_completion(running)
        served.append(s.job_id)
        running = s.job_id
    # eligible (12 > 0) from its arrival: served as soon as the flooder's refill is spent (12 - 24 < 0 after
    # one more grant), and never after a second quantum of the flooder's
    assert 99 in served[:2], served


def test_d2lpm_a_light_clients_miss_waits_for_at_most_fair_skips_of_other_clients_grants():
    """DLPM's deficits bound service, not the order among clients with credit: under the paper's order a
    light client's miss loses every freed slot to a flooder's hits for as long as the flooder's quantum
    lasts. With fair_skips it goes first once other clients' grants passed it over that many times; a
    client's own grants never count (the flooder's miss keeps waiting behind its own hits)."""
    chains = chains_of(1, capacity=1, hops=1)

    def served_order(fair_skips):
        params = PrefixParams(quantum_client=10_000.0, fair_skips=fair_skips)
        d = make_dispatcher("d2lpm", chains, params=params)
        assert d.on_arrival(0, None, DispatchRequest("flood", prompt(1, 4, 0), 5 * 16, 4))  # learns prefix 1
        assert not d.on_arrival(50, None, DispatchRequest("flood", prompt(3, 4, 50), 5 * 16, 4))  # its miss
        assert not d.on_arrival(99, None, DispatchRequest("light", prompt(2, 4, 99), 5 * 16, 4))  # a miss
        for j in range(1, 9):  # the flooder's hits (16 + 8 charged each: its quantum lasts 400 of them)
            assert not d.on_arrival(j, None, DispatchRequest("flood", prompt(1, 4, j), 5 * 16, 4))
        order, running = [], 0
        while True:
            starts = d.on_completion(running)
            if not starts:
                return order
            [s] = starts
            order.append(s.job_id)
            running = s.job_id

    assert served_order(None) == [1, 2, 3, 4, 5, 6, 7, 8, 50, 99]  # the paper's: the light miss last
    order = served_order(2)
    assert order.index(99) == 2 and order.index(50) == 9, order  # passed over twice by the flooder, then first


def test_d2lpm_forgets_idle_clients_past_its_bound_and_status_shows_waiting_ones_first():
    chains = chains_of(2, capacity=1, hops=1)
    d = make_dispatcher("d2lpm", chains)
    d.MAX_CLIENTS = 4
    running = [j for j in range(2) if d.on_arrival(j, None, DispatchRequest(f"c{j}", prompt(j, 2, j), 48, 2))]
    for j in range(2, 12):  # both chains busy: these wait (all distinct clients), then are served in turn
        assert not d.on_arrival(j, None, DispatchRequest(f"c{j}", prompt(j, 2, j), 48, 2))
    while running:
        running += [s.job_id for s in d.on_completion(running.pop(0))]
    assert len(d.client_deficit) == 12  # waiting and running clients are never forgotten
    d.on_arrival(99, None, DispatchRequest("new", prompt(99, 2, 99), 48, 2))
    assert len(d.client_deficit) == 4 and "new" in d.client_deficit  # the longest-known idle ones went
    assert {c for c, _ in d.chain_deficit} <= set(d.client_deficit) and set(d.service) <= set(d.client_deficit)
    view = d.deficits_view(limit=2)
    assert view["clients_known"] == len(d.client_deficit) and len(view["client_deficit"]) == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_chains=st.integers(1, 3),
    capacity=st.integers(1, 2),
    seed=st.integers(0, 10_000),
    quantum=st.sampled_from([50.0, 200.0, 1000.0]),
    steps=st.integers(20, 120),
    fair_skips=st.sampled_from([None, 1, 4, 32]),
)
def test_d2lpm_service_bound_in_every_window(n_chains, capacity, seed, quantum, steps, fair_skips):
    """Theorem 5.1/A.3: over any window in which client f stays backlogged, W_g - W_f <= 2 (U + Q^u) |W|,
    W the service charged at grants (w_e extend tokens + w_q output), U the largest one request's charge;
    with or without the fair_skips order among the clients with credit."""
    rng = np.random.default_rng(seed)
    params = PrefixParams(quantum_client=quantum, quantum_chain=quantum, fair_skips=fair_skips)
    d = make_dispatcher("d2lpm", chains_of(n_chains, capacity), params=params)
    assert isinstance(d, D2lpmDispatcher)
    clients = ["a", "b", "c"]
    max_chunks, max_out = 6, 8
    u_bound = params.w_in * (max_chunks * 16 + 15) + params.w_out * max_out
    running: list[int] = []
    waiting_of = {c: 0 for c in clients}
    job_client: dict[int, str] = {}
    history = []  # after each event: (service per client, backlogged clients)
    job = 0

    def note(starts):
        for s in starts:
            waiting_of[job_client[s.job_id]] -= 1
            running.append(s.job_id)

    for _ in range(steps):
        if running and rng.random() < 0.45:
            j = running.pop(int(rng.integers(len(running))))
            note(d.on_completion(j))
        else:
            job += 1
            c = clients[int(rng.choice(3, p=[0.6, 0.25, 0.15]))]
            job_client[job] = c
            waiting_of[c] += 1
            chunks = int(rng.integers(0, max_chunks + 1))
            req = DispatchRequest(
                c,
                prompt(int(rng.integers(2)), chunks, job),
                chunks * 16 + int(rng.integers(1, 16)),
                int(rng.integers(0, max_out + 1)),
            )
            note(d.on_arrival(job, None, req))
        history.append(({c: d.service.get(c, 0.0) for c in clients}, {c for c in clients if waiting_of[c] > 0}))
    bound = 2 * (u_bound + params.quantum_client) * n_chains
    for a in range(len(history)):
        for b in range(a + 1, len(history)):
            backlogged = set.intersection(*(history[t][1] for t in range(a, b)))
            for f in backlogged:
                wf = history[b][0][f] - history[a][0][f]
                for g in clients:
                    assert history[b][0][g] - history[a][0][g] - wf <= bound, (f, g, a, b)


# -- the simulator --------------------------------------------------------------------------------
def test_lru_cache_evicts_leaves_before_their_prefix():
    gone = []
    c = LruPrefixCache("s", 3, on_evict=lambda s, ns, h: gone.append(h))
    c.store("n", ["a", "b"])
    c.store("n", ["c"])
    c.store("n", ["a", "d"])
    assert gone == ["b"] and c.match_chunks("n", ["a", "d"]) == 2


def test_sim_charges_prefill_only_for_unmatched_tokens():
    chains = chains_of(1, capacity=1)
    costs = {s: ServerCost(0.001, 0.01) for s in chains[0].servers}
    shared = prompt(1, 8, 0)[:-1]
    reqs = [
        PromptRequest(0.0, "a", shared + (("u", 0),), 9 * 16 + 5, 2),
        PromptRequest(100.0, "a", shared + (("u", 1),), 9 * 16 + 5, 2),
    ]
    for policy in ["jffc", "e2"]:
        idx = PrefixIndex(sharing="swarm")
        res = simulate_prefix(
            make_dispatcher(policy, chains, index=idx), chains, reqs, costs=costs, cache_chunks=100, index=idx
        )
        blocks = 8  # two hops of 4 blocks
        assert res.computed_tokens.tolist() == [9 * 16 + 5, 16 + 5]
        assert res.reused_tokens.tolist() == [0, 8 * 16]
        assert np.allclose(
            res.response_s, [blocks * (0.001 * (9 * 16 + 5) + 0.01 * 2), blocks * (0.001 * (16 + 5) + 0.01 * 2)]
        )


def test_sim_index_tracks_the_caches_through_evictions():
    chains = chains_of(2, capacity=2)
    costs = {s: ServerCost(0.001, 0.01) for k in chains for s in k.servers}
    arrivals = np.cumsum(np.random.default_rng(0).exponential(0.5, 300))
    reqs = prompt_requests("tooluse", arrivals, {"a": 1.0, "b": 1.0}, np.random.default_rng(0))
    idx = PrefixIndex(sharing="swarm")
    d = make_dispatcher("e2", chains, index=idx, costs=costs)
    res = simulate_prefix(d, chains, reqs, costs=costs, cache_chunks=300, index=idx)
    assert res.reused_tokens.sum() > 0
    assert jain_index([1.0, 1.0]) == 1.0 and abs(jain_index([1.0, 0.0]) - 0.5) < 1e-12
    # with no delay on the servers' reports the index holds exactly what the caches hold
    assert sum(len(v) for v in res.cache_contents.values()) == len(idx)
    for srv, held in res.cache_contents.items():
        assert idx.held_by(srv) == held and len(held) <= 300
