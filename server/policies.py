"""Scheduling policies of a block server: small classes behind one interface, chosen by name.

A policy owns the server's queue of waiting work (`enqueue`, `select`, `remove`, `drain`) and
decides which waiting session gets a freed KV slot (`admit`). The scheduler calls every hook under
one lock and treats an exception or an impossible answer as the policy's failure: the affected
work fails with `SchedulerPolicyError`, the loop keeps running (`server/scheduler.py`).

Work is counted in tokens. A step of n new tokens is a prefill chunk (n > 1) or a decode step
(n = 1); a prefill longer than the batch budget is cut (`WorkItem.split`) so that no batch holds
more than `max_batch_tokens` rows: chunked prefill interleaves long prompts with others' decodes.

- `fcfs`: arrival order (a cut prefill's remainder re-enters at the back).
- `vtc`: Virtual Token Counter (papers/vtc-fairness-in-serving-llms.txt, Algorithm 2): one counter
  per client (the authenticated libp2p peer id); a client that becomes active is lifted to the
  smallest counter of the active clients (lines 8-13); the next item comes from the client with the
  smallest counter; counters are charged `w_in` per prefill token and `w_out` per decode token as
  work is scheduled (lines 24, 30). Theorem 4.4: two backlogged clients' service differs by at most
  2U, U = max(w_in L_input, w_out M) (eq. 2).
- `dlpm`: Deficit Longest Prefix Match (`server/policy_dlpm.py`): deficit counters with quantum Q,
  prefix locality first among clients with credit; bound 2(U + Q).

The interface and the records it passes (`WorkItem`, `AdmissionRequest`) are in
`server/policy_base.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from petals_chain.algorithms.vtc import VirtualTokenCounters
from petals_chain.errors import InvalidRequestError
from server.policy_base import (
    AdmissionRequest,
    ArrivalOrderPolicy,
    PolicyParam,
    SchedulingPolicy,
    WorkItem,
)
from server.policy_dlpm import DLPMPolicy

__all__ = [
    "AdmissionRequest",
    "PolicyParam",
    "SchedulingPolicy",
    "WorkItem",
    "FCFSPolicy",
    "VTCPolicy",
    "DLPMPolicy",
    "POLICIES",
    "describe_policies",
    "parse_policy_args",
    "make_policy",
]


class FCFSPolicy(ArrivalOrderPolicy):
    """First come, first served: arrival order, batch filled up to the token budget."""

    name = "fcfs"

    def select(self, max_batch_tokens: int, prefill_tokens: int | None = None) -> list[WorkItem]:
        batch: list[WorkItem] = []
        sessions: set[str] = set()
        room, prefill_room = max_batch_tokens, prefill_tokens
        for seq in sorted(self._queue):
            item = self._queue[seq]
            if item.session_id in sessions:
                continue
            run, rest = self.take_within(item, room, prefill_room)
            if run is None:
                continue
            del self._queue[seq]
            if rest is not None:
                self._queue[rest.seq] = rest  # the remainder waits behind everything that arrived
            batch.append(run)
            sessions.add(run.session_id)
            room -= run.n_tokens
            if run.is_prefill and prefill_room is not None:
                prefill_room -= run.n_tokens
            if room <= 0:
                break
        return batch


class VTCPolicy(SchedulingPolicy):
    """Virtual Token Counter (VTC paper, Algorithm 2) over steps and admissions."""

    name = "vtc"
    PARAMS = {
        "w_in": PolicyParam(float, 1.0, "cost of one prompt (prefill) token", minimum=0.0),
        "w_out": PolicyParam(float, 2.0, "cost of one decode token (the paper uses w_p=1, w_q=2)", minimum=0.0),
        "max_client_share": PolicyParam(
            float,
            1.0,
            "largest fraction of a batch's tokens one client may take while another client is active "
            "(1: the paper's work-conserving VTC; less: shorter batches for the others' next step, "
            "the trade-off of the paper's Remark 4.7)",
            minimum=0.0,
        ),
    }

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0, max_client_share: float = 1.0):
        super().__init__(w_in=w_in, w_out=w_out, max_client_share=max_client_share)
        if w_in <= 0 and w_out <= 0:
            raise InvalidRequestError("vtc needs w_in > 0 or w_out > 0, otherwise no counter ever moves")
        if not 0 < max_client_share <= 1:
            raise InvalidRequestError(f"vtc's max_client_share must be in (0, 1], got {max_client_share}")
        self.vtc = VirtualTokenCounters(w_in, w_out)  # the counters, shared with the API gateway's admission
        self.max_client_share = float(max_client_share)
        self._last_batch_clients: set[str] = set()
        self._by_client: dict[str, dict[int, WorkItem]] = {}  # client -> seq -> item (the active clients)
        self._count = 0

    @property
    def counters(self) -> dict[str, float]:
        return self.vtc.counters

    @property
    def served(self) -> dict[str, float]:
        return self.vtc.served

    def _lift(self, client: str) -> None:
        """Lines 7-13: a client new to the queue is lifted (idle time earns no credit)."""
        self.vtc.lift(client, self._by_client)

    def enqueue(self, item: WorkItem) -> None:
        if item.client_id not in self._by_client:
            self._lift(item.client_id)
        self._by_client.setdefault(item.client_id, {})[item.seq] = item
        self._count += 1

    def _take(self, client: str, seq: int) -> WorkItem:
        queue = self._by_client[client]
        item = queue.pop(seq)
        self._count -= 1
        if not queue:
            del self._by_client[client]
            self.vtc.left(client)
        return item

    def select(self, max_batch_tokens: int, prefill_tokens: int | None = None) -> list[WorkItem]:
        batch: list[WorkItem] = []
        sessions: set[str] = set()
        room, prefill_room = max_batch_tokens, prefill_tokens
        blocked: set[str] = set()  # clients with nothing that can join this batch
        held: set[str] = set()  # clients whose next work is a prompt chunk the prefill limit holds back
        used: dict[str, int] = {}
        # a client in the middle of a round trip (served last batch) is active although nothing of it waits
        active = set(self._by_client) | self._last_batch_clients
        cap = max(1, int(self.max_client_share * max_batch_tokens))
        u = max(self.vtc.cost(max_batch_tokens, 0), self.vtc.cost(0, 1))  # the largest single charge
        while room > 0:
            candidates = [c for c in self._by_client if c not in blocked]
            if not candidates:
                break
            # ties (a client lifted when its step arrives equals the smallest counter) go to a decode step
            # first (a light client's next token, lifted after every round trip, does not lose to a prompt
            # chunk of equal counter), then to the oldest waiting work
            client = self.vtc.pick(
                candidates,
                tiebreak=lambda c: (all(it.is_prefill for it in self._by_client[c].values()), min(self._by_client[c])),
            )
            queue = self._by_client[client]
            # within a client, decode steps first: its sessions' next tokens do not wait behind its own
            # prompt chunks (the order across clients is still the counters')
            seq = next(
                (
                    s
                    for s in sorted(queue, key=lambda s: (queue[s].is_prefill, s))
                    if queue[s].session_id not in sessions
                ),
                None,
            )
            if seq is None:
                blocked.add(client)
                continue
            item = queue[seq]
            if item.is_prefill and prefill_room is not None and prefill_room <= 0:
                held.add(client)
                blocked.add(client)
                continue
            if held and client not in held:
                # the room the prefill limit leaves goes to others' decode steps, but never so far that a
                # held-back client falls more than U behind (Lemma 4.3's spread, so Theorem 4.4's 2U holds)
                floor = min(self.vtc.counters.get(c, 0.0) for c in held)
                charge = self.vtc.cost(0, 1) if not item.is_prefill else self.vtc.cost(min(item.n_tokens, room), 0)
                if self.vtc.counters.get(client, 0.0) + charge > floor + u:
                    blocked.add(client)
                    continue
            client_room = room
            if self.max_client_share < 1 and active - {client}:
                client_room = min(room, cap - used.get(client, 0))
            run, rest = self.take_within(item, client_room, prefill_room)
            if run is None:
                blocked.add(client)
                continue
            used[client] = used.get(client, 0) + run.n_tokens
            self._take(client, seq)
            if rest is not None:
                self._by_client.setdefault(client, {})[rest.seq] = rest
                self._count += 1
            # line 24 / 30: charged as it is scheduled
            self.vtc.charge(client, *((run.n_tokens, 0) if run.is_prefill else (0, run.n_tokens)))
            batch.append(run)
            sessions.add(run.session_id)
            room -= run.n_tokens
            if run.is_prefill and prefill_room is not None:
                prefill_room -= run.n_tokens
        self._last_batch_clients = {it.client_id for it in batch}
        return batch

    def serves_first(self, client_id: str) -> bool:
        """A client whose counter is at most every waiting client's gets the next batch's first room
        (for a decode step, ties included; a client that arrives is lifted to the smallest counter)."""
        others = [self.vtc.counters.get(c, 0.0) for c in self._by_client if c != client_id]
        return not others or self.vtc.counters.get(client_id, 0.0) <= min(others)

    def remove(self, session_id: str) -> list[WorkItem]:
        gone = [(c, s) for c, q in self._by_client.items() for s, it in q.items() if it.session_id == session_id]
        return [self._take(c, s) for c, s in gone]

    def drain(self) -> list[WorkItem]:
        gone = [(c, s) for c, q in self._by_client.items() for s in q]
        return [self._take(c, s) for c, s in gone]

    def __len__(self) -> int:
        return self._count

    def admit(self, waiting: Sequence[AdmissionRequest]) -> AdmissionRequest:
        """The freed slot goes to the waiting session whose client has the smallest counter; a
        client with no steps waiting is lifted first (idle time earns no credit here either)."""
        for r in waiting:
            if r.client_id not in self._by_client:
                self._lift(r.client_id)
        return min(waiting, key=lambda r: (self.vtc.counters.get(r.client_id, 0.0), r.seq))

    def service_view(self) -> dict[str, float]:
        return dict(self.served)


POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FCFSPolicy, VTCPolicy, DLPMPolicy)}


def describe_policies() -> str:
    """For --help: each policy and its --policy-arg parameters."""
    lines = []
    for name, cls in POLICIES.items():
        args = ", ".join(f"{k}={p.default} ({p.help})" for k, p in cls.PARAMS.items()) or "no parameters"
        lines.append(f"  {name}: {args}")
    return "\n".join(lines)


def parse_policy_args(name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """['w_in=1', 'w_out=2'] -> {'w_in': 1.0, 'w_out': 2.0}, checked against the policy's PARAMS."""
    if name not in POLICIES:
        raise InvalidRequestError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}")
    params = POLICIES[name].PARAMS
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidRequestError(f"bad --policy-arg {pair!r}: use NAME=VALUE, e.g. w_out=2")
        if key not in params:
            known = ", ".join(params) or "none"
            raise InvalidRequestError(f"policy {name!r} has no parameter {key!r} (its parameters: {known})")
        spec = params[key]
        try:
            value = spec.kind(text)
        except ValueError:
            raise InvalidRequestError(f"--policy-arg {key}={text!r}: expected a {spec.kind.__name__}") from None
        if spec.minimum is not None and not value >= spec.minimum:
            raise InvalidRequestError(f"--policy-arg {key}={text}: must be >= {spec.minimum}")
        out[key] = value
    return out


def make_policy(name: str, params: dict[str, Any] | None = None) -> SchedulingPolicy:
    if name not in POLICIES:
        raise InvalidRequestError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**(params or {}))
