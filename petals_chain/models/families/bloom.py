"""BLOOM (the PETALS paper's model): ALiBi instead of rotary positions, a fused QKV projection
(interleaved per head: [heads, 3, dim]), LayerNorms with biases, GELU MLP, and a LayerNorm right
after the token embedding, which runs on the client head with the embedding."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.bloom.modeling_bloom import BloomBlock

from petals_chain.models.attention import alibi_slopes, segment_attention
from petals_chain.models.decoder import embedding, lm_head, norm_with, tied_lm_head_name
from petals_chain.models.family import ModelFamily, PositionEncoder, register_family


class AlibiSlopes(PositionEncoder):
    """ALiBi's bias depends only on key positions inside each session's cache, so the one feature is
    the per-head slopes, made once on the device and handed to every row (a view, no copy; a decode
    captured in a CUDA graph reads the same tensor)."""

    def __init__(self, num_heads: int, device: torch.device):
        self.slopes = alibi_slopes(num_heads, torch.device(device))

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        return (self.slopes.expand(positions.shape[0], -1),)  # [rows, heads], float32


class BloomFamily(ModelFamily):
    name = "bloom"
    model_types = ("bloom",)

    def num_blocks(self, config) -> int:
        return config.n_layer

    def block_prefix(self, index: int) -> str:
        return f"transformer.h.{index}."

    def make_block(self, config, index: int) -> nn.Module:
        with torch.device("meta"):
            return BloomBlock(config, layer_idx=index)

    def kv_heads_and_dim(self, config) -> tuple[int, int]:
        return config.n_head, config.hidden_size // config.n_head

    def position_encoder(self, config, device):
        return AlibiSlopes(config.n_head, device)

    def block_forward(self, block, hidden, features, segments):
        attn = block.self_attention
        rows = hidden.shape[0]
        post_ln_residual = block.apply_residual_connection_post_layernorm
        x = block.input_layernorm(hidden)
        qkv = attn.query_key_value(x).view(rows, attn.num_heads, 3, attn.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = segment_attention(q, k, v, segments, scale=attn.inv_norm_factor, alibi=features[0][0])
        hidden = attn.dense(out.reshape(rows, -1)) + (x if post_ln_residual else hidden)
        x = block.post_attention_layernorm(hidden)
        return block.mlp(x, x if post_ln_residual else hidden)  # BloomMLP adds its residual itself

    def client_tensor_names(self, config) -> dict[str, str]:
        embed = "transformer.word_embeddings.weight"
        return {
            "embed": embed,
            "embed_norm": "transformer.word_embeddings_layernorm.weight",
            "embed_norm_bias": "transformer.word_embeddings_layernorm.bias",
            "norm": "transformer.ln_f.weight",
            "norm_bias": "transformer.ln_f.bias",
            "lm_head": tied_lm_head_name(config, embed),
        }

    def make_client_modules(self, config, tensors):
        eps = config.layer_norm_epsilon
        embed_norm = norm_with(nn.LayerNorm(config.hidden_size, eps=eps), tensors, "embed_norm")
        embed = nn.Sequential(embedding(config, tensors["embed"]), embed_norm)
        norm = norm_with(nn.LayerNorm(config.hidden_size, eps=eps), tensors, "norm")
        return embed, norm, lm_head(config, tensors["lm_head"])


BLOOM = register_family(BloomFamily())
