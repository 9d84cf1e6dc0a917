"""Qwen2 / Qwen2.5: the Llama layout with biases on q/k/v (in the HF module itself) and, where the
config turns it on, a sliding window on the layers `layer_types` marks 'sliding_attention'."""

from __future__ import annotations

from transformers.models.qwen2.modeling_qwen2 import (
    Qwen2DecoderLayer,
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
)

from petals_chain.models.decoder import RotaryDecoderFamily
from petals_chain.models.family import register_family


class Qwen2Family(RotaryDecoderFamily):
    name = "qwen2"
    model_types = ("qwen2",)
    layer_class = Qwen2DecoderLayer
    rotary_class = Qwen2RotaryEmbedding
    norm_class = Qwen2RMSNorm


QWEN2 = register_family(Qwen2Family())
