"""Knobs of the PETALS and BPRR baselines beyond our default reading of their papers.

All default to our reading (docs/orchestrator.md); orchestrator.sim.authors_setup sets them to the
choices of the paper authors' simulator, one named switch each.
"""

from __future__ import annotations

from dataclasses import dataclass

BPRR_WAITS: tuple[str, ...] = ("order-statistics", "active-mean")


@dataclass(frozen=True)
class BaselineOptions:
    """- ``petals_max_blocks``: per-server cap on the blocks a PETALS server takes (None = no cap;
      one entry per server, None entries uncapped).
    - ``petals_fixed_cache_per_block``: PETALS keeps this much KV cache per hosted block (in the
      cluster's memory unit)
      (slots = floor(m_j * it / s_c), at most eq. 3's), instead of all leftover memory.
    - ``bprr_wait``: "order-statistics" (exponential order statistics of the sessions on a server)
      or "active-mean" (mean service time of the server / sessions holding cache on it).
    - ``commit_at_arrival``: a baseline job holds its route's cache from arrival (while it waits)
      to completion, and starts once the jobs that arrived before it and share a server leave
      enough room; otherwise a waiting job holds nothing."""

    petals_max_blocks: tuple[int | None, ...] | None = None
    petals_fixed_cache_per_block: float | None = None
    bprr_wait: str = "order-statistics"
    commit_at_arrival: bool = False

    def __post_init__(self) -> None:
        if self.bprr_wait not in BPRR_WAITS:
            raise ValueError(f"bprr_wait must be one of {BPRR_WAITS}, got {self.bprr_wait!r}")
        if self.petals_fixed_cache_per_block is not None and not self.petals_fixed_cache_per_block > 0:
            raise ValueError(f"petals_fixed_cache_per_block must be > 0, got {self.petals_fixed_cache_per_block!r}")
