"""Mixtral: Mistral's attention with a sparse mixture-of-experts feed-forward.

The router picks the top-k experts of every row, and each expert runs once per block call over all
rows routed to it, whichever session they belong to (HF's own `MixtralSparseMoeBlock` on the
flattened batch). Checkpoints store experts one by one (`block_sparse_moe.experts.E.w1/w2/w3`,
what HF's `save_pretrained` and the Hub's Mixtral checkpoints hold); the module keeps them fused
([experts, 2*inter, hidden] gate+up, [experts, hidden, inter] down), so `block_state` fuses them.
"""

from __future__ import annotations

import torch
from transformers.models.mixtral.modeling_mixtral import (
    MixtralDecoderLayer,
    MixtralRMSNorm,
    MixtralRotaryEmbedding,
)

from petals_chain.models.families.mistral import MistralFamily
from petals_chain.models.family import register_family

_MOE = "block_sparse_moe."


class MixtralFamily(MistralFamily):
    name = "mixtral"
    model_types = ("mixtral",)
    layer_class = MixtralDecoderLayer
    rotary_class = MixtralRotaryEmbedding
    norm_class = MixtralRMSNorm

    def block_tensor_names(self, config, index):
        prefix = self.block_prefix(index)
        names = [prefix + k for k in self.make_block(config, index).state_dict() if not k.startswith("mlp.")]
        names.append(prefix + _MOE + "gate.weight")
        for e in range(config.num_local_experts):
            names += [f"{prefix}{_MOE}experts.{e}.{w}.weight" for w in ("w1", "w2", "w3")]
        return names

    def block_state(self, config, index, tensors):
        prefix = self.block_prefix(index)
        moe = prefix + _MOE
        state = {n[len(prefix) :]: t for n, t in tensors.items() if not n.startswith(moe)}
        state["mlp.gate.weight"] = tensors[moe + "gate.weight"]
        experts = range(config.num_local_experts)
        # gate_up_proj[e] = [w1; w3]: the expert computes act(x w1^T) * (x w3^T), then w2
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[f"{moe}experts.{e}.w1.weight"], tensors[f"{moe}experts.{e}.w3.weight"]])
                for e in experts
            ]
        )
        state["mlp.experts.down_proj"] = torch.stack([tensors[f"{moe}experts.{e}.w2.weight"] for e in experts])
        return state

    def mlp(self, block, x):
        return block.mlp(x.unsqueeze(0))[0]  # the MoE block takes [batch, seq, hidden]


MIXTRAL = register_family(MixtralFamily())
