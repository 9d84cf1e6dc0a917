"""The calibrated service model: what the live swarm measures, fitted per server. Pure (time passed in).
The fit of one window is `petals_chain/algorithms/service_fit.py` (the servers' start-up profile uses it too).

Servers report each batch they ran (`petals_chain.wire.records.BatchService`: wall and CPU seconds, sessions,
and block-tokens of prefill and of decode). The orchestrator fits per server, over a sliding window,

    wall_s = t_o + t_B * blocks + t_I * prefill_block_tokens + t_O * decode_block_tokens

(footnote 11's model with t_o per step and server, not per block: a step pays its framework cost
once, whatever its blocks; t_B per block a step runs, whatever its rows: on a device whose decode
is bound by reading the weights, a block costs about as much for 1 row as for 3, so the marginal
t_O per block-token is small and most of a lone session's step is t_B), robustly: least absolute deviations by
iteratively reweighted least
squares, so a batch slowed by a neighbour's burst or a GC pause does not move the fit. Clients report
on release each hop's network time per step (client time - server time); minus the RTT the
orchestrator measured, it is the per-hop framework cost (p2pd both ways, framing, thread hops) that
an rpc_info ping does not see. Both go into tau_c (`tau_c = l_out (RTT + hop cost + t_o)`). With
server relay only a chain's first hop is a round trip from the client (the others take their input
pushed by the hop before, and the client's copy mostly arrives after the step ran), so clients report
only round trips, and a server with none takes the swarm's median hop cost
(`own_else_swarm_median`): the same framework runs on every server. The cost is timed on decode-sized steps only; a
prompt's step is
reported apart, with its tokens, and its time beyond the RTT per token is the time to move a token's
hidden states there and back (the paper's Fig. 10: prefill communication grows with the input
length; on a GPU host with hidden size 4,096 it is seconds per hop for a long prompt, against
milliseconds of compute). It joins tau_c once per session (`first_step_extra_s`). A server with too
few batches for a fit is planned from its start-up profile and a fitted twin's fit
(`scaled_profile_fit`).

`ReplanTrigger` decides when the fitted model moved the plan enough to re-plan: the planned total
rate or c* differs from the installed plan's by more than `enter` (relative) continuously for
`hold_s`, at most once per `min_interval_s`; it re-arms only after the difference fell below `exit`
or a re-plan took the new model in (hysteresis).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from petals_chain.algorithms.service_fit import ServiceFit, fit_service


class ServiceWindow:
    """One server's recent batches and hop costs (sliding windows) and its fit."""

    def __init__(self, max_batches: int = 256, max_hops: int = 256, min_batches: int = 20):
        self.batches: deque[tuple[float, float, float, int, int]] = deque(
            maxlen=max_batches
        )  # (P, D, wall_s, sessions, blocks)
        self.cpu: deque[tuple[float, float]] = deque(maxlen=max_batches)  # (wall_s, cpu_s)
        self.hop_cost_s: deque[float] = deque(maxlen=max_hops)
        self.transfer_s_per_token: deque[float] = deque(maxlen=max_hops)
        self.min_batches = min_batches
        self.last_seq = -1

    def add_batch(
        self,
        seq: int,
        prefill_block_tokens: float,
        decode_block_tokens: float,
        wall_s: float,
        cpu_s: float,
        sessions: int = 0,
        blocks: int = 0,
    ) -> None:
        if seq <= self.last_seq:
            return  # seen already (the server's records are read by cursor; a restart resets it)
        self.last_seq = seq
        self.batches.append(
            (float(prefill_block_tokens), float(decode_block_tokens), float(wall_s), int(sessions), int(blocks))
        )
        self.cpu.append((float(wall_s), float(cpu_s)))

    def add_hop(self, comm_per_step_s: float, rtt_s: float) -> None:
        """A finished session's network time per step with this server; the part beyond the RTT."""
        if math.isfinite(comm_per_step_s) and comm_per_step_s >= 0:
            self.hop_cost_s.append(max(0.0, comm_per_step_s - rtt_s))

    def fit(self, t_O_profile_s: float | None = None) -> ServiceFit | None:
        if len(self.batches) < self.min_batches:
            return None
        p, d, y, k, b = zip(*self.batches)
        # records without sessions or blocks (0: not reported) are fitted without them
        return fit_service(
            p, d, y, t_O_profile_s=t_O_profile_s, sessions=k if min(k) > 0 else None, blocks=b if min(b) > 0 else None
        )

    def add_prompt(self, steps: int, tokens: int, comm_s: float, rtt_s: float) -> None:
        """A finished session's prompt steps with this server (round trips from the client): the part
        of their network time beyond one RTT each, per token, when the prompt was long enough
        (PROMPT_MIN_TOKENS) for moving its hidden states to outweigh the per-step cost."""
        if tokens >= PROMPT_MIN_TOKENS and steps > 0 and math.isfinite(comm_s) and comm_s >= 0:
            self.transfer_s_per_token.append(max(0.0, comm_s - steps * rtt_s) / tokens)

    @property
    def transfer(self) -> float | None:
        """Median round-trip transfer time per prompt token (None: no long prompt reported yet)."""
        return float(np.median(self.transfer_s_per_token)) if self.transfer_s_per_token else None

    @property
    def hop_cost(self) -> float | None:
        """Median per-hop framework cost per step (None: no session reported yet)."""
        return float(np.median(self.hop_cost_s)) if self.hop_cost_s else None

    @property
    def cpu_per_wall(self) -> float | None:
        """CPU seconds per wall second of the window's batches (how much of a core a batch took)."""
        wall = sum(w for w, _ in self.cpu)
        return sum(c for _, c in self.cpu) / wall if wall > 0 else None


PROMPT_MIN_TOKENS = 64  # shorter prompts time the per-step cost more than the transfer


def own_else_swarm_median(measured: dict[str, float | None]) -> dict[str, float | None]:
    """Each server's per-hop cost (or per-token transfer): its own measured one, else the median of the
    servers that have one (None while none has). With server relay, servers that are never a chain's
    first hop are never timed by a round trip (see the module docstring); leaving them at 0 made tau_c
    too low."""
    known = [c for c in measured.values() if c is not None]
    swarm = float(np.median(known)) if known else None
    return {p: (swarm if c is None else c) for p, c in measured.items()}


@dataclass(frozen=True)
class FittedProfile:
    """A fitted server as a donor for `scaled_profile_fit`: its live fit, start-up profile and blocks."""

    fit: ServiceFit
    profile_t_I_s: float
    profile_t_O_s: float
    blocks: int

    @property
    def lone_step_per_profile(self) -> float:
        """Its fitted step alone (t_o + m (t_B + t_O)) over what the profile says that step costs (m t_O)."""
        return self.fit.step_s(self.blocks) / (self.blocks * self.profile_t_O_s)


TWIN_PROFILE_TOLERANCE = 0.1  # profiles' t_O within 10 %: the same kind of device


def _positive(x) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def scaled_profile_fit(profile_t_I_s: float, profile_t_O_s: float, fitted: list[FittedProfile]) -> ServiceFit | None:
    """The model of a server with no fit of its own yet (fewer than `min_batches` batches at a
    re-plan): a fitted donor's fit, scaled by the two servers' start-up profiles. None without a
    usable donor, or without a profile of its own.

    A profile's t_O is its lone decode step through its range, per block (server/range_profile.py:
    `RangeProfile.lone_decode_s_per_block`), so it ranks hosts by what a session alone costs there.
    The start-up profile is a cached microbenchmark without the per-step framework cost: on the live
    swarm a step runs several times what the profile says. A server planned from its bare profile
    looks that much faster than its fitted twins, and JFFC sends the bursts to it first (a Table 1
    run, docs/results.md: fast2 modelled 4.4 s, measured 23.5 s, its twins fitted at 18.5-19.5 s). The profile
    still ranks devices (it runs under the host's CPU share), so the donor is a fitted twin (profile
    t_O within TWIN_PROFILE_TOLERANCE, and t_I too where both profiles have one; any fitted server
    when there is none), the one with the median
    ratio of fitted lone step to profile step among them; its t_O, t_B, t_o and t_I are scaled by the
    ratio of the profiles (t_I by the t_I profiles'). One donor, not a median per term: fits split a
    step between t_o and t_O differently (the window cannot always tell them apart), and mixing one
    server's t_O with another's t_o gave a fast server a step 2.5x its twin's."""
    if not _positive(profile_t_O_s):
        return None
    usable = [d for d in fitted if _positive(d.profile_t_O_s) and d.blocks > 0]
    if not usable:
        return None
    # t_I as well as t_O: a short decode profile can read the same on two devices (a quick Table 1 run
    # in docs/results.md: 1.83 ms on fast and slow hosts, their shares 0.193 and 0.120 cores) while the
    # prefill's, timed over many tokens, tells them apart (0.40 against 0.63 ms); slow servers without
    # a fit then took a fast server's and were modelled 1.9x too fast
    twins = [
        d
        for d in usable
        if abs(d.profile_t_O_s / profile_t_O_s - 1.0) <= TWIN_PROFILE_TOLERANCE
        and (
            not (_positive(profile_t_I_s) and _positive(d.profile_t_I_s))
            or abs(d.profile_t_I_s / profile_t_I_s - 1.0) <= TWIN_PROFILE_TOLERANCE
        )
    ] or usable
    twins.sort(key=lambda d: d.lone_step_per_profile)
    donor = twins[(len(twins) - 1) // 2]  # the median (the lower one of an even count)
    ratio_O = profile_t_O_s / donor.profile_t_O_s
    f = donor.fit
    if f.t_I_s is None:
        t_I = None
    elif _positive(profile_t_I_s) and _positive(donor.profile_t_I_s):
        t_I = f.t_I_s * profile_t_I_s / donor.profile_t_I_s
    else:
        t_I = f.t_I_s * ratio_O
    return ServiceFit(
        t_I_s=t_I,
        t_O_s=f.t_O_s * ratio_O,
        t_o_s=f.t_o_s * ratio_O,
        samples=0,
        median_abs_rel_residual=math.nan,
        t_O_from_profile=f.t_O_from_profile,
        t_B_s=f.t_B_s * ratio_O,
        blocks_separable=f.blocks_separable,
    )


def relative_change(new: float, old: float) -> float:
    if old == new:
        return 0.0
    if not (math.isfinite(new) and math.isfinite(old)) or old == 0:
        return math.inf
    return abs(new / old - 1.0)


class ReplanTrigger:
    """Hysteresis over the planned (rate, c*) from the calibrated model vs the installed plan's."""

    def __init__(self, enter: float = 0.2, exit: float = 0.1, hold_s: float = 30.0, min_interval_s: float = 120.0):
        if not 0 <= exit < enter:
            raise ValueError(f"hysteresis needs 0 <= exit < enter, got exit={exit}, enter={enter}")
        self.enter, self.exit, self.hold_s, self.min_interval_s = enter, exit, hold_s, min_interval_s
        self.reference: tuple[float, int | None] | None = None  # (rate, c) of the installed plan
        self.planned_s = -math.inf
        self.since_s: float | None = None  # when the difference first exceeded `enter`

    def planned(self, rate_per_s: float, c: int | None, now_s: float) -> None:
        """A plan was made with the current model: it is the new reference."""
        self.reference = (rate_per_s, c)
        self.planned_s = now_s
        self.since_s = None

    def difference(self, rate_per_s: float, c: int | None) -> float:
        if self.reference is None:
            return 0.0
        ref_rate, ref_c = self.reference
        dc = 0.0 if c == ref_c else (math.inf if c is None or ref_c is None else relative_change(c, ref_c))
        return max(relative_change(rate_per_s, ref_rate), dc)

    def observe(self, rate_per_s: float, c: int | None, now_s: float) -> bool:
        """The calibrated model's plan now would have (rate, c): True when a re-plan is due."""
        diff = self.difference(rate_per_s, c)
        if diff <= self.exit:
            self.since_s = None
            return False
        if diff <= self.enter:
            return False  # between the thresholds: keep the state (armed stays armed, idle stays idle)
        if self.since_s is None:
            self.since_s = now_s
        return now_s - self.since_s >= self.hold_s and now_s - self.planned_s >= self.min_interval_s
