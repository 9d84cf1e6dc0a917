"""Sizes the orchestrator plans with, and errors at the runtime boundary."""

from __future__ import annotations

import pytest
import torch

from petals_chain.errors import (
    InvalidRequestError,
    MaxLengthExceededError,
    ModelNotFoundError,
)
from petals_chain.models.checkpoint import read_tensors, resolve_model_path
from petals_chain.runtime.block_range import BlockRange, StepInput


def test_block_and_kv_bytes(tiny_llama_path):
    r = BlockRange(tiny_llama_path, 1, 3)
    # 4 attention projections (q,o: 64x64; k,v: 64x32) + 3 MLP (64x128) + 2 norms, float32
    expected_params = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64
    assert r.block_bytes == expected_params * 4
    # keys + values, 2 kv heads x 16 dims x 100 positions x 4 bytes
    assert r.kv_bytes_per_block(100) == 2 * 2 * 16 * 100 * 4
    kv = r.allocate_kv(100, first_block=2)
    assert kv.nbytes == r.kv_bytes_per_block(100) * 1


def test_only_range_tensors_are_read(tiny_llama_path, monkeypatch):
    import petals_chain.runtime.block_range as br

    seen: list[str] = []
    real = br.read_tensors

    def spy(path, names, dtype=None):
        seen.extend(names)
        return real(path, names, dtype)

    monkeypatch.setattr(br, "read_tensors", spy)
    BlockRange(tiny_llama_path, 2, 4)
    assert seen and all(n.startswith(("model.layers.2.", "model.layers.3.")) for n in seen)


def test_bad_inputs_raise_typed_errors(tiny_llama_path):
    r = BlockRange(tiny_llama_path, 0, 2)
    kv = r.allocate_kv(4)
    with pytest.raises(InvalidRequestError, match="shape"):
        r.forward([StepInput(kv, torch.zeros(3, 65))])
    with pytest.raises(InvalidRequestError, match="float"):
        r.forward([StepInput(kv, torch.zeros(3, 64, dtype=torch.long))])
    with pytest.raises(InvalidRequestError, match="NaN"):
        r.forward([StepInput(kv, torch.full((1, 64), float("nan")))])
    with pytest.raises(MaxLengthExceededError, match="max_length=4"):
        r.forward([StepInput(kv, torch.zeros(5, 64))])
    assert kv.past_tokens == 0  # nothing was consumed by the failed calls
    with pytest.raises(InvalidRequestError, match="range"):
        BlockRange(tiny_llama_path, 4, 9)
    with pytest.raises(InvalidRequestError, match="entry block"):
        r.allocate_kv(4, first_block=5)


def test_unknown_model_says_how_to_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="--model smollm2-135m"):
        resolve_model_path(tmp_path / "nothing-here")
    with pytest.raises(ModelNotFoundError):
        read_tensors(tmp_path, ["x"])
