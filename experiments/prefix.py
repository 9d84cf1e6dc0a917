"""`petals-chain experiment prefix`: prompt-aware dispatch side by side on a live swarm.

One swarm per policy (`--policies`, default jffc,e2,d2lpm), all started first and alive for the whole run:
a DHT, `petals-chain orchestrator --policy jffc-only --dispatch P --prefix-sharing swarm` and `--servers`
SmolLM2-135M servers (each holds the whole model: `--servers` chains of one hop). Each server's memory
budget is sized so that its chain takes `--sessions-per-server` sessions at once (the orchestrator's
capacity c_k: beyond it sessions wait in the orchestrator's central queue, where the policies differ
too) next to a prefix cache of `--cache-tokens` tokens (`--prefix-cache-min` = `--prefix-cache-max`:
sessions never take it, so the cache's size is the same under every load).

The workload (`--workload`), one of the simulator's shared-prompt workloads scaled down:
- `tooluse` (default): one shared system prompt, one of `--segments` tool descriptions drawn with
  Zipf-`--zipf` popularity (default 1.1), a short question;
- `longdoc`: long-document QA: one of `--segments` documents, drawn uniformly (`--zipf` 0), a short question;
- `unique`: the control, prompts that share nothing but a 6-token instruction: every request its own
  text of `--segment-words` words (`--segments` only sizes the caches, as for the others), so a
  prompt-aware policy has nothing to win and shows what it costs.
`--output-tokens` greedy tokens; from `--clients` clients (one model object, one peer id each; the
first sends `--flood-weight` times the others' requests). Arrivals: the first `--requests` of the Azure
code trace, rescaled so that they arrive at `--rate` requests per second on average (burstiness kept).
A request is one session of `generate` (the client sends its prompt's prefix hashes in `Acquire`); its
response time runs from its arrival to its last token. By default each server's prefix cache holds
1/`--servers` of the working set (the shared head and ceil(segments / servers) segments): the swarm's
caches together hold every segment, one server's does not (the regime where where a prompt goes matters).

Every policy gets the same requests in the same order. So that a change of this machine's load
cannot favour one policy (a run takes many minutes, and other work shares the cores), the policies
alternate: the requests are cut into blocks (at most `--block` requests arriving within `--block-span`
seconds); in round j each policy in turn replays block j
at the trace's times (the block's first request at once), waits for all of it to finish, and hands
over; the policies' order rotates by one every round. A swarm idles while the others replay, keeping
its caches and its orchestrator's state.

Writes --out/summary.json: per policy mean / p95 response, where the time went (client queue,
orchestrator queue, session), prefill tokens computed vs reused (the chains' `prefix_tokens`) and the
hit rate, chains used, per-client service (prompt + 2 x output tokens of its finished requests) and
Jain's index over it, failures, the orchestrator's prefix status, and `--check` outputs (spread over
the run, hits and misses) compared with HF greedy; the ratios against jffc and the issue's goal;
records_<policy>.jsonl: every request. Runs on localhost processes (no emulated WAN or CPU shares:
the servers share this machine's cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np

POLICIES = ("jffc", "e2", "d2lpm", "rr-lpm", "vtc-rr")
WORDS = (
    "library book borrow open hours event reading room quiet cafe floor child club member card return late "
    "fee renew shelf map archive study group printer scan wifi desk staff ask help rule guest parking"
).split()
MODEL = "smollm2-135m"


def build_parser() -> argparse.ArgumentParser:
    from petals_chain.cli.args import CliParser, non_negative_float, non_negative_int, positive_float, positive_int

    p = CliParser(
        prog="petals-chain experiment prefix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--policies", default="jffc,e2,d2lpm")
    p.add_argument("--requests", type=positive_int, default=300, help="requests per policy (the same for each)")
    p.add_argument("--rate", type=positive_float, default=1.0, help="mean arrivals per second of the chosen requests")
    p.add_argument("--block", type=positive_int, default=35, help="requests a policy replays before the next one")
    p.add_argument(
        "--block-span", type=positive_float, default=30.0, help="... arriving within at most this many seconds"
    )
    p.add_argument("--servers", type=positive_int, default=3, help="servers = chains per policy")
    p.add_argument("--sessions-per-server", type=positive_int, default=4, help="each chain's capacity c_k")
    p.add_argument("--clients", type=positive_int, default=3)
    p.add_argument(
        "--flood-weight",
        type=positive_float,
        default=1.0,
        help="the first client sends this many times the others' requests; != 1: summary.json reports the "
        "others' response times apart (`well_behaved`, and its p95 against jffc's)",
    )
    p.add_argument(
        "--chain-quantum-sessions",
        type=positive_float,
        default=None,
        help="d2lpm's Q^w, passed to the orchestrators (default: theirs)",
    )
    p.add_argument(
        "--fair-skips",
        type=non_negative_int,
        default=None,
        help="d2lpm's fair_skips, passed to the orchestrators (default: theirs; 0: the DLPM paper's order)",
    )
    p.add_argument("--workload", choices=("tooluse", "longdoc", "unique"), default="tooluse")
    p.add_argument("--segments", type=positive_int, default=12, help="tool descriptions or documents")
    p.add_argument(
        "--zipf",
        type=non_negative_float,
        default=None,
        help="segment popularity (Zipf exponent; default 1.1 tooluse, 0 longdoc)",
    )
    p.add_argument("--system-words", type=positive_int, default=40, help="tooluse: the shared system prompt")
    p.add_argument("--segment-words", type=positive_int, default=240, help="words of a tool description or document")
    p.add_argument("--output-tokens", type=positive_int, default=4)
    p.add_argument(
        "--cache-tokens",
        type=positive_int,
        default=None,
        help="each server's prefix cache, in tokens of KV (default: 1/--servers of the working set)",
    )
    p.add_argument("--check", type=int, default=6, help="outputs compared with HF greedy, per policy")
    p.add_argument("--concurrency", type=positive_int, default=48, help="requests in flight at most (threads)")
    p.add_argument("--step-timeout", type=positive_float, default=120.0, help="the clients' step timeout, s")
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


def default_zipf(workload_name: str) -> float:
    """`--zipf`'s default: tool popularity is Zipf-1.1 (Preble's tool-use workload), documents uniform."""
    return 1.1 if workload_name == "tooluse" else 0.0


def segment_arrivals(trace_arrival_s: np.ndarray, n: int, rate_per_s: float) -> np.ndarray:
    """The first n arrivals, rescaled in time so that they come at `rate_per_s` on average over their own
    span (the trace's overall mean rate would not do: its first requests are sparser than the rest)."""
    a = np.asarray(trace_arrival_s[:n], dtype=float)
    a = a - a[0]
    if n < 2 or a[-1] <= 0:
        return np.arange(n) / rate_per_s
    return a * ((n - 1) / rate_per_s / a[-1])


def workload(args, tokenizer, trace_arrival_s: np.ndarray) -> tuple[list[dict], int, int]:
    """The requests; the shared head's length in tokens (what every request shares) and the longest
    segment's (a tool description or document)."""
    rng = np.random.default_rng(args.seed)
    if args.workload == "tooluse":
        head = "You answer questions about the library. " + _text(rng, args.system_words) + "\n"
        segments = [f"Tool {t}: " + _text(rng, args.segment_words) + "\n" for t in range(args.segments)]
    elif args.workload == "longdoc":
        head = "Answer from the document.\n"
        segments = [f"Document {t}: " + _text(rng, args.segment_words) + "\n" for t in range(args.segments)]
    else:  # unique: one text per request, so nothing past the head is shared
        head = "Answer from the text.\n"
        segments = [f"Text {t}: " + _text(rng, args.segment_words) + "\n" for t in range(args.requests)]
    w = 1.0 / np.arange(1, args.segments + 1) ** args.zipf
    arrivals = segment_arrivals(trace_arrival_s, args.requests, args.rate)
    weights = np.array([args.flood_weight] + [1.0] * (args.clients - 1))
    out = []
    for i, t in enumerate(arrivals):
        seg = i if args.workload == "unique" else int(rng.choice(args.segments, p=w / w.sum()))
        text = head + segments[seg] + f"Question {i}: " + _text(rng, 6) + "?\nAnswer:"
        out.append(
            {
                "i": i,
                "arrival_s": float(t),
                "client": int(rng.choice(args.clients, p=weights / weights.sum())),
                "tool": seg,
                "ids": tokenizer(text, return_tensors="pt").input_ids,
            }
        )
    head_tokens = len(tokenizer(head)["input_ids"])
    seg_tokens = max(len(tokenizer(head + x)["input_ids"]) for x in segments) - head_tokens
    return out, head_tokens, seg_tokens


def blocks_of(arrival_s: list[float], block: int, span_s: float) -> list[range]:
    """Consecutive requests, at most `block` of them arriving within at most `span_s` of the block's first."""
    out, start = [], 0
    for i in range(1, len(arrival_s) + 1):
        if i == len(arrival_s) or i - start >= block or arrival_s[i] - arrival_s[start] > span_s:
            out.append(range(start, i))
            start = i
    return out


def rounds(blocks: list[range], policies: list[str]) -> list[tuple[int, str, range]]:
    """(round, policy, request indices) in replay order: block j for every policy, the order rotated by j."""
    out = []
    for j, idx in enumerate(blocks):
        order = policies[j % len(policies) :] + policies[: j % len(policies)]
        out += [(j, p, idx) for p in order]
    return out


def server_sizes(hf_model, session_tokens: int, sessions: int, cache_tokens: int) -> dict:
    """A whole-model server (fp32, as the servers run) that admits `sessions` sessions of up to
    `session_tokens` tokens next to a prefix cache of `cache_tokens` tokens set aside
    (`--prefix-cache-min` = `--prefix-cache-max`), and whose orchestrator plans exactly `sessions` for it.

    Why --max-length is not the session length: the planner counts a server's whole budget minus its
    weights as session room (it does not know the cache's set-aside room), floor((M - W) / s_c(max_length)),
    while the server admits sessions at their own length into M - W - cache. So the room for sessions is
    (sessions + 1/2) x session_tokens (exactly `sessions` fit, not one more), and --max-length is
    (that room + the cache) / (sessions + 1/2), which makes the planner's floor `sessions` too."""
    cfg = hf_model.config
    layer = hf_model.model.layers[0]
    blocks = cfg.num_hidden_layers
    block_bytes = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_token_bytes = 2 * kv_heads * head_dim * 4 * blocks
    room_tokens = int((sessions + 0.5) * session_tokens)
    max_length = int((room_tokens + cache_tokens) / (sessions + 0.5))
    return {
        "memory_budget_bytes": blocks * block_bytes + (room_tokens + cache_tokens) * kv_token_bytes,
        "cache_bytes": cache_tokens * kv_token_bytes,
        "kv_token_bytes": kv_token_bytes,
        "server_max_length": max_length,
        "session_room_tokens": room_tokens,
    }


class PolicySwarm:
    """One policy's swarm and its clients, alive for the whole run."""

    def __init__(self, policy: str, args, sizes: dict, workdir: Path, stack: ExitStack):
        from petals_chain.client.model import DistributedModelForCausalLM
        from petals_chain.swarm.local import LocalSwarm

        self.policy = policy
        server_args = [
            *("--num-threads", "1", "--max-length", str(sizes["server_max_length"]), "--prefix-sharing", "swarm"),
            *("--memory-budget", str(sizes["memory_budget_bytes"])),
            *("--prefix-cache-min", str(sizes["cache_bytes"]), "--prefix-cache-max", str(sizes["cache_bytes"])),
        ]
        orch = [
            *("--policy", "jffc-only", "--expected-servers", str(args.servers), "--dispatch", policy),
            *("--prefix-sharing", "swarm", "--lease-ttl", "60"),
        ]
        if args.chain_quantum_sessions is not None:
            orch += ["--chain-quantum-sessions", str(args.chain_quantum_sessions)]
        if args.fair_skips is not None:
            orch += ["--fair-skips", str(args.fair_skips)]
        self.swarm = stack.enter_context(
            LocalSwarm(MODEL, [None] * args.servers, server_args=server_args, orchestrator_args=orch)
        )
        deadline = time.monotonic() + 300
        while not get_json(self.swarm.orchestrator_url + "status").get("plan_installed"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{policy}: the orchestrator installed no plan within 300 s")
            time.sleep(1.0)  # polling the status page for the plan
        self.models = [
            DistributedModelForCausalLM.from_pretrained(
                MODEL,
                initial_peers=self.swarm.initial_peers,
                identity_path=str(workdir / f"{policy}-c{c}.key"),
                step_timeout_s=args.step_timeout,
                acquire_timeout_s=1800.0,
            )
            for c in range(args.clients)
        ]
        for m in self.models:
            stack.callback(m.backend.shutdown)
        self.records: list[dict] = []
        self.replay_s = 0.0

    def status(self) -> dict:
        return get_json(self.swarm.orchestrator_url + "status")

    def replay(self, requests: list[dict], args, round_no: int) -> None:
        """Requests at their arrival times relative to the first; returns when all have finished or failed."""
        lock = threading.Lock()
        gate = threading.Semaphore(args.concurrency)
        base = requests[0]["arrival_s"]

        def one(r: dict, due: float) -> None:
            model = self.models[r["client"]]
            ids = r["ids"]
            rec = {"i": r["i"], "round": round_no, "client": r["client"], "tool": r["tool"]}
            rec["prompt_tokens"] = int(ids.shape[1])
            start = time.perf_counter()
            rec["client_queue_s"] = start - due
            try:
                with model.inference_session(
                    max_length=ids.shape[1] + args.output_tokens + 1, prompt_ids=ids[0]
                ) as session:
                    rec["open_s"] = time.perf_counter() - start  # Acquire (the orchestrator's queue) and open
                    out = model.generate(ids, max_new_tokens=args.output_tokens, do_sample=False)
                    rec.update(
                        reused_tokens=int(session.chain.prefix_tokens),
                        chain=[h.peer_id[-6:] for h in session.chain.hops],
                        output=out[0, ids.shape[1] :].tolist(),
                    )
                done = time.perf_counter()
                rec["response_s"] = done - due
                rec["session_s"] = done - start - rec["open_s"]
            except Exception as e:  # counted, never hidden
                rec["error"] = f"{type(e).__name__}: {e}"
            finally:
                gate.release()
            with lock:
                self.records.append(rec)

        threads = []
        t0 = time.perf_counter()
        for r in requests:
            due = t0 + r["arrival_s"] - base
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # open-loop arrivals at the trace's (rescaled) times
            gate.acquire()
            th = threading.Thread(target=one, args=(r, due), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join(1800)
        self.replay_s += time.perf_counter() - t0


def jain(xs) -> float:
    x = np.asarray(xs, dtype=float)
    return float(x.sum() ** 2 / (len(x) * (x**2).sum())) if len(x) and (x**2).sum() else float("nan")


def _response_stats(rs: list[dict]) -> dict:
    resp = [r["response_s"] for r in rs]
    if not resp:
        return {"n": 0, "mean_s": float("nan"), "p95_s": float("nan")}
    return {"n": len(resp), "mean_s": float(np.mean(resp)), "p95_s": float(np.percentile(resp, 95))}


def summarize(records: list[dict], output_tokens: int, flooder: int | None = None) -> dict:
    """Per policy. `flooder`: the client that sends more than the others (`--flood-weight`), whose
    neighbours' response times are reported apart (`well_behaved`)."""
    ok = [r for r in records if "error" not in r]
    resp = np.array([r["response_s"] for r in ok]) if ok else np.array([np.nan])
    reused = sum(r["reused_tokens"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    service: dict[str, float] = {}
    chains: dict[str, int] = {}
    for r in ok:
        service[str(r["client"])] = service.get(str(r["client"]), 0.0) + r["prompt_tokens"] + 2.0 * output_tokens
        key = ">".join(r["chain"])
        chains[key] = chains.get(key, 0) + 1

    def mean(key: str) -> float:
        return float(np.mean([r[key] for r in ok])) if ok else float("nan")

    return {
        "requests": len(records),
        "finished": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r["error"] for r in records if "error" in r})[:5],
        "mean_response_s": float(resp.mean()),
        "p50_response_s": float(np.percentile(resp, 50)),
        "p95_response_s": float(np.percentile(resp, 95)),
        "mean_client_queue_s": mean("client_queue_s"),
        "mean_open_s": mean("open_s"),
        "mean_session_s": mean("session_s"),
        "prefill_tokens_reused": int(reused),
        "prefill_tokens_computed": int(prompt - reused),
        "hit_rate": reused / prompt if prompt else float("nan"),
        "requests_with_segment_reused": None,  # filled in by main (needs the shared head's length)
        "requests_per_chain": chains,
        "service_by_client": service,
        "jain_index": jain(list(service.values())),
        "response_by_client": {
            str(c): _response_stats([r for r in ok if r["client"] == c]) for c in sorted({r["client"] for r in ok})
        },
        "well_behaved": None if flooder is None else _response_stats([r for r in ok if r["client"] != flooder]),
    }


def check_sample(records: list[dict], n: int) -> list[dict]:
    """`n` finished requests spread evenly over the run (both hits and misses, early and late)."""
    ok = sorted((r for r in records if "error" not in r), key=lambda r: r["i"])
    if n <= 0 or not ok:
        return []
    picks = sorted({int(round(x)) for x in np.linspace(0, len(ok) - 1, min(n, len(ok)))})
    return [ok[k] for k in picks]


def goal(summary: dict) -> dict | None:
    """The issue's live goal: the best prefix-aware policy's mean response <= 0.6x jffc's with >= 2x its
    reused prefill tokens, every request finished, the HF sample equal."""
    pol = summary["policies"]
    base = pol.get("jffc")
    others = {p: s for p, s in pol.items() if p != "jffc"}
    if not base or not others:
        return None
    best = min(others, key=lambda p: others[p]["mean_response_s"])
    s = others[best]
    mean_ratio = s["mean_response_s"] / base["mean_response_s"]
    reuse_ratio = s["prefill_tokens_reused"] / base["prefill_tokens_reused"] if base["prefill_tokens_reused"] else None
    all_finished = all(x["failed"] == 0 for x in pol.values())
    hf_equal = all(c["equal_to_hf"] for x in pol.values() for c in x["hf_check"])
    return {
        "best_prefix_aware": best,
        "mean_response_ratio": mean_ratio,
        "reused_tokens_ratio": reuse_ratio,
        "every_request_finished": all_finished,
        "hf_sample_equal": hf_equal,
        "met": bool(mean_ratio <= 0.6 and reuse_ratio is not None and reuse_ratio >= 2.0 and all_finished and hf_equal),
    }


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies or len(set(policies)) != len(policies):
        print(
            f"petals-chain experiment prefix: --policies takes distinct names from {','.join(POLICIES)}, got "
            f"{args.policies!r}",
            file=sys.stderr,
        )
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.sim.traces import load_azure_trace
    from petals_chain.models.checkpoint import resolve_model_path

    path = resolve_model_path(MODEL, show_progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trace = load_azure_trace(args.data)
    if len(trace.arrival_s) < args.requests:
        print(f"--requests: the trace has {len(trace.arrival_s)} requests", file=sys.stderr)
        return 2
    if args.zipf is None:
        args.zipf = default_zipf(args.workload)
    requests, head_tokens, seg_tokens = workload(args, tokenizer, trace.arrival_s)
    lengths = [int(r["ids"].shape[1]) for r in requests]
    if args.cache_tokens is None:  # 1/K of the working set: the head and ceil(segments / servers) segments
        args.cache_tokens = head_tokens + -(-args.segments // args.servers) * seg_tokens
    session_tokens = max(lengths) + args.output_tokens + 1
    if (args.sessions_per_server + 1) * (min(lengths) + args.output_tokens + 1) <= (
        args.sessions_per_server + 0.5
    ) * session_tokens:
        print("the prompts' lengths differ too much for an exact per-server session count", file=sys.stderr)
        return 2
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sizes = server_sizes(hf, session_tokens, args.sessions_per_server, args.cache_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "command": "petals-chain experiment prefix " + " ".join(argv),
        "workload": {
            "name": args.workload,
            "requests_per_policy": args.requests,
            "mean_prompt_tokens": float(np.mean(lengths)),
            "shared_head_tokens": head_tokens,
            "segment_tokens": seg_tokens,
            "segments": args.requests if args.workload == "unique" else args.segments,
            "zipf": args.zipf,
            "segment_share": np.bincount([r["tool"] for r in requests], minlength=args.segments).tolist(),
            "arrival_span_s": requests[-1]["arrival_s"],
            "cache_tokens_per_server": args.cache_tokens,
            "segments_per_cache": (args.cache_tokens - head_tokens) / seg_tokens,
            **sizes,
        },
        "policies": {},
    }
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        swarms = {}
        for policy in policies:
            t = time.perf_counter()
            swarms[policy] = PolicySwarm(policy, args, sizes, Path(tmp), stack)
            print(f"{policy}: swarm up in {time.perf_counter() - t:.0f} s", flush=True)
        summary["chains"] = {p: s.status().get("chains") for p, s in swarms.items()}
        blocks = blocks_of([r["arrival_s"] for r in requests], args.block, args.block_span)
        summary["workload"]["blocks"] = len(blocks)
        for round_no, policy, idx in rounds(blocks, policies):
            sw = swarms[policy]
            t = time.perf_counter()
            sw.replay([requests[i] for i in idx], args, round_no)
            done = [r for r in sw.records if r["round"] == round_no]
            ok = [r for r in done if "error" not in r]
            print(
                f"round {round_no} {policy}: {len(ok)}/{len(done)} finished in {time.perf_counter() - t:.0f} s, "
                f"mean response {np.mean([r['response_s'] for r in ok]) if ok else float('nan'):.2f} s, "
                f"reused {sum(r['reused_tokens'] for r in ok)} / {sum(r['prompt_tokens'] for r in ok)} tokens",
                flush=True,
            )
        for policy, sw in swarms.items():
            s = summarize(sw.records, args.output_tokens, flooder=0 if args.flood_weight != 1.0 else None)
            s["requests_with_segment_reused"] = sum(
                1 for r in sw.records if "error" not in r and r["reused_tokens"] > head_tokens + 16
            )
            s["replay_s"] = sw.replay_s
            s["prefix_status"] = sw.status().get("prefix")
            summary["policies"][policy] = s
            (args.out / f"records_{policy}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in sorted(sw.records, key=lambda r: r["i"]))
            )
    for policy in policies:
        checked = []
        recs = [json.loads(x) for x in (args.out / f"records_{policy}.jsonl").read_text().splitlines()]
        for r in check_sample(recs, args.check):
            ids = requests[r["i"]]["ids"]
            ref = hf.generate(ids, max_new_tokens=args.output_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
            checked.append({"i": r["i"], "reused_tokens": r["reused_tokens"], "equal_to_hf": ref == r["output"]})
        summary["policies"][policy]["hf_check"] = checked
    base = summary["policies"].get("jffc")
    if base:
        reused = base["prefill_tokens_reused"]
        summary["vs_jffc"] = {
            p: {
                "mean_response": s["mean_response_s"] / base["mean_response_s"],
                "p95_response": s["p95_response_s"] / base["p95_response_s"],
                "reused_tokens": s["prefill_tokens_reused"] / reused if reused else None,
                **(
                    {"well_behaved_p95": s["well_behaved"]["p95_s"] / base["well_behaved"]["p95_s"]}
                    if s["well_behaved"] is not None
                    else {}
                ),
            }
            for p, s in summary["policies"].items()
        }
        summary["goal"] = goal(summary)
    summary["wall_s"] = time.perf_counter() - t_start
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    for p, s in summary["policies"].items():
        print(f"{p}: {json.dumps({k: v for k, v in s.items() if k != 'prefix_status'})}", flush=True)
    print(json.dumps({k: summary.get(k) for k in ("vs_jffc", "goal", "wall_s")}, indent=1))
    return 0
