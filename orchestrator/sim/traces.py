"""Workload traces: the Azure LLM inference trace (code), read through netem's data-path scheme.

`AzureLLMInferenceTrace_code.csv` (Azure Public Dataset, CC BY 4.0): TIMESTAMP, ContextTokens,
GeneratedTokens. `trace_workload` turns it into what the engine takes: arrival times (seconds from
the first request, optionally rescaled to a target mean rate) and job sizes of mean 1 proportional
to the per-block compute time of footnote 11 of the paper,
    tau_p(l_in, l_out) = t_o + t_I * l_in + t_O * (l_out - 1),
with the high-performance GPU's t_o = 1 ms, t_I = 5 GFLOP / 120 TFLOPS, t_O = 1.32 GB / 1.02 GB/ms
(these give the paper's 109 ms at l_in = 2000, l_out = 20).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from netem.topology import AZURE_CODE_TRACE_FILENAME, resolve_data_file

T_OVERHEAD_MS = 1.0
T_PREFILL_MS_PER_TOKEN = 5.0 / 120.0
T_DECODE_MS_PER_TOKEN = 1.32 / 1.02


@dataclass(frozen=True)
class RequestTrace:
    arrival_s: np.ndarray  # seconds since the first request, sorted
    context_tokens: np.ndarray
    generated_tokens: np.ndarray

    @property
    def mean_rate_per_s(self) -> float:
        span = float(self.arrival_s[-1] - self.arrival_s[0])
        return (len(self.arrival_s) - 1) / span if span > 0 else float("nan")


def _parse_ts(text: str) -> float:
    text = text.strip()
    if "." in text:  # the trace has 7 fractional digits; datetime takes at most 6
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(text).timestamp()


def load_azure_trace(path: str | os.PathLike | None = None) -> RequestTrace:
    """Load the Azure code trace from `path` (file or data folder; default: the data-path scheme)."""
    file = resolve_data_file(AZURE_CODE_TRACE_FILENAME, path)
    ts, ctx, gen = [], [], []
    with open(file, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{file}: not an Azure LLM inference trace, missing columns {sorted(missing)}")
        for row in reader:
            ts.append(_parse_ts(row["TIMESTAMP"]))
            ctx.append(int(row["ContextTokens"]))
            gen.append(int(row["GeneratedTokens"]))
    t = np.array(ts)
    order = np.argsort(t, kind="stable")
    t = t[order]
    return RequestTrace(arrival_s=t - t[0], context_tokens=np.array(ctx)[order], generated_tokens=np.array(gen)[order])


def trace_workload(trace: RequestTrace, *, target_rate_per_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(arrival times s, job sizes of mean 1) for the engine; arrivals rescaled in time to
    `target_rate_per_s` when given (burstiness kept)."""
    arrivals = trace.arrival_s.astype(float)
    if target_rate_per_s is not None:
        arrivals = arrivals * (trace.mean_rate_per_s / target_rate_per_s)
    work_ms = (
        T_OVERHEAD_MS
        + T_PREFILL_MS_PER_TOKEN * trace.context_tokens
        + T_DECODE_MS_PER_TOKEN * np.maximum(trace.generated_tokens - 1, 0)
    )
    return arrivals, work_ms / work_ms.mean()
