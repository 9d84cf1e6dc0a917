"""KV-cache memory accounting within a server's budget (the paper's eq. 1 and 3).

Weights take `s_m * m_j`; each session reserves `s_c * m_ij` up front (static allocation by
max_length), where `m_ij` is the number of this server's blocks the session uses. Cached prompt
prefixes (`server/prefix_cache.py`) are reservations too, so weights + sessions + cached prefixes
never exceed `M_j`; but they are evictable: a session that would not fit first evicts unpinned
cached prefixes (least recently used first) through the attached reclaimer, and only then is
refused with `OutOfCacheError`. `available_bytes` (what `free_slots` advertises to the
orchestrator) therefore counts evictable cache as free, so a granted session never waits on it.

One re-entrant lock guards the budget and the prefix cache together (the cache uses `lock`), so a
reservation that evicts and an insertion that reserves can never deadlock one another.
"""
from __future__ import annotations

import threading
from typing import Protocol

from petals_chain.errors import OutOfCacheError


class Reclaimer(Protocol):
    """Memory that can be given back on demand (the prefix cache)."""

    def evictable_bytes(self) -> int: ...

    def evict(self, nbytes: int) -> int:
        """Release at least `nbytes` if possible (LRU); return the bytes released."""


class KVBudget:
    def __init__(self, memory_budget_bytes: int, weights_bytes: int):
        if weights_bytes > memory_budget_bytes:
            raise OutOfCacheError(
                f"the blocks alone take {weights_bytes / 2**20:.1f} MiB but --memory-budget is "
                f"{memory_budget_bytes / 2**20:.1f} MiB; serve fewer blocks or raise --memory-budget")
        self.memory_budget_bytes = memory_budget_bytes
        self.weights_bytes = weights_bytes
        self._reserved: dict[str, int] = {}
        self.lock = threading.RLock()  # shared with the prefix cache (see the module docstring)
        self.reclaimer: Reclaimer | None = None

    @property
    def reserved_bytes(self) -> int:
        with self.lock:
            return sum(self._reserved.values())

    @property
    def free_bytes(self) -> int:
        """Bytes no reservation holds (cached prefixes count as held)."""
        return self.memory_budget_bytes - self.weights_bytes - self.reserved_bytes

    @property
    def available_bytes(self) -> int:
        """Bytes a session could get now: free plus what the reclaimer can evict."""
        with self.lock:
            extra = self.reclaimer.evictable_bytes() if self.reclaimer is not None else 0
            return self.free_bytes + extra

    def reserve(self, key: str, nbytes: int, *, reclaim: bool = True) -> None:
        with self.lock:
            if key in self._reserved:
                raise OutOfCacheError(f"cache for {key!r} is already reserved")
            free = self.memory_budget_bytes - self.weights_bytes - sum(self._reserved.values())
            if nbytes > free and reclaim and self.reclaimer is not None:
                self.reclaimer.evict(nbytes - free)  # calls release() for what it evicts (re-entrant lock)
                free = self.memory_budget_bytes - self.weights_bytes - sum(self._reserved.values())
            if nbytes > free:
                raise OutOfCacheError(
                    f"this session needs {nbytes / 2**20:.2f} MiB of KV cache but only {free / 2**20:.2f} MiB of the "
                    f"server's budget is free; retry later, use a smaller max_length, or pick another server")
            self._reserved[key] = nbytes

    def release(self, key: str) -> None:
        with self.lock:
            self._reserved.pop(key, None)

    def free_slots(self, bytes_per_session: int) -> int:
        """Sessions of `bytes_per_session` that still fit, evicting cached prefixes if needed
        (integer arithmetic: no float floor issues)."""
        return max(0, self.available_bytes // bytes_per_session) if bytes_per_session > 0 else 0

    def __len__(self) -> int:
        with self.lock:
            return len(self._reserved)
