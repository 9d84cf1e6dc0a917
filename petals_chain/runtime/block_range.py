"""A contiguous range of transformer blocks `[start, end)` with per-session KV caches.

This is what a server runs and what the in-process pipeline and the exactness tests chain
together. Only the range's own tensors are read from the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from petals_chain.errors import InvalidRequestError, MaxLengthExceededError
from petals_chain.models.checkpoint import load_config, read_tensors, resolve_model_path
from petals_chain.models.family import AttentionSegment, get_family
from petals_chain.runtime.kv_cache import SessionKV, kv_bytes_per_block
from petals_chain.runtime.quantization import module_bytes, quantize_linears

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidRequestError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


@dataclass
class StepInput:
    """One session's part of a batched step: its KV and its new hidden states [n_tokens, hidden]."""

    kv: SessionKV
    hidden: torch.Tensor
    validated: bool = False  # `validate_step` passed already (the server checks at submit): skip it in forward


class BlockRange:
    """Blocks `[start, end)` of a causal LM, ready to run sessions' steps."""

    def __init__(self, model: str | Path, start: int, end: int, *, dtype: str | torch.dtype = "float32",
                 quant: str = "none", device: str = "cpu", config=None, model_path: Path | None = None):
        self.model_path = model_path or resolve_model_path(model)
        self.config = config or load_config(self.model_path)
        self.family = get_family(self.config)
        total = self.family.num_blocks(self.config)
        if not (0 <= start < end <= total):
            raise InvalidRequestError(
                f"block range [{start}, {end}) is not inside the model's {total} blocks; use START:END with "
                f"0 <= START < END <= {total}")
        self.start, self.end = start, end
        self.dtype = parse_dtype(dtype)
        self.quant = quant
        self.device = torch.device(device)
        self.hidden_size = self.config.hidden_size
        self.kv_heads, self.head_dim = self.family.kv_heads_and_dim(self.config)
        self._encode_positions = self.family.position_encoder(self.config)
        self.blocks: dict[int, torch.nn.Module] = {}
        for index in range(start, end):
            names = self.family.block_tensor_names(self.config, index)
            tensors = read_tensors(self.model_path, names, dtype=self.dtype)
            block = self.family.make_block(self.config, index)
            state = {self.family.block_state_key(self.config, index, n): t for n, t in tensors.items()}
            block.load_state_dict(state, assign=True, strict=True)
            block = block.to(self.device).eval().requires_grad_(False)
            self.blocks[index] = quantize_linears(block, quant, self.dtype, self.device)

    # -- sizes the orchestrator plans with -------------------------------------------------
    @cached_property
    def block_bytes(self) -> int:
        """`s_m`: bytes of the largest block of this range (all blocks are alike in practice).
        Cached: weights never change, and servers report it on every announcement and rpc_info."""
        return max(module_bytes(b) for b in self.blocks.values())

    def kv_bytes_per_block(self, max_length_tokens: int) -> int:
        """`s_c` at `max_length_tokens`."""
        return kv_bytes_per_block(self.kv_heads, self.head_dim, max_length_tokens, self.dtype)

    # -- sessions --------------------------------------------------------------------------
    def allocate_kv(self, max_length_tokens: int, first_block: int | None = None) -> SessionKV:
        first = self.start if first_block is None else first_block
        if not self.start <= first < self.end:
            raise InvalidRequestError(
                f"entry block {first} is outside this range [{self.start}, {self.end})")
        if max_length_tokens <= 0:
            raise InvalidRequestError(f"max_length must be positive, got {max_length_tokens}")
        return SessionKV.allocate(first, self.end, self.kv_heads, self.head_dim, max_length_tokens,
                                  self.dtype, self.device)

    def validate_step(self, step: StepInput) -> None:
        h = step.hidden
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != self.hidden_size or h.shape[0] < 1:
            shape = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise InvalidRequestError(f"hidden states must have shape [n_tokens >= 1, {self.hidden_size}], got {shape}")
        if not h.is_floating_point():
            raise InvalidRequestError(f"hidden states must be a float tensor, got {h.dtype}")
        if step.kv.end_block != self.end or not self.start <= step.kv.first_block < self.end:
            raise InvalidRequestError("this KV cache was not allocated by this block range")
        if step.kv.past_tokens + h.shape[0] > step.kv.max_length_tokens:
            raise MaxLengthExceededError(
                f"session would reach {step.kv.past_tokens + h.shape[0]} tokens but was opened with max_length="
                f"{step.kv.max_length_tokens}; open the session with a larger max_length")
        if not torch.isfinite(h).all():
            raise InvalidRequestError("hidden states contain NaN or Inf")

    @torch.inference_mode()
    def forward(self, steps: list[StepInput]) -> list[torch.Tensor]:
        """Run one batched step for several sessions; each output has its input's shape.

        The linear layers see all sessions' rows at once (that is the batching gain); attention
        runs per session against its own cache. A session that entered mid-range skips blocks
        before its entry block.
        """
        if not steps:
            return []
        for step in steps:
            if not step.validated:
                self.validate_step(step)
        sizes = [s.hidden.shape[0] for s in steps]
        hidden = torch.cat([s.hidden.to(self.device, self.dtype) for s in steps])
        positions = torch.cat([torch.arange(s.kv.past_tokens, s.kv.past_tokens + n) for s, n in zip(steps, sizes)])
        features = self._encode_positions(positions.to(self.device), self.dtype)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        for index in range(self.start, self.end):
            active = [i for i, s in enumerate(steps) if s.kv.first_block <= index]
            if not active:
                continue
            if len(active) == len(steps):
                rows, sub_hidden, sub_features, starts = None, hidden, features, offsets[:-1]
            else:
                rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in active]).to(self.device)
                sub_hidden = hidden.index_select(0, rows)
                sub_features = tuple(f.index_select(0, rows) for f in features)
                starts, acc = [], 0
                for i in active:
                    starts.append(acc)
                    acc += sizes[i]
            segments = []
            for row_start, i in zip(starts, active):
                k, v = steps[i].kv.block_views(index)
                segments.append(AttentionSegment(row_start, sizes[i], steps[i].kv.past_tokens, k, v))
            out = self.family.block_forward(self.blocks[index], sub_hidden, sub_features, segments)
            if rows is None:
                hidden = out
            else:
                hidden = hidden.index_copy(0, rows, out)
        for step, n in zip(steps, sizes):
            step.kv.past_tokens += n
        return list(torch.split(hidden, sizes))

    @torch.inference_mode()
    def forward_stateless(self, hidden: torch.Tensor, first_block: int | None = None) -> torch.Tensor:
        """Forward of whole sequences without keeping a cache: hidden [batch, seq, hidden] -> same shape."""
        if hidden.dim() != 3:
            raise InvalidRequestError(f"hidden states must have shape [batch, seq, {self.hidden_size}], got {tuple(hidden.shape)}")
        steps = [StepInput(self.allocate_kv(hidden.shape[1], first_block), seq) for seq in hidden]
        return torch.stack(self.forward(steps))
