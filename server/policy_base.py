"""The interface of a block server's scheduling policies and the records it passes them.

`server/policies.py` describes the contract and holds FCFS, VTC and the registry; DLPM lives in
`server/policy_dlpm.py`. Both build on these classes.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkItem:
    """A run of consecutive new tokens of one session's step, waiting for the server's compute."""

    seq: int  # arrival order at this server (a cut remainder gets a new one)
    session_id: str  # the server's key of the open session (unique per stream)
    client_id: str  # the client's libp2p peer id, authenticated by the transport
    n_tokens: int  # new tokens in this item (prefill chunk: many; decode: 1)
    past_tokens: int  # tokens already in the session's cache when this item runs
    enqueued_s: float
    payload: Any = None  # the scheduler's job this item belongs to
    row_offset: int = 0  # first row of the job's step that this item covers
    is_prefill: bool = False  # prompt tokens (a step of several tokens, or a session's first)
    prefix_tokens: int = 0  # tokens of its session's prompt taken from the prefix cache (DLPM's locality)
    deliver: Callable[[Any, BaseException | None], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.is_prefill = self.is_prefill or self.n_tokens > 1 or self.past_tokens == 0

    def split(self, head_tokens: int, seq: int) -> "WorkItem":
        """Keep the first `head_tokens` rows here; return the rest as a new item (arrival `seq`)."""
        if not 0 < head_tokens < self.n_tokens:
            raise ValueError(f"cannot cut {head_tokens} of {self.n_tokens} tokens")
        tail = WorkItem(
            seq,
            self.session_id,
            self.client_id,
            self.n_tokens - head_tokens,
            self.past_tokens + head_tokens,
            self.enqueued_s,
            self.payload,
            self.row_offset + head_tokens,
            True,
            prefix_tokens=self.prefix_tokens,
            deliver=self.deliver,
        )
        self.n_tokens = head_tokens
        return tail


@dataclass(frozen=True)
class AdmissionRequest:
    """A session that asked to open while the server's KV budget was full."""

    seq: int
    session_id: str
    client_id: str
    kv_bytes: int
    enqueued_s: float
    prefix_match_tokens: int = 0  # of its prompt, the server's prefix cache holds this many tokens now


@dataclass(frozen=True)
class PolicyParam:
    kind: type
    default: Any
    help: str
    minimum: float | None = None


class SchedulingPolicy(ABC):
    """The interface the scheduler drives. Subclasses keep their own queue structure."""

    name: str = ""
    PARAMS: dict[str, PolicyParam] = {}

    def __init__(self, **params: Any):
        self.params = params
        # one arrival order for new steps and cut remainders alike: the scheduler numbers submitted
        # steps with next_seq() too, so a remainder sorts after exactly what arrived before the cut
        self._seq = itertools.count()

    # -- the waiting queue --------------------------------------------------------------------
    @abstractmethod
    def enqueue(self, item: WorkItem) -> None:
        """An item joins the queue."""

    @abstractmethod
    def select(self, max_batch_tokens: int, prefill_tokens: int | None = None) -> list[WorkItem]:
        """Take the next batch out of the queue: non-empty when work waits, at most one item per
        session, at most `max_batch_tokens` tokens in all (cut a prefill with `take_within`), of
        which at most `prefill_tokens` prompt rows (None: no separate limit). The scheduler sets
        `prefill_tokens` while sessions decode, so that their next step never waits behind a long
        batch of others' prompt chunks; decode steps are never held back by it."""

    @abstractmethod
    def remove(self, session_id: str) -> list[WorkItem]:
        """Take out every waiting item of a session (closed, cancelled, or failed) and return them."""

    @abstractmethod
    def drain(self) -> list[WorkItem]:
        """Take out and return everything that waits."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of waiting items."""

    # -- admission and accounting ---------------------------------------------------------------
    def admit(self, waiting: Sequence[AdmissionRequest]) -> AdmissionRequest:
        """Which of the sessions waiting to open (all fit the freed memory) gets it: the earliest."""
        return min(waiting, key=lambda r: r.seq)

    def on_admission_wait(self, request: AdmissionRequest) -> None:
        """A session started waiting for KV memory (its client has work waiting, e.g. for DLPM's refill)."""

    def on_admission_end(self, request: AdmissionRequest) -> None:
        """A waiting session was admitted, timed out, or went away."""

    def on_served(self, item: WorkItem, service_s: float) -> None:
        """The item's rows ran, in a batch that took `service_s`."""

    def service_view(self) -> dict[str, float]:
        """Per-client counters for status reporting (empty when the policy keeps none)."""
        return {}

    def serves_first(self, client_id: str) -> bool:
        """Would a step of `client_id` arriving now go into the next batch ahead of the work that
        waits? The scheduler waits a moment for such a client's session due back even when the
        waiting work would fill a batch (`StepScheduler._gather`); for a policy that answers False
        (arrival order) that wait could only delay everyone."""
        return False

    # -- helpers for subclasses ---------------------------------------------------------------
    def next_seq(self) -> int:
        """The next arrival number (submitted steps and cut remainders share it)."""
        return next(self._seq)

    def take_within(
        self, item: WorkItem, room_tokens: int, prefill_room_tokens: int | None = None
    ) -> tuple[WorkItem | None, WorkItem | None]:
        """(what runs now, what stays) for `item` in a batch with `room_tokens` left, of which
        `prefill_room_tokens` (None: all) may be prompt rows: a prefill longer than its room is cut
        (chunked prefill); an item that cannot run now stays whole."""
        if item.is_prefill and prefill_room_tokens is not None:
            room_tokens = min(room_tokens, prefill_room_tokens)
        if item.n_tokens <= room_tokens:
            return item, None
        if room_tokens <= 0 or not item.is_prefill:
            return None, item
        tail = item.split(room_tokens, self.next_seq())
        return item, tail


class ArrivalOrderPolicy(SchedulingPolicy, ABC):
    """A policy whose waiting items sit in one arrival-ordered map (FCFS, DLPM): the queue's
    bookkeeping lives here once; subclasses decide what `select` takes."""

    def __init__(self, **params: Any):
        super().__init__(**params)
        self._queue: dict[int, WorkItem] = {}  # seq -> item; dicts keep insertion order

    def enqueue(self, item: WorkItem) -> None:
        self._queue[item.seq] = item

    def remove(self, session_id: str) -> list[WorkItem]:
        gone = [seq for seq, it in self._queue.items() if it.session_id == session_id]
        return [self._queue.pop(seq) for seq in gone]

    def drain(self) -> list[WorkItem]:
        items, self._queue = list(self._queue.values()), {}
        return items

    def __len__(self) -> int:
        return len(self._queue)
