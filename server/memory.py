"""KV-cache memory accounting within a server's budget (the paper's eq. 1 and 3).

Weights take `s_m * m_j`; each session reserves `s_c * m_ij` up front (static allocation by
max_length), where `m_ij` is the number of this server's blocks the session uses. A reservation
that would exceed `M_j` is refused at once with `OutOfCacheError`.
"""
from __future__ import annotations

import threading

from petals_chain.errors import OutOfCacheError


class KVBudget:
    def __init__(self, memory_budget_bytes: int, weights_bytes: int):
        if weights_bytes > memory_budget_bytes:
            raise OutOfCacheError(
                f"the blocks alone take {weights_bytes / 2**20:.1f} MiB but --memory-budget is "
                f"{memory_budget_bytes / 2**20:.1f} MiB; serve fewer blocks or raise --memory-budget")
        self.memory_budget_bytes = memory_budget_bytes
        self.weights_bytes = weights_bytes
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()
        self.peak_reserved_bytes = 0  # high-water mark of the reservations (reported; overload tests check it)

    @property
    def reserved_bytes(self) -> int:
        with self._lock:
            return sum(self._reserved.values())

    @property
    def free_bytes(self) -> int:
        return self.memory_budget_bytes - self.weights_bytes - self.reserved_bytes

    def reserve(self, key: str, nbytes: int) -> None:
        with self._lock:
            if key in self._reserved:
                raise OutOfCacheError(f"cache for {key!r} is already reserved")
            free = self.memory_budget_bytes - self.weights_bytes - sum(self._reserved.values())
            if nbytes > free:
                raise OutOfCacheError(
                    f"this session needs {nbytes / 2**20:.2f} MiB of KV cache but only {free / 2**20:.2f} MiB of the "
                    f"server's budget is free; retry later, use a smaller max_length, or pick another server")
            self._reserved[key] = nbytes
            self.peak_reserved_bytes = max(self.peak_reserved_bytes, sum(self._reserved.values()))

    def release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)

    def free_slots(self, bytes_per_session: int) -> int:
        """Sessions of `bytes_per_session` that still fit (integer arithmetic: no float floor issues)."""
        return max(0, self.free_bytes // bytes_per_session) if bytes_per_session > 0 else 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._reserved)
