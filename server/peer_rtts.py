"""A server's measured RTTs to other servers of its model: the RTT_ij of the paper's footnote 4.

With server relay a step reaches server j from the hop before it, not from the client, so the
orchestrator's tau_c,ij = steps x RTT_ij / 2 needs server-to-server RTTs, which only the servers can
measure. Each server times `rpc_info` round trips (the same probe the orchestrator and clients use,
`petals_chain.transport.protocol.ping_block_server_s`) to a bounded set of peers and announces the medians in
`ServerInfo.peer_rtt_s` (seconds, by peer id); the orchestrator reads them
(`orchestrator.service.registry.peer_rtt_s`).

Which peers: those it can exchange pushes with first (a span that ends where its own could be
entered, or one that could be entered where its own ends), then the rest, at most `max_peers`, so
the probing stays bounded however large the swarm. A server without blocks yet (`--blocks auto`,
waiting for its assignment) probes every peer up to the bound: the orchestrator plans its range
with these RTTs. `PeerRtts` is pure bookkeeping (time passed in); `BlockServer` runs the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from petals_chain.wire.records import ServerInfo


def can_adjoin(start: int, end: int, other: ServerInfo) -> bool:
    """Whether a chain may pass between a server holding [start, end) and `other` in either order:
    other's end lies in [start, end) (other, then this server entered at other's end) or this end lies
    in [other.start, other.end) (this server, then other entered at this end). A server without blocks
    (start == end) may adjoin anyone."""
    if start >= end or not other.has_blocks:
        return True
    return start <= other.end < end or other.start <= end < other.end


def choose_peers(me: str, start: int, end: int, infos: Iterable[ServerInfo], max_peers: int) -> list[str]:
    """Up to `max_peers` peer ids to probe: those that can adjoin [start, end) first, then the others;
    by peer id within each group (the same swarm gives the same choice)."""
    others = {i.peer_id: i for i in infos if i.peer_id != me}
    ranked = sorted(others.values(), key=lambda i: (not can_adjoin(start, end, i), i.peer_id))
    return [i.peer_id for i in ranked[:max_peers]]


class PeerRtts:
    """The latest median RTT to each chosen peer (seconds), and when each was measured. One writer
    (the server's peer-rtts thread: `due`, `measure`); `view` may be called from any thread (a
    dict copy of str -> float runs under the GIL without Python code in between)."""

    def __init__(self, *, max_peers: int = 8, probes: int = 3, period_s: float = 30.0):
        if max_peers < 0 or probes < 1 or period_s <= 0:
            raise ValueError("max_peers >= 0, probes >= 1 and period_s > 0 are required")
        self.max_peers = max_peers
        self.probes = probes
        self.period_s = period_s
        self._rtt_s: dict[str, float] = {}
        self._measured_at_s: dict[str, float] = {}

    def due(self, peers: list[str], now_s: float) -> list[str]:
        """Of the chosen `peers`, those never measured or measured more than `period_s` ago; peers no
        longer chosen are forgotten (gone from the DHT, or out of the bound)."""
        for gone in set(self._measured_at_s) - set(peers):
            self._rtt_s.pop(gone, None)
            del self._measured_at_s[gone]
        return [p for p in peers if now_s - self._measured_at_s.get(p, -float("inf")) >= self.period_s]

    def measure(self, peer: str, ping: Callable[[str], float | None], now_s: float) -> float | None:
        """`probes` pings of `peer` (None: no answer); keeps their median. The first ping may pay a
        connection setup, which the median of three leaves out. A peer that never answers is dropped."""
        samples = sorted(x for x in (ping(peer) for _ in range(self.probes)) if x is not None)
        self._measured_at_s[peer] = now_s
        if not samples:
            self._rtt_s.pop(peer, None)
            return None
        self._rtt_s[peer] = samples[len(samples) // 2]
        return self._rtt_s[peer]

    def view(self) -> dict[str, float]:
        """What the server announces: `ServerInfo.peer_rtt_s`."""
        return dict(self._rtt_s)
