"""`petals-chain experiment prefix`: prompt-aware dispatch side by side on a live swarm.

Per policy (`--policies`, default jffc,e2,d2lpm) a fresh swarm on this host: a DHT, `petals-chain
orchestrator --policy jffc-only --dispatch P --prefix-sharing swarm` and `--servers` SmolLM2-135M servers
(each holds the whole model: `--servers` chains) with prefix caches of `--prefix-cache` bytes
(`--prefix-sharing swarm`). The same requests for every policy: the simulator's tool-use workload scaled
down (one shared system prompt, one of `--tools` tool descriptions drawn with Zipf-1.1 popularity, a short
query; `--output-tokens` greedy tokens), from `--clients` clients (one model object, one peer id each; the
first sends `--flood-weight` times the others' requests), arriving at the Azure code trace's times rescaled
to `--rate` requests per second. Each request is one session of `generate` (the client sends its prompt's
prefix hashes in `Acquire`).

Writes --out/summary.json: per policy mean / p95 response, prefill tokens computed vs reused (the chains'
`prefix_tokens`), per-client service (prompt + 2 x output tokens of its finished requests) and Jain's index
over it, failures, and a sample of outputs (`--check`) compared with HF greedy; and the ratios against jffc.
Runs on localhost processes (no emulated WAN or CPU shares: the servers share this machine's cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

POLICIES = ("jffc", "e2", "d2lpm", "rr-lpm", "vtc-rr")
WORDS = (
    "library book borrow open hours event reading room quiet cafe floor child club member card return late "
    "fee renew shelf map archive study group printer scan wifi desk staff ask help rule guest parking"
).split()


def build_parser() -> argparse.ArgumentParser:
    from petals_chain.cli.args import CliParser

    p = CliParser(
        prog="petals-chain experiment prefix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--policies", default="jffc,e2,d2lpm")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=1.0, help="mean requests per second (the trace's times rescaled)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--flood-weight", type=float, default=1.0)
    p.add_argument("--tools", type=int, default=8)
    p.add_argument("--system-words", type=int, default=90)
    p.add_argument("--tool-words", type=int, default=90)
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--prefix-cache", default="8MiB", help="each server's --prefix-cache-max")
    p.add_argument("--check", type=int, default=5, help="outputs compared with HF greedy, per policy")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at most (threads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data", default=None, help="folder of the Azure trace (default: $PETALS_CHAIN_DATA, else ../shared/data)"
    )
    p.add_argument("--out", type=Path, default=Path("results/prefix_live"))
    return p


def get_json(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in rng.integers(len(WORDS), size=n))


def workload(args, tokenizer) -> list[dict]:
    from orchestrator.sim.traces import load_azure_trace

    rng = np.random.default_rng(args.seed)
    system = "You answer questions about the library. " + _text(rng, args.system_words) + "\n"
    tools = [f"Tool {t}: " + _text(rng, args.tool_words) + "\n" for t in range(args.tools)]
    w = 1.0 / np.arange(1, args.tools + 1) ** 1.1
    trace = load_azure_trace(args.data)
    arrivals = (trace.arrival_s * (trace.mean_rate_per_s / args.rate))[: args.requests]
    weights = np.array([args.flood_weight] + [1.0] * (args.clients - 1))
    out = []
    for i, t in enumerate(arrivals):
        tool = int(rng.choice(args.tools, p=w / w.sum()))
        text = system + tools[tool] + f"Question {i}: " + _text(rng, 6) + "?\nAnswer:"
        out.append(
            {
                "i": i,
                "arrival_s": float(t),
                "client": int(rng.choice(args.clients, p=weights / weights.sum())),
                "tool": tool,
                "ids": tokenizer(text, return_tensors="pt").input_ids,
            }
        )
    return out


def run_policy(policy: str, args, requests: list[dict], workdir: Path) -> dict:
    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.swarm.local import LocalSwarm

    server_args = [
        "--num-threads",
        "1",
        "--max-length",
        "1024",
        "--prefix-sharing",
        "swarm",
        "--prefix-cache-max",
        args.prefix_cache,
    ]
    orch = [
        "--policy",
        "jffc-only",
        "--expected-servers",
        str(args.servers),
        "--dispatch",
        policy,
        "--prefix-sharing",
        "swarm",
        "--lease-ttl",
        "30",
    ]
    records: list[dict] = []
    lock = threading.Lock()
    with LocalSwarm("smollm2-135m", [None] * args.servers, server_args=server_args, orchestrator_args=orch) as swarm:
        deadline = time.monotonic() + 300
        while not get_json(swarm.orchestrator_url + "status").get("plan_installed"):
            if time.monotonic() > deadline:
                raise TimeoutError("the orchestrator installed no plan within 300 s")
            time.sleep(1.0)  # polling the status page for the plan
        models = [
            DistributedModelForCausalLM.from_pretrained(
                "smollm2-135m", initial_peers=swarm.initial_peers, identity_path=str(workdir / f"{policy}-c{c}.key")
            )
            for c in range(args.clients)
        ]
        gate = threading.Semaphore(args.concurrency)

        def one(r: dict, t0: float) -> None:
            model = models[r["client"]]
            start = time.perf_counter()
            rec = {"i": r["i"], "client": r["client"], "tool": r["tool"], "prompt_tokens": int(r["ids"].shape[1])}
            try:
                with model.inference_session(
                    max_length=r["ids"].shape[1] + args.output_tokens + 1, prompt_ids=r["ids"][0]
                ) as session:
                    out = model.generate(r["ids"], max_new_tokens=args.output_tokens, do_sample=False)
                    rec.update(
                        reused_tokens=int(session.chain.prefix_tokens),
                        chain=[h.peer_id[-6:] for h in session.chain.hops],
                        output=out[0, r["ids"].shape[1] :].tolist(),
                    )
                rec["response_s"] = time.perf_counter() - (t0 + r["arrival_s"])
                rec["run_s"] = time.perf_counter() - start
            except Exception as e:  # counted, never hidden
                rec["error"] = f"{type(e).__name__}: {e}"
            finally:
                gate.release()
            with lock:
                records.append(rec)

        threads = []
        t0 = time.perf_counter()
        try:
            for r in requests:
                delay = t0 + r["arrival_s"] - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)  # open-loop arrivals at the trace's (rescaled) times
                gate.acquire()
                th = threading.Thread(target=one, args=(r, t0), daemon=True)
                th.start()
                threads.append(th)
            for th in threads:
                th.join(600)
            status = get_json(swarm.orchestrator_url + "status")
        finally:
            for m in models:
                m.backend.shutdown()
    return {
        "records": sorted(records, key=lambda x: x["i"]),
        "prefix_status": status.get("prefix"),
        "wall_s": time.perf_counter() - t0,
    }


def jain(xs) -> float:
    x = np.asarray(xs, dtype=float)
    return float(x.sum() ** 2 / (len(x) * (x**2).sum())) if len(x) and (x**2).sum() else float("nan")


def summarize(run: dict, output_tokens: int) -> dict:
    ok = [r for r in run["records"] if "error" not in r]
    resp = np.array([r["response_s"] for r in ok]) if ok else np.array([np.nan])
    reused = sum(r["reused_tokens"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    service: dict[str, float] = {}
    for r in ok:
        service[str(r["client"])] = service.get(str(r["client"]), 0.0) + r["prompt_tokens"] + 2.0 * output_tokens
    return {
        "requests": len(run["records"]),
        "finished": len(ok),
        "failed": len(run["records"]) - len(ok),
        "errors": sorted({r["error"] for r in run["records"] if "error" in r})[:5],
        "mean_response_s": float(resp.mean()),
        "p95_response_s": float(np.percentile(resp, 95)),
        "prefill_tokens_reused": int(reused),
        "prefill_tokens_computed": int(prompt - reused),
        "service_by_client": service,
        "jain_index": jain(list(service.values())),
        "prefix_status": run["prefix_status"],
        "wall_s": run["wall_s"],
    }


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies or args.requests < 1 or args.clients < 1 or args.servers < 1:
        print(
            f"petals-chain experiment prefix: --policies takes a subset of {','.join(POLICIES)}; --requests, "
            "--clients and --servers must be >= 1",
            file=sys.stderr,
        )
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from petals_chain.models.checkpoint import resolve_model_path

    path = resolve_model_path("smollm2-135m", show_progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    requests = workload(args, tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"command": "petals-chain experiment prefix " + " ".join(argv), "policies": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in policies:
            run = run_policy(policy, args, requests, Path(tmp))
            s = summarize(run, args.output_tokens)
            done = [r for r in run["records"] if "error" not in r][: args.check]
            checked = []
            for r in done:
                ids = requests[r["i"]]["ids"]
                ref = hf.generate(ids, max_new_tokens=args.output_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
                checked.append({"i": r["i"], "equal_to_hf": ref == r["output"]})
            s["hf_check"] = checked
            summary["policies"][policy] = s
            (args.out / f"records_{policy}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run["records"]))
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
            print(f"{policy}: {json.dumps({k: v for k, v in s.items() if k not in ('prefix_status',)})}", flush=True)
    base = summary["policies"].get("jffc")
    if base:
        summary["vs_jffc"] = {
            p: {
                "mean_response": s["mean_response_s"] / base["mean_response_s"],
                "reused_tokens": (
                    s["prefill_tokens_reused"] / base["prefill_tokens_reused"]
                    if base["prefill_tokens_reused"]
                    else None
                ),
            }
            for p, s in summary["policies"].items()
        }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary.get("vs_jffc", {}), indent=1))
    return 0
