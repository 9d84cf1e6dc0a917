"""The server's execution loop: one thread takes waiting steps of all open sessions and batches them.

Handlers `submit` a validated step (`server/step_request.py:StepRequest`, made and checked once by the
handler) with a `deliver(result, error)` callback. The policy
(`server/policies.py`) owns the waiting queue; every call into it runs under the scheduler's one
lock. A step longer than the batch budget runs in chunks (the policy cuts it), interleaved with
other sessions' steps; its rows are delivered together once the last chunk ran, in order.

Gathering: a session whose step was just delivered usually comes back with its next step one
client round trip later. The loop takes whatever waits at once, so with concurrent sessions it
used to run the first arrival alone and the rest as the next batch, and stayed in that split (one
session, then seven, then one... measured through the API gateway: 2.5 sessions per batch with 8
concurrent requests). Before a batch, the loop therefore waits for sessions it expects back (each
session's delivery-to-next-step gap, averaged) if they are due within `gather_fraction` of a
batch's service time (averaged over recent batches), and never longer: a session at another hop
of a long chain, or idle, is not expected that soon and costs no wait.

Decode steps first: while sessions decode, a batch carries at most `prefill_tokens_while_decoding`
prompt rows (`--prefill-tokens-while-decoding`; decode steps may take the rest of the budget), so
a decoding session's next step waits behind a short batch, not a full budget of others' prompt
chunks; and when the waiting work would fill a batch, the gathering still waits for a session whose
client the policy serves first (`SchedulingPolicy.serves_first`).

A broken policy never kills the loop: when a hook raises, or `select` answers with nothing while
work waits, or with a batch that breaks the contract (unknown items, two items of one session,
rows out of order, over the token budget), every waiting step fails with `SchedulerPolicyError`
and the loop goes on serving what arrives next.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from petals_chain.errors import (
    PetalsChainError,
    SchedulerPolicyError,
    ServerUnavailableError,
    SessionClosedError,
)
from petals_chain.runtime.block_range import StepInput
from server.policies import SchedulingPolicy, WorkItem
from server.step_request import StepRequest

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    batches: int = 0
    steps: int = 0  # steps delivered (a chunked prefill counts once)
    tokens: int = 0
    busy_s: float = 0.0
    tokens_by_client: dict[str, int] = field(default_factory=dict)
    max_batch_size: int = 0
    max_batch_tokens_seen: int = 0
    policy_failures: int = 0


@dataclass(eq=False)
class _Job:
    """One submitted step and how far it ran: its rows may run over several batches (chunked prefill)."""

    job_id: int
    request: StepRequest
    deliver: Callable[[Any, BaseException | None], None]
    rows_done: int = 0
    compute_s: float = 0.0  # forward time of the batches its rows ran in (shared with their other steps)
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def session_id(self) -> str:
        return self.request.key

    @property
    def client_id(self) -> str:
        return self.request.client_id

    @property
    def total_rows(self) -> int:
        return self.request.hidden.shape[0]


class StepScheduler:
    """`executor` is anything with `forward(list[StepInput]) -> list[Tensor]` (a `BlockRange`);
    a `StepRequest` is a `StepInput`, handed to it as it is when a batch runs all its rows.
    With `start_thread=False` nothing runs until the caller calls `run_once()` (tests)."""

    def __init__(
        self,
        executor,
        policy: SchedulingPolicy,
        *,
        max_batch_tokens: int = 2048,
        clock: Callable[[], float] = time.monotonic,
        start_thread: bool = True,
        on_batch: Callable[[dict], None] | None = None,
        gather_fraction: float = 0.5,
        waiting_for_memory: Callable[[], list[str]] = list,
        prefill_tokens_while_decoding: int | None = None,
    ):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if prefill_tokens_while_decoding is not None and prefill_tokens_while_decoding < 1:
            raise ValueError(f"prefill_tokens_while_decoding must be >= 1, got {prefill_tokens_while_decoding}")
        # at most this many prompt rows in a batch while sessions decode (None: the whole budget); see run_once
        self.prefill_tokens_while_decoding = (
            None
            if prefill_tokens_while_decoding is None or prefill_tokens_while_decoding >= max_batch_tokens
            else prefill_tokens_while_decoding
        )
        if gather_fraction < 0:
            raise ValueError(f"gather_fraction must be >= 0, got {gather_fraction}")
        self.gather_fraction = gather_fraction  # 0: never wait for expected sessions
        self._delivered_s: dict[str, float] = {}  # session -> when its last step was delivered (not back yet)
        self._delivered_client: dict[str, str] = {}  # session -> its client, for the sessions in _delivered_s
        self._return_s: dict[str, float] = {}  # session -> average gap from a delivery to its next step
        self._service_s = 0.0  # batch service time, averaged over recent batches (the gathering window's unit)
        self.gather_waits = 0  # batches that waited for expected sessions (stats)
        self.block_range = executor
        self._device = torch.device(getattr(executor, "device", "cpu"))
        self._on_cuda = self._device.type == "cuda"
        self.policy = policy
        self.max_batch_tokens = max_batch_tokens
        self.clock = clock
        self.on_batch = on_batch  # e.g. the --service-log writer; called outside the lock
        # clients with sessions waiting for KV memory (the admission queue's, wired by
        # server/serving_stack.py:build_stack), for the log
        self.waiting_for_memory = waiting_for_memory
        self.stats = SchedulerStats()
        self._jobs: dict[int, _Job] = {}  # submitted, not yet delivered
        self._cond = threading.Condition()
        self._job_ids = itertools.count()
        self._stopped = False
        self._running = False  # a thread (the scheduler's, or an inline caller's) is running a batch
        self._thread = None
        if start_thread:
            self._thread = threading.Thread(target=self._loop, name="step-scheduler", daemon=True)
            self._thread.start()

    # -- handler side ---------------------------------------------------------------------------
    def submit(
        self,
        request: StepRequest,
        deliver: Callable[[Any, BaseException | None], None],
        *,
        inline: bool = False,
        defer: Callable[[Callable[[], None]], Any] | None = None,
    ) -> _Job:
        """Queue `request` (its `key` is the session's here); `deliver(output, None)` or
        `deliver(None, error)` is called once. Returns the job (its `compute_s` is final once delivered).
        `inline`: when nothing else waits or runs, run the batch on the caller's thread now (no
        hand-off to the scheduler thread and back: the lean path of a lone session); otherwise it
        waits for the scheduler thread as usual, so batches still form under load. `defer`: how an
        inline run hands off its after-work (the batch observer: service records, the service log),
        e.g. through the event loop's `call_later`, so that it runs after the caller has sent its
        reply, not before (by default it runs at once)."""
        with self._cond:
            if self._stopped:
                raise ServerUnavailableError("this server is shutting down; use another server")
            session_id = request.key
            delivered_s = self._delivered_s.pop(session_id, None)
            if delivered_s is not None:
                gap_s = self.clock() - delivered_s
                prev_s = self._return_s.get(session_id)
                self._return_s[session_id] = gap_s if prev_s is None else 0.5 * (prev_s + gap_s)
            job_id = next(self._job_ids)
            job = _Job(job_id, request, deliver)
            ok, seq = self._call_policy("next_seq", self.policy.next_seq)
            self._jobs[job_id] = job
            if not ok:
                self._fail_job(job, self._policy_error("next_seq", RuntimeError("no arrival number")))
                return job
            item = WorkItem(
                seq,
                session_id,
                request.client_id,
                job.total_rows,
                request.kv.past_tokens,
                self.clock(),
                job,
                prefix_tokens=request.prefix_tokens,
            )
            self._call_policy("enqueue", lambda: self.policy.enqueue(item))
            # not while other sessions are expected back within the gathering window: their batch
            # forms on the scheduler thread (_gather)
            claimed = inline and not self._running and len(self._jobs) == 1 and not self._expects_others()
            if not claimed:
                self._cond.notify()
                return job
            self._running = True
        self._run_claimed(defer)
        return job

    def _run_claimed(self, defer: Callable[[Callable[[], None]], Any] | None = None) -> None:
        """Run batches while this thread holds the runner role (`_running`), then hand it back."""
        try:
            self.run_once(defer)
        finally:
            with self._cond:
                self._running = False
                if self._jobs or self._stopped:
                    self._cond.notify_all()

    def cancel_session(self, session_id: str) -> None:
        """The session closed or its stream broke: its waiting work leaves the queue."""
        with self._cond:
            self._delivered_s.pop(session_id, None)
            self._delivered_client.pop(session_id, None)
            self._return_s.pop(session_id, None)
            ok, items = self._call_policy("remove", lambda: self.policy.remove(session_id))
            for item in items if ok else ():
                self._fail_job(item.payload, SessionClosedError("the session was closed before this step ran"))

    def call_policy(self, what: str, fn: Callable[[SchedulingPolicy], Any]) -> Any:
        """Run another hook (admission) under the scheduler's lock; raises SchedulerPolicyError."""
        with self._cond:
            try:
                return fn(self.policy)
            except Exception as e:
                self.stats.policy_failures += 1
                logger.exception("scheduling policy %s failed in %s", self.policy.name, what)
                raise self._policy_error(what, e) from e

    @property
    def queue_length(self) -> int:
        with self._cond:
            return len(self._jobs)

    def waiting_clients(self) -> set[str]:
        with self._cond:
            return {j.client_id for j in self._jobs.values()}

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._cond:
            for job in list(self._jobs.values()):
                self._fail_job(job, ServerUnavailableError("this server is shutting down; use another server"))

    # -- loop -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._jobs or self._running) and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._gather()
                if self._running or not self._jobs:  # an inline caller claimed it, or a cancel emptied it
                    continue
                self._running = True
            self._run_claimed()

    def _expects_others(self) -> bool:
        """Is a delivered session (not back yet) due within the gathering window of now? (lock held)"""
        if self.gather_fraction <= 0 or self._service_s <= 0:
            return False
        window_s, now_s = self.gather_fraction * self._service_s, self.clock()
        return any(
            abs(delivered_s + self._return_s.get(session_id, float("inf")) - now_s) <= window_s
            for session_id, delivered_s in self._delivered_s.items()
        )

    def _gather(self) -> None:
        """Wait (under the lock, woken by every submit) for sessions expected back within the
        gathering window; see the module docstring. When the waiting work would fill a batch anyway,
        wait only for sessions whose client the policy would serve ahead of it (`serves_first`: a
        light client mid round trip under VTC), whose next step would otherwise wait one whole
        batch of others' work."""
        if self.gather_fraction <= 0 or self._service_s <= 0:
            return
        window_s = self.gather_fraction * self._service_s
        deadline_s = self.clock() + window_s
        waited = False
        while not self._stopped:
            now_s = self.clock()
            full = sum(j.total_rows - j.rows_done for j in self._jobs.values()) >= self.max_batch_tokens
            due_s = []
            for session_id, delivered_s in list(self._delivered_s.items()):
                expected_s = delivered_s + self._return_s.get(session_id, float("inf"))
                if expected_s + window_s < now_s:  # overdue: idle, or gone elsewhere; stop expecting it
                    del self._delivered_s[session_id]
                    self._delivered_client.pop(session_id, None)
                elif expected_s <= deadline_s and (not full or self._serves_first(session_id)):
                    due_s.append(expected_s)
            if not due_s or now_s >= deadline_s:
                break
            waited = True
            self._cond.wait(timeout=deadline_s - now_s)
        self.gather_waits += waited

    def _serves_first(self, session_id: str) -> bool:
        client = self._delivered_client.get(session_id)
        if client is None:
            return False
        ok, first = self._call_policy("serves_first", lambda: self.policy.serves_first(client))
        return bool(ok and first)

    def _decoding(self) -> bool:
        """Is a session decoding: a decode step waits, or a session's last step was delivered and its
        next is due (lock held)? An idle session stops counting once overdue, as in _gather."""
        if any(j.rows_done == 0 and j.total_rows == 1 and j.request.kv.past_tokens > 0 for j in self._jobs.values()):
            return True
        now_s, slack_s = self.clock(), max(self._service_s, 1e-3)
        return any(
            now_s <= delivered_s + self._return_s.get(session_id, 2 * slack_s) + slack_s
            for session_id, delivered_s in self._delivered_s.items()
        )

    def run_once(self, defer: Callable[[Callable[[], None]], Any] | None = None) -> int:
        """Select and run one batch; returns the number of items it ran (0: nothing waited, or the
        policy failed and the waiting work was failed)."""
        with self._cond:
            if not self._jobs:
                return 0
            # while sessions decode, a batch carries at most prefill_tokens_while_decoding prompt rows: the
            # decoding sessions' next step then waits behind a short batch, not a full budget of others'
            # prompt chunks (their decode steps still take the rest of the budget: decode steps first)
            prefill_tokens = self.prefill_tokens_while_decoding
            if prefill_tokens is not None and self._decoding():
                ok, batch = self._call_policy(
                    "select", lambda: self.policy.select(self.max_batch_tokens, prefill_tokens=prefill_tokens)
                )
            else:
                prefill_tokens = None
                ok, batch = self._call_policy("select", lambda: self.policy.select(self.max_batch_tokens))
            if not ok:
                return 0
            problem = self._check_batch(batch, prefill_tokens)
            if problem:
                self._policy_failed("select", SchedulerPolicyError(problem))
                return 0
            running = {id(it.payload) for it in batch}
            backlogged = sorted({j.client_id for j in self._jobs.values() if id(j) not in running})
        self._run(batch, backlogged, defer)
        return len(batch)

    def _check_batch(self, batch, prefill_tokens: int | None = None) -> str | None:
        if not isinstance(batch, list) or not batch:
            return f"select returned {batch!r} while {len(self._jobs)} step(s) wait"
        tokens = prefill_rows = 0
        jobs: set[int] = set()
        for it in batch:
            job = getattr(it, "payload", None)
            if not isinstance(it, WorkItem) or not isinstance(job, _Job) or self._jobs.get(job.job_id) is not job:
                return f"select returned {it!r}, which is not waiting here"
            if job.job_id in jobs or any(self._jobs[j].session_id == it.session_id for j in jobs):
                return f"select returned two items of session {it.session_id!r} in one batch"
            if it.row_offset != job.rows_done or it.n_tokens < 1 or it.row_offset + it.n_tokens > job.total_rows:
                return (
                    f"select returned rows [{it.row_offset}, {it.row_offset + it.n_tokens}) of a step whose "
                    f"next row is {job.rows_done} of {job.total_rows}"
                )
            jobs.add(job.job_id)
            tokens += it.n_tokens
            prefill_rows += it.n_tokens if it.is_prefill else 0
        if tokens > self.max_batch_tokens:
            return f"select returned {tokens} tokens, over the budget of {self.max_batch_tokens}"
        if prefill_tokens is not None and prefill_rows > prefill_tokens:
            return (
                f"select returned {prefill_rows} prompt rows while sessions decode, over the limit of {prefill_tokens}"
            )
        return None

    def _blocks_of(self, job: _Job) -> int:
        """Blocks this step runs here (a session may enter mid-range); 0 for executors without blocks."""
        try:
            return int(self.block_range.end - job.request.kv.first_block)
        except AttributeError:
            return 0

    def _run(
        self, batch: list[WorkItem], backlogged: list[str], defer: Callable[[Callable[[], None]], Any] | None = None
    ) -> None:
        if self._on_cuda:  # GPU work is asynchronous: what was queued before is not this batch's
            torch.cuda.synchronize(self._device)
        start_s = self.clock()
        cpu0_s = time.process_time()  # the whole process: torch's intra-op threads do the work
        # a whole step as it came (no new object, no slice: each is one more call on the decode step's
        # path); a chunk of a prefill as a slice of its rows
        steps = [
            it.payload.request
            if it.n_tokens == it.payload.total_rows
            else StepInput(
                it.payload.request.kv,
                it.payload.request.hidden[it.row_offset : it.row_offset + it.n_tokens],
                validated=it.payload.request.validated,
            )
            for it in batch
        ]
        try:
            outputs = self.block_range.forward(steps)
            if self._on_cuda:  # kernels run asynchronously: the batch ends when they do
                torch.cuda.synchronize(self._device)
            error = None
        except Exception as e:  # a failed batch fails its steps, never the loop
            logger.exception("batch of %d steps failed", len(batch))
            outputs, error = [None] * len(batch), e
        service_s = self.clock() - start_s
        cpu_s = time.process_time() - cpu0_s
        finished: list[tuple[_Job, torch.Tensor | None, BaseException | None]] = []
        with self._cond:
            # averaged: one short batch (a lone session's) must not shrink the window that would
            # let the next batch gather everyone
            self._service_s = service_s if not self._service_s else 0.5 * (self._service_s + service_s)
            st = self.stats
            st.batches += 1
            st.busy_s += service_s
            st.max_batch_size = max(st.max_batch_size, len(batch))
            st.max_batch_tokens_seen = max(st.max_batch_tokens_seen, sum(it.n_tokens for it in batch))
            for it, out in zip(batch, outputs):
                job = it.payload
                job.compute_s += service_s
                if error is not None:
                    # the job's remaining rows must not run on a cache this batch left half-written
                    self._call_policy("remove", lambda: self.policy.remove(job.session_id))
                    self._jobs.pop(job.job_id, None)
                    finished.append((job, None, error))
                    continue
                st.tokens += it.n_tokens
                st.tokens_by_client[it.client_id] = st.tokens_by_client.get(it.client_id, 0) + it.n_tokens
                self._call_policy("on_served", lambda: self.policy.on_served(it, service_s))
                if job.job_id not in self._jobs:  # the policy failed just now and failed this job with it
                    continue
                job.outputs.append(out)
                job.rows_done += it.n_tokens
                if job.rows_done == job.total_rows:
                    self._jobs.pop(job.job_id, None)
                    st.steps += 1
                    result = job.outputs[0] if len(job.outputs) == 1 else torch.cat(job.outputs)
                    finished.append((job, result, None))
                    self._delivered_s[job.session_id] = self.clock()
                    self._delivered_client[job.session_id] = job.client_id
        for job, result, err in finished:
            job.deliver(result, err)
        if self.on_batch is not None:
            # built when observed, which `defer` may put after the caller's reply: what it reads of the
            # batch does not change after it ran; the server-wide views (who waits for memory, the
            # policy's counters) are as of the observation
            def observe():
                try:
                    self.on_batch(
                        {
                            "t_s": start_s,
                            "service_s": service_s,
                            "cpu_s": cpu_s,
                            "ok": error is None,
                            "items": [[it.client_id, it.n_tokens, it.is_prefill] for it in batch],
                            "blocks": [self._blocks_of(it.payload) for it in batch],
                            "backlogged": backlogged,
                            "waiting_for_memory": self.waiting_for_memory(),
                            "counters": self.policy.service_view(),
                        }
                    )
                except Exception:
                    logger.exception("batch observer failed")

            if defer is None:
                observe()
            else:
                defer(observe)

    # -- policy failures (all under the lock) -----------------------------------------------------
    def _call_policy(self, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, fn()'s result), or (False, None) after failing the waiting work when the policy raised."""
        try:
            return True, fn()
        except Exception as e:
            self._policy_failed(what, e)
            return False, None

    def _policy_error(self, what: str, cause: BaseException) -> SchedulerPolicyError:
        return SchedulerPolicyError(
            f"the server's scheduling policy {self.policy.name!r} failed in {what} ({type(cause).__name__}: {cause}); "
            "the waiting steps were failed instead of stopping the server: retry the session, and restart the "
            "server with --policy fcfs if this repeats"
        )

    def _policy_failed(self, what: str, cause: BaseException) -> None:
        self.stats.policy_failures += 1
        logger.error(
            "scheduling policy %s failed in %s: %r; failing %d waiting step(s)",
            self.policy.name,
            what,
            cause,
            len(self._jobs),
            exc_info=not isinstance(cause, SchedulerPolicyError),
        )
        error = self._policy_error(what, cause)
        try:
            self.policy.drain()  # best effort: forget what we fail now
        except Exception:
            logger.exception("policy %s failed to drain too", self.policy.name)
        for job in list(self._jobs.values()):
            self._fail_job(job, error)

    def _fail_job(self, job: _Job, error: PetalsChainError) -> None:
        if self._jobs.pop(job.job_id, None) is None:
            return
        try:
            job.deliver(None, error)
        except Exception:
            logger.exception("delivering a failure failed")
