"""Client-side chain choice (pure): Dijkstra over block boundaries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from petals_chain.client.routing import min_latency_chain
from petals_chain.errors import NoChainError
from petals_chain.wire.records import ServerInfo


def server(name, start, end, decode_s=0.001, free=10, max_len=2048):
    return ServerInfo(
        peer_id=name,
        model="m",
        start=start,
        end=end,
        state="online",
        memory_budget_bytes=1,
        block_bytes=1,
        kv_bytes_per_block=1,
        max_length_tokens=max_len,
        free_kv_slots=free,
        prefill_s_per_token=0.0,
        decode_s_per_token=decode_s,
        name=name,
    )


def rtt(_peer):
    return 0.01


def test_prefers_fewer_hops_and_fast_servers():
    servers = [server("a", 0, 10), server("b", 10, 20), server("whole", 0, 20), server("slow", 0, 20, decode_s=1.0)]
    assert [h.peer_id for h in min_latency_chain(servers, 0, 20, rtt)] == ["whole"]
    hops = min_latency_chain(servers, 0, 20, rtt, exclude=frozenset({"whole"}))
    assert [(h.peer_id, h.start, h.end) for h in hops] == [("a", 0, 10), ("b", 10, 20)]


def test_enters_mid_range_and_penalises_full_servers():
    servers = [server("a", 0, 12), server("b", 8, 20), server("full", 8, 20, decode_s=0.0, free=0)]
    hops = min_latency_chain(servers, 0, 20, rtt)
    assert [(h.peer_id, h.start, h.end) for h in hops] == [("a", 0, 12), ("b", 12, 20)]


def test_span_may_end_at_a_kept_boundary():
    """Failover of hop [10, 20) in a chain [0,10) [10,20) [20,30): a spare [10, 20) ends at the kept hop."""
    servers = [server("spare", 10, 20), server("tail", 10, 30, decode_s=0.01)]
    hops = min_latency_chain(servers, 10, 30, rtt, ends=frozenset({20, 30}))
    assert [(h.peer_id, h.start, h.end) for h in hops] == [("spare", 10, 20)]
    hops = min_latency_chain(servers, 10, 30, rtt, exclude=frozenset({"spare"}), ends=frozenset({20, 30}))
    assert [(h.peer_id, h.start, h.end) for h in hops] == [("tail", 10, 30)]


def test_no_chain_is_a_typed_error_that_says_what_is_missing():
    with pytest.raises(NoChainError, match=r"\[0, 30\)"):
        min_latency_chain([server("a", 0, 10), server("c", 20, 30)], 0, 30, rtt)
    with pytest.raises(NoChainError):
        min_latency_chain([server("a", 0, 30, max_len=64)], 0, 30, rtt, max_length=128)
    with pytest.raises(NoChainError):
        min_latency_chain([server("a", 0, 30)], 0, 30, lambda _p: None)  # unreachable


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.integers(1, 12)), min_size=1, max_size=8), st.integers(0, 11))
def test_any_chain_found_tiles_the_span_in_order(ranges, start):
    servers = [server(f"s{i}", a, b) for i, (a, b) in enumerate(ranges) if a < b]
    try:
        hops = min_latency_chain(servers, start, 12, rtt)
    except NoChainError:
        return
    assert hops[0].start == start and hops[-1].end == 12
    assert all(x.end == y.start for x, y in zip(hops, hops[1:]))
    by_name = {s.peer_id: s for s in servers}
    for h in hops:  # each hop runs from its entry block to the end of its server's range
        s = by_name[h.peer_id]
        assert s.start <= h.start < h.end == min(s.end, 12)
