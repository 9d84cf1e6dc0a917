"""The remote chain backend: relays a session's hidden states through servers over hivemind.

By default the servers relay (`relay="server"`): the first server pushes its output to the second
and so on, while the client sends its own copies and keeps every hop's output for failover (the
paper's tau_c,ij, footnote 4). With `relay="client"` the client alone relays, as PETALS without
rpc_push does (the paper's default tau_c model). A session's relay and its recovery from
failures live in `remote_session.py`; this module finds the servers and runs stateless forwards.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable

import torch
from hivemind.p2p import PeerID

from petals_chain.client.chain import ChainBackend, PromptPrefix
from petals_chain.client.hop_client import (  # noqa: F401
    HopClient,
    HopFailed,
    as_server_error,
)
from petals_chain.client.lease import Lease
from petals_chain.client.orchestrated import OrchestratorChainProvider
from petals_chain.client.peer_health import PeerHealth
from petals_chain.client.recovery import BUSY_BACKOFF_S, Action, Decision, Recovery
from petals_chain.client.remote_session import RemoteChainSession
from petals_chain.client.routing import (
    ChainProvider,
    DhtChainProvider,
    min_latency_chain,
)
from petals_chain.client.session_context import RelayDialer, SessionContext
from petals_chain.client.verification import Verification, VerificationConfig, sign_report
from petals_chain.errors import InvalidRequestError, NoChainError
from petals_chain.process.loop import BackgroundLoop
from petals_chain.process.signals import start_dht
from petals_chain.swarm.identity import SwarmIdentity, swarm_validators
from petals_chain.swarm.records import fetch_servers, find_orchestrator, model_key
from petals_chain.transport.protocol import OrchestratorService, ping_block_server_s
from petals_chain.wire import codec as wire
from petals_chain.wire import parts as wire_parts
from petals_chain.wire import records as wire_records
from petals_chain.wire.messages import ReportReply, VerificationReport

logger = logging.getLogger(__name__)

RELAYS = ("server", "client")
REPORT_FIND_ORCHESTRATOR_S = 12.0  # how long a verification report looks for the orchestrator's record


class RemoteChain(ChainBackend):
    def __init__(
        self,
        model: str,
        config,
        initial_peers: list[str],
        dtype: torch.dtype = torch.float32,
        *,
        provider: ChainProvider | None = None,
        step_timeout_s: float = 30.0,
        open_timeout_s: float = 15.0,
        max_failovers: int = 3,
        wait_for_chain_s: float = 20.0,
        use_orchestrator: bool = True,
        acquire_timeout_s: float = 120.0,
        allowed_servers: frozenset[str] | list[str] | None = None,
        identity_path: str | None = None,
        prefix_reuse: bool = True,
        relay: str = "server",
        direct_streams: bool = True,
        peer_health: PeerHealth | None = None,
        verification: VerificationConfig | None = None,
    ):
        self.model = model_key(model)
        self.num_blocks = config.num_hidden_layers
        self.dtype = dtype
        self.step_timeout_s = step_timeout_s
        self.open_timeout_s = open_timeout_s
        self.max_failovers = max_failovers
        self.busy_backoff_s = BUSY_BACKOFF_S  # an open refused by a full server waits these, in turn
        self.prefix_reuse = prefix_reuse  # send prompt prefix keys with opens (servers' prefix caches)
        if relay not in RELAYS:
            raise InvalidRequestError(f"relay must be one of {', '.join(RELAYS)}, got {relay!r}")
        # "server": each hop pushes its output straight to the next (server/relay.py); the client
        # still sends its own copy and keeps every hop's output (history for failover). "client":
        # the client alone relays, hop by hop, as PETALS without rpc_push does
        self.relay = relay
        # `identity_path`: a stable peer id, e.g. to be listed in a private swarm's --allowed-peers
        verification = verification or VerificationConfig()
        # spot checks sign their reports with the peer's identity (a fresh one without `identity_path`)
        self.identity = (
            SwarmIdentity.load_or_create(identity_path)
            if identity_path is not None or verification.spot_checks
            else None
        )
        identity = {"record_validators": swarm_validators()} if self.identity is None else self.identity.dht_kwargs()
        self.dht = start_dht(initial_peers=initial_peers, client_mode=True, **identity)
        self.loop = BackgroundLoop("client-p2p")
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout_s=30)
        # `direct_streams`: session streams over plain TCP to servers that offer them (launch-server
        # --direct-port), else through the p2p daemons (petals_chain/transport/direct_stream.py)
        self.hops = HopClient(
            self.loop,
            self.p2p,
            step_timeout_s=step_timeout_s,
            open_timeout_s=open_timeout_s,
            direct_streams=direct_streams,
        )
        # a private swarm: records of servers (and of an orchestrator) not on this list are ignored
        allowed = None if allowed_servers is None else frozenset(allowed_servers)
        self.allowed_servers = allowed
        self.orchestrator = (
            find_orchestrator(self.dht, self.model, allowed) if provider is None and use_orchestrator else None
        )
        if provider is None and self.orchestrator is not None:
            provider = OrchestratorChainProvider(
                self.loop,
                self.p2p,
                self.orchestrator.peer_id,
                acquire_timeout_s=acquire_timeout_s,
                rediscover=lambda: getattr(find_orchestrator(self.dht, self.model, allowed), "peer_id", None),
            )
        self.provider = provider or DhtChainProvider(
            lambda: fetch_servers(self.dht, self.model, allowed=allowed),
            self.ping_s,
            wait_for_chain_s=wait_for_chain_s,
            dtype=str(dtype).removeprefix("torch."),
        )
        # who is relayed (behind a NAT) and connecting through the relays: one owner for every session
        self.relays = RelayDialer(self.loop, self.p2p, lambda: fetch_servers(self.dht, self.model, allowed=allowed))
        # servers seen failing, banned with backoff for every session of this client (pass one object to
        # several clients to share it)
        self.peer_health = peer_health if peer_health is not None else PeerHealth()
        # cheap checks of every reply, spot checks by redundancy (client/verification.py)
        # (a server a spot check convicts goes on `peer_health` for good: every session leaves it out)
        self.verification = Verification(
            verification, self, send_report=self._send_report, peer_health=self.peer_health
        )

    def _send_report(self, report: VerificationReport, tensors: tuple[torch.Tensor, ...]) -> str:
        """A signed verification report to the orchestrator (rpc_report); its answer, in words."""
        if self.identity is None:
            return "no identity to sign with"
        # the swarm's orchestrator, also when this client routes by itself. Its record lives 3 announce
        # periods (6 s) and may lapse for a while when the orchestrator or the DHT is slow under load, so
        # look for REPORT_FIND_ORCHESTRATOR_S, about twice that (on the verification thread, never a session's)
        orchestrator = self.orchestrator
        deadline = time.monotonic() + REPORT_FIND_ORCHESTRATOR_S
        while orchestrator is None:
            orchestrator = find_orchestrator(self.dht, self.model, self.allowed_servers)
            if orchestrator is not None or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        if orchestrator is None:
            return "no orchestrator to report to"
        sign_report(report, self.identity)
        (request, *more) = wire_parts.to_messages(report.to_wire(), tensors)
        if more:
            return "not sent: its evidence exceeds one message"
        stub = OrchestratorService.get_stub(self.p2p, PeerID.from_base58(orchestrator.peer_id))
        resp = self.loop.run(stub.rpc_report(request, timeout=60.0), timeout_s=62.0)
        reply = wire.decode_reply(wire.unpack(resp.metadata), ReportReply)
        return (
            f"counted: {reply.reporters} reporter(s), excluded={reply.excluded}"
            if reply.counted
            else f"not counted: {reply.detail}"
        )

    def session_context(self) -> SessionContext:
        """What a session opened now uses of this client (the provider as set now: tests swap it)."""
        return SessionContext(
            model=self.model,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
            step_timeout_s=self.step_timeout_s,
            max_failovers=self.max_failovers,
            server_relay=self.server_relay,
            loop=self.loop,
            hops=self.hops,
            provider=self.provider,
            peer_health=self.peer_health,
            relays=self.relays,
            busy_backoff_s=tuple(self.busy_backoff_s),
        )

    @property
    def server_relay(self) -> bool:
        return self.relay == "server"

    def stub(self, peer_id: str):
        return self.hops.stub(peer_id)

    def ping_s(self, peer_id: str) -> float | None:
        """Round trip of rpc_info, or None when the peer does not answer within 3 s."""
        self.relays.dial([peer_id])
        return ping_block_server_s(self.loop, self.p2p, peer_id)

    def server_info(self, peer_id: str) -> wire_records.ServerInfo:
        resp = self.loop.run(
            self.stub(peer_id).rpc_info(wire.request(wire_records.InfoRequest()), timeout=5.0), timeout_s=7.0
        )
        return wire.decode_reply(wire.unpack(resp.metadata), wire_records.InfoReply).info

    def forward(self, hidden: torch.Tensor, adapter: str | None = None) -> torch.Tensor:
        """Stateless forward of [batch, seq, hidden] through a whole chain (rpc_forward), with the LoRA
        `adapter` if given; with an orchestrator it holds a chain slot for the call's duration."""
        sid = "forward-" + uuid.uuid4().hex
        # a stateless forward has no cache to rebuild, so it simply runs again: on the same chain once
        # if the server still answers (a stream that broke on a live server), else on a chain without
        # it (the same session id keeps an orchestrator's lease)
        recovery = Recovery(self.max_failovers, self.peer_health, ping_s=self.ping_s)
        lease = Lease(self.provider, sid, num_blocks=self.num_blocks, max_length=hidden.shape[1], adapter=adapter)

        def attempt() -> torch.Tensor:
            self.relays.dial([h.peer_id for h in lease.hops])
            x = hidden
            for hop in lease.hops:
                x = self.hops.forward(hop, x.to(self.dtype), adapter)
            self.peer_health.report_success(h.peer_id for h in lease.hops)
            return x

        def repair(_failed: HopFailed, decision: Decision) -> None:
            if decision.action is not Action.SAME:
                recovery.ask(lease.acquire)

        try:
            recovery.ask(lease.acquire)
            return recovery.run(attempt, repair, "forward")
        finally:
            lease.release(lease.hops)

    def open_session(
        self,
        max_length: int,
        prefix: PromptPrefix | None = None,
        adapter: str | None = None,
        *,
        session_id: str | None = None,
        avoid: Iterable[str] = (),
    ) -> "RemoteChainSession":
        """`prefix`: the prompt, offered to the hops' prefix caches (`remote_session.py`); `adapter`:
        the LoRA adapter of the session (only servers that list it are used); `avoid`: peer ids of
        servers the session must not use."""
        # spot checks audit a hop from its own inputs: a prefix its cache supplied is not among them
        reuse = self.prefix_reuse and not self.verification.config.spot_checks
        session = RemoteChainSession(
            self.session_context(),
            max_length,
            prefix if reuse else None,
            adapter,
            session_id=session_id,
            avoid=avoid,  # and what `peer_health` bans, convicted servers included
        )
        session.verifier = self.verification.session(session)
        return session

    def unready_reason(self) -> str | None:
        """None once the DHT lists online servers that cover every block (a chain the provider
        can dispatch), else the reason; with an orchestrator, also that it is still announced."""
        servers = fetch_servers(self.dht, self.model, allowed=self.allowed_servers)
        try:
            min_latency_chain(servers, 0, self.num_blocks, lambda _peer: 0.0)
        except NoChainError as e:
            return f"model {self.model}: {e}"
        if self.orchestrator is not None and find_orchestrator(self.dht, self.model, self.allowed_servers) is None:
            return f"the orchestrator of {self.model} is no longer announced in the DHT"
        return None

    def shutdown(self) -> None:
        self.verification.close()
        self.provider.close()
        try:
            self.loop.run(self.p2p.shutdown(), timeout_s=5)
        except Exception:
            logger.debug("p2p shutdown failed", exc_info=True)
        try:
            self.dht.shutdown()
        finally:
            self.loop.stop()
