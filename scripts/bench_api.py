"""Benchmark the OpenAI gateway: N concurrent requests vs 1, with the client head's cross-session
batching on and off, all measured in one run on one local swarm.

A swarm of one server holding all blocks (processes on 127.0.0.1) and a `petals-chain api`
process; requests are streaming completions sent by the official `openai` client from threads.
Both gateways (batching on: default; off: `--client-batch-rows 1`) run side by side and are
measured in interleaved rounds (medians reported): one request alone, then N at once: aggregate completion tokens/s
(all tokens / wall time from the first send
to the last byte), time to first token and inter-token latency percentiles (per streamed chunk).

The server writes a `--service-log` (one line per batch it ran): the report gives the mean number
of sessions per server batch in each phase, the measure of how well concurrent requests batch; the
gateway's /metrics give the same for its client head (sessions per LM head pass).

Prefix reuse (`--history-tokens 500`, 0 to skip): a chat's first turn with a history of that many
tokens, then its second turn (history + reply + a new question), streamed; time to first token of
the second turn over the first's (each round uses a new history, so every first turn misses).

Prints a table and writes results/bench_api.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from petals_chain.swarm.local import REPO_ROOT, LocalSwarm, stop_process

PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The history of the printing press begins",
    "Here is a recipe for a simple tomato soup:",
    "The main causes of the French Revolution were",
    "A lighthouse keeper wrote in his diary:",
    "In the year 2150, humanity",
    "The three laws of thermodynamics state",
    "My grandmother's garden was",
]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def start_gateway(swarm: LocalSwarm, extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "petals_chain.cli",
            "api",
            "--initial-peers",
            *swarm.initial_peers,
            "--port",
            "0",
            "--max-concurrent",
            "16",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=swarm.env,
        start_new_session=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "api ready at " in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep draining
            return proc, line.split("api ready at ")[1].split()[0]
    raise RuntimeError("gateway did not start:\n" + "".join(lines[-20:]))


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_request(client: OpenAI, model: str, prompt: str, max_tokens: int) -> dict:
    start_s = time.perf_counter()
    times, tokens = [], 0
    stream = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end_s = time.perf_counter()
    return {
        "start_s": start_s,
        "end_s": end_s,
        "tokens": tokens,
        "ttft_s": times[0] - start_s if times else float("nan"),
        "itl_s": [b - a for a, b in zip(times, times[1:])],
    }


def chat_ttft_s(client: OpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """Time to the first streamed content of a greedy chat request, and the reply's text."""
    start_s = time.perf_counter()
    first_s, text = None, ""
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            first_s = first_s or time.perf_counter()
            text += chunk.choices[0].delta.content
    return (first_s or time.perf_counter()) - start_s, text


def history_text(tokenizer, tokens: int, round_index: int) -> str:
    """A user message of about `tokens` tokens, different in every round (no cross-round hits)."""
    words = [f"item{round_index}-{i}" for i in range(tokens)]
    text = f"Round {round_index}. Here is a list to remember: "
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += " ".join(words[:16]) + ". "
        words = words[16:] or [f"more{round_index}-{len(text)}"]
    return text


def prefix_reuse(client: OpenAI, model: str, tokenizer, history_tokens: int, rounds: int) -> dict:
    firsts, seconds = [], []
    for r in range(rounds):
        messages = [{"role": "user", "content": history_text(tokenizer, history_tokens, r)}]
        ttft1, reply = chat_ttft_s(client, model, messages, 16)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the first item?"}]
        ttft2, _ = chat_ttft_s(client, model, messages, 16)
        firsts.append(ttft1)
        seconds.append(ttft2)
    prompt_tokens = len(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    return {
        "history_tokens": history_tokens,
        "second_turn_prompt_tokens": prompt_tokens,
        "first_turn_ttft_s": firsts,
        "second_turn_ttft_s": seconds,
        "ratio": statistics.median(seconds) / statistics.median(firsts),
    }


def batch_sizes(log_path: Path, since_line: int) -> tuple[float, int]:
    """Mean sessions per server batch in the service log from `since_line` on, and the line count."""
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    sizes = [len(json.loads(line)["items"]) for line in lines[since_line:]]
    return (statistics.mean(sizes) if sizes else float("nan")), len(lines)


def head_counters(url: str) -> tuple[float, float]:
    """The gateway's client head LM calls and the batches they ran in, from its /metrics."""
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    values = {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples}
    return (
        values.get("petals_chain:client_head_lm_calls_total", 0.0),
        values.get("petals_chain:client_head_lm_batches_total", 0.0),
    )


def run_concurrent(client: OpenAI, model: str, n: int, max_tokens: int) -> dict:
    results: list[dict] = [None] * n  # type: ignore[list-item]
    errors: list[BaseException] = []

    def work(i):
        try:
            results[i] = one_request(client, model, PROMPTS[i % len(PROMPTS)], max_tokens)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    wall_s = max(r["end_s"] for r in results) - min(r["start_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl_s"]]
    ttft = [r["ttft_s"] for r in results]
    return {
        "requests": n,
        "tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "itl_p50_s": percentile(itl, 50),
        "itl_p95_s": percentile(itl, 95),
        "itl_p99_s": percentile(itl, 99),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=8, help="concurrent requests (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="completion tokens per request (default 32)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians are reported (default 2)")
    p.add_argument("--no-baseline", action="store_true", help="skip the gateway without client head batching")
    p.add_argument(
        "--history-tokens",
        type=int,
        default=500,
        help="chat history for the prefix-reuse measurement (0: skip it; default 500)",
    )
    p.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_api.json")
    args = p.parse_args()

    from petals_chain.models.checkpoint import load_config, resolve_model_path

    num_blocks = load_config(resolve_model_path(args.model)).num_hidden_layers
    variants = [("batched", [])] + ([] if args.no_baseline else [("unbatched", ["--client-batch-rows", "1"])])
    report: dict = {
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "swarm": f"1 server, blocks [0, {num_blocks})",
        "cpu_count": os.cpu_count(),
    }
    runs: dict[str, dict[str, list[dict]]] = {name: {"one": [], "many": []} for name, _ in variants}
    service_log = args.out.parent / "bench_api_service.jsonl"
    service_log.parent.mkdir(parents=True, exist_ok=True)
    service_log.unlink(missing_ok=True)
    with LocalSwarm(args.model, [(0, num_blocks)], server_args=["--service-log", str(service_log)]) as swarm:
        gateways = []
        try:
            for name, extra in variants:
                proc, url = start_gateway(swarm, extra)
                gateways.append((name, proc, OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600), url))
            for _, _, client, _ in gateways:
                one_request(client, args.model, "Warm up:", 4)  # load paths, open the first chain
            # Variants interleave, round after round, so that load from elsewhere on the machine
            # hits them alike; each number reported is the median over rounds.
            server_pid = swarm.servers[0].process.pid
            for _ in range(args.rounds):
                for key, n in (("one", 1), ("many", args.requests)):
                    for name, proc, client, url in gateways:
                        before = (cpu_s(proc.pid), cpu_s(server_pid), time.process_time())
                        _, log_start = batch_sizes(service_log, 0)
                        head_before = head_counters(url)
                        r = run_concurrent(client, args.model, n, args.max_tokens)
                        r["sessions_per_server_batch"], _ = batch_sizes(service_log, log_start)
                        head_after = head_counters(url)
                        # the gateway's side of the same: sessions per batched LM head run
                        r["sessions_per_client_head_batch"] = (head_after[0] - head_before[0]) / max(
                            1.0, head_after[1] - head_before[1]
                        )
                        # where the CPU went, per completion token: gateway (client head, sessions,
                        # HTTP), the block server, and this benchmark's own openai clients
                        r["gateway_cpu_ms_per_token"] = 1000 * (cpu_s(proc.pid) - before[0]) / r["tokens"]
                        r["server_cpu_ms_per_token"] = 1000 * (cpu_s(server_pid) - before[1]) / r["tokens"]
                        r["bench_client_cpu_ms_per_token"] = 1000 * (time.process_time() - before[2]) / r["tokens"]
                        runs[name][key].append(r)
            if args.history_tokens > 0:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
                report["prefix_reuse"] = prefix_reuse(
                    gateways[0][2], args.model, tokenizer, args.history_tokens, args.rounds
                )
        finally:
            for _, proc, _, _ in gateways:
                stop_process(proc)
    for name, _ in variants:
        single = {k: statistics.median(r[k] for r in runs[name]["one"]) for k in runs[name]["one"][0]}
        many = {k: statistics.median(r[k] for r in runs[name]["many"]) for k in runs[name]["many"][0]}
        report[name] = {
            "one": single,
            "many": many,
            "ratio": many["tokens_per_s"] / single["tokens_per_s"],
            "rounds": runs[name],
        }
    if "unbatched" in report:
        report["batched_over_unbatched_many"] = (
            report["batched"]["many"]["tokens_per_s"] / report["unbatched"]["many"]["tokens_per_s"]
        )
    print(
        f"{'gateway':10} {'reqs':>4} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8} "
        f"{'ITL p99':>8}  CPU ms/token: gateway server bench"
    )
    for name, _ in variants:
        for key in ("one", "many"):
            r = report[name][key]
            print(
                f"{name:10} {int(r['requests']):>4} {r['tokens_per_s']:>7.2f} {r['ttft_p50_s']:>8.3f}s "
                f"{r['ttft_p95_s']:>8.3f}s "
                f"{r['itl_p50_s'] * 1000:>6.0f}ms {r['itl_p95_s'] * 1000:>6.0f}ms {r['itl_p99_s'] * 1000:>6.0f}ms  "
                f"{r['gateway_cpu_ms_per_token']:>18.1f} {r['server_cpu_ms_per_token']:>6.1f} "
                f"{r['bench_client_cpu_ms_per_token']:>5.1f}  sessions/server batch "
                f"{r['sessions_per_server_batch']:.2f}, per LM head batch {r['sessions_per_client_head_batch']:.2f}"
            )
        print(f"{name:10} aggregate {args.requests} requests / 1 request: {report[name]['ratio']:.2f}x")
    if "batched_over_unbatched_many" in report:
        print(f"client head batching, {args.requests} requests: {report['batched_over_unbatched_many']:.2f}x unbatched")
    if "prefix_reuse" in report:
        pr = report["prefix_reuse"]
        print(
            f"prefix reuse, {pr['history_tokens']}-token history ({pr['second_turn_prompt_tokens']} prompt tokens "
            f"in turn 2): TTFT turn 1 {statistics.median(pr['first_turn_ttft_s']):.3f}s, turn 2 "
            f"{statistics.median(pr['second_turn_ttft_s']):.3f}s, ratio {pr['ratio']:.2f}"
        )
    report["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    print(f"load average (1/5/15 min): {' '.join(report['loadavg'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
