"""What a model family must provide to be served block by block, and the registry of families.

A family is one module in `petals_chain/models/families/` (see `families/llama.py`): how to build
one transformer block, which checkpoint tensors belong to a block or to the client side, the KV
layout, and a forward over a flattened batch of several sessions' tokens that reads/writes each
session's static KV cache (`models/attention.py:segment_attention` does the per-session part).
The registry imports every module of that folder on first use, so adding a family never edits
this file.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from abc import ABC, abstractmethod
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


class ModelFamily(ABC):
    """A model architecture served block by block."""

    name: str
    model_types: tuple[str, ...]

    def check_config(self, config) -> None:
        """Raise `UnsupportedModelError` (saying what to do) for a config this family cannot serve exactly."""

    @abstractmethod
    def num_blocks(self, config) -> int: ...

    @abstractmethod
    def block_prefix(self, index: int) -> str:
        """Checkpoint name prefix of block `index`'s tensors, e.g. 'model.layers.3.'."""

    def block_tensor_names(self, config, index: int) -> list[str]:
        """Checkpoint names of block `index`'s tensors (by default: the block module's own keys under its prefix)."""
        return [self.block_prefix(index) + k for k in self.make_block(config, index).state_dict()]

    @abstractmethod
    def make_block(self, config, index: int) -> nn.Module:
        """An empty block (weights on the meta device) to be filled with `load_state_dict(assign=True)`."""

    def block_state(self, config, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The block module's state dict from its checkpoint tensors (by default: names minus the prefix;
        a family whose checkpoint layout differs from its module's, e.g. Mixtral's experts, converts here)."""
        prefix = self.block_prefix(index)
        return {name[len(prefix) :]: t for name, t in tensors.items()}

    @abstractmethod
    def kv_heads_and_dim(self, config) -> tuple[int, int]:
        """(KV heads, head dim) of one block's cache: what `s_c` (KV bytes per block per token) is made of."""

    @abstractmethod
    def position_encoder(self, config, device: torch.device) -> PositionEncoder:
        """A function (positions, dtype) -> per-row position features (e.g. rotary cos/sin), each with
        first dimension len(positions), on `device` (where `positions` live). Built once per runtime
        object; it must not allocate per call what it can cache, and must be capturable in a CUDA graph
        (no host sync) once warmed up for the positions it will see."""

    @abstractmethod
    def block_forward(
        self,
        block: nn.Module,
        hidden: torch.Tensor,
        features: tuple[torch.Tensor, ...],
        segments: list[AttentionSegment],
    ) -> torch.Tensor:
        """Run one block over `hidden` [rows, hidden_size]; writes each segment's new KV."""

    @abstractmethod
    def client_tensor_names(self, config) -> dict[str, str]:
        """Checkpoint names of the client-side tensors by role (what `make_client_modules` reads)."""

    @abstractmethod
    def make_client_modules(self, config, tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, nn.Module, nn.Module]:
        """(embedding, final norm, lm head) built from the tensors named by `client_tensor_names`."""


class FamilyRegistry:
    """model_type -> family. Family modules are discovered (imported) once, on the first lookup."""

    def __init__(self, package: str):
        self._package = package
        self._families: dict[str, ModelFamily] = {}
        self._discovered = False
        self._lock = threading.Lock()

    def register(self, family: ModelFamily) -> ModelFamily:
        for model_type in family.model_types:
            if model_type in self._families and self._families[model_type] is not family:
                raise ValueError(
                    f"model type {model_type!r} is registered twice "
                    f"({self._families[model_type].name} and {family.name})"
                )
            self._families[model_type] = family
        return family

    def _discover(self) -> None:
        with self._lock:
            if self._discovered:
                return
            package = importlib.import_module(self._package)
            for module in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{self._package}.{module.name}")  # registers itself
            self._discovered = True

    def model_types(self) -> list[str]:
        self._discover()
        return sorted(self._families)

    def get(self, config) -> ModelFamily:
        self._discover()
        model_type = getattr(config, "model_type", None)
        family = self._families.get(model_type)
        if family is None:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; supported: {sorted(self._families)}. "
                "Add a family module under petals_chain/models/families/ to serve it."
            )
        family.check_config(config)
        return family


REGISTRY = FamilyRegistry("petals_chain.models.families")


def register_family(family: ModelFamily) -> ModelFamily:
    return REGISTRY.register(family)


def get_family(config) -> ModelFamily:
    return REGISTRY.get(config)
