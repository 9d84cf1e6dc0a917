"""A random-weight checkpoint of a known model's shape, for benchmarks and GPU tests with no download.

    python scripts/make_random_checkpoint.py --shape llama-2-7b --out /tmp/llama-2-7b-random [--device cuda]

Writes a Hugging Face checkpoint folder (config.json + safetensors, bfloat16 unless --dtype says
otherwise) that `launch-server --model PATH`, `from_pretrained(PATH)` and transformers load. Random
weights time exactly like trained ones (the same shapes and kernels) and suit exactness checks
against transformers; the text they generate is noise. Nothing is written if the folder already
holds a checkpoint of that shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = {
    # meta-llama/Llama-2-7b-hf's config
    "llama-2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # HuggingFaceTB/SmolLM2-135M's config (the embedded model's shape)
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}


def make_random_checkpoint(
    shape: str, out: Path, *, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0
) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    marker = out / "config.json"
    if (
        marker.is_file()
        and json.loads(marker.read_text()).get("hidden_size") == config.hidden_size
        and any(out.glob("*.safetensors"))
    ):
        return out
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 7B parameters takes minutes on a CPU, a second on a GPU
        model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-2-7b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is much faster)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    path = make_random_checkpoint(args.shape, args.out, dtype=args.dtype, device=args.device)
    print(f"{path} ({args.shape}, {args.dtype}) ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
