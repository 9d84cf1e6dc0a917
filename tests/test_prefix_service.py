"""Prompt-aware dispatch in the live service's pieces, without processes: `Acquire`'s prompt fields at the
boundary, the sessions' owner with e2 / d2lpm and its global prefix index, a client flooding acquires, and
the index's convergence to real servers' prefix caches (server/prefix_cache.py) through their reports
(server/prefix_report.py -> orchestrator/service/prefix_reports.py) after churn, eviction and a restart."""

from __future__ import annotations

import pytest
import torch

from orchestrator.dispatch import DispatchRequest, PrefixParams
from orchestrator.service.prefix_reports import PrefixReportReader
from orchestrator.service.sessions import Sessions
from petals_chain.errors import InvalidRequestError, TooManyWaitingError
from petals_chain.runtime.kv_cache import SessionKV
from petals_chain.wire import codec as wire
from petals_chain.wire import records as wire_records
from petals_chain.wire.messages import Acquire, Hop
from petals_chain.wire.prefix_keys import MAX_PREFIX_HASHES, PREFIX_CHUNK_TOKENS, prefix_hashes
from server.memory import KVBudget
from server.prefix_cache import PrefixCache
from server.prefix_report import PrefixReport, prefix_delta

H = [f"{i:032x}" for i in range(8)]


# -- the boundary -----------------------------------------------------------------------------------
def test_acquire_round_trips_its_prompt():
    m = Acquire("s1", 256, prefix_hashes=H[:4], prompt_tokens=70)
    back = wire.decode_request(wire.request(m), Acquire)
    assert back.prefix_hashes == H[:4] and back.prompt_tokens == 70
    assert wire.decode_request(wire.request(Acquire("s1", 8)), Acquire).prefix_hashes is None  # an older client


@pytest.mark.parametrize(
    "fields, what",
    [
        ({"prefix_hashes": ["x" * 32], "prompt_tokens": 100}, "hex"),
        ({"prefix_hashes": [1], "prompt_tokens": 100}, "prefix_hashes"),
        ({"prefix_hashes": "0" * 32, "prompt_tokens": 100}, "prefix_hashes"),
        ({"prefix_hashes": ["0" * 32] * (MAX_PREFIX_HASHES + 1), "prompt_tokens": 100}, "at most"),
        ({"prefix_hashes": H[:4]}, "prompt_tokens"),
        ({"prefix_hashes": H[:4], "prompt_tokens": 4 * PREFIX_CHUNK_TOKENS - 1}, "more than prompt_tokens"),
        ({"prompt_tokens": 300}, "max_length"),
        ({"prompt_tokens": -1}, "max_length"),
    ],
)
def test_acquire_refuses_bad_prompt_fields_with_a_typed_error(fields, what):
    with pytest.raises(InvalidRequestError, match=what):
        Acquire.from_wire({"session_id": "s1", "max_length": 256, **fields})


# -- the sessions' owner --------------------------------------------------------------------------------
def two_chains() -> list:
    a = (Hop("A0", 0, 4), Hop("A1", 4, 8))
    b = (Hop("B0", 0, 4), Hop("B1", 4, 8))
    return [(a, 2, 1.0, 1024), (b, 2, 1.0, 1024)]


def req(client: str, hashes: list[str], tokens: int) -> DispatchRequest:
    return DispatchRequest(client, tuple(hashes), tokens, 8)


@pytest.mark.parametrize("policy", ["e2", "d2lpm"])
def test_a_session_goes_where_its_prefix_is_cached_and_only_its_own_under_client_scope(policy):
    s = Sessions(prefix_sharing="client")
    s.install_chains(two_chains(), 1, 0.0, dispatch=policy)
    # chain B's servers hold alice's prompt (their report said so); the index is keyed by peer and entry block
    s.prefix_report("B0", [("alice|0", h) for h in H], [])
    s.prefix_report("B1", [("alice|4", h) for h in H], [])
    g, _ = s.acquire("a1", "alice", 256, 0.0, timeout_s=10, request=req("alice", H, 8 * 16 + 3))
    assert [h.peer_id for h in g.hops] == ["B0", "B1"]
    st = s.prefix_status()
    assert st["index_entries"] == 16 and st["prefix_sharing"] == "client"
    assert st["chain_hit_rate"][str(g.chain_id)] == pytest.approx(8 * 16 / (8 * 16 + 3))
    if policy == "d2lpm":
        assert any(k.startswith("alice@") for k in st["chain_deficit"])
    # bob sends the same hashes: under client scope they name nothing of his, so no chain matches
    s.release("a1", 1.0)
    bob = Sessions(prefix_sharing="client")
    bob.install_chains(two_chains(), 1, 0.0, dispatch=policy)
    bob.prefix_report("B0", [("alice|0", h) for h in H], [])
    bob.prefix_report("B1", [("alice|4", h) for h in H], [])
    bob.acquire("b1", "bob", 256, 0.0, timeout_s=10, request=req("bob", H, 8 * 16 + 3))
    assert bob.prefix_status()["chain_hit_rate"] == {k: 0.0 for k in bob.prefix_status()["chain_hit_rate"]}


def test_d2lpm_quanta_follow_the_expected_session_so_a_client_stays_where_its_prefix_is():
    """Q^u and Q^w are one and four expected sessions' charge *as learned*, not as the prior (64 + 2 x 32)
    at the plan's install: with prompts of 131 tokens a quantum of the prior's sessions sent the client to
    the chain without its prefix after 4 sessions; at the learned length (300, 4) its chain quantum lasts 9."""

    def chains_taken(learn: bool) -> list[str]:
        s = Sessions(prefix_sharing="client")
        s.install_chains(two_chains(), 1, 0.0, dispatch="d2lpm")
        if learn:
            s.set_expected_tokens(300, 4)  # what the service does as sessions finish
        s.prefix_report("B0", [("alice|0", h) for h in H], [])
        s.prefix_report("B1", [("alice|4", h) for h in H], [])
        taken = []
        for i in range(10):
            g, _ = s.acquire(f"a{i}", "alice", 256, float(i), timeout_s=10, request=req("alice", H, 8 * 16 + 3))
            taken.append(g.hops[0].peer_id[0])
            s.release(f"a{i}", i + 0.5)
        return taken

    # each session charges its chain 131 at the grant and 2 x 8 at its end
    assert chains_taken(learn=False)[:5] == ["B", "B", "B", "B", "A"]  # Q^w = 4 x 128 = 512
    assert chains_taken(learn=True) == ["B"] * 9 + ["A"]  # Q^w = 4 x 308 = 1232


def test_status_shows_d2lpm_knobs_in_force_and_fair_skips_reaches_the_dispatcher():
    for fair_skips in (32, None):
        s = Sessions(prefix_sharing="client", fair_skips=fair_skips)
        s.install_chains(two_chains(), 1, 0.0, dispatch="d2lpm")
        s.set_expected_tokens(300, 4)  # new quanta; fair_skips stays
        st = s.prefix_status()
        assert (st["quantum_client"], st["quantum_chain"], st["fair_skips"]) == (308.0, 4 * 308.0, fair_skips)
    with pytest.raises(ValueError, match="fair_skips must be >= 1 or None"):
        Sessions(fair_skips=0)


def test_a_flooding_client_is_refused_beyond_its_waiting_bound_and_others_are_served():
    s = Sessions(max_waiting_per_client=3)
    s.dispatch_params = PrefixParams(quantum_client=20.0)  # less than one request's charge (10 + 2 x 8)
    s.install_chains(two_chains(), 1, 0.0, dispatch="d2lpm")
    granted = [s.acquire(f"f{i}", "flood", 64, 0.0, timeout_s=10, request=req("flood", [], 10))[0] for i in range(4)]
    assert all(g is not None for g in granted)  # 4 slots
    for i in range(4, 7):
        assert s.acquire(f"f{i}", "flood", 64, 0.0, timeout_s=10, request=req("flood", [], 10))[0] is None
    with pytest.raises(TooManyWaitingError, match="already has 3 sessions waiting"):
        s.acquire("f7", "flood", 64, 0.0, timeout_s=10, request=req("flood", [], 10))
    assert s.queue_length == 3 and s.prefix_status()["refused_floods"] == 1  # nothing lost, nothing added
    s.acquire("light", "light", 64, 0.0, timeout_s=10, request=req("light", [], 10))
    # d2lpm's fair order: the flooder's four grants on free chains were charged (4 x 26 against a quantum of
    # 20), so the refill makes light eligible first, before the flooder's older backlog (FIFO would serve it
    # last); then the flooder's sessions in turn
    assert [g.session_id for g in s.release("f0", 1.0)] == ["light"]
    assert [g.session_id for g in s.release("f1", 1.0)] == ["f4"]


# -- convergence of the index to the servers' caches ------------------------------------------------------
CHUNK_BYTES = 2 * 2 * 1 * PREFIX_CHUNK_TOKENS * 2 * 4


def _kv(tokens: int) -> SessionKV:
    kv = SessionKV.allocate(0, 2, 1, 2, 256, torch.float32)
    kv.past_tokens = tokens
    return kv


def small_cache() -> PrefixCache:
    budget = KVBudget(weights_bytes=0, memory_budget_bytes=10**7)
    return PrefixCache(budget, PREFIX_CHUNK_TOKENS, sharing="swarm", max_bytes=6 * CHUNK_BYTES)


class FakeStack:
    def __init__(self, cache):
        self.prefix_cache = cache


def report_round(reader: PrefixReportReader, sessions: Sessions, caches: dict) -> None:
    """What the orchestrator's poll does, with the servers' own rpc_info code path and the wire in between."""
    for peer, cache in caches.items():
        epoch, seq = reader.cursors.get(peer, (None, 0))
        request = wire.decode_request(
            wire.request(wire_records.InfoRequest(prefix_since_seq=seq, prefix_epoch=epoch)), wire_records.InfoRequest
        )
        delta = prefix_delta(FakeStack(cache), request)
        reader.apply(sessions, peer, wire_records.PrefixDelta.from_wire(delta.to_wire()))


def assert_converged(sessions: Sessions, caches: dict) -> None:
    for peer, cache in caches.items():
        assert sessions.prefix_index.held_by(peer) == set(cache.held_keys()), peer


def test_index_converges_to_the_caches_after_grants_evictions_a_restart_and_a_lost_log():
    caches = {p: small_cache() for p in ("A0", "A1")}
    s = Sessions(prefix_sharing="swarm")
    s.install_chains([((Hop("A0", 0, 4), Hop("A1", 4, 8)), 4, 1.0, 1024)], 1, 0.0, dispatch="e2")
    reader = PrefixReportReader()
    report_round(reader, s, caches)  # first contact: empty listings
    prompts = [prefix_hashes(list(range(p, p + 4 * PREFIX_CHUNK_TOKENS)), "m") for p in (0, 1000, 2000)]
    for i, hashes in enumerate(prompts):
        g, _ = s.acquire(f"s{i}", "c", 256, 0.0, timeout_s=10, request=req("c", hashes, 4 * PREFIX_CHUNK_TOKENS + 1))
        assert g is not None
        for peer, first in (("A0", 0), ("A1", 4)):  # the session ran: each hop offers its prompt's chunks
            caches[peer].insert(caches[peer].namespace("c", first), hashes, _kv(4 * PREFIX_CHUNK_TOKENS))
        s.release(f"s{i}", 1.0)
        report_round(reader, s, caches)
    # 12 chunks offered into 6 chunks of room: the caches evicted, the reports said so
    assert all(len(c) == 6 for c in caches.values()) and all(c.stats.evicted_chunks == 6 for c in caches.values())
    assert_converged(s, caches)
    # a grant whose session never ran: learned, never confirmed; kept while it holds its lease (a long prefill
    # is not done before the servers' next reports), dropped two reports after it ended
    s.acquire("ghost", "c", 256, 0.0, timeout_s=10, request=req("c", H[:3], 3 * PREFIX_CHUNK_TOKENS + 1))
    assert len(s.prefix_index) == 12 + 6
    for _ in range(3):
        report_round(reader, s, caches)
    assert len(s.prefix_index) == 12 + 6
    s.release("ghost", 1.5)
    report_round(reader, s, caches)
    assert len(s.prefix_index) == 12 + 6
    report_round(reader, s, caches)
    assert_converged(s, caches)
    # A1 restarts: a new cache (a new epoch) holding something else; its first reply is a full listing
    caches["A1"] = small_cache()
    caches["A1"].insert(caches["A1"].namespace("c", 4), prompts[0], _kv(4 * PREFIX_CHUNK_TOKENS))
    fulls = reader.full_listings
    report_round(reader, s, caches)
    assert reader.full_listings == fulls + 1
    assert_converged(s, caches)
    # a reader that fell behind the server's bounded log gets the full listing too
    caches["A0"].report = PrefixReport(caches["A0"].held_keys, max_events=2)
    report_round(reader, s, caches)
    for p in (3000, 4000):
        caches["A0"].insert(caches["A0"].namespace("c", 0), prefix_hashes(list(range(p, p + 64)), "m"), _kv(64))
    report_round(reader, s, caches)
    assert_converged(s, caches)
    # a lost server: nothing of it stays reusable
    s.drop_servers({"A0"}, 2.0)
    assert s.prefix_index.held_by("A0") == set()
