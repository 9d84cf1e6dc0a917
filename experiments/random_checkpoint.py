"""`python -m experiments.random_checkpoint OUT [--shape llama-2-7b] [--dtype float16]`: a randomly
initialised checkpoint of a real model's shape, for the GPU variant of Table 1 (the paper serves
LLaMA-2-7B; compute and memory depend on the shape, not on the weights' values, and the load
generator sends random token ids). Written as sharded safetensors (`save_pretrained`), seeded.
Llama-2-7B in bfloat16 (what `launch-server --dtype bfloat16` serves): 13.5 GB on disk, about as much
RAM while it is written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

SHAPES = {
    # the paper's model (§4.2): 32 blocks of hidden 4096, MHA 32 heads, FFN 11008, vocabulary 32000
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, rope_theta=10000.0),
    # a small one of the same family, for trying the command on a CPU
    "llama-tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.random_checkpoint", description=__doc__)
    p.add_argument("out", help="checkpoint folder to write (must not exist)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-2-7b")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        print(f"random_checkpoint: {out} exists; pick a new folder", file=sys.stderr)
        return 2
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(**SHAPES[args.shape], tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2, torch_dtype=args.dtype)
    torch.set_default_dtype(dtype)  # initialise in the target dtype: half the memory of float32
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2GB")
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote {out}: {args.shape}, {n / 1e6:.1f} M parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
