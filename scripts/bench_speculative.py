"""Benchmark speculative decoding by prompt lookup over a chain, plain greedy as the same-run baseline.

One session at a time through a 3-server chain of SmolLM2-135M (blocks 0:10, 10:20, 20:30); the
servers and the client (with the DHT peer) each on its own emulated host (netem, userspace backend,
`experiments.hosts.EmulatedHosts`), every pair at the same RTT (0 and 50 ms by default), with the
servers relaying each step to the next (the client's default; `--relay server,client` also runs the
client relaying every hop, PETALS' way). Per task, the client generates greedily with HF's `generate`
plainly, with `prompt_lookup_num_tokens=k` at a constant k (k = 2, 4, 8: every draft sent whole) and
with the adaptive schedule (up to K = 8: each round sends the 0..K drafted tokens worth a longer
step by the measured acceptance and step times, client/speculation.py), and records tokens/s (of the
whole request, and of the decode phase after the first round, which includes the prompt), chain steps
per token, drafted and accepted tokens, and checks that the output is identical to the plain run's.

Timing on a shared machine drifts by several times within minutes, so every task runs `--repeats`
times, its modes back to back in each repeat (the order rotated from repeat to repeat), and the
number to read is the median paired ratio: each run's tok/s over the plain run's of the same task
and repeat, the median over repeats per task, then the median over the kind's tasks. The totals
(tokens / seconds over all runs) are kept next to it; the step and draft counts are exact.

Tasks: (a) repetitive (rewrite given code with a name changed, extend given code with a docstring,
answer by quoting a given passage), where drafts copied from the prompt are often right; (b) free
chat, where prompt lookup's drafts (mostly 1-gram matches) are rarely right.

Needs root (namespaces). Prints a Markdown table and writes results/bench_speculative.json; the
machine's load average is recorded next to the numbers (they are noisy on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CODE = """def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "paid":
            total += order.amount
            count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}"""

PASSAGE = (
    "The lighthouse stood on a rock a mile from the shore. Every evening the keeper climbed its ninety-"
    "two steps to light the lamp. Ships passing in the night saw the beam sweep the water every ten "
    "seconds. In winter the keeper lived alone, with a radio, a stove and a shelf of old books."
)

TASKS = {
    "code_rewrite": (
        "repetitive",
        "Rewrite this Python function, renaming the variable `total` to `paid_total`. "
        "Reply with the code only.\n\n```python\n" + CODE + "\n```",
    ),
    "code_extend": (
        "repetitive",
        "Add a docstring to this Python function. Reply with the whole function, "
        "code unchanged.\n\n```python\n" + CODE + "\n```",
    ),
    "quote_passage": (
        "repetitive",
        "Passage:\n" + PASSAGE + "\n\nQuestion: what does the keeper do every evening, "
        "and what do passing ships see? Answer by quoting the passage word for word.",
    ),
    "chat_story": ("chat", "Tell me a short story about a fox who learns to swim."),
    "chat_advice": ("chat", "Give me three tips for learning to play the guitar."),
}


class FirstRound:
    """A streamer that notes when the first round's tokens came (the prefill step's), and how many:
    what follows is the decode phase, where speculation acts (the prefill costs every mode the same)."""

    def __init__(self):
        self.puts, self.at_s, self.tokens = 0, None, 0

    def put(self, value):
        self.puts += 1  # the first put is the prompt
        if self.puts == 2:
            self.at_s, self.tokens = time.perf_counter(), int(value.numel())

    def end(self):
        pass


def client(peer: str, new_tokens: int, modes: list[tuple[int, str]], repeats: int, relay: str) -> None:
    """Runs in the client's namespace: `repeats` rounds; in each, every task runs plain and in each
    (k, schedule) back to back (the order rotated from round to round), so that a change in the
    machine's load hits every mode of a task alike. One JSON line per run."""
    import torch
    from transformers import AutoTokenizer

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.models.checkpoint import resolve_model_path

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    model = DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=[peer], relay=relay)
    all_modes = [(0, "plain"), *modes]
    try:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)  # warm-up: routing, streams
        for repeat in range(repeats):
            for task, (kind, prompt) in TASKS.items():
                ids = tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}],
                    add_generation_prompt=True,
                    return_tensors="pt",
                    return_dict=True,
                )["input_ids"]
                shift = repeat % len(all_modes)
                for k, schedule in all_modes[shift:] + all_modes[:shift]:
                    kwargs = {"prompt_lookup_num_tokens": k, "prompt_lookup_schedule": schedule} if k else {}
                    first = FirstRound()
                    load = os.getloadavg()[0]
                    with model.inference_session(max_length=ids.shape[1] + new_tokens + k) as session:
                        t0 = time.perf_counter()
                        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=first, **kwargs)
                        seconds = time.perf_counter() - t0
                        stats = session.last_generate
                    decode = {
                        "decode_seconds": seconds - (first.at_s - t0),
                        "decode_tokens": stats.tokens - first.tokens,
                    }
                    print(
                        json.dumps(
                            {
                                "task": task,
                                "kind": kind,
                                "k": k,
                                "schedule": schedule,
                                "repeat": repeat,
                                "relay": relay,
                                "seconds": seconds,
                                **decode,
                                **stats.to_json(),
                                "output_ids": out[0, ids.shape[1] :].tolist(),
                                "prompt_tokens": ids.shape[1],
                                "loadavg_1m_before": load,
                            }
                        ),
                        flush=True,
                    )
    finally:
        model.backend.shutdown()


def run(
    rtts_ms: list[float], new_tokens: int, modes: list[tuple[int, str]], repeats: int, relays: list[str]
) -> list[dict]:
    import numpy as np

    import netem
    from experiments.hosts import EmulatedHosts
    from petals_chain.swarm.local import LocalSwarm

    name = "s" + uuid.uuid4().hex[:6]
    servers = ["s0", "s1", "s2"]  # the DHT peer runs on the client's host (experiments.hosts)

    def uniform(ms):
        return (np.full((4, 4), ms) - np.diag(np.full(4, ms))).tolist()

    rows: list[dict] = []
    hosts = EmulatedHosts(servers, np.array(uniform(rtts_ms[0])), backend="userspace", name=name)
    try:
        with LocalSwarm(
            "smollm2-135m",
            [(0, 10), (10, 20), (20, 30)],
            placement=hosts.placement,
            server_args=["--num-threads", "1", "--no-orchestrator"],
        ) as swarm:
            env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
            for ms, relay in ((ms, relay) for ms in rtts_ms for relay in relays):
                hosts.net.set_rtt_ms(uniform(ms))
                argv = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--client",
                    swarm.initial_peers[0],
                    "--new-tokens",
                    str(new_tokens),
                    "--modes",
                    format_modes(modes),
                    "--repeats",
                    str(repeats),
                    "--relay",
                    relay,
                ]
                # stderr to a file: a pipe nobody reads while stdout is read could fill and stall the client
                stderr_file = tempfile.TemporaryFile(mode="w+")
                proc = hosts.popen("client", argv, stdout=subprocess.PIPE, stderr=stderr_file, text=True, env=env)
                # read as the runs finish (a bounded number of lines: one per run), so progress shows
                for line in proc.stdout:
                    if line.startswith("{"):
                        row = {**json.loads(line), "rtt_ms": ms}
                        rows.append(row)
                        print(
                            f"RTT {ms:g} ms {relay} relay #{row['repeat']} {row['task']:14s} {mode_name(row)}: "
                            f"{row['tokens'] / row['seconds']:6.2f} tok/s, "
                            f"{row['chain_steps'] / max(1, row['tokens']):.2f} steps/token, "
                            f"load {row['loadavg_1m_before']:.1f}",
                            flush=True,
                        )
                if proc.wait(timeout=60) != 0:
                    stderr_file.seek(0)
                    raise RuntimeError(stderr_file.read()[-3000:])
                stderr_file.close()
    finally:
        hosts.close()
        netem.cleanup(name)
    return rows


def mode_name(row: dict) -> str:
    return "plain greedy" if row["k"] == 0 else f"prompt lookup {row['schedule']} k={row['k']}"


def parse_modes(text: str) -> list[tuple[int, str]]:
    """'2,4,8,a8' -> [(2, 'constant'), (4, 'constant'), (8, 'constant'), (8, 'adaptive')]."""
    return [(int(x[1:]), "adaptive") if x.startswith("a") else (int(x), "constant") for x in text.split(",") if x]


def format_modes(modes: list[tuple[int, str]]) -> str:
    return ",".join(f"a{k}" if schedule == "adaptive" else str(k) for k, schedule in modes)


def mark_identical(rows: list[dict]) -> None:
    """`identical_to_plain` on every run: its output equals plain greedy's on the same task, RTT and
    repeat (and every plain run of a task equals the others: greedy is deterministic)."""
    plain = {(r["rtt_ms"], r["relay"], r["task"], r["repeat"]): r["output_ids"] for r in rows if r["k"] == 0}
    first_plain = {}
    for (ms, relay, task, _), ids in sorted(plain.items()):
        first_plain.setdefault(task, ids)
    for r in rows:
        r["identical_to_plain"] = (
            r["output_ids"] == plain.get((r["rtt_ms"], r["relay"], r["task"], r["repeat"]))
            and r["output_ids"] == first_plain[r["task"]]
        )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired_ratios(rows: list[dict], mode: tuple[int, str]) -> list[dict]:
    """Per run of `mode`: its tok/s (whole request and decode phase) over the plain run's of the same
    RTT, relay, task and repeat, which ran back to back with it: the load drifts of a shared machine
    cancel out of these ratios far better than out of totals gathered minutes apart."""
    plain = {(r["rtt_ms"], r["relay"], r["task"], r["repeat"]): r for r in rows if r["k"] == 0}
    out = []
    for r in rows:
        base = plain.get((r["rtt_ms"], r["relay"], r["task"], r["repeat"]))
        if (r["k"], r["schedule"]) != mode or base is None:
            continue
        out.append(
            {
                "task": r["task"],
                "repeat": r["repeat"],
                "speedup": (r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"]),
                "decode_speedup": (r["decode_tokens"] / r["decode_seconds"])
                / (base["decode_tokens"] / base["decode_seconds"]),
            }
        )
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Per RTT, relay, task kind and mode: tokens/s over all tasks and repeats of that kind (total tokens /
    total seconds) and its ratio to plain (k = 0); the median over the kind's tasks of each task's
    median paired ratio (`paired_speedup_median`: the number to read on a loaded machine) and the
    median, min and max over all paired runs; chain steps per token, drafted and accepted tokens
    (exact: they do not depend on the load), whether all outputs matched plain greedy, and the load."""
    out = []
    for ms, relay in sorted({(r["rtt_ms"], r["relay"]) for r in rows}, key=lambda c: (c[0], c[1] != "server")):
        for kind in ("repetitive", "chat"):
            sel = [r for r in rows if r["rtt_ms"] == ms and r["relay"] == relay and r["kind"] == kind]
            if not sel:
                continue
            by_mode = {}
            for mode in dict.fromkeys((r["k"], r["schedule"]) for r in sel):
                rk = [r for r in sel if (r["k"], r["schedule"]) == mode]
                tokens, seconds = sum(r["tokens"] for r in rk), sum(r["seconds"] for r in rk)
                decode_tok_per_s = sum(r["decode_tokens"] for r in rk) / sum(r["decode_seconds"] for r in rk)
                pairs = paired_ratios(sel, mode)
                tasks = list(dict.fromkeys(p["task"] for p in pairs))
                per_task = {
                    t: {
                        "speedup_median": median([p["speedup"] for p in pairs if p["task"] == t]),
                        "decode_speedup_median": median([p["decode_speedup"] for p in pairs if p["task"] == t]),
                        "steps_per_token": sum(r["chain_steps"] for r in rk if r["task"] == t)
                        / sum(r["tokens"] for r in rk if r["task"] == t),
                    }
                    for t in tasks
                }
                loads = [r["loadavg_1m_before"] for r in rk]
                by_mode[mode] = {
                    "rtt_ms": ms,
                    "relay": relay,
                    "kind": kind,
                    "k": mode[0],
                    "schedule": mode[1],
                    "tokens": tokens,
                    "repeats": len({r["repeat"] for r in rk}),
                    "tok_per_s": tokens / seconds,
                    "decode_tok_per_s": decode_tok_per_s,
                    "paired_speedup_median": median([v["speedup_median"] for v in per_task.values()]),
                    "paired_decode_speedup_median": median([v["decode_speedup_median"] for v in per_task.values()]),
                    "paired_speedup_all_median": median([p["speedup"] for p in pairs]),
                    "paired_speedup_min": min((p["speedup"] for p in pairs), default=float("nan")),
                    "paired_speedup_max": max((p["speedup"] for p in pairs), default=float("nan")),
                    "per_task": per_task,
                    "steps_per_token": sum(r["chain_steps"] for r in rk) / tokens,
                    "drafted_tokens": sum(r["drafted_tokens"] for r in rk),
                    "accepted_draft_tokens": sum(r["accepted_draft_tokens"] for r in rk),
                    "identical": all(r["identical_to_plain"] for r in rk),
                    "loadavg_1m": max(loads),
                    "loadavg_1m_median": median(loads),
                }
            plain = by_mode[(0, "plain")]
            for s in by_mode.values():
                s["speedup_vs_plain"] = s["tok_per_s"] / plain["tok_per_s"]
                s["decode_speedup_vs_plain"] = s["decode_tok_per_s"] / plain["decode_tok_per_s"]
                out.append(s)
    return out


def table(summary: list[dict]) -> str:
    lines = [
        "| RTT | relay | tasks | mode | paired speedup, median (min-max) | decode, median | tok/s (total) | "
        "vs plain (totals) | chain steps / token | accepted / drafted | identical output | load avg (median, max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        paired = (
            "1.00x"
            if s["k"] == 0
            else f"{s['paired_speedup_median']:.2f}x ({s['paired_speedup_min']:.2f}-{s['paired_speedup_max']:.2f})"
        )
        decode = "1.00x" if s["k"] == 0 else f"{s['paired_decode_speedup_median']:.2f}x"
        lines.append(
            f"| {s['rtt_ms']:g} ms | {s['relay']} | {s['kind']} | {mode_name(s)} | {paired} | {decode} | "
            f"{s['tok_per_s']:.2f} | {s['speedup_vs_plain']:.2f}x | {s['steps_per_token']:.2f} | "
            f"{s['accepted_draft_tokens']} / {s['drafted_tokens']} | {'yes' if s['identical'] else 'NO'} | "
            f"{s['loadavg_1m_median']:.1f}, {s['loadavg_1m']:.1f} |"
        )
    lines += [
        "",
        "| RTT | relay | task | mode | paired speedup, median | chain steps / token |",
        "|---|---|---|---|---|---|",
    ]
    for s in (s for s in summary if s["k"] != 0):
        for task, v in s["per_task"].items():
            lines.append(
                f"| {s['rtt_ms']:g} ms | {s['relay']} | {task} | {mode_name(s)} | {v['speedup_median']:.2f}x | "
                f"{v['steps_per_token']:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rtts-ms", default="0,50", help="emulated RTTs between every pair of hosts (default 0,50)")
    p.add_argument(
        "--modes",
        default="2,4,8,a8",
        help="prompt lookup draft lengths: K a constant K, aK adaptive up to K (default 2,4,8,a8)",
    )
    p.add_argument("--new-tokens", type=int, default=64, help="max new tokens per generation (default 64)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of every task and mode, the modes of a task back "
        "to back in each (default 3; medians of paired ratios)",
    )
    p.add_argument(
        "--relay",
        default="server",
        help="who relays a step from hop to hop: server (the default: each "
        "server pushes to the next), client (PETALS' way), or both "
        "as server,client",
    )
    p.add_argument("--out", default="results/bench_speculative.json")
    p.add_argument("--client", metavar="PEER", help=argparse.SUPPRESS)  # internal: the client side
    args = p.parse_args()
    modes = parse_modes(args.modes)
    if args.client:
        client(args.client, args.new_tokens, modes, args.repeats, args.relay)
        return 0
    started, load_start = time.time(), os.getloadavg()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    relays = [r for r in args.relay.split(",") if r]
    if not relays or any(r not in ("server", "client") for r in relays):
        p.error(f"--relay takes server, client or server,client, got {args.relay!r}")
    rows = run([float(x) for x in args.rtts_ms.split(",")], args.new_tokens, modes, args.repeats, relays)
    mark_identical(rows)
    summary = summarize(rows)
    print(table(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "new_tokens": args.new_tokens,
                "modes": format_modes(modes),
                "repeats": args.repeats,
                "model": "smollm2-135m",
                "servers": "3 (blocks 0:10, 10:20, 20:30)",
                "relays": relays,
                "wall_s": time.time() - started,
                "loadavg_start": load_start,
                "loadavg_end": os.getloadavg(),
                "summary": summary,
                "runs": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
