"""`petals-chain demo`: a private swarm on 127.0.0.1 (a DHT peer and 3 block servers splitting the
model), one chat generation through it, then a clean shutdown (also on Ctrl-C)."""
from __future__ import annotations

import argparse
import signal
import sys
import time


def even_ranges(num_blocks: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_blocks / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="petals-chain demo", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--servers", type=int, default=3, help="number of block servers (default 3)")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.servers < 1 or args.max_new_tokens < 1:
        print("petals-chain demo: --servers and --max-new-tokens must be >= 1", file=sys.stderr)
        return 2

    def terminate(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    from transformers import AutoTokenizer, TextStreamer

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.errors import PetalsChainError
    from petals_chain.generate_cli import encode_prompt
    from petals_chain.local_swarm import LocalSwarm
    from petals_chain.models.checkpoint import load_config, resolve_model_path

    path = resolve_model_path(args.model)  # convert once here, not in every server
    num_blocks = load_config(path).num_hidden_layers
    ranges = even_ranges(num_blocks, min(args.servers, num_blocks))
    print(f"starting a local swarm: DHT peer + {len(ranges)} servers {ranges} on 127.0.0.1 ...", flush=True)
    model = None
    try:
        with LocalSwarm(args.model, ranges, server_args=["--num-threads", "1"]) as swarm:
            for sp in swarm.servers:
                print(f"  {sp.name}: blocks [{sp.start}, {sp.end}) peer {sp.peer_id}")
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
            print(f"\nchain: {chain}")
            print(f"{new_tokens} tokens in {elapsed_s:.2f} s: {new_tokens / elapsed_s:.1f} tokens/s")
            model.backend.shutdown()
            model = None
            print("shutting the swarm down ...", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: swarm stopped", file=sys.stderr)
        return 130
    except (PetalsChainError, RuntimeError) as e:
        print(f"petals-chain demo: {e}", file=sys.stderr)
        return 1
    finally:
        if model is not None:
            model.backend.shutdown()
    print("done: all processes stopped")
    return 0
