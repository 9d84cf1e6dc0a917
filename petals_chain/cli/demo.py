"""`petals-chain demo`: a private swarm on 127.0.0.1 run by the online orchestrator: a DHT peer,
`petals-chain orchestrator`, and block servers with different memory budgets started with
`--blocks auto`. The orchestrator plans their placement (GBP-CR + GCA by default), the demo
streams one chat answer, then runs N concurrent sessions dispatched by JFFC and prints each
session's queue wait and service time; then it shuts everything down (also on Ctrl-C)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request

from petals_chain.cli.args import (
    CliParser,
    non_negative_int,
    one_line,
    parse_size,
    positive_int,
)

DEFAULT_BUDGETS = "300MiB,340MiB,380MiB,420MiB"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The sun is a", "In 1492, Columbus",
           "Water boils at", "My favourite colour is", "A haiku about rain:", "The best way to learn is",
           "Photosynthesis is", "The three primary colors are", "A good cup of coffee"]


def get_policy_names() -> tuple[str, ...]:
    from orchestrator.policies import (
        POLICY_NAMES,  # the registry (planner, simulator, service read it too)
    )
    return POLICY_NAMES


def parse_budgets(text: str) -> list[str]:
    """'300MiB,340MiB' -> ['300MiB', '340MiB'], each checked as a size (the servers get them as written)."""
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    if not budgets:
        raise argparse.ArgumentTypeError(f"no budget in {text!r}: use e.g. {DEFAULT_BUDGETS}")
    for b in budgets:
        parse_size(b)
    return budgets


def check_budgets(path, budgets_bytes: list[int], max_length_tokens: int) -> None:
    """Refuse budgets that cannot serve the model, before any process starts: each server must hold
    at least one block with one session's KV, and together they must hold every block with one
    session each (a necessary condition; the orchestrator's plan may still need more for c > 1)."""
    from petals_chain.errors import InvalidRequestError
    from petals_chain.runtime.block_range import BlockRange

    probe = BlockRange(path, 0, 1, model_path=path)  # sizes of one block, as a server measures them
    s_m, s_c = probe.block_bytes, probe.kv_bytes_per_block(max_length_tokens)
    num_blocks = probe.family.num_blocks(probe.config)
    per_block = s_m + s_c
    mib = 2**20
    too_small = [b for b in budgets_bytes if b < per_block]
    if too_small:
        raise InvalidRequestError(
            f"--budgets: {too_small[0] / mib:.0f} MiB cannot hold one block ({s_m / mib:.1f} MiB) with one session's "
            f"KV at --max-length {max_length_tokens} ({s_c / mib:.2f} MiB); give every server at least "
            f"{per_block / mib:.0f} MiB, e.g. --budgets {DEFAULT_BUDGETS}")
    held = sum(b // per_block for b in budgets_bytes)
    if held < num_blocks:
        raise InvalidRequestError(
            f"--budgets: together the servers hold {held} of the model's {num_blocks} blocks (each block "
            f"{per_block / mib:.1f} MiB with one session's KV); add servers or memory, e.g. "
            f"--budgets {DEFAULT_BUDGETS}")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def main(argv: list[str]) -> int:
    p = CliParser(prog="petals-chain demo", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint folder")
    p.add_argument("--budgets", type=parse_budgets, default=parse_budgets(DEFAULT_BUDGETS),
                   help=f"comma-separated memory budgets, one server each (default {DEFAULT_BUDGETS})")
    p.add_argument("--servers", type=positive_int, default=None,
                   help="number of servers (budgets cycle through --budgets; default: one per budget)")
    p.add_argument("--policy", default="proposed", choices=get_policy_names(),
                   help="the orchestrator's placement and dispatch policy (default proposed: GBP-CR + GCA + JFFC)")
    p.add_argument("--c", default="3", help="cache reservation c for the proposed policy: auto or N (default 3)")
    p.add_argument("--sessions", type=non_negative_int, default=8,
                   help="concurrent sessions after the chat (default 8)")
    p.add_argument("--session-tokens", type=positive_int, default=12, help="tokens each concurrent session generates")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.", help="the chat's message")
    p.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens of the chat's answer (default 48)")
    p.add_argument("--max-length", type=positive_int, default=512, help="servers' --max-length (sets s_c)")
    p.add_argument("--keep-running", action="store_true", help="keep the swarm up (status page) until Ctrl-C")
    args = p.parse_args(argv)
    budgets = args.budgets
    if args.servers is not None:
        budgets = [budgets[i % len(budgets)] for i in range(args.servers)]

    def terminate(*_):
        # The sessions' threads would log every retry against the stopping swarm: quiet them first.
        logging.disable(logging.CRITICAL)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    from transformers import AutoTokenizer, TextStreamer

    from petals_chain.cli.generate import encode_prompt
    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.errors import PetalsChainError
    from petals_chain.models.checkpoint import cache_dir, resolve_model_path
    from petals_chain.swarm.local import LocalSwarm, SwarmStartError

    path = resolve_model_path(args.model)  # convert once here, not in every server
    check_budgets(path, [parse_size(b) for b in budgets], args.max_length)  # before any process starts
    orch_args = ["--expected-servers", str(len(budgets)), "--policy", args.policy, "--c", args.c, "--arrival-rate", "2"]
    print(f"starting a local swarm on 127.0.0.1: DHT peer + orchestrator ({args.policy}) + {len(budgets)} servers "
          f"with --blocks auto and budgets {', '.join(budgets)} ...", flush=True)
    model = None
    try:
        with LocalSwarm(args.model, [None] * len(budgets),
                        server_args=["--num-threads", "1", "--max-length", str(args.max_length)],
                        per_server_args=[["--memory-budget", b] for b in budgets],
                        orchestrator_args=orch_args) as swarm:
            deadline = time.monotonic() + 60
            while not (status := _get(swarm.orchestrator_url + "status"))["plan_installed"]:
                if time.monotonic() > deadline:
                    raise RuntimeError("the orchestrator's plan did not come online within 60 s")
                time.sleep(0.3)
            names = {s["peer_id"]: s["name"] for s in status["servers"]}
            print(f"\norchestrator {swarm.orchestrator_peer_id[-8:]}: plan v{status['plan_version']}, "
                  f"policy {status['policy']}, c = {status['c']}   (status page: {swarm.orchestrator_url})")
            print("placement (what each server loaded):")
            for s in status["servers"]:
                blocks = f"[{s['start']:2d}, {s['end']:2d})" if s["end"] > s["start"] else "unused  "
                print(f"  {s['name']:8s} budget {s['memory'] / 2**20:5.0f} MiB  blocks {blocks}  "
                      f"tau_c {s['tau_c'] * 1e3:6.1f} ms  tau_p {s['tau_p'] * 1e3:6.2f} ms/block")
            print(f"  (tau_p from each server's t_I/t_O: measured at its start, or read from "
                  f"{cache_dir() / 'throughput.json'} if measured before; delete that file to measure again)")
            print("chains:" if args.policy in ("proposed", "jffc-only")
                  else "chains (per-request routes, made on demand):")
            for k in status["chains"]:
                print(f"  {' -> '.join(names.get(p, p[-8:]) for p in k['servers'])}  blocks {k['blocks']}  "
                      f"capacity {k['capacity']}  T = {k['service_time']:.2f} s")

            model = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=swarm.initial_peers)
            tokenizer = AutoTokenizer.from_pretrained(path)
            ids = encode_prompt(tokenizer, args.prompt, chat=True)
            print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            start_s = time.perf_counter()
            with model.inference_session(max_length=ids.shape[1] + args.max_new_tokens) as session:
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, streamer=streamer,
                                     eos_token_id=tokenizer.eos_token_id)
                chain = session.chain.describe()
            elapsed_s = time.perf_counter() - start_s
            new_tokens = out.shape[1] - ids.shape[1]
            print(f"\nchain: {chain}\n{new_tokens} tokens in {elapsed_s:.2f} s: {new_tokens / elapsed_s:.1f} tokens/s")

            if args.sessions:
                from orchestrator.policies import get_policy
                routed = get_policy(args.policy).per_request
                capacity = ("routes chosen per request" if routed else
                            f"total capacity {sum(k['capacity'] for k in status['chains'])}")
                print(f"\n{args.sessions} concurrent sessions, {args.session_tokens} tokens each ({capacity}):",
                      flush=True)
                rows: dict[int, tuple] = {}
                errors: list[str] = []

                def run(i: int):
                    try:
                        m = DistributedModelForCausalLM(model.config, model.head, model.backend)
                        prompt = tokenizer(PROMPTS[i % len(PROMPTS)], return_tensors="pt").input_ids
                        t0 = time.perf_counter()
                        with m.inference_session(max_length=prompt.shape[1] + args.session_tokens) as s:
                            t1 = time.perf_counter()
                            o = m.generate(prompt, max_new_tokens=args.session_tokens, do_sample=False)
                            t2 = time.perf_counter()
                            grant = getattr(s.chain, "grant", None)  # the orchestrator's, on the session
                            rows[i] = (t1 - t0, grant.wait_s if grant else float("nan"), t2 - t1, s.chain.describe(),
                                       tokenizer.decode(o[0, prompt.shape[1]:], skip_special_tokens=True))
                    except PetalsChainError as e:
                        errors.append(f"session {i}: {e}")

                threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(args.sessions)]
                for t in threads:
                    t.start()
                    time.sleep(0.05)
                for t in threads:
                    t.join()
                print(f"  {'#':>2}  {'wait (client)':>13}  {'queue wait (orch.)':>18}  {'service':>8}  chain")
                for i in sorted(rows):
                    w_client, w_orch, service, chain, text = rows[i]
                    print(f"  {i:2d}  {w_client:11.2f} s  {w_orch:16.2f} s  {service:6.2f} s  {chain}   "
                          f"{text.strip()[:40]!r}")
                for e in errors:
                    print("  " + e)
                st = _get(swarm.orchestrator_url + "status")
                print(f"orchestrator: {st['metrics']['admitted']} sessions admitted, "
                      f"queue length {st['queue_length']}, "
                      f"expected lengths now in={st['expected_lengths']['input_tokens']:.1f} "
                      f"out={st['expected_lengths']['output_tokens']:.1f} tokens")
            if args.keep_running:
                print(f"\nswarm running; status page {swarm.orchestrator_url} - Ctrl-C stops it", flush=True)
                while True:
                    time.sleep(1)
            model.backend.shutdown()
            model = None
            print("shutting the swarm down ...", flush=True)
    except KeyboardInterrupt:
        # The swarm is stopped (LocalSwarm's exit ran). Leave now: the concurrent sessions' threads
        # would otherwise go on asking a dead orchestrator for minutes, and stopping their event
        # loops under them prints tracebacks. Our DHT child and its p2pd follow us (ParentBoundDHT).
        print("\ninterrupted: swarm stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    except SwarmStartError as e:
        print(f"petals-chain demo: {e.reason}", file=sys.stderr)
        return 1
    except (PetalsChainError, RuntimeError) as e:
        print(f"petals-chain demo: {one_line(e)}", file=sys.stderr)
        return 1
    finally:
        if model is not None:
            model.backend.shutdown()
    print("done: all processes stopped")
    return 0
