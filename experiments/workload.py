"""The Table 1 workload: the Azure LLM inference trace (code), scaled honestly to this machine.

The paper replays the trace at its own rate (2.57 req/s, mean 2,048 input / 28 output tokens) on
9 GPUs. Here 9 servers share a few CPU cores and a 135M model, so the trace is scaled by stated
factors (all pure arithmetic below, unit-tested):

- lengths: input tokens x `length_scale` (at least 1), output tokens x `output_scale` (at least 1);
  a request longer than the servers' `max_length_tokens` keeps its input and has its output cut to
  fit (counted as `truncated`); an input that leaves no room at all (the trace holds prompts of up to
  7,436 tokens, over Llama-2's 4,096 context) keeps its last tokens, as a client cuts a prompt to its
  model's context, leaving its output room up to half the context (counted as `inputs_cut`);
- time: every arrival time x `time_scale` (> 1 stretches), which divides the rate by `time_scale`
  and leaves the shape of the inter-arrival distribution (its coefficient of variation, 13.15 for
  the whole trace) exactly as it is.

`auto_time_scale` picks `time_scale` so that the offered load relative to the capacity of what
bounds throughput here (the CPU cores every server shares) is `target_load`:
    lambda' = target_load * n_cpus / cpu_s_per_request,   time_scale = lambda_trace / lambda',
with `cpu_s_per_request` from footnote 11 of the paper (tau_p summed over the L blocks, with the
t_I, t_O measured on this machine) plus a per-step overhead for the messaging every step costs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from orchestrator.sim.traces import RequestTrace

PAPER_RATE_PER_S = 2.57  # the paper's §4.2.1 trace statistics
PAPER_MEAN_INPUT_TOKENS = 2048
PAPER_MEAN_OUTPUT_TOKENS = 28


@dataclass(frozen=True)
class Scale:
    time_scale: float  # scaled arrival = time_scale * trace arrival
    length_scale: float  # scaled input = max(1, round(length_scale * trace input))
    output_scale: float = 1.0  # scaled output = max(1, round(output_scale * trace output))
    max_length_tokens: int = 1024  # input + output of one request must fit the servers' --max-length

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and self.length_scale > 0 and self.output_scale > 0):
            raise ValueError(
                f"scale factors must be > 0, got time {self.time_scale}, length {self.length_scale}, "
                f"output {self.output_scale}"
            )
        if self.max_length_tokens < 2:
            raise ValueError(f"max_length_tokens must be >= 2, got {self.max_length_tokens}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ScaledRequest:
    index: int  # position in the trace (0-based)
    arrival_s: float  # scaled, from the first replayed request
    input_tokens: int
    output_tokens: int
    trace_input_tokens: int
    trace_output_tokens: int
    truncated: bool  # output cut to fit max_length_tokens
    input_cut: bool = False  # input cut to its last tokens: alone it left no room for output

    def to_dict(self) -> dict:
        return asdict(self)


def scale_lengths(input_tokens: int, output_tokens: int, scale: Scale) -> tuple[int, int, bool, bool]:
    """(scaled input, scaled output, output truncated, input cut) of one request."""
    l_in = max(1, round(input_tokens * scale.length_scale))
    l_out = max(1, round(output_tokens * scale.output_scale))
    input_cut = l_in >= scale.max_length_tokens
    if input_cut:  # keep the prompt's last tokens; the output keeps its length up to half the context
        l_in = scale.max_length_tokens - min(l_out, scale.max_length_tokens // 2)
    cut = l_in + l_out > scale.max_length_tokens
    return l_in, (scale.max_length_tokens - l_in if cut else l_out), cut, input_cut


def scale_requests(trace: RequestTrace, n_requests: int, scale: Scale, *, offset: int = 0) -> list[ScaledRequest]:
    """Requests `offset .. offset + n_requests - 1` of the trace, in arrival order, scaled."""
    if n_requests < 1 or offset < 0 or offset + n_requests > len(trace.arrival_s):
        raise ValueError(f"the trace has {len(trace.arrival_s)} requests; cannot take {n_requests} from {offset}")
    t0 = float(trace.arrival_s[offset])
    out = []
    for i in range(offset, offset + n_requests):
        l_in, l_out, cut, input_cut = scale_lengths(int(trace.context_tokens[i]), int(trace.generated_tokens[i]), scale)
        out.append(
            ScaledRequest(
                i,
                (float(trace.arrival_s[i]) - t0) * scale.time_scale,
                l_in,
                l_out,
                int(trace.context_tokens[i]),
                int(trace.generated_tokens[i]),
                cut,
                input_cut,
            )
        )
    return out


def rate_per_s(arrivals_s: np.ndarray | list[float]) -> float:
    """Mean arrival rate (n - 1) / span."""
    a = np.asarray(arrivals_s, dtype=float)
    span = float(a[-1] - a[0]) if len(a) > 1 else 0.0
    return (len(a) - 1) / span if span > 0 else float("nan")


def interarrival_cv(arrivals_s: np.ndarray | list[float]) -> float:
    """Coefficient of variation of the inter-arrival times (1 for Poisson; the burstiness kept by scaling)."""
    d = np.diff(np.asarray(arrivals_s, dtype=float))
    return float(d.std() / d.mean()) if len(d) and d.mean() > 0 else float("nan")


def cpu_s_per_request(
    prefill_s_per_token: float,
    decode_s_per_token: float,
    num_blocks: int,
    mean_input_tokens: float,
    mean_output_tokens: float,
    *,
    step_overhead_cpu_s: float = 0.0,
    hops: float = 1.0,
) -> float:
    """CPU seconds one request costs: footnote 11's tau_p over all L blocks,
    L (t_I l_in + t_O (l_out - 1)), plus `step_overhead_cpu_s` per step and hop (messaging, client head)."""
    compute = num_blocks * (prefill_s_per_token * mean_input_tokens + decode_s_per_token * (mean_output_tokens - 1))
    return compute + step_overhead_cpu_s * hops * mean_output_tokens


def auto_time_scale(trace_rate_per_s: float, cpu_s_per_req: float, n_cpus: float, target_load: float) -> float:
    """time_scale such that lambda_trace / time_scale * cpu_s_per_req / n_cpus = target_load."""
    if not (trace_rate_per_s > 0 and cpu_s_per_req > 0 and n_cpus > 0 and 0 < target_load):
        raise ValueError("auto_time_scale needs a positive rate, CPU cost, CPU count and target load")
    return trace_rate_per_s * cpu_s_per_req / (n_cpus * target_load)


def offered_load(rate_per_s: float, cpu_s_per_req: float, n_cpus: float) -> float:
    """Offered CPU load lambda * W / n_cpus (1 = every core busy all the time)."""
    return rate_per_s * cpu_s_per_req / n_cpus


PEAK_WINDOW_S = 120.0  # the window of the busiest-window load: a few service times of a scaled request here


def peak_offered_load(
    arrivals_s: np.ndarray | list[float], cpu_s_per_req: float, n_cpus: float, window_s: float = PEAK_WINDOW_S
) -> float:
    """Offered CPU load of the busiest window: max over windows [a, a + window_s) starting at an
    arrival of (arrivals in it) W / (window_s n_cpus). The trace's bursts (CV ~11-13) put this far
    above the mean load `offered_load`, which the auto time scale targets."""
    if not (window_s > 0 and n_cpus > 0):
        raise ValueError("peak_offered_load needs a positive window and CPU count")
    a = np.sort(np.asarray(arrivals_s, dtype=float))
    if not len(a):
        return 0.0
    counts = np.searchsorted(a, a + window_s, side="left") - np.arange(len(a))
    return float(counts.max() * cpu_s_per_req / (window_s * n_cpus))


def summary(requests: list[ScaledRequest]) -> dict:
    """Statistics of a scaled request list, for the results' `scale` section."""
    arr = [r.arrival_s for r in requests]
    return {
        "requests": len(requests),
        "span_s": arr[-1] - arr[0] if arr else 0.0,
        "rate_per_s": rate_per_s(arr),
        "interarrival_cv": interarrival_cv(arr),
        "mean_input_tokens": float(np.mean([r.input_tokens for r in requests])),
        "mean_output_tokens": float(np.mean([r.output_tokens for r in requests])),
        "trace_mean_input_tokens": float(np.mean([r.trace_input_tokens for r in requests])),
        "trace_mean_output_tokens": float(np.mean([r.trace_output_tokens for r in requests])),
        "truncated": sum(r.truncated for r in requests),
        "inputs_cut": sum(r.input_cut for r in requests),
        "max_total_tokens": max((r.input_tokens + r.output_tokens for r in requests), default=0),
    }
