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


def _segment_mask(
    n_queries: int,
    past_tokens: int,
    device: torch.device,
    sliding_window: int | None,
    slopes: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
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


def grouped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of one session's queries to its keys/values without repeating the cache for GQA:
    the `heads // kv_heads` query heads that share a KV head become that head's query rows, so SDPA
    sees as many heads as the cache has (one call, no `enable_gqa`). query [n, heads, dim],
    keys/values [kv_heads, L, dim]; mask: None, [n, L] (bool, or additive float) shared by all heads,
    or [heads, n, L] additive per head (ALiBi) -> [n, heads, dim].

    Why: on the CPU, SDPA with a mask and `enable_gqa` runs the math kernel (measured with torch 2.13:
    2-3x the time of the flash kernel a folded call gets), and a multi-token step with a mask is
    what speculative verification and chunked prefill send. The masks are repeated to the folded
    rows (row t * group + g is query token t of head g of its group), so each query row sees
    exactly the keys its token may see."""
    n, heads, dim = query.shape
    kv_heads, length = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    q = query.reshape(n, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, n * group, dim)
    if mask is not None:
        if mask.dim() == 2 and n == 1:  # one token: its mask broadcasts over all rows
            mask = mask.view(1, 1, 1, length)
        elif mask.dim() == 2:  # the same for every head: one [n * group, L] mask broadcast over KV heads
            mask = mask.unsqueeze(1).expand(n, group, length).reshape(1, 1, n * group, length)
        else:  # per query head: [heads, n, L] -> [kv_heads, n, group, L] in the folded row order
            mask = mask.view(kv_heads, group, n, length).transpose(1, 2).reshape(1, kv_heads, n * group, length)
    o = F.scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scale)
    return o[0].view(kv_heads, n, group, dim).transpose(0, 1).reshape(n, heads, dim)


def _graph_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seg: AttentionSegment,
    scale: float,
    sliding_window: int | None,
    slopes: torch.Tensor | None,
) -> torch.Tensor:
    """One decode token at a position held in a device tensor (capturable in a CUDA graph): the KV
    write is an index_copy at that position and attention runs over the whole static cache with an
    additive mask hiding positions after it (and before the window), so no shape depends on the
    position. query [1, heads, dim] -> [1, heads, dim]."""
    pos = seg.position
    seg.key_cache.index_copy_(1, pos, key.transpose(0, 1))
    seg.value_cache.index_copy_(1, pos, value.transpose(0, 1))
    length = seg.key_cache.shape[1]
    key_pos = torch.arange(length, device=pos.device)
    visible = key_pos <= pos
    if sliding_window is not None:
        visible &= key_pos > pos - sliding_window
    if slopes is None:
        mask = torch.zeros(1, length, dtype=query.dtype, device=pos.device).masked_fill_(~visible, float("-inf"))
    else:  # a bias per query head: [heads, 1, length]
        mask = _alibi_bias(slopes, key_pos, query.dtype).masked_fill(~visible, float("-inf"))
    return grouped_attention(query, seg.key_cache, seg.value_cache, mask, scale)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: list[AttentionSegment],
    *,
    scale: float,
    sliding_window: int | None = None,
    alibi: torch.Tensor | None = None,
) -> torch.Tensor:
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
        if causal:  # a whole prompt from position 0: the causal kernel, no mask to build
            query = q[r0:r1].transpose(0, 1)  # [heads, n, dim]
            o = F.scaled_dot_product_attention(
                query.unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=keys.shape[0] != query.shape[0],
            )
            out[r0:r1] = o[0].transpose(0, 1)
        else:
            out[r0:r1] = grouped_attention(q[r0:r1], keys, values, mask, scale)
    return out
