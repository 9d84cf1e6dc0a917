"""Acquire latency while the orchestrator re-plans a large swarm, against the same acquires with no plan
running (issue 54: the planner used to run under the lock the RPC handlers take).

    python scripts/bench_replan.py [--servers 10000] [--blocks 80] [--acquires 3000] [--locked] [--json F]

An offline orchestrator (orchestrator/service/core.py, no DHT) is given J synthetic servers (two GPU
types as scripts/bench_plan.py, announced profiles, RTTs 5-30 ms), plans and installs; then the
acquire path the RPC handler runs (`Sessions.poll` on an asyncio loop, then `Orchestrator.release`)
is timed call by call: first with nothing else running (`--acquires` of them, and again for as long as
the re-plan below took: `idle_as_long`), then while a re-plan (the servers' decode
times moved by up to +-30 %, as a calibrated model does) runs on another thread, its planner in the
worker process (`--plan-process-min-servers`, orchestrator/service/planning.py). `--thread` adds the same
measurement with the planner in that thread (sharing the GIL with the acquires, as before the worker
process); `--locked` with the re-plan holding the service's lock too, as `_plan` did before that. Prints
one JSON object (also written to --json).

    python scripts/bench_replan.py [--servers 10000] [--thread] [--locked] [--plan-process-min-servers 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.service.core import Orchestrator, OrchestratorConfig  # noqa: E402
from orchestrator.service.registry import ServerRecord  # noqa: E402
from petals_chain.wire.records import ServerInfo  # noqa: E402

GB = 2**30


def swarm(orch: Orchestrator, num_servers: int, rng: np.random.Generator) -> None:
    for j in range(num_servers):
        fast = rng.random() < 0.3
        t_o = (0.03 if fast else 0.109) * float(rng.uniform(0.9, 1.1)) / 32  # per block and token
        info = ServerInfo(
            f"peer{j:07d}",
            "m",
            0,
            0,
            "joining",
            int((80 if fast else 40) * GB),
            int(1.32 * GB),
            int(0.11 * GB),
            2048,
            10,
            t_o / 4,
            t_o,
            name=f"s{j}",
            extra={"auto": True},
        )
        orch.records[info.peer_id] = ServerRecord(info, rtt_s=float(rng.uniform(0.005, 0.03)))


def online(orch: Orchestrator) -> None:
    for p, rec in orch.records.items():
        a = orch.current.assignment(p)
        rec.info = replace(rec.info, start=a[0] if a else 0, end=a[1] if a else 0, state="online")


def acquires(orch: Orchestrator, loop: asyncio.AbstractEventLoop, until, start_id: int) -> tuple[list[float], int]:
    """acquire (one poll) + release per iteration until `until()`; returns the acquire latencies and grants."""
    lat, granted, k = [], 0, start_id
    while not until():
        sid = f"b{k}"
        k += 1
        t0 = time.perf_counter()
        out = loop.run_until_complete(
            orch.sessions.poll(sid, "bench", 64, timeout_s=60.0, poll_s=0.0, exclude=frozenset(), clock=orch.clock)
        )
        lat.append(time.perf_counter() - t0)
        if hasattr(out, "hops"):
            granted += 1
        orch.release(sid, 64, 32)
    return lat, granted


def summary(lat: list[float]) -> dict:
    a = np.array(lat) * 1e3
    return {
        "n": len(lat),
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
        "max_ms": float(a.max()),
    }


def replan_phase(orch: Orchestrator, loop, rng, locked: bool, start_id: int) -> dict:
    orch.drain = None  # a drain the phase before started: this phase re-plans from the installed plan again
    for rec in orch.records.values():  # the calibrated model moved every server's decode time
        rec.info = replace(rec.info, decode_s_per_token=rec.info.decode_s_per_token * float(rng.uniform(0.7, 1.3)))
    orch.model_moved, orch.model_moved_s = True, orch.clock()
    done = threading.Event()
    took = {}

    def run() -> None:
        t0 = time.perf_counter()
        if locked:
            with orch.lock:
                orch._plan(orch.clock())
        else:
            orch._plan(orch.clock())
        took["plan_s"] = time.perf_counter() - t0
        done.set()

    th = threading.Thread(target=run)
    th.start()
    lat, granted = acquires(orch, loop, done.is_set, start_id)
    th.join()
    return {
        **summary(lat),
        "granted": granted,
        "plan_s": took["plan_s"],
        "planned_in": orch.planner.last_where,
        "decision": orch.last_decision,
        "timing": orch.last_plan_timing,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=10000)
    ap.add_argument("--blocks", type=int, default=80)
    ap.add_argument("--acquires", type=int, default=3000, help="acquire + release pairs with no plan running")
    ap.add_argument("--arrival-rate", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--thread", action="store_true", help="also measure with the planner in a thread of this process")
    ap.add_argument("--locked", action="store_true", help="also measure with the plan under the lock (the old way)")
    ap.add_argument("--plan-process-min-servers", type=int, default=1000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    logging.getLogger("orchestrator").setLevel(logging.WARNING)
    now = [0.0]
    cfg = OrchestratorConfig(
        model="m",
        initial_peers=[],
        num_blocks=a.blocks,
        calibrate=False,
        arrival_rate_per_s=a.arrival_rate,
        lease_ttl_s=600.0,
        plan_process_min_servers=a.plan_process_min_servers,
    )
    orch = Orchestrator.offline(cfg, lambda: now[0])
    swarm(orch, a.servers, rng)
    t0 = time.perf_counter()
    orch._plan(0.0)
    first_s = time.perf_counter() - t0
    online(orch)
    orch._maybe_install(0.0)
    loop = asyncio.new_event_loop()
    n = [0]

    def enough() -> bool:
        n[0] += 1
        return n[0] > a.acquires

    idle_lat, idle_granted = acquires(orch, loop, enough, 0)
    out = {
        "servers": a.servers,
        "blocks": a.blocks,
        "first_plan_s": first_s,
        "chains": len(orch.sessions.chain_views()),
        "idle": {**summary(idle_lat), "granted": idle_granted},
        "first_plan_in": orch.planner.last_where,
        "during_replan": replan_phase(orch, loop, rng, False, 10**7),
    }
    # the same acquires with no plan running for as long as the re-plan ran: a short idle phase meets none of
    # the host's scheduling stalls a seconds-long one does, and the ratio would credit them to the plan
    until = time.perf_counter() + out["during_replan"]["plan_s"]
    lat, granted = acquires(orch, loop, lambda: time.perf_counter() >= until, 4 * 10**7)
    out["idle_as_long"] = {**summary(lat), "granted": granted, "seconds": out["during_replan"]["plan_s"]}
    out["p99_ratio_during_vs_idle"] = out["during_replan"]["p99_ms"] / out["idle"]["p99_ms"]
    out["p99_ratio_during_vs_idle_as_long"] = out["during_replan"]["p99_ms"] / out["idle_as_long"]["p99_ms"]
    if a.thread:
        min_servers, orch.planner.min_servers = orch.planner.min_servers, 0
        out["during_replan_thread"] = replan_phase(orch, loop, rng, False, 3 * 10**7)
        orch.planner.min_servers = min_servers
        out["p99_ratio_thread_vs_idle"] = out["during_replan_thread"]["p99_ms"] / out["idle"]["p99_ms"]
    if a.locked:
        out["during_replan_locked"] = replan_phase(orch, loop, rng, True, 2 * 10**7)
    orch.planner.close()
    out["host"] = platform.node()
    out["date"] = time.strftime("%Y-%m-%d %H:%M")
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)


if __name__ == "__main__":
    main()
