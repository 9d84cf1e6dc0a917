"""Policies that choose which waiting steps the scheduler loop runs next, chosen by name.

A policy sees the whole queue of waiting work, with per-session and per-client identity and token
counts, and is told how much service each item received, so fair policies (VTC, DLPM) can keep
their counters. FCFS ships now.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkItem:
    """One session's step waiting for the server's compute."""

    seq: int  # arrival order at this server
    session_id: str
    client_id: str  # the client's libp2p peer id, authenticated by the transport
    n_tokens: int  # new tokens in this step (prefill: many; decode: 1)
    past_tokens: int  # tokens already in the session's cache
    enqueued_s: float
    payload: Any = None  # what the executor needs (the step input)
    deliver: Callable[[Any, BaseException | None], None] | None = field(default=None, repr=False)

    @property
    def is_prefill(self) -> bool:
        return self.n_tokens > 1


class SchedulingPolicy(ABC):
    name: str

    @abstractmethod
    def select(self, waiting: Sequence[WorkItem], max_batch_tokens: int) -> list[WorkItem]:
        """Pick the next batch from `waiting` (non-empty): at least one item, at most one per session."""

    def on_enqueue(self, item: WorkItem) -> None:
        """Called when an item joins the queue."""

    def on_served(self, item: WorkItem, service_s: float) -> None:
        """Called after the item's step ran, with the wall time of the batch it ran in."""


def fill_in_order(ordered: Sequence[WorkItem], max_batch_tokens: int) -> list[WorkItem]:
    """Take items in the given order while the batch stays within `max_batch_tokens` (the first
    item always goes, even if larger), at most one step per session."""
    batch: list[WorkItem] = []
    sessions: set[str] = set()
    tokens = 0
    for item in ordered:
        if item.session_id in sessions:
            continue
        if batch and tokens + item.n_tokens > max_batch_tokens:
            continue
        batch.append(item)
        sessions.add(item.session_id)
        tokens += item.n_tokens
    return batch


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: arrival order, batch filled up to the token budget."""

    name = "fcfs"

    def select(self, waiting, max_batch_tokens):
        return fill_in_order(sorted(waiting, key=lambda w: w.seq), max_batch_tokens)


POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}") from None
