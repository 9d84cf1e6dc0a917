"""The orchestrator's central queue with `--queue fair`: VTC counters over granted sessions (pure)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from orchestrator.service.sessions import Sessions
from petals_chain.wire.messages import Hop


def hops(*peers):
    return tuple(Hop(p, i * 10, (i + 1) * 10) for i, p in enumerate(peers))


def chains():
    return [(hops("a", "b"), 2, 1.0, 4096), (hops("c", "d"), 1, 2.0, 4096)]


@pytest.mark.parametrize("queue", ["fifo", "fair"])
def test_flooder_cannot_starve_a_light_client(queue):
    ds = Sessions(lease_ttl_s=1e9, queue=queue)
    ds.install_chains(chains(), 1, 0.0)
    running = []
    for i in range(20):  # the flooder: 20 sessions, 3 get slots, 17 wait
        g, _ = ds.acquire(f"f{i}", "flooder", 64, float(i), timeout_s=1e6)
        if g:
            running.append(g.session_id)
    assert len(running) == 3 and ds.queue_length == 17
    g, _ = ds.acquire("light", "light-client", 64, 100.0, timeout_s=1e6)
    assert g is None
    releases = 0
    t = 100.0
    while "light" not in running:
        t += 1
        done = running.pop(0)
        grants = ds.release(done, t)  # no lengths reported: only the counters charged at the grants count
        releases += 1
        running += [x.session_id for x in grants]
    if queue == "fair":
        assert releases == 1  # the very next freed slot goes to the client with the least service
    else:
        assert releases == 18  # FIFO: behind every flooder session that arrived before it


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["acquire", "release"]),
            st.sampled_from(["x", "y", "z"]),
            st.integers(1, 500),
            st.integers(1, 64),
        ),
        min_size=1,
        max_size=80,
    )
)
def test_fair_queue_keeps_jffc_invariants_and_serves_least_served_client(ops):
    assume(any(op == "release" for op, *_ in ops))
    ds = Sessions(lease_ttl_s=1e9, queue="fair")
    ds.install_chains(chains(), 1, 0.0)
    charge = ds.w_in * ds.expected_tokens[0] + ds.w_out * ds.expected_tokens[1]
    leases: list[str] = []
    client_of: dict[str, str] = {}
    for k, (op, client, n_in, n_out) in enumerate(ops):
        waiting_before = {w.client_id for w in ds.queue.values()}
        if op == "acquire":
            client_of[f"s{k}"] = client
            g, others = ds.acquire(f"s{k}", client, 64, float(k), timeout_s=1e9)
            grants = ([g] if g else []) + others
        else:
            if not leases:
                continue
            grants = ds.release(leases.pop(0), float(k), input_tokens=n_in, output_tokens=n_out)
            assert len(grants) <= 1  # one slot freed
            if grants:  # it went to a waiting client whose counter was the smallest
                winner = client_of[grants[0].session_id]
                counters = {c: ds.client_service[c] - (charge if c == winner else 0.0) for c in waiting_before}
                assert counters[winner] <= min(counters.values()) + 1e-9
        leases += [g.session_id for g in grants]
        for ch in ds.chains.values():
            assert 0 <= ch.in_use <= ch.capacity
        # work conserving: nothing waits while a chain has a free slot
        assert ds.queue_length == 0 or all(ch.in_use == ch.capacity for ch in ds.chains.values())


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.sampled_from(["acquire", "release"]), min_size=1, max_size=60))
def test_fair_with_one_client_is_fifo_jffc(ops):
    """With a single client the fair queue makes exactly the FIFO queue's grants (JFFC)."""
    runs = {}
    for queue in ("fifo", "fair"):
        ds = Sessions(lease_ttl_s=1e9, queue=queue)
        ds.install_chains(chains(), 1, 0.0)
        leases, log = [], []
        for k, op in enumerate(ops):
            if op == "acquire":
                g, others = ds.acquire(f"s{k}", "one", 64, float(k), timeout_s=1e9)
                grants = ([g] if g else []) + others
            elif leases:
                grants = ds.release(leases.pop(0), float(k), input_tokens=10, output_tokens=3)
            else:
                grants = []
            leases += [g.session_id for g in grants]
            log += [(g.session_id, g.chain_id) for g in grants]
        runs[queue] = log
    assert runs["fifo"] == runs["fair"]


def test_orchestrator_cli_queue_flag():
    from orchestrator.service.cli import build_parser

    # a well-formed address (the parser checks it)
    peer = "/ip4/127.0.0.1/tcp/1/p2p/QmW91aaAN3fKnU9CDMMrWLyRmaiaBFqwKKgqDTm6LaWpUc"
    assert build_parser().parse_args(["--initial-peers", peer]).queue == "fifo"  # the paper's JFFC by default
    assert build_parser().parse_args(["--initial-peers", peer, "--queue", "fair"]).queue == "fair"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--initial-peers", peer, "--queue", "lifo"])
    with pytest.raises(ValueError):
        Sessions(queue="lifo")
