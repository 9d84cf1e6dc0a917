"""The orchestrator's reader of the servers' prefix-cache reports (server/prefix_report.py): one cursor
(epoch, next seq) per server, advanced by each `rpc_info` reply, so the global prefix index
(orchestrator/prefix_index.py, owned by Sessions) converges to what the servers' caches hold after churn,
eviction and restarts: a restarted server answers from a new epoch with its full listing.

Runs on the service thread, outside the lock for the round trips (as the batch records' reader does).
"""

from __future__ import annotations

import logging

from hivemind.p2p import PeerID

from petals_chain.transport.protocol import BlockService
from petals_chain.wire import codec as wire
from petals_chain.wire import records as wire_records

logger = logging.getLogger(__name__)


def fetch_prefix_delta(
    loop, p2p, peer_id: str, since_seq: int, epoch: str | None, *, timeout_s: float = 3.0
) -> wire_records.PrefixDelta | None:
    """A server's prefix-cache changes after (epoch, since_seq); None when it does not answer or keeps none."""
    stub = BlockService.get_stub(p2p, PeerID.from_base58(peer_id))
    req = wire_records.InfoRequest(prefix_since_seq=since_seq, prefix_epoch=epoch)
    try:
        resp = loop.run(stub.rpc_info(wire.request(req), timeout=timeout_s), timeout_s=timeout_s + 1)
        return wire.decode_reply(wire.unpack(resp.metadata), wire_records.InfoReply).prefix
    except Exception as e:  # an unreachable server is the membership loop's business
        logger.debug("prefix report of %s: %s", peer_id[-8:], e)
        return None


class PrefixReportReader:
    def __init__(self):
        self.cursors: dict[str, tuple[str, int]] = {}  # peer -> (epoch, next seq)
        self.full_listings = 0
        self.reports = 0

    def apply(self, sessions, peer_id: str, delta: wire_records.PrefixDelta) -> None:
        """One reply into the index (Sessions.prefix_report takes the lock)."""
        sessions.prefix_report(
            peer_id, [tuple(x) for x in delta.inserted], [tuple(x) for x in delta.evicted], full=delta.full
        )
        self.cursors[peer_id] = (delta.epoch, delta.next_seq)
        self.reports += 1
        self.full_listings += int(delta.full)

    def collect(self, loop, p2p, sessions, peers: list[str]) -> None:
        for p in list(self.cursors):
            if p not in peers:
                del self.cursors[p]
        for p in peers:
            epoch, seq = self.cursors.get(p, (None, 0))
            delta = fetch_prefix_delta(loop, p2p, p, seq, epoch)
            if delta is not None:
                self.apply(sessions, p, delta)
