"""Per-session quantities of the online orchestrator from its measurements. Pure functions.

tau_p_j and tau_c_j come from orchestrator.session_times (one implementation, shared with the
simulator); RTT_j is measured from the orchestrator (the client relays, as the tau_c model assumes).
Here: the running estimate of the session shape (mean input/output lengths) and a median helper.
"""

from __future__ import annotations

from orchestrator.session_times import SessionShape


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
        return SessionShape(
            (w * self.prior.mean_input_tokens + self._sum_in) / n,
            (w * self.prior.mean_output_tokens + self._sum_out) / n,
        )
