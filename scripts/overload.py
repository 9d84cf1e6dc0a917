"""Overload: a swarm with an orchestrator receives `--factor` times more concurrent sessions than its capacity.

    .venv/bin/python scripts/overload.py --minutes 5                  # SmolLM2, the long run
    .venv/bin/python scripts/overload.py --minutes 1 --model PATH     # a short one (the test uses a tiny Llama)

Servers start with `--blocks auto` and a small `--memory-budget`, so the orchestrator's chains hold
only a few sessions. Once the plan is installed, capacity C = the sum of the chains' capacities in
its /status, and ceil(factor * C) client threads (sharing one model object, like the API gateway)
generate greedy text back to back for `--minutes`. Sessions open with `max_length` = the servers'
`--max-length`, so a session reserves exactly the slot the orchestrator counts and the servers'
budgets are really full at capacity.

A monitor polls, every `--poll-s`: the orchestrator's /status (no chain has more sessions in use
than its capacity), each server's rpc_info accounting (weights + reserved KV <= budget; KV
allocated by open sessions <= reserved; at the end the server's own high-water mark of the
reservations) and each server's RSS (psutil, the server process and its children: DHT, p2pd).

Counts: started, completed (identical to HF), failed (a typed error reached the caller: e.g.
`AcquireTimeoutError` after `--acquire-timeout` in the queue), lost (hung past `--hang-s`, wrong
output, or an untyped error). Ends with one JSON line; exit 1 if anything was lost or the accounting
ever exceeded a budget.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402
from soak import Tally, references, tokenize  # noqa: E402

from petals_chain.client.model import DistributedModelForCausalLM  # noqa: E402
from petals_chain.errors import PetalsChainError  # noqa: E402
from petals_chain.swarm.local import LocalSwarm  # noqa: E402

MIB = 2**20


def get_status(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=10) as r:
        return json.load(r)


def wait_for_plan(swarm: LocalSwarm, timeout_s: float) -> dict:
    """The orchestrator's /status once its plan is installed and its chains can take sessions."""
    deadline = time.monotonic() + timeout_s
    status: dict = {}
    while time.monotonic() < deadline:
        try:
            status = get_status(swarm.orchestrator_url)
        except OSError:
            status = {}
        if status.get("plan_installed") and any(c["dispatchable"] for c in status.get("chains", [])):
            return status
        time.sleep(0.5)
    raise RuntimeError(f"the orchestrator installed no plan within {timeout_s:.0f} s: {json.dumps(status)[-2000:]}")


def rss_bytes(pid: int) -> tuple[int, int]:
    """RSS of the process, and of it with all its children (the server's DHT process and p2p daemons)."""
    try:
        proc = psutil.Process(pid)
        own = proc.memory_info().rss
        total = own
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                pass
        return own, total
    except psutil.Error:
        return 0, 0


class Monitor:
    """Polls the orchestrator's /status, the servers' accounting (rpc_info) and their RSS."""

    def __init__(self, swarm: LocalSwarm, backend, poll_s: float):
        self.swarm, self.backend, self.poll_s = swarm, backend, poll_s
        self.violations: list[str] = []
        self.servers: dict[str, dict] = {}
        self.max_queue_length = 0
        self.max_in_use = 0
        self.polls = 0
        self.status_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="overload-monitor", daemon=True)

    def start(self) -> "Monitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.poll_once()  # the final high-water marks

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll_once()

    def poll_once(self) -> None:
        self.polls += 1
        try:
            status = get_status(self.swarm.orchestrator_url)
        except OSError:
            self.status_errors += 1
            status = None
        if status is not None:
            self.max_queue_length = max(self.max_queue_length, status["queue_length"])
            self.max_in_use = max(self.max_in_use, sum(c["in_use"] for c in status["chains"]))
            for c in status["chains"]:
                if c["in_use"] > c["capacity"]:
                    self.violations.append(f"chain {c['chain_id']}: {c['in_use']} sessions > capacity {c['capacity']}")
        for sp in list(self.swarm.servers):
            if not sp.alive or not sp.peer_id:
                continue
            row = self.servers.setdefault(
                sp.name,
                {
                    "name": sp.name,
                    "peer_id": sp.peer_id,
                    "rss_bytes_max": 0,
                    "rss_with_children_bytes_max": 0,
                    "kv_reserved_bytes_max": 0,
                    "kv_allocated_bytes_max": 0,
                    "active_sessions_max": 0,
                },
            )
            own, total = rss_bytes(sp.process.pid)
            row["rss_bytes_max"] = max(row["rss_bytes_max"], own)
            row["rss_with_children_bytes_max"] = max(row["rss_with_children_bytes_max"], total)
            try:
                info = self.backend.server_info(sp.peer_id)
            except Exception as e:  # a busy server may answer late: the next poll tries again
                row["info_errors"] = row.get("info_errors", 0) + 1
                row["last_info_error"] = f"{type(e).__name__}: {e}"[:200]
                continue
            x = info.extra
            if "kv_reserved_bytes" not in x:  # a server without blocks (standing by) reports no accounting
                continue
            budget, weights = info.memory_budget_bytes, x["weights_bytes"]
            row.update(
                memory_budget_bytes=budget,
                weights_bytes=weights,
                blocks=[info.start, info.end],
                kv_peak_reserved_bytes=x["kv_peak_reserved_bytes"],
                kv_bytes_per_session=info.kv_bytes_per_block * (info.end - info.start),
            )
            row["kv_reserved_bytes_max"] = max(row["kv_reserved_bytes_max"], x["kv_reserved_bytes"])
            row["kv_allocated_bytes_max"] = max(row["kv_allocated_bytes_max"], x["kv_allocated_bytes"])
            row["active_sessions_max"] = max(row["active_sessions_max"], info.active_sessions)
            for what, used in (("reserved", x["kv_reserved_bytes"]), ("peak reserved", x["kv_peak_reserved_bytes"])):
                if weights + used > budget:
                    self.violations.append(f"{sp.name}: weights {weights} + {what} KV {used} > budget {budget} bytes")
            if x["kv_allocated_bytes"] > x["kv_reserved_bytes"]:
                self.violations.append(
                    f"{sp.name}: KV allocated {x['kv_allocated_bytes']} > reserved {x['kv_reserved_bytes']} bytes"
                )


def client_loop(
    model: DistributedModelForCausalLM,
    prompts,
    refs,
    args,
    stop: threading.Event,
    tally: Tally,
    waits_s: list[float],
    seed: int,
) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        i = rng.randrange(len(prompts))
        result: dict = {}

        def run():
            try:
                # max_length = the servers' limit: the session reserves a whole slot (see the module doc)
                result["out"] = model.generate(
                    torch.tensor([prompts[i]]), max_length=args.max_length, max_new_tokens=args.tokens, do_sample=False
                )[0].tolist()
            except PetalsChainError as e:
                result["typed"] = type(e).__name__
                result["message"] = str(e)
            except Exception as e:  # an untyped error is a bug: counted as lost (with where it came from)
                import traceback

                where = " <- ".join(
                    f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_tb(e.__traceback__)[-4:]
                )
                result["untyped"] = f"{type(e).__name__}: {e} at {where}"

        tally.add("started")
        t0 = time.monotonic()
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(args.hang_s)
        if worker.is_alive():
            tally.add("lost", "hung")
            return  # this thread's stuck session stays open; the others go on (the summary says it hung)
        if "out" in result:
            ok = result["out"] == refs[i]
            tally.add("completed" if ok else "lost", None if ok else "wrong")
            with tally.lock:
                waits_s.append(time.monotonic() - t0)
        elif "typed" in result:
            tally.add("failed", result["typed"], result["message"])
        else:
            tally.add("lost", result["untyped"])


def run(args) -> dict:
    prompts = tokenize(args.model, 100)
    refs = references(args.model, prompts, args.tokens)
    if max(len(p) for p in prompts) + args.tokens > args.max_length:
        raise SystemExit(f"--max-length {args.max_length} is too small for the prompts plus {args.tokens} tokens")
    tally, waits_s = Tally(), []
    stop = threading.Event()
    server_args = [
        "--num-threads",
        "1",
        "--max-length",
        str(args.max_length),
        "--memory-budget",
        args.budget,
        "--admission-timeout",
        str(args.admission_timeout),
    ]
    orchestrator_args = [
        "--expected-servers",
        str(args.servers),
        "--lease-ttl",
        "10",
        "--replan-period",
        "600",
        "--mean-output-tokens",
        str(args.tokens),
    ]
    with LocalSwarm(
        args.model, [None] * args.servers, server_args=server_args, orchestrator_args=orchestrator_args
    ) as swarm:
        status = wait_for_plan(swarm, 180)
        capacity = sum(c["capacity"] for c in status["chains"] if c["dispatchable"])
        n_clients = max(1, math.ceil(args.factor * capacity))
        model = DistributedModelForCausalLM.from_pretrained(
            args.model, initial_peers=swarm.initial_peers, acquire_timeout_s=args.acquire_timeout
        )
        monitor = Monitor(swarm, model.backend, args.poll_s).start()
        t_start = time.monotonic()
        try:
            clients = [
                threading.Thread(
                    target=client_loop,
                    args=(model, prompts, refs, args, stop, tally, waits_s, args.seed + c),
                    daemon=True,
                )
                for c in range(n_clients)
            ]
            for t in clients:
                t.start()
            stop.wait(args.minutes * 60)
            stop.set()
            deadline = time.monotonic() + args.hang_s + 30
            for t in clients:  # each finishes (or gives up on) its current request within hang_s
                t.join(max(0.0, deadline - time.monotonic()))
            unfinished = sum(t.is_alive() for t in clients)
            elapsed_s = time.monotonic() - t_start
        finally:
            monitor.stop()
            model.backend.shutdown()
        final = get_status(swarm.orchestrator_url)
    c = tally.counts
    waits_s.sort()
    mean_session_s = sum(waits_s) / len(waits_s) if waits_s else None
    return {
        "started": c["started"],
        "completed": c["completed"],
        "failed": c["failed"],
        "lost": c["lost"],
        "unfinished_clients": unfinished,
        "errors": dict(tally.errors),
        "error_examples": tally.examples,
        "capacity": capacity,
        "clients": n_clients,
        "factor": args.factor,
        "chains": len(status["chains"]),
        # sessions that completed per capacity slot: how many times the capacity turned over
        "turnovers": round(c["completed"] / max(1, capacity), 1),
        "session_s_p50": waits_s[len(waits_s) // 2] if waits_s else None,
        "session_s_mean": mean_session_s,
        "session_s_max": waits_s[-1] if waits_s else None,
        "max_queue_length": monitor.max_queue_length,
        "max_in_use": monitor.max_in_use,
        "acquire_timeouts": final["metrics"]["timed_out"],
        "admitted": final["metrics"]["admitted"],
        "budget_violations": monitor.violations[:20],
        "n_budget_violations": len(monitor.violations),
        "polls": monitor.polls,
        "status_errors": monitor.status_errors,
        "servers": [
            {
                **row,
                "rss_mib_max": round(row["rss_bytes_max"] / MIB, 1),
                "rss_with_children_mib_max": round(row["rss_with_children_bytes_max"] / MIB, 1),
            }
            for row in monitor.servers.values()
        ],
        "minutes": args.minutes,
        "elapsed_s": round(elapsed_s, 1),
        "model": str(args.model),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", type=int, default=3, help="servers with --blocks auto")
    p.add_argument("--budget", default="700MiB", help="--memory-budget of every server (small: few slots)")
    p.add_argument("--max-length", type=int, default=256, help="the servers' --max-length; every session reserves it")
    p.add_argument("--factor", type=float, default=2.0, help="concurrent sessions / the swarm's capacity")
    p.add_argument("--tokens", type=int, default=8, help="greedy tokens per request")
    p.add_argument(
        "--acquire-timeout",
        type=float,
        default=120.0,
        help="seconds a session may wait in the orchestrator's queue before AcquireTimeoutError",
    )
    p.add_argument("--admission-timeout", type=float, default=10.0, help="the servers' --admission-timeout")
    p.add_argument("--hang-s", type=float, default=300.0, help="a request not done by then counts as lost")
    p.add_argument("--poll-s", type=float, default=0.5, help="seconds between accounting polls")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.servers < 1 or args.factor <= 0:
        p.error("--minutes > 0, --servers >= 1 and --factor > 0 are needed")
    summary = run(args)
    print(json.dumps(summary), flush=True)
    return 1 if summary["lost"] or summary["n_budget_violations"] or summary["unfinished_clients"] else 0


if __name__ == "__main__":
    sys.exit(main())
