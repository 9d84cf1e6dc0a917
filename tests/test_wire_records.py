"""The generic from_wire/to_wire of the typed messages: round trips, and every broken field is a
typed InvalidRequestError that names it (the checks the hand-written converters made, kept)."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from petals_chain.errors import ERROR_TYPES, ErrorCode, InvalidRequestError
from petals_chain.wire import messages as m
from petals_chain.wire.records import (
    InfoReply,
    OrchestratorInfo,
    ServerInfo,
    ServerState,
)

HOPS = (m.Hop("a", 0, 10, "A"), m.Hop("b", 10, 30))
GRANT = m.ChainGrant("s1", 3, 2, HOPS, 0.5, 15.0, wait_s=0.25, extra={"seq": 7})
SERVER = ServerInfo(
    "p",
    "model",
    0,
    30,
    ServerState.ONLINE,
    10**9,
    10**6,
    10**4,
    512,
    3,
    1e-3,
    2e-3,
    extra={"auto": False},
    peer_rtt_s={"q": 0.012},
)

SAMPLES = [
    m.Open("s1", 64, entry_block=5, admission_wait_s=1.5),
    m.Open("s1", 64),
    m.Opened("s1", 5, 30),
    m.Step("s1", 4),
    m.StepReply("s1", 4, 12, 0.01),
    m.Close(),
    m.Forward(3),
    m.ErrorReply("no_chain", "none"),
    m.Acquire("s1", 64, 10.0, 2.0, ["x"]),
    m.Granted(GRANT),
    m.Queued(2, 5),
    m.Release("s1", 10, 4),
    m.Released(True),
    m.Heartbeat(["s1", "s2"]),
    m.HeartbeatReply(["s2"], 15.0),
    m.AssignmentReply(m.Assignment(m.AssignmentStatus.ASSIGNED, 4, 0, 12)),
    m.AssignmentRequest(),
    InfoReply(SERVER),
    OrchestratorInfo("o", "model", "proposed", 3, 8080),
    GRANT,
    SERVER,
]


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: type(r).__name__)
def test_round_trip_through_msgpack(record):
    wire_form = msgpack.unpackb(msgpack.packb(record.to_wire(), use_bin_type=True), raw=False)
    assert type(record).from_wire(wire_form) == record
    if record.TYPE is not None:
        assert wire_form["type"] == str(record.TYPE)


def test_wire_format_is_the_old_one():
    """The maps are what the hand-written converters produced (plain strings, lists, no None for
    optional fields a peer may not know)."""
    assert m.Open("s", 8, 2).to_wire() == {"type": "open", "session_id": "s", "max_length": 8, "entry_block": 2}
    assert m.Close().to_wire() == {"type": "close"}
    g = GRANT.to_wire()
    assert g["hops"] == [
        {"peer_id": "a", "start": 0, "end": 10, "name": "A"},
        {"peer_id": "b", "start": 10, "end": 30, "name": ""},
    ]
    assert type(SERVER.to_wire()["state"]) is str and SERVER.to_wire()["state"] == "online"
    assert g["extra"] == {"seq": 7} and m.ChainGrant.from_wire(g).seq == 7


def test_typed_maps_check_keys_and_values():
    wire_form = SERVER.to_wire()
    assert ServerInfo.from_wire({**wire_form, "peer_rtt_s": {"q": 1}}).peer_rtt_s == {"q": 1.0}
    for bad in ({"q": "fast"}, {"q": float("nan")}, {7: 0.01}, [0.01]):
        with pytest.raises(InvalidRequestError, match="peer_rtt_s"):
            ServerInfo.from_wire({**wire_form, "peer_rtt_s": bad})


def test_unknown_fields_are_ignored_and_defaults_fill_in():
    assert m.Step.from_wire({"type": "step", "session_id": "s", "zzz": [1]}) == m.Step("s", None)
    assert m.Close.from_wire({"type": "close", "session_id": 5}) == m.Close()


@pytest.mark.parametrize(
    "data, field",
    [
        ({"session_id": "s"}, "max_length"),
        ({"session_id": "s", "max_length": True}, "max_length"),
        ({"session_id": "s", "max_length": "8"}, "max_length"),
        ({"session_id": 1, "max_length": 8}, "session_id"),
        ({"session_id": "s", "max_length": 8, "admission_wait_s": math.nan}, "admission_wait_s"),
        ({"session_id": "s", "max_length": 8, "admission_wait_s": -math.inf}, "admission_wait_s"),
        ({"session_id": "s", "max_length": 8, "entry_block": 1.5}, "entry_block"),
    ],
)
def test_bad_open_fields_name_the_field(data, field):
    with pytest.raises(InvalidRequestError, match=field):
        m.Open.from_wire(data)


def test_nested_errors_name_the_path_and_cross_field_rules_hold():
    g = GRANT.to_wire()
    with pytest.raises(InvalidRequestError, match=r"hops\[1\]\.start"):
        m.ChainGrant.from_wire({**g, "hops": [g["hops"][0], {**g["hops"][1], "start": "x"}]})
    with pytest.raises(InvalidRequestError, match="contiguous"):
        m.ChainGrant.from_wire({**g, "hops": [g["hops"][0], {**g["hops"][1], "start": 11}]})
    with pytest.raises(InvalidRequestError, match="at least one hop"):
        m.ChainGrant.from_wire({**g, "hops": []})
    with pytest.raises(InvalidRequestError, match="bad hop range"):
        m.Hop.from_wire({"peer_id": "a", "start": 5, "end": 5})
    with pytest.raises(InvalidRequestError, match="state"):
        ServerInfo.from_wire({**SERVER.to_wire(), "state": "dancing"})
    with pytest.raises(InvalidRequestError, match="status"):
        m.Assignment.from_wire({"status": "maybe", "plan_version": 1})
    with pytest.raises(InvalidRequestError, match="assigned range"):
        m.Assignment.from_wire({"status": "assigned", "plan_version": 1, "start": 4, "end": 2})
    with pytest.raises(InvalidRequestError, match=r"session_ids\[1\]"):
        m.Heartbeat.from_wire({"session_ids": ["a", 3]})
    with pytest.raises(InvalidRequestError, match="session_id"):
        m.Acquire.from_wire({"session_id": "x" * 129, "max_length": 8})
    with pytest.raises(InvalidRequestError, match="unknown message type"):
        m.decode_tagged({"type": "dance"}, m.Open, m.Step, m.Close)


WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@given(record=st.sampled_from(SAMPLES), data=st.data())
@settings(max_examples=300, deadline=None)
def test_any_field_replaced_by_anything_parses_or_is_a_typed_error(record, data):
    """Whatever a peer puts in one field: the record parses (and is then well-typed) or the error is
    InvalidRequestError naming that field or a rule across fields (never another exception)."""
    wire_form = record.to_wire()
    names = [f.name for f in dataclasses.fields(record)]
    assume(names)
    name = data.draw(st.sampled_from(names))
    value = data.draw(WEIRD)
    try:
        parsed = type(record).from_wire({**wire_form, name: value})
    except InvalidRequestError as e:
        assert name in str(e) or "range" in str(e) or "hop" in str(e) or "session_id" in str(e), str(e)
        return
    for f in dataclasses.fields(parsed):
        v = getattr(parsed, f.name)
        assert not (isinstance(v, float) and not math.isfinite(v)), (f.name, v)


def test_error_codes_are_a_str_enum_on_the_wire():
    assert all(isinstance(code, ErrorCode) for code in ERROR_TYPES)
    reply = m.ErrorReply(ErrorCode.NO_CHAIN, "x").to_wire()
    assert type(reply["code"]) is str and reply["code"] in ERROR_TYPES
