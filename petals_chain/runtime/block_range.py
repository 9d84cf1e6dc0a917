"""A contiguous range of transformer blocks `[start, end)` with per-session KV caches.

This is what a server runs and what the in-process pipeline and the exactness tests chain
together. Only the range's own tensors are read from the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from petals_chain.errors import InvalidRequestError, MaxLengthExceededError
from petals_chain.models.checkpoint import load_config, read_tensors, resolve_model_path
from petals_chain.models.family import AttentionSegment, get_family
from petals_chain.runtime.decode_graphs import DecodeGraphs, attention_backends
from petals_chain.runtime.kv_cache import SessionKV, kv_bytes_per_block
from petals_chain.runtime.lora import (
    LoraRows,
    adapter_name,
    attach_adapter,
    check_adapter,
    load_adapter_blocks,
)
from petals_chain.runtime.packed_linear import pack_linears
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
    validated: bool = False  # `validate_step` passed already (a server's `StepRequest`): skip it in forward


class BlockRange:
    """Blocks `[start, end)` of a causal LM, ready to run sessions' steps."""

    def __init__(
        self,
        model: str | Path,
        start: int,
        end: int,
        *,
        dtype: str | torch.dtype = "float32",
        quant: str = "none",
        device: str | torch.device = "cpu",
        config=None,
        model_path: Path | None = None,
        cuda_graphs: bool = True,
        adapters: list[str | Path] = (),
    ):
        """`adapters`: PEFT LoRA folders, each served under its folder name (`runtime/lora.py`)."""
        self.model_path = model_path or resolve_model_path(model)
        self.config = config or load_config(self.model_path)
        self.family = get_family(self.config)
        total = self.family.num_blocks(self.config)
        if not (0 <= start < end <= total):
            raise InvalidRequestError(
                f"block range [{start}, {end}) is not inside the model's {total} blocks; use START:END with "
                f"0 <= START < END <= {total}"
            )
        self.start, self.end = start, end
        self.dtype = parse_dtype(dtype)
        self.quant = quant
        self.device = torch.device(device)
        self.hidden_size = self.config.hidden_size
        self.kv_heads, self.head_dim = self.family.kv_heads_and_dim(self.config)
        self._encode_positions = self.family.position_encoder(self.config, self.device)
        self.blocks: dict[int, torch.nn.Module] = {}
        for index in range(start, end):
            names = self.family.block_tensor_names(self.config, index)
            tensors = read_tensors(self.model_path, names, dtype=self.dtype)
            block = self.family.make_block(self.config, index)
            block.load_state_dict(self.family.block_state(self.config, index, tensors), assign=True, strict=True)
            block = block.eval().requires_grad_(False)
            # Quantize while the weights are still on the CPU: bitsandbytes quantizes a weight when it
            # moves from the CPU to the device, so a block moved first would keep serving bf16 weights.
            block = quantize_linears(block, quant, self.dtype, self.device).to(self.device)
            # float32 linears on the CPU through oneDNN-packed weights: a step of a few rows
            # (concurrent decodes, speculative verification) costs near one row's (runtime/packed_linear.py)
            self.blocks[index] = pack_linears(block, self.device, self.dtype)
        self.lora_rows = LoraRows()  # set around each block call by `_run_blocks` (its only writer)
        self.adapters: list[str] = []
        for path in adapters:
            name = adapter_name(path)
            if name in self.adapters:
                raise InvalidRequestError(
                    f"two adapters are named {name!r} (adapters are named by their folder); rename one folder"
                )
            prefixes = {i: self.family.block_prefix(i) for i in range(start, end)}
            for index, weights in load_adapter_blocks(path, prefixes, self.dtype).items():
                attach_adapter(self.blocks[index], weights, self.lora_rows)
            self.adapters.append(name)
        # CUDA graphs of decode steps (runtime/decode_graphs.py): on CUDA unless turned off, and not
        # for bitsandbytes layers (int8's matmul syncs with the host: its capture fails, measured on
        # an H100 with bitsandbytes 0.50.2, so quantized ranges decode eagerly)
        self.graphs = (
            DecodeGraphs(
                self._graph_body,
                hidden_size=self.hidden_size,
                dtype=self.dtype,
                device=self.device,
                version=self._encode_positions_version,
            )
            if cuda_graphs and self.device.type == "cuda" and quant == "none"
            else None
        )

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
    def allocate_kv(
        self, max_length_tokens: int, first_block: int | None = None, adapter: str | None = None
    ) -> SessionKV:
        """A session's cache; `adapter`: the LoRA adapter its steps run with (None: the base model)."""
        check_adapter(adapter, self.adapters)
        first = self.start if first_block is None else first_block
        if not self.start <= first < self.end:
            raise InvalidRequestError(f"entry block {first} is outside this range [{self.start}, {self.end})")
        if max_length_tokens <= 0:
            raise InvalidRequestError(f"max_length must be positive, got {max_length_tokens}")
        # the position table covers the whole session now, not at a later step (that step may be a
        # graph replay, which must not reallocate what a captured graph reads)
        self._encode_positions.reserve(max_length_tokens)
        return SessionKV.allocate(
            first, self.end, self.kv_heads, self.head_dim, max_length_tokens, self.dtype, self.device, adapter=adapter
        )

    def validate_step(self, step: StepInput, check_finite: bool = True, past_tokens: int | None = None) -> None:
        """Refuse a step this range cannot run (typed errors). `check_finite=False`: the caller has
        checked its values for NaN and Inf already (a server's input: wire_parts' `finite` decoding).
        `past_tokens`: where the step will start, when the caller checks it before moving the session
        there (a server's KV rollback or prefix reuse; default: where the session is)."""
        h = step.hidden
        past = step.kv.past_tokens if past_tokens is None else past_tokens
        if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != self.hidden_size or h.shape[0] < 1:
            shape = tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise InvalidRequestError(f"hidden states must have shape [n_tokens >= 1, {self.hidden_size}], got {shape}")
        if not h.is_floating_point():
            raise InvalidRequestError(f"hidden states must be a float tensor, got {h.dtype}")
        if step.kv.end_block != self.end or not self.start <= step.kv.first_block < self.end:
            raise InvalidRequestError("this KV cache was not allocated by this block range")
        if past + h.shape[0] > step.kv.max_length_tokens:
            raise MaxLengthExceededError(
                f"session would reach {past + h.shape[0]} tokens but was opened with max_length="
                f"{step.kv.max_length_tokens}; open the session with a larger max_length"
            )
        # one reduction instead of isfinite + all + bool (each torch call costs tens of microseconds on a
        # decode step's cold path): the float64 sum of finite float16/bfloat16/float32 values cannot
        # overflow, so it is finite exactly when every value is (no block range runs float64)
        if check_finite and not math.isfinite(h.sum(dtype=torch.float64).item()):
            raise InvalidRequestError("hidden states contain NaN or Inf")

    @torch.inference_mode()
    def forward(self, steps: list[StepInput]) -> list[torch.Tensor]:
        """Run one batched step for several sessions; each output has its input's shape.

        The linear layers see all sessions' rows at once (that is the batching gain); attention
        runs per session against its own cache. A session that entered mid-range skips blocks
        before its entry block. On CUDA, a decode step (one token per session) of a set of sessions
        seen before replays a captured CUDA graph instead (runtime/decode_graphs.py), unless a
        session uses a LoRA adapter (its rows are chosen per step on the host).
        """
        if not steps:
            return []
        for step in steps:
            if not step.validated:
                self.validate_step(step)
        sizes = [s.hidden.shape[0] for s in steps]
        with attention_backends(self.device):
            graphable = self.graphs is not None and max(sizes) == 1 and all(s.kv.adapter is None for s in steps)
            out = self.graphs.run(steps) if graphable else None
            if out is None:
                hidden = torch.cat([s.hidden.to(self.device, self.dtype) for s in steps])
                self._encode_positions.reserve(max(s.kv.past_tokens + n for s, n in zip(steps, sizes)))
                positions = torch.cat(
                    [
                        torch.arange(s.kv.past_tokens, s.kv.past_tokens + n, device=self.device)
                        for s, n in zip(steps, sizes)
                    ]
                )
                features = self._encode_positions(positions, self.dtype)
                out = self._run_blocks(hidden, features, [s.kv for s in steps], sizes)
        for step, n in zip(steps, sizes):
            step.kv.past_tokens += n
        return out

    def _graph_body(self, hidden: torch.Tensor, positions: torch.Tensor, kvs: list[SessionKV]) -> torch.Tensor:
        """A decode step of `kvs` (one row each) at positions held in a device tensor: no shape or
        host value depends on the positions, so DecodeGraphs can capture it once and replay it."""
        features = self._encode_positions(positions, self.dtype)
        return torch.cat(self._run_blocks(hidden, features, kvs, [1] * len(kvs), positions=positions))

    def _encode_positions_version(self) -> int:
        """Changes whenever the position encoder reallocates its table (a captured graph read the old one)."""
        return getattr(self._encode_positions, "capacity", 0)

    def _run_blocks(
        self,
        hidden: torch.Tensor,
        features: tuple[torch.Tensor, ...],
        kvs: list[SessionKV],
        sizes: list[int],
        positions: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        for index in range(self.start, self.end):
            active = [i for i, kv in enumerate(kvs) if kv.first_block <= index]
            if not active:
                continue
            if len(active) == len(kvs):
                rows, sub_hidden, sub_features, starts = None, hidden, features, offsets[:-1]
            else:
                rows = torch.cat([torch.arange(offsets[i], offsets[i + 1], device=self.device) for i in active])
                sub_hidden = hidden.index_select(0, rows)
                sub_features = tuple(f.index_select(0, rows) for f in features)
                starts, acc = [], 0
                for i in active:
                    starts.append(acc)
                    acc += sizes[i]
            segments = []
            adapter_rows: dict[str, list[int]] = {}
            for row_start, i in zip(starts, active):
                k, v = kvs[i].block_views(index)
                position = None if positions is None else positions[i : i + 1]
                segments.append(AttentionSegment(row_start, sizes[i], kvs[i].past_tokens, k, v, position))
                if kvs[i].adapter is not None:
                    adapter_rows.setdefault(kvs[i].adapter, []).extend(range(row_start, row_start + sizes[i]))
            self.lora_rows.groups = [
                (name, torch.tensor(rows_of, device=self.device)) for name, rows_of in adapter_rows.items()
            ]
            try:
                out = self.family.block_forward(self.blocks[index], sub_hidden, sub_features, segments)
            finally:
                self.lora_rows.groups = []
            if rows is None:
                hidden = out
            else:
                hidden = hidden.index_copy(0, rows, out)
        return list(torch.split(hidden, sizes))

    @torch.inference_mode()
    def forward_stateless(
        self, hidden: torch.Tensor, first_block: int | None = None, adapter: str | None = None
    ) -> torch.Tensor:
        """Forward of whole sequences without keeping a cache: hidden [batch, seq, hidden] -> same shape."""
        if hidden.dim() != 3:
            raise InvalidRequestError(
                f"hidden states must have shape [batch, seq, {self.hidden_size}], got {tuple(hidden.shape)}"
            )
        steps = [StepInput(self.allocate_kv(hidden.shape[1], first_block, adapter), seq) for seq in hidden]
        return torch.stack(self.forward(steps))
