"""What a model family must provide to be served block by block, and the registry of families.

A family is one file (see `llama.py`): how to build one transformer block, which checkpoint tensors
belong to a block or to the client side, the KV layout, and a forward over a flattened batch of
several sessions' tokens that reads/writes each session's static KV cache.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
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
    def position_encoder(self, config) -> Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, ...]]:
        """A function (positions, dtype) -> per-row position features (e.g. rotary cos/sin), each with
        first dimension len(positions). Built once per runtime object."""

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
