"""What a model family must provide to be served block by block, and the registry of families.

A family is one file (see `llama.py`): how to build one transformer block, which checkpoint tensors
belong to a block or to the client side, the KV layout, and a forward over a flattened batch of
several sessions' tokens that reads/writes each session's static KV cache.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from petals_chain.errors import UnsupportedModelError


@dataclass
class AttentionSegment:
    """One session's rows in a flattened batch, with that session's KV cache for one block.

    Rows `[row_start, row_start + n_tokens)` of the batch belong to the session; its cache holds
    `past_tokens` positions already, and the new keys/values go to `[past_tokens, past_tokens + n_tokens)`.
    """

    row_start: int
    n_tokens: int
    past_tokens: int
    key_cache: torch.Tensor  # [kv_heads, max_length, head_dim]
    value_cache: torch.Tensor
    # Set only in a CUDA-graph decode step (runtime/decode_graphs.py): a one-element long tensor on the
    # cache's device holding `past_tokens`, so one captured graph serves every position. Then
    # n_tokens == 1 and `past_tokens` is not read.
    position: torch.Tensor | None = None


class PositionEncoder:
    """Per-row position features of a family (rotary cos/sin; nothing for ALiBi-style families).

    `reserve(n)` is called with the largest position + 1 before any call that reaches it, so an
    encoder can keep a table and a call never grows it (a grow inside a CUDA-graph capture would be
    lost on replay)."""

    def reserve(self, n_positions: int) -> None:
        pass

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return ()


class RotaryTable(PositionEncoder):
    """Rotary cos/sin for positions [0, capacity), computed on the device by the model's own rotary
    module (so whatever rope scaling it implements is kept) and indexed per step instead of
    recomputed. The table is float32, as transformers computes it, and cast per call: the values
    equal a direct call's (each entry is one product and a cos/sin, independent of the others)."""

    def __init__(self, rotary: nn.Module, device: torch.device):
        self.rotary = rotary
        self.device = torch.device(device)
        self.capacity = 0
        self.cos = self.sin = torch.empty(0, device=self.device)

    def reserve(self, n_positions: int) -> None:
        if n_positions <= self.capacity:
            return
        capacity = max(n_positions, 2 * self.capacity, 256)
        positions = torch.arange(capacity, device=self.device).view(1, -1)
        cos, sin = self.rotary(torch.empty(0, dtype=torch.float32, device=self.device), positions)
        self.cos, self.sin, self.capacity = cos[0], sin[0], capacity

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return self.cos.index_select(0, positions).to(dtype), self.sin.index_select(0, positions).to(dtype)


def write_and_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seg: AttentionSegment,
                     scale: float) -> torch.Tensor:
    """Store a segment's new keys/values in its static cache and attend its queries over the cache.

    query [n, heads, dim], key/value [n, kv_heads, dim] (the segment's rows); returns [n, heads, dim].
    Shared by the families whose attention is plain softmax(QK^T)V with GQA over a static cache.
    """
    if seg.position is not None:
        return _graph_decode_attention(query, key, value, seg, scale)
    p0, p1 = seg.past_tokens, seg.past_tokens + seg.n_tokens
    seg.key_cache[:, p0:p1] = key.transpose(0, 1)
    seg.value_cache[:, p0:p1] = value.transpose(0, 1)
    keys, values = seg.key_cache[:, :p1], seg.value_cache[:, :p1]
    q = query.transpose(0, 1)  # [heads, n, dim]
    if seg.n_tokens == 1:
        mask, causal = None, False  # a single new token sees every cached position
    elif p0 == 0:
        mask, causal = None, True
    else:
        # query i sits at absolute position p0 + i and may see keys 0..p0+i (bottom-right aligned);
        # made on the cache's device: a CPU mask beside CUDA queries fails inside SDPA
        mask = torch.ones(seg.n_tokens, p1, dtype=torch.bool, device=keys.device).tril(diagonal=p0)
        causal = False
    o = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                       attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def _graph_decode_attention(query, key, value, seg: AttentionSegment, scale: float) -> torch.Tensor:
    """One decode token at a position held in a device tensor (capturable in a CUDA graph): the KV
    write is an index_copy at that position and attention runs over the whole static cache with an
    additive mask hiding positions after it, so no shape depends on the position."""
    pos = seg.position
    seg.key_cache.index_copy_(1, pos, key.transpose(0, 1))
    seg.value_cache.index_copy_(1, pos, value.transpose(0, 1))
    kv_heads, length, dim = seg.key_cache.shape
    heads = query.shape[1]
    # GQA without repeating the cache: the `heads // kv_heads` query heads that share a KV head become
    # that head's query rows (a decode token's rows all see the same positions, so one mask serves them)
    q = query[0].view(kv_heads, heads // kv_heads, dim).unsqueeze(0)
    visible = torch.arange(length, device=pos.device) <= pos
    mask = torch.zeros(length, dtype=q.dtype, device=pos.device).masked_fill_(~visible, float("-inf"))
    o = F.scaled_dot_product_attention(q, seg.key_cache.unsqueeze(0), seg.value_cache.unsqueeze(0),
                                       attn_mask=mask.view(1, 1, 1, length), scale=scale)
    return o[0].reshape(1, heads, dim)


class ModelFamily(ABC):
    """A model architecture served block by block."""

    name: str
    model_types: tuple[str, ...]

    @abstractmethod
    def num_blocks(self, config) -> int: ...

    @abstractmethod
    def block_tensor_names(self, config, index: int) -> list[str]: ...

    @abstractmethod
    def make_block(self, config, index: int) -> nn.Module:
        """An empty block (weights on the meta device) to be filled with `load_state_dict(assign=True)`."""

    @abstractmethod
    def block_state_key(self, config, index: int, tensor_name: str) -> str:
        """Map a checkpoint tensor name to the block module's own state-dict key."""

    @abstractmethod
    def kv_heads_and_dim(self, config) -> tuple[int, int]: ...

    @abstractmethod
    def position_encoder(self, config, device: torch.device) -> PositionEncoder:
        """A function (positions, dtype) -> per-row position features (e.g. rotary cos/sin), each with
        first dimension len(positions), on `device` (where `positions` live). Built once per runtime
        object; it must not allocate per call what it can cache, and must be capturable in a CUDA graph
        (no host sync) once warmed up for the positions it will see."""

    @abstractmethod
    def block_forward(
        self, block: nn.Module, hidden: torch.Tensor, features: tuple[torch.Tensor, ...],
        segments: list[AttentionSegment],
    ) -> torch.Tensor:
        """Run one block over `hidden` [rows, hidden_size]; writes each segment's new KV."""

    @abstractmethod
    def client_tensor_names(self, config) -> dict[str, str]:
        """Checkpoint names of the client-side tensors: keys 'embed', 'norm', 'lm_head'."""

    @abstractmethod
    def make_client_modules(self, config, tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, nn.Module, nn.Module]:
        """(embedding, final norm, lm head) built from the tensors named by `client_tensor_names`."""


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def get_family(config) -> ModelFamily:
    from petals_chain.models import llama  # noqa: F401  (registers itself)

    family = _FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', None)!r} is not supported; supported: {sorted(_FAMILIES)}. "
            "Add a family module under petals_chain/models/ to serve it."
        )
    return family
