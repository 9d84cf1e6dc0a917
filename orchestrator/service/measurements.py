"""Per-session quantities of the paper from per-token measurements (footnote 11). Pure functions.

tau_p_j = t_o + t_I,j * l_in + t_O,j * (l_out - 1): one block, one whole session (prefill of l_in
tokens, then l_out - 1 decode steps; the prefill produces the first output token).
tau_c_j = steps * (RTT_j + per-step overhead), steps = l_out (one prefill step + l_out - 1 decode
steps), with RTT_j measured from the orchestrator (the client relays, as the tau_c model assumes).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SessionShape:
    """Expected input and output lengths of a session (tokens)."""

    mean_input_tokens: float
    mean_output_tokens: float

    def __post_init__(self) -> None:
        if not self.mean_input_tokens >= 1 or not self.mean_output_tokens >= 1:
            raise ValueError(f"mean input/output tokens must be >= 1, got {self.mean_input_tokens}, "
                             f"{self.mean_output_tokens}")

    @property
    def steps(self) -> float:
        """Round trips of one session through a server: 1 prefill step + (l_out - 1) decode steps."""
        return self.mean_output_tokens


def tau_p_s(prefill_s_per_token: float, decode_s_per_token: float, shape: SessionShape,
            per_block_overhead_s: float = 0.0) -> float:
    """Footnote 11: t_o + t_I l_in + t_O (l_out - 1), per block, per session."""
    return per_block_overhead_s + prefill_s_per_token * shape.mean_input_tokens + \
        decode_s_per_token * (shape.mean_output_tokens - 1)


def tau_c_s(rtt_s: float, shape: SessionShape, per_step_overhead_s: float = 0.0) -> float:
    """Communication time of one session with a server: steps x (RTT + per-step overhead)."""
    return shape.steps * (rtt_s + per_step_overhead_s)


def median(values: list[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


class LengthEstimator:
    """Expected input/output lengths: the flags' values as a prior worth `prior_weight` sessions,
    updated with the lengths reported by finished sessions (a running mean)."""

    def __init__(self, prior: SessionShape, prior_weight: float = 1.0):
        self.prior = prior
        self.prior_weight = prior_weight
        self.sessions = 0
        self._sum_in = 0.0
        self._sum_out = 0.0

    def observe(self, input_tokens: int, output_tokens: int) -> None:
        if input_tokens < 1 or output_tokens < 1:
            return  # a session that never ran a step says nothing about lengths
        self.sessions += 1
        self._sum_in += input_tokens
        self._sum_out += output_tokens

    @property
    def shape(self) -> SessionShape:
        w = self.prior_weight
        n = w + self.sessions
        return SessionShape((w * self.prior.mean_input_tokens + self._sum_in) / n,
                            (w * self.prior.mean_output_tokens + self._sum_out) / n)
