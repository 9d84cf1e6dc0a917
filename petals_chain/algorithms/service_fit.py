"""The service model of one server, fitted from its batches: pure (numpy and scipy only), shared by the
server (its start-up profile, `server/range_profile.py`, and its check of that profile against live
service) and the orchestrator (`orchestrator/service/calibration.py`: the sliding windows, the hop
costs and the re-plan trigger around this fit). It lives here because `server/` may not import
`orchestrator/` (DESIGN.md).

Per batch: wall_s = t_o + t_B * blocks + t_I * prefill_block_tokens + t_O * decode_block_tokens
(footnote 11 of the paper, with t_o per step and server; see `fit_service`), fitted by least absolute
deviations (IRLS), so a batch slowed by a neighbour's burst or a GC pause does not move the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls


@dataclass(frozen=True)
class ServiceFit:
    t_I_s: float | None  # prefill seconds per token per block (None: no prefill batch in the window)
    t_O_s: float  # decode seconds per token per block
    t_o_s: float  # seconds per step (per batch) on this server, whatever its blocks
    samples: int
    median_abs_rel_residual: float  # how well the line describes the window
    t_O_from_profile: bool = False  # the window could not tell t_O from t_o: t_O is the start-up profile's
    t_o_lone_batches: int = 0  # t_o was anchored at this many one-session decode batches (0: the line's own)
    # seconds per block per step, whatever the rows (the weights' cost); 0 when fitted without blocks
    t_B_s: float = 0.0
    blocks_separable: bool = False  # the window held steps of different block counts: t_o apart from t_B

    def step_s(self, blocks: int, rows: int = 1) -> float:
        """Modelled wall time of one decode step of `rows` sessions through `blocks` blocks."""
        return self.t_o_s + blocks * (self.t_B_s + rows * self.t_O_s)


def _lad(X: np.ndarray, y: np.ndarray, iterations: int) -> np.ndarray:
    """Non-negative least-absolute-deviation coefficients of y ~ X (IRLS; each step an NNLS)."""
    # scale columns so the weights of the IRLS do not depend on units
    scale = np.maximum(np.abs(X).max(axis=0), 1e-12)
    Xs = X / scale
    w = np.ones_like(y)
    floor = 1e-6 * max(float(np.median(np.abs(y))), 1e-12)
    beta = np.zeros(X.shape[1])
    for _ in range(iterations):
        sw = np.sqrt(w)
        beta, _ = nnls(Xs * sw[:, None], y * sw)
        w = 1.0 / np.maximum(np.abs(y - Xs @ beta), floor)
    return beta / scale


MIN_LONE_BATCHES = 5  # one-session decode batches needed to anchor t_o at them
MIN_SPAN_BATCHES = 3  # batches per block count needed to tell t_o from t_B


FAR_OUT_IQR = 3.0  # Tukey's far-out fence: lone steps beyond Q3 + 3 IQR are stalls, not service


def mean_level(values: np.ndarray) -> float:
    """The mean of `values` without their far-out high values (beyond Q3 + 3 IQR).

    Why the mean and not the median: the paper's tau_p is a session's mean time in service (a chain's
    rate is 1 / E[T]), and a lone step's time on a host with a CPU quota is skewed to the right (the
    full Table 1 run in docs/results.md: lone decode steps on the 0.12-core hosts had their mean 12-17 % above
    their median, on the 0.193-core hosts within +-7 %), so a median anchors the model below what a
    session takes on average. The fence keeps one stalled step (a swapped-in page, a GC pause) from
    moving a window of a few lone steps."""
    v = np.asarray(values, dtype=float)
    q1, q3 = np.percentile(v, [25, 75])
    return float(v[v <= q3 + FAR_OUT_IQR * (q3 - q1)].mean())


def _separable(blocks: np.ndarray, min_each: int) -> bool:
    """At least two block counts, each seen in `min_each` batches: t_o and t_B are then identified."""
    _, counts = np.unique(blocks, return_counts=True)
    return int((counts >= min_each).sum()) >= 2


def fit_service(
    prefill_block_tokens,
    decode_block_tokens,
    wall_s,
    *,
    iterations: int = 30,
    t_O_profile_s: float | None = None,
    sessions=None,
    blocks=None,
) -> ServiceFit | None:
    """Least-absolute-deviation fit of wall = t_o + t_B b + t_I P + t_O D with every term >= 0.
    None when the window cannot separate them (no decode batch, or fewer than 3 batches).

    `blocks` (per batch: the most blocks one step of it ran): with it, t_B is fitted. When the window
    holds steps of one block count only (a server every chain runs whole), t_o and t_B are the same
    column; the step's fixed part is then put per block (t_o = 0): measured on these CPU hosts, a
    lone step's in-server overhead beyond the blocks' compute is 5-10 ms of 0.2-0.4 s, so a step
    through fewer blocks costs proportionally less (a Table 1 quick run, docs/results.md: a fast server's
    lone steps took 0.16-0.18 s through 14 blocks, 0.29-0.33 s through 30). Without `blocks`, t_B = 0
    and the fixed part is t_o (the start-up profile and the server's own cache check).

    A server's blocks are fixed, so D is its blocks times the sessions in the batch: when batches
    hold about as many sessions each (or the per-session cost is below the batches' noise), D is
    nearly a constant and t_O trades off against the fixed part. The L1 fit then may put the whole
    decode cost there and return t_O = 0 (it sits on the bound); when every decode batch held as many
    rows, t_O is not fitted at all. With `t_O_profile_s` (the start-up
    profile's t_O), such a fit keeps the profile's t_O and fits the rest to what remains: the planner
    needs t_O per block, and a fit at the bound says only that the window cannot tell it.

    `sessions` (per batch): with at least MIN_LONE_BATCHES one-session decode batches, the lone step
    is anchored at them (all the window's: one lone step's time varies by +-15 % from one session to
    the next on a quiet machine, and anchoring at the newest 16 instead did not track the probe
    better in two quick runs): when they span block counts, the slope s of their wall over blocks by
    LAD (t_B = s - t_O) and t_o at their mean beyond it; else their mean (`mean_level`: the fixed
    part per block, or beside the line's t_o when the whole window separated it). Why: on a CPU a
    batch's cost is not linear in its sessions. 1 to 3 decode rows cost about the same, then it
    grows (one server of 30 blocks at 0.193 cores, measured: 1 session 0.28-0.33 s per step, 3
    sessions 0.35 s, 6 sessions 0.56 s), so the L1 line over a
    window of mixed batches takes the larger batches' slope and runs below the lone ones. The paper's
    tau_p and tau_c are a session's time alone; the slope t_O still says what each further session
    adds (for 2-3 sessions a little more than they cost)."""
    p = np.asarray(prefill_block_tokens, dtype=float)
    d = np.asarray(decode_block_tokens, dtype=float)
    y = np.asarray(wall_s, dtype=float)
    k = np.zeros_like(y) if sessions is None else np.asarray(sessions, dtype=float)
    b = None if blocks is None else np.asarray(blocks, dtype=float)
    ok = np.isfinite(p) & np.isfinite(d) & np.isfinite(y) & (y > 0) & (p + d > 0)
    if b is not None:
        ok &= np.isfinite(b) & (b > 0)
    p, d, y, k = p[ok], d[ok], y[ok], k[ok]
    if b is not None:
        b = b[ok]
    if len(y) < 3 or not (d > 0).any():
        return None
    separable = b is not None and _separable(b, MIN_SPAN_BATCHES)
    per_block_fixed = b is not None and not separable  # t_o and t_B one column: the fixed part per block
    # column 0: the fixed part of a step (1, or its blocks when t_o and t_B cannot be told apart)
    fixed = b if per_block_fixed else np.ones_like(y)
    cols = {0: fixed, 1: p, 2: d, **({3: b} if separable else {})}
    use = [i for i in (0, 3, 1, 2) if i in cols and (i != 1 or (p > 0).any())]  # without prefill t_I is unknown
    # rows per decode step all equal (every decode batch one session, say): D is then a multiple of the
    # blocks column and t_O cannot be told from the fixed part; an L1 fit would split them anyhow
    rows = (d / b if b is not None else k)[d > 0]
    t_O_known = sessions is None and b is None or len(np.unique(rows)) > 1
    fit_cols = use if t_O_known else [i for i in use if i != 2]
    X = np.stack([cols[i] for i in use], axis=1)
    coef = dict(zip(fit_cols, _lad(X[:, [use.index(i) for i in fit_cols]], y, iterations)))
    coef.setdefault(2, 0.0)
    from_profile = False
    if coef[2] <= 0 and t_O_profile_s is not None and math.isfinite(t_O_profile_s) and t_O_profile_s > 0:
        rest = [i for i in use if i != 2]
        coef = dict(zip(rest, _lad(X[:, [use.index(i) for i in rest]], y - t_O_profile_s * d, iterations)))
        coef[2] = float(t_O_profile_s)
        from_profile = True
    lone = (k == 1) & (p == 0) & (d > 0)
    n_lone = int(lone.sum())
    if n_lone >= MIN_LONE_BATCHES:
        yl, dl = y[lone], d[lone]
        bl = dl if b is None else b[lone]
        # the lone step's level is their mean (far-out values dropped), its slope over blocks robust
        if b is not None and _separable(bl, 2):
            _, slope = _lad(np.stack([np.ones_like(yl), bl], axis=1), yl, iterations)
            coef[3] = max(0.0, float(slope) - coef[2])
            coef[0] = max(0.0, mean_level(yl - (coef[3] + coef[2]) * bl))
            # the lone steps told t_o from t_B even where the whole window could not (2 lone batches at a
            # block count, fewer than MIN_SPAN_BATCHES there in all): the fit is t_o + m t_B from here on
            # (column 0 a constant again, column 3 the blocks)
            separable, per_block_fixed = True, False
            cols[0], cols[3] = np.ones_like(y), b
        elif per_block_fixed:  # coef[0] multiplies b
            coef[0] = max(0.0, mean_level(yl / bl) - coef[2])
        else:  # t_o beside the line's t_B (0 without blocks)
            coef[0] = max(0.0, mean_level(yl - (coef.get(3, 0.0) + coef[2]) * bl))
    else:
        n_lone = 0
    pred = sum(coef[i] * cols[i] for i in coef)
    rel = np.abs(y - pred) / y
    if per_block_fixed:
        t_o, t_B = 0.0, float(coef[0])
    else:
        t_o, t_B = float(coef.get(0, 0.0)), float(coef.get(3, 0.0))
    return ServiceFit(
        t_I_s=float(coef[1]) if 1 in coef else None,
        t_O_s=float(coef[2]),
        t_o_s=t_o,
        samples=int(len(y)),
        median_abs_rel_residual=float(np.median(rel)),
        t_O_from_profile=from_profile,
        t_o_lone_batches=n_lone,
        t_B_s=t_B,
        blocks_separable=separable,
    )
