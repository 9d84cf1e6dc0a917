"""TEST ONLY, off by default: `launch-server --test-corrupt MODE` makes this server return wrong hidden states.

A misbehaving server for the client's verification (petals_chain/client/verification.py) to catch:
a faulty GPU, corrupted weights, or a member that perturbs activations on purpose or skips blocks to
save compute. It wraps the serving stack's block range (`server/serving_stack.py:build_stack`, as the
`--emulate-slowdown` emulation does), so every output a batch produces for a session's step or a
stateless forward passes through `CorruptedBlockRange.forward`: the one hook. The start-up profile
runs on the real range underneath (`server/emulation.py:real_range`), so it neither counts as
sessions nor announces other times than an honest server of the same range would.

Modes (`parse_mode`):
- `noise`: every step's output gets Gaussian noise of its own RMS (scale 1.0, `noise:SCALE` to change);
- `rare:P`: with probability P per step (e.g. `rare:0.01`), a small perturbation: noise of 0.02 x the
  output's RMS (`rare:P:SCALE` to change);
- `skip-last`: the range's last block is never run (its output is the block's input): a server that
  saves compute and claims the work;
- `after:N`: honest for the first N sessions (KV caches it served), then noise on every step of every
  later one.

Randomness comes from one seeded generator (`--test-corrupt-seed`), so runs are reproducible.
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass

import torch

from petals_chain.errors import InvalidRequestError
from petals_chain.runtime.block_range import StepInput

MODES = ("noise", "rare", "skip-last", "after")
RARE_SCALE = 0.02  # the "small perturbation": relative to the output's RMS


@dataclass(frozen=True)
class CorruptionMode:
    kind: str  # one of MODES
    probability: float = 1.0  # of corrupting a step (rare)
    scale: float = 1.0  # noise std relative to the output's RMS
    honest_sessions: int = 0  # after: sessions served honestly first

    def describe(self) -> str:
        if self.kind == "rare":
            return f"rare:{self.probability}:{self.scale}"
        if self.kind == "after":
            return f"after:{self.honest_sessions}"
        if self.kind == "noise":
            return f"noise:{self.scale}"
        return self.kind


def parse_mode(text: str) -> CorruptionMode:
    """`noise[:SCALE]`, `rare:P[:SCALE]`, `skip-last`, `after:N`; a typed error says what is accepted."""
    spec = text.strip()
    usage = (
        f"--test-corrupt takes noise[:SCALE], rare:P[:SCALE] (0 < P <= 1), skip-last or after:N (N >= 0), got {text!r}"
    )
    if spec == "skip-last":
        return CorruptionMode("skip-last")
    if m := re.fullmatch(r"noise(?::([0-9.eE+-]+))?", spec):
        scale = float(m.group(1)) if m.group(1) else 1.0
        if not scale > 0:
            raise InvalidRequestError(usage)
        return CorruptionMode("noise", scale=scale)
    if m := re.fullmatch(r"rare:([0-9.eE+-]+)(?::([0-9.eE+-]+))?", spec):
        try:
            p, scale = float(m.group(1)), float(m.group(2)) if m.group(2) else RARE_SCALE
        except ValueError:
            raise InvalidRequestError(usage) from None
        if not (0 < p <= 1 and scale > 0):
            raise InvalidRequestError(usage)
        return CorruptionMode("rare", probability=p, scale=scale)
    if m := re.fullmatch(r"after:(\d+)", spec):
        return CorruptionMode("after", honest_sessions=int(m.group(1)))
    raise InvalidRequestError(usage)


class CorruptedBlockRange:
    """Wraps a block range (a `BlockRange` or the slowdown emulation's wrapper): `forward` returns
    corrupted outputs as `mode` says; everything else is the range's (`inner`)."""

    def __init__(self, inner, mode: CorruptionMode, seed: int = 0):
        self.inner = inner
        self.mode = mode
        self._lock = threading.Lock()  # the scheduler thread and an inline step on the loop may both run batches
        self._generator = torch.Generator().manual_seed(seed)
        # after:N: the KV caches seen (by id, with a weak reference that tells a reused id apart) and
        # whether each is corrupted; sessions_seen counts every one ever seen
        self._kvs: dict[int, tuple[weakref.ref, bool]] = {}
        self.sessions_seen = 0
        self.corrupted_steps = 0  # steps whose output this wrapper changed (for logs and tests)

    def __getattr__(self, name: str):  # start, end, dtype, allocate_kv, validate_step, ... of the real range
        return getattr(self.inner, name)

    def forward(self, steps: list[StepInput]) -> list[torch.Tensor]:
        if self.mode.kind == "skip-last":
            return self._forward_skipping_last(steps)
        with self._lock:
            corrupt = [self._decide(step) for step in steps]
        outs = self.inner.forward(steps)
        if not any(corrupt):
            return outs
        with self._lock:
            result = []
            for out, bad in zip(outs, corrupt):
                if bad:
                    rms = out.float().pow(2).mean().sqrt().clamp_min(1e-6)
                    noise = torch.randn(out.shape, generator=self._generator) * (self.mode.scale * rms)
                    out = (out.float() + noise.to(out.device)).to(out.dtype)
                    self.corrupted_steps += 1
                result.append(out)
            return result

    def _decide(self, step: StepInput) -> bool:
        """Whether this step's output is corrupted (under the lock)."""
        kind = self.mode.kind
        if kind == "noise":
            return True
        if kind == "rare":
            return bool(torch.rand((), generator=self._generator).item() < self.mode.probability)
        # after:N: the (N+1)-th KV cache this range serves, and every later one, is corrupted
        kv = step.kv
        known = self._kvs.get(id(kv))
        if known is None or known[0]() is not kv:
            self.sessions_seen += 1
            known = (weakref.ref(kv), self.sessions_seen > self.mode.honest_sessions)
            self._kvs = {k: v for k, v in self._kvs.items() if v[0]() is not None}
            self._kvs[id(kv)] = known
        return known[1]

    def _forward_skipping_last(self, steps: list[StepInput]) -> list[torch.Tensor]:
        """The inner range's forward with its last block replaced by the identity (never computed)."""
        inner = _innermost(self.inner)
        last = inner.blocks[inner.end - 1]
        family = inner.family
        with self._lock:
            inner.family = _SkippingFamily(family, last)
            try:
                out = self.inner.forward(steps)
            finally:
                inner.family = family
            self.corrupted_steps += len(steps)
        return out


class _SkippingFamily:
    """A model family whose `block_forward` returns its input for one block (the skipped one)."""

    def __init__(self, family, skipped):
        self._family = family
        self._skipped = skipped

    def block_forward(self, block, hidden, features, segments):
        if block is self._skipped:
            return hidden
        return self._family.block_forward(block, hidden, features, segments)

    def __getattr__(self, name: str):
        return getattr(self._family, name)


def _innermost(block_range):
    while (inner := getattr(block_range, "inner", None)) is not None:
        block_range = inner
    return block_range


def maybe_corrupted(block_range, mode: str | None, seed: int = 0):
    """`block_range` as it is (mode None: every server but a test's), else wrapped."""
    return block_range if not mode else CorruptedBlockRange(block_range, parse_mode(mode), seed)
