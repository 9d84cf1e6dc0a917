"""Benchmark the swarm on this machine, with baselines measured in the same run.

1. Overhead of distribution: tokens/s of one session through a local swarm of 3 servers
   (processes on 127.0.0.1, hivemind P2P) vs transformers' own generate in this process.
2. Gain from batching: aggregate tokens/s of N concurrent sessions on one server holding all
   blocks vs 1 session on the same server.

3. Where the end-to-end batching gain goes: the same decode steps run in-process on one
   `BlockRange` holding all blocks (server compute only, no network, no client), 1 vs N sessions.
4. A long prefill (2,048 tokens: a 4.5 MiB float32 hidden state, sent in parts) through the
   3-server chain, split into compute (the same prefill in-process on all blocks, 1 thread like
   the servers) and wire (the rest: 3 hops' transfers both ways, of which the in-process encode +
   decode of the parts, `codec`, is measured separately).

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
from petals_chain.models.checkpoint import load_config, resolve_model_path
from petals_chain.runtime.block_range import BlockRange, StepInput
from petals_chain.swarm.local import LocalSwarm
from petals_chain.wire import parts as wire_parts

PROMPT = "Tell me a short story about a lighthouse keeper."
# a long prefill on a loaded 1-thread server can outlast the client's default 30 s step timeout
LONG_STEP_TIMEOUT_S = 300.0


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
    block_range.forward(
        [StepInput(kv, torch.randn(prompt_tokens, block_range.hidden_size, generator=gen)) for kv in kvs]
    )
    start_s = time.perf_counter()
    for _ in range(steps):
        block_range.forward([StepInput(kv, torch.randn(1, block_range.hidden_size, generator=gen)) for kv in kvs])
    return sessions * steps / (time.perf_counter() - start_s)


def best_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start_s = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start_s)
    return min(times)


def codec_roundtrip(hidden: torch.Tensor) -> None:
    """What one hop's transfer costs in this process: split into parts, protobuf-serialise,
    parse and reassemble, for the request and for the reply."""
    for reply in (False, True):
        wire_ = [m.SerializeToString() for m in wire_parts.to_messages({"type": "step"}, (hidden,), reply=reply)]
        cls = wire_parts.runtime_pb2.ExpertResponse if reply else wire_parts.runtime_pb2.ExpertRequest
        assembler = wire_parts.Assembler()
        results = [r for data in wire_ for r in assembler.feed(cls.FromString(data))]
        assert torch.equal(results[0].tensors[0], hidden)


def codec_roundtrip_hivemind(hidden: torch.Tensor) -> None:
    """The same with hivemind's split_for_streaming / combine_from_streaming (PETALS' way)."""
    from hivemind.compression.serialization import (
        deserialize_torch_tensor,
        serialize_torch_tensor,
    )
    from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

    for _ in range(2):  # request and reply
        data = [
            wire_parts.runtime_pb2.ExpertRequest(tensors=[part]).SerializeToString()
            for part in split_for_streaming(serialize_torch_tensor(hidden), wire_parts.MAX_PART_BYTES)
        ]
        parts = [t for d in data for t in wire_parts.runtime_pb2.ExpertRequest.FromString(d).tensors]
        assert torch.equal(deserialize_torch_tensor(combine_from_streaming(parts)), hidden)


def prefill_split(client, path, ids: torch.Tensor, repeats: int) -> dict[str, float]:
    """Section 4: a prefill of `ids` through the chain vs the same prefill in-process."""
    hidden = client.head.embed_tokens(ids[0])
    tokens = hidden.shape[0]

    def through_chain():
        with client.inference_session(max_length=tokens) as session:
            session.chain.step(hidden)

    through_chain()  # warm-up
    total_s = best_s(through_chain, repeats)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the servers
    try:
        block_range = BlockRange(path, 0, load_config(path).num_hidden_layers, model_path=path)
        compute_s = best_s(lambda: block_range.forward([StepInput(block_range.allocate_kv(tokens), hidden)]), repeats)
        codec_s = 3 * best_s(lambda: codec_roundtrip(hidden), repeats)  # 3 hops
        codec_hivemind_s = 3 * best_s(lambda: codec_roundtrip_hivemind(hidden), repeats)
    finally:
        torch.set_num_threads(default_threads)
    return {
        f"prefill{tokens}_swarm3_s": total_s,
        f"prefill{tokens}_in_process_compute_s": compute_s,
        f"prefill{tokens}_wire_s": total_s - compute_s,
        f"prefill{tokens}_codec_s": codec_s,
        f"prefill{tokens}_codec_hivemind_s": codec_hivemind_s,
        f"ratio_prefill{tokens}_codec_vs_hivemind": codec_s / codec_hivemind_s,
        f"prefill{tokens}_compute_share": compute_s / total_s,
        f"prefill{tokens}_wire_share": (total_s - compute_s) / total_s,
        f"prefill{tokens}_hidden_mib": hidden.numel() * hidden.element_size() / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="best of N for each measurement")
    p.add_argument("--prefill-tokens", type=int, default=2048, help="prompt length of section 4")
    p.add_argument("--prefill-only", action="store_true", help="run section 4 only")
    p.add_argument(
        "--out",
        default=None,
        help="default results/bench_swarm.json (results/bench_swarm_prefill.json with --prefill-only)",
    )
    args = p.parse_args()
    path = resolve_model_path(args.model)
    num_blocks = load_config(path).num_hidden_layers
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    long_ids = tok(" ".join([PROMPT] * (args.prefill_tokens // 8 + 1)), return_tensors="pt").input_ids
    if long_ids.shape[1] < args.prefill_tokens:
        p.error(f"could not build a {args.prefill_tokens}-token prompt")
    long_ids = long_ids[:, : args.prefill_tokens]
    results: dict[str, float] = {}
    third = num_blocks // 3
    swarm3 = [(0, third), (third, 2 * third), (2 * third, num_blocks)]
    swarm3_args = ["--num-threads", "1", "--max-length", str(max(2048, args.prefill_tokens))]
    if args.prefill_only:
        with LocalSwarm(args.model, swarm3, server_args=swarm3_args) as swarm:
            client = DistributedModelForCausalLM.from_pretrained(
                args.model, initial_peers=swarm.initial_peers, step_timeout_s=LONG_STEP_TIMEOUT_S
            )
            results.update(prefill_split(client, path, long_ids, args.repeats))
            client.backend.shutdown()
        report(results, args)
        return

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    results["hf_local_tokens_per_s"] = max(timed_generate(hf, ids, args.new_tokens) for _ in range(args.repeats))
    default_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the servers run one thread each: the same per-process budget
    results["hf_local_1thread_tokens_per_s"] = max(
        timed_generate(hf, ids, args.new_tokens) for _ in range(args.repeats)
    )
    torch.set_num_threads(default_threads)
    del hf

    with LocalSwarm(args.model, swarm3, server_args=swarm3_args) as swarm:
        client = DistributedModelForCausalLM.from_pretrained(
            args.model, initial_peers=swarm.initial_peers, step_timeout_s=LONG_STEP_TIMEOUT_S
        )
        timed_generate(client, ids, 4)  # warm-up: routing, connections
        results["swarm3_one_session_tokens_per_s"] = max(
            timed_generate(client, ids, args.new_tokens) for _ in range(args.repeats)
        )
        results.update(prefill_split(client, path, long_ids, args.repeats))
        client.backend.shutdown()

    with LocalSwarm(args.model, [(0, num_blocks)]) as swarm:
        client = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=swarm.initial_peers)
        timed_generate(client, ids, 4)
        results["one_server_1_session_tokens_per_s"] = max(
            concurrent_tokens_per_s(client, ids, args.new_tokens, 1) for _ in range(args.repeats)
        )
        results[f"one_server_{args.sessions}_sessions_tokens_per_s"] = max(
            concurrent_tokens_per_s(client, ids, args.new_tokens, args.sessions) for _ in range(args.repeats)
        )
        client.backend.shutdown()

    results["in_process_1_session_decode_tokens_per_s"] = max(
        in_process_decode_tokens_per_s(path, 1) for _ in range(args.repeats)
    )
    results[f"in_process_{args.sessions}_sessions_decode_tokens_per_s"] = max(
        in_process_decode_tokens_per_s(path, args.sessions) for _ in range(args.repeats)
    )
    results[f"ratio_in_process_{args.sessions}_vs_1"] = (
        results[f"in_process_{args.sessions}_sessions_decode_tokens_per_s"]
        / results["in_process_1_session_decode_tokens_per_s"]
    )
    overhead = results["swarm3_one_session_tokens_per_s"] / results["hf_local_tokens_per_s"]
    batching = (
        results[f"one_server_{args.sessions}_sessions_tokens_per_s"] / results["one_server_1_session_tokens_per_s"]
    )
    results["ratio_swarm3_vs_hf_local"] = overhead
    results["ratio_swarm3_vs_hf_local_1thread"] = (
        results["swarm3_one_session_tokens_per_s"] / results["hf_local_1thread_tokens_per_s"]
    )
    results[f"ratio_{args.sessions}_sessions_vs_1"] = batching
    report(results, args)


def report(results: dict[str, float], args) -> None:
    for k, v in results.items():
        print(f"{k:45s} {v:8.2f}")
    out = Path(args.out or ("results/bench_swarm_prefill.json" if args.prefill_only else "results/bench_swarm.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"new_tokens": args.new_tokens, "threads": torch.get_num_threads(), **results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
