"""The orchestrator's global prefix index: which servers hold which chained prefix hashes, for which
entry block and (scope ``client``) for which client (D2LPM's global radix tree, §5 of
papers/dlpm-locality-aware-fair-scheduling.txt; Preble's global prefix trees, §3.2).

A server's prefix cache (server/prefix_cache.py) keys a chunk by (namespace, hash) with namespace
``"{owner}|{first_block}"``: owner the client's peer id under ``--prefix-sharing client``, ``*`` under
``swarm``. The index keeps the same keys per server, so a chain's usable prefix is the minimum over
its hops of what each hop's server holds for the block the hop starts at
(`petals_chain.wire.prefix_keys.usable_prefix_tokens`).

The hashes are chained (hash i names the whole prefix up to chunk i), so a server's hold on a prompt
is the longest run of leading hashes present: a flat set per server is the radix tree.

Learned at grant time (`learn`: every hop will store the prompt's chunks after it ran them) and
corrected by the servers' reports of what they inserted and evicted (`apply`), asynchronously:
between a grant and a report the index may believe a chunk the server refused to store, which costs
one dispatch a worse chain, never a wrong output (the servers match again at open).

An entry learned at a grant that the server's reports have not confirmed (an insert) is dropped
``PROVISIONAL_REPORTS`` of its reports after the session that taught it ended (`settle`): the server
refused to store it (no memory), or the session never ran, and no report would ever mention it. The
clock starts at the session's end, not at the grant, because a server stores a prompt's chunks only
once it has run them: a prefill that takes longer than two report intervals (a long prompt, a busy
server) must not lose its entries before the server could report them, or the requests that share
the prefix and arrive meanwhile are dispatched as if nothing held it. A session that never settles
(its dispatcher was replaced by a new plan) leaves its entries provisional for at most
``PENDING_MAX_REPORTS`` reports.

Bounded: at most ``max_entries`` (server, namespace, hash) entries, least recently used dropped first.
Pure: no clock, no I/O, no lock (its owner holds one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from petals_chain.wire.prefix_keys import PREFIX_CHUNK_TOKENS, usable_prefix_tokens

SHARING_SCOPES = ("client", "swarm")
DEFAULT_MAX_ENTRIES = 1 << 18
PROVISIONAL_REPORTS = 2  # a learned entry no report confirmed this many reports after its session ended is dropped
PENDING_MAX_REPORTS = 64  # ... and one whose session never settled, this many reports after it was learned


@dataclass(frozen=True)
class HopKey:
    """One hop of a chain as the index sees it: the server and the first block it runs."""

    server: Hashable
    first_block: int


def namespace(sharing: str, client_id: str, first_block: int) -> str:
    """The servers' namespace (server/prefix_cache.py:PrefixCache.namespace) of a session's chunks."""
    owner = client_id if sharing == "client" else "*"
    return f"{owner}|{first_block}"


class PrefixIndex:
    def __init__(
        self,
        *,
        sharing: str = "client",
        max_entries: int = DEFAULT_MAX_ENTRIES,
        chunk_tokens: int = PREFIX_CHUNK_TOKENS,
    ):
        if sharing not in SHARING_SCOPES:
            raise ValueError(f"prefix sharing must be one of {', '.join(SHARING_SCOPES)}, got {sharing!r}")
        if max_entries < 1:
            raise ValueError(f"the prefix index needs max_entries >= 1, got {max_entries}")
        self.sharing = sharing
        self.max_entries = max_entries
        self.chunk_tokens = chunk_tokens
        self._entries: OrderedDict[tuple[Hashable, str, Hashable], None] = OrderedDict()  # LRU order, oldest first
        self._by_namespace: dict[tuple[Hashable, str], set] = {}  # (server, namespace) -> hashes: the lookups' view
        self.dropped_lru = 0  # entries pushed out by the bound (not by a server's eviction)
        # server -> learned, unconfirmed key -> [report count its clock started at, sessions still running]
        self._provisional: dict[Hashable, dict[tuple, list[int]]] = {}
        self._reports: dict[Hashable, int] = {}  # server -> reports applied
        self.dropped_unconfirmed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[Hashable, str, Hashable]) -> bool:
        return key in self._entries

    def entries(self) -> set[tuple[Hashable, str, Hashable]]:
        return set(self._entries)

    # -- lookups --------------------------------------------------------------------------
    def held_chunks(self, hop: HopKey, client_id: str, hashes: Sequence[Hashable], *, stored: bool = False) -> int:
        """Leading chunks of `hashes` the hop's server holds for this client (no side effects). With
        `stored`, only chunks it has stored already: not those a session still running on it is computing
        (learned at its grant, not yet confirmed by a report)."""
        ns = namespace(self.sharing, client_id, hop.first_block)
        held = self._by_namespace.get((hop.server, ns))
        if not held:
            return 0
        pending = self._provisional.get(hop.server, {}) if stored else {}
        n = 0
        for h in hashes:
            if h not in held:
                break
            rec = pending.get((hop.server, ns, h))
            if rec is not None and rec[1] > 0:
                break
            n += 1
        return n

    def chain_match_tokens(
        self,
        hops: Sequence[HopKey],
        client_id: str,
        hashes: Sequence[Hashable],
        prompt_tokens: int,
        *,
        stored: bool = False,
    ) -> int:
        """Tokens of the prompt a chain can reuse: min over its hops, whole chunks, one token left to run
        (`stored`: only what its servers hold now, see held_chunks)."""
        if not hashes or not hops:
            return 0
        held = [self.held_chunks(h, client_id, hashes, stored=stored) * self.chunk_tokens for h in hops]
        return usable_prefix_tokens(held, prompt_tokens, self.chunk_tokens)

    # -- updates --------------------------------------------------------------------------
    def learn(self, hops: Iterable[HopKey], client_id: str, hashes: Sequence[Hashable]) -> None:
        """A session with these hashes was granted a chain: each hop will hold its chunks once it ran them.
        The caller `settle`s the same hops and hashes when the session ends."""
        for hop in hops:
            ns = namespace(self.sharing, client_id, hop.first_block)
            mine = None
            for h in hashes:
                key = (hop.server, ns, h)
                if hop.server in self._reports:  # a reporting server: to be confirmed
                    if mine is None:
                        mine = self._provisional.setdefault(hop.server, {})
                    rec = mine.get(key)
                    if rec is not None:  # still unconfirmed: one more session waits for it
                        rec[0], rec[1] = self._reports[hop.server], rec[1] + 1
                    elif key not in self._entries:
                        mine[key] = [self._reports[hop.server], 1]
                self._touch(key)

    def settle(self, hops: Iterable[HopKey], client_id: str, hashes: Sequence[Hashable]) -> None:
        """A session `learn`ed with these hops and hashes ended: its unconfirmed entries now have
        PROVISIONAL_REPORTS reports of their server to be confirmed."""
        for hop in hops:
            mine = self._provisional.get(hop.server)
            if not mine:
                continue
            ns = namespace(self.sharing, client_id, hop.first_block)
            for h in hashes:
                rec = mine.get((hop.server, ns, h))
                if rec is not None and rec[1] > 0:
                    rec[1] -= 1
                    if rec[1] == 0:
                        rec[0] = self._reports[hop.server]

    def insert(self, server: Hashable, ns: str, h: Hashable) -> None:
        self._touch((server, ns, h))

    def evict(self, server: Hashable, ns: str, h: Hashable) -> None:
        if self._entries.pop((server, ns, h), 0) is None:
            self._unindex((server, ns, h))

    def apply(
        self, server: Hashable, inserted: Iterable[tuple[str, Hashable]], evicted: Iterable[tuple[str, Hashable]]
    ) -> None:
        """A server's report: chunks it stored and chunks it dropped since its last report, in that order
        within each list. Evictions are applied after inserts (a chunk inserted then evicted is gone)."""
        mine = self._provisional.get(server, {})
        for ns, h in inserted:
            mine.pop((server, ns, h), None)
            self._touch((server, ns, h))
        for ns, h in evicted:
            mine.pop((server, ns, h), None)
            self.evict(server, ns, h)
        self._reported(server)

    def _reported(self, server: Hashable) -> None:
        n = self._reports[server] = self._reports.get(server, 0) + 1
        mine = self._provisional.get(server)
        if mine:
            gone = [
                k
                for k, (at, running) in mine.items()
                if n - at >= (PENDING_MAX_REPORTS if running else PROVISIONAL_REPORTS)
            ]
            for key in gone:
                del mine[key]
                if self._entries.pop(key, 0) is None:
                    self._unindex(key)
                    self.dropped_unconfirmed += 1

    def replace_server(self, server: Hashable, held: Iterable[tuple[str, Hashable]]) -> None:
        """A server's full listing (after its restart, or when its report cursor was lost): what it holds
        replaces everything the index believed of it."""
        reports = self._reports.get(server, 0)
        self.forget_server(server)
        for ns, h in held:
            self._touch((server, ns, h))
        self._reports[server] = reports
        self._reported(server)

    def forget_server(self, server: Hashable) -> None:
        for key in [k for k in self._entries if k[0] == server]:
            del self._entries[key]
            self._unindex(key)
        self._provisional.pop(server, None)
        self._reports.pop(server, None)

    def held_by(self, server: Hashable) -> set[tuple[str, Hashable]]:
        return {(ns, h) for s, ns, h in self._entries if s == server}

    def _touch(self, key: tuple[Hashable, str, Hashable]) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        self._entries[key] = None
        self._by_namespace.setdefault(key[:2], set()).add(key[2])
        while len(self._entries) > self.max_entries:
            old, _ = self._entries.popitem(last=False)
            self._unindex(old)
            self._provisional.get(old[0], {}).pop(old, None)
            self.dropped_lru += 1

    def _unindex(self, key: tuple[Hashable, str, Hashable]) -> None:
        held = self._by_namespace[key[:2]]
        held.discard(key[2])
        if not held:
            del self._by_namespace[key[:2]]
