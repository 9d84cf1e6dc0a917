"""Linear layers whose float32 weights are prepacked for oneDNN on the CPU.

A server's step feeds its linear layers a handful of rows: one per concurrent decoding session, or
k + 1 for a speculative verification; a prefill feeds a chunk of the prompt. Every one of these is
bound by streaming the weights (a few rows) or by the GEMM (many), and `F.linear(x, W)` (MKL's sgemm
on the row-major weight) gets much slower from 1 to 2 rows. oneDNN's inner product on a weight
reordered once into its blocked layout (what Inductor's weight freezing does:
`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`) streams it in the order its kernel
reads, and keeps a step of a few rows near the cost of one. Measured with torch 2.13 on this
machine's AMD EPYC (AVX2), one thread, CPU time of the 210 weight matrices of SmolLM2-135M's blocks,
median of 7 interleaved runs, beside a busy experiment (so read +-10 %):

    rows                 1     4     9    16    32   128
    F.linear (ms)       37    48    67    75   111   322
    W @ x.T (ms)        38    38    89    85   120   350   (the orientation this file replaced)
    oneDNN packed (ms)  34    29    36    49    80   273

and SmolLM2's 49,152 x 576 LM head on the client: 1 / 4 / 8 / 16 rows 9.8 / 16.8 / 19.4 / 24.2 ms
with `F.linear`, 6.7 / 5.5 / 7.6 / 11.0 ms packed. So every row count takes the packed weight, with
one exception found on a quiet machine (11 interleaved runs, the blocks' matrices as above): two rows
take oneDNN's slowest path, 38.4 ms against 28.3 ms for three (and 32.1 ms for one; `W @ x.T` took
25.1 ms, but it needs the dense weight kept beside the packed one, twice the memory). Two rows are
therefore computed as three with a zero row (30.4 ms) and cut back to two.

The products equal `F.linear`'s up to float reduction order (5.7e-5 absolute on outputs of size
~30; as they already differ between batch sizes in MKL). The dense weight is dropped after packing
(`weight` becomes an empty placeholder on the same device, so the layer costs no more memory than
before and LoRA still finds its device); the packed copy is a non-persistent buffer, which is what
`module_bytes` counts. Only plain float32 `nn.Linear`s on the CPU are packed (quantized layers keep
their own kernels; other dtypes and devices were not measured to gain), and only where this torch
has oneDNN; LoRA wraps the packed layer as any linear.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    """Whether this torch build has oneDNN and the (private, Inductor's) packed linear ops."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    """An `nn.Linear` (same `isinstance`, same bias) computing through a oneDNN-packed weight."""

    @classmethod
    def of(cls, linear: nn.Linear) -> "PackedLinear":
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().contiguous())
        new.weight = nn.Parameter(
            torch.empty(0, dtype=linear.weight.dtype, device=linear.weight.device), requires_grad=False
        )
        new.bias = linear.bias
        new.register_buffer("packed_weight", packed, persistent=False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 2 * self.in_features:
            # Two rows take oneDNN's slowest path (see the module docstring): compute three, the
            # third a zero row, and return the first two (rows are independent in a linear layer)
            rows = torch.cat([x.reshape(2, self.in_features), x.new_zeros(1, self.in_features)])
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
            return out[:2].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Replace (in place) every plain float32 `nn.Linear` inside `module` by a `PackedLinear` when the
    module runs on the CPU and oneDNN is there; elsewhere return it unchanged."""
    if device.type != "cpu" or dtype != torch.float32 or not packing_available():
        return module
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear:  # not subclasses: bitsandbytes' layers are nn.Linear subclasses
            setattr(module, name, PackedLinear.of(child))
        else:
            pack_linears(child, device, dtype)
    return module
