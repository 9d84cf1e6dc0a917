"""Per-session service quantities of the paper's model (§2.1.1, footnote 11). Pure functions.

One implementation, imported by the online orchestrator (orchestrator/service/registry.py) and the
simulator's paper setup (orchestrator/sim/paper_setup.py), so both read tau_c the same way:

tau_p_j = t_o + t_I,j * l_in + t_O,j * (l_out - 1): one block, one whole session (prefill of l_in
tokens, then l_out - 1 decode steps; the prefill produces the first output token).
tau_c_j = steps * (RTT_j + per-step overhead) + first-step extra, steps = l_out (one prefill step +
l_out - 1 decode steps): the paper defines tau_c_j as the mean *total* communication time with
server j over all tokens of a request (§3.1, the sentence after eq. 2), and the client relays
every step through the chain (footnote 4). With server relay (servers push to the next hop, as in
PETALS 2.2's rpc_push) footnote 4's variant applies: tau_c_ij from the preceding hop i, one one-way
leg (RTT_ij / 2) per step, and tau_c_j := max_i tau_c_ij (`tau_c_relay_s`). The first-step extra is the larger prefill
message
(0 unless measured; the authors' code uses 50 ms, see orchestrator/sim/authors_setup.py).
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
            raise ValueError(
                f"mean input/output tokens must be >= 1, got {self.mean_input_tokens}, {self.mean_output_tokens}"
            )

    @property
    def steps(self) -> float:
        """Round trips of one session through a server: 1 prefill step + (l_out - 1) decode steps."""
        return self.mean_output_tokens


def tau_p_s(
    prefill_s_per_token: float, decode_s_per_token: float, shape: SessionShape, per_block_overhead_s: float = 0.0
) -> float:
    """Footnote 11: t_o + t_I l_in + t_O (l_out - 1), per block, per session."""
    return (
        per_block_overhead_s
        + prefill_s_per_token * shape.mean_input_tokens
        + decode_s_per_token * (shape.mean_output_tokens - 1)
    )


def tau_c_s(rtt_s, shape: SessionShape, per_step_overhead_s: float = 0.0, first_step_extra_s: float = 0.0):
    """Communication time of one session with a server: steps x (RTT + per-step overhead) plus the
    first (prefill) step's extra time. ``rtt_s`` may be a float or a numpy array (elementwise)."""
    return shape.steps * (rtt_s + per_step_overhead_s) + first_step_extra_s


def tau_c_relay_s(
    predecessor_rtts_s, shape: SessionShape, per_step_overhead_s: float = 0.0, first_step_extra_s: float = 0.0
) -> float:
    """Footnote 4 with server relay: tau_c_j = max_i tau_c_ij, where tau_c_ij = steps x (RTT_ij / 2 +
    per-step overhead) + the first step's extra is the time to receive each step from hop i (one
    one-way leg). `predecessor_rtts_s`: the RTTs from every node that may precede j (the other
    servers, and the client for a first hop)."""
    rtts = [float(r) for r in predecessor_rtts_s]
    if not rtts:
        raise ValueError("tau_c with server relay needs at least one predecessor RTT")
    return max(tau_c_s(r / 2, shape, per_step_overhead_s, first_step_extra_s) for r in rtts)
