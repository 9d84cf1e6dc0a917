"""The client side of a model: token embeddings, final norm and LM head (no transformer blocks)."""

from __future__ import annotations

from pathlib import Path

import torch

from petals_chain.models.checkpoint import load_config, read_tensors, resolve_model_path
from petals_chain.models.family import get_family
from petals_chain.runtime.block_range import parse_dtype
from petals_chain.runtime.packed_linear import pack_linears
from petals_chain.runtime.row_batcher import RowBatcher

# the LM head's batcher waits for expected sessions at most this fraction of its average call
# (row_batcher.py; the server's scheduler gathers its batches with the same default, 0.5)
LM_HEAD_GATHER_FRACTION = 0.5


class ClientHead(torch.nn.Module):
    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str | torch.dtype = "float32",
        model_path: Path | None = None,
        max_batch_rows: int = 4096,
        device: str | torch.device = "cpu",
    ):
        """`max_batch_rows`: most rows one batched call of concurrent sessions may hold (1: no
        cross-session batching, each call alone, as a baseline for benchmarks). `device`: where the
        embeddings, norm and LM head run (a GPU's LM head takes ~0.1 ms where a CPU's took 4.5 ms
        for a 32k vocabulary); token ids and hidden states are moved to it on entry."""
        super().__init__()
        self.model_path = model_path or resolve_model_path(model)
        self.config = load_config(self.model_path)
        self.family = get_family(self.config)
        self.dtype = parse_dtype(dtype)
        names = self.family.client_tensor_names(self.config)
        tensors = read_tensors(self.model_path, sorted(set(names.values())), dtype=self.dtype)
        self.embed, self.norm, self.lm_head = self.family.make_client_modules(
            self.config, {role: tensors[name] for role, name in names.items()}
        )
        self.device = torch.device(device)
        self.requires_grad_(False).eval().to(self.device)
        # the LM head through a oneDNN-packed weight on the CPU (runtime/packed_linear.py): SmolLM2's
        # 49,152 x 576 head was the gateway's largest per-token cost with 8 concurrent requests
        # (py-spy: 58% of its busy samples); packed, 8 rows take 7.6 ms of CPU instead of 19.4 ms
        pack_linears(self, self.device, self.dtype)
        # Every session of this process (any model object, any thread) shares these: concurrent
        # sessions' embedding lookups and final norm + LM head run as one call per step (row_batcher.py).
        self.embed_batched = RowBatcher(self.embed_tokens, max_rows=max_batch_rows)
        # the LM head (the costly one) waits briefly for sessions whose chain step is in flight
        # (`logits_batched.expecting()`): their replies come together from one server batch
        self.logits_batched = RowBatcher(self.logits, max_rows=max_batch_rows, gather_fraction=LM_HEAD_GATHER_FRACTION)

    @torch.inference_mode()
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids.to(self.device))

    @torch.no_grad()  # not inference mode: callers may edit their rows in place (HF's assisted decoding)
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden.to(self.device, self.dtype)))
