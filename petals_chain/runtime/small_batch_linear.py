"""Linear layers that compute a step of a few rows as `(W @ x.T).T` on the CPU.

A server's batched step feeds its linear layers a handful of rows: one per concurrent decoding
session, or k + 1 for a speculative verification. `F.linear(x, W)` (MKL's sgemm with the weight
transposed) gets much slower from 1 to 2 rows, although a step of a few rows is bound by streaming
the weights once, like one row. Computing the same product as `W @ x.T` (a skinny right-hand side)
keeps it near the one-row cost. Measured with torch 2.13 (MKL 2024.2) on this machine's AMD EPYC
(AVX2, one thread, CPU time of the 210 weight matrices of SmolLM2-135M's blocks, same run):

    rows            1     2     3     4     5     8     9    12    16
    F.linear (ms)  43    76   102   100   108   133   133   131   118
    W @ x.T  (ms)  42    57    78    68    78   110   129   147   115

so the row counts 2..8 take the other orientation (at 8 rows the gain moved between 17 % and -6 %
over runs; 2..5 rows gained 25-35 % in every run); one row (a gemv either way) and larger batches
(prefill) keep `F.linear`. Making `x.T` contiguous first doubles the cost (measured): it is not.
The products are equal up to float reduction order (as they already are between batch sizes:
MKL's row 1 of a 3-row batch differs from the same row alone in the last bit).
Only plain float32 `nn.Linear`s on the CPU are replaced (quantized layers keep their own kernels;
other dtypes and devices were not measured to gain); LoRA wraps the replaced layer as any linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_ROWS = range(2, 9)  # row counts computed as W @ x.T (measured above)


class SmallBatchLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same `isinstance`) whose 2..8-row inputs use `W @ x.T`."""

    @classmethod
    def of(cls, linear: nn.Linear) -> "SmallBatchLinear":
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias  # shared, not copied
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] not in SKINNY_ROWS:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            out = torch.mm(self.weight, x.t())
        else:
            out = torch.addmm(self.bias.unsqueeze(1), self.weight, x.t())
        # contiguous: the callers view the output as [rows, heads, dim], and a transposed result would
        # make every later op strided
        return out.t().contiguous()


def small_batch_linears(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Replace (in place) every plain float32 `nn.Linear` inside `module` by a `SmallBatchLinear`
    when the module runs on the CPU; elsewhere return it unchanged."""
    if device.type != "cpu" or dtype != torch.float32:
        return module
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:  # not subclasses: bitsandbytes' layers are nn.Linear subclasses
            setattr(module, name, SmallBatchLinear.of(child))
        else:
            small_batch_linears(child, device, dtype)
    return module
