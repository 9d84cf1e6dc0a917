"""Comparing two servers' hidden states for the same step, and naming tensors by digest.

Pure functions, shared by the client's spot checks (petals_chain/client/verification.py) and the
orchestrator's check of a report's evidence (orchestrator/service/reports.py), so both judge alike.

Why a tolerance even for float32 on CPU: two honest computations of the same rows are not bit-equal
once their matmuls have other shapes: a server batches a session's decode row with other sessions'
rows, and a spot check recomputes the history as one prefill (measured on SmolLM2-135M, 10 blocks:
relative row error up to 2.3e-6 between a decode step alone and batched, 2.1e-6 against the prefill;
bfloat16 2.5e-2 against the prefill). So rows are compared by their relative error
||a - b|| / ||b|| against a bound per dtype, calibrated from honest pairs' distribution
(`scripts/bench_verify.py calibrate`, docs/verification.md): the bound is the largest honest error
seen times a margin, so honest pairs stay far below it while a perturbation of a few percent of a
row's norm (float32) does not.
"""

from __future__ import annotations

import hashlib

import torch

# Relative row error above which two servers' outputs for the same rows disagree, by dtype. float32:
# honest pairs measured at most 2.3e-6 (SmolLM2-135M, 10 blocks; all 30 in docs/verification.md) -> 1e-3,
# a margin over 400x, while the test mode's "small perturbation" (2e-2 of the row norm) is 20x above it.
# 16-bit types: honest prefill-vs-decode pairs reach a few 1e-2 -> 0.2: only gross corruption is
# caught between 16-bit servers (a 2 % perturbation is not).
TOLERANCE_BY_DTYPE: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.bfloat16: 0.2, torch.float16: 0.2}


def tolerance_for(*dtypes: torch.dtype) -> float:
    """The bound for comparing outputs computed in these dtypes (the loosest of them)."""
    return max(TOLERANCE_BY_DTYPE.get(d, max(TOLERANCE_BY_DTYPE.values())) for d in dtypes)


def row_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative error of each row of `a` [rows, hidden] against `b`: ||a - b|| / ||b|| (float32)."""
    a32, b32 = a.float(), b.float()
    return (a32 - b32).norm(dim=-1) / b32.norm(dim=-1).clamp_min(1e-12)


def first_mismatch(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> int | None:
    """The index of the first row where `a` and `b` disagree beyond `tolerance` (None: they agree).
    A row with NaN or Inf disagrees."""
    errors = row_errors(a, b)
    bad = ~(errors <= tolerance)  # NaN compares False: a non-finite row disagrees
    if not bool(bad.any()):
        return None
    return int(bad.nonzero()[0, 0])


def digest(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's dtype, shape and bytes: the name a report gives the tensors it carries."""
    t = tensor.detach().contiguous().cpu()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
