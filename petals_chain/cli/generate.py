"""`petals-chain generate`: generate text through block ranges, streaming tokens as they come.

Without --initial-peers the block ranges run in this process (pipelined, no network); with
--initial-peers the client joins a swarm and relays through its servers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from petals_chain.cli.args import (
    DTYPE_CHOICES,
    EXIT_INTERRUPTED,
    CliParser,
    identity_path,
    peer_maddr,
    positive_float,
    positive_int,
    probability,
)
from petals_chain.errors import PetalsChainError


def _exit_interrupted(_signum, _frame) -> None:
    """Ctrl-C mid-generation: leave from the signal handler itself. Why not let KeyboardInterrupt
    unwind: it may surface inside a failover or a hop's open, whose handlers close the session's
    streams politely (up to 2 s a hop on the background loop), and the promise is an exit within 5 s
    whatever the client was doing. Nothing is lost: the servers free the session when this
    process's p2pd, bound to it, goes away."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the handler may have interrupted a write that holds stdout's lock
        pass
    os.write(2, b"\npetals-chain generate: interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """'0:10,10:20,20:30' -> [(0, 10), (10, 20), (20, 30)]: ranges that tile the blocks from 0 in order
    (whether they end at the model's last block is checked once the model's config is read)."""
    ranges = []
    for part in text.split(","):
        try:
            start, end = (int(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad block range {part!r}: use START:END, e.g. 0:10,10:20,20:30"
            ) from None
        expected = ranges[-1][1] if ranges else 0
        if start != expected or end <= start:
            raise argparse.ArgumentTypeError(
                f"block ranges must tile the model from block 0 in order, each START < END; {part!r} should start "
                f"at {expected} (e.g. 0:10,10:20,20:30)"
            )
        ranges.append((start, end))
    return ranges


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(
        prog="petals-chain generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint folder")
    p.add_argument(
        "--prompt",
        default="What is pipeline parallelism? Answer in two sentences.",
        help="the user's message (sent through the chat template unless --no-chat)",
    )
    p.add_argument("--no-chat", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=positive_float, default=0.7, help="with --sample: > 0 (default 0.7)")
    p.add_argument("--top-p", type=probability, default=0.9, help="with --sample: nucleus mass in (0, 1] (default 0.9)")
    p.add_argument(
        "--repetition-penalty", type=positive_float, default=1.0, help="> 0; 1 (default) leaves the logits as they are"
    )
    p.add_argument("--seed", type=int, default=0, help="torch seed for --sample (default 0)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="client-side dtype")
    p.add_argument(
        "--local-ranges",
        type=parse_ranges,
        default=parse_ranges("0:10,10:20,20:30"),
        help="block ranges run in this process when no --initial-peers is given (default 0:10,10:20,20:30)",
    )
    p.add_argument("--initial-peers", nargs="*", default=None, type=peer_maddr, help="multiaddrs of swarm DHT peers")
    p.add_argument(
        "--identity-path",
        default=None,
        type=identity_path,
        help="this client's peer identity file (`petals-chain identity new PATH`): a stable peer id to "
        "list in a private swarm's --allowed-peers",
    )
    p.add_argument(
        "--allowed-peers",
        default=None,
        metavar="FILE",
        help="use only servers (and an orchestrator) whose peer ids FILE lists (private swarm)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda[:N]: where the client head runs (and, without --initial-peers, the local ranges)",
    )
    p.add_argument(
        "--prompt-lookup",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding by prompt lookup: draft up to K tokens copied from n-grams of the "
        "context, verified in one chain step (HF's prompt_lookup_num_tokens; 0: off)",
    )
    p.add_argument(
        "--prompt-lookup-schedule",
        choices=("adaptive", "constant"),
        default="adaptive",
        help="adaptive (default): send 0..K drafted tokens per round, as many as pay off by the measured "
        "acceptance and chain step times (no worth-while draft: a plain step); constant: all K",
    )
    p.add_argument(
        "--stats",
        action="store_true",
        help='print a final JSON line {"tokens", "chain_steps", "accepted_draft_tokens"}',
    )
    return p


def encode_prompt(tokenizer, prompt: str, chat: bool):
    if chat and tokenizer.chat_template:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        print("petals-chain generate: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.prompt_lookup < 0:
        print("petals-chain generate: --prompt-lookup must be >= 0 (0: off)", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer, TextStreamer

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.models.checkpoint import resolve_model_path

    try:
        path = resolve_model_path(args.model)
        if args.initial_peers:
            from petals_chain.transport.membership import load_allowed_peers

            model = DistributedModelForCausalLM.from_pretrained(
                args.model,
                initial_peers=args.initial_peers,
                dtype=args.dtype,
                device=args.device,
                identity_path=args.identity_path,
                allowed_servers=load_allowed_peers(args.allowed_peers),
            )
        else:
            model = DistributedModelForCausalLM.from_local_ranges(
                path, args.local_ranges, dtype=args.dtype, device=args.device
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = encode_prompt(tokenizer, args.prompt, chat=not args.no_chat)
        torch.manual_seed(args.seed)
        gen_kwargs = dict(
            max_new_tokens=args.max_new_tokens,
            do_sample=args.sample,
            repetition_penalty=args.repetition_penalty,
            eos_token_id=tokenizer.eos_token_id,
        )
        if args.sample:
            gen_kwargs.update(temperature=args.temperature, top_p=args.top_p)
        if args.prompt_lookup:
            gen_kwargs.update(
                prompt_lookup_num_tokens=args.prompt_lookup, prompt_lookup_schedule=args.prompt_lookup_schedule
            )
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        start_s = time.perf_counter()
        # + K: a verification step may hold up to K drafted tokens past the output
        with model.inference_session(max_length=ids.shape[1] + args.max_new_tokens + args.prompt_lookup) as session:
            previous = signal.signal(signal.SIGINT, _exit_interrupted)
            try:
                out = model.generate(ids, streamer=streamer, **gen_kwargs)
            finally:
                signal.signal(signal.SIGINT, previous)
            chain = session.chain.describe()
            stats = session.last_generate
        elapsed_s = time.perf_counter() - start_s
        new_tokens = out.shape[1] - ids.shape[1]
        print(f"\n[chain: {chain}] {new_tokens} tokens in {elapsed_s:.2f} s ({new_tokens / elapsed_s:.1f} tokens/s)")
        if args.stats:
            stats = stats.to_json()
            print(json.dumps({k: stats[k] for k in ("tokens", "chain_steps", "accepted_draft_tokens")}))
        model.backend.shutdown()
    except PetalsChainError as e:
        print(f"petals-chain generate: {e}", file=sys.stderr)
        return 2
    return 0
