"""`Recovery`: the one failover loop of the client, used by a session's open, its steps (and the
reopen of an idle stream inside a step), and a stateless forward.

An operation runs `attempt()`; each server failure it raises (`HopFailed`) is counted against one
`max_failovers` budget for the whole operation (a session: its open and all its steps), the failed
server is banned in the client's `PeerHealth` (shared by every session of the client, with backoff),
and `repair(failed, decision)` rebuilds what the attempt needs (a new chain, a replaced span, and the
replay of the session's history); a repair that fails the same way (a replacement killed moments
ago that the records still list) is counted and repaired in turn. Then the attempt runs again.

What a failure means is decided here once (`Decision`): a stateless forward whose server still
answers its ping runs again on it once (`SAME`: a stream that broke on a live server); an open refused
for want of KV memory waits and asks again (`WAIT`: the server is full, not failed, and is not
banned); a server that closed the session because it moves to other blocks (`ServerMovingError`: a
re-plan's drain deadline) is replaced for this operation but not banned (it is healthy, and serves
its new blocks a moment later); anything else replaces the server (`REPLACE`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from petals_chain.client.hop_client import HopFailed
from petals_chain.client.peer_health import PeerHealth
from petals_chain.errors import NoChainError, OutOfCacheError, ServerMovingError, ServerUnavailableError

logger = logging.getLogger(__name__)
T = TypeVar("T")

# An open refused for want of KV memory (OutOfCacheError: the server is up, only full, and its own
# admission queue already waited --admission-timeout) is asked again after these waits, beside the
# failover budget, nothing banned. Why: the orchestrator counts a chain's free slots at its planned
# session length, so a session longer than that can be granted a chain whose server cannot hold it
# yet; banning a full server at each try lost Table 1 requests that failed over from full server to
# full server.
BUSY_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 8.0, 8.0)


class Action(StrEnum):
    SAME = "same"  # run the attempt again on the same servers
    WAIT = "wait"  # the server is full: give the chain back, wait `wait_s`, ask for a chain again
    REPLACE = "replace"  # the server is banned: replace it


@dataclass(frozen=True)
class Decision:
    action: Action
    wait_s: float = 0.0


class Recovery:
    """One operation's failover budget and its loop (`run`). `avoid`: servers the operation must
    never use (the Table 1 model probe measures one chain alone by avoiding every other server);
    `ping_s` (stateless forwards): a failed server that still answers is retried once."""

    def __init__(
        self,
        max_failovers: int,
        health: PeerHealth,
        *,
        avoid: Iterable[str] = (),
        ping_s: Callable[[str], float | None] | None = None,
        busy_backoff_s: tuple[float, ...] = BUSY_BACKOFF_S,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.max_failovers = max_failovers
        self.health = health
        self.avoid = frozenset(avoid)
        self.ping_s = ping_s
        self.busy_backoff_s = busy_backoff_s
        self.sleep = sleep  # the wait for a full server (injected so tests do not wait)
        self.failovers = 0
        self.busy = 0  # opens refused for want of memory so far
        self.failed_peers: set[str] = set()  # servers this operation saw fail (what it reports; bans are `health`'s)
        self.moved_peers: set[str] = set()  # servers that closed it to move (avoided by it, banned by nobody)
        self._retried: set[str] = set()

    def exclude(self) -> frozenset[str]:
        """The servers a chain asked for now must not use: the avoided ones, those that moved away from
        this operation and those banned now."""
        return self.avoid | self.moved_peers | self.health.banned()

    def ask(self, find: Callable[[frozenset[str]], T]) -> T:
        """`find(exclude)` (a provider's chain or span), asked once more when it finds none
        (`NoChainError`) and bans expired meanwhile: a ban keeps a server out of new chains while
        others exist, and a provider's wait for a chain can outlast a ban."""
        exclude = self.exclude()
        try:
            return find(exclude)
        except NoChainError:
            now = self.exclude()
            if now == exclude:
                raise
            return find(now)

    def run(
        self,
        attempt: Callable[[], T],
        repair: Callable[[HopFailed, Decision], None],
        what: str,
        *,
        busy_waits: bool = False,
    ) -> T:
        """`attempt()`'s result, repairing after each server failure until the budget is spent
        (then `ServerUnavailableError`). `busy_waits`: a server refusing for want of memory is waited
        for (an open) rather than replaced. Errors other than `HopFailed` propagate unchanged."""
        while True:
            try:
                return attempt()
            except HopFailed as failed:
                pending = failed
            while True:
                decision = self.decide(pending, what, busy_waits=busy_waits)
                try:
                    repair(pending, decision)
                    break
                except HopFailed as again:
                    logger.warning("%s: replacement %s failed too (%s)", what, again.hop.describe(), again.error)
                    pending = again

    def decide(self, failed: HopFailed, what: str, *, busy_waits: bool = False) -> Decision:
        """What to do about `failed` (see the module docstring); raises ServerUnavailableError once the
        budget is spent (`what` names the operation)."""
        if busy_waits and isinstance(failed.error, OutOfCacheError) and self.busy < len(self.busy_backoff_s):
            wait_s = self.busy_backoff_s[self.busy]
            self.busy += 1
            logger.info(
                "%s: server %s is full (%s); asking again in %.0f s", what, failed.hop.describe(), failed.error, wait_s
            )
            return Decision(Action.WAIT, wait_s)
        self.failovers += 1
        peer = failed.hop.peer_id
        moved = isinstance(failed.error, ServerMovingError)
        if self.failovers > self.max_failovers:
            # the operation gives up, but the server did fail: later sessions should not try it either
            if not moved:
                self.failed_peers.add(peer)
                self.health.report_failure(peer)
            raise ServerUnavailableError(
                f"{what} gave up after {self.max_failovers} failovers; last: {failed.error}"
            ) from failed.error
        if moved:
            # not a failure of the server: its blocks are elsewhere now (the session's KV is gone with them)
            self.moved_peers.add(peer)
            logger.info(
                "%s: server %s moves to other blocks (%s); failing over", what, failed.hop.describe(), failed.error
            )
            return Decision(Action.REPLACE)
        if self.ping_s is not None and peer not in self._retried and self.ping_s(peer) is not None:
            self._retried.add(peer)
            logger.warning(
                "%s: server %s failed (%s) but answers; retrying it once", what, failed.hop.describe(), failed.error
            )
            return Decision(Action.SAME)
        self.failed_peers.add(peer)
        ban_s = self.health.report_failure(peer)
        logger.warning(
            "%s: server %s failed (%s); banned for %.0f s, asking for a replacement",
            what,
            failed.hop.describe(),
            failed.error,
            ban_s,
        )
        return Decision(Action.REPLACE)
