"""What a session needs from the client it runs on (`SessionContext`, frozen), and `RelayDialer`, the
one owner of the client's view of which servers sit behind NATs.

`RemoteChain` builds a context for each session it opens; the session reads nothing else of it, so
`remote_session.py` does not import `remote.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from petals_chain.client.hop_client import HopClient
from petals_chain.client.peer_health import PeerHealth
from petals_chain.client.recovery import BUSY_BACKOFF_S
from petals_chain.client.routing import ChainProvider
from petals_chain.process.loop import BackgroundLoop
from petals_chain.swarm.reachability import RelayRoutes
from petals_chain.wire.records import ServerInfo

RELAY_RECORDS_REFRESH_S = 5.0  # servers' records are re-read for relay routes at most this often
RELAY_CONNECT_S = 15.0  # per relayed server: connecting through its relays


class RelayDialer:
    """Connects to relayed servers through their relays before a session talks to them
    (`petals_chain/swarm/reachability.py`); learns who is relayed from the servers' DHT records,
    read again when a peer is new to it (at most every `refresh_s`).

    Its routes (`RelayRoutes`) are confined to the client's event loop: only coroutines on that
    loop's one thread read or write them (`dial` hands its work to the loop; `relayed` is called by
    the session's step coroutines there), so the sessions of many threads share it without a lock."""

    def __init__(
        self,
        loop: BackgroundLoop,
        p2p,
        fetch_records: Callable[[], list[ServerInfo]],
        *,
        refresh_s: float = RELAY_RECORDS_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.loop = loop
        self.p2p = p2p
        self.fetch_records = fetch_records
        self.refresh_s = refresh_s
        self.clock = clock
        self._routes = RelayRoutes()
        self._records_read_s = -1e18

    def dial(self, peer_ids: Iterable[str]) -> None:
        """From a session's thread (never the loop's): connect to the relayed ones among `peer_ids`."""
        peers = list(peer_ids)
        self.loop.run(self._dial(peers), timeout_s=RELAY_CONNECT_S * (len(peers) + 1))

    async def _dial(self, peer_ids: list[str]) -> None:
        now = self.clock()
        if any(p not in self._routes.known for p in peer_ids) and now - self._records_read_s >= self.refresh_s:
            self._records_read_s = now  # before the read: a dial meanwhile does not read them again
            # the DHT read blocks (its own process answers through a pipe): off the loop
            self._routes.update(await asyncio.to_thread(self.fetch_records))
        for p in peer_ids:
            if self._routes.relayed(p):
                await asyncio.wait_for(self._routes.connect(self.p2p, p), RELAY_CONNECT_S)

    def relayed(self, peer_id: str) -> bool:
        """On the loop only (see the class docstring)."""
        return self._routes.relayed(peer_id)


@dataclass(frozen=True)
class SessionContext:
    """The client's parts a `RemoteChainSession` uses, fixed when it opens."""

    model: str  # the model's DHT key (prefix hashes are per model)
    num_blocks: int
    dtype: torch.dtype
    step_timeout_s: float
    max_failovers: int
    server_relay: bool  # True: each hop pushes its output to the next (relay="server")
    loop: BackgroundLoop
    hops: HopClient
    provider: ChainProvider
    peer_health: PeerHealth  # shared by every session of the client
    relays: RelayDialer
    busy_backoff_s: tuple[float, ...] = BUSY_BACKOFF_S
