"""What a server's prefix cache stored and dropped, for the orchestrator's global prefix index
(orchestrator/prefix_index.py), read by cursor in `rpc_info` (`InfoRequest.prefix_since_seq`).

A bounded log of (seq, op, namespace, hash) events: the prefix cache appends one per chunk it stores
or evicts (under its budget's lock). A reader that asks from a cursor the log no longer holds (it fell
behind by more than `max_events`), or from another epoch (this cache was made after a restart), gets
the full listing of what the cache holds instead, flagged `full`, so the index converges either way.
The epoch is a random id made with the cache.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable

from petals_chain.wire.records import PrefixDelta

MAX_EVENTS = 8192  # events the log keeps (about 512 KB of hashes)
MAX_REPLY_ENTRIES = 16384  # entries one reply carries (a full listing beyond it is cut: the LRU keeps the rest)
INSERT, EVICT = 1, 0


class PrefixReport:
    def __init__(self, listing: Callable[[], Iterable[tuple[str, str]]], max_events: int = MAX_EVENTS):
        self.epoch = uuid.uuid4().hex
        self._listing = listing  # what the cache holds now (called under the cache's lock by its caller)
        self._events: deque[tuple[int, int, str, str]] = deque(maxlen=max_events)
        self._next_seq = 0
        self._lock = threading.Lock()  # appends come from the cache's lock holders, reads from rpc_info

    def inserted(self, namespace: str, h: str) -> None:
        self._append(INSERT, namespace, h)

    def evicted(self, namespace: str, h: str) -> None:
        self._append(EVICT, namespace, h)

    def _append(self, op: int, namespace: str, h: str) -> None:
        with self._lock:
            self._events.append((self._next_seq, op, namespace, h))
            self._next_seq += 1

    def since(self, seq: int | None, epoch: str | None) -> PrefixDelta | None:
        """Events from `seq` on (None: the reader asks nothing), else the full listing."""
        if seq is None:
            return None
        with self._lock:
            oldest = self._events[0][0] if self._events else self._next_seq
            if epoch == self.epoch and oldest <= seq <= self._next_seq:
                ins, ev = [], []
                for s, op, ns, h in self._events:
                    if s >= seq:
                        (ins if op == INSERT else ev).append([ns, h])
                return PrefixDelta(self.epoch, self._next_seq, False, ins[:MAX_REPLY_ENTRIES], ev[:MAX_REPLY_ENTRIES])
            next_seq = self._next_seq
        held = [[ns, h] for ns, h in self._listing()][:MAX_REPLY_ENTRIES]
        return PrefixDelta(self.epoch, next_seq, True, held, [])


def prefix_delta(stack, request) -> PrefixDelta | None:
    """rpc_info's prefix part: the serving stack's cache changes after the request's cursor (None when
    the request asks none, or the server keeps no prefix cache)."""
    cache = None if stack is None else stack.prefix_cache
    if cache is None or request.prefix_since_seq is None:
        return None
    return cache.report.since(request.prefix_since_seq, request.prefix_epoch)
