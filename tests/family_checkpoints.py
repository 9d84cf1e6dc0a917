"""Tiny random checkpoints of every served family (and layout variant), saved as HF would save them.

Sizes are small enough that building one takes well under a second; each variant turns on what
makes its family differ from Llama (biases, a sliding window shorter than the test prompts, MQA/GQA
layouts, ALiBi, experts), so the exactness tests exercise that path and not a Llama look-alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=256,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def _config(variant: str):
    from transformers import (
        BloomConfig,
        FalconConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
    )

    rotary = dict(COMMON, intermediate_size=96, num_hidden_layers=4, num_key_value_heads=2, tie_word_embeddings=False)
    if variant == "qwen2":
        # a 6-token window on layers >= 2 (Qwen2's max_window_layers), tied embeddings like Qwen2.5-0.5B
        return Qwen2Config(
            **dict(rotary, tie_word_embeddings=True), use_sliding_window=True, sliding_window=6, max_window_layers=2
        )
    if variant == "mistral":
        return MistralConfig(**rotary, sliding_window=5)
    if variant == "mixtral":
        return MixtralConfig(**rotary, num_local_experts=4, num_experts_per_tok=2)
    if variant == "bloom":
        return BloomConfig(
            vocab_size=VOCAB, hidden_size=64, n_layer=4, n_head=4, pad_token_id=0, eos_token_id=1, bos_token_id=2
        )
    falcon = dict(COMMON, num_hidden_layers=4, alibi=False)
    if variant == "falcon-new":  # Falcon-40B layout: KV groups, ln_attn + ln_mlp
        return FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=2, bias=False)
    if variant == "falcon-mq":  # Falcon-7B layout: multi-query, one shared norm, parallel attention
        return FalconConfig(**falcon, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False)
    if variant == "falcon-seq":  # old layout with full KV heads, sequential attention then MLP, biases
        return FalconConfig(**falcon, new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True)
    raise KeyError(variant)


VARIANTS = ("qwen2", "mistral", "mixtral", "bloom", "falcon-new", "falcon-mq", "falcon-seq")


def save_tiny(variant: str, path: Path, seed: int = 0) -> Path:
    """Build the variant's HF model with random weights (biases and norms perturbed too, since HF
    initialises them to constants that would hide a missing bias or a swapped norm) and save it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(variant)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_random_lora(
    base_path: Path,
    path: Path,
    target_modules: list[str],
    *,
    r: int = 4,
    alpha: float = 8.0,
    use_rslora: bool = False,
    seed: int = 0,
) -> Path:
    """A PEFT LoRA adapter of the checkpoint at `base_path` with random A and B (peft's default
    initialisation zeroes B, which would make any adapter look exact), saved in peft's format."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=target_modules, use_rslora=use_rslora, init_lora_weights=False
    )
    get_peft_model(load_hf(base_path), config).save_pretrained(path)
    return path


def load_hf_with_lora(base_path: Path, adapter_path: Path):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(base_path), adapter_path).eval()
