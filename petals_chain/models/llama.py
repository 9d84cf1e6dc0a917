"""The Llama family (Llama 2/3, SmolLM2, Mistral-like layouts without sliding windows).

Blocks are transformers' own `LlamaDecoderLayer` modules used as weight containers; the forward
is written here so that one call can carry several sessions' tokens (a prefill of many tokens and
other sessions' single decode tokens, flattened into rows) against per-session static KV caches.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from petals_chain.models.family import ModelFamily, RotaryTable, register_family, write_and_attend


class LlamaFamily(ModelFamily):
    name = "llama"
    model_types = ("llama", "mistral")

    def num_blocks(self, config) -> int:
        return config.num_hidden_layers

    def _prefix(self, index: int) -> str:
        return f"model.layers.{index}."

    def block_tensor_names(self, config, index: int) -> list[str]:
        block = self.make_block(config, index)
        return [self._prefix(index) + k for k in block.state_dict()]

    def make_block(self, config, index: int) -> nn.Module:
        with torch.device("meta"):
            return LlamaDecoderLayer(config, layer_idx=index)

    def block_state_key(self, config, index: int, tensor_name: str) -> str:
        return tensor_name[len(self._prefix(index)):]

    def kv_heads_and_dim(self, config) -> tuple[int, int]:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return config.num_key_value_heads, head_dim

    def position_encoder(self, config, device: torch.device):
        return RotaryTable(LlamaRotaryEmbedding(config).to(device), device)

    def block_forward(self, block, hidden, features, segments):
        attn = block.self_attn
        cos, sin = features
        rows = hidden.shape[0]
        residual = hidden
        x = block.input_layernorm(hidden)
        q = attn.q_proj(x).view(rows, -1, attn.head_dim)
        k = attn.k_proj(x).view(rows, -1, attn.head_dim)
        v = attn.v_proj(x).view(rows, -1, attn.head_dim)
        # [rows, heads, dim] with cos/sin [rows, dim] -> unsqueeze the heads axis
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        out = torch.empty_like(q)
        for seg in segments:
            r0, r1 = seg.row_start, seg.row_start + seg.n_tokens
            out[r0:r1] = write_and_attend(q[r0:r1], k[r0:r1], v[r0:r1], seg, attn.scaling)
        hidden = residual + attn.o_proj(out.reshape(rows, -1))
        return hidden + block.mlp(block.post_attention_layernorm(hidden))

    def client_tensor_names(self, config) -> dict[str, str]:
        lm_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        return {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": lm_head}

    def make_client_modules(self, config, tensors):
        embed_w = tensors["embed"]
        embed = nn.Embedding.from_pretrained(embed_w, freeze=True, padding_idx=getattr(config, "pad_token_id", None))
        norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norm.weight = nn.Parameter(tensors["norm"], requires_grad=False)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        lm_head.weight = nn.Parameter(tensors["lm_head"], requires_grad=False)
        return embed, norm, lm_head


LLAMA = register_family(LlamaFamily())
