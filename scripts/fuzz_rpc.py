"""Fuzz every RPC of a live server and orchestrator with random and mutated messages.

    .venv/bin/python scripts/fuzz_rpc.py --messages 10000          # per RPC: the long run
    .venv/bin/python scripts/fuzz_rpc.py --messages 200 --model PATH

Starts a local swarm (DHT, orchestrator, one `--blocks auto` server) and sends `--messages`
fuzzed messages to each of the server's RPCs (info, forward, forward_stream, inference streams)
and the orchestrator's (acquire, release, heartbeat, assignment), built by tests/fuzz_messages.py
(garbage, random msgpack, missing/ill-typed/huge/NaN fields, NaN tensors, wrong dtypes and widths,
lying tensor headers, lying parts counts, streams cut mid-session), plus reconnect storms. A
well-behaved client generates greedy text alongside the whole time; each of its sessions is
compared with HF. Ends with one JSON line:
{"messages", "crashes", "typed_errors", "affected_sessions", "untyped_errors", "no_reply", ...}
(exit 1 when anything died, a message got an untyped error or no reply, or a session was affected).
`accepted` counts mutations that are still valid requests (e.g. NaNs in hidden states, ignored extra fields).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from petals_chain.client.model import DistributedModelForCausalLM  # noqa: E402
from petals_chain.client.remote import RemoteChain  # noqa: E402
from petals_chain.models.checkpoint import load_config, resolve_model_path  # noqa: E402
from petals_chain.swarm.local import LocalSwarm  # noqa: E402
from tests.fuzz_messages import ORCHESTRATOR_RPCS, SERVER_RPCS, RpcFuzzer  # noqa: E402


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def status_json(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "status", timeout=10) as r:
        return json.load(r)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=10_000, help="fuzzed messages per RPC")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--memory-budget", default="600MiB")
    p.add_argument("--storm-every", type=int, default=500, help="a reconnect storm of 30 streams every N messages")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.messages < 1:
        p.error("--messages must be >= 1")
    path = resolve_model_path(args.model)
    config = load_config(path)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(args.seed)
    prompts = [torch.tensor([[rng.randrange(2, min(1000, config.vocab_size)) for _ in range(4 + i)]]) for i in range(4)]
    refs = [hf.generate(x, max_new_tokens=6, do_sample=False).tolist() for x in prompts]
    stop = threading.Event()
    sessions = {"run": 0, "affected": 0}
    rss = {"max": 0}
    start_s = time.monotonic()
    with LocalSwarm(
        str(path),
        [None],
        server_args=["--num-threads", "1", "--memory-budget", args.memory_budget, "--max-length", "128"],
        orchestrator_args=["--expected-servers", "1", "--lease-ttl", "5"],
    ) as swarm:
        deadline = time.monotonic() + 120
        while not status_json(swarm.orchestrator_url)["plan_installed"]:
            if time.monotonic() > deadline:
                raise SystemExit("the orchestrator installed no plan in 120 s")
            time.sleep(0.5)
        server_pid = swarm.servers[0].process.pid
        client = DistributedModelForCausalLM.from_pretrained(str(path), initial_peers=swarm.initial_peers)

        def well_behaved():
            i = 0
            while not stop.is_set():
                try:
                    out = client.generate(prompts[i % 4], max_new_tokens=6, do_sample=False).tolist()
                    ok = out == refs[i % 4]
                except Exception:
                    ok = False
                sessions["run"] += 1
                sessions["affected"] += 0 if ok else 1
                rss["max"] = max(rss["max"], rss_bytes(server_pid))
                i += 1

        worker = threading.Thread(target=well_behaved, daemon=True)
        worker.start()
        raw = RemoteChain(str(path), config, swarm.initial_peers, use_orchestrator=False)
        fuzzer = RpcFuzzer(raw, swarm.servers[0].peer_id, swarm.orchestrator_peer_id, config.hidden_size, rng)
        rpcs = SERVER_RPCS + ORCHESTRATOR_RPCS
        from tqdm import tqdm

        for n in tqdm(range(args.messages * len(rpcs)), desc="fuzz", file=sys.stderr, mininterval=5):
            fuzzer.run(rpcs[n % len(rpcs)])
            if n and n % args.storm_every == 0:
                fuzzer.storm(30)
                fuzzer.release_grants()
        fuzzer.release_grants()
        stop.set()
        worker.join(120)
        alive = [sp.alive for sp in swarm.servers] + [
            swarm.orchestrator_process.poll() is None,
            swarm.dht_process.poll() is None,
        ]
        info = status_json(swarm.orchestrator_url)
        client.backend.shutdown()
        raw.shutdown()
    o = fuzzer.outcomes
    summary = {
        "messages": args.messages * len(rpcs),
        "crashes": alive.count(False),
        "typed_errors": o["typed_error"],
        "affected_sessions": sessions["affected"],
        "well_behaved_sessions": sessions["run"],
        "untyped_errors": o["untyped_error"],
        "no_reply": o["no_reply"],
        "silent": o["silent"],
        "accepted": o["accepted"],
        "closed": o["closed"],
        "stream_broken": o["stream_broken"],
        "storm_streams": o["storm_streams"],
        "server_max_rss_bytes": rss["max"],
        "orchestrator_queue_after": info.get("queue_length"),
        "untyped_examples": fuzzer.untyped,
        "seconds": round(time.monotonic() - start_s, 1),
        "by_kind": dict(sorted(fuzzer.by_kind.items())),
    }
    print(json.dumps(summary), flush=True)
    bad = (
        summary["crashes"]
        or summary["untyped_errors"]
        or summary["no_reply"]
        or summary["affected_sessions"]
        or summary["stream_broken"]
        or summary["silent"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
