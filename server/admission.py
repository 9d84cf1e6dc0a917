"""Admission of sessions to the KV budget: when memory is full, opening sessions wait here.

A session that fits the budget when it opens is admitted at once (so a session the orchestrator
granted, whose slot its capacity accounting guarantees, never waits). One that does not fit waits
in a bounded queue until its deadline; whenever memory frees, the scheduling policy chooses which
of the waiting sessions that now fit gets it (`SchedulingPolicy.admit`; VTC: the client with the
least service), so admission is a fairness decision, not arrival order.

Everything here runs on the server's event loop (handlers open and close sessions there); policy
hooks run under the scheduler's lock through `StepScheduler.call_policy`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from petals_chain.errors import (
    AdmissionTimeoutError,
    OutOfCacheError,
    SchedulerPolicyError,
)
from server.memory import KVBudget
from server.policies import AdmissionRequest

logger = logging.getLogger(__name__)


@dataclass
class _Waiter:
    request: AdmissionRequest
    key: str
    future: asyncio.Future
    prefix_match: Callable[[], int] | None = None  # tokens of its prompt the prefix cache holds now


class AdmissionQueue:
    def __init__(
        self,
        budget: KVBudget,
        scheduler,
        *,
        max_waiting: int = 64,
        timeout_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_waiting < 0 or timeout_s < 0:
            raise ValueError("max_waiting and timeout_s must be >= 0")
        self.budget = budget
        self.scheduler = scheduler
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.clock = clock
        self._waiting: dict[str, _Waiter] = {}
        self._seq = itertools.count()
        self.admitted_after_wait = 0
        self.timed_out = 0
        # clients with a session waiting, replaced whole on every change: the scheduler thread reads it
        self._waiting_clients: tuple[str, ...] = ()

    def waiting_clients(self) -> list[str]:
        """Clients with a session waiting for memory (safe from any thread)."""
        return sorted(set(self._waiting_clients))

    def _note_waiting(self) -> None:
        self._waiting_clients = tuple(w.request.client_id for w in self._waiting.values())

    def __len__(self) -> int:
        return len(self._waiting)

    async def reserve(
        self,
        key: str,
        nbytes: int,
        session_id: str,
        client_id: str,
        wait_s: float | None = None,
        prefix_match: Callable[[], int] | None = None,
    ) -> float:
        """Reserve `nbytes` under `key`, waiting up to min(wait_s, the server's timeout) for memory.
        Returns the seconds waited; raises OutOfCacheError (queue full / no wait asked) or
        AdmissionTimeoutError (deadline passed)."""
        try:
            self.budget.reserve(key, nbytes)
            return 0.0
        except OutOfCacheError as refused:
            wait_s = self.timeout_s if wait_s is None else min(max(0.0, wait_s), self.timeout_s)
            if (
                nbytes > self.budget.memory_budget_bytes - self.budget.weights_bytes - self.budget.cache_floor_bytes
                or wait_s <= 0
            ):
                raise
            if len(self._waiting) >= self.max_waiting:
                raise OutOfCacheError(
                    f"{refused} (and the admission queue is full: {self.max_waiting} sessions wait already)"
                ) from None
        start_s = self.clock()
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            AdmissionRequest(next(self._seq), session_id, client_id, nbytes, start_s),
            key,
            loop.create_future(),
            prefix_match,
        )
        self.scheduler.call_policy("admission_wait", lambda p: p.on_admission_wait(waiter.request))
        self._waiting[key] = waiter
        self._note_waiting()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), wait_s)
        except BaseException as e:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.budget.release(key)  # admitted just as the deadline passed or the caller went away
                self.on_release()
            if isinstance(e, asyncio.TimeoutError):
                self.timed_out += 1
                raise AdmissionTimeoutError(
                    f"no KV memory freed for this session within {wait_s:.1f} s of waiting in the server's "
                    "admission queue; retry later, use a smaller max_length, or pick another server"
                ) from None
            raise
        finally:
            self._waiting.pop(key, None)
            self._note_waiting()
            try:
                self.scheduler.call_policy("admission_end", lambda p: p.on_admission_end(waiter.request))
            except SchedulerPolicyError:
                logger.exception("the policy failed to note the end of an admission wait")
        self.admitted_after_wait += 1
        return self.clock() - start_s

    def fail_waiting(self, error: Exception) -> int:
        """Refuse every waiting session with `error` (the server moves to other blocks); returns how many.
        Each waiter's `reserve` raises it and cleans up after itself."""
        failed = 0
        for w in list(self._waiting.values()):
            if not w.future.done():
                w.future.set_exception(error)
                failed += 1
        return failed

    def on_release(self) -> None:
        """Memory freed: the policy hands it out among the waiting sessions that now fit."""
        while self._waiting:
            free = self.budget.available_bytes  # cached prefixes are evicted for it (LRU)
            # the prefix match is asked now: the cache changes while a session waits (DLPM's locality)
            fits = [
                replace(w.request, prefix_match_tokens=w.prefix_match()) if w.prefix_match else w.request
                for w in self._waiting.values()
                if w.request.kv_bytes <= free and not w.future.done()
            ]
            if not fits:
                return
            try:
                chosen = self.scheduler.call_policy("admit", lambda p: p.admit(fits))
                if not any(chosen is r for r in fits):
                    raise SchedulerPolicyError(f"the policy admitted {chosen!r}, which is not waiting")
            except SchedulerPolicyError as e:
                for w in list(self._waiting.values()):
                    if not w.future.done():
                        w.future.set_exception(e)
                    self._waiting.pop(w.key, None)
                self._note_waiting()
                return
            waiter = next(w for w in self._waiting.values() if w.request.seq == chosen.seq)
            self._waiting.pop(waiter.key)
            self._note_waiting()
            self.budget.reserve(waiter.key, chosen.kv_bytes)
            waiter.future.set_result(None)
