"""Prefix KV cache of a block server: KV of recently served prompt prefixes, reused by new sessions.

Keys are chained chunk hashes computed by the client (`petals_chain/wire/prefix_keys.py`): the prompt is
cut into chunks of `chunk_tokens` token ids and the hash of chunk i covers chunk i's ids and the
hash of chunk i-1, so one hash names a whole prefix. The server never sees token ids (hop 0 gets
embeddings, later hops hidden states); it stores, per chunk, the KV its blocks computed for those
positions, as a tree of chunks (a chunk's parent is the chunk before it, SGLang's radix cache with
fixed-size edges).

Namespaces keep what must not mix apart: the entry block (KV of blocks [first, end)), and with
`--prefix-sharing client` the authenticated peer id of the client, so one client never hits
another's prompt. With `swarm`, clients share: faster, but a hit is visible in timing (see README,
Security) and the server trusts every client's hashes.

Memory: every chunk is a reservation in the server's `KVBudget` (eq. 1 holds with the cache in
it); an unpinned chunk without children can be evicted, least recently used first, whenever a
session or a newer chunk needs the memory. A session that matched a prefix at open pins the
chunks until it has copied them into its own cache (its first step) or closed. All methods run
under the budget's re-entrant lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from petals_chain.errors import InvalidRequestError, OutOfCacheError
from petals_chain.runtime.kv_cache import SessionKV
from server.memory import KVBudget
from server.prefix_report import PrefixReport

SHARING_SCOPES = ("client", "swarm")


@dataclass
class _Chunk:
    key: tuple[str, str]  # (namespace, chained hash)
    parent: tuple[str, str] | None
    keys: torch.Tensor  # [blocks, kv_heads, chunk_tokens, head_dim]
    values: torch.Tensor
    nbytes: int
    last_used: int
    children: int = 0
    pins: int = 0


@dataclass
class PrefixPin:
    """Chunks one session matched at open, pinned until it copied them or closed."""

    chunks: list[tuple[str, str]]
    chunk_tokens: int
    released: bool = False

    @property
    def tokens(self) -> int:
        return len(self.chunks) * self.chunk_tokens


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hit_tokens: int = 0  # tokens sessions took from the cache
    asked_tokens: int = 0  # tokens of full chunks sessions asked about
    inserted_chunks: int = 0
    evicted_chunks: int = 0
    insert_refused: int = 0  # chunks not stored: no memory even after eviction
    by_client: dict[str, list[int]] = field(default_factory=dict)  # client -> [hit tokens, asked tokens]


class PrefixCache:
    def __init__(self, budget: KVBudget, chunk_tokens: int, *, sharing: str = "client", max_bytes: int | None = None):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if sharing not in SHARING_SCOPES:
            raise InvalidRequestError(f"--prefix-sharing must be one of {', '.join(SHARING_SCOPES)}, got {sharing!r}")
        self.budget = budget
        self.chunk_tokens = chunk_tokens
        self.sharing = sharing
        self.max_bytes = max_bytes  # None: as much as the budget has free
        self.stats = PrefixCacheStats()
        self._chunks: dict[tuple[str, str], _Chunk] = {}
        self._bytes = 0
        self._tick = itertools.count()
        budget.attach_reclaimer(self)  # the cache's chunks are what a session may evict
        self.report = PrefixReport(self.held_keys)  # inserts and evictions, for the orchestrator's index

    # -- keys -------------------------------------------------------------------------------
    def namespace(self, client_id: str, first_block: int, adapter: str | None = None) -> str:
        owner = client_id if self.sharing == "client" else "*"
        return f"{owner}|{first_block}" + (f"|{adapter}" if adapter is not None else "")

    def held_keys(self) -> list[tuple[str, str]]:
        with self.budget.lock:
            return list(self._chunks)

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._chunks

    # -- lookups ----------------------------------------------------------------------------
    def match(self, namespace: str, hashes: Sequence[str]) -> int:
        """How many leading chunks of `hashes` this server holds (no side effects)."""
        with self.budget.lock:
            n = 0
            for h in hashes:
                if (namespace, h) not in self._chunks:
                    break
                n += 1
            return n

    def pin(self, namespace: str, hashes: Sequence[str], client_id: str = "") -> PrefixPin:
        """Pin the longest held prefix of `hashes` (marking it recently used) and count the lookup."""
        with self.budget.lock:
            n = self.match(namespace, hashes)
            keys = [(namespace, h) for h in hashes[:n]]
            tick = next(self._tick)
            for k in keys:
                chunk = self._chunks[k]
                chunk.pins += 1
                chunk.last_used = tick
            self.stats.lookups += 1
            return PrefixPin(keys, self.chunk_tokens)

    def unpin(self, pin: PrefixPin) -> None:
        with self.budget.lock:
            if pin.released:
                return
            pin.released = True
            for k in pin.chunks:
                chunk = self._chunks.get(k)
                if chunk is not None:
                    chunk.pins -= 1

    def check_take(self, pin: PrefixPin, use_tokens: int, kv: SessionKV) -> None:
        """Refuse (typed) what `take` would refuse, changing nothing (a server checks a first step
        whole before any of it happens)."""
        if pin.released:
            raise InvalidRequestError("prefix_tokens must come with the session's first step")
        if use_tokens < 0 or use_tokens % self.chunk_tokens or use_tokens > pin.tokens:
            raise InvalidRequestError(
                f"prefix_tokens={use_tokens} must be a multiple of {self.chunk_tokens} and at most the "
                f"{pin.tokens} tokens this server matched at open (send the minimum over the chain's hops)"
            )
        if kv.past_tokens != 0 or use_tokens > kv.max_length_tokens:
            raise InvalidRequestError("prefix_tokens must come with the session's first step, within max_length")

    def take(self, pin: PrefixPin, use_tokens: int, kv: SessionKV, client_id: str = "") -> int:
        """Copy the first `use_tokens` (a multiple of chunk_tokens, at most the pinned prefix) of the
        pinned prefix into the session's empty cache and unpin; returns the tokens copied."""
        with self.budget.lock:
            self.check_take(pin, use_tokens, kv)
            c = self.chunk_tokens
            for i, k in enumerate(pin.chunks[: use_tokens // c]):
                chunk = self._chunks[k]  # pinned: still here
                kv.keys[:, :, i * c : (i + 1) * c] = chunk.keys
                kv.values[:, :, i * c : (i + 1) * c] = chunk.values
            kv.past_tokens = use_tokens
            self.stats.hit_tokens += use_tokens
            per_client = self.stats.by_client.setdefault(client_id, [0, 0])
            per_client[0] += use_tokens
            self.unpin(pin)
            return use_tokens

    def count_asked(self, client_id: str, tokens: int) -> None:
        with self.budget.lock:
            self.stats.asked_tokens += tokens
            self.stats.by_client.setdefault(client_id, [0, 0])[1] += tokens

    # -- storing ----------------------------------------------------------------------------
    def insert(self, namespace: str, hashes: Sequence[str], kv: SessionKV) -> int:
        """Store the chunks of `hashes` that the session's cache now holds (full chunks below
        kv.past_tokens) and this server does not; returns the chunks added. Stops at the first chunk
        for which no memory can be had: the cache is opportunistic, a session's memory comes first."""
        c = self.chunk_tokens
        n = min(len(hashes), kv.past_tokens // c)
        added = 0
        with self.budget.lock:
            path: list[_Chunk] = []  # pinned while inserting, so eviction cannot cut our own parents
            try:
                parent = None
                for i in range(n):
                    key = (namespace, hashes[i])
                    chunk = self._chunks.get(key)
                    if chunk is None:
                        keys = kv.keys[:, :, i * c : (i + 1) * c].clone()
                        values = kv.values[:, :, i * c : (i + 1) * c].clone()
                        nbytes = keys.numel() * keys.element_size() * 2
                        if self.max_bytes is not None and self._bytes + nbytes > self.max_bytes:
                            self.evict(self._bytes + nbytes - self.max_bytes)
                            if self._bytes + nbytes > self.max_bytes:
                                self.stats.insert_refused += 1
                                break
                        try:
                            self.budget.reserve(self._budget_key(key), nbytes, cache=True)
                        except OutOfCacheError:
                            self.stats.insert_refused += 1
                            break
                        chunk = _Chunk(key, parent, keys, values, nbytes, next(self._tick))
                        self._chunks[key] = chunk
                        self._bytes += nbytes
                        if parent is not None:
                            self._chunks[parent].children += 1
                        self.stats.inserted_chunks += 1
                        self.report.inserted(*key)
                        added += 1
                    else:
                        chunk.last_used = next(self._tick)
                    chunk.pins += 1
                    path.append(chunk)
                    parent = key
            finally:
                for chunk in path:
                    chunk.pins -= 1
        return added

    # -- eviction (the budget's Reclaimer) -----------------------------------------------------
    def _budget_key(self, key: tuple[str, str]) -> str:
        return f"prefix-cache/{key[0]}/{key[1]}"

    def _evictable(self, chunk: _Chunk) -> bool:
        return chunk.pins == 0 and chunk.children == 0

    def evictable_bytes(self) -> int:
        """Bytes eviction can free: every chunk whose subtree holds no pinned chunk (evicting
        leaves one by one frees whole unpinned subtrees)."""
        with self.budget.lock:
            blocked: set[tuple[str, str]] = set()
            for chunk in self._chunks.values():
                if chunk.pins:
                    k: tuple[str, str] | None = chunk.key
                    while k is not None and k not in blocked:
                        blocked.add(k)
                        k = self._chunks[k].parent
            return sum(ch.nbytes for k, ch in self._chunks.items() if k not in blocked)

    def evict(self, nbytes: int) -> int:
        """Evict unpinned leaves, least recently used first, until `nbytes` are freed or none is left."""
        freed = 0
        with self.budget.lock:
            while freed < nbytes:
                victims = [ch for ch in self._chunks.values() if self._evictable(ch)]
                if not victims:
                    break
                victim = min(victims, key=lambda ch: ch.last_used)
                freed += self._drop(victim)
        return freed

    def _drop(self, chunk: _Chunk) -> int:
        del self._chunks[chunk.key]
        if chunk.parent is not None:
            self._chunks[chunk.parent].children -= 1
        self._bytes -= chunk.nbytes
        self.budget.release(self._budget_key(chunk.key))
        self.stats.evicted_chunks += 1
        self.report.evicted(*chunk.key)
        return chunk.nbytes

    def clear(self) -> None:
        with self.budget.lock:
            while self._chunks:
                if not self.evict(1):
                    break

    def view(self) -> dict:
        with self.budget.lock:
            s = self.stats
            return {
                "chunks": len(self._chunks),
                "cached_bytes": self._bytes,
                "chunk_tokens": self.chunk_tokens,
                "sharing": self.sharing,
                "hit_tokens": s.hit_tokens,
                "asked_tokens": s.asked_tokens,
                "hit_rate": s.hit_tokens / s.asked_tokens if s.asked_tokens else 0.0,
                "evicted_chunks": s.evicted_chunks,
                "insert_refused": s.insert_refused,
            }
