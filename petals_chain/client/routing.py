"""Choosing the chain of servers a session runs on, behind one small interface.

`ChainProvider.find_chain(start, end, exclude)` returns hops (`messages.Hop`, the one chain type the
orchestrator's grants use too) that together process blocks
`[start, end)` in order. Until an orchestrator decides, the client picks the chain itself from the
DHT records by minimum estimated latency, as PETALS does: Dijkstra over block boundaries, where
using server s from boundary b costs its round trip plus its per-block decode time over the blocks
it would process, with a penalty when it reports no free KV slot.
"""

from __future__ import annotations

import heapq
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from petals_chain.errors import NoChainError, UnknownAdapterError
from petals_chain.wire.messages import ChainGrant, Hop
from petals_chain.wire.records import ServerInfo, ServerState

NO_CACHE_PENALTY_S = 10.0
# a server of another dtype than the session's still serves it (it casts the hidden states in and its reply
# back), but its rounding makes the output differ from the session's own dtype: used only where no chain of
# the session's dtype is this much faster (a hop's RTT plus its blocks' decode time is well under it)
OTHER_DTYPE_PENALTY_S = 5.0


@dataclass(frozen=True)
class Acquired:
    """A whole chain a provider chose for a session, with the orchestrator's grant behind it (None
    from client-side routing): its chain id, plan version and the session's wait in the queue."""

    hops: list[Hop]
    grant: ChainGrant | None = None


class ChainProvider(ABC):
    # True: on a server failure the session replaces its whole chain (asked from block 0), not
    # only the hops from the failed one on (an orchestrator counts a session on one chain).
    whole_chain_failover: bool = False
    # True: find_chain also takes the prompt (`prefix_hashes`, `prompt_tokens`) for prompt-aware dispatch
    takes_prompt: bool = False

    @abstractmethod
    def find_chain(
        self,
        start: int,
        end: int,
        *,
        exclude: frozenset[str] = frozenset(),
        max_length: int = 0,
        session_id: str = "",
        adapter: str | None = None,
    ) -> list[Hop]:
        """Hops covering `[start, end)`, each serving the LoRA `adapter` if one is asked for;
        raises NoChainError when none exists."""

    def acquire(
        self,
        start: int,
        end: int,
        *,
        exclude: frozenset[str] = frozenset(),
        max_length: int = 0,
        session_id: str = "",
        adapter: str | None = None,
    ) -> Acquired:
        """`find_chain`, with the grant that comes with the chain (`client/lease.py` keeps it on the session)."""
        return Acquired(
            self.find_chain(start, end, exclude=exclude, max_length=max_length, session_id=session_id, adapter=adapter)
        )

    def find_span(
        self,
        start: int,
        ends: frozenset[int],
        *,
        exclude: frozenset[str] = frozenset(),
        max_length: int = 0,
        session_id: str = "",
        adapter: str | None = None,
    ) -> list[Hop]:
        """Hops from `start` to any boundary in `ends` (failover of one span); by default the
        longest span, i.e. a new chain to `max(ends)`."""
        return self.find_chain(
            start, max(ends), exclude=exclude, max_length=max_length, session_id=session_id, adapter=adapter
        )

    def session_finished(
        self,
        hops: list[Hop],
        *,
        session_id: str = "",
        input_tokens: int = 0,
        output_tokens: int = 0,
        hop_timings: tuple = (),
    ) -> None:
        """Called when a session on `hops` ends (an orchestrator frees its slot); `hop_timings`:
        its steps' `HopTiming`s (the orchestrator learns the per-hop network cost from them)."""

    def close(self) -> None:
        """Stop background work (heartbeats)."""


def min_latency_chain(
    servers: list[ServerInfo],
    start: int,
    end: int,
    rtt_s: Callable[[str], float | None],
    *,
    exclude: frozenset[str] = frozenset(),
    max_length: int = 0,
    ends: frozenset[int] | None = None,
    adapter: str | None = None,
    dtype: str | None = None,
) -> list[Hop]:
    """Dijkstra over block boundaries `start..end` (pure; `rtt_s(peer)` is None for unreachable peers).

    With `ends`, the chain may stop at any of those boundaries (all <= `end`): failover uses it to
    replace only a failed span and keep the hops after it, which start at those boundaries.
    With `adapter`, only servers that list that LoRA adapter are used. With `dtype` (the session's),
    servers declaring another dtype cost OTHER_DTYPE_PENALTY_S more (a mixed-dtype swarm).
    """
    targets = ends if ends else frozenset({end})
    if adapter is not None and servers and not any(adapter in s.adapters for s in servers):
        served = sorted({a for s in servers for a in s.adapters})
        raise UnknownAdapterError(
            f"no server of this model serves adapter {adapter!r}; served adapters: "
            f"{served or 'none'}. Choose one of them, or start servers with --adapters PATH"
        )
    usable = [
        s
        for s in servers
        if s.peer_id not in exclude
        and s.state == ServerState.ONLINE
        and s.max_length_tokens >= max_length
        and s.end > start
        and s.start < end
        and (adapter is None or adapter in s.adapters)
    ]
    best: dict[int, float] = {start: 0.0}
    prev: dict[int, tuple[int, ServerInfo]] = {}
    heap = [(0.0, start)]
    while heap:
        cost, b = heapq.heappop(heap)
        if b in targets:
            break
        if cost > best.get(b, float("inf")):
            continue
        for s in usable:
            if not s.start <= b < s.end:
                continue
            rtt = rtt_s(s.peer_id)
            if rtt is None:
                continue
            nxt = min(s.end, end)
            c = cost + rtt + s.decode_s_per_token * (nxt - b) + (NO_CACHE_PENALTY_S if s.free_kv_slots <= 0 else 0.0)
            if dtype is not None and s.dtype != dtype:
                c += OTHER_DTYPE_PENALTY_S
            if c < best.get(nxt, float("inf")):
                best[nxt] = c
                prev[nxt] = (b, s)
                heapq.heappush(heap, (c, nxt))
    reached = [t for t in targets if t in best]
    if not reached:
        covered = sorted((s.start, s.end) for s in usable)
        serving = f" serving adapter {adapter!r}" if adapter is not None else ""
        raise NoChainError(
            f"no chain of online servers{serving} covers blocks [{start}, {end}) (usable servers hold "
            f"{covered or 'nothing'}); start servers for the missing blocks"
            f"{' with --adapters' if adapter is not None else ''} or wait for them to join"
        )
    hops, b = [], min(reached, key=lambda t: best[t])
    while b != start:
        a, s = prev[b]
        hops.append(Hop(s.peer_id, a, b, s.name))
        b = a
    return hops[::-1]


class DhtChainProvider(ChainProvider):
    """Client-side routing from DHT records (used when no orchestrator is present)."""

    def __init__(
        self,
        fetch_servers: Callable[[], list[ServerInfo]],
        ping_s: Callable[[str], float | None],
        *,
        wait_for_chain_s: float = 20.0,
        rtt_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        dtype: str | None = None,
    ):
        self.fetch_servers = fetch_servers
        self.dtype = dtype  # the sessions' dtype: servers of it preferred (min_latency_chain)
        self.ping_s = ping_s
        self.wait_for_chain_s = wait_for_chain_s
        self.rtt_ttl_s = rtt_ttl_s
        self.clock = clock
        # every session's thread routes through here: the RTT cache is read and written under the lock,
        # never held across a ping (two threads may ping one peer at once; the later answer stays)
        self._lock = threading.Lock()
        self._rtt: dict[str, tuple[float, float | None]] = {}

    def _rtt_s(self, peer_id: str) -> float | None:
        now = self.clock()
        with self._lock:
            cached = self._rtt.get(peer_id)
        if cached is None or now - cached[0] > self.rtt_ttl_s:
            cached = (now, self.ping_s(peer_id))
            with self._lock:
                self._rtt[peer_id] = cached
        return cached[1]

    def find_chain(self, start, end, *, exclude=frozenset(), max_length=0, session_id="", adapter=None):
        return self.find_span(start, frozenset({end}), exclude=exclude, max_length=max_length, adapter=adapter)

    def find_span(self, start, ends, *, exclude=frozenset(), max_length=0, session_id="", adapter=None):
        deadline = self.clock() + self.wait_for_chain_s
        while True:
            try:
                return min_latency_chain(
                    self.fetch_servers(),
                    start,
                    max(ends),
                    self._rtt_s,
                    exclude=exclude,
                    max_length=max_length,
                    ends=ends,
                    adapter=adapter,
                    dtype=self.dtype,
                )
            except NoChainError:
                if self.clock() >= deadline:
                    raise
                with self._lock:  # retry unreachable peers
                    self._rtt = {p: v for p, v in self._rtt.items() if v[1] is not None}
                time.sleep(0.5)  # servers may still be joining: poll the DHT again
