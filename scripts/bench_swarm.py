"""Benchmark the swarm on this machine, with baselines measured in the same run.

1. Overhead of distribution: tokens/s of one session through a local swarm of 3 servers
   (processes on 127.0.0.1, hivemind P2P) vs transformers' own generate in this process.
2. Gain from batching: aggregate tokens/s of N concurrent sessions on one server holding all
   blocks vs 1 session on the same server.

3. Where the end-to-end batching gain goes: the same decode steps run in-process on one
   `BlockRange` holding all blocks (server compute only, no network, no client), 1 vs N sessions.

Prints a table with ratios and writes results/bench_swarm.json.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.local_swarm import LocalSwarm
from petals_chain.models.checkpoint import load_config, resolve_model_path
from petals_chain.runtime.block_range import BlockRange, StepInput

PROMPT = "Tell me a short story about a lighthouse keeper."


def timed_generate(model, ids, new_tokens: int) -> float:
    start_s = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    elapsed_s = time.perf_counter() - start_s
    assert out.shape[1] - ids.shape[1] == new_tokens
    return new_tokens / elapsed_s


def concurrent_tokens_per_s(client, ids, new_tokens: int, sessions: int) -> float:
    models = [DistributedModelForCausalLM(client.config, client.head, client.backend) for _ in range(sessions)]
    errors: list[BaseException] = []

    def run(m):
        try:
            m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    start_s = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed_s = time.perf_counter() - start_s
    if errors:
        raise errors[0]
    return sessions * new_tokens / elapsed_s


def in_process_decode_tokens_per_s(path, sessions: int, steps: int = 20, prompt_tokens: int = 20) -> float:
    """Decode steps of `sessions` sessions batched in one BlockRange.forward per step."""
    block_range = BlockRange(path, 0, load_config(path).num_hidden_layers, model_path=path)
    gen = torch.Generator().manual_seed(0)
    kvs = [block_range.allocate_kv(prompt_tokens + steps + 1) for _ in range(sessions)]
    block_range.forward([StepInput(kv, torch.randn(prompt_tokens, block_range.hidden_size, generator=gen))
                         for kv in kvs])
    start_s = time.perf_counter()
    for _ in range(steps):
        block_range.forward([StepInput(kv, torch.randn(1, block_range.hidden_size, generator=gen)) for kv in kvs])
    return sessions * steps / (time.perf_counter() - start_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="best of N for each measurement")
    p.add_argument("--out", default="results/bench_swarm.json")
    args = p.parse_args()
    path = resolve_model_path(args.model)
    num_blocks = load_config(path).num_hidden_layers
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    results: dict[str, float] = {}

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results["hf_local_tokens_per_s"] = max(timed_generate(hf, ids, args.new_tokens) for _ in range(args.repeats))
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the servers run one thread each: the same per-process budget
    results["hf_local_1thread_tokens_per_s"] = max(timed_generate(hf, ids, args.new_tokens) for _ in range(args.repeats))
    torch.set_num_threads(default_threads)
    del hf

    third = num_blocks // 3
    with LocalSwarm(args.model, [(0, third), (third, 2 * third), (2 * third, num_blocks)],
                    server_args=["--num-threads", "1"]) as swarm:
        client = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=swarm.initial_peers)
        timed_generate(client, ids, 4)  # warm-up: routing, connections
        results["swarm3_one_session_tokens_per_s"] = max(
            timed_generate(client, ids, args.new_tokens) for _ in range(args.repeats))
        client.backend.shutdown()

    with LocalSwarm(args.model, [(0, num_blocks)]) as swarm:
        client = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=swarm.initial_peers)
        timed_generate(client, ids, 4)
        results["one_server_1_session_tokens_per_s"] = max(
            concurrent_tokens_per_s(client, ids, args.new_tokens, 1) for _ in range(args.repeats))
        results[f"one_server_{args.sessions}_sessions_tokens_per_s"] = max(
            concurrent_tokens_per_s(client, ids, args.new_tokens, args.sessions) for _ in range(args.repeats))
        client.backend.shutdown()

    results["in_process_1_session_decode_tokens_per_s"] = max(
        in_process_decode_tokens_per_s(path, 1) for _ in range(args.repeats))
    results[f"in_process_{args.sessions}_sessions_decode_tokens_per_s"] = max(
        in_process_decode_tokens_per_s(path, args.sessions) for _ in range(args.repeats))
    results[f"ratio_in_process_{args.sessions}_vs_1"] = (
        results[f"in_process_{args.sessions}_sessions_decode_tokens_per_s"]
        / results["in_process_1_session_decode_tokens_per_s"])
    overhead = results["swarm3_one_session_tokens_per_s"] / results["hf_local_tokens_per_s"]
    batching = results[f"one_server_{args.sessions}_sessions_tokens_per_s"] / results["one_server_1_session_tokens_per_s"]
    results["ratio_swarm3_vs_hf_local"] = overhead
    results["ratio_swarm3_vs_hf_local_1thread"] = (results["swarm3_one_session_tokens_per_s"]
                                                  / results["hf_local_1thread_tokens_per_s"])
    results[f"ratio_{args.sessions}_sessions_vs_1"] = batching
    for k, v in results.items():
        print(f"{k:45s} {v:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"new_tokens": args.new_tokens, "threads": torch.get_num_threads(), **results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
