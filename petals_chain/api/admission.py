"""Admission of API requests into the swarm: at most `max_concurrent` sessions at once, the rest
wait, and a small policy class picks which waiting request goes next.

Every user of a gateway looks like one client to the servers (one libp2p peer), so the servers'
fair scheduler cannot tell the gateway's users apart: fairness across API keys has to happen here.
Policies are chosen by name (`--admission fifo`), like the servers' scheduling policies; FIFO ships
now. The interface gives a fair policy what it needs: each waiting ticket's user and prompt length
(`choose`), and the service each finished request got (`on_served`), so a VTC-style policy
(papers/vtc-fairness-in-serving-llms.txt: serve the waiting user with the least weighted tokens
served) plugs in as one more class once the servers' VTC lands.
"""
from __future__ import annotations

import asyncio
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


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

    def on_served(self, user: str, input_tokens: int, output_tokens: int) -> None:
        """A request of `user` finished after processing these tokens."""


class FifoPolicy(AdmissionPolicy):
    """First come, first served, whoever the user."""

    name = "fifo"

    def choose(self, waiting):
        return waiting[0]


ADMISSION_POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {"fifo": FifoPolicy}


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
        self.waiting: list[Ticket] = []
        self._seq = itertools.count()

    async def acquire(self, user: str, input_tokens: int, timeout_s: float) -> None:
        """Wait for a slot; raises CapacityError after `timeout_s`. Cancelling the wait (the client
        went away) gives the place up, or the slot back if it was granted in the meantime."""
        if self.active < self.max_concurrent and not self.waiting:
            self.active += 1
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
            if isinstance(e, asyncio.TimeoutError):
                raise CapacityError(f"all {self.max_concurrent} session slots stayed busy for {timeout_s:.0f} s "
                                    f"({len(self.waiting)} requests waiting); retry later") from None
            raise

    def release(self, user: str, input_tokens: int, output_tokens: int) -> None:
        self.policy.on_served(user, input_tokens, output_tokens)
        self.active -= 1
        while self.waiting and self.active < self.max_concurrent:
            ticket = self.policy.choose(self.waiting)
            self.waiting.remove(ticket)
            self.active += 1
            ticket.granted.set_result(None)
