"""Cross-session batching of the client's own compute: embedding, final norm and LM head.

Each session of a process runs in its own thread and relays its hidden states through servers,
which batch steps of different sessions already. The client side did not: every session ran the
LM head alone, and SmolLM2's LM head (576 x 49,152 weights, 113 MB in float32) costs about as much
as several blocks per token, almost all of it reading the weight matrix. `RowBatcher` lets
concurrent callers share one call: rows submitted while a batch is running are concatenated and
computed together as the next batch, so the weights are read once per batch instead of once per
session (the head holds one batcher for each, `ClientHead.embed_batched` / `.logits_batched`).
Nobody waits for a batch to fill (no timer): a caller that finds the batcher idle runs
at once, alone or with whatever was already queued.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
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

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], max_rows: int = 4096):
        self.fn = fn
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._pending: list[_Job] = []
        self._running = False
        # counters for tests and benchmarks: batches run, calls and rows they served
        self.batches = 0
        self.batched_calls = 0
        self.rows = 0

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        job = _Job(rows)
        with self._lock:
            self._pending.append(job)
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
            batch, total = [], 0
            while self._pending and (not batch or total + self._pending[0].rows.shape[0] <= self.max_rows):
                job = self._pending.pop(0)
                batch.append(job)
                total += job.rows.shape[0]
        try:
            out = self.fn(torch.cat([j.rows for j in batch])) if len(batch) > 1 else self.fn(batch[0].rows)
            offset = 0
            for j in batch:
                n = j.rows.shape[0]
                j.result = out[offset:offset + n]
                offset += n
        except BaseException as e:  # every caller of the batch gets the error, none hangs
            for j in batch:
                j.error = e
        self.batches += 1
        self.batched_calls += len(batch)
        self.rows += total
        with self._lock:
            if self._pending:
                nxt = self._pending[0]
                nxt.lead = True
                nxt.done.set()
            else:
                self._running = False
        for j in batch:
            j.done.set()
