"""The servers' service logs as the fairness benchmarks read them (`scripts/bench_fairness.py` and its
shared-prefix phase, `scripts/fairness_prefix.py`): weighted service per client, and the largest gap
between two backlogged clients' service."""

from __future__ import annotations

import json
import os
from pathlib import Path


def pin_process_tree(pid: int, core: int) -> int:
    """Pin a started process, every thread of it and its children (a server's DHT child, its p2pd) to
    one CPU core; returns the threads pinned. Done once the server is up rather than at its start: a
    server started on one core of a loaded machine took over 180 s to come up."""
    pinned = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), {core})
            pinned += 1
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for child in children:
            pinned += pin_process_tree(int(child), core)
    return pinned


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def weighted(item: list, w_in: float, w_out: float) -> float:
    _, n, is_prefill = item
    return (w_in if is_prefill else w_out) * n


def service_by_client(batches: list[dict], t0: float, t1: float, w_in: float, w_out: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in batches:
        if t0 <= b["t_s"] < t1:
            for item in b["items"]:
                out[item[0]] = out.get(item[0], 0.0) + weighted(item, w_in, w_out)
    return out


def max_backlogged_gap(batches: list[dict], a: str, b: str, w_in: float, w_out: float) -> tuple[float, int]:
    """max over intervals in which both clients had waiting steps of |W_a - W_b| (weighted tokens),
    and the number of batches in such intervals. Within a run of batches where both are backlogged,
    the largest interval difference is (max - min) of the running difference, starting at 0."""
    best, counted = 0.0, 0
    diff = lo = hi = 0.0
    in_run = False
    for batch in batches:
        both = a in batch["backlogged"] and b in batch["backlogged"]
        if not both:
            in_run = False
            continue
        if not in_run:
            diff = lo = hi = 0.0
            in_run = True
        for item in batch["items"]:
            w = weighted(item, w_in, w_out)
            diff += w if item[0] == a else -w if item[0] == b else 0.0
        lo, hi = min(lo, diff), max(hi, diff)
        best = max(best, hi - lo)
        counted += 1
    return best, counted
