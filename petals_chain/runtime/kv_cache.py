"""Per-session static KV cache (the paper's static allocation by max length, §2.1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def kv_bytes_per_block(kv_heads: int, head_dim: int, max_length_tokens: int, dtype: torch.dtype) -> int:
    """`s_c`: keys + values of one block for one session at `max_length_tokens`."""
    return 2 * kv_heads * head_dim * max_length_tokens * dtype.itemsize


@dataclass
class SessionKV:
    """KV of one session for the blocks `[first_block, end_block)` it uses on one server."""

    first_block: int
    end_block: int
    max_length_tokens: int
    keys: torch.Tensor  # [blocks, kv_heads, max_length, head_dim]
    values: torch.Tensor
    past_tokens: int = 0
    adapter: str | None = None  # the LoRA adapter this session's KV is computed with (None: base model)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = self.keys.numel() * self.keys.element_size() * 2

    @classmethod
    def allocate(
        cls,
        first_block: int,
        end_block: int,
        kv_heads: int,
        head_dim: int,
        max_length_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        adapter: str | None = None,
    ) -> "SessionKV":
        shape = (end_block - first_block, kv_heads, max_length_tokens, head_dim)
        return cls(
            first_block,
            end_block,
            max_length_tokens,
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
            adapter=adapter,
        )

    @property
    def num_blocks(self) -> int:
        return self.end_block - self.first_block

    def block_views(self, block_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = block_index - self.first_block
        return self.keys[i], self.values[i]
