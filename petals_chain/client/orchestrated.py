"""`OrchestratorChainProvider`: the client asks the online orchestrator for chains.

find_chain(0, L) = rpc_acquire: JFFC's chain, or a wait in the central FIFO queue (long polls of a
few seconds each, so a dead orchestrator is noticed within one poll; the session then waits for an
orchestrator to answer again, the same one or a new one the DHT announces, until its acquire
deadline, and only then gets `OrchestratorUnavailableError`), or `AcquireTimeoutError` after
`acquire_timeout_s`. session_finished = rpc_release (with the session's input/output lengths, which
refine the orchestrator's tau estimates). A heartbeat thread renews the leases of open sessions. On
a server failure the session asks again with the failed server excluded and replaces its whole chain
(`whole_chain_failover`), so it always runs on exactly the chain the orchestrator counts it on.
The provider keeps only the leases held now; what a session was granted is on its `Lease`
(`client/lease.py`), which also makes sure each grant is released once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from hivemind.p2p import PeerID

from petals_chain.client.routing import Acquired, ChainProvider
from petals_chain.errors import OrchestratorUnavailableError, PetalsChainError
from petals_chain.transport.protocol import OrchestratorService
from petals_chain.wire import codec as wire
from petals_chain.wire.messages import (
    Acquire,
    ChainGrant,
    Granted,
    Heartbeat,
    HeartbeatReply,
    HopReport,
    Queued,
    Release,
    Released,
    decode_tagged,
)
from petals_chain.wire.prefix_keys import MAX_PREFIX_HASHES, PREFIX_CHUNK_TOKENS
from petals_chain.wire.record import WireRecord

logger = logging.getLogger(__name__)


# Steps of at most this many tokens time a hop's per-step cost (a decode step, a speculative draft's
# verification); a prompt's step does not: its time beyond the RTT is mostly moving its hidden states
# (a 1,676-token bfloat16 prompt at hidden size 4,096 is 13.7 MB per hop: 3.3 s of client time against
# 0.045 s of server time on a GPU run in docs/results.md), which spread over the session's steps made the
# "per-step" cost 67-103 ms there, ten times the decode steps' own
HOP_COST_MAX_TOKENS = 16


def hop_reports(hop_timings) -> list[HopReport] | None:
    """Per server: steps and summed (client - server) time of the steps that reported a server time
    and were a round trip from the client (not pushed by the hop before: with server relay only a
    chain's first hop is timed that way; the orchestrator gives the others the swarm's median);
    those of at most HOP_COST_MAX_TOKENS tokens as `steps`/`comm_s` (the per-step cost), the longer
    ones (prompts) as `prompt_steps`/`prompt_tokens`/`prompt_comm_s` (the transfer per token)."""
    acc: dict[str, list] = {}
    for t in hop_timings:
        if t.server_s is not None and not t.pushed:
            a = acc.setdefault(t.peer_id, [0, 0.0, 0, 0, 0.0])
            comm_s = max(0.0, t.client_s - t.server_s)
            if t.tokens <= HOP_COST_MAX_TOKENS:
                a[0] += 1
                a[1] += comm_s
            else:
                a[2] += 1
                a[3] += t.tokens
                a[4] += comm_s
    return [HopReport(p, *a) for p, a in acc.items()] or None


class OrchestratorChainProvider(ChainProvider):
    whole_chain_failover = True

    def __init__(
        self,
        loop,
        p2p,
        orchestrator_peer_id: str,
        *,
        acquire_timeout_s: float = 120.0,
        poll_s: float = 5.0,
        rpc_margin_s: float = 5.0,
        rediscover=None,
        retry_unavailable_s: float = 1.0,
    ):
        """`rediscover()` returns the peer id of the orchestrator the DHT announces now (or None):
        when the known one does not answer and the DHT names another, calls go there."""
        self.rediscover = rediscover
        self.loop = loop
        self.p2p = p2p
        self.acquire_timeout_s = acquire_timeout_s
        self.poll_s = poll_s
        self.rpc_margin_s = rpc_margin_s
        self.retry_unavailable_s = retry_unavailable_s  # between acquire attempts while no orchestrator answers
        # Written by the sessions' threads and the heartbeat thread, so all under `_lock`: the leases held
        # now (an entry from a grant to its release or loss: as many as open sessions, never more), the
        # orchestrator's address (moved by `_call` when the DHT names a new one) and the heartbeat period.
        # What a session was granted (wait, chain) lives on the session's lease, not here.
        self._lock = threading.Lock()
        self.grants: dict[str, ChainGrant] = {}
        self._orchestrator_peer_id = orchestrator_peer_id
        self._heartbeat_period_s = 2.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="lease-heartbeat", daemon=True)
        self._thread.start()

    @property
    def orchestrator_peer_id(self) -> str:
        with self._lock:
            return self._orchestrator_peer_id

    def held_leases(self) -> int:
        with self._lock:
            return len(self.grants)

    def _call(self, method: str, meta: WireRecord, timeout_s: float) -> dict:
        peer_id = self.orchestrator_peer_id
        try:
            return self._call_once(peer_id, method, meta, timeout_s)
        except OrchestratorUnavailableError:
            new = None
            if self.rediscover is not None:
                try:
                    new = self.rediscover()
                except Exception:
                    logger.debug("looking the orchestrator up again failed", exc_info=True)
            if not new or new == peer_id:
                raise
            with self._lock:
                # compare-and-set: another thread may have moved it already (to this one or a newer one)
                moved = self._orchestrator_peer_id == peer_id
                if moved:
                    self._orchestrator_peer_id = new
            if moved:
                logger.warning("orchestrator %s is gone; using %s, which the DHT announces now", peer_id[-8:], new[-8:])
            return self._call_once(new, method, meta, timeout_s)

    def _call_once(self, peer_id: str, method: str, meta: WireRecord, timeout_s: float) -> dict:
        stub = OrchestratorService.get_stub(self.p2p, PeerID.from_base58(peer_id))
        try:
            resp = self.loop.run(getattr(stub, method)(wire.request(meta), timeout=timeout_s), timeout_s=timeout_s + 2)
        except Exception as e:
            raise OrchestratorUnavailableError(
                f"the orchestrator {peer_id[-8:]} did not answer {method} "
                f"({type(e).__name__}: {e or 'no reply'}); restart it, or open the model with "
                "use_orchestrator=False to route client-side"
            ) from None
        out = wire.unpack(resp.metadata)
        wire.raise_if_error(out)
        return out

    takes_prompt = True

    def find_chain(
        self,
        start,
        end,
        *,
        exclude=frozenset(),
        max_length=0,
        session_id="",
        adapter=None,
        prefix_hashes=(),
        prompt_tokens=0,
    ):
        return self.acquire(
            start,
            end,
            exclude=exclude,
            max_length=max_length,
            session_id=session_id,
            adapter=adapter,
            prefix_hashes=prefix_hashes,
            prompt_tokens=prompt_tokens,
        ).hops

    def acquire(
        self,
        start,
        end,
        *,
        exclude=frozenset(),
        max_length=0,
        session_id="",
        adapter=None,
        prefix_hashes=(),
        prompt_tokens=0,
    ) -> Acquired:
        """`prefix_hashes`, `prompt_tokens`: the session's prompt (its chained chunk hashes, the first
        MAX_PREFIX_HASHES, and its length), so a prompt-aware dispatcher can send it where its prefix is cached."""
        if not session_id:
            raise PetalsChainError("OrchestratorChainProvider.find_chain needs the session id")
        deadline = time.monotonic() + self.acquire_timeout_s
        max_length = int(max_length or 1)
        prompt_tokens = min(int(prompt_tokens), max_length)
        hashes = list(prefix_hashes)[: min(MAX_PREFIX_HASHES, prompt_tokens // PREFIX_CHUNK_TOKENS)]
        meta = Acquire(
            session_id,
            max_length,
            float(self.acquire_timeout_s),
            float(self.poll_s),
            sorted(exclude),
            adapter,
            hashes or None,
            prompt_tokens or None,
        )
        while True:
            try:
                out = decode_tagged(self._call("rpc_acquire", meta, self.poll_s + self.rpc_margin_s), Granted, Queued)
            except OrchestratorUnavailableError as e:
                # no orchestrator answers (it died; a restarted one may not have announced itself yet):
                # the session waits for one as it would wait in the queue, until its acquire deadline
                if time.monotonic() + self.retry_unavailable_s > deadline:
                    raise OrchestratorUnavailableError(
                        f"{e} (no orchestrator answered within the acquire timeout of {self.acquire_timeout_s:.0f} s)"
                    ) from None
                logger.warning("%s; asking again in %.0f s", e, self.retry_unavailable_s)
                self._stop.wait(self.retry_unavailable_s)
                continue
            if isinstance(out, Granted):
                grant = out.grant
                with self._lock:
                    self.grants[session_id] = grant
                    self._heartbeat_period_s = max(0.5, grant.lease_ttl_s / 3)
                hops = [dataclasses.replace(h, start=max(h.start, start)) for h in grant.hops if h.end > start]
                return Acquired(hops, grant)
            if time.monotonic() > deadline + self.rpc_margin_s:  # the orchestrator should have said so
                raise OrchestratorUnavailableError("the orchestrator kept the session queued past its timeout")
            logger.debug("session %s queued at position %s", session_id[:8], out.position)

    def session_finished(self, hops, *, session_id="", input_tokens=0, output_tokens=0, hop_timings=()):
        with self._lock:
            self.grants.pop(session_id, None)
        try:
            release = Release(session_id, int(input_tokens), int(output_tokens), hop_reports(hop_timings))
            Released.from_wire(self._call("rpc_release", release, 5.0))
        except PetalsChainError as e:  # the lease expires by itself; say so, do not fail the caller's close
            logger.warning("release of session %s failed: %s (its lease will expire)", session_id[:8], e)

    def _heartbeat_period(self) -> float:
        with self._lock:
            return self._heartbeat_period_s

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_period()):
            try:
                self.heartbeat_once()
            except PetalsChainError as e:
                logger.warning("heartbeat failed: %s", e)

    def heartbeat_once(self) -> list[str]:
        """Renew every held lease; returns the sessions whose lease the orchestrator has lost.

        Why the grant objects are compared: the snapshot is taken before the RPC and the lock is not
        held across it, so a session may be released (or released and re-acquired by a failover)
        while the heartbeat is in flight. The orchestrator then rightly answers "unknown" for a lease
        that this client no longer holds; only a lease still held under the same grant was lost."""
        with self._lock:
            held = dict(self.grants)
        if not held:
            return []
        out = HeartbeatReply.from_wire(self._call("rpc_heartbeat", Heartbeat(sorted(held)), 5.0))
        lost = []
        with self._lock:
            for sid in out.unknown:
                if sid in held and self.grants.get(sid) is held[sid]:
                    lost.append(sid)
                    # say it once: a lost lease is not renewed (a failover acquires a new one)
                    del self.grants[sid]
        for sid in lost:
            logger.warning(
                "the orchestrator no longer holds the lease of session %s (it expired or its chain "
                "lost a server); the session keeps its streams but is no longer counted",
                str(sid)[:8],
            )
        return lost

    def close(self) -> None:
        self._stop.set()
