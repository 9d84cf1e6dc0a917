"""Benchmark speculative decoding by prompt lookup over a chain, plain greedy as the same-run baseline.

One session at a time through a 3-server chain of SmolLM2-135M (blocks 0:10, 10:20, 20:30); the
servers and the client (with the DHT peer) each on its own emulated host (netem, userspace backend,
`experiments.hosts.EmulatedHosts`), every pair at the same RTT (0 and 50 ms by default). Per task, the client generates greedily with HF's `generate`
plainly, with `prompt_lookup_num_tokens=k` at a constant k (k = 2, 4, 8: every draft sent whole) and
with the adaptive schedule (up to K = 8: each round sends the 0..K drafted tokens worth a longer
step by the measured acceptance and step times, client/speculation.py), and records tokens/s (of the
whole request, and of the decode phase after the first round, which includes the prompt), chain steps
per token, drafted and accepted tokens, and checks that the output is identical to the plain run's.

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
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order.status == "paid":
            total += order.amount
            count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}'''

PASSAGE = ("The lighthouse stood on a rock a mile from the shore. Every evening the keeper climbed its ninety-"
           "two steps to light the lamp. Ships passing in the night saw the beam sweep the water every ten "
           "seconds. In winter the keeper lived alone, with a radio, a stove and a shelf of old books.")

TASKS = {
    "code_rewrite": ("repetitive", "Rewrite this Python function, renaming the variable `total` to `paid_total`. "
                                   "Reply with the code only.\n\n```python\n" + CODE + "\n```"),
    "code_extend": ("repetitive", "Add a docstring to this Python function. Reply with the whole function, "
                                  "code unchanged.\n\n```python\n" + CODE + "\n```"),
    "quote_passage": ("repetitive", "Passage:\n" + PASSAGE + "\n\nQuestion: what does the keeper do every evening, "
                                    "and what do passing ships see? Answer by quoting the passage word for word."),
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


def client(peer: str, new_tokens: int, modes: list[tuple[int, str]]) -> None:
    """Runs in the client's namespace: every task, plain then each (k, schedule); one JSON line per run."""
    import torch
    from transformers import AutoTokenizer

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.models.checkpoint import resolve_model_path

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    model = DistributedModelForCausalLM.from_pretrained("smollm2-135m", initial_peers=[peer])
    try:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)  # warm-up: routing, streams
        for task, (kind, prompt) in TASKS.items():
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            plain = None
            for k, schedule in [(0, "plain"), *modes]:
                kwargs = {"prompt_lookup_num_tokens": k, "prompt_lookup_schedule": schedule} if k else {}
                first = FirstRound()
                with model.inference_session(max_length=ids.shape[1] + new_tokens + k) as session:
                    t0 = time.perf_counter()
                    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, streamer=first, **kwargs)
                    seconds = time.perf_counter() - t0
                    stats = session.last_generate
                decode = {"decode_seconds": seconds - (first.at_s - t0), "decode_tokens": stats.tokens - first.tokens}
                if plain is None:
                    plain = out
                print(json.dumps({"task": task, "kind": kind, "k": k, "schedule": schedule, "seconds": seconds,
                                  **decode, **stats.to_json(),
                                  "identical_to_plain": out.tolist() == plain.tolist(),
                                  "prompt_tokens": ids.shape[1]}), flush=True)
    finally:
        model.backend.shutdown()


def run(rtts_ms: list[float], new_tokens: int, modes: list[tuple[int, str]]) -> list[dict]:
    import numpy as np

    import netem
    from experiments.hosts import EmulatedHosts
    from petals_chain.local_swarm import LocalSwarm

    name = "s" + uuid.uuid4().hex[:6]
    servers = ["s0", "s1", "s2"]  # the DHT peer runs on the client's host (experiments.hosts)
    uniform = lambda ms: (np.full((4, 4), ms) - np.diag(np.full(4, ms))).tolist()
    rows: list[dict] = []
    hosts = EmulatedHosts(servers, np.array(uniform(rtts_ms[0])), backend="userspace", name=name)
    try:
        with LocalSwarm("smollm2-135m", [(0, 10), (10, 20), (20, 30)], placement=hosts.placement,
                        server_args=["--num-threads", "1", "--no-orchestrator"]) as swarm:
            env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
            for ms in rtts_ms:
                hosts.net.set_rtt_ms(uniform(ms))
                load = os.getloadavg()[0]
                argv = [sys.executable, str(Path(__file__).resolve()), "--client", swarm.initial_peers[0],
                        "--new-tokens", str(new_tokens), "--modes", format_modes(modes)]
                proc = hosts.popen("client", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                stdout, stderr = proc.communicate(timeout=1800)
                if proc.returncode != 0:
                    raise RuntimeError(stderr[-3000:])
                for line in stdout.splitlines():
                    if line.startswith("{"):
                        row = {**json.loads(line), "rtt_ms": ms, "loadavg_1m_before": load}
                        rows.append(row)
                        print(f"RTT {ms:g} ms {row['task']:14s} {mode_name(row)}: {row['tokens'] / row['seconds']:6.2f} "
                              f"tok/s, {row['chain_steps'] / max(1, row['tokens']):.2f} steps/token, "
                              f"identical={row['identical_to_plain']}", flush=True)
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


def summarize(rows: list[dict]) -> list[dict]:
    """Per RTT, task kind and mode: tokens/s over all tasks of that kind (total tokens / total seconds),
    chain steps per token, the ratio to plain (k = 0) in the same run, and whether all outputs matched."""
    out = []
    for ms in sorted({r["rtt_ms"] for r in rows}):
        for kind in ("repetitive", "chat"):
            sel = [r for r in rows if r["rtt_ms"] == ms and r["kind"] == kind]
            if not sel:
                continue
            by_mode = {}
            for mode in dict.fromkeys((r["k"], r["schedule"]) for r in sel):
                rk = [r for r in sel if (r["k"], r["schedule"]) == mode]
                tokens, seconds = sum(r["tokens"] for r in rk), sum(r["seconds"] for r in rk)
                decode_tok_per_s = sum(r["decode_tokens"] for r in rk) / sum(r["decode_seconds"] for r in rk)
                by_mode[mode] = {"rtt_ms": ms, "kind": kind, "k": mode[0], "schedule": mode[1], "tokens": tokens,
                                 "tok_per_s": tokens / seconds, "decode_tok_per_s": decode_tok_per_s,
                                 "steps_per_token": sum(r["chain_steps"] for r in rk) / tokens,
                                 "drafted_tokens": sum(r["drafted_tokens"] for r in rk),
                                 "accepted_draft_tokens": sum(r["accepted_draft_tokens"] for r in rk),
                                 "identical": all(r["identical_to_plain"] for r in rk),
                                 "loadavg_1m": max(r["loadavg_1m_before"] for r in rk)}
            plain = by_mode[(0, "plain")]
            for s in by_mode.values():
                s["speedup_vs_plain"] = s["tok_per_s"] / plain["tok_per_s"]
                s["decode_speedup_vs_plain"] = s["decode_tok_per_s"] / plain["decode_tok_per_s"]
                out.append(s)
    return out


def table(summary: list[dict]) -> str:
    lines = ["| RTT | tasks | mode | tok/s (whole request) | vs plain | decode tok/s | vs plain | chain steps / token | "
             "accepted / drafted | identical output | load avg |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['rtt_ms']:g} ms | {s['kind']} | {mode_name(s)} | {s['tok_per_s']:.2f} | "
                     f"{s['speedup_vs_plain']:.2f}x | {s['decode_tok_per_s']:.2f} | {s['decode_speedup_vs_plain']:.2f}x | "
                     f"{s['steps_per_token']:.2f} | {s['accepted_draft_tokens']} / {s['drafted_tokens']} | "
                     f"{'yes' if s['identical'] else 'NO'} | {s['loadavg_1m']:.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rtts-ms", default="0,50", help="emulated RTTs between every pair of hosts (default 0,50)")
    p.add_argument("--modes", default="2,4,8,a8", help="prompt lookup draft lengths: K a constant K, aK adaptive "
                                                       "up to K (default 2,4,8,a8)")
    p.add_argument("--new-tokens", type=int, default=64, help="max new tokens per generation (default 64)")
    p.add_argument("--out", default="results/bench_speculative.json")
    p.add_argument("--client", metavar="PEER", help=argparse.SUPPRESS)  # internal: the client side
    args = p.parse_args()
    modes = parse_modes(args.modes)
    if args.client:
        client(args.client, args.new_tokens, modes)
        return 0
    started = time.time()
    rows = run([float(x) for x in args.rtts_ms.split(",")], args.new_tokens, modes)
    summary = summarize(rows)
    print(table(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"new_tokens": args.new_tokens, "modes": format_modes(modes), "model": "smollm2-135m",
                               "servers": "3 (blocks 0:10, 10:20, 20:30), client relays",
                               "wall_s": time.time() - started, "summary": summary, "runs": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
