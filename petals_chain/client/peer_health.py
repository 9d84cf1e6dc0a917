"""`PeerHealth`: the servers a client has seen fail, banned with backoff for every session of the client.

A server that failed one session (a reset stream, a refused dial, a silent host, a typed "unavailable"
reply) is left out of every later chain the same client asks for (its `ChainProvider`'s `exclude`,
the orchestrator's `Acquire.exclude`) until its ban expires, so a gateway's sessions do not each
rediscover a dead server by failing on it. As PETALS' sequence manager does (its `banned_peers`
with `ban_timeout` and backoff rate 2): the first failure bans for `base_ban_s`, each further failure
without a success in between doubles the ban (up to `max_ban_s`), and a success (an open or a
forward that went through the server) forgets the failures. A ban that expired is remembered for
`forget_after_s` more (so a server that fails again at once gets the doubled ban), then dropped: the
list holds at most the servers that failed recently, whatever the number of sessions.

A server a spot check convicted of returning wrong hidden states (client/verification.py) is another
matter: `convict` bans it for the life of the list, and neither a success nor time lifts it (a server
that computes wrongly answers quickly). Convictions are in `banned()` like failures, so every session
of the client (a gateway's concurrent ones included) and every failover leaves the server out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from petals_chain.errors import InvalidRequestError

BASE_BAN_S = 15.0  # PETALS' default ban_timeout
BACKOFF_RATE = 2.0
MAX_BAN_S = 240.0  # 15 s doubled four times
FORGET_AFTER_S = 300.0


@dataclass(frozen=True)
class Ban:
    """One server's standing: `failures` in a row, banned until `until_s` (on the list's clock)."""

    failures: int
    until_s: float


class PeerHealth:
    """The one owner of a client's bans (thread-safe: every read and write holds its lock, never
    across I/O). `clock`: seconds, monotonic (injected so tests step time)."""

    def __init__(
        self,
        *,
        base_ban_s: float = BASE_BAN_S,
        backoff_rate: float = BACKOFF_RATE,
        max_ban_s: float = MAX_BAN_S,
        forget_after_s: float = FORGET_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not (0 < base_ban_s <= max_ban_s) or backoff_rate < 1 or forget_after_s < 0:
            raise InvalidRequestError(
                f"PeerHealth needs 0 < base_ban_s <= max_ban_s, backoff_rate >= 1 and "
                f"forget_after_s >= 0; got base_ban_s={base_ban_s}, max_ban_s={max_ban_s}, "
                f"backoff_rate={backoff_rate}, forget_after_s={forget_after_s}"
            )
        self.base_ban_s = base_ban_s
        self.backoff_rate = backoff_rate
        self.max_ban_s = max_ban_s
        self.forget_after_s = forget_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._bans: dict[str, Ban] = {}
        self._convicted: set[str] = set()  # caught returning wrong hidden states: banned for good

    def ban_s(self, failures: int) -> float:
        """How long the `failures`-th failure in a row bans a server."""
        return min(self.max_ban_s, self.base_ban_s * self.backoff_rate ** (failures - 1))

    def report_failure(self, peer_id: str) -> float:
        """`peer_id` failed: ban it (longer after each failure in a row); returns the ban's length in seconds."""
        with self._lock:
            now = self.clock()
            self._forget_old(now)
            before = self._bans.get(peer_id)
            if before is not None and now < before.until_s:
                # a failure seen while the ban still runs (another session that used it meanwhile, or
                # one that had it before it was banned) is the same outage, not one more in a row
                return before.until_s - now
            failures = 1 if before is None else before.failures + 1
            ban_s = self.ban_s(failures)
            self._bans[peer_id] = Ban(failures, now + ban_s)
            return ban_s

    def report_success(self, peer_ids: Iterable[str]) -> None:
        """These servers served a request: their failures are forgotten."""
        with self._lock:
            for p in peer_ids:
                self._bans.pop(p, None)

    def banned(self) -> frozenset[str]:
        """The servers banned now (failed lately, or convicted)."""
        with self._lock:
            now = self.clock()
            self._forget_old(now)
            return frozenset(p for p, b in self._bans.items() if now < b.until_s) | self._convicted

    def convict(self, peer_id: str) -> bool:
        """`peer_id` was caught returning wrong hidden states: banned for the life of this list (a
        success does not lift it, time does not expire it). True if it was not convicted before."""
        with self._lock:
            new = peer_id not in self._convicted
            self._convicted.add(peer_id)
            return new

    def convicted(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._convicted)

    def forget_convictions(self) -> None:
        """Lift every conviction, and the failure bans of the convicted servers' failovers (benchmarks
        and tests whose next trial must meet a caught server anew)."""
        with self._lock:
            for p in self._convicted:
                self._bans.pop(p, None)
            self._convicted.clear()

    def standing(self, peer_id: str) -> Ban | None:
        with self._lock:
            return self._bans.get(peer_id)

    def __len__(self) -> int:
        """Servers remembered for failures (banned, or expired within `forget_after_s`); convictions
        are not counted (`convicted()`)."""
        with self._lock:
            return len(self._bans)

    def _forget_old(self, now: float) -> None:
        # under the lock; the list is as long as the servers that failed lately, so a scan is cheap
        old = [p for p, b in self._bans.items() if now >= b.until_s + self.forget_after_s]
        for p in old:
            del self._bans[p]
