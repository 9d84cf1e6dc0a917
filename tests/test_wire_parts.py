"""Tensors split into parts below the message size and rebuilt exactly, and a decode step's group in one raw
frame (no network: the codec)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from petals_chain.errors import InvalidRequestError, PetalsChainError
from petals_chain.wire import codec as wire
from petals_chain.wire.parts import (
    DTYPES,
    MAX_PART_BYTES,
    PARTS_KEY,
    RAW_DTYPES,
    Assembler,
    Message,
    RawFrame,
    RawTensor,
    as_tensor,
    decode_raw,
    decode_raw_lazy,
    decode_single,
    encode_raw,
    split_tensor,
    to_messages,
)


def _payload_bytes(msg) -> int:
    return sum(len(t.buffer) for t in msg.tensors)


def _roundtrip(meta, tensors, part_bytes, admit=None) -> Message:
    msgs = to_messages(meta, tensors, part_bytes=part_bytes)
    assert all(_payload_bytes(m) <= part_bytes for m in msgs)
    assembler = Assembler(admit)
    results = [r for m in msgs for r in assembler.feed(m)]
    assert len(results) == 1
    return results[0]


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=0, max_size=3),
    dtype=st.sampled_from(sorted(DTYPES)),
    part_bytes=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_any_tensors_roundtrip_bit_exactly_in_parts_below_the_size(shapes, dtype, part_bytes, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randint(-(2**15), 2**15, tuple(s), generator=g).to(DTYPES[dtype])
        if DTYPES[dtype] in (torch.int64, torch.int32)
        else torch.randn(tuple(s), generator=g).to(DTYPES[dtype])
        for s in shapes
    ]
    out = _roundtrip({"type": "step", "n": 3}, tensors, part_bytes)
    assert out.meta == {"type": "step", "n": 3}  # the parts count does not leak into the metadata
    assert len(out.tensors) == len(tensors)
    for a, b in zip(tensors, out.tensors):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))  # bits, NaN-safe


def test_a_32_mib_bfloat16_hidden_state_roundtrips_within_the_message_limit():
    hidden = torch.randn(1, 4096, 4096).to(torch.bfloat16)  # a 7B model's 4,096-token prefill
    msgs = to_messages({"type": "forward"}, (hidden,))
    assert len(msgs) == hidden.numel() * 2 // MAX_PART_BYTES == 16
    assert all(m.ByteSize() < 4 * 2**20 for m in msgs)  # hivemind's p2pd limit per message
    assert wire.unpack(msgs[0].metadata)[PARTS_KEY] == 16 and all(not m.metadata for m in msgs[1:])
    out = _roundtrip({"type": "forward"}, (hidden,), MAX_PART_BYTES)
    assert torch.equal(out.tensors[0], hidden)


def test_admit_refuses_by_header_before_allocating_and_the_rest_of_the_group_is_dropped():
    seen = []

    def admit(shape, dtype):
        seen.append(shape)
        if shape[0] > 8:
            raise InvalidRequestError("too many tokens")

    assembler = Assembler(admit)
    big = to_messages({"type": "step"}, (torch.zeros(16, 64),), part_bytes=256)
    results = [r for m in big for r in assembler.feed(m)]
    assert len(results) == 1 and isinstance(results[0], InvalidRequestError) and seen == [(16, 64)]
    # the stream stays usable: the next group is decoded normally
    small = torch.randn(4, 64)
    results = [r for m in to_messages({"type": "step"}, (small,), part_bytes=256) for r in assembler.feed(m)]
    assert len(results) == 1 and torch.equal(results[0].tensors[0], small)


def _errors(messages) -> list:
    assembler = Assembler()
    return [r for m in messages for r in assembler.feed(m)]


def test_malformed_groups_get_one_typed_error_each():
    t = torch.arange(64, dtype=torch.float32)
    parts = split_tensor(t, part_bytes=64)  # 4 parts
    req = wire.runtime_pb2.ExpertRequest
    truncated = [
        req(metadata=wire.pack({"type": "a", PARTS_KEY: 4}), tensors=parts[:1]),
        req(tensors=parts[1:2]),
        req(metadata=wire.pack({"type": "b"})),
    ]
    results = _errors(truncated)
    assert isinstance(results[0], InvalidRequestError) and "early" in str(results[0])
    assert isinstance(results[1], Message) and results[1].meta == {"type": "b"}
    overflow = parts[0]
    overflow.chunks = 1  # declares one part of 64 bytes, but the header says 256 bytes: missing bytes
    assert isinstance(_errors([req(metadata=wire.pack({"type": "a"}), tensors=[overflow])])[0], InvalidRequestError)
    lying = wire.runtime_pb2.Tensor(buffer=b"x" * 12, size=[2], dtype="float32", chunks=1)
    assert "more than" in str(_errors([req(metadata=wire.pack({"type": "a"}), tensors=[lying])])[0])
    assert "outside" in str(_errors([req(tensors=parts[1:2])])[0])
    assert "dtype" in str(
        _errors(
            [req(metadata=wire.pack({}), tensors=[wire.runtime_pb2.Tensor(buffer=b"", size=[0], dtype="complex64")])]
        )[0]
    )
    assert PARTS_KEY in str(_errors([req(metadata=wire.pack({PARTS_KEY: 0}))])[0])
    assert "msgpack" in str(_errors([req(metadata=b"\xc1garbage")])[0])


def test_unary_decode_refuses_a_first_part_with_a_fix_it_message():
    msgs = to_messages({"type": "forward"}, (torch.zeros(3, 128),), part_bytes=512)
    assert len(msgs) > 1
    with pytest.raises(PetalsChainError, match="stream"):
        decode_single(msgs[0])
    (too_big,) = to_messages(
        {"type": "forward"}, (torch.zeros(MAX_PART_BYTES // 4 + 1),), part_bytes=2 * MAX_PART_BYTES
    )
    with pytest.raises(PetalsChainError, match=f"at most {MAX_PART_BYTES} bytes"):
        decode_single(too_big)  # its reply would not fit one message either
    one = to_messages({"type": "forward"}, (torch.ones(3, 4),))
    assert len(one) == 1 and torch.equal(decode_single(one[0]).tensors[0], torch.ones(3, 4))


# -- raw frames (a decode step's group without protobuf) -------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=4),
    dtype=st.sampled_from(sorted(RAW_DTYPES)),
    seed=st.integers(0, 2**16),
    step_id=st.integers(0, 2**40),
)
def test_raw_frames_roundtrip_bit_exactly_and_name_themselves_raw(shape, dtype, seed, step_id):
    g = torch.Generator().manual_seed(seed)
    kind = DTYPES[dtype]
    t = (
        torch.randint(-(2**15), 2**15, tuple(shape), generator=g).to(kind)
        if kind in (torch.int64, torch.int32)
        else torch.randn(tuple(shape), generator=g).to(kind)
    )
    meta = {"type": "step", "step_id": step_id, "route": ["a", "b"]}
    out = decode_raw(encode_raw(meta, t))
    assert out.raw and out.meta == meta and len(out.tensors) == 1
    (back,) = out.tensors
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))  # bits, NaN-safe
    if back.numel():
        back.view(-1)[0] = 0  # its own memory, writable (the frame's bytes are not)
    assert decode_raw(encode_raw(meta)).tensors == []  # metadata alone
    # the lazy form (a client relaying a reply): forwarded into the next frame byte for byte as the
    # tensor would be encoded, and decoded to the same bits when asked
    (lazy,) = decode_raw_lazy(encode_raw(meta, t)).tensors
    assert isinstance(lazy, RawTensor) and lazy.shape == t.shape and lazy.dtype == t.dtype
    onward = {"type": "step", "step_id": step_id + 1}
    assert encode_raw(onward, lazy).body == encode_raw(onward, t).body
    decoded = as_tensor(lazy)
    assert decoded is as_tensor(lazy)  # decoded once
    assert decoded.dtype == t.dtype and decoded.shape == t.shape
    assert torch.equal(decoded.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    assert decode_raw_lazy(encode_raw(meta)).tensors == []


def test_tensors_that_do_not_fit_one_raw_frame_take_the_parts_path():
    assert encode_raw({}, torch.zeros(MAX_PART_BYTES // 4 + 1)) is None  # over one part
    assert encode_raw({}, torch.zeros(1, dtype=torch.complex64)) is None  # no dtype code
    assert encode_raw({}, torch.zeros([1] * 9)) is None  # too many dimensions
    strided = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # not contiguous: sent as its values
    assert torch.equal(decode_raw(encode_raw({}, strided)).tensors[0], strided)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=64))
def test_any_bytes_as_a_raw_frame_are_a_typed_error_or_a_message(body):
    try:
        out = decode_raw(RawFrame(body))
    except InvalidRequestError:
        out = None  # refused, typed: nothing else may come out of garbage
    assert out is None or (isinstance(out, Message) and out.raw)


def test_raw_frames_are_refused_by_their_header_and_end_an_unfinished_group():
    seen = []

    def admit(shape, dtype):
        seen.append((shape, dtype))
        raise InvalidRequestError("too many tokens")

    with pytest.raises(InvalidRequestError, match="too many tokens"):
        decode_raw(encode_raw({"type": "step"}, torch.zeros(64, 8)), admit)
    assert seen == [((64, 8), torch.float32)]
    good = encode_raw({"type": "step"}, torch.ones(2, 3))
    frame = good.body
    for cut in (2, 7, len(frame) - 1):  # truncated anywhere: typed
        with pytest.raises(InvalidRequestError):
            decode_raw(RawFrame(frame[:cut]))
    with pytest.raises(InvalidRequestError, match="needs 24 bytes"):
        decode_raw(RawFrame(frame + b"\0"))
    # a raw frame in the middle of a group of parts: that group is reported unfinished, the raw one decoded
    assembler = Assembler()
    parts = to_messages({"type": "a"}, (torch.zeros(64),), part_bytes=64)
    results = [r for m in parts[:2] for r in assembler.feed(m)] + assembler.feed(good)
    assert isinstance(results[0], InvalidRequestError) and "early" in str(results[0])
    assert isinstance(results[1], Message) and torch.equal(results[1].tensors[0], torch.ones(2, 3))


FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@given(
    dtype=st.sampled_from(FLOAT_DTYPES),
    rows=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    bad=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(NON_FINITE)), max_size=3),
    extreme=st.booleans(),
)
@settings(max_examples=120, deadline=None)
def test_finite_decoding_agrees_with_torch_on_both_paths(dtype, rows, seed, bad, extreme):
    """`finite=True` refuses a tensor exactly when torch.isfinite says it holds NaN or Inf, in a raw
    frame and in protobuf parts (several parts), for every float dtype; finite extremes (the dtype's
    largest magnitudes, subnormals, -0.0) pass, so no large but finite hidden state is refused."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, 64, generator=g).to(dtype)
    if extreme:
        info = torch.finfo(dtype)
        flat = t.view(-1)
        flat[0], flat[1], flat[2], flat[3] = info.max, -info.max, info.smallest_normal / 4, -0.0
    for index, value in bad:
        t.view(-1)[index % t.numel()] = value
    expect_ok = bool(torch.isfinite(t).all())
    frame = encode_raw({"type": "step"}, t)
    groups = [[frame], to_messages({"type": "step"}, (t,), part_bytes=96)]
    for messages in groups:
        assembler = Assembler(finite=True)
        (result,) = [r for m in messages for r in assembler.feed(m)]
        if expect_ok:
            assert isinstance(result, Message) and torch.equal(result.tensors[0].view(torch.uint8), t.view(torch.uint8))
        else:
            assert isinstance(result, InvalidRequestError) and "NaN or Inf" in str(result)
        # without the check, the same bytes decode as they are (a client reading replies)
        plain_assembler = Assembler()
        (plain,) = [r for m in messages for r in plain_assembler.feed(m)]
        assert torch.equal(plain.tensors[0].view(torch.uint8), t.view(torch.uint8))


def test_a_refused_non_finite_step_leaves_the_stream_usable():
    """One typed error for the bad group, then the next step on the same stream decodes."""
    good = torch.randn(1, 32)
    bad = good.clone()
    bad[0, 5] = float("nan")
    assembler = Assembler(finite=True)
    first = assembler.feed(encode_raw({"type": "step", "step_id": 1}, bad))
    second = assembler.feed(encode_raw({"type": "step", "step_id": 2}, good))
    assert len(first) == 1 and isinstance(first[0], InvalidRequestError)
    assert len(second) == 1 and second[0].meta["step_id"] == 2 and torch.equal(second[0].tensors[0], good)
    with pytest.raises(InvalidRequestError, match="NaN or Inf"):
        decode_single(to_messages({"type": "forward"}, (bad,))[0], finite=True)
