"""KV-cache memory accounting within a server's budget (the paper's eq. 1 and 3).

Weights take `s_m * m_j`; each session reserves `s_c * m_ij` up front (static allocation by
max_length), where `m_ij` is the number of this server's blocks the session uses. Cached prompt
prefixes (`server/prefix_cache.py`) are reservations too, so weights + sessions + cached prefixes
never exceed `M_j`; but they are evictable: a session that would not fit first evicts unpinned
cached prefixes (least recently used first) through the attached reclaimer, and only then is
refused with `OutOfCacheError`. `available_bytes` (what `free_slots` advertises to the
orchestrator) therefore counts evictable cache as free, so a granted session never waits on it.
`cache_floor_bytes` (`--prefix-cache-min`) sets memory aside that sessions never take: the cache's
guaranteed room (advertised slots shrink by it, so the orchestrator's accounting stays true).

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
    def __init__(self, memory_budget_bytes: int, weights_bytes: int, cache_floor_bytes: int = 0):
        if weights_bytes + cache_floor_bytes > memory_budget_bytes:
            raise OutOfCacheError(
                f"the blocks take {weights_bytes / 2**20:.1f} MiB and the prefix cache's reserved room "
                f"{cache_floor_bytes / 2**20:.1f} MiB but --memory-budget is {memory_budget_bytes / 2**20:.1f} MiB; "
                "serve fewer blocks, lower --prefix-cache-min or raise --memory-budget"
            )
        self.memory_budget_bytes = memory_budget_bytes
        self.weights_bytes = weights_bytes
        self.cache_floor_bytes = cache_floor_bytes
        self._reserved: dict[str, int] = {}
        self._cache_keys: set[str] = set()  # reservations of the prefix cache (evictable)
        self.lock = threading.RLock()  # shared with the prefix cache (see the module docstring)
        self.reclaimer: Reclaimer | None = None  # set once, by attach_reclaimer
        self.peak_reserved_bytes = 0  # high-water mark of the reservations (reported; overload tests check it)

    def attach_reclaimer(self, reclaimer: Reclaimer) -> None:
        """The memory this budget may evict for a session (the prefix cache, which attaches itself
        when made on this budget); one per budget, never replaced."""
        if self.reclaimer is not None:
            raise ValueError("this KV budget already has a reclaimer (one prefix cache per budget)")
        self.reclaimer = reclaimer

    @property
    def reserved_bytes(self) -> int:
        with self.lock:
            return sum(self._reserved.values())

    @property
    def free_bytes(self) -> int:
        """Bytes no reservation holds (cached prefixes count as held)."""
        return self.memory_budget_bytes - self.weights_bytes - self.reserved_bytes

    def _session_bytes(self) -> int:
        return sum(n for k, n in self._reserved.items() if k not in self._cache_keys)

    @property
    def available_bytes(self) -> int:
        """Bytes a session could get now: free plus what the reclaimer can evict, never the room
        set aside for the cache."""
        with self.lock:
            extra = self.reclaimer.evictable_bytes() if self.reclaimer is not None else 0
            for_sessions = (
                self.memory_budget_bytes - self.weights_bytes - self.cache_floor_bytes - self._session_bytes()
            )
            return max(0, min(self.free_bytes + extra, for_sessions))

    def reserve(self, key: str, nbytes: int, *, reclaim: bool = True, cache: bool = False) -> None:
        """`cache`: a prefix-cache chunk (may use the cache's reserved room; evictable)."""
        with self.lock:
            if key in self._reserved:
                raise OutOfCacheError(f"cache for {key!r} is already reserved")
            for_sessions = (
                self.memory_budget_bytes - self.weights_bytes - self.cache_floor_bytes - self._session_bytes()
            )
            if not cache and nbytes > for_sessions:  # cached prefixes are evicted for sessions, the floor never
                raise OutOfCacheError(
                    f"this session needs {nbytes / 2**20:.2f} MiB of KV cache but only "
                    f"{max(0, for_sessions) / 2**20:.2f} "
                    f"MiB of the server's budget is free; retry later, use a smaller max_length, or pick another server"
                )
            free = self.memory_budget_bytes - self.weights_bytes - sum(self._reserved.values())
            if nbytes > free and reclaim and self.reclaimer is not None:
                self.reclaimer.evict(nbytes - free)  # calls release() for what it evicts (re-entrant lock)
                free = self.memory_budget_bytes - self.weights_bytes - sum(self._reserved.values())
            if nbytes > free:
                raise OutOfCacheError(
                    f"this session needs {nbytes / 2**20:.2f} MiB of KV cache but only {free / 2**20:.2f} MiB of the "
                    f"server's budget is free; retry later, use a smaller max_length, or pick another server"
                )
            self._reserved[key] = nbytes
            if cache:
                self._cache_keys.add(key)
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, sum(self._reserved.values()))

    def release(self, key: str) -> None:
        with self.lock:
            self._reserved.pop(key, None)
            self._cache_keys.discard(key)

    def free_slots(self, bytes_per_session: int) -> int:
        """Sessions of `bytes_per_session` that still fit, evicting cached prefixes if needed
        (integer arithmetic: no float floor issues)."""
        return max(0, self.available_bytes // bytes_per_session) if bytes_per_session > 0 else 0

    def __len__(self) -> int:
        with self.lock:
            return len(self._reserved)
