"""Fairness of a block server's local scheduler on a live swarm: FCFS vs VTC vs DLPM, measured in one run.

For each policy a fresh one-server swarm (all blocks, `--max-batch-tokens`, `--service-log`) runs:

1. **flooder**: a well-behaved client's 8-token generations (short prompts, one at a time) alone,
   and next to a flooding client (one peer, several concurrent sessions of long prompts, each
   retrying whatever fails, forever). With `--flooder-schedule paired` (the default) the
   generations alone run on a twin server on the other core, interleaved one by one with those
   next to the flooder, so both means see the same load (sequential: alone first, then crowded,
   on one server). Slowdown = mean latency with the flooder / alone; the script
   prints both policies' slowdowns, their ratio (VTC / FCFS; the goal is <= 0.5), and each
   client's share of the service (w_in per prompt token, w_out per decode token) while both ran.
2. **service gap**: two continuously backlogged clients that differ in how much they ask for at once
   (client a runs twice as many concurrent sessions as client b, all with long prompts); from the
   server's per-batch log it computes max |W_a(t1,t2) - W_b(t1,t2)| over intervals in which both
   still had steps waiting after each batch was chosen (the paper's backlog), next to the VTC
   paper's Theorem 4.4 bound 2U, U = max(w_in L_input, w_out M) with L_input = M = --max-batch-tokens
   (prompts run in chunks of at most M tokens).
3. **shared prefix** (`scripts/fairness_prefix.py`): clients whose requests share a long system
   prompt, on a server whose memory holds few sessions and less prefix cache than all clients'
   prompts: VTC vs DLPM throughput (the DLPM paper: 2.87x), cache hit rate, service gap vs 2(U+Q);
   by default both policies at once, one server each on a core of its own (`--prefix-schedule`).

Every server runs with `--prefill-tokens-while-decoding` (32 here; the server's default is off).

`--phases` picks which run (default: all three). Writes results/fairness/bench_fairness.json and
results/fairness/service_over_time.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from petals_chain.client.remote import RemoteChain  # noqa: E402
from petals_chain.runtime.client_head import ClientHead  # noqa: E402
from petals_chain.swarm.local import LocalSwarm  # noqa: E402
from scripts import fairness_prefix  # noqa: E402
from scripts.fairness_log import (  # noqa: E402
    max_backlogged_gap,
    pin_process_tree,
    read_log,
    service_by_client,
    weighted,
)

LIGHT_PROMPT = "Name a colour of the rainbow."


def generate(chain: RemoteChain, head: ClientHead, ids: torch.Tensor, new_tokens: int) -> float:
    """Greedy generation of `new_tokens` in a fresh session; returns its latency (open to close)."""
    start = time.monotonic()
    session = chain.open_session(max_length=ids.shape[0] + new_tokens + 1)
    try:
        out = session.step(head.embed_tokens(ids))
        token = int(head.logits(out[-1:]).argmax())
        for _ in range(new_tokens - 1):
            out = session.step(head.embed_tokens(torch.tensor([token])))
            token = int(head.logits(out[-1:]).argmax())
    finally:
        session.close()
    return time.monotonic() - start


class LoopingClient:
    """`sessions` threads, each forever: open, prompt of `prompt_tokens`, `decode_tokens` decode
    steps, close; any failure is retried (the flooder does not back off)."""

    def __init__(
        self, chain: RemoteChain, head: ClientHead, sessions: int, prompt_tokens: int, decode_tokens: int, seed: int
    ):
        self.chain, self.head = chain, head
        self.prompt_tokens, self.decode_tokens = prompt_tokens, decode_tokens
        self.stop = threading.Event()
        self.completed = 0
        self.failures = 0
        rng = random.Random(seed)
        vocab = head.config.vocab_size
        self.prompts = [torch.tensor([rng.randrange(2, vocab) for _ in range(prompt_tokens)]) for _ in range(sessions)]
        self.threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in self.prompts]

    def _run(self, prompt: torch.Tensor) -> None:
        embedded = self.head.embed_tokens(prompt)
        one = self.head.embed_tokens(torch.tensor([17]))
        while not self.stop.is_set():
            try:
                session = self.chain.open_session(max_length=self.prompt_tokens + self.decode_tokens + 1)
                try:
                    session.step(embedded)
                    for _ in range(self.decode_tokens):
                        if self.stop.is_set():
                            break
                        session.step(one)
                finally:
                    session.close()
                self.completed += 1
            except Exception:
                self.failures += 1
                self.stop.wait(0.05)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def run_policy(spec: str, args, head: ClientHead, out_dir: Path) -> dict:
    """`spec` is a policy name, optionally with parameters: `vtc:max_client_share=0.5`."""
    policy, *params = spec.split(":")
    log = out_dir / f"service_{spec.replace(':', '_').replace('=', '')}.jsonl"
    log.unlink(missing_ok=True)
    server_args = [
        "--num-threads",
        str(args.num_threads),
        "--max-batch-tokens",
        str(args.max_batch_tokens),
        "--max-length",
        "2048",
        "--memory-budget",
        args.memory_budget,
        "--policy",
        policy,
        "--prefill-tokens-while-decoding",
        str(args.prefill_tokens_while_decoding),
        "--service-log",
        str(log),
        "--no-orchestrator",
    ]
    if policy == "vtc":
        server_args += ["--policy-arg", f"w_in={args.w_in}", "--policy-arg", f"w_out={args.w_out}"]
    for param in params:
        server_args += ["--policy-arg", param]
    result: dict = {"policy": spec}
    paired = args.flooder_schedule == "paired"
    cores = sorted(os.sched_getaffinity(0))
    pin = paired and args.flooder_pin_cores and len(cores) >= 2

    print(
        f"\n== {spec}: starting a one-server swarm" + (" and its twin for the light client alone" if paired else ""),
        flush=True,
    )
    with ExitStack() as stack:
        swarm = stack.enter_context(
            LocalSwarm(
                "smollm2-135m", [(0, head.config.num_hidden_layers)], server_args=server_args, start_timeout_s=600
            )
        )
        if pin:
            pin_process_tree(swarm.servers[0].process.pid, cores[0])
        chains = [
            RemoteChain(
                "smollm2-135m",
                head.config,
                swarm.initial_peers,
                use_orchestrator=False,
                step_timeout_s=300,
                open_timeout_s=60,
            )
            for _ in range(3)
        ]
        light, flooder, other = chains
        peer = {str(c.p2p.peer_id): name for c, name in zip(chains, ("light", "flooder", "other"))}
        if paired:
            # the twin: the same server on the other core, where the light client runs alone, its
            # generations interleaved with those next to the flooder, so both see the same load
            twin_log = log.with_name(log.stem + "_alone.jsonl")
            twin_log.unlink(missing_ok=True)
            twin_args = [twin_log.as_posix() if a == str(log) else a for a in server_args]
            twin = stack.enter_context(
                LocalSwarm(
                    "smollm2-135m", [(0, head.config.num_hidden_layers)], server_args=twin_args, start_timeout_s=600
                )
            )
            if pin:
                pin_process_tree(twin.servers[0].process.pid, cores[1])
            light_alone = RemoteChain(
                "smollm2-135m",
                head.config,
                twin.initial_peers,
                use_orchestrator=False,
                step_timeout_s=300,
                open_timeout_s=60,
            )
            chains.append(light_alone)
        try:
            ids = head_ids(head, LIGHT_PROMPT)
            generate(light, head, ids, args.new_tokens)  # warm-up: routing, connections
            if paired:
                generate(light_alone, head, ids, args.new_tokens)
                alone = []
            else:
                alone = [generate(light, head, ids, args.new_tokens) for _ in range(args.light_runs)]
                print(f"   light alone: mean {statistics.mean(alone):.2f} s over {len(alone)} generations", flush=True)
            with LoopingClient(
                flooder, head, args.flooder_sessions, args.flooder_prompt, args.flooder_decode, seed=1
            ) as flood:
                time.sleep(args.flooder_head_start_s)  # explicit: let the flood build its backlog first
                t0 = time.monotonic()
                crowded = []
                for _ in range(args.light_runs):
                    if paired:
                        alone.append(generate(light_alone, head, ids, args.new_tokens))
                    crowded.append(generate(light, head, ids, args.new_tokens))
                t1 = time.monotonic()
            if paired:
                print(
                    f"   light alone (twin server, interleaved): mean {statistics.mean(alone):.2f} s over "
                    f"{len(alone)} generations",
                    flush=True,
                )
            batches = read_log(log)
            # the log's clock is the server's time.monotonic(): the same clock on this host
            share = service_by_client(batches, t0, t1, args.w_in, args.w_out)
            light_id = str(light.p2p.peer_id)
            waits = light_step_waits([b for b in batches if t0 <= b["t_s"] < t1], light_id)
            total = sum(share.values()) or 1.0
            result["flooder"] = {
                "light_alone_mean_s": statistics.mean(alone),
                "light_with_flooder_mean_s": statistics.mean(crowded),
                "slowdown": statistics.mean(crowded) / statistics.mean(alone),
                "light_alone_s": alone,
                "light_with_flooder_s": crowded,
                "service_share": {peer.get(c, c[:8]): w / total for c, w in share.items()},
                "light_step_waits": waits,
                "flooder_completed": flood.completed,
                "flooder_failures": flood.failures,
            }
            f = result["flooder"]
            shares = json.dumps({k: round(v, 3) for k, v in f["service_share"].items()})
            print(
                f"   light next to flooder: mean {f['light_with_flooder_mean_s']:.2f} s -> slowdown "
                f"{f['slowdown']:.1f}x; service share {shares}; "
                f"per decode step it waited {waits.get('mean_batches_waited', float('nan')):.2f} batches, "
                f"{waits.get('mean_other_tokens_waited', float('nan')):.0f} tokens of others' work",
                flush=True,
            )
            # -- two backlogged clients -------------------------------------------------------------
            start_batch = len(read_log(log))
            with (
                LoopingClient(flooder, head, 2 * args.gap_sessions, args.gap_prompt, args.gap_decode, seed=2),
                LoopingClient(other, head, args.gap_sessions, args.gap_prompt, args.gap_decode, seed=3),
            ):
                time.sleep(args.gap_duration_s)  # the measurement window: the load runs for this long
            batches = read_log(log)[start_batch:]
            a = next(c for c, n in peer.items() if n == "flooder")
            b = next(c for c, n in peer.items() if n == "other")
            gap, counted = max_backlogged_gap(batches, a, b, args.w_in, args.w_out)
            u = max(args.w_in * args.max_batch_tokens, args.w_out * args.max_batch_tokens)
            served = service_by_client(batches, float("-inf"), float("inf"), args.w_in, args.w_out)
            result["gap"] = {
                "max_gap_weighted_tokens": gap,
                "bound_2U": 2 * u,
                "U": u,
                "batches_both_backlogged": counted,
                "batches": len(batches),
                "service": {{a: "a", b: "b"}.get(c, c[:8]): w for c, w in served.items()},
                "series": cumulative_series(
                    batches,
                    {a: f"client a ({2 * args.gap_sessions} sessions)", b: f"client b ({args.gap_sessions} sessions)"},
                    args.w_in,
                    args.w_out,
                ),
            }
            g = result["gap"]
            print(
                f"   two backlogged clients: max service gap {gap:.0f} weighted tokens over {counted} of "
                f"{len(batches)} batches (VTC bound 2U = {2 * u:.0f}); service "
                f"{json.dumps({k: round(v) for k, v in g['service'].items()})}",
                flush=True,
            )
        finally:
            for c in chains:
                c.shutdown()
    return result


def head_ids(head: ClientHead, text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(head.model_path)
    return tok(text, return_tensors="pt").input_ids[0]


def light_step_waits(batches: list[dict], light: str) -> dict:
    """Work the well-behaved client's decode steps waited behind, from the server's log: for each
    pair of consecutive steps of one generation (a session's first step opens a new one), the
    batches that ran in between and the other clients' tokens in them and in the step's own batch.
    Unlike wall time, this does not move with the load other programs put on the machine."""
    at = [k for k, b in enumerate(batches) if any(i[0] == light for i in b["items"])]
    waits_batches, waits_tokens = [], []
    for a, b in zip(at, at[1:]):
        if any(i[0] == light and i[2] and i[1] > 1 for i in batches[b]["items"]):
            continue  # a new generation's prompt: not a step that followed the previous one
        waits_batches.append(b - a - 1)
        waits_tokens.append(sum(i[1] for k in range(a + 1, b + 1) for i in batches[k]["items"] if i[0] != light))
    if not waits_batches:
        return {}
    return {
        "steps": len(waits_batches),
        "mean_batches_waited": statistics.mean(waits_batches),
        "mean_other_tokens_waited": statistics.mean(waits_tokens),
    }


def cumulative_series(batches, names: dict[str, str], w_in: float, w_out: float) -> dict[str, list]:
    if not batches:
        return {}
    t0 = batches[0]["t_s"]
    series = {name: [[0.0, 0.0]] for name in names.values()}
    totals = {name: 0.0 for name in names.values()}
    for b in batches:
        for item in b["items"]:
            name = names.get(item[0])
            if name is not None:
                totals[name] += weighted(item, w_in, w_out)
        for name in names.values():
            series[name].append([b["t_s"] - t0, totals[name]])
    return series


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        for name, pts in r["gap"]["series"].items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
        g = r["gap"]
        ax.set_title(f"{r['policy']}: max gap {g['max_gap_weighted_tokens']:.0f} (2U = {g['bound_2U']:.0f})")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("service received (weighted tokens)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--policies",
        default="fcfs,vtc,vtc:max_client_share=0.5",
        help="comma-separated policies, each NAME or NAME:PARAM=VALUE[:...] (--policy-arg of the server)",
    )
    p.add_argument("--max-batch-tokens", type=int, default=128)
    p.add_argument("--w-in", type=float, default=1.0)
    p.add_argument("--w-out", type=float, default=2.0)
    p.add_argument("--memory-budget", default="2GiB")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument(
        "--prefill-tokens-while-decoding",
        type=int,
        default=32,
        help="the servers' --prefill-tokens-while-decoding in every phase (0: off, the server's default)",
    )
    p.add_argument("--new-tokens", type=int, default=8, help="tokens per well-behaved generation")
    p.add_argument("--light-runs", type=int, default=4, help="well-behaved generations per phase")
    p.add_argument("--flooder-sessions", type=int, default=6)
    p.add_argument("--flooder-prompt", type=int, default=700)
    p.add_argument("--flooder-decode", type=int, default=4)
    p.add_argument("--flooder-head-start-s", type=float, default=3.0)
    p.add_argument(
        "--flooder-schedule",
        choices=("paired", "sequential"),
        default="paired",
        help="paired: the light client's generations alone run on a twin server (its own core) "
        "interleaved with those next to the flooder, so both see the same load; sequential: alone "
        "first, then next to the flooder, on one server",
    )
    p.add_argument(
        "--flooder-pin-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="paired: pin the flooder's server and the twin to a core each once they are up",
    )
    p.add_argument("--gap-sessions", type=int, default=2, help="client b's sessions (client a runs twice as many)")
    p.add_argument("--gap-prompt", type=int, default=256)
    p.add_argument("--gap-decode", type=int, default=8)
    p.add_argument("--gap-duration-s", type=float, default=90.0)
    p.add_argument(
        "--phases",
        default="flooder,gap,prefix",
        help="which phases run: flooder and gap (per --policies, together), prefix (per --prefix-policies)",
    )
    fairness_prefix.add_arguments(p)
    p.add_argument("--out", default=str(REPO / "results" / "fairness"))
    args = p.parse_args(argv)
    phases = set(args.phases.split(","))
    if not phases <= {"flooder", "gap", "prefix"} or ("flooder" in phases) != ("gap" in phases):
        p.error("--phases takes flooder,gap (both or neither) and/or prefix")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    from petals_chain.models.checkpoint import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    head = ClientHead(path, model_path=path)
    results = (
        [run_policy(policy, args, head, out_dir) for policy in args.policies.split(",")] if "flooder" in phases else []
    )
    prefix_results = fairness_prefix.run_phase(args, head, out_dir) if "prefix" in phases else []
    by = {r["policy"]: r for r in results}
    summary = {"args": vars(args), "results": results, "shared_prefix": prefix_results}
    print("\n== summary (ratios within this run)")
    summary.update(fairness_prefix.summarize(prefix_results))
    for r in results:
        f, g = r["flooder"], r["gap"]
        w = f["light_step_waits"]
        print(
            f"   {r['policy']:26s} light slowdown next to flooder {f['slowdown']:6.1f}x  "
            f"waits/step {w.get('mean_batches_waited', float('nan')):4.2f} batches "
            f"{w.get('mean_other_tokens_waited', float('nan')):5.0f} tokens  "
            f"light share {f['service_share'].get('light', 0):.3f}  "
            f"max backlogged gap {g['max_gap_weighted_tokens']:7.0f} (2U = {g['bound_2U']:.0f})"
        )
    for spec, r in by.items():
        if spec != "fcfs" and "fcfs" in by:
            ratio = r["flooder"]["slowdown"] / by["fcfs"]["flooder"]["slowdown"]
            summary[f"slowdown_ratio_{spec}_over_fcfs"] = ratio
            tokens = {x: by[x]["flooder"]["light_step_waits"].get("mean_other_tokens_waited") for x in (spec, "fcfs")}
            wait_ratio = tokens[spec] / tokens["fcfs"] if tokens[spec] is not None and tokens["fcfs"] else None
            summary[f"wait_tokens_ratio_{spec}_over_fcfs"] = wait_ratio
            print(
                f"   slowdown {spec} / fcfs = {ratio:.3f} (goal <= 0.5); others' tokens waited per light step "
                f"{spec} / fcfs = {wait_ratio if wait_ratio is None else round(wait_ratio, 3)}"
            )
    (out_dir / "bench_fairness.json").write_text(json.dumps(summary, indent=1))
    if results:
        plot(results, out_dir / "service_over_time.png")
    print(f"wrote {out_dir / 'bench_fairness.json'} and {out_dir / 'service_over_time.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
