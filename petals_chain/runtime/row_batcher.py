"""Cross-session batching of the client's own compute: embedding, final norm and LM head.

Each session of a process runs in its own thread and relays its hidden states through servers,
which batch steps of different sessions already. The client side did not: every session ran the
LM head alone, and SmolLM2's LM head (576 x 49,152 weights, 113 MB in float32) costs about as much
as several blocks per token, almost all of it reading the weight matrix. `RowBatcher` lets
concurrent callers share one call: rows submitted while a batch is running are concatenated and
computed together as the next batch, so the weights are read once per batch instead of once per
session (the head holds one batcher for each, `ClientHead.embed_batched` / `.logits_batched`).
A caller that finds the batcher idle runs at once, alone or with whatever was already queued,
unless callers are *expected* (`gather_fraction` > 0): sessions whose chain step is in flight
(`expecting()`). Their replies come in a burst, since the server runs concurrent sessions' steps as
one batch, and the first reply's caller used to run its row alone while the other seven queued
for the next call (measured through the API gateway with 8 concurrent requests: 7.5 sessions per
server batch but 3.8 per LM head call, i.e. two LM head passes over the 113 MB of weights per
step). The leader therefore waits for expected callers, at most `gather_fraction` of a batch's
measured time: a session that is in another server batch costs that much latency, never more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class _Job:
    rows: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to run the next batch, not because its result is ready
    result: torch.Tensor | None = None
    error: BaseException | None = None


class RowBatcher:
    """`batcher(rows) == fn(rows)` for rows [n, ...], with concurrent callers' rows computed in one
    `fn(torch.cat(rows))` call. `fn` must be row-wise (row i of the output depends only on row i of
    the input), as embedding lookup, RMSNorm and a linear layer are."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], max_rows: int = 4096, gather_fraction: float = 0.0):
        """`gather_fraction`: how long a leader may wait for expected callers, as a fraction of the
        average batch's `fn` time (0: never wait)."""
        self.fn = fn
        self.max_rows = max_rows
        self.gather_fraction = gather_fraction
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a caller arrived, or an expected one gave up
        self._pending: list[_Job] = []
        self._running = False
        self._expected = 0  # callers inside `expecting()` that have not called yet
        self._fn_s = 0.0  # batch `fn` time, averaged (the gathering window's unit)
        # counters for tests and benchmarks: batches run, calls and rows they served, batches that waited
        self.batches = 0
        self.batched_calls = 0
        self.rows = 0
        self.gather_waits = 0

    @contextmanager
    def expecting(self) -> Iterator[None]:
        """Mark the caller as expected: it will call with `expected=True` when the block ends (wrap
        a session's chain step in it). A block that raises is no longer expected."""
        with self._lock:
            self._expected += 1
        try:
            yield
        except BaseException:
            with self._lock:
                self._expected -= 1
                self._changed.notify_all()
            raise

    def __call__(self, rows: torch.Tensor, expected: bool = False) -> torch.Tensor:
        """`expected`: the caller ends an `expecting()` block with this call."""
        job = _Job(rows)
        with self._lock:
            self._pending.append(job)
            if expected:
                self._expected -= 1
            self._changed.notify_all()
            leader = not self._running
            self._running = True
        if leader:
            self._lead()
        else:
            job.done.wait()
            if job.lead:  # the previous leader handed the batcher over: our rows head the next batch
                self._lead()
        if job.error is not None:
            raise job.error
        return job.result

    def _lead(self) -> None:
        """Run one batch (which holds the caller's own job), then hand the batcher to the first
        queued caller, or mark it idle. Handing over instead of looping keeps the leader's own
        latency at one batch."""
        with self._lock:
            if self.gather_fraction > 0 and self._fn_s > 0 and self.max_rows > 1 and self._expected > 0:
                self.gather_waits += 1
                deadline_s = time.perf_counter() + self.gather_fraction * self._fn_s
                while self._expected > 0 and (left_s := deadline_s - time.perf_counter()) > 0:
                    self._changed.wait(left_s)
            batch, total = [], 0
            while self._pending and (not batch or total + self._pending[0].rows.shape[0] <= self.max_rows):
                job = self._pending.pop(0)
                batch.append(job)
                total += job.rows.shape[0]
        started_s = time.perf_counter()
        try:
            out = self.fn(torch.cat([j.rows for j in batch])) if len(batch) > 1 else self.fn(batch[0].rows)
            offset = 0
            for j in batch:
                n = j.rows.shape[0]
                j.result = out[offset : offset + n]
                offset += n
        except BaseException as e:  # every caller of the batch gets the error, none hangs
            for j in batch:
                j.error = e
        fn_s = time.perf_counter() - started_s
        self.batches += 1
        self.batched_calls += len(batch)
        self.rows += total
        with self._lock:
            self._fn_s = fn_s if self._fn_s == 0 else 0.8 * self._fn_s + 0.2 * fn_s
            if self._pending:
                nxt = self._pending[0]
                nxt.lead = True
                nxt.done.set()
            else:
                self._running = False
        for j in batch:
            j.done.set()
