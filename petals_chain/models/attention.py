"""Attention of a flattened multi-session batch against each session's static KV cache.

Every family computes its queries/keys/values for all rows at once (the batching gain), then calls
`segment_attention`, which writes each session's new keys/values into its cache and attends per
session. What families differ in is passed as arguments: GQA/MQA (fewer KV heads than query heads),
a sliding window (Mistral, Qwen2), ALiBi slopes (BLOOM) instead of rotary positions.
Every tensor made here is made on the queries' device, so the same code runs on CPU and CUDA.
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
    bias = slopes.to(dtype).view(-1, 1, 1) * key_pos.to(dtype)  # [heads, 1, total]
    return bias.masked_fill(~visible, float("-inf"))  # [heads, n_queries, total]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[AttentionSegment], *,
                      scale: float, sliding_window: int | None = None,
                      alibi: torch.Tensor | None = None) -> torch.Tensor:
    """q [rows, heads, dim], k/v [rows, kv_heads, dim] (positions already applied) -> [rows, heads, dim].

    Writes each segment's new k/v at its positions `[past, past + n)` of its cache, then attends
    each segment's queries to its cache `[0, past + n)`. `alibi`: per-head slopes [heads] or None."""
    out = torch.empty_like(q)
    for seg in segments:
        r0, r1 = seg.row_start, seg.row_start + seg.n_tokens
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
