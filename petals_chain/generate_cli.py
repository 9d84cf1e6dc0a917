"""`petals-chain generate`: generate text through block ranges, streaming tokens as they come.

Without --initial-peers the block ranges run in this process (pipelined, no network); with
--initial-peers the client joins a swarm and relays through its servers.
"""
from __future__ import annotations

import argparse
import sys
import time

from petals_chain.errors import PetalsChainError


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """'0:10,10:20,20:30' -> [(0, 10), (10, 20), (20, 30)]."""
    ranges = []
    for part in text.split(","):
        try:
            start, end = (int(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad block range {part!r}: use START:END, e.g. 0:10,10:20,20:30") from None
        ranges.append((start, end))
    return ranges


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="petals-chain generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint folder")
    p.add_argument("--prompt", default="What is pipeline parallelism? Answer in two sentences.")
    p.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--local-ranges", type=parse_ranges, default=parse_ranges("0:10,10:20,20:30"),
                   help="block ranges run in this process when no --initial-peers is given (default 0:10,10:20,20:30)")
    p.add_argument("--initial-peers", nargs="*", default=None, help="multiaddrs of swarm DHT peers")
    p.add_argument("--device", default="cpu",
                   help="cpu or cuda[:N]: where the client head runs (and, without --initial-peers, the local ranges)")
    return p


def encode_prompt(tokenizer, prompt: str, chat: bool):
    if chat and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        print("petals-chain generate: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer, TextStreamer

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.models.checkpoint import resolve_model_path

    try:
        path = resolve_model_path(args.model)
        if args.initial_peers:
            model = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=args.initial_peers,
                                                                dtype=args.dtype, device=args.device)
        else:
            model = DistributedModelForCausalLM.from_local_ranges(path, args.local_ranges, dtype=args.dtype,
                                                                  device=args.device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat)
        torch.manual_seed(args.seed)
        gen_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample,
                          repetition_penalty=args.repetition_penalty, eos_token_id=tokenizer.eos_token_id)
        if args.sample:
            gen_kwargs.update(temperature=args.temperature, top_p=args.top_p)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        start_s = time.perf_counter()
        with model.inference_session(max_length=ids.shape[1] + args.max_new_tokens) as session:
            out = model.generate(ids, streamer=streamer, **gen_kwargs)
            chain = session.chain.describe()
        elapsed_s = time.perf_counter() - start_s
        new_tokens = out.shape[1] - ids.shape[1]
        print(f"\n[chain: {chain}] {new_tokens} tokens in {elapsed_s:.2f} s ({new_tokens / elapsed_s:.1f} tokens/s)")
        model.backend.shutdown()
    except PetalsChainError as e:
        print(f"petals-chain generate: {e}", file=sys.stderr)
        return 2
    return 0
