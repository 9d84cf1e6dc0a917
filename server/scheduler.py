"""The server's execution loop: one thread takes steps from all open sessions and batches them.

Handlers submit `WorkItem`s (already validated) and get the result through the item's `deliver`
callback; the policy decides which waiting items form the next batch.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from petals_chain.runtime.block_range import BlockRange, StepInput
from server.policies import SchedulingPolicy, WorkItem

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    batches: int = 0
    steps: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    tokens_by_client: dict[str, int] = field(default_factory=dict)
    max_batch_size: int = 0


class StepScheduler:
    def __init__(self, block_range: BlockRange, policy: SchedulingPolicy, *, max_batch_tokens: int = 2048,
                 clock: Callable[[], float] = time.monotonic):
        self.block_range = block_range
        self.policy = policy
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        self.stats = SchedulerStats()
        self._waiting: list[WorkItem] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="step-scheduler", daemon=True)
        self._thread.start()

    def next_seq(self) -> int:
        return next(self._seq)

    def submit(self, item: WorkItem) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError("scheduler stopped")
            self._waiting.append(item)
            self.policy.on_enqueue(item)
            self._cond.notify()

    @property
    def queue_length(self) -> int:
        with self._cond:
            return len(self._waiting)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    pending, self._waiting = self._waiting, []
                    break
                batch = self.policy.select(list(self._waiting), self.max_batch_tokens)
                chosen = {id(item) for item in batch}
                self._waiting = [w for w in self._waiting if id(w) not in chosen]
            self._run(batch)
        for item in pending:
            item.deliver(None, RuntimeError("server is shutting down"))

    def _run(self, batch: list[WorkItem]) -> None:
        start_s = self.clock()
        try:
            outputs = self.block_range.forward([item.payload for item in batch])
            error = None
        except Exception as e:  # a failed batch fails its items, never the loop
            logger.exception("batch of %d steps failed", len(batch))
            outputs, error = [None] * len(batch), e
        service_s = self.clock() - start_s
        st = self.stats
        st.batches += 1
        st.steps += len(batch)
        st.busy_s += service_s
        st.max_batch_size = max(st.max_batch_size, len(batch))
        for item, out in zip(batch, outputs):
            if error is None:
                st.tokens += item.n_tokens
                st.tokens_by_client[item.client_id] = st.tokens_by_client.get(item.client_id, 0) + item.n_tokens
                self.policy.on_served(item, service_s)
            item.deliver(out, error)


def step_item(scheduler: StepScheduler, session_id: str, client_id: str, step: StepInput,
              deliver: Callable) -> WorkItem:
    return WorkItem(seq=scheduler.next_seq(), session_id=session_id, client_id=client_id,
                    n_tokens=step.hidden.shape[0], past_tokens=step.kv.past_tokens, enqueued_s=scheduler.clock(),
                    payload=step, deliver=deliver)
