"""Per-block compute times the orchestrator plans with (paper footnote 11), as a server announces them.

`t_I` (prefill seconds per token per block) and `t_O` (decode seconds per token per block) come
from the start-up profile of the hosted range, measured through the server's real step path
(`server/range_profile.py`: scheduler batches, on CUDA synchronized before and after, the first
round a warm-up that is not timed), scaled by an emulated slowdown (`server/emulation.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockTimes:
    prefill_s_per_token: float  # t_I
    decode_s_per_token: float  # t_O
