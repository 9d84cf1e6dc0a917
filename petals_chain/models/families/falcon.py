"""Falcon: parallel attention and MLP, a fused QKV projection with multi-query or grouped KV heads,
rotary positions, LayerNorms with biases. Both layer layouts of HF's FalconConfig:
`new_decoder_architecture=True` (Falcon-40B/180B: KV groups, `ln_attn` + `ln_mlp` or one shared
norm) and False (Falcon-7B: multi-query, one `input_layernorm`, `parallel_attn` on or off).
The cache holds only the real KV heads (HF broadcasts them to every query head; `enable_gqa`
does that inside attention), so KV bytes per token are the config's KV heads, not its query heads."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers.models.falcon.modeling_falcon import (
    FalconDecoderLayer,
    FalconRotaryEmbedding,
    apply_rotary_pos_emb,
)

from petals_chain.errors import UnsupportedModelError
from petals_chain.models.attention import segment_attention
from petals_chain.models.decoder import embedding, lm_head, norm_with, tied_lm_head_name
from petals_chain.models.family import ModelFamily, RotaryTable, register_family


class FalconFamily(ModelFamily):
    name = "falcon"
    model_types = ("falcon",)

    def check_config(self, config) -> None:
        if getattr(config, "alibi", False):
            raise UnsupportedModelError(
                "Falcon checkpoints with alibi=True (falcon-rw) are not supported; serve a rotary Falcon "
                "(falcon-7b/40b/180b: alibi=false)"
            )

    def num_blocks(self, config) -> int:
        return config.num_hidden_layers

    def block_prefix(self, index: int) -> str:
        return f"transformer.h.{index}."

    def make_block(self, config, index: int) -> nn.Module:
        # FalconDecoderLayer picks its attention class by implementation name, which a config read
        # from disk leaves unset (our forward never calls it); it also writes the default of
        # num_ln_in_parallel_attn into the config, so it gets a copy
        config = copy.copy(config)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            return FalconDecoderLayer(config, layer_idx=index)

    def kv_heads_and_dim(self, config) -> tuple[int, int]:
        head_dim = config.hidden_size // config.num_attention_heads
        if config.new_decoder_architecture:
            return config.num_kv_heads, head_dim
        return (1 if config.multi_query else config.num_attention_heads), head_dim

    def position_encoder(self, config, device):
        return RotaryTable(FalconRotaryEmbedding(config).to(device), device)

    @staticmethod
    def _split_qkv(config, qkv: torch.Tensor, heads: int, head_dim: int):
        rows = qkv.shape[0]
        if config.new_decoder_architecture:
            # [kv groups, heads per group + 2, dim]: a group's queries, then its key, then its value
            grouped = qkv.view(rows, config.num_kv_heads, -1, head_dim)
            return grouped[:, :, :-2].reshape(rows, heads, head_dim), grouped[:, :, -2], grouped[:, :, -1]
        if config.multi_query:
            fused = qkv.view(rows, heads + 2, head_dim)
            return fused[:, :-2], fused[:, -2:-1], fused[:, -1:]
        fused = qkv.view(rows, heads, 3, head_dim)
        return fused[:, :, 0], fused[:, :, 1], fused[:, :, 2]

    def block_forward(self, block, hidden, features, segments):
        config, attn = block.config, block.self_attention
        rows = hidden.shape[0]
        two_norms = config.new_decoder_architecture and (config.num_ln_in_parallel_attn or 2) == 2
        if two_norms:
            attn_in, mlp_in = block.ln_attn(hidden), block.ln_mlp(hidden)
        else:
            attn_in = mlp_in = block.input_layernorm(hidden)
        q, k, v = self._split_qkv(config, attn.query_key_value(attn_in), attn.num_heads, attn.head_dim)
        cos, sin = features
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        out = segment_attention(q, k, v, segments, scale=attn.inv_norm_factor)
        attn_out = attn.dense(out.reshape(rows, -1))
        residual = hidden
        if not config.new_decoder_architecture and not config.parallel_attn:
            residual = attn_out + hidden  # sequential layout: the MLP sees the attention's output
            mlp_in = block.post_attention_layernorm(residual)
        mlp_out = block.mlp(mlp_in)
        if config.new_decoder_architecture or config.parallel_attn:
            mlp_out = mlp_out + attn_out
        return mlp_out + residual

    def client_tensor_names(self, config) -> dict[str, str]:
        embed = "transformer.word_embeddings.weight"
        return {
            "embed": embed,
            "norm": "transformer.ln_f.weight",
            "norm_bias": "transformer.ln_f.bias",
            "lm_head": tied_lm_head_name(config, embed),
        }

    def make_client_modules(self, config, tensors):
        norm = norm_with(nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon), tensors, "norm")
        return embedding(config, tensors["embed"]), norm, lm_head(config, tensors["lm_head"])


FALCON = register_family(FalconFamily())
