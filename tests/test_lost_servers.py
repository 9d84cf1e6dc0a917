"""The orchestrator drops a server only when its DHT record has been missing for the grace period, or
at once when it announced offline (orchestrator.service.registry.lost_servers)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.service.registry import lost_servers


def test_one_missed_read_keeps_the_server_and_a_long_absence_drops_it():
    seen = {"a": 100.0, "b": 100.0}
    # b's record is missing from this read only: kept
    assert lost_servers(seen, present={"a"}, offline=set(), now_s=101.0, grace_s=10.0) == []
    # still missing 10 s after it was last seen: dropped
    assert lost_servers(seen, present={"a"}, offline=set(), now_s=110.0, grace_s=10.0) == ["b"]


def test_a_server_that_announced_offline_is_dropped_at_once():
    seen = {"a": 100.0, "b": 100.0}
    assert lost_servers(seen, present={"a"}, offline={"b"}, now_s=100.5, grace_s=10.0) == ["b"]


def test_a_failed_dht_read_drops_nobody_within_the_grace():
    # fetch_servers returns [] when the DHT read itself fails: every record looks missing
    seen = {p: 50.0 for p in "abcdef"}
    assert lost_servers(seen, present=set(), offline=set(), now_s=55.0, grace_s=10.0) == []


def test_negative_grace_is_refused():
    with pytest.raises(ValueError, match="grace_s"):
        lost_servers({}, set(), set(), 0.0, -1.0)


@given(
    st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 100)),
    st.sets(st.sampled_from("abcdefgh")),
    st.sets(st.sampled_from("abcdefgh")),
    st.floats(0, 200),
    st.floats(0, 50),
)
def test_dropped_iff_offline_or_missing_past_the_grace(seen, present, offline, now, grace):
    lost = set(lost_servers(seen, present, offline, now, grace))
    assert lost <= set(seen)
    for p, t in seen.items():
        assert (p in lost) == (p in offline or (p not in present and now - t >= grace))
