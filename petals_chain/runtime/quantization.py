"""Optional weight quantization of a block's linear layers with bitsandbytes (nf4 / int8).

bitsandbytes quantizes a parameter when it is moved from the CPU to a device (`.to(device)`); a
parameter already on the GPU is not quantized, so the block must be quantized before it moves
(`BlockRange` does so).
"""

from __future__ import annotations

import torch
from torch import nn

from petals_chain.errors import InvalidRequestError

QUANT_MODES = ("none", "nf4", "int8")


def quantize_linears(module: nn.Module, mode: str, compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Replace every nn.Linear inside `module` by its bitsandbytes counterpart (in place)."""
    if mode == "none":
        return module
    if mode not in QUANT_MODES:
        raise InvalidRequestError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    import bitsandbytes as bnb

    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            weight = child.weight.data
            if mode == "nf4":
                q = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=compute_dtype,
                    quant_type="nf4",
                )
                q.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                q = bnb.nn.Linear8bitLt(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    has_fp16_weights=False,
                    threshold=6.0,
                )
                q.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            q = q.to(device)
            setattr(module, name, Float16Inputs(q) if mode == "int8" else q)
        else:
            quantize_linears(child, mode, compute_dtype, device)
    return module


class Float16Inputs(nn.Module):
    """bitsandbytes' int8 matmul computes in float16 and casts any other input to it, warning on
    every call (2,151 warnings for one bf16 generation). This does the same cast itself, so the
    arithmetic is bitsandbytes' own, and returns the caller's dtype."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.float16)).to(x.dtype)


def module_bytes(module: nn.Module) -> int:
    """Bytes the module's weights occupy, quantization state (absmax, scales) included."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        total += t.numel() * t.element_size()
        state = getattr(t, "quant_state", None)
        if state is not None:
            total += sum(
                x.numel() * x.element_size() for x in (state.absmax, getattr(state, "code", None)) if x is not None
            )
        scb = getattr(t, "SCB", None)
        if scb is not None:
            total += scb.numel() * scb.element_size()
    return total
