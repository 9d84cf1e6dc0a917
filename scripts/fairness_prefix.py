"""The shared-prefix phase of scripts/bench_fairness.py: DLPM vs VTC with the servers' prefix KV cache.

Workload (the DLPM paper's shape, per client): `--prefix-clients` clients (one libp2p peer each),
each with its own long system prompt / few-shot block of `--prefix-tokens` tokens, run
`--prefix-sessions-per-client` sessions in a loop: prompt = that block + a fresh random suffix of
`--prefix-suffix` tokens, then `--prefix-decode` greedy decode steps, close, again. The server (all
blocks, `--prefix-sharing client`) has memory for `--prefix-slots` sessions at once plus
`--prefix-cache-room` system prompts of prefix cache (`--prefix-cache-min`), so sessions wait in
its admission queue and the policy decides who opens next, and the cache cannot hold every
client's prefix: the order of admissions decides the hit rate (the paper's locality).

Measured over a window after a warm-up: completed sessions per second (throughput), the cache's hit
rate (tokens taken from the cache / tokens of full chunks asked about, from the server's status),
per-client completions, and from the server's batch log the largest service gap between two
clients both backlogged against DLPM's 2(U + Q); backlogged here means with steps waiting after a
batch was chosen or a session waiting for KV memory (both are the paper's waiting queue).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from contextlib import ExitStack
from itertools import combinations
from pathlib import Path

import torch

from petals_chain.client.chain import PromptPrefix
from petals_chain.client.remote import RemoteChain
from petals_chain.runtime.block_range import BlockRange
from petals_chain.runtime.client_head import ClientHead
from petals_chain.swarm.local import LocalSwarm
from scripts.fairness_log import max_backlogged_gap, pin_process_tree, read_log, service_by_client


def add_arguments(p) -> None:
    p.add_argument(
        "--prefix-policies", default="vtc,dlpm", help="policies of the shared-prefix phase (specs as --policies)"
    )
    p.add_argument("--prefix-clients", type=int, default=4)
    p.add_argument("--prefix-sessions-per-client", type=int, default=2)
    p.add_argument("--prefix-tokens", type=int, default=384, help="tokens of each client's shared system prompt")
    p.add_argument("--prefix-suffix", type=int, default=16, help="fresh tokens after it in every request")
    p.add_argument("--prefix-decode", type=int, default=8)
    p.add_argument("--prefix-slots", type=int, default=2, help="sessions the server's memory holds at once")
    p.add_argument(
        "--prefix-cache-room",
        type=float,
        default=2.5,
        help="prefix cache room (--prefix-cache-min) in system prompts (fewer than --prefix-clients)",
    )
    p.add_argument("--prefix-q", type=float, default=1024.0, help="DLPM's quantum Q (weighted tokens)")
    p.add_argument("--prefix-warmup-s", type=float, default=15.0)
    p.add_argument("--prefix-duration-s", type=float, default=90.0)
    p.add_argument(
        "--prefix-schedule",
        choices=("paired", "sequential"),
        default="paired",
        help="paired: every policy's swarm and clients at once, in the same window (the ratio does not "
        "move with the machine's load); sequential: one policy after the other",
    )
    p.add_argument(
        "--prefix-pin-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="paired: pin each policy's server to a core of its own once it is up, when there are enough",
    )


class PrefixClient:
    """One client peer: `sessions` threads looping over requests that share its system prompt."""

    def __init__(self, chain: RemoteChain, head: ClientHead, system: list[int], args, seed: int):
        self.chain, self.head, self.system, self.args = chain, head, system, args
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.done: list[tuple[float, int, int]] = []  # (finish time, reused prefix tokens, prompt tokens)
        self.failures: list[float] = []  # when a request failed (the loop retries it)
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(args.prefix_sessions_per_client)]

    def _prompt(self) -> list[int]:
        with self._lock:
            vocab = self.head.config.vocab_size
            return self.system + [self.rng.randrange(2, vocab) for _ in range(self.args.prefix_suffix)]

    def _run(self) -> None:
        one = self.head.embed_tokens(torch.tensor([17]))
        max_length = self.args.prefix_tokens + self.args.prefix_suffix + self.args.prefix_decode + 1
        while not self.stop.is_set():
            ids = self._prompt()
            hidden = self.head.embed_tokens(torch.tensor(ids))
            try:
                session = self.chain.open_session(max_length, PromptPrefix(ids, hidden))
                try:
                    session.step(hidden[session.position :])  # only what the chain does not hold already
                    for _ in range(self.args.prefix_decode):
                        session.step(one)
                finally:
                    session.close()
                with self._lock:
                    self.done.append((time.monotonic(), session.prefix_tokens, len(ids)))
            except Exception:
                self.failures.append(time.monotonic())
                self.stop.wait(0.05)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(self.join_timeout_s)

    join_timeout_s = 300.0  # a session waiting for memory may wait this long (--admission-timeout)


def server_sizes(head: ClientHead, args) -> dict[str, int]:
    """Memory budget for `--prefix-slots` sessions + `--prefix-cache-room` system prompts of cache."""
    probe = BlockRange(head.model_path, 0, 1, model_path=head.model_path, config=head.config)
    blocks = head.config.num_hidden_layers
    max_length = args.prefix_tokens + args.prefix_suffix + args.prefix_decode + 1
    per_token = probe.kv_bytes_per_block(1) * blocks
    room = int(args.prefix_cache_room * per_token * args.prefix_tokens)
    weights = probe.block_bytes * blocks
    # a little slack under one more session, so exactly --prefix-slots fit
    budget = weights + args.prefix_slots * per_token * max_length + room + per_token * max_length // 2
    return {"budget": budget, "cache_room": room, "max_length": max_length, "per_token_bytes": per_token}


class PrefixRun:
    """One policy's side of the phase: a fresh one-server swarm, its clients, and what they measured.
    `__enter__` starts the swarm and the clients' loops; `mark()` reads the server's cache counters
    (the window's start and end); `result()` summarizes the window once the run is over."""

    def __init__(self, spec: str, args, head: ClientHead, out_dir: Path, core: int | None = None):
        self.spec, self.args, self.head = spec, args, head
        self.core = core  # the CPU core its server (and the server's DHT child and p2pd) is pinned to
        self.policy, *params = spec.split(":")
        self.log = out_dir / f"service_prefix_{spec.replace(':', '_').replace('=', '')}.jsonl"
        self.log.unlink(missing_ok=True)
        self.sizes = server_sizes(head, args)
        self.server_args = [
            "--num-threads",
            str(args.num_threads),
            "--max-batch-tokens",
            str(args.max_batch_tokens),
            "--max-length",
            str(self.sizes["max_length"]),
            "--memory-budget",
            str(self.sizes["budget"]),
            "--prefix-cache-min",
            str(self.sizes["cache_room"]),
            "--prefix-sharing",
            "client",
            "--admission-timeout",
            "300",
            "--admission-queue",
            "256",
            "--policy",
            self.policy,
            "--policy-arg",
            f"w_in={args.w_in}",
            "--policy-arg",
            f"w_out={args.w_out}",
            "--prefill-tokens-while-decoding",
            str(args.prefill_tokens_while_decoding),
            "--service-log",
            str(self.log),
            "--no-orchestrator",
        ]
        if self.policy == "dlpm":
            self.server_args += ["--policy-arg", f"q={args.prefix_q}"]
        for param in params:
            self.server_args += ["--policy-arg", param]
        self.swarm: LocalSwarm | None = None
        self.chains: list[RemoteChain] = []
        self.clients: list[PrefixClient] = []
        self.marks: list[tuple[float, dict]] = []

    def __enter__(self) -> "PrefixRun":
        args, head = self.args, self.head
        gen = random.Random(7)  # the same system prompts for every policy
        vocab = head.config.vocab_size
        systems = [[gen.randrange(2, vocab) for _ in range(args.prefix_tokens)] for _ in range(args.prefix_clients)]
        self.swarm = LocalSwarm(
            "smollm2-135m", [(0, head.config.num_hidden_layers)], server_args=self.server_args, start_timeout_s=600
        )
        self.swarm.__enter__()
        try:
            if self.core is not None:
                pin_process_tree(self.swarm.servers[0].process.pid, self.core)
            self.peer = self.swarm.servers[0].peer_id
            self.chains = [
                RemoteChain(
                    "smollm2-135m",
                    head.config,
                    self.swarm.initial_peers,
                    use_orchestrator=False,
                    step_timeout_s=300,
                    open_timeout_s=310,
                )
                for _ in range(args.prefix_clients)
            ]
            self.names = {str(c.p2p.peer_id): f"c{i}" for i, c in enumerate(self.chains)}
            self.clients = [PrefixClient(c, head, systems[i], args, seed=100 + i) for i, c in enumerate(self.chains)]
            for c in self.clients:
                c.__enter__()
        except BaseException:
            self.__exit__()
            raise
        return self

    def mark(self) -> None:
        self.marks.append((time.monotonic(), self.chains[0].server_info(self.peer).extra["prefix_cache"]))

    def __exit__(self, *exc) -> None:
        # the window is over (what it measured is kept): stop the loops without waiting for sessions
        # still queued for memory, whose RPCs fail once the chains shut down (the threads are daemons)
        for c in self.clients:
            c.stop.set()
        for c in self.chains:
            c.shutdown()
        for c in self.clients:
            c.join_timeout_s = 10.0
            c.__exit__()
        if self.swarm is not None:
            self.swarm.__exit__(*(exc or (None, None, None)))
            self.swarm = None

    def result(self) -> dict:
        args, names = self.args, self.names
        (t0, before), (t1, after) = self.marks[0], self.marks[-1]
        done = {f"c{i}": [d for d in c.done if t0 <= d[0] < t1] for i, c in enumerate(self.clients)}
        completed = sum(len(v) for v in done.values())
        asked = after["asked_tokens"] - before["asked_tokens"]
        hits = after["hit_tokens"] - before["hit_tokens"]
        batches = [
            {**b, "backlogged": sorted(set(b["backlogged"]) | set(b.get("waiting_for_memory", ())))}
            for b in read_log(self.log)
            if t0 <= b["t_s"] < t1
        ]
        u = max(args.w_in * args.max_batch_tokens, args.w_out)
        q = args.prefix_q if self.policy == "dlpm" else 0.0
        gaps = {
            f"{names.get(a, a[:8])}-{names.get(b, b[:8])}": max_backlogged_gap(batches, a, b, args.w_in, args.w_out)
            for a, b in combinations(sorted(names), 2)
        }
        worst = max(gaps.items(), key=lambda kv: kv[1][0]) if gaps else ("", (0.0, 0))
        served = service_by_client(batches, t0, t1, args.w_in, args.w_out)
        # load-independent work per finished session: tokens the server computed (cache hits are not sent)
        computed = sum(item[1] for b in batches for item in b["items"])
        prefill_computed = sum(item[1] for b in batches for item in b["items"] if item[2])
        busy_s = sum(b["service_s"] for b in batches)
        cpu_s = sum(b.get("cpu_s", 0.0) for b in batches)

        def per(x: float) -> float | None:
            return x / completed if completed else None

        return {
            "policy": self.spec,
            "window_s": t1 - t0,
            "completed": completed,
            "sessions_per_s": completed / (t1 - t0),
            "hit_rate": hits / asked if asked else 0.0,
            "hit_tokens": hits,
            "asked_tokens": asked,
            "reused_prefill_tokens": hits,
            "computed_prefill_tokens": prefill_computed,
            "computed_tokens_per_session": per(computed),
            "server_busy_s_per_session": per(busy_s),
            "server_cpu_s_per_session": per(cpu_s),
            "server_busy_fraction": busy_s / (t1 - t0),
            "server_cpu_fraction": cpu_s / (t1 - t0),
            "client_reused_tokens_mean": per(sum(d[1] for v in done.values() for d in v)) or 0.0,
            "completed_by_client": {k: len(v) for k, v in done.items()},
            "service_by_client": {names.get(c, c[:8]): w for c, w in served.items()},
            # within the window (the loops' sessions still running at the end fail when the chains shut down)
            "failures": sum(t0 <= t < t1 for c in self.clients for t in c.failures),
            "evicted_chunks": after["evicted_chunks"] - before["evicted_chunks"],
            # every finished session in the window, in order: (s after the window's start, client, reused tokens);
            # where the locality broke (a session that reused less than its system prompt) and whose turn it was
            "timeline": sorted((round(d[0] - t0, 2), name, d[1]) for name, v in done.items() for d in v),
            "misses": sum(1 for v in done.values() for d in v if d[1] < args.prefix_tokens // 16 * 16),
            "max_gap_weighted_tokens": worst[1][0],
            "max_gap_pair": worst[0],
            "batches_both_backlogged": worst[1][1],
            "batches": len(batches),
            "U": u,
            "Q": q,
            "bound_2_U_plus_Q": 2 * (u + q),
            "sizes": self.sizes,
        }


def _print_result(r: dict) -> None:
    nan = float("nan")
    print(
        f"   {r['policy']}: {r['completed']} sessions in {r['window_s']:.0f} s = {r['sessions_per_s']:.3f}/s; "
        f"cache hit rate {r['hit_rate']:.3f} ({r['hit_tokens']}/{r['asked_tokens']} tokens); server computed "
        f"{r['computed_tokens_per_session'] or nan:.0f} tokens and {r['server_cpu_s_per_session'] or nan:.2f} CPU s "
        f"per session (busy {r['server_busy_fraction']:.2f}, CPU {r['server_cpu_fraction']:.2f} of the window); "
        f"per client {json.dumps(r['completed_by_client'])}; {r['misses']} missed the cache; "
        f"max backlogged gap {r['max_gap_weighted_tokens']:.0f} "
        f"({r['max_gap_pair']}, {r['batches_both_backlogged']} of {r['batches']} batches) vs 2(U+Q) = "
        f"{r['bound_2_U_plus_Q']:.0f}; failures {r['failures']}",
        flush=True,
    )


def _describe(args, specs) -> None:
    print(
        f"\n== shared prefix, {' and '.join(specs)} ({args.prefix_schedule}): {args.prefix_clients} clients x "
        f"{args.prefix_sessions_per_client} sessions, {args.prefix_tokens}-token system prompts, memory for "
        f"{args.prefix_slots} sessions + {args.prefix_cache_room} prompts of cache",
        flush=True,
    )


def run_shared_prefix(spec: str, args, head: ClientHead, out_dir: Path) -> dict:
    """One policy alone (`--prefix-schedule sequential`): its warm-up, then its window."""
    _describe(args, [spec])
    with PrefixRun(spec, args, head, out_dir) as run:
        time.sleep(args.prefix_warmup_s)  # explicit warm-up window: the loops reach their steady state
        run.mark()
        time.sleep(args.prefix_duration_s)  # the measurement window: the load runs for this long
        run.mark()
    result = run.result()
    _print_result(result)
    return result


def run_paired(specs: list[str], args, head: ClientHead, out_dir: Path) -> list[dict]:
    """All policies at once (`--prefix-schedule paired`, the default): one swarm each, their clients
    running in the same warm-up and the same window, so whatever else loads the machine loads every
    policy alike and their ratio does not move with it (run one after the other, minutes apart, the
    ratio moved from 0.64 to 4.67 with the load). With `--prefix-pin-cores` (the default where there
    are as many cores as policies) each policy's server runs on a core of its own, so one policy's
    server cannot take CPU time the other's leaves while it waits for its clients; halfway through the
    window the servers swap cores, so neither keeps the core the machine's other work loads more."""
    _describe(args, specs)
    cores = sorted(os.sched_getaffinity(0))
    pin = args.prefix_pin_cores and len(cores) >= len(specs)
    with ExitStack() as stack:
        runs = [
            stack.enter_context(PrefixRun(spec, args, head, out_dir, cores[i] if pin else None))
            for i, spec in enumerate(specs)
        ]
        time.sleep(args.prefix_warmup_s)  # explicit warm-up window: the loops reach their steady state
        for run in runs:
            run.mark()
        if pin and len(runs) > 1:
            # the cores are not loaded alike by the machine's other work (in three paired runs the second
            # core gave its server 0.02-0.03 of a core less every time): halfway through the window every
            # server moves to the next core, so each policy spends half of it on each
            time.sleep(args.prefix_duration_s / 2)  # the window's first half on the first cores
            for i, run in enumerate(runs):
                run.core = cores[(i + 1) % len(runs)]
                pin_process_tree(run.swarm.servers[0].process.pid, run.core)
            time.sleep(args.prefix_duration_s / 2)  # and its second half on the other ones
        else:
            time.sleep(args.prefix_duration_s)  # the measurement window: every policy's load runs for this long
        for run in runs:
            run.mark()
    results = [{**run.result(), "cores": [cores[i], run.core] if pin else None} for i, run in enumerate(runs)]
    for r in results:
        _print_result(r)
    return results


def run_phase(args, head: ClientHead, out_dir: Path) -> list[dict]:
    specs = args.prefix_policies.split(",")
    if args.prefix_schedule == "paired":
        return run_paired(specs, args, head, out_dir)
    return [run_shared_prefix(spec, args, head, out_dir) for spec in specs]


def summarize(results: list[dict]) -> dict:
    by = {r["policy"].split(":")[0]: r for r in results}
    out = {}
    if "vtc" in by and "dlpm" in by and by["vtc"]["sessions_per_s"] > 0:
        out["throughput_ratio_dlpm_over_vtc"] = by["dlpm"]["sessions_per_s"] / by["vtc"]["sessions_per_s"]
        print(
            f"   shared prefix: throughput dlpm / vtc = {out['throughput_ratio_dlpm_over_vtc']:.2f} (goal >= 2, "
            f"paper 2.87); hit rate vtc {by['vtc']['hit_rate']:.3f}, dlpm {by['dlpm']['hit_rate']:.3f}; dlpm's max "
            f"gap {by['dlpm']['max_gap_weighted_tokens']:.0f} vs 2(U+Q) = {by['dlpm']['bound_2_U_plus_Q']:.0f}"
        )
        if by["dlpm"]["computed_tokens_per_session"] and by["vtc"]["computed_tokens_per_session"]:
            out["computed_tokens_per_session_ratio_vtc_over_dlpm"] = (
                by["vtc"]["computed_tokens_per_session"] / by["dlpm"]["computed_tokens_per_session"]
            )
            print(
                f"   tokens the server computed per finished session: vtc / dlpm = "
                f"{out['computed_tokens_per_session_ratio_vtc_over_dlpm']:.2f} (does not move with the load)"
            )
        if by["dlpm"]["server_cpu_s_per_session"] and by["vtc"]["server_cpu_s_per_session"]:
            out["cpu_s_per_session_ratio_vtc_over_dlpm"] = (
                by["vtc"]["server_cpu_s_per_session"] / by["dlpm"]["server_cpu_s_per_session"]
            )
            print(
                f"   server CPU seconds per finished session: vtc / dlpm = "
                f"{out['cpu_s_per_session_ratio_vtc_over_dlpm']:.2f}"
            )
        out["reused_prefill_tokens_dlpm_over_vtc"] = by["dlpm"]["reused_prefill_tokens"] / max(
            1, by["vtc"]["reused_prefill_tokens"]
        )
    return out
