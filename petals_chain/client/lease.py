"""`Lease`: a session's hold on its chain with its `ChainProvider` (with an orchestrator: the slot JFFC
counts it on), acquired and released in this one place.

A lease is acquired at open (`acquire`), moved by a whole-chain failover (`acquire` again under the
same session id: the orchestrator moves the session to the new chain), handed back while an open
waits for a full server (`give_back`, then `acquire`), and released once at the end (`release`):
every hold is released at most once, so a second `release` (a close after a failed open, a close
from another thread) sends nothing. What the provider granted (the orchestrator's `ChainGrant`: its
wait in the queue, chain id, plan version) is kept here, on the session, so a long-lived provider
keeps nothing of a session once it ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from petals_chain.client.routing import ChainProvider
from petals_chain.errors import PetalsChainError
from petals_chain.wire.messages import ChainGrant, Hop


class LeaseClosedError(PetalsChainError):
    """A released lease was asked to acquire again: a session cannot run after its close."""


class Lease:
    def __init__(
        self,
        provider: ChainProvider,
        session_id: str,
        *,
        num_blocks: int,
        max_length: int,
        adapter: str | None = None,
        prompt: dict | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.provider = provider
        self.prompt = dict(prompt or {})  # prefix_hashes / prompt_tokens, for a provider that dispatches by them
        self.session_id = session_id
        self.num_blocks = num_blocks
        self.max_length = max_length
        self.adapter = adapter
        self.clock = clock
        # `release` may come from another thread than the session's (a gateway's close on cancel):
        # the hold's state changes under the lock, the provider's RPC runs outside it
        self._lock = threading.Lock()
        self._held = False
        self._released = False  # final: no acquire after it
        self.hops: list[Hop] = []  # the chain of the latest acquire
        self.grant: ChainGrant | None = None  # the latest grant (None: client-side routing)
        self.granted_at_s: float | None = None  # `clock()` when that grant arrived
        self.acquires = 0
        self.releases = 0  # holds handed back to the provider (give_back and release)

    @property
    def held(self) -> bool:
        with self._lock:
            return self._held

    def acquire(self, exclude: frozenset[str]) -> list[Hop]:
        """A whole chain for the session, avoiding `exclude`; while held already, the lease moves to it."""
        with self._lock:
            if self._released:
                raise LeaseClosedError(f"session {self.session_id[:8]} is closed; open a new session")
        acquired = self.provider.acquire(
            0,
            self.num_blocks,
            exclude=exclude,
            max_length=self.max_length,
            session_id=self.session_id,
            adapter=self.adapter,
            **self.prompt,
        )
        with self._lock:
            closed_meanwhile = self._released  # released by another thread while the acquire was in flight
            self._held = True
            self.acquires += 1
            self.hops = list(acquired.hops)
            if acquired.grant is not None:
                self.grant, self.granted_at_s = acquired.grant, self.clock()
        if closed_meanwhile:
            self._end(list(acquired.hops), final=True)
            raise LeaseClosedError(f"session {self.session_id[:8]} was closed while it acquired a chain")
        return self.hops

    def find_span(self, start: int, ends: frozenset[int], exclude: frozenset[str]) -> list[Hop]:
        """Hops replacing one span of the chain (client-side routing's failover; the lease stays as it is)."""
        return self.provider.find_span(
            start, ends, exclude=exclude, max_length=self.max_length, session_id=self.session_id, adapter=self.adapter
        )

    def give_back(self) -> None:
        """Hand the hold back while the session waits (it will `acquire` again)."""
        self._end(list(self.hops), final=False)

    def release(
        self, hops: list[Hop], *, input_tokens: int = 0, output_tokens: int = 0, hop_timings: tuple = ()
    ) -> None:
        """The session ended on `hops`: release its hold (once; later calls are no-ops) with what it ran
        (the orchestrator refines its estimates from the lengths and the hops' timings)."""
        self._end(hops, final=True, input_tokens=input_tokens, output_tokens=output_tokens, hop_timings=hop_timings)

    def _end(self, hops: list[Hop], *, final: bool, **report) -> None:
        with self._lock:
            send = self._held
            self._held = False
            self._released = self._released or final
            if send:
                self.releases += 1
        if send:
            self.provider.session_finished(hops, session_id=self.session_id, **report)
