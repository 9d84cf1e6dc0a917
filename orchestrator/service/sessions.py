"""The one owner of the live sessions: leases, the waiting sessions, the grants not yet picked up by
their client, and the installed plan's dispatcher, all under one lock (`Sessions.lock`).

Decisions are not made here: the plan's dispatcher (orchestrator.dispatch, via the policy registry
orchestrator.policies) decides which waiting session starts on which chain, exactly as in the
simulator; this class maps its job ids to sessions and its chain ids to live hops. So the same
event sequence gives the simulator and the service the same decisions (tests/test_one_dispatch_core.py).

- a session asks (`acquire`): it becomes a job of the dispatcher, with the chains it may use (it
  may exclude servers after a failure, and ask for a max_length some chains do not accept);
- a grant is recorded once, here, when the dispatcher starts the job: the lease, and the grant
  waiting for its client's next poll (`poll` returns it; a poll that waits is woken);
- a session ends (`release`), its lease expires without heartbeats (`expire`), or its server is
  lost (`drop_servers`): the dispatcher hears of the completion and starts the next jobs.
- a new plan (`install`): a new dispatcher; chains of the earlier plan keep their sessions and
  drain (they take no new session); the waiting sessions are offered to the new dispatcher in their
  queue order.

Queue order (`queue`): `fifo` (the paper's JFFC, the default) serves waiters in arrival order;
`fair` serves first the waiter whose client has received the least service: a VTC counter per
client (papers/vtc-fairness-in-serving-llms.txt, Algorithm 2) charged `w_in * l_in + w_out * l_out`
of the expected lengths when a session is granted and corrected by the lengths its client reports
at release; a client that starts waiting is lifted to the smallest counter among waiting clients,
so idle time earns no credit. Ties go to the client holding fewer slots, then by arrival.

Pure apart from the lock and the wake-up of waiting polls: every call takes `now_s`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.dispatch import (
    PROMPT_AWARE,
    D2lpmDispatcher,
    Dispatcher,
    DispatchRequest,
    E2Dispatcher,
    PrefixParams,
    Start,
    make_dispatcher,
)
from orchestrator.model import BlockInterval, ChainSpec
from orchestrator.prefix_index import DEFAULT_MAX_ENTRIES, PrefixIndex
from petals_chain.errors import (
    AcquireTimeoutError,
    MaxLengthExceededError,
    NoChainError,
    TooManyWaitingError,
)
from petals_chain.wire.messages import ChainGrant, Hop

logger = logging.getLogger(__name__)

WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
QUEUE_ORDERS = ("fifo", "fair")
MAX_POLL_S = 10.0
UNPICKED_GRANT_TTL_S = 2 * MAX_POLL_S + 5.0  # a grant no poll collected this long: its client is gone


@dataclass
class LiveChain:
    chain_id: int
    hops: tuple[Hop, ...]  # in block order
    capacity: int
    service_time_s: float
    max_length_tokens: int = 1 << 30
    in_use: int = 0
    dispatchable: bool = True  # False: from an earlier plan (or lost), kept until its sessions end
    index: int | None = None  # the dispatcher's chain id (static chains) or route id (per-request)
    route: bool = False  # a per-request route: capacity is what the router's free slots allow

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(h.peer_id for h in self.hops)


@dataclass
class Lease:
    session_id: str
    client_id: str
    chain_id: int
    granted_s: float
    expires_s: float
    wait_s: float
    job_id: int = -1  # -1: not a job of the current dispatcher (an earlier plan's session)
    charged: float = 0.0  # fair queue: what the client's counter was charged at the grant
    grant: ChainGrant | None = None  # what the session was granted (a later poll may need it again)


@dataclass
class Waiter:
    session_id: str
    client_id: str
    max_length: int
    exclude: frozenset[str]
    arrived_s: float
    deadline_s: float
    job_id: int = -1
    last_seen_s: float = 0.0  # last time its client polled (a client that stops polling is gone)
    request: DispatchRequest | None = None  # its prompt, for the prompt-aware dispatchers


@dataclass
class Metrics:
    admitted: int = 0
    released: int = 0
    expired: int = 0
    timed_out: int = 0
    dropped: int = 0  # leases whose chain vanished (server lost)
    wait_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS_S) + 1))
    wait_sum_s: float = 0.0

    def observe_wait(self, wait_s: float) -> None:
        self.wait_sum_s += wait_s
        for i, b in enumerate(WAIT_BUCKETS_S):
            if wait_s <= b:
                self.wait_bucket_counts[i] += 1
                return
        self.wait_bucket_counts[-1] += 1


@dataclass(frozen=True)
class Queued:
    position: int
    queue_length: int


@dataclass
class _Binding:
    """What the installed dispatcher's chain ids mean on the live swarm."""

    dispatcher: Dispatcher
    per_request: bool
    chains: list[tuple[tuple[Hop, ...], float, int]] = field(default_factory=list)  # static: (hops, T, max_len)
    peers: list[str] = field(default_factory=list)  # per-request: cluster index -> peer id
    max_length: dict[str, int] = field(default_factory=dict)  # per-request: peer -> max_length


def chain_specs(chains: list[tuple[tuple[Hop, ...], int, float, int]]) -> list[ChainSpec]:
    """The dispatcher's view of live chains (hops, capacity, service time, max_length): only capacity
    and service time matter to it."""
    return [
        ChainSpec(tuple(range(len(h))), tuple(BlockInterval(x.start, x.end) for x in h), int(cap), float(t))
        for h, cap, t, _ in chains
    ]


class Sessions:
    def __init__(
        self,
        lease_ttl_s: float = 30.0,
        *,
        queue: str = "fifo",
        w_in: float = 1.0,
        w_out: float = 2.0,
        lock: threading.RLock | None = None,
        prefix_sharing: str = "client",
        prefix_index_entries: int = DEFAULT_MAX_ENTRIES,
        max_waiting_per_client: int = 256,
        quantum_sessions: tuple[float, float] = (1.0, 4.0),
        fair_skips: int | None = 32,
    ):
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        if queue not in QUEUE_ORDERS:
            raise ValueError(f"unknown queue order {queue!r}; choose one of {', '.join(QUEUE_ORDERS)}")
        self.lock = lock if lock is not None else threading.RLock()
        self.lease_ttl_s = lease_ttl_s
        self.queue_order = queue
        self.w_in, self.w_out = w_in, w_out
        self.expected_tokens: tuple[float, float] = (64.0, 32.0)  # (l_in, l_out): the service keeps it current
        self.client_service: dict[str, float] = {}  # fair queue: VTC counter per client
        self.plan_version = 0
        self.no_chain_reason: str | None = None  # set by the service when it cannot plan: acquire fails at once
        self.chains: dict[int, LiveChain] = {}
        self.leases: dict[str, Lease] = {}
        self.queue: OrderedDict[str, Waiter] = OrderedDict()
        self.metrics = Metrics()
        self._binding: _Binding | None = None
        self._live_of_index: dict[int, int] = {}  # dispatcher chain/route id -> live chain id
        self._job_session: dict[int, str] = {}
        self._unpicked: dict[str, tuple[ChainGrant, float]] = {}  # grants their client has not polled yet
        self._wakers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._next_chain_id = 0
        self._next_job = 0
        # the global prefix index outlives plans (the servers' caches do); the prompt-aware dispatchers
        # read it and learn grants into it, the servers' reports correct it (`prefix_report`)
        self.prefix_index = PrefixIndex(sharing=prefix_sharing, max_entries=prefix_index_entries)
        self.server_costs: dict | None = None  # peer id -> dispatch.ServerCost (calibrated t_I, t_O), if known
        self.dispatch_params: PrefixParams | None = None  # None: quanta of expected sessions (below)
        if not all(q > 0 for q in quantum_sessions):
            raise ValueError(f"quantum_sessions must be positive, got {quantum_sessions}")
        self.quantum_sessions = quantum_sessions  # (Q^u, Q^w) in expected sessions' charge
        if fair_skips is not None and fair_skips < 1:
            raise ValueError(f"fair_skips must be >= 1 or None (the DLPM paper's order), got {fair_skips}")
        self.fair_skips = fair_skips
        if max_waiting_per_client < 1:
            raise ValueError("max_waiting_per_client must be >= 1")
        self.max_waiting_per_client = max_waiting_per_client
        self._waiting_of: dict[str, int] = {}
        self.refused_floods = 0

    # -- installing plans ---------------------------------------------------------------------
    def queue_order_key(self) -> Callable[[list[int]], list[int]] | None:
        """The order a JFFC dispatcher serves its central queue in (None: FIFO)."""
        return None if self.queue_order == "fifo" else self._fair_order

    def install_chains(
        self,
        chains: list[tuple[tuple[Hop, ...], int, float, int]],
        plan_version: int,
        now_s: float,
        *,
        dispatch: str = "jffc",
        rng=None,
        server_costs: dict | None = None,
    ) -> list[ChainGrant]:
        """Static chains: [(hops, capacity, service_time_s, max_length_tokens)] dispatched by `dispatch`
        (orchestrator.dispatch); `server_costs` (peer id -> dispatch.ServerCost), E2's load cost when
        known. Returns grants to waiting sessions."""
        chains = [c for c in chains if c[1] >= 1]
        with self.lock:
            if server_costs is not None:
                self.server_costs = server_costs
            if not chains:
                self._retire_all()
                self.plan_version = plan_version
                return []
            d = make_dispatcher(
                dispatch,
                chain_specs(chains),
                rng,
                self.queue_order_key(),
                index=self.prefix_index,
                hop_servers=[[h.peer_id for h in hops] for hops, *_ in chains],
                costs=self.server_costs,
                params=self._dispatch_params(),
            )
            return self.install(d, plan_version, now_s, chains=chains)

    def _dispatch_params(self) -> PrefixParams:
        """The prompt-aware policies' knobs: DLPM's Q^u of one expected session's charge (w_in l_in +
        w_out l_out) and D2LPM's Q^w of four by default (`quantum_sessions`), so a flooder's backlog yields
        to a light client within a session or two (a quantum of many sessions lets one client's burst go
        first; the bound 2 (U + Q^u) |W| grows with it), in the units the counters charge; kept current as
        the expected lengths are learned (set_expected_tokens)."""
        if self.dispatch_params is not None:
            return self.dispatch_params
        q_user, q_chain = self._quanta()
        return PrefixParams(
            quantum_client=q_user, quantum_chain=q_chain, w_in=self.w_in, w_out=self.w_out, fair_skips=self.fair_skips
        )

    def _expected_charge(self) -> float:
        """One expected session's charge, w_in l_in + w_out l_out (the fair queue's and the quanta's unit)."""
        return self.w_in * self.expected_tokens[0] + self.w_out * self.expected_tokens[1]

    def _quanta(self) -> tuple[float, float]:
        one = self._expected_charge()
        return self.quantum_sessions[0] * one, self.quantum_sessions[1] * one

    def install_router(
        self,
        router: Dispatcher,
        peer_ids: list[str],
        max_length_tokens: dict[str, int],
        plan_version: int,
        now_s: float,
    ) -> list[ChainGrant]:
        """A per-request router (petals, bprr) over servers `peer_ids` (its cluster order)."""
        return self.install(router, plan_version, now_s, peers=peer_ids, max_length=max_length_tokens)

    def install(
        self,
        dispatcher: Dispatcher,
        plan_version: int,
        now_s: float,
        *,
        chains: list[tuple[tuple[Hop, ...], int, float, int]] | None = None,
        peers: list[str] | None = None,
        max_length: dict[str, int] | None = None,
    ) -> list[ChainGrant]:
        """A new plan's dispatcher: over static `chains` (index-aligned with its chain list), or a
        per-request router over `peers`. Earlier chains drain; waiting sessions are offered to it in
        queue order."""
        with self.lock:
            self._retire_all()
            self.plan_version = plan_version
            if chains is not None:
                b = _Binding(dispatcher, False, chains=[(tuple(h), float(t), int(m)) for h, _, t, m in chains])
                for i, (h, cap, t, m) in enumerate(chains):
                    cid = self._new_chain_id()
                    self.chains[cid] = LiveChain(cid, tuple(h), int(cap), float(t), int(m), index=i)
                    self._live_of_index[i] = cid
            else:
                b = _Binding(dispatcher, True, peers=list(peers or []), max_length=dict(max_length or {}))
            self._binding = b
            if chains is not None:
                self._carry_over(chains)
            grants: list[ChainGrant] = []
            for w in self._waiting_in_order():
                if w.session_id in self.queue and self._can_dispatch(w):
                    grants += self._arrive(w, now_s)
            return grants

    def _carry_over(self, chains: list[tuple[tuple[Hop, ...], int, float, int]]) -> None:
        """Sessions on an earlier chain with the same hops as a new one move onto it (up to its capacity):
        they hold its servers' slots, so the new chain is installed with them counted, not with its whole
        capacity free beside them (which would grant more sessions than the servers hold slots for)."""
        by_hops: dict[tuple, LiveChain] = {}
        for ch in self.chains.values():
            if not ch.dispatchable and ch.in_use > 0:
                by_hops.setdefault(tuple(ch.hops), ch)
        if not by_hops:
            return
        on: dict[int, list[Lease]] = {}
        for lease in self.leases.values():
            on.setdefault(lease.chain_id, []).append(lease)
        for i, (h, _, _, _) in enumerate(chains):
            old = by_hops.pop(tuple(h), None)
            new = self.chains.get(self._live_of_index.get(i, -1))
            if old is None or new is None:
                continue
            for lease in on.get(old.chain_id, []):
                if new.in_use >= new.capacity:
                    break
                self._next_job += 1
                if not self._binding.dispatcher.on_arrival(self._next_job, frozenset({i})):
                    self._binding.dispatcher.cancel(self._next_job)
                    break
                lease.job_id, lease.chain_id = self._next_job, new.chain_id
                self._job_session[self._next_job] = lease.session_id
                new.in_use += 1
                old.in_use -= 1
            if old.in_use == 0:
                del self.chains[old.chain_id]
            else:
                old.capacity = old.in_use

    def _retire_all(self) -> None:
        for cid in list(self.chains):
            ch = self.chains[cid]
            if ch.in_use == 0:
                del self.chains[cid]
            else:
                ch.dispatchable = False
                ch.capacity = ch.in_use  # drains: never takes a new session
        for lease in self.leases.values():
            lease.job_id = -1  # sessions of an earlier dispatcher are no longer its jobs
        for w in self.queue.values():
            w.job_id = -1
        self._binding = None
        self._live_of_index.clear()
        self._job_session.clear()

    def _new_chain_id(self) -> int:
        self._next_chain_id += 1
        return self._next_chain_id

    @property
    def mode(self) -> str:
        b = self._binding
        return "none" if b is None else ("router" if b.per_request else "chains")

    # -- what a session may use ---------------------------------------------------------------
    def _allowed(self, w: Waiter) -> frozenset[int] | None:
        b = self._binding
        if b is None or b.per_request:
            return None  # a per-request route is computed over live slots; exclusions do not apply
        ok = frozenset(
            i
            for i, (hops, _, max_len) in enumerate(b.chains)
            if max_len >= w.max_length
            and not (w.exclude & {h.peer_id for h in hops})
            and self.chains.get(self._live_of_index.get(i, -1)) is not None
            and self.chains[self._live_of_index[i]].dispatchable
        )
        if not w.exclude and w.max_length <= min(m for _, _, m in b.chains) and len(ok) == len(b.chains):
            return None  # every chain: the paper's unconstrained JFFC
        return ok

    def _can_dispatch(self, w: Waiter) -> bool:
        allowed = self._allowed(w)
        return allowed is None or bool(allowed)

    def refuses_length(self, max_length: int) -> bool:
        """True when sessions of `max_length` can never be granted by the installed chains: some chain
        takes sessions now and none accepts that length. With no dispatchable chain (every chain lost a
        server to churn, or all drain) nothing is known about lengths: the session queues for the next
        plan instead of being refused with MaxLengthExceededError."""
        with self.lock:
            b = self._binding
            if b is None or (not b.per_request and not any(c.dispatchable for c in self.chains.values())):
                return False
            return not self.fits_any(max_length)

    def fits_any(self, max_length: int) -> bool:
        with self.lock:
            b = self._binding
            if b is not None and b.per_request:
                return bool(b.max_length) and all(v >= max_length for v in b.max_length.values())
            return any(c.dispatchable and c.max_length_tokens >= max_length for c in self.chains.values())

    # -- sessions -----------------------------------------------------------------------------
    def acquire(
        self,
        session_id: str,
        client_id: str,
        max_length: int,
        now_s: float,
        *,
        timeout_s: float,
        exclude: frozenset[str] = frozenset(),
        request: DispatchRequest | None = None,
    ) -> tuple[ChainGrant | None, list[ChainGrant]]:
        """Grant `session_id` a chain now, or queue it (returns None). A session that already holds a
        lease (failover) gives it back first; the grants of other sessions that this frees come second.
        `request`: its prompt (client id, prefix hashes, token count) for the prompt-aware dispatchers.
        A client with `max_waiting_per_client` sessions waiting already gets TooManyWaitingError: a flood of
        acquires costs the orchestrator bounded memory and leaves the others' places in the queue alone."""
        with self.lock:
            if (
                session_id not in self.queue
                and session_id not in self.leases
                and self._waiting_of.get(client_id, 0) >= self.max_waiting_per_client
            ):
                self.refused_floods += 1
                raise TooManyWaitingError(
                    f"client {client_id} already has {self.max_waiting_per_client} sessions waiting for a chain; "
                    "retry once some of them were granted"
                )
            others: list[ChainGrant] = []
            if session_id in self.leases:
                others = self.release(session_id, now_s)
            if session_id in self.queue:
                raise ValueError(f"session {session_id!r} is already waiting")
            if request is not None and request.client_id != client_id:
                request = DispatchRequest(
                    client_id, request.prefix_hashes, request.prompt_tokens, request.output_tokens
                )
            w = Waiter(
                session_id,
                client_id,
                max_length,
                frozenset(exclude),
                now_s,
                now_s + timeout_s,
                last_seen_s=now_s,
                request=request,
            )
            self._waiting_of[client_id] = self._waiting_of.get(client_id, 0) + 1
            if self.queue_order == "fair" and all(q.client_id != client_id for q in self.queue.values()):
                self._lift(client_id)
            self.queue[session_id] = w
            if self._binding is not None and self._can_dispatch(w):
                others.extend(self._arrive(w, now_s))
            mine = next((g for g in others if g.session_id == session_id), None)
            return mine, [g for g in others if g.session_id != session_id]

    def _arrive(self, w: Waiter, now_s: float) -> list[ChainGrant]:
        self._next_job += 1
        w.job_id = self._next_job
        self._job_session[w.job_id] = w.session_id
        b = self._binding
        if b.per_request:
            return self._starts(b.dispatcher.on_arrival(w.job_id, self._allowed(w)), now_s)
        return self._starts(b.dispatcher.on_arrival(w.job_id, self._allowed(w), w.request), now_s)

    def _starts(self, starts: list[Start], now_s: float) -> list[ChainGrant]:
        return [self._grant(self.queue[self._job_session[s.job_id]], self._live_chain(s), now_s) for s in starts]

    def _live_chain(self, s: Start) -> LiveChain:
        b = self._binding
        cid = self._live_of_index.get(s.chain_id)
        if cid is not None and cid in self.chains:
            return self.chains[cid]
        # a per-request route seen for the first time
        spec = b.dispatcher.route(s.chain_id)
        hops = tuple(Hop(b.peers[j], blk.start, blk.end) for j, blk in zip(spec.servers, spec.blocks))
        cid = self._new_chain_id()
        max_len = min(b.max_length.get(h.peer_id, 1 << 30) for h in hops)
        self.chains[cid] = LiveChain(cid, hops, 0, spec.service_time_s, max_len, index=s.chain_id, route=True)
        self._live_of_index[s.chain_id] = cid
        return self.chains[cid]

    def _grant(self, w: Waiter, ch: LiveChain, now_s: float) -> ChainGrant:
        assert ch.in_use < ch.capacity or ch.route, "the dispatcher overfilled a chain"
        del self.queue[w.session_id]
        self._left_queue(w)
        self._job_session.pop(w.job_id, None)
        ch.in_use += 1
        wait = now_s - w.arrived_s
        charge = self._expected_charge()
        self.client_service[w.client_id] = self.client_service.get(w.client_id, 0.0) + charge
        self.metrics.admitted += 1
        self.metrics.observe_wait(wait)
        # the session id carries an API gateway's request id: this line ties a request to its chain
        logger.info(
            "session %s of %s: chain %s granted after %.3f s in the queue", w.session_id, w.client_id, ch.chain_id, wait
        )
        g = ChainGrant(
            w.session_id,
            ch.chain_id,
            self.plan_version,
            ch.hops,
            ch.service_time_s,
            self.lease_ttl_s,
            wait,
            extra={"seq": self.metrics.admitted},
        )
        self.leases[w.session_id] = Lease(
            w.session_id, w.client_id, ch.chain_id, now_s, now_s + self.lease_ttl_s, wait, w.job_id, charge, g
        )
        self._unpicked[w.session_id] = (g, now_s)
        self._wake(w.session_id)
        return g

    def _left_queue(self, w: Waiter) -> None:
        n = self._waiting_of.get(w.client_id, 0) - 1
        if n > 0:
            self._waiting_of[w.client_id] = n
        else:
            self._waiting_of.pop(w.client_id, None)

    def _lift(self, client_id: str) -> None:
        """VTC's counter lift: a client that starts waiting gets at least the smallest counter of the
        clients already waiting (credit is not carried over idle periods)."""
        waiting = {q.client_id for q in self.queue.values()} - {client_id}
        c = self.client_service.get(client_id, 0.0)
        if waiting:
            c = max(c, min(self.client_service.get(x, 0.0) for x in waiting))
        self.client_service[client_id] = c

    def _fair_key(self, w: Waiter, held: dict[str, int]) -> tuple[float, int]:
        # a lifted newcomer ties with the least-served waiting client: among equals, the client holding
        # fewer slots right now goes first; the stable sort keeps arrival order after that
        return self.client_service.get(w.client_id, 0.0), held.get(w.client_id, 0)

    def _held(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for lease in self.leases.values():
            held[lease.client_id] = held.get(lease.client_id, 0) + 1
        return held

    def _fair_order(self, jobs: list[int]) -> list[int]:
        held = self._held()
        return sorted(jobs, key=lambda j: self._fair_key(self.queue[self._job_session[j]], held))

    def _waiting_in_order(self) -> list[Waiter]:
        waiters = list(self.queue.values())
        if self.queue_order == "fair":
            held = self._held()
            waiters.sort(key=lambda w: self._fair_key(w, held))
        return waiters

    def release(
        self, session_id: str, now_s: float, *, input_tokens: int = 0, output_tokens: int = 0
    ) -> list[ChainGrant]:
        """The session ended (or left the queue): free its slot; returns the sessions that start now.
        Reported lengths replace the expected ones in its client's service counter."""
        with self.lock:
            self._unpicked.pop(session_id, None)
            if session_id in self.queue:
                self.cancel(session_id)
            lease = self.leases.pop(session_id, None)
            if lease is None:
                return []
            if input_tokens > 0 or output_tokens > 0:
                actual = self.w_in * max(0, input_tokens) + self.w_out * max(0, output_tokens)
                self.client_service[lease.client_id] = (
                    self.client_service.get(lease.client_id, 0.0) + actual - lease.charged
                )
            self.metrics.released += 1
            logger.info(
                "session %s released after %.1f s on chain %s", session_id, now_s - lease.granted_s, lease.chain_id
            )
            return self._free(lease, now_s)

    def _free(self, lease: Lease, now_s: float) -> list[ChainGrant]:
        ch = self.chains.get(lease.chain_id)
        if ch is not None:
            ch.in_use -= 1
            if not ch.dispatchable and ch.in_use == 0:
                del self.chains[ch.chain_id]
            elif not ch.dispatchable:
                ch.capacity = ch.in_use
        if lease.job_id < 0 or self._binding is None:
            return []
        self._job_session.pop(lease.job_id, None)
        return self._starts(self._binding.dispatcher.on_completion(lease.job_id), now_s)

    def heartbeat(self, session_id: str, now_s: float) -> bool:
        with self.lock:
            lease = self.leases.get(session_id)
            if lease is None:
                return False
            lease.expires_s = now_s + self.lease_ttl_s
            return True

    def unknown(self, session_ids: list[str], now_s: float) -> list[str]:
        """Heartbeat: renew the leases; returns the sessions without lease or place in the queue."""
        with self.lock:
            return [s for s in session_ids if not self.heartbeat(s, now_s) and s not in self.queue]

    def expire(self, now_s: float) -> tuple[list[str], list[ChainGrant]]:
        """Release leases past their expiry; returns (expired sessions, grants). Grants no poll picked up
        for UNPICKED_GRANT_TTL_S are forgotten (their lease expires without heartbeats)."""
        with self.lock:
            for sid in [s for s, (_, t) in self._unpicked.items() if now_s - t > UNPICKED_GRANT_TTL_S]:
                del self._unpicked[sid]
            expired, grants = [], []
            for sid, lease in list(self.leases.items()):
                if lease.expires_s < now_s:
                    del self.leases[sid]
                    self.metrics.expired += 1
                    expired.append(sid)
                    grants.extend(self._free(lease, now_s))
            return expired, grants

    def timeouts(self, now_s: float) -> list[str]:
        """Waiters past their deadline leave the queue (their acquire fails with a timeout)."""
        with self.lock:
            gone = [sid for sid, w in self.queue.items() if w.deadline_s <= now_s]
            for sid in gone:
                self.cancel(sid)
                self.metrics.timed_out += 1
            return gone

    def touch(self, session_id: str, now_s: float) -> None:
        """The waiting session's client polled."""
        with self.lock:
            if session_id in self.queue:
                self.queue[session_id].last_seen_s = now_s

    def abandoned(self, now_s: float, max_idle_s: float) -> list[str]:
        """Waiters whose client stopped polling for `max_idle_s` leave the queue (it crashed)."""
        with self.lock:
            gone = [sid for sid, w in self.queue.items() if now_s - w.last_seen_s > max_idle_s]
            for sid in gone:
                self.cancel(sid)
                self.metrics.timed_out += 1
            return gone

    def cancel(self, session_id: str) -> None:
        """A waiting session leaves the queue without a grant; a poll waiting for it wakes up."""
        with self.lock:
            w = self.queue.pop(session_id, None)
            if w is not None:
                self._left_queue(w)
            if w is not None and w.job_id >= 0 and self._binding is not None:
                self._binding.dispatcher.cancel(w.job_id)
                self._job_session.pop(w.job_id, None)
            self._wake(session_id)

    def drop_servers(self, peer_ids: set[str], now_s: float = 0.0) -> tuple[list[str], list[ChainGrant]]:
        """Servers gone: their chains disappear now, and so do the leases on them (the clients fail
        over and ask again). Returns (sessions whose lease was dropped, grants). A per-request router
        is not told: the service installs a router over the surviving servers next."""
        with self.lock:
            lost = {cid for cid, ch in self.chains.items() if set(ch.peers) & peer_ids}
            dropped = []
            for sid, lease in list(self.leases.items()):
                if lease.chain_id in lost:
                    del self.leases[sid]
                    self._unpicked.pop(sid, None)
                    dropped.append(sid)
            grants: list[ChainGrant] = []
            b = self._binding
            if b is not None and not b.per_request:
                grants = self._starts(
                    b.dispatcher.disable(
                        [
                            self.chains[cid].index
                            for cid in lost
                            if self.chains[cid].index is not None
                            and self._live_of_index.get(self.chains[cid].index) == cid
                        ]
                    ),
                    now_s,
                )
            for cid in lost:
                del self.chains[cid]
            for p in peer_ids:  # a lost (or moved) server's cache is gone: its next report lists it anew
                self.prefix_index.forget_server(p)
            self.metrics.dropped += len(dropped)
            return dropped, grants

    def stop_granting(self, peer_ids: set[str], now_s: float) -> list[ChainGrant]:
        """A re-plan drains `peer_ids` before moving them: chains through them take no new session
        (the dispatcher's `disable`, so no policy-specific code), their sessions keep their leases and
        end as usual (their completions free no slot). Chains avoiding them keep serving. Returns grants
        (waiters a per-chain-queue dispatcher re-dispatches). A per-request router is not drained (its
        routes are computed per session over live slots): returns []."""
        with self.lock:
            b = self._binding
            gone = [cid for cid, ch in self.chains.items() if ch.dispatchable and set(ch.peers) & peer_ids]
            for cid in gone:
                ch = self.chains[cid]
                ch.dispatchable = False
                ch.capacity = ch.in_use
                if ch.in_use == 0:
                    del self.chains[cid]
            if b is None or b.per_request:
                return []
            for lease in self.leases.values():
                if lease.chain_id in gone:
                    self._job_session.pop(lease.job_id, None)
                    lease.job_id = -1  # the dispatcher forgets its jobs on disabled chains
            index = [i for i, cid in self._live_of_index.items() if cid in gone]
            for i in index:
                del self._live_of_index[i]
            return self._starts(b.dispatcher.disable(index), now_s)

    def draining(self) -> list[int]:
        """Chains that take no new session (an earlier plan's, or drained for a move)."""
        with self.lock:
            return sorted(cid for cid, ch in self.chains.items() if not ch.dispatchable)

    def sessions_per_peer(self) -> dict[str, int]:
        """Leases per server (one pass over the leases)."""
        with self.lock:
            out: dict[str, int] = {}
            for lease in self.leases.values():
                ch = self.chains.get(lease.chain_id)
                for p in ch.peers if ch is not None else ():
                    out[p] = out.get(p, 0) + 1
            return out

    def holds_lease(self, session_id: str) -> bool:
        with self.lock:
            return session_id in self.leases

    def set_expected_tokens(self, input_tokens: float, output_tokens: float) -> None:
        """The expected (l_in, l_out) a fair queue charges at a grant (the service keeps them current)."""
        with self.lock:
            self.expected_tokens = (float(input_tokens), float(output_tokens))
            # the installed dispatcher's quanta follow, unless set explicitly: fixed at the plan's install
            # they stayed at the prior's session (64 + 2 x 32) under prompts of hundreds of tokens, and
            # D2LPM then moved a client to another chain after every session or two (cache locality lost)
            b = self._binding
            quanta = self._quanta()
            live = b is not None and hasattr(b.dispatcher, "set_quanta")
            if self.dispatch_params is None and live and min(quanta) > 0:  # (0, 0): keep the last ones
                b.dispatcher.set_quanta(*quanta)

    def set_no_chain_reason(self, reason: str | None) -> None:
        """Why no plan exists (acquire then fails at once with NoChainError), or None."""
        with self.lock:
            self.no_chain_reason = reason

    # -- the RPC side: one poll of a waiting session ---------------------------------------------
    def take_grant(self, session_id: str) -> ChainGrant | None:
        with self.lock:
            entry = self._unpicked.pop(session_id, None)
            self._wakers.pop(session_id, None)
            return None if entry is None else entry[0]

    def _granted_before(self, session_id: str, exclude: frozenset[str]) -> ChainGrant | None:
        """The grant a session holds, for a poll that excludes none of its chain's servers: that poll is not
        a failover (a failover excludes the server that failed), so its client never read the grant. Why
        this happens: the client's wait for a poll's reply ended (its timeout, the poll's reply late by more
        than the client's margin) while that poll, still waiting here, took the grant; the reply went to
        nobody and the client's next poll found its session out of the queue. Without this the next poll
        gave the lease back and queued again (losing its place), or, already waiting, failed the session."""
        lease = self.leases.get(session_id)
        ch = None if lease is None else self.chains.get(lease.chain_id)
        if lease is None or lease.grant is None or ch is None or set(ch.peers) & exclude:
            return None
        logger.info(
            "session %s: its grant of chain %s given again (a poll whose reply its client no longer read had taken it)",
            session_id,
            lease.chain_id,
        )
        return lease.grant

    def _wake(self, session_id: str) -> None:
        entry = self._wakers.pop(session_id, None)
        if entry is not None:
            loop, ev = entry
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # its loop is closed (shutdown): nobody waits any more
                pass

    async def poll(
        self,
        session_id: str,
        client_id: str,
        max_length: int,
        *,
        timeout_s: float,
        poll_s: float,
        exclude: frozenset[str],
        clock: Callable[[], float],
        request: DispatchRequest | None = None,
    ) -> ChainGrant | Queued:
        """One long poll of acquire: the grant (made now, or since the last poll), or Queued after at most
        `poll_s`. Raises NoChainError / MaxLengthExceededError at once, AcquireTimeoutError when the
        session's own deadline passed or it left the queue."""
        now = clock()
        with self.lock:
            g = self.take_grant(session_id)
            if g is not None:
                return g
            if session_id not in self.queue:  # a new request (or a replacement after failover)
                g = self._granted_before(session_id, exclude)
                if g is not None:
                    return g
                if self._binding is None and self.no_chain_reason:
                    raise NoChainError(f"the orchestrator cannot plan for the servers it knows: {self.no_chain_reason}")
                if self.refuses_length(max_length):
                    raise MaxLengthExceededError(
                        f"max_length={max_length} exceeds what every chain's servers accept; use a smaller max_length"
                    )
                self.acquire(
                    session_id, client_id, max_length, now, timeout_s=timeout_s, exclude=exclude, request=request
                )
                g = self.take_grant(session_id)
                if g is not None:
                    return g
            self.touch(session_id, now)
            deadline = self.queue[session_id].deadline_s
            ev = asyncio.Event()
            self._wakers[session_id] = (asyncio.get_running_loop(), ev)
        try:
            await asyncio.wait_for(ev.wait(), max(0.0, min(poll_s, deadline - now)))
        except asyncio.TimeoutError:
            pass
        finally:  # also when the RPC is cancelled: no waker outlives its poll
            with self.lock:
                if self._wakers.get(session_id, (None, None))[1] is ev:
                    del self._wakers[session_id]
        with self.lock:
            g = self.take_grant(session_id)
            if g is not None:
                return g
            if session_id not in self.queue:  # another thread took it out (deadline, abandoned, release)
                g = self._granted_before(session_id, exclude)  # or an older poll of this session took its grant
                if g is not None:
                    return g
                raise AcquireTimeoutError(
                    "the session left the orchestrator's queue (its deadline passed or "
                    "its client stopped polling); retry later or raise the timeout"
                )
            if clock() >= deadline:
                self.cancel(session_id)
                self.metrics.timed_out += 1
                raise AcquireTimeoutError(
                    f"no chain slot freed within {timeout_s:.0f} s (queue length "
                    f"{len(self.queue)}); retry later or raise the timeout"
                )
            self.touch(session_id, clock())
            return Queued(list(self.queue).index(session_id) + 1, len(self.queue))

    # -- the global prefix index ----------------------------------------------------------------
    def prefix_report(
        self, peer_id: str, inserted: list[tuple[str, str]], evicted: list[tuple[str, str]], *, full: bool = False
    ) -> None:
        """A server's prefix-cache report (server/prefix_report.py): chunks it stored and dropped since its
        last report, or (`full`) everything it holds (after its restart, or when reports were lost)."""
        with self.lock:
            if full:
                self.prefix_index.replace_server(peer_id, inserted)
            else:
                self.prefix_index.apply(peer_id, inserted, evicted)

    def forget_prefix_server(self, peer_id: str) -> None:
        """A server left (or restarted with an empty cache): nothing of it is reusable."""
        with self.lock:
            self.prefix_index.forget_server(peer_id)

    def prefix_status(self) -> dict:
        """/status's prompt-aware part: the index's size, each live chain's hit rate as the dispatcher
        expected it, and (d2lpm) the deficit counters, the quanta and fair_skips."""
        with self.lock:
            b = self._binding
            out: dict = {
                "prefix_sharing": self.prefix_index.sharing,
                "index_entries": len(self.prefix_index),
                "index_max_entries": self.prefix_index.max_entries,
                "index_dropped_lru": self.prefix_index.dropped_lru,
                "index_dropped_unconfirmed": self.prefix_index.dropped_unconfirmed,
                "refused_floods": self.refused_floods,
            }
            d = None if b is None else b.dispatcher
            if d is not None and getattr(d, "name", None) in PROMPT_AWARE:
                live = {i: cid for i, cid in self._live_of_index.items()}
                out["chain_hit_rate"] = {str(live.get(i, i)): r for i, r in enumerate(d.hit_rates())}
                if isinstance(d, E2Dispatcher):  # requests its rebalancing rule sent to explore, newcomers held
                    out["rebalanced"], out["holds"] = d.rebalanced, d.holds
                if isinstance(d, D2lpmDispatcher):
                    view = d.deficits_view()
                    out["clients_known"], out["client_deficit"] = view["clients_known"], view["client_deficit"]
                    out["chain_deficit"] = {f"{c}@{live.get(k, k)}": q for (c, k), q in view["chain_deficit"].items()}
                    # the knobs in force (the quanta follow the learned session length)
                    p = d.params
                    out["quantum_client"], out["quantum_chain"] = p.quantum_client, p.quantum_chain
                    out["fair_skips"] = p.fair_skips
            return out

    # -- views ----------------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self.queue)

    def chain_views(self) -> list[dict]:
        with self.lock:
            out = []
            b = self._binding
            for ch in sorted(self.chains.values(), key=lambda c: (not c.dispatchable, c.service_time_s, c.chain_id)):
                cap = ch.capacity
                if ch.route and b is not None and b.per_request and ch.dispatchable:
                    # a per-request route has no fixed capacity: report the sessions it could hold right now
                    idx = {p: j for j, p in enumerate(b.peers)}
                    cap = ch.in_use + min(
                        b.dispatcher.free_slots[idx[h.peer_id]] // max(1, h.num_blocks) for h in ch.hops
                    )
                out.append(
                    {
                        "chain_id": ch.chain_id,
                        "servers": list(ch.peers),
                        "blocks": [[h.start, h.end] for h in ch.hops],
                        "capacity": cap,
                        "in_use": ch.in_use,
                        "service_time": ch.service_time_s,
                        "dispatchable": ch.dispatchable,
                    }
                )
            return out

    def sessions_on(self, peer_id: str) -> int:
        with self.lock:
            return sum(
                1
                for lease in self.leases.values()
                if lease.chain_id in self.chains and peer_id in self.chains[lease.chain_id].peers
            )
