"""Churn soak: clients generate continuously while servers are SIGKILLed and restarted at random.

    .venv/bin/python scripts/soak.py --minutes 30            # the long run
    .venv/bin/python scripts/soak.py --minutes 1 --model PATH # a short one (CI uses a tiny model)

A swarm with an orchestrator (servers started with `--blocks auto`, more of them than one chain
needs, so spares exist), `--clients` client processes' worth of model objects generating greedy
text from a fixed prompt set, and a killer that every ~`--kill-every` seconds SIGKILLs a random
server and starts a fresh one in its place; once, halfway, it SIGKILLs the orchestrator and starts
a new one. Every output is compared with local HF greedy output for the same prompt.

Counts: started, completed (identical to HF), failed (a typed error reached the caller after the
client's own failover/retries), lost (hung past `--hang-s`, wrong output, or an untyped error).
Ends with one JSON line: {"started", "completed", "failed", "lost", "kills", ...}; exit 1 if lost > 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from petals_chain.client.model import DistributedModelForCausalLM  # noqa: E402
from petals_chain.errors import PetalsChainError  # noqa: E402
from petals_chain.models.checkpoint import resolve_model_path  # noqa: E402
from petals_chain.swarm.local import LocalSwarm  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
    "The history of the printing press",
    "A haiku about rain:",
]


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = Counter()
        self.errors = Counter()
        self.examples: dict[str, str] = {}  # the first message of each error type, to say what it was

    def add(self, outcome: str, error: str | None = None, message: str = "") -> None:
        with self.lock:
            self.counts[outcome] += 1
            if error:
                self.errors[error] += 1
                if message and error not in self.examples:
                    self.examples[error] = message[:300]


def references(model: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[0].tolist() for p in prompts]


def tokenize(model: str, vocab_limit: int) -> list[list[int]]:
    """Prompt token ids: the model's tokenizer when it has one, else fixed ids (a test model)."""
    path = resolve_model_path(model)
    if (Path(path) / "tokenizer.json").exists() or (Path(path) / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        return [tok(p).input_ids for p in PROMPTS]
    rng = random.Random(0)
    return [[rng.randrange(2, vocab_limit) for _ in range(4 + i)] for i in range(len(PROMPTS))]


def client_loop(
    swarm: LocalSwarm,
    model: str,
    prompts,
    refs,
    new_tokens: int,
    stop: threading.Event,
    tally: Tally,
    hang_s: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    client = None
    while not stop.is_set():
        if client is None:
            client = DistributedModelForCausalLM.from_pretrained(
                model, initial_peers=swarm.initial_peers, acquire_timeout_s=hang_s
            )
        i = rng.randrange(len(prompts))
        result: dict = {}

        def run():
            try:
                result["out"] = client.generate(torch.tensor([prompts[i]]), max_new_tokens=new_tokens, do_sample=False)[
                    0
                ].tolist()
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
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(hang_s)
        if worker.is_alive():
            tally.add("lost", "hung")
            client = None  # abandon the stuck object (its thread is a daemon); a fresh client goes on
        elif "out" in result:
            tally.add(
                "completed" if result["out"] == refs[i] else "lost", None if result["out"] == refs[i] else "wrong"
            )
        elif "typed" in result:
            tally.add("failed", result["typed"], result["message"])
        else:
            tally.add("lost", result["untyped"])
    if client is not None:
        client.backend.shutdown()


def killer(swarm: LocalSwarm, args, stop: threading.Event, events: list[str], counts: Counter) -> None:
    rng = random.Random(args.seed)
    start_s = time.monotonic()
    orchestrator_killed = False
    while not stop.wait(args.kill_every * rng.uniform(0.5, 1.5)):
        if not orchestrator_killed and time.monotonic() - start_s > args.minutes * 30:
            swarm.kill_orchestrator()
            counts["orchestrator_kills"] += 1
            events.append(f"{time.monotonic() - start_s:.0f}s kill orchestrator")
            orchestrator_killed = True
            for attempt in range(3):  # a loaded machine may start it slowly: try again, never stop the churn
                try:
                    swarm.start_orchestrator(args.orchestrator_args, timeout_s=180)
                    events.append(f"{time.monotonic() - start_s:.0f}s new orchestrator")
                    break
                except RuntimeError as e:
                    swarm.kill_orchestrator()
                    events.append(f"orchestrator start {attempt + 1} failed: {str(e).splitlines()[0]}")
            continue
        alive = [sp for sp in swarm.servers if sp.alive]
        if not alive:
            continue
        victim = rng.choice(alive)
        swarm.kill_server(victim)
        counts["kills"] += 1
        events.append(f"{time.monotonic() - start_s:.0f}s kill {victim.name}")
        budgets = args.budgets.split(",")  # the newcomer takes the victim's budget
        budget = budgets[swarm.servers.index(victim) % len(budgets)]
        newcomer = swarm.add_server(None, None, extra_args=["--memory-budget", budget], wait=False)
        # wait for it aside, so that the kill cadence does not depend on how fast servers start
        threading.Thread(target=wait_started, args=(swarm, newcomer, events, counts), daemon=True).start()


def wait_started(swarm: LocalSwarm, server, events: list[str], counts: Counter) -> None:
    try:
        swarm.wait_ready([server])
        counts["restarts"] += 1
    except RuntimeError as e:
        events.append(f"restart of {server.name} failed: {str(e).splitlines()[0]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", type=int, default=5, help="servers with --blocks auto (spares included)")
    p.add_argument("--budgets", default="300MiB,380MiB", help="memory budgets, cycled over the servers")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--tokens", type=int, default=12, help="greedy tokens per request")
    p.add_argument("--kill-every", type=float, default=20.0, help="mean seconds between kills")
    p.add_argument("--hang-s", type=float, default=120.0, help="a request not done by then counts as lost")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.servers < 2 or args.clients < 1:
        p.error("--minutes > 0, --servers >= 2 and --clients >= 1 are needed")
    args.orchestrator_args = ["--expected-servers", str(args.servers), "--lease-ttl", "6", "--replan-period", "10"]
    prompts = tokenize(args.model, 100)
    refs = references(args.model, prompts, args.tokens)
    budgets = args.budgets.split(",")
    tally, events, counts = Tally(), [], Counter()
    stop = threading.Event()
    with LocalSwarm(
        args.model,
        [None] * args.servers,
        server_args=["--num-threads", "1", "--max-length", "256"],
        per_server_args=[["--memory-budget", budgets[i % len(budgets)]] for i in range(args.servers)],
        orchestrator_args=args.orchestrator_args,
    ) as swarm:
        clients = [
            threading.Thread(
                target=client_loop,
                args=(swarm, args.model, prompts, refs, args.tokens, stop, tally, args.hang_s, args.seed + 1 + c),
                daemon=True,
            )
            for c in range(args.clients)
        ]
        kill_thread = threading.Thread(target=killer, args=(swarm, args, stop, events, counts), daemon=True)
        for t in clients + [kill_thread]:
            t.start()
        stop.wait(args.minutes * 60)
        stop.set()
        kill_thread.join(120)
        for t in clients:  # each finishes (or gives up on) its current request within hang_s
            t.join(args.hang_s + 30)
    c = tally.counts
    summary = {
        "started": c["started"],
        "completed": c["completed"],
        "failed": c["failed"],
        "lost": c["lost"],
        "kills": counts["kills"],
        "orchestrator_kills": counts["orchestrator_kills"],
        "restarts": counts["restarts"],
        "errors": dict(tally.errors),
        "error_examples": tally.examples,
        "events": events,
        "minutes": args.minutes,
        "model": args.model,
    }
    print(json.dumps(summary), flush=True)
    return 1 if c["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
