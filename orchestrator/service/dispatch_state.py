"""Leases, the central FIFO queue and per-chain session counts, on top of the planner's chains.
Pure: no I/O; every call takes `now_s` (the service passes its clock), so tests drive time.

Two admission modes, chosen by the policy:
- chains (proposed, jffc-only): JFFC (Alg. 3) over the installed chains: a session takes a slot
  on the fastest chain with in_use < capacity; otherwise it waits in one central FIFO queue and a
  freed slot goes to the queue head. `in_use <= capacity` holds for every chain at all times.
  A session may exclude servers (failover) and ask for a max_length; the queue is then served in
  FIFO order among the waiters that a free chain can take. Without exclusions this is exactly
  `orchestrator.dispatch.JffcDispatcher` (tests check the two agree event by event).
- router (petals, bprr): the baseline's per-request router (`make_baseline_router`) picks a route
  per session from its live free-slot bookkeeping and keeps its own waiting list.

Queue order (`queue`): `fifo` (the paper's JFFC, the default) serves waiters in arrival order;
`fair` serves first the waiter whose client has received the least service: a VTC counter per
client (papers/vtc-fairness-in-serving-llms.txt, Algorithm 2) charged `w_in * l_in + w_out * l_out`
of the expected lengths when a session is granted and corrected by the lengths its client reports
at release; a client that starts waiting is lifted to the smallest counter among waiting clients,
so idle time earns no credit. Ties go to the client holding fewer slots, then by arrival. Chain choice stays JFFC's (fastest free chain);
router mode keeps its router's order.

Leases: a granted session holds a lease that its client renews by heartbeats; an expired lease is
released like a finished session, so a crashed client's slot returns.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from orchestrator.baselines.request_router import PerRequestRouter
from petals_chain.messages import ChainGrant, Hop

WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

logger = logging.getLogger(__name__)


@dataclass
class LiveChain:
    chain_id: int
    hops: tuple[Hop, ...]  # in block order
    capacity: int
    service_time_s: float
    max_length_tokens: int = 1 << 30
    in_use: int = 0
    dispatchable: bool = True  # False: from an earlier plan, kept until its sessions end
    route: int | None = None  # router mode: the router's route id

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
    job_id: int = -1
    charged: float = 0.0  # fair queue: what the client's counter was charged at the grant


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


QUEUE_ORDERS = ("fifo", "fair")


class DispatchState:
    def __init__(self, lease_ttl_s: float = 30.0, *, queue: str = "fifo", w_in: float = 1.0, w_out: float = 2.0):
        if lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        if queue not in QUEUE_ORDERS:
            raise ValueError(f"unknown queue order {queue!r}; choose one of {', '.join(QUEUE_ORDERS)}")
        self.lease_ttl_s = lease_ttl_s
        self.queue_order = queue
        self.w_in, self.w_out = w_in, w_out
        self.expected_tokens: tuple[float, float] = (64.0, 32.0)  # (l_in, l_out): the service keeps it current
        self.client_service: dict[str, float] = {}  # fair queue: VTC counter per client
        self.plan_version = 0
        self.chains: dict[int, LiveChain] = {}
        self.leases: dict[str, Lease] = {}
        self.queue: OrderedDict[str, Waiter] = OrderedDict()
        self.metrics = Metrics()
        self._next_chain_id = 0
        self._next_job = 0
        # router mode
        self.router: PerRequestRouter | None = None
        self.router_peers: list[str] = []
        self.router_max_length: dict[str, int] = {}
        self._route_chain: dict[int, int] = {}
        self._job_session: dict[int, str] = {}

    # -- installing plans ---------------------------------------------------------------------
    def _retire_all(self) -> None:
        for cid in list(self.chains):
            ch = self.chains[cid]
            if ch.in_use == 0:
                del self.chains[cid]
            else:
                ch.dispatchable = False
                ch.capacity = ch.in_use  # drains: never takes a new session
        for lease in self.leases.values():
            lease.job_id = -1  # sessions of an earlier router are no longer its jobs
        self.router = None
        self._route_chain.clear()
        self._job_session.clear()

    def install_chains(self, chains: list[tuple[tuple[Hop, ...], int, float, int]],
                       plan_version: int, now_s: float) -> list[ChainGrant]:
        """JFFC mode: `chains` = [(hops, capacity, service_time_s, max_length_tokens)], fastest first.
        Chains of earlier plans keep their sessions and drain. Returns grants to queued sessions."""
        self._retire_all()
        self.plan_version = plan_version
        for hops, cap, t, max_len in chains:
            if cap < 1:
                continue
            cid = self._new_chain_id()
            self.chains[cid] = LiveChain(cid, tuple(hops), int(cap), float(t), int(max_len))
        return self._serve_queue(now_s)

    def install_router(self, router: PerRequestRouter, peer_ids: list[str], max_length_tokens: dict[str, int],
                       plan_version: int, now_s: float) -> list[ChainGrant]:
        """Router mode (petals, bprr): queued sessions are offered to the new router in FIFO order."""
        self._retire_all()
        self.plan_version = plan_version
        self.router = router
        self.router_peers = list(peer_ids)
        self.router_max_length = dict(max_length_tokens)
        grants = []
        for w in list(self.queue.values()):
            w.job_id = self._new_job(w.session_id)
            grants.extend(self._router_starts(router.on_arrival(w.job_id), now_s))
        return grants

    def _new_chain_id(self) -> int:
        self._next_chain_id += 1
        return self._next_chain_id

    def _new_job(self, session_id: str) -> int:
        self._next_job += 1
        self._job_session[self._next_job] = session_id
        return self._next_job

    @property
    def mode(self) -> str:
        return "router" if self.router is not None else "chains"

    # -- sessions -----------------------------------------------------------------------------
    def refuses_length(self, max_length: int) -> bool:
        """True when sessions of `max_length` can never be granted by the installed chains: some chain
        takes sessions now and none accepts that length. With no dispatchable chain (every chain lost a
        server to churn, or all drain) nothing is known about lengths: the session queues for the next
        plan instead of being refused with MaxLengthExceededError."""
        if self.router is None and not any(c.dispatchable for c in self.chains.values()):
            return False
        return not self.fits_any(max_length)

    def fits_any(self, max_length: int) -> bool:
        if self.router is not None:
            return all(v >= max_length for v in self.router_max_length.values()) if self.router_max_length else False
        return any(c.dispatchable and c.max_length_tokens >= max_length for c in self.chains.values())

    def acquire(self, session_id: str, client_id: str, max_length: int, now_s: float, *, timeout_s: float,
                exclude: frozenset[str] = frozenset()) -> tuple[ChainGrant | None, list[ChainGrant]]:
        """Grant `session_id` a chain now, or queue it (returns None). A session that already holds a
        lease (failover) gives it back first; the grants of other sessions that this frees come second."""
        others: list[ChainGrant] = []
        if session_id in self.leases:
            others = self.release(session_id, now_s)
        if session_id in self.queue:
            raise ValueError(f"session {session_id!r} is already waiting")
        w = Waiter(session_id, client_id, max_length, frozenset(exclude), now_s, now_s + timeout_s, last_seen_s=now_s)
        if self.queue_order == "fair" and all(q.client_id != client_id for q in self.queue.values()):
            self._lift(client_id)
        self.queue[session_id] = w
        if self.router is not None:
            w.job_id = self._new_job(session_id)
            others.extend(self._router_starts(self.router.on_arrival(w.job_id), now_s))
        else:
            others.extend(self._serve_queue(now_s))
        mine = next((g for g in others if g.session_id == session_id), None)
        return mine, [g for g in others if g.session_id != session_id]

    def _eligible(self, ch: LiveChain, w: Waiter) -> bool:
        return (ch.dispatchable and ch.in_use < ch.capacity and ch.max_length_tokens >= w.max_length
                and not (w.exclude & set(ch.peers)))

    def _lift(self, client_id: str) -> None:
        """VTC's counter lift: a client that starts waiting gets at least the smallest counter of the
        clients already waiting (credit is not carried over idle periods)."""
        waiting = {q.client_id for q in self.queue.values()} - {client_id}
        c = self.client_service.get(client_id, 0.0)
        if waiting:
            c = max(c, min(self.client_service.get(x, 0.0) for x in waiting))
        self.client_service[client_id] = c

    def _in_service_order(self) -> list[Waiter]:
        waiters = list(self.queue.values())
        if self.queue_order == "fair":
            # a lifted newcomer ties with the least-served waiting client: among equals, the client
            # holding fewer slots right now goes first; the stable sort keeps arrival order after that
            held: dict[str, int] = {}
            for lease in self.leases.values():
                held[lease.client_id] = held.get(lease.client_id, 0) + 1
            waiters.sort(key=lambda w: (self.client_service.get(w.client_id, 0.0), held.get(w.client_id, 0)))
        return waiters

    def _serve_queue(self, now_s: float) -> list[ChainGrant]:
        if self.router is not None:
            return []
        grants = []
        free = sorted((c for c in self.chains.values() if c.dispatchable and c.in_use < c.capacity),
                      key=lambda c: (c.service_time_s, c.chain_id))
        progress = True
        while free and progress:
            progress = False
            for w in self._in_service_order():  # re-ordered after every grant: a grant moves a counter
                ch = next((c for c in free if self._eligible(c, w)), None)
                if ch is None:
                    continue
                grants.append(self._grant(w, ch, now_s))
                if ch.in_use >= ch.capacity:
                    free.remove(ch)
                progress = True
                break
        return grants

    def _grant(self, w: Waiter, ch: LiveChain, now_s: float) -> ChainGrant:
        assert ch.in_use < ch.capacity or ch.route is not None
        del self.queue[w.session_id]
        ch.in_use += 1
        wait = now_s - w.arrived_s
        charge = self.w_in * self.expected_tokens[0] + self.w_out * self.expected_tokens[1]
        self.client_service[w.client_id] = self.client_service.get(w.client_id, 0.0) + charge
        self.leases[w.session_id] = Lease(w.session_id, w.client_id, ch.chain_id, now_s, now_s + self.lease_ttl_s,
                                          wait, w.job_id, charge)
        self.metrics.admitted += 1
        self.metrics.observe_wait(wait)
        # the session id carries an API gateway's request id: this line ties a request to its chain
        logger.info("session %s of %s: chain %s granted after %.3f s in the queue", w.session_id, w.client_id,
                    ch.chain_id, wait)
        return ChainGrant(w.session_id, ch.chain_id, self.plan_version, ch.hops, ch.service_time_s, self.lease_ttl_s,
                          wait, extra={"seq": self.metrics.admitted})

    def _router_starts(self, starts, now_s: float) -> list[ChainGrant]:
        grants = []
        for st in starts:
            sid = self._job_session.pop(st.job_id)
            w = self.queue[sid]
            cid = self._route_chain.get(st.chain_id)
            if cid is None or cid not in self.chains:
                spec = self.router.route(st.chain_id)
                hops = tuple(Hop(self.router_peers[j], b.start, b.end) for j, b in zip(spec.servers, spec.blocks))
                cid = self._new_chain_id()
                max_len = min(self.router_max_length.get(h.peer_id, 1 << 30) for h in hops)
                self.chains[cid] = LiveChain(cid, hops, 0, spec.service_time_s, max_len, route=st.chain_id)
                self._route_chain[st.chain_id] = cid
            grants.append(self._grant(w, self.chains[cid], now_s))
        return grants

    def release(self, session_id: str, now_s: float, *, input_tokens: int = 0,
                output_tokens: int = 0) -> list[ChainGrant]:
        """The session ended: free its slot; returns the sessions that start now (queue head first).
        Reported lengths replace the expected ones in its client's service counter."""
        lease = self.leases.pop(session_id, None)
        if lease is None:
            return []
        if input_tokens > 0 or output_tokens > 0:
            actual = self.w_in * max(0, input_tokens) + self.w_out * max(0, output_tokens)
            self.client_service[lease.client_id] = self.client_service.get(lease.client_id, 0.0) + actual - lease.charged
        self.metrics.released += 1
        return self._free(lease, now_s)

    def _free(self, lease: Lease, now_s: float) -> list[ChainGrant]:
        ch = self.chains.get(lease.chain_id)
        if ch is not None:
            ch.in_use -= 1
            if not ch.dispatchable and ch.in_use == 0:
                del self.chains[ch.chain_id]
            elif not ch.dispatchable:
                ch.capacity = ch.in_use
        if self.router is not None and lease.job_id >= 0:
            return self._router_starts(self.router.on_completion(lease.job_id), now_s)
        return self._serve_queue(now_s)

    def heartbeat(self, session_id: str, now_s: float) -> bool:
        lease = self.leases.get(session_id)
        if lease is None:
            return False
        lease.expires_s = now_s + self.lease_ttl_s
        return True

    def expire(self, now_s: float) -> tuple[list[str], list[ChainGrant]]:
        """Release leases past their expiry; returns (expired sessions, grants)."""
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
        gone = [sid for sid, w in self.queue.items() if w.deadline_s <= now_s]
        for sid in gone:
            self.cancel(sid)
            self.metrics.timed_out += 1
        return gone

    def touch(self, session_id: str, now_s: float) -> None:
        """The waiting session's client polled."""
        if session_id in self.queue:
            self.queue[session_id].last_seen_s = now_s

    def abandoned(self, now_s: float, max_idle_s: float) -> list[str]:
        """Waiters whose client stopped polling for `max_idle_s` leave the queue (it crashed)."""
        gone = [sid for sid, w in self.queue.items() if now_s - w.last_seen_s > max_idle_s]
        for sid in gone:
            self.cancel(sid)
            self.metrics.timed_out += 1
        return gone

    def cancel(self, session_id: str) -> None:
        w = self.queue.pop(session_id, None)
        if w is not None and self.router is not None and w.job_id >= 0:
            self.router.cancel(w.job_id)
            self._job_session.pop(w.job_id, None)

    def drop_servers(self, peer_ids: set[str]) -> list[str]:
        """Servers gone: their chains disappear now, and so do the leases on them (the clients fail
        over and ask again). Returns the sessions whose lease was dropped. In router mode the caller
        installs a router over the surviving servers next."""
        lost = {cid for cid, ch in self.chains.items() if set(ch.peers) & peer_ids}
        dropped = []
        for sid, lease in list(self.leases.items()):
            if lease.chain_id in lost:
                del self.leases[sid]
                dropped.append(sid)
        for cid in lost:
            del self.chains[cid]
        self.metrics.dropped += len(dropped)
        return dropped

    # -- views ----------------------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self.queue)

    def chain_views(self) -> list[dict]:
        out = []
        for ch in sorted(self.chains.values(), key=lambda c: (not c.dispatchable, c.service_time_s, c.chain_id)):
            cap = ch.capacity
            if ch.route is not None and self.router is not None and ch.dispatchable:
                # a per-request route has no fixed capacity: report the sessions it could hold right now
                idx = {p: j for j, p in enumerate(self.router_peers)}
                cap = ch.in_use + min(self.router.free_slots[idx[h.peer_id]] // max(1, h.num_blocks) for h in ch.hops)
            out.append({"chain_id": ch.chain_id, "servers": list(ch.peers),
                        "blocks": [[h.start, h.end] for h in ch.hops], "capacity": cap, "in_use": ch.in_use,
                        "service_time": ch.service_time_s, "dispatchable": ch.dispatchable})
        return out

    def sessions_on(self, peer_id: str) -> int:
        return sum(1 for lease in self.leases.values()
                   if lease.chain_id in self.chains and peer_id in self.chains[lease.chain_id].peers)
