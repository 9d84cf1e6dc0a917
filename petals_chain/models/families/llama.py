"""The Llama family (Llama 2/3.x, SmolLM2, and Llama-layout models without sliding windows)."""

from __future__ import annotations

from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from petals_chain.models.decoder import RotaryDecoderFamily
from petals_chain.models.family import register_family


class LlamaFamily(RotaryDecoderFamily):
    name = "llama"
    model_types = ("llama",)
    layer_class = LlamaDecoderLayer
    rotary_class = LlamaRotaryEmbedding
    norm_class = LlamaRMSNorm


LLAMA = register_family(LlamaFamily())
