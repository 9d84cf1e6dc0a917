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

# Across dtypes (a float32 row checked by a bfloat16 server, or the other way round) the rows are judged
# together, by their median error, not one by one. Honest float32 and bfloat16 rows differ with a heavy
# tail (SmolLM2-135M, all 30 blocks, 256 random 12-token prompts, one stateless forward in each dtype;
# docs/verification.md): median row error 0.02, 99.7th percentile 0.2, 8 rows of 3,072 over 0.2, up to
# 0.53, and 2.5 where float32 gave the second token a massive activation (Sun et al., 2024: a few
# dimensions hundreds of times the rest, as the attention sink at the first token has) that bfloat16
# did not; the outliers are isolated rows (at most 3 of a prompt's 12). A server that skips its last
# block is off by 0.44 at least (median 0.79), one adding noise of the rows' RMS by about 1: no bound
# on one row separates them from the honest tail, while every prompt's median stayed under 0.05 honest
# and over 0.64 skipping a block. With fewer than MIN_ROWS_FOR_MEDIAN rows each row is judged (the
# outliers came at prompt positions 1-7; none of 1,024 rows at positions 8-11 exceeded 0.16).
# What this gives up: across dtypes, a server that corrupts a minority of an audit's rows is not
# caught by that audit (a same-dtype check sees it; checkers of the session's dtype are preferred).
MIN_ROWS_FOR_MEDIAN = 3


def tolerance_for(*dtypes: torch.dtype) -> float:
    """The bound for comparing outputs computed in these dtypes (the loosest of them)."""
    return max(TOLERANCE_BY_DTYPE.get(d, max(TOLERANCE_BY_DTYPE.values())) for d in dtypes)


def row_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Relative error of each row of `a` [rows, hidden] against `b`: ||a - b|| / ||b|| (float32)."""
    a32, b32 = a.float(), b.float()
    return (a32 - b32).norm(dim=-1) / b32.norm(dim=-1).clamp_min(1e-12)


def first_mismatch(a: torch.Tensor, b: torch.Tensor, tolerance: float, *, across_dtypes: bool = False) -> int | None:
    """The index of the first row where `a` and `b` disagree beyond `tolerance` (None: they agree).
    A row with NaN or Inf disagrees. `across_dtypes` (they were computed in different dtypes): with at
    least MIN_ROWS_FOR_MEDIAN rows, all finite, rows over `tolerance` count only when the median row
    error is over it too (see above)."""
    errors = row_errors(a, b)
    bad = ~(errors <= tolerance)  # NaN compares False: a non-finite row disagrees
    if not bool(bad.any()):
        return None
    if (
        across_dtypes
        and errors.numel() >= MIN_ROWS_FOR_MEDIAN
        and bool(errors.isfinite().all())
        and float(errors.median()) <= tolerance
    ):
        return None
    return int(bad.nonzero()[0, 0])


def digest(tensor: torch.Tensor) -> str:
    """sha256 (hex) of a tensor's dtype, shape and bytes: the name a report gives the tensors it carries."""
    t = tensor.detach().contiguous().cpu()
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{list(t.shape)}:".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
