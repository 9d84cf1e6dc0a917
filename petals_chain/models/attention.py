"""Attention of a flattened multi-session batch against each session's static KV cache.

Every family computes its queries/keys/values for all rows at once (the batching gain), then calls
`segment_attention`, which writes each session's new keys/values into its cache and attends per
session. What families differ in is passed as arguments: GQA/MQA (fewer KV heads than query heads),
a sliding window (Mistral, Qwen2), ALiBi slopes (BLOOM) instead of rotary positions.
Every tensor made here is made on the queries' device, so the same code runs on CPU and CUDA; a
CUDA-graph decode step (`AttentionSegment.position` set, runtime/decode_graphs.py) attends over the
whole static cache with a mask so that no shape depends on the position.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from petals_chain.models.family import AttentionSegment


def alibi_slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    """ALiBi's per-head slopes [heads] (float32), exactly as transformers' BLOOM computes them."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    return _get_alibi_slopes(num_heads, device)


def _segment_mask(n_queries: int, past_tokens: int, device: torch.device, sliding_window: int | None,
                  slopes: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Query i sits at absolute position past_tokens + i and may see keys 0..past_tokens+i
    (bottom-right aligned causal), only the last `sliding_window` of them with a window. With ALiBi
    the mask is additive: slope_h * key_position where visible (softmax is shift-invariant per row,
    so this equals BLOOM's slope_h * (key - query) bias), -inf elsewhere."""
    total = past_tokens + n_queries
    query_pos = torch.arange(past_tokens, total, device=device).unsqueeze(1)
    key_pos = torch.arange(total, device=device).unsqueeze(0)
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window  # transformers' sliding_window_overlay
    if slopes is None:
        return visible
    return _alibi_bias(slopes, key_pos, dtype).masked_fill(~visible, float("-inf"))  # [heads, n_queries, total]


def _alibi_bias(slopes: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """slope_h * key position [heads, 1, keys], computed in float32 and cast as transformers does."""
    return (slopes.view(-1, 1, 1) * key_pos.view(1, 1, -1).to(torch.float32)).to(dtype)


def _graph_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seg: AttentionSegment,
                  scale: float, sliding_window: int | None, slopes: torch.Tensor | None) -> torch.Tensor:
    """One decode token at a position held in a device tensor (capturable in a CUDA graph): the KV
    write is an index_copy at that position and attention runs over the whole static cache with an
    additive mask hiding positions after it (and before the window), so no shape depends on the
    position. query [1, heads, dim] -> [1, heads, dim]."""
    pos = seg.position
    seg.key_cache.index_copy_(1, pos, key.transpose(0, 1))
    seg.value_cache.index_copy_(1, pos, value.transpose(0, 1))
    kv_heads, length, dim = seg.key_cache.shape
    heads = query.shape[1]
    # GQA without repeating the cache: the `heads // kv_heads` query heads that share a KV head become
    # that head's query rows (a decode token's rows all see the same positions)
    q = query[0].view(kv_heads, heads // kv_heads, dim).unsqueeze(0)
    key_pos = torch.arange(length, device=pos.device)
    visible = key_pos <= pos
    if sliding_window is not None:
        visible &= key_pos > pos - sliding_window
    if slopes is None:
        mask = torch.zeros(length, dtype=q.dtype, device=pos.device).masked_fill_(~visible, float("-inf"))
        mask = mask.view(1, 1, 1, length)
    else:  # a bias per query head, laid out as q: [1, kv_heads, heads per KV head, length]
        bias = _alibi_bias(slopes, key_pos, q.dtype).view(kv_heads, heads // kv_heads, length)
        mask = bias.masked_fill(~visible, float("-inf")).unsqueeze(0)
    o = F.scaled_dot_product_attention(q, seg.key_cache.unsqueeze(0), seg.value_cache.unsqueeze(0),
                                       attn_mask=mask, scale=scale)
    return o[0].reshape(1, heads, dim)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[AttentionSegment], *,
                      scale: float, sliding_window: int | None = None,
                      alibi: torch.Tensor | None = None) -> torch.Tensor:
    """q [rows, heads, dim], k/v [rows, kv_heads, dim] (positions already applied) -> [rows, heads, dim].

    Writes each segment's new k/v at its positions `[past, past + n)` of its cache, then attends
    each segment's queries to its cache `[0, past + n)`. `alibi`: per-head slopes [heads] or None."""
    out = torch.empty_like(q)
    for seg in segments:
        r0, r1 = seg.row_start, seg.row_start + seg.n_tokens
        if seg.position is not None:
            out[r0:r1] = _graph_decode(q[r0:r1], k[r0:r1], v[r0:r1], seg, scale, sliding_window, alibi)
            continue
        p0, p1 = seg.past_tokens, seg.past_tokens + seg.n_tokens
        seg.key_cache[:, p0:p1] = k[r0:r1].transpose(0, 1)
        seg.value_cache[:, p0:p1] = v[r0:r1].transpose(0, 1)
        query = q[r0:r1].transpose(0, 1)  # [heads, n, dim]
        first_key = 0
        if alibi is None and seg.n_tokens == 1:
            # a single new token sees every cached position, or the last `sliding_window` of them
            mask, causal = None, False
            if sliding_window is not None:
                first_key = max(0, p1 - sliding_window)
        elif alibi is None and p0 == 0 and (sliding_window is None or seg.n_tokens <= sliding_window):
            mask, causal = None, True
        else:
            mask = _segment_mask(seg.n_tokens, p0, q.device, sliding_window, alibi, q.dtype)
            causal = False
        keys, values = seg.key_cache[:, first_key:p1], seg.value_cache[:, first_key:p1]
        o = F.scaled_dot_product_attention(
            query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=None if mask is None else mask.unsqueeze(0), is_causal=causal, scale=scale,
            enable_gqa=keys.shape[0] != query.shape[0],
        )
        out[r0:r1] = o[0].transpose(0, 1)
    return out
