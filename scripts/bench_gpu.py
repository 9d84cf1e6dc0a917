"""GPU benchmark: transformers' generate vs petals-chain on one CUDA host, all in the same run.

    python scripts/bench_gpu.py --random llama-2-7b --json results/bench_gpu.json
    python scripts/bench_gpu.py --model /path/to/hf-checkpoint --dtype bfloat16

Measures, for one session greedy decoding `--new-tokens` after a `--prompt-tokens` prompt:
  hf            transformers' eager `generate` (the baseline)
  local         the block runtime in-process (one range holding every block; CUDA graphs on / off)
  server1       one `launch-server` process holding every block, client head on the GPU
  chain3        3 servers (the blocks split in thirds) on the same GPU
and: `--sessions` concurrent sessions on server1 vs one (aggregate tok/s), a `--prefill-tokens`
prefill through chain3 vs transformers' forward of the same tokens, time to first token, and the
split of one decode step (server compute measured in-process, client head, and the rest: RPC).
Every time is read after `torch.cuda.synchronize()`. `--random SHAPE` makes a random-weight
checkpoint of that shape first (scripts/make_random_checkpoint.py) so nothing is downloaded.
Prints a table and one JSON object (also written to `--json`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from petals_chain.client.model import DistributedModelForCausalLM  # noqa: E402
from petals_chain.models.checkpoint import load_config  # noqa: E402
from petals_chain.runtime.block_range import BlockRange, StepInput  # noqa: E402
from petals_chain.swarm.local import LocalSwarm  # noqa: E402
from scripts.bench_swarm import codec_roundtrip  # noqa: E402
from scripts.make_random_checkpoint import make_random_checkpoint  # noqa: E402


def sync() -> None:
    torch.cuda.synchronize()


def prompt_ids(n: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (1, n), generator=g).to("cuda")


def tok_s(model, ids, new: int) -> tuple[float, list[int]]:
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    sync()
    return new / (time.perf_counter() - t0), out[0, ids.shape[1] :].tolist()


def ttft_s(model, ids) -> float:
    sync()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - t0


def concurrent_tok_s(client, ids_list, new: int) -> float:
    errors: list[BaseException] = []

    def run(ids):
        try:
            client.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(ids,)) for ids in ids_list]
    sync()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sync()
    if errors:
        raise errors[0]
    return len(ids_list) * new / (time.perf_counter() - t0)


def chain_prefill_s(client, ids) -> float:
    """One forward of the whole prompt through the chain (the servers' prefill + the wire), LM head on
    the last position only, as generate does."""
    with client.inference_session(max_length=ids.shape[1] + 1):
        sync()
        t0 = time.perf_counter()
        client(ids, logits_to_keep=1)
        sync()
        return time.perf_counter() - t0


def server_decode_compute_ms(path, dtype, n_blocks, sessions: int, steps: int = 50) -> dict[str, float]:
    """A decode step of all blocks in-process, graphs on and off, for 1 session and for `sessions`
    sessions batched (what a server computes per step, without the network or the client)."""
    result = {}
    for graphs in (True, False):
        br = BlockRange(path, 0, n_blocks, dtype=dtype, device="cuda", cuda_graphs=graphs)
        for batch in (1, sessions):
            kvs = [br.allocate_kv(steps + 40) for _ in range(batch)]
            x = torch.randn(32, br.hidden_size, device="cuda")
            br.forward([StepInput(kv, x) for kv in kvs])
            times = []
            for i in range(steps):
                sync()
                t0 = time.perf_counter()
                br.forward([StepInput(kv, x[i % 32 : i % 32 + 1]) for kv in kvs])
                sync()
                times.append(time.perf_counter() - t0)
            result[("graphs" if graphs else "eager") + ("" if batch == 1 else f"_batch{batch}")] = (
                1e3 * statistics.median(times[5:])
            )
            del kvs
        del br
        gc.collect()
        torch.cuda.empty_cache()
    return result


def client_head_ms(client, steps: int = 50) -> float:
    h = torch.randn(1, client.config.hidden_size, device="cuda")
    ids = torch.tensor([5], device="cuda")
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        client.head.logits_batched(client.head.embed_batched(ids) + h).float().argmax()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[5:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a local Hugging Face checkpoint folder")
    src.add_argument("--random", choices=["llama-2-7b", "smollm2-135m"], help="make a random checkpoint of this shape")
    p.add_argument("--random-dir", type=Path, default=Path("/tmp/petals-chain-random"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--prefill-tokens", type=int, default=2000)
    p.add_argument("--memory-budget", default="30GiB", help="per server")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: hf,local,server1,chain3")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; run it on a GPU host", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    path = args.model or make_random_checkpoint(
        args.random, args.random_dir / args.random, dtype=args.dtype, device="cuda"
    )
    config = load_config(path)
    n_blocks = config.num_hidden_layers
    dtype = getattr(torch, args.dtype)
    ids = prompt_ids(args.prompt_tokens, config.vocab_size)
    long_ids = prompt_ids(args.prefill_tokens, config.vocab_size)
    r: dict = {
        "device": torch.cuda.get_device_name(),
        "model": str(path),
        "dtype": args.dtype,
        "blocks": n_blocks,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
    }

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    reference_tokens = None
    if "hf" not in skip:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
        tok_s(hf, ids, 8)  # warm-up
        r["hf_tok_s"], reference_tokens = tok_s(hf, ids, args.new_tokens)
        r["hf_ttft_s"] = ttft_s(hf, ids)
        with torch.inference_mode():
            hf(long_ids, logits_to_keep=1)
            sync()
            t0 = time.perf_counter()
            hf(long_ids, logits_to_keep=1)
            sync()
        r["hf_prefill_s"] = time.perf_counter() - t0
        log(f"hf: {r['hf_tok_s']:.1f} tok/s")
        del hf
        gc.collect()
        torch.cuda.empty_cache()

    if "local" not in skip:
        r["server_decode_compute_ms"] = server_decode_compute_ms(path, args.dtype, n_blocks, args.sessions)
        for graphs in (True, False):
            local = DistributedModelForCausalLM.from_local_ranges(
                path, [(0, n_blocks)], dtype=args.dtype, device="cuda", cuda_graphs=graphs
            )
            tok_s(local, ids, 8)
            name = "local_graphs" if graphs else "local_eager"
            r[f"{name}_tok_s"], tokens = tok_s(local, ids, args.new_tokens)
            if reference_tokens is not None:
                r[f"{name}_same_tokens_as_hf"] = sum(a == b for a, b in zip(tokens, reference_tokens))
            log(f"{name}: {r[f'{name}_tok_s']:.1f} tok/s")
            del local
            gc.collect()
            torch.cuda.empty_cache()

    server_args = [
        "--device",
        "cuda",
        "--dtype",
        args.dtype,
        "--memory-budget",
        args.memory_budget,
        "--max-length",
        str(max(args.prefill_tokens + 8, args.prompt_tokens + args.new_tokens + 8)),
        "--max-batch-tokens",
        str(args.prefill_tokens + 8),
    ]
    layouts = {
        "server1": [(0, n_blocks)],
        "chain3": [(0, n_blocks // 3), (n_blocks // 3, 2 * n_blocks // 3), (2 * n_blocks // 3, n_blocks)],
    }
    for name, ranges in layouts.items():
        if name in skip:
            continue
        with LocalSwarm(str(path), ranges, server_args=server_args, start_timeout_s=600) as swarm:
            client = DistributedModelForCausalLM.from_pretrained(
                path, initial_peers=swarm.initial_peers, dtype=args.dtype, device="cuda"
            )
            try:
                tok_s(client, ids, 8)
                r[f"{name}_tok_s"], tokens = tok_s(client, ids, args.new_tokens)
                if reference_tokens is not None:
                    r[f"{name}_same_tokens_as_hf"] = sum(a == b for a, b in zip(tokens, reference_tokens))
                r[f"{name}_ttft_s"] = ttft_s(client, ids)
                step_ms = 1e3 / r[f"{name}_tok_s"]
                r[f"{name}_step_ms"] = step_ms
                log(f"{name}: {r[f'{name}_tok_s']:.1f} tok/s")
                if name == "server1":
                    many = [prompt_ids(args.prompt_tokens, config.vocab_size).roll(i, 1) for i in range(args.sessions)]
                    concurrent_tok_s(client, many[:2], 4)  # warm-up
                    r[f"server1_{args.sessions}_sessions_tok_s"] = concurrent_tok_s(client, many, args.new_tokens)
                    r["server1_sessions_gain"] = r[f"server1_{args.sessions}_sessions_tok_s"] / r["server1_tok_s"]
                    r["client_head_ms"] = client_head_ms(client)
                    compute = r.get("server_decode_compute_ms", {}).get("graphs")
                    if compute is not None:
                        r["server1_step_split_ms"] = {
                            "server_compute": compute,
                            "client_head": r["client_head_ms"],
                            "rpc_and_rest": step_ms - compute - r["client_head_ms"],
                        }
                if name == "chain3":
                    chain_prefill_s(client, long_ids)  # warm-up
                    r["chain3_prefill_s"] = chain_prefill_s(client, long_ids)
                    # the wire's own CPU work per hop for that hidden state (split, protobuf, parse,
                    # reassemble; request and reply), from the GPU tensor, against the prefill's total
                    hidden = torch.randn(args.prefill_tokens, config.hidden_size, device="cuda").to(dtype)
                    codec = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        codec_roundtrip(hidden.cpu())
                        codec.append(time.perf_counter() - t0)
                    r["prefill_hidden_mib"] = hidden.numel() * hidden.element_size() / 2**20
                    r["prefill_codec_per_hop_s"] = min(codec)
                    r["chain3_prefill_codec_share"] = 3 * min(codec) / r["chain3_prefill_s"]
            finally:
                client.backend.shutdown()

    ratios = {}
    if "hf_tok_s" in r:
        for k in ("local_graphs_tok_s", "local_eager_tok_s", "server1_tok_s", "chain3_tok_s"):
            if k in r:
                ratios[k.removesuffix("_tok_s") + "_vs_hf"] = r[k] / r["hf_tok_s"]
        if "chain3_prefill_s" in r:
            ratios["chain3_prefill_vs_hf"] = r["chain3_prefill_s"] / r["hf_prefill_s"]
    r["ratios"] = ratios
    print(json.dumps(r, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
