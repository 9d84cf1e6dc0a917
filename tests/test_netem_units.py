"""netem without root: the link model (pure), the kernel backend's tc programme, topology validation,
state naming, bandwidth parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from netem.cli import load_topology, parse_bandwidth_bit_s
from netem.errors import NetemError, TopologyError
from netem.hub import LinkModel
from netem.kernel import link_programme, tc_programme
from netem.state import NetworkState, host_addresses, owned_netns, validate_name
from netem.topology import load_topology_json, validate_rtt_matrix


def test_link_model_delay_and_serialisation():
    m = LinkModel(one_way_s=np.array([[0, 0.01], [0.02, 0]]), rate_bytes_per_s=1000.0)
    assert m.schedule(0, 1, 100, now_s=0.0) == pytest.approx(0.1 + 0.01)  # 100 B at 1000 B/s, then 10 ms
    assert m.schedule(0, 1, 100, now_s=0.0) == pytest.approx(0.2 + 0.01)  # queued behind the first on the uplink
    assert m.schedule(1, 0, 100, now_s=0.0) == pytest.approx(0.1 + 0.02)  # the other host's uplink is free
    m2 = LinkModel(one_way_s=np.array([[0, 0.01], [0.01, 0]]))
    assert m2.schedule(0, 1, 10**6, now_s=5.0) == pytest.approx(5.01)  # no rate: delay only


def test_link_model_tail_drop_when_queue_full():
    m = LinkModel(one_way_s=np.zeros((2, 2)), rate_bytes_per_s=1000.0, queue_limit_bytes=250)
    got = [m.schedule(0, 1, 100, now_s=0.0) for _ in range(5)]  # the 4th would wait behind 300 B > 250 B
    assert got[:3] == pytest.approx([0.1, 0.2, 0.3]) and got[3:] == [None, None] and m.dropped == 2
    assert m.schedule(0, 1, 100, now_s=0.15) == pytest.approx(0.4)  # the queue drained: accepted again


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(40, 65535), st.floats(0, 0.05)),
        min_size=1,
        max_size=60,
    ),
    st.floats(0, 0.02),
    st.sampled_from([None, 1e5, 1e7]),
)
def test_link_model_never_early_never_reorders_a_pair(packets, jitter_s, rate):
    rtt = np.array([[0, 0.02, 0.1], [0.02, 0, 0.05], [0.1, 0.05, 0]])
    m = LinkModel(
        one_way_s=rtt / 2,
        rate_bytes_per_s=rate,
        jitter_s=jitter_s,
        queue_limit_bytes=10**12,
        rng=np.random.default_rng(1),
    )
    now, last = 0.0, {}
    for src, dst, size, gap in packets:
        assume(src != dst)
        now += gap
        at = m.schedule(src, dst, size, now)
        serial = size / rate if rate else 0.0
        assert at >= now + serial + max(0.0, rtt[src, dst] / 2 - jitter_s) - 1e-12
        assert at >= last.get((src, dst), 0.0)  # FIFO per pair, even with jitter
        last[(src, dst)] = at


def test_link_model_loss_rate():
    m = LinkModel(one_way_s=np.zeros((2, 2)), loss=0.2, rng=np.random.default_rng(3))
    lost = sum(m.schedule(0, 1, 100, 0.0) is None for _ in range(5000))
    assert 850 < lost < 1150 and m.dropped == lost


def _state(n=3, **kw) -> NetworkState:
    rtt = [[0, 20, 100], [20, 0, 50], [100, 50, 0]][:n]
    return NetworkState(
        name="pct",
        backend="kernel",
        hosts=[f"h{i}" for i in range(n)],
        addresses=host_addresses(n),
        rtt_ms=[r[:n] for r in rtt],
        **kw,
    )


def test_kernel_tc_programme_per_destination_netem_leaves():
    cmds = tc_programme(_state(bandwidth_bit_s=1e9, jitter_ms=2.0, loss=0.01), 0)
    text = [" ".join(c) for c in cmds]
    assert all(c[:5] == ["ip", "netns", "exec", "pct-h0", "tc"] for c in cmds)  # only inside host 0's namespace
    assert text[0].endswith("qdisc add dev pct-e0 root handle 1: htb")
    assert "class add dev pct-e0 parent 1: classid 1:1 htb rate 1000000000bit ceil 1000000000bit" in text[1]
    # destination 1 (RTT 20 ms) -> class 1:11, netem 10 ms one way; destination 2 (RTT 100) -> 1:12, 50 ms
    assert any("parent 1:11 handle 11: netem delay 10.000ms 2.000ms loss 1.0000% limit" in t for t in text)
    assert any("parent 1:12 handle 12: netem delay 50.000ms 2.000ms loss 1.0000% limit" in t for t in text)
    assert any("u32 match ip dst 10.213.0.2/32 flowid 1:11" in t for t in text)
    assert any("u32 match ip dst 10.213.0.3/32 flowid 1:12" in t for t in text)
    assert not any("10.213.0.1/32" in t for t in text)  # no class towards itself
    # the other direction carries its own one-way delay (both directions delayed)
    back = " ".join(" ".join(c) for c in tc_programme(_state(), 2))
    assert "netem delay 50.000ms" in back and "netem delay 25.000ms" in back and "rate 100gbit" in back


def test_kernel_tc_programme_hex_class_ids_are_distinct():
    n = 20
    st_ = NetworkState(
        name="pct",
        backend="kernel",
        hosts=[f"h{i}" for i in range(n)],
        addresses=host_addresses(n),
        rtt_ms=[[0 if i == j else 10 for j in range(n)] for i in range(n)],
    )
    cmds = tc_programme(st_, 0)
    ids = [c[c.index("classid") + 1] for c in cmds if "classid" in c]
    assert len(ids) == len(set(ids)) == n and all(int(i.split(":")[1], 16) >= 1 for i in ids)


def test_kernel_link_programme_creates_nothing_in_the_host_namespace():
    for c in link_programme(_state()):
        assert c[:3] == ["ip", "netns", "add"] or c[1] == "-n" or ("netns" in c and c[2] == "add")
        if c[2] == "add" and c[1] == "link":  # the veth pair: both ends created straight inside our namespaces
            assert c.count("netns") == 2


def test_validate_rtt_matrix_refuses_bad_input():
    assert validate_rtt_matrix(["a", "b"], [[0, 5], [5, 0]]) == [[0.0, 5.0], [5.0, 0.0]]
    for hosts, m, msg in [
        (["a", "b"], [[0, 5], [6, 0]], "symmetric"),
        (["a", "b"], [[1, 5], [5, 0]], "diagonal"),
        (["a", "b"], [[0, 5, 1], [5, 0, 1]], "2 x 2"),
        (["a", "a"], [[0, 5], [5, 0]], "distinct"),
        (["a", "b"], [[0, -5], [-5, 0]], ">= 0"),
        (["a", "b"], [[0, "x"], ["x", 0]], "numbers"),
        ([], [], "non-empty"),
    ]:
        with pytest.raises(TopologyError, match=msg):
            validate_rtt_matrix(hosts, m)


def test_topology_json_file(tmp_path):
    good = tmp_path / "t.json"
    good.write_text(json.dumps({"hosts": ["a", "b", "c"], "rtt_ms": [[0, 40, 10], [40, 0, 20], [10, 20, 0]]}))
    topo = load_topology_json(good)
    assert topo.hosts == ("a", "b", "c") and topo.rtt_ms[0][1] == 40
    assert load_topology(str(good), None, 0, None).hosts == ("a", "b", "c")
    with pytest.raises(TopologyError, match="has 3 hosts"):
        load_topology(str(good), 4, 0, None)
    bad = tmp_path / "b.json"
    for doc, msg in [
        ("{", "not valid JSON"),
        (json.dumps({"hosts": ["a"]}), "expected exactly"),
        (json.dumps({"hosts": ["a", "b"], "rtt_ms": [[0, 1], [2, 0]]}), "symmetric"),
    ]:
        bad.write_text(doc)
        with pytest.raises(TopologyError, match=msg):
            load_topology_json(bad)
    with pytest.raises(TopologyError, match="no such"):
        load_topology_json(tmp_path / "missing.json")


def test_synthetic_and_ripe_topologies_are_seeded():
    a, b = load_topology("synthetic", 4, 7, None), load_topology("synthetic", 4, 7, None)
    assert a == b and len(a.hosts) == 4 and a.rtt_ms[0][0] == 0
    with pytest.raises(TopologyError, match="needs --hosts"):
        load_topology("synthetic", None, 0, None)


def test_names_and_addresses():
    assert validate_name("pcnet") == "pcnet"
    for bad in ("PC", "a-b", "toolongname", "1abc", ""):
        with pytest.raises(NetemError, match="1-8 lowercase"):
            validate_name(bad)
    assert host_addresses(3) == ["10.213.0.1", "10.213.0.2", "10.213.0.3"]
    with pytest.raises(TopologyError, match="private"):
        host_addresses(2, "8.8.8.0/24")
    # only our exact names count as ours
    assert owned_netns("pc", ["pc-h0", "pc-h12", "pc-sw", "pc-probe", "pc-h", "pcx-h0", "pc-h0x", "other"]) == [
        "pc-h0",
        "pc-h12",
        "pc-sw",
        "pc-probe",
    ]


def test_parse_bandwidth():
    assert parse_bandwidth_bit_s("1Gbit") == 1e9 and parse_bandwidth_bit_s("100mbit") == 1e8
    assert parse_bandwidth_bit_s("500kbit") == 5e5 and parse_bandwidth_bit_s("1e6") == 1e6
    import argparse

    for bad in ("fast", "-1mbit", "0", "10MB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bandwidth_bit_s(bad)


def test_kernel_change_programme_updates_every_leaf_in_place():
    st_ = _state()
    st_.rtt_ms = [[0, 60, 100], [60, 0, 50], [100, 50, 0]]
    from netem.kernel import change_delays_programme

    cmds = [" ".join(c) for c in change_delays_programme(st_)]
    assert len(cmds) == 6 and all(" tc qdisc change dev " in c for c in cmds)
    assert any(
        c.startswith("ip netns exec pct-h1 ") and "parent 1:10 handle 10: netem delay 30.000ms" in c for c in cmds
    )
