"""Benchmark one server's batched step: what a step of S sessions x T tokens costs against a step of
1 session x 1 token, measured in the same run.

A block range of SmolLM2-135M (all 30 blocks by default) runs `BlockRange.forward` on sessions whose
caches hold `--ctx` tokens; each repetition rolls the sessions back so every step sees the same
context. Single torch thread by default (a server shares a small CPU), so the step's CPU time is
this thread's (`time.thread_time`): on a shared, loaded machine it moves far less than wall time
does, and both are reported. Shapes measured: S sessions x
1 token (concurrent decode, issue 23) and 1 session x T tokens (speculative verification of T - 1
drafts, issue 22). Repetitions of all shapes are interleaved (round-robin) so that a load change on a
shared machine hits every shape alike; the median per shape is reported, with the load average.

Prints a table and writes results/bench_step.json (keys: `model`, `blocks`, `ctx_tokens`, `threads`,
`reps`, `loadavg_before`, `loadavg_after`, `base_ms`, `base_cpu_ms`, `shapes[]`: `sessions`, `tokens`,
`median_ms`, `ratio_vs_base`, `median_cpu_ms`, `cpu_ratio_vs_base`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from petals_chain.models.checkpoint import resolve_model_path
from petals_chain.runtime.block_range import BlockRange, StepInput

REPO = Path(__file__).resolve().parents[1]


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--blocks", default="0:30", help="START:END of the block range")
    ap.add_argument("--ctx", type=int, default=300, help="tokens already in each session's cache")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9, help="repetitions per shape (median reported)")
    ap.add_argument("--sessions", default="1,2,4,8", help="session counts of the 1-token shapes")
    ap.add_argument("--tokens", default="2,3,5,9", help="token counts of the 1-session shapes")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start, end = (int(x) for x in args.blocks.split(":"))
    br = BlockRange(resolve_model_path(args.model), start, end)
    gen = torch.Generator().manual_seed(0)
    shapes = (
        [(1, 1)]
        + [(int(s), 1) for s in args.sessions.split(",") if int(s) != 1]
        + [(1, int(t)) for t in args.tokens.split(",") if int(t) != 1]
    )
    max_sessions = max(s for s, _ in shapes)
    max_tokens = max(t for _, t in shapes)
    kvs = [br.allocate_kv(args.ctx + max_tokens) for _ in range(max_sessions)]
    for kv in kvs:
        br.forward([StepInput(kv, torch.randn(args.ctx, br.hidden_size, generator=gen))])
    inputs = {
        shape: [torch.randn(shape[1], br.hidden_size, generator=gen) for _ in range(shape[0])] for shape in shapes
    }

    def step(shape) -> tuple[float, float]:
        steps = [StepInput(kv, h) for kv, h in zip(kvs, inputs[shape])]
        t0, c0 = time.perf_counter(), time.thread_time()
        br.forward(steps)
        elapsed_s, cpu_s = time.perf_counter() - t0, time.thread_time() - c0
        for s in steps:
            s.kv.past_tokens -= shape[1]  # roll back: every repetition sees `ctx` cached tokens
        return elapsed_s, cpu_s

    for shape in shapes:  # warm-up: first calls allocate and pick kernels
        step(shape)
    load_before = loadavg()
    times_s: dict = {shape: [] for shape in shapes}
    for _ in range(args.reps):
        for shape in shapes:
            times_s[shape].append(step(shape))
    load_after = loadavg()

    def median_ms(shape, which: int) -> float:
        values = sorted(t[which] for t in times_s[shape])
        return values[len(values) // 2] * 1000

    wall_ms = {shape: median_ms(shape, 0) for shape in shapes}
    cpu_ms = {shape: median_ms(shape, 1) for shape in shapes}
    base_ms, base_cpu_ms = wall_ms[(1, 1)], cpu_ms[(1, 1)]
    rows = [
        {
            "sessions": s,
            "tokens": t,
            "median_ms": round(wall_ms[(s, t)], 2),
            "ratio_vs_base": round(wall_ms[(s, t)] / base_ms, 3),
            "median_cpu_ms": round(cpu_ms[(s, t)], 2),
            "cpu_ratio_vs_base": round(cpu_ms[(s, t)] / base_cpu_ms, 3),
        }
        for s, t in shapes
    ]
    print(
        f"blocks {start}:{end}, ctx {args.ctx}, {args.threads} thread(s), {args.reps} reps, "
        f"load {load_before} -> {load_after}"
    )
    print(
        "| sessions | tokens | wall ms | x (1 sess, 1 tok) | CPU ms | x (1 sess, 1 tok) "
        "|\n|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['sessions']} | {r['tokens']} | {r['median_ms']:.1f} | {r['ratio_vs_base']:.2f} "
            f"| {r['median_cpu_ms']:.1f} | {r['cpu_ratio_vs_base']:.2f} |"
        )
    result = {
        "model": args.model,
        "blocks": args.blocks,
        "ctx_tokens": args.ctx,
        "threads": args.threads,
        "reps": args.reps,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "base_ms": round(base_ms, 2),
        "base_cpu_ms": round(base_cpu_ms, 2),
        "shapes": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
