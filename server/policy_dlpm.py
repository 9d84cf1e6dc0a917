"""DLPM: Deficit Longest Prefix Match (papers/dlpm-locality-aware-fair-scheduling.txt, Algorithm 1).

Each client i has a deficit counter q_i (0 when it first appears, line 12). A batch is filled from
the waiting work sorted by prefix locality (the longest prefix its session took from the prefix
cache first, then arrival; line 16, SGLang's LPM order); an item joins only while its client's
q_i > 0 (line 21) and is charged as it is scheduled (lines 23, 26): `w_in` per prompt token it
computes (the "extend" tokens: a cached prefix is never sent, so it is never charged) and `w_out`
per decode token. When a client's counter is spent, CheckRefill (lines 3-8) looks at the clients
with waiting work: only when none of them has q > 0 does every client with q <= 0 get the quantum
Q. So q_i stays in (-U, Q] (eq. 1-2 of Theorem A.1) and two continuously backlogged clients'
service differs by at most 2(U + Q) (Theorem 4.1), U being the largest charge of one item
(here w_in * max_batch_tokens for a prefill chunk, w_out for a decode step).

In the paper a request waits until it is added to the running batch, which holds its KV; here a
session first waits for KV memory (the admission queue) and then its steps wait for a batch. Both
count as waiting work: a client with a session waiting for memory is "queued" for CheckRefill, and
admission follows Algorithm 1's loop: waiting sessions in order of the longest prefix the cache
holds for them right now, skipping clients without credit (refilling as above). So a client keeps
being admitted while its quantum lasts and its cached prefix stays hot (VTC alternates clients
and, when the cache cannot hold every client's prefix, evicts each one before it is used again).
Admission charges nothing; the session's work is charged as it runs. Two departures keep memory
and compute busy, as the paper's running batch never stalls: when no waiting session's client has
credit, the one with the most credit is admitted; and batch room that no client with credit can use
goes to the others' work in the same order (charged, so their counters go below zero and they wait
longer for the next admission). Theorem 4.1's bound is about clients whose work waits for a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

from petals_chain.errors import InvalidRequestError
from server.policy_base import (
    AdmissionRequest,
    ArrivalOrderPolicy,
    PolicyParam,
    WorkItem,
)


class DLPMPolicy(ArrivalOrderPolicy):
    name = "dlpm"
    PARAMS = {
        "q": PolicyParam(
            float,
            1024.0,
            "quantum Q: weighted tokens a client may take per round before others "
            "are refilled (larger: more locality, looser bound 2(U+Q))",
            minimum=1.0,
        ),
        "w_in": PolicyParam(
            float, 1.0, "cost of one computed prompt token (cached prefix tokens cost nothing)", minimum=0.0
        ),
        "w_out": PolicyParam(float, 2.0, "cost of one decode token", minimum=0.0),
    }

    def __init__(self, q: float = 1024.0, w_in: float = 1.0, w_out: float = 2.0):
        super().__init__(q=q, w_in=w_in, w_out=w_out)
        if not q > 0:
            raise InvalidRequestError(f"dlpm's quantum q must be > 0, got {q}")
        if w_in <= 0 and w_out <= 0:
            raise InvalidRequestError("dlpm needs w_in > 0 or w_out > 0, otherwise no counter ever moves")
        self.quantum = float(q)
        self.w_in, self.w_out = float(w_in), float(w_out)
        self.deficit: dict[str, float] = {}  # the paper's q_i, for every client seen (its list l)
        self.served: dict[str, float] = {}  # weighted tokens scheduled per client
        self.refills = 0
        self._admission_waiting: dict[str, int] = {}  # client -> sessions waiting for KV memory

    def cost(self, item: WorkItem) -> float:
        return (self.w_in if item.is_prefill else self.w_out) * item.n_tokens

    def _waiting_clients(self) -> set[str]:
        return {it.client_id for it in self._queue.values()} | set(self._admission_waiting)

    def _check_refill(self) -> None:
        """Lines 3-8: refill only when no client with waiting work has credit left."""
        if any(self.deficit[c] > 0 for c in self._waiting_clients()):
            return
        for client, q in self.deficit.items():
            if q <= 0:
                self.deficit[client] = q + self.quantum
        self.refills += 1

    def enqueue(self, item: WorkItem) -> None:
        self.deficit.setdefault(item.client_id, 0.0)  # line 12
        super().enqueue(item)

    def select(self, max_batch_tokens: int, prefill_tokens: int | None = None) -> list[WorkItem]:
        batch: list[WorkItem] = []
        sessions: set[str] = set()
        room, prefill_room = max_batch_tokens, prefill_tokens
        progressed, borrowing = True, False
        while room > 0 and self._queue:
            if not progressed:  # nothing with credit fits: the rest of the room goes to the others
                if borrowing:
                    break
                borrowing = True
            progressed = False
            for seq in sorted(self._queue, key=lambda s: (-self._queue[s].prefix_tokens, s)):  # line 16
                item = self._queue[seq]
                if item.session_id in sessions:
                    continue
                client = item.client_id
                if self.deficit[client] <= 0 and not borrowing:  # line 20
                    self._check_refill()
                    if self.deficit[client] <= 0:
                        continue
                run, rest = self.take_within(item, room, prefill_room)
                if run is None:
                    continue
                del self._queue[seq]
                if rest is not None:
                    self._queue[rest.seq] = rest
                charge = self.cost(run)  # lines 23 and 26, as the work is scheduled
                self.deficit[client] -= charge
                self.served[client] = self.served.get(client, 0.0) + charge
                batch.append(run)
                sessions.add(run.session_id)
                room -= run.n_tokens
                if run.is_prefill and prefill_room is not None:
                    prefill_room -= run.n_tokens
                progressed = True
                if room <= 0:
                    break
        return batch

    def on_admission_wait(self, request: AdmissionRequest) -> None:
        self.deficit.setdefault(request.client_id, 0.0)  # line 12
        self._admission_waiting[request.client_id] = self._admission_waiting.get(request.client_id, 0) + 1

    def on_admission_end(self, request: AdmissionRequest) -> None:
        left = self._admission_waiting.get(request.client_id, 0) - 1
        if left > 0:
            self._admission_waiting[request.client_id] = left
        else:
            self._admission_waiting.pop(request.client_id, None)

    def admit(self, waiting: Sequence[AdmissionRequest]) -> AdmissionRequest:
        """Algorithm 1's loop over the sessions waiting for memory: longest cached prefix first
        (locality), then arrival; a client without credit is skipped unless CheckRefill refills it.
        When nobody waiting has credit, the one with the most (memory must not idle)."""
        for r in waiting:
            self.deficit.setdefault(r.client_id, 0.0)
        for r in sorted(waiting, key=lambda r: (-r.prefix_match_tokens, r.seq)):
            if self.deficit[r.client_id] <= 0:
                self._check_refill()
            if self.deficit[r.client_id] > 0:
                return r
        return min(waiting, key=lambda r: (-self.deficit[r.client_id], -r.prefix_match_tokens, r.seq))

    def service_view(self) -> dict[str, float]:
        return dict(self.served)

    def bound(self, max_batch_tokens: int) -> float:
        """2(U + Q) of Theorem 4.1 for this server's batch budget."""
        return 2 * (max(self.w_in * max_batch_tokens, self.w_out) + self.quantum)
