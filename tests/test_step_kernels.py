"""The server step's kernels against plain references: the GQA-folded attention (models/attention.py)
and the oneDNN-packed linears (runtime/packed_linear.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from petals_chain.models.attention import (
    _alibi_bias,
    _segment_mask,
    grouped_attention,
    segment_attention,
)
from petals_chain.models.family import AttentionSegment
from petals_chain.runtime.packed_linear import (
    PackedLinear,
    pack_linears,
    packing_available,
)
from petals_chain.runtime.quantization import module_bytes


def reference_attention(query, keys, values, mask, scale):
    """Textbook attention with the KV heads repeated per query head: query [n, heads, dim],
    keys/values [kv_heads, L, dim], mask None / [n, L] bool or float / [heads, n, L] float."""
    heads, kv_heads = query.shape[1], keys.shape[0]
    k = keys.repeat_interleave(heads // kv_heads, 0).double()  # [heads, L, dim]
    v = values.repeat_interleave(heads // kv_heads, 0).double()
    scores = torch.einsum("nhd,hld->hnl", query.double(), k) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.double()
    return torch.einsum("hnl,hld->nhd", scores.softmax(-1), v)


@settings(max_examples=60, deadline=None)
@given(
    kv_heads=st.integers(1, 4),
    group=st.integers(1, 5),
    dim=st.sampled_from([8, 16, 32]),
    past=st.integers(0, 40),
    n=st.integers(1, 9),
    window=st.one_of(st.none(), st.integers(1, 20)),
    alibi=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_grouped_attention_equals_reference(kv_heads, group, dim, past, n, window, alibi, seed):
    # the masked path is what is under test (an unmasked decode token is checked below as well)
    assume(n > 1 or alibi or window is not None)
    heads = kv_heads * group
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(n, heads, dim, generator=gen)
    keys = torch.randn(kv_heads, past + n, dim, generator=gen)
    values = torch.randn(kv_heads, past + n, dim, generator=gen)
    slopes = torch.rand(heads, generator=gen) if alibi else None
    mask = _segment_mask(n, past, query.device, window, slopes, query.dtype)
    scale = 1 / math.sqrt(dim)
    got = grouped_attention(query, keys, values, mask, scale)
    torch.testing.assert_close(
        got.double(), reference_attention(query, keys, values, mask, scale), rtol=1e-5, atol=1e-5
    )
    if not alibi and window is None:  # the unmasked form of the same call: a decode token sees everything
        last = grouped_attention(query[-1:], keys, values, None, scale)
        torch.testing.assert_close(last, got[-1:], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    pasts=st.lists(st.integers(0, 12), min_size=4, max_size=4),
    alibi=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_segment_attention_writes_caches_and_matches_reference(kv_heads, group, sizes, pasts, alibi, seed):
    """Several sessions' multi-token steps in one call (speculative verification, chunked prefill):
    each session's rows see its own cache up to their positions, and its new keys/values land in it."""
    assume(any(n > 1 and p > 0 for n, p in zip(sizes, pasts)))  # the masked multi-token path is exercised
    heads, dim, capacity = kv_heads * group, 16, 24
    gen = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    q = torch.randn(rows, heads, dim, generator=gen)
    k = torch.randn(rows, kv_heads, dim, generator=gen)
    v = torch.randn(rows, kv_heads, dim, generator=gen)
    slopes = torch.rand(heads, generator=gen) if alibi else None
    segments, start = [], 0
    for n, past in zip(sizes, pasts):
        cache_k = torch.randn(kv_heads, capacity, dim, generator=gen)
        cache_v = torch.randn(kv_heads, capacity, dim, generator=gen)
        segments.append(AttentionSegment(start, n, past, cache_k, cache_v))
        start += n
    before = [(s.key_cache.clone(), s.value_cache.clone()) for s in segments]
    out = segment_attention(q, k, v, segments, scale=0.25, alibi=slopes)
    for seg, (old_k, old_v) in zip(segments, before):
        r0, r1, p0, p1 = seg.row_start, seg.row_start + seg.n_tokens, seg.past_tokens, seg.past_tokens + seg.n_tokens
        torch.testing.assert_close(seg.key_cache[:, p0:p1], k[r0:r1].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(seg.value_cache[:, :p0], old_v[:, :p0], rtol=0, atol=0)
        mask = _segment_mask(seg.n_tokens, p0, q.device, None, slopes, q.dtype)
        expected = reference_attention(q[r0:r1], seg.key_cache[:, :p1], seg.value_cache[:, :p1], mask, 0.25)
        torch.testing.assert_close(out[r0:r1].double(), expected, rtol=1e-5, atol=1e-5)


def test_alibi_bias_fold_keeps_each_heads_slope():
    """The per-head mask is laid out in the folded row order: a head's row sees its own slope."""
    kv_heads, group, n, dim = 2, 3, 2, 8
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    keys = torch.zeros(kv_heads, 5, dim)  # equal scores: softmax is the bias's alone
    values = torch.arange(5.0).view(1, 5, 1).expand(kv_heads, 5, dim).contiguous()
    mask = _alibi_bias(slopes, torch.arange(5).view(1, -1), torch.float32).expand(6, n, 5)
    out = grouped_attention(torch.zeros(n, kv_heads * group, dim), keys, values, mask, 1.0)
    for head, slope in enumerate(slopes):
        weights = (slope * torch.arange(5.0)).softmax(0)
        torch.testing.assert_close(out[:, head, 0], (weights * torch.arange(5.0)).sum().expand(n))


NEEDS_PACKING = pytest.mark.skipif(
    not packing_available(), reason="this torch build has no oneDNN packed linear ops (torch.backends.mkldnn)"
)


@NEEDS_PACKING
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), bias=st.booleans(), lead=st.sampled_from([(), (1,), (2,)]), seed=st.integers(0, 2**16))
def test_packed_linear_equals_linear(rows, bias, lead, seed):
    """Any row count and leading batch shape: the packed layer's product is F.linear's up to float
    reduction order, as a contiguous tensor that callers may edit in place."""
    gen = torch.Generator().manual_seed(seed)
    base = nn.Linear(48, 40, bias=bias)
    with torch.no_grad():
        base.weight.copy_(torch.randn(40, 48, generator=gen))
        if bias:
            base.bias.copy_(torch.randn(40, generator=gen))
    layer = PackedLinear.of(base)
    assert isinstance(layer, nn.Linear) and layer.weight.numel() == 0  # the dense copy is dropped
    assert (layer.bias is base.bias) if bias else layer.bias is None
    x = torch.randn(*lead, rows, 48, generator=gen)
    with torch.no_grad():
        got = layer(x)
    assert got.is_contiguous() and got.shape == (*lead, rows, 40)
    torch.testing.assert_close(got, F.linear(x, base.weight, base.bias), rtol=1e-5, atol=1e-4)
    got[..., 0] = 0.0


@NEEDS_PACKING
def test_pack_linears_replaces_only_plain_float32_cpu_linears():
    class Quantized(nn.Linear):  # stands for bitsandbytes' layers, which subclass nn.Linear
        pass

    block = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), Quantized(4, 4)), nn.LayerNorm(4))
    dense_bytes = module_bytes(block)
    pack_linears(block, torch.device("cpu"), torch.float32)
    assert [type(m).__name__ for m in block.modules() if isinstance(m, nn.Linear)] == [
        "PackedLinear",
        "PackedLinear",
        "Quantized",
    ]
    assert module_bytes(block) == dense_bytes  # the packed copy replaces the dense weight
    other = nn.Sequential(nn.Linear(4, 4))
    pack_linears(other, torch.device("cpu"), torch.bfloat16)
    pack_linears(other, torch.device("meta"), torch.float32)
    assert type(other[0]) is nn.Linear
