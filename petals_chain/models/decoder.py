"""Shared parts of the families: the pre-norm rotary decoder (Llama, Qwen2, Mistral, Mixtral are one
forward with different HF classes and a few switches) and the client-side modules every family
builds from checkpoint tensors.

Blocks are transformers' own decoder-layer modules used as weight containers; the forward is
written here so that one call carries several sessions' rows against per-session static caches.
"""

from __future__ import annotations

import torch
from torch import nn

from petals_chain.models.attention import segment_attention
from petals_chain.models.family import ModelFamily, RotaryTable


def embedding(config, weight: torch.Tensor) -> nn.Embedding:
    return nn.Embedding.from_pretrained(weight, freeze=True, padding_idx=getattr(config, "pad_token_id", None))


def lm_head(config, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=bias is not None)
    head.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        head.bias = nn.Parameter(bias, requires_grad=False)
    return head


def norm_with(norm: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> nn.Module:
    """Fill an empty norm module with `tensors[prefix]` (weight) and `tensors[prefix + '_bias']` if present."""
    norm.weight = nn.Parameter(tensors[prefix], requires_grad=False)
    if prefix + "_bias" in tensors:
        norm.bias = nn.Parameter(tensors[prefix + "_bias"], requires_grad=False)
    return norm


def tied_lm_head_name(config, embed_name: str, own_name: str = "lm_head.weight") -> str:
    return embed_name if getattr(config, "tie_word_embeddings", False) else own_name


class RotaryDecoderFamily(ModelFamily):
    """Pre-norm decoder with rotary positions and (G)QA: x + attn(norm(x)), then h + mlp(norm(h)).

    Subclasses name transformers' classes and override `sliding_window` / `mlp` where they differ."""

    layer_class: type[nn.Module]
    rotary_class: type[nn.Module]
    norm_class: type[nn.Module]

    def num_blocks(self, config) -> int:
        return config.num_hidden_layers

    def block_prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def make_block(self, config, index: int) -> nn.Module:
        with torch.device("meta"):
            return self.layer_class(config, layer_idx=index)

    def kv_heads_and_dim(self, config) -> tuple[int, int]:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return config.num_key_value_heads, head_dim

    def position_encoder(self, config, device):
        return RotaryTable(self.rotary_class(config).to(device), device)

    def sliding_window(self, block: nn.Module) -> int | None:
        """Keys a query may see (the most recent ones), None for all: Qwen2's attention modules carry
        their layer's window (`layer_types`), Mistral's and Mixtral's read the config's, Llama has none."""
        attn = block.self_attn
        return getattr(attn, "sliding_window", getattr(attn.config, "sliding_window", None))

    def mlp(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block.mlp(x)

    def block_forward(self, block, hidden, features, segments):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = block.self_attn
        cos, sin = features
        rows = hidden.shape[0]
        x = block.input_layernorm(hidden)
        q = attn.q_proj(x).view(rows, -1, attn.head_dim)
        k = attn.k_proj(x).view(rows, -1, attn.head_dim)
        v = attn.v_proj(x).view(rows, -1, attn.head_dim)
        # [rows, heads, dim] with cos/sin [rows, dim] -> unsqueeze the heads axis
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        out = segment_attention(q, k, v, segments, scale=attn.scaling, sliding_window=self.sliding_window(block))
        hidden = hidden + attn.o_proj(out.reshape(rows, -1))
        return hidden + self.mlp(block, block.post_attention_layernorm(hidden))

    def client_tensor_names(self, config) -> dict[str, str]:
        embed = "model.embed_tokens.weight"
        return {"embed": embed, "norm": "model.norm.weight", "lm_head": tied_lm_head_name(config, embed)}

    def make_client_modules(self, config, tensors):
        norm = norm_with(self.norm_class(config.hidden_size, eps=config.rms_norm_eps), tensors, "norm")
        return embedding(config, tensors["embed"]), norm, lm_head(config, tensors["lm_head"])
