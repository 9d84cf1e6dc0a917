"""Mistral: the Llama layout with sliding-window attention on every layer when `sliding_window` is set."""

from __future__ import annotations

from transformers.models.mistral.modeling_mistral import (
    MistralDecoderLayer,
    MistralRMSNorm,
    MistralRotaryEmbedding,
)

from petals_chain.models.decoder import RotaryDecoderFamily
from petals_chain.models.family import register_family


class MistralFamily(RotaryDecoderFamily):
    name = "mistral"
    model_types = ("mistral",)
    layer_class = MistralDecoderLayer
    rotary_class = MistralRotaryEmbedding
    norm_class = MistralRMSNorm


MISTRAL = register_family(MistralFamily())
