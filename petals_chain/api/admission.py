"""Admission of API requests into the swarm: at most `max_concurrent` sessions at once, the rest
wait, and a small policy class picks which waiting request goes next.

Every user of a gateway looks like one client to the servers (one libp2p peer), so the servers'
fair scheduler cannot tell the gateway's users apart: fairness across API keys has to happen here.
Policies are chosen by name (`--admission fifo|vtc`), like the servers' scheduling policies:

- `fifo`: arrival order, whoever the user.
- `vtc`: the servers' Virtual Token Counter (`petals_chain/algorithms/vtc.py`, one implementation) over API
  keys: the freed slot goes to the waiting user with the smallest counter; a user is charged
  `w_in` per prompt token when a request is admitted and `w_out` per generated token when it
  finishes (the gateway learns the count then); a user who becomes active is lifted, so idle time
  earns no credit. A heavy user's queue then cannot starve a light user's requests.
"""

from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from petals_chain.algorithms.vtc import VirtualTokenCounters


class CapacityError(Exception):
    """No slot freed up for the request within the gateway's queue timeout (HTTP 429)."""


@dataclass
class Ticket:
    seq: int
    user: str  # the API key's label (or "anonymous"): the unit of fairness
    input_tokens: int
    granted: asyncio.Future = field(repr=False, default=None)


class AdmissionPolicy(ABC):
    name: str

    @abstractmethod
    def choose(self, waiting: Sequence[Ticket]) -> Ticket:
        """The next ticket to admit from `waiting` (non-empty, in arrival order)."""

    def on_active(self, user: str, active: Collection[str]) -> None:
        """`user` had nothing waiting or running and now has a request; `active`: the users who do."""

    def on_admitted(self, user: str, input_tokens: int) -> None:
        """A request of `user` with this prompt got a slot."""

    def on_served(self, user: str, input_tokens: int, output_tokens: int) -> None:
        """A request of `user` finished after processing these tokens."""

    def on_idle(self, user: str) -> None:
        """`user` has nothing waiting or running any more."""


class FifoPolicy(AdmissionPolicy):
    """First come, first served, whoever the user."""

    name = "fifo"

    def choose(self, waiting):
        return waiting[0]


class VtcPolicy(AdmissionPolicy):
    """Virtual Token Counter over API keys (module docstring)."""

    name = "vtc"

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0):
        self.vtc = VirtualTokenCounters(w_in, w_out)

    def choose(self, waiting):
        user = self.vtc.pick({t.user for t in waiting}, tiebreak=lambda u: min(t.seq for t in waiting if t.user == u))
        return next(t for t in waiting if t.user == user)

    def on_active(self, user, active):
        self.vtc.lift(user, active)

    def on_admitted(self, user, input_tokens):
        self.vtc.charge(user, input_tokens=input_tokens)

    def on_served(self, user, input_tokens, output_tokens):
        self.vtc.charge(user, output_tokens=output_tokens)

    def on_idle(self, user):
        self.vtc.left(user)


ADMISSION_POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {"fifo": FifoPolicy, "vtc": VtcPolicy}


def make_admission_policy(name: str) -> AdmissionPolicy:
    try:
        return ADMISSION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown admission policy {name!r}; choose one of {', '.join(ADMISSION_POLICIES)}") from None


class AdmissionQueue:
    """Slots for concurrent sessions on one asyncio loop (all methods run on that loop)."""

    def __init__(self, max_concurrent: int, policy: AdmissionPolicy):
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self.max_concurrent = max_concurrent
        self.policy = policy
        self.active = 0
        self.running: Counter[str] = Counter()  # user -> requests holding a slot
        self.waiting: list[Ticket] = []
        self._seq = itertools.count()

    def _users(self) -> set[str]:
        return {u for u, n in self.running.items() if n > 0} | {t.user for t in self.waiting}

    def _admit(self, user: str, input_tokens: int) -> None:
        self.active += 1
        self.running[user] += 1
        self.policy.on_admitted(user, input_tokens)

    def _maybe_idle(self, user: str) -> None:
        if user not in self._users():
            self.running.pop(user, None)
            self.policy.on_idle(user)

    async def acquire(self, user: str, input_tokens: int, timeout_s: float) -> None:
        """Wait for a slot; raises CapacityError after `timeout_s`. Cancelling the wait (the client
        went away) gives the place up, or the slot back if it was granted in the meantime."""
        users = self._users()
        if user not in users:
            self.policy.on_active(user, users)
        if self.active < self.max_concurrent and not self.waiting:
            self._admit(user, input_tokens)
            return
        ticket = Ticket(next(self._seq), user, input_tokens, asyncio.get_running_loop().create_future())
        self.waiting.append(ticket)
        try:
            await asyncio.wait_for(asyncio.shield(ticket.granted), timeout_s)
        except BaseException as e:
            if ticket.granted.done():  # granted just as we gave up: hand the slot on
                self.release(user, 0, 0)
            else:
                self.waiting.remove(ticket)
                self._maybe_idle(user)
            if isinstance(e, asyncio.TimeoutError):
                raise CapacityError(
                    f"all {self.max_concurrent} session slots stayed busy for {timeout_s:.0f} s "
                    f"({len(self.waiting)} requests waiting); retry later"
                ) from None
            raise

    def release(self, user: str, input_tokens: int, output_tokens: int) -> None:
        self.policy.on_served(user, input_tokens, output_tokens)
        self.active -= 1
        self.running[user] -= 1
        self._maybe_idle(user)
        while self.waiting and self.active < self.max_concurrent:
            ticket = self.policy.choose(self.waiting)
            self.waiting.remove(ticket)
            self._admit(ticket.user, ticket.input_tokens)
            ticket.granted.set_result(None)
