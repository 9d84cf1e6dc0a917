"""LoRA adapters (PEFT's on-disk format) applied per session inside one batched block call.

A server loads every adapter given to `--adapters` for the blocks it hosts. Each targeted linear
layer of a block is wrapped in a `LoraLinear` that keeps the base layer and every adapter's
(A, B, scaling). The base layer runs once on all rows of the batch; each adapter's low-rank update
`scaling * B(A(x))` is added only to the rows of the sessions that use it (`LoraRows`, set by the
block range around each block call), so sessions with different adapters, or none, share a batch.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from petals_chain.errors import (
    ModelNotFoundError,
    UnknownAdapterError,
    UnsupportedModelError,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def adapter_name(path: str | Path) -> str:
    """An adapter is named by its folder's name (what clients pass as `active_adapter`)."""
    return Path(path).expanduser().resolve().name


@dataclass
class LoraWeights:
    """One adapter's tensors for one block: module path inside the block -> (A [r, in], B [out, r])."""

    name: str
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _scaling(config: dict, path: Path) -> float:
    refused = [k for k in ("use_dora", "fan_in_fan_out", "lora_bias") if config.get(k)]
    refused += [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform") if config.get(k)]
    if config.get("peft_type", "LORA") != "LORA" or refused:
        raise UnsupportedModelError(
            f"adapter {path}: only plain LoRA adapters are served (peft_type LORA without "
            f"{', '.join(refused) or 'other peft types'}); merge or retrain it as plain LoRA"
        )
    if config.get("bias", "none") != "none":
        raise UnsupportedModelError(f"adapter {path}: LoRA with trained biases (bias={config['bias']!r}) is not served")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / (r**0.5) if config.get("use_rslora") else alpha / r


def load_adapter_blocks(path: str | Path, block_prefixes: dict[int, str], dtype: torch.dtype) -> dict[int, LoraWeights]:
    """Read a PEFT LoRA folder: for each block index in `block_prefixes` (index -> checkpoint prefix,
    e.g. 'model.layers.3.'), that block's LoRA tensors keyed by module path inside the block.
    Tensors of other blocks are never read. An adapter touching anything outside the blocks
    (embeddings, LM head) is refused: the client head does not take adapters."""
    path = Path(path).expanduser()
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ModelNotFoundError(
            f"{path} is not a PEFT adapter folder: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} "
            "(what PeftModel.save_pretrained writes)"
        )
    scaling = _scaling(json.loads((path / ADAPTER_CONFIG).read_text()), path)
    name = adapter_name(path)
    out = {index: LoraWeights(name, scaling) for index in block_prefixes}
    with safe_open(path / ADAPTER_WEIGHTS, framework="pt") as f:
        pairs: dict[str, dict[str, str]] = {}
        for key in f.keys():
            module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise UnsupportedModelError(
                    f"adapter {path}: unexpected tensor {key!r} (only lora_A/lora_B weights "
                    "of linear layers are served)"
                )
            pairs.setdefault(module, {})[kind[0]] = key
        for module, keys in pairs.items():
            index = next((i for i, p in block_prefixes.items() if module.startswith(p)), None)
            if index is None:
                if not any(module.startswith(p.rsplit(".", 2)[0] + ".") for p in block_prefixes.values()):
                    raise UnsupportedModelError(
                        f"adapter {path} changes {module!r}, which is not inside a transformer block; only adapters "
                        "of block layers are served"
                    )
                continue  # another server's block
            a, b = (f.get_tensor(keys[k]).to(dtype) for k in ("A", "B"))
            out[index].modules[module[len(block_prefixes[index]) :]] = (a, b)
    return out


class LoraRows(threading.local):
    """Which rows of the current block call use which adapter; the block range (its only writer)
    sets it around each block call, the block's `LoraLinear`s read it. Per thread: threads of one
    process may run the same block range's forward at once (in-process chains, the gateway)."""

    def __init__(self):
        self.groups: list[tuple[str, torch.Tensor]] = []  # (adapter, row indices)


class LoraLinear(nn.Module):
    """A linear layer plus any number of LoRA adapters, applied to the rows `rows` assigns them."""

    def __init__(self, base: nn.Module, rows: LoraRows):
        super().__init__()
        self.base = base
        self.rows = rows
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        out_features, in_features = b.shape[0], a.shape[1]
        if (getattr(self.base, "in_features", in_features), getattr(self.base, "out_features", out_features)) != (
            in_features,
            out_features,
        ):
            raise UnsupportedModelError(
                f"adapter {name}: LoRA shapes {tuple(a.shape)}/{tuple(b.shape)} do not fit a "
                f"{self.base.in_features}->{self.base.out_features} layer; was it trained "
                "on this model?"
            )
        self.lora[name] = (a, b, scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for name, rows in self.rows.groups:
            lora = self.lora.get(name)
            if lora is None:
                continue  # this adapter leaves this layer alone
            a, b, scaling = lora
            xs = x.index_select(0, rows)
            y = y.index_add(0, rows, (xs @ a.T @ b.T) * scaling)
        return y


def attach_adapter(block: nn.Module, weights: LoraWeights, rows: LoraRows) -> None:
    """Wrap (once) each linear layer the adapter targets in `block` and register the adapter there."""
    for module_path, (a, b) in weights.modules.items():
        parent_path, _, child = module_path.rpartition(".")
        parent = block.get_submodule(parent_path) if parent_path else block
        layer = getattr(parent, child)
        if not isinstance(layer, LoraLinear):
            if not isinstance(layer, nn.Linear):
                raise UnsupportedModelError(
                    f"adapter {weights.name} targets {module_path} ({type(layer).__name__}); "
                    "only linear layers take LoRA here"
                )
            layer = LoraLinear(layer, rows)
            setattr(parent, child, layer)
        layer.add(weights.name, a.to(layer.base.weight.device), b.to(layer.base.weight.device), weights.scaling)


def check_adapter(adapter: str | None, served: list[str]) -> None:
    if adapter is not None and adapter not in served:
        raise UnknownAdapterError(
            f"adapter {adapter!r} is not served here; served adapters: {served or 'none'}. "
            "Choose one of them, or start servers with --adapters PATH"
        )
