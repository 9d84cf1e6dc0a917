"""`BlockServer`: hosts one contiguous block range in a hivemind swarm.

Life cycle: load blocks -> measure t_I/t_O (cached) -> join the DHT -> register RPC handlers ->
announce `online` every `announce_period_s` with an expiration of `record_ttl_s` (a dead server
disappears within seconds) -> on shutdown announce `offline`, stop, leave.

With `start=end=None` (`--blocks auto`) the range comes from the orchestrator: measure t_I/t_O on
one block loaded temporarily -> join the DHT and register handlers -> announce `joining` with no
blocks (budget, s_m, s_c, t_I, t_O) -> ask the orchestrator (rpc_assignment) until it assigns a
range -> load exactly that range -> announce `online`. A later plan may move the server; it moves
only while it holds no session and none waits to open, unless the assignment forces the move (a
re-plan's drain deadline passed): then it closes its sessions with `ServerMovingError` first.

The start-up is a stack of resources (`BlockServer.STARTUP`): a failure at any stage tears down what
the earlier stages started, in reverse order. The lifecycle (state, serving stack, profile) is owned by
`server/lifecycle.py:ServerLifecycle`; every record is built from one snapshot of it, and `offline`
is final.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from contextlib import ExitStack

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from petals_chain.errors import PetalsChainError, ServerMovingError
from petals_chain.models.checkpoint import load_config, resolve_model_path
from petals_chain.models.family import get_family
from petals_chain.process.heap import freeze_startup_heap
from petals_chain.process.loop import BackgroundLoop
from petals_chain.process.signals import start_dht
from petals_chain.runtime.block_range import BlockRange
from petals_chain.runtime.lora import adapter_name
from petals_chain.swarm.identity import SwarmIdentity
from petals_chain.swarm.reachability import (
    UnreachableError,
    check_reachability,
    circuit_maddrs,
    dht_ping_s,
    p2pd_flags,
    relay_peer_id,
    relayed_dht_kwargs,
    serve_dial_back,
)
from petals_chain.swarm.records import (
    announce_server,
    fetch_servers,
    find_orchestrator,
    model_key,
)
from petals_chain.transport.direct_stream import (
    DirectDialer,
    DirectListener,
    offered_hosts,
)
from petals_chain.transport.protocol import (
    BlockService,
    OrchestratorService,
    ping_block_server_s,
)
from petals_chain.wire import codec as wire
from petals_chain.wire.messages import (
    AssignmentReply,
    AssignmentRequest,
    AssignmentStatus,
)
from petals_chain.wire.records import Reachability, ServerInfo, ServerState
from server.block_selection import (
    HeldSpan,
    better_start,
    block_throughputs,
    choose_start,
)
from server.config import ServerConfig
from server.emulation import real_range, slowed_times
from server.handler import BlockServicer, ServicerLimits
from server.lifecycle import LifecycleView, ServerLifecycle
from server.peer_rtts import PeerRtts, choose_peers
from server.profiling import BlockTimes
from server.range_profile import (
    RangeProfile,
    cached_range_profile,
    disagrees,
    forget_profile,
)
from server.service_log import ServiceLog
from server.service_meter import ServiceMeter
from server.serving_stack import build_stack

logger = logging.getLogger(__name__)


class BlockServer:
    """One block server. Its start-up is a stack of resources (`STARTUP`, each stage pushing the undo
    of what it started onto one `ExitStack`): a start-up that fails (or is interrupted) at any stage
    tears down exactly what the stages before it started, in reverse order, and `shutdown` unwinds
    the same stack. Its lifecycle (state, serving stack, profile) has one owner, `self.lifecycle`
    (server/lifecycle.py); the announcer builds each record from one snapshot of it."""

    # the start-up's stages, in order (each `_start_<stage>(resources)`); tests inject failures here
    STARTUP = ("blocks", "dht", "loop", "p2p", "handlers", "peer_rtts", "announce", "placement", "online")
    # how long the unwinding waits for the server's threads to end, all together (each waits on `_stop`,
    # so this is for one caught mid-step, e.g. a peer's RTT probe; a Ctrl-C must end within seconds)
    THREAD_JOIN_S = 3.0
    # a forced move: how long it waits for the sessions it closed to end before it reloads (each ends
    # after its running step: a prompt's prefill at most, seconds on a loaded CPU)
    MOVE_CLOSE_WAIT_S = 30.0

    def __init__(self, config: ServerConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_name = model_key(config.model)
        self.max_length_tokens = config.max_length_tokens
        self.session_idle_timeout_s = config.session_idle_timeout_s
        self.service_log: ServiceLog | None = None
        self.meter = ServiceMeter()  # every batch's measured service, for the orchestrator's model
        self.lifecycle = ServerLifecycle()  # state, serving stack, profile: one owner, one lock
        self._profile_checked_seq = -1  # the announcer thread's (check_profile): batches checked so far
        self.max_step_tokens = config.max_step_tokens or config.max_length_tokens
        self.path = resolve_model_path(config.model)
        self.self_placed = config.num_blocks is not None  # --num-blocks: chooses its own span
        self.auto = config.start is None and not self.self_placed
        self.orchestrator = None
        self.peer_rtts = PeerRtts(
            max_peers=config.peer_rtt_max_peers, probes=config.peer_rtt_probes, period_s=config.peer_rtt_period_s
        )  # before rpc_info can be called (info())
        self.relay_rtts = PeerRtts(probes=config.peer_rtt_probes, period_s=config.peer_rtt_period_s)  # relayed only
        self.relay_maddrs: tuple[str, ...] = ()
        self.reachability = Reachability.DIRECT
        self.dht = self.loop = self.p2p = self.direct = None
        self._stop = threading.Event()  # the server's threads end when it is set
        # announcements one at a time, each from one snapshot: a store begun before shutdown's
        # `offline` ends before it, so `offline` (the later expiration) is the record that stays
        self._announcing = threading.Lock()
        self._announcer: threading.Thread | None = None
        self._join_deadline_s: float | None = None
        if self.self_placed:
            total = get_family(cfg := load_config(self.path)).num_blocks(cfg)
            if not 1 <= config.num_blocks <= total:
                raise PetalsChainError(
                    f"--num-blocks {config.num_blocks}: the model has {total} blocks; choose 1..{total}"
                )
            self.total_blocks = total
        with ExitStack() as resources:
            for stage in self.STARTUP:
                getattr(self, f"_start_{stage}")(resources)
            self._resources = resources.pop_all()  # shutdown unwinds them

    # -- start-up stages (each pushes the undo of what it started) ------------------------------
    def _start_blocks(self, resources: ExitStack) -> None:
        """The service log, and the blocks: a fixed range's stack, or the one-block probe's profile."""
        if self.config.service_log:
            self.service_log = ServiceLog(self.config.service_log)
            resources.callback(self.service_log.close)
        # whatever stack the lifecycle holds when the start-up unwinds (a fixed range's, an assigned one)
        resources.callback(self._stop_serving)
        c = self.config
        if self.auto or self.self_placed:  # measure on one block loaded for the purpose, before holding any
            probe = BlockRange(self.path, 0, 1, dtype=c.dtype, quant=c.quant, device=c.device, model_path=self.path)
            self.lifecycle.set_profile(*self._profile(probe))
            self._sizes = (
                probe.block_bytes,
                probe.kv_bytes_per_block(self.max_length_tokens),
                str(probe.dtype).removeprefix("torch."),
            )
            del probe
        else:
            self._load(c.start, c.end)

    def _start_dht(self, resources: ExitStack) -> None:
        c = self.config
        self.identity = SwarmIdentity.load_or_create(c.identity_path)
        self.reachability, self.relay_maddrs = self._check_reachability()
        relayed = self.reachability == Reachability.RELAYED
        with p2pd_flags(relay_service=c.relay_service and not relayed):
            self.dht = start_dht(
                initial_peers=c.initial_peers,
                host_maddrs=c.host_maddrs,
                announce_maddrs=c.announce_maddrs or None,
                use_relay=c.use_relay,
                **(relayed_dht_kwargs(c.initial_peers) if relayed else {}),
                **self.identity.dht_kwargs(),
            )
        resources.callback(self.dht.shutdown)
        self.peer_id = str(self.dht.peer_id)

    def _start_loop(self, resources: ExitStack) -> None:
        self.loop = BackgroundLoop("server-p2p")
        resources.callback(self.loop.stop)

    def _start_p2p(self, resources: ExitStack) -> None:
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout_s=30)
        # its tasks must end before the loop stops
        resources.callback(self._on_loop, lambda: self.p2p.shutdown(), "p2p shutdown")

    def _start_handlers(self, resources: ExitStack) -> None:
        """The RPC handlers on p2p, the direct listener's port, and the dial-back service."""
        c = self.config
        limits = ServicerLimits(self.max_length_tokens, self.max_step_tokens, self.session_idle_timeout_s)
        if c.direct_port is not None:
            visible = self.loop.run(self.p2p.get_visible_maddrs(), timeout_s=30)
            bind, hosts = offered_hosts(c.announce_maddrs, c.host_maddrs, [str(m) for m in visible])
            self.direct = DirectListener(self.p2p, hosts, bind_host=bind, port=c.direct_port)
        self._servicer = BlockServicer(
            limits, self.lifecycle, self.info, self.meter, DirectDialer(self.p2p), self.direct
        )
        self.servicer = BlockService(self._servicer, c.allowed_peers)
        resources.callback(self._on_loop, lambda: self.servicer.remove_p2p_handlers(self.p2p), "removing handlers")
        self.loop.run(self.servicer.add_p2p_handlers(self.p2p), timeout_s=30)
        if self.direct is not None:  # the same handlers as the p2p streams (the allowlist's check included)
            resources.callback(self._on_loop, self.direct.close, "closing the direct listener")
            self.loop.run(
                self.direct.start(
                    {
                        BlockService.handle_name(m): (getattr(self.servicer, m), runtime_pb2.ExpertRequest)
                        for m in BlockService.FRAMED_STREAMS
                    }
                ),
                timeout_s=30,
            )
            logger.info("direct streams on port %d (offered at %s)", self.direct.port, ", ".join(self.direct.hosts))
        if self.reachability != Reachability.RELAYED:  # a reachable server checks others' reachability too
            self.loop.run(serve_dial_back(self.p2p), timeout_s=30)
        else:  # the first record already says what the relayed path costs (see _measure_relay_rtts)
            self._measure_relay_rtts()

    def _start_peer_rtts(self, resources: ExitStack) -> None:
        # from now on, also while an auto server waits for its assignment: the orchestrator plans its
        # range with these RTTs
        self._thread(resources, self._measure_peer_rtts, "peer-rtts")

    def _start_announce(self, resources: ExitStack) -> None:
        """The first record (joining); from here on, the unwinding announces `offline` first."""
        resources.callback(self._go_offline)
        self._announce()

    def _start_placement(self, resources: ExitStack) -> None:
        """`--blocks auto`: the orchestrator's assignment; `--num-blocks`: the swarm's weakest span."""
        if self.auto:
            self._join_orchestrator()
        elif self.self_placed:
            n = self.config.num_blocks
            start = choose_start(self._others_throughputs(), n)
            logger.info("--num-blocks %d: taking blocks [%d, %d), the swarm's weakest", n, start, start + n)
            self._load(start, start + n)

    def _start_online(self, resources: ExitStack) -> None:
        if self.lifecycle.go_online():
            self._announce()
        self._announcer = self._thread(resources, self._announce_loop, "announcer")
        if self.auto:
            self._thread(resources, self._follow_assignments, "assignments")
        if self.self_placed:
            self._thread(resources, self._rebalance, "rebalance")

    def _thread(self, resources: ExitStack, target, name: str) -> threading.Thread:
        """A thread of the server's that runs until `_stop`; the unwinding sets it and joins the thread."""
        t = threading.Thread(target=target, name=name, daemon=True)
        resources.callback(self._join, t)
        resources.callback(self._stop.set)
        t.start()
        return t

    def _join(self, thread: threading.Thread) -> None:
        if self._join_deadline_s is None:  # the first join of an unwinding starts its one deadline
            self._join_deadline_s = time.monotonic() + self.THREAD_JOIN_S
        thread.join(timeout=max(0.0, self._join_deadline_s - time.monotonic()))
        if thread.is_alive():  # a daemon: it ends on its own (a move still loading stops its stack itself)
            logger.warning("thread %s did not end within %.0f s of the shutdown", thread.name, self.THREAD_JOIN_S)

    def _on_loop(self, make_coro, what: str) -> None:
        """Run a teardown coroutine on the loop; a failure is logged, never stops the unwinding."""
        try:
            self.loop.run(make_coro(), timeout_s=5)
        except Exception:  # noqa: BLE001 - the rest must still be torn down
            logger.debug("%s failed during shutdown", what, exc_info=True)

    def _check_reachability(self) -> tuple[Reachability, tuple[str, ...]]:
        """Ask the initial peers to dial this host back (petals_chain/swarm/reachability.py); log the verdict.
        Loopback-only listeners (a swarm on one machine) need no check."""
        c = self.config
        if all("/ip4/127." in m for m in c.host_maddrs) or not c.initial_peers:
            return Reachability.DIRECT, ()
        check = asyncio.run(check_reachability(c.initial_peers, c.host_maddrs, c.announce_maddrs or None))
        relays = circuit_maddrs(c.initial_peers)
        if check.reachability == Reachability.RELAYED and not c.use_relay:
            raise UnreachableError(
                f"this server is not reachable from the swarm (dial-back: {check.detail}) and --no-relay forbids "
                "joining through a relay: forward a TCP port to this host, listen on it (--host-maddrs "
                "/ip4/0.0.0.0/tcp/PORT) and announce it (--announce-maddrs /ip4/PUBLIC_IP/tcp/PORT), or drop "
                "--no-relay"
            )
        if check.reachability == Reachability.RELAYED and not relays:
            raise UnreachableError(
                f"this server is not reachable (dial-back: {check.detail}) and no initial peer "
                "has a /p2p/ id to relay through: pass full multiaddrs as --initial-peers"
            )
        verdict = {
            Reachability.DIRECT: "reachable directly",
            Reachability.RELAYED: "NOT reachable directly (NAT or firewall): joining through relays "
            + ", ".join(relays),
            Reachability.UNKNOWN: "unknown (no peer answered the dial-back request): running as a direct peer",
        }
        print(
            f"reachability: {check.reachability} - {verdict[check.reachability]} (dial-back: {check.detail})",
            flush=True,
        )
        return check.reachability, relays if check.reachability == Reachability.RELAYED else ()

    def _load(self, start: int, end: int) -> None:
        """Build a stack for [start, end), profile it and put both in place in one step; the old one
        (which holds no session: a move waits for that) stops after the swap, so no handler ever sees a
        half-replaced stack. Once shut down, the new stack is stopped instead of put in place."""
        stack = build_stack(self.config, self.path, start, end, on_batch=self._on_batch)
        try:
            # the start-up profile of exactly this range, through the real step path (cached per shape)
            times, profile = self._while_announcing(lambda: self._profile(real_range(stack.block_range)))
        except BaseException:
            stack.stop()
            raise
        to_stop = self.lifecycle.install(stack, times, profile)
        if to_stop is not None:
            to_stop.stop()
            del to_stop
        if not self.lifecycle.stopped:
            freeze_startup_heap(f"blocks [{start}, {end})")  # steps never meet a full collection of it

    @property
    def block_range(self) -> BlockRange | None:
        """The current stack's blocks (None before `--blocks auto` gets an assignment)."""
        stack = self.lifecycle.current
        return None if stack is None else stack.block_range

    @property
    def state(self) -> ServerState:
        return self.lifecycle.snapshot().state

    def _while_announcing(self, fn):
        """Run `fn` (seconds: a profile on a loaded machine) while the record stays fresh in the DHT:
        an `--blocks auto` server measures its range before the announcer thread runs, and a record
        that expires (6 s) makes the orchestrator drop the server and re-plan."""
        announcer = self._announcer
        if self.dht is None or (announcer is not None and announcer.is_alive()):
            return fn()  # no DHT yet (a fixed range measures first), or the announcer already runs
        done = threading.Event()

        def keep_alive() -> None:
            while not done.wait(self.config.announce_period_s):
                self._announce()

        t = threading.Thread(target=keep_alive, name="announce-while-profiling", daemon=True)
        t.start()
        try:
            return fn()
        finally:
            done.set()
            t.join(timeout=15)

    def _profile(self, block_range) -> tuple[BlockTimes, RangeProfile]:
        """The range's start-up profile and the t_I, t_O to announce from it (an emulated slowdown
        scales them); the caller hands both to the lifecycle."""
        profile = cached_range_profile(block_range, self.model_name)
        return slowed_times(
            BlockTimes(profile.prefill_s_per_token, profile.lone_decode_s_per_block), self.config.emulate_slowdown
        ), profile

    def check_profile(self, min_batches: int = 100) -> bool:
        """Compare the cached start-up profile with live service (the fit of this range's recent batches);
        when they disagree, drop the cache entry so the next start measures instead of trusting it.
        Returns whether it dropped it. Run by the announcer thread only."""
        from petals_chain.algorithms.service_fit import fit_service

        view = self.lifecycle.snapshot()
        br, prof = (view.stack.block_range if view.stack is not None else None), view.profile
        if br is None or prof is None or prof.blocks != br.end - br.start or view.profile_contradicted:
            return False
        recs = [r for r in self.meter.records() if r.seq > self._profile_checked_seq]
        if len(recs) < min_batches:
            return False
        self._profile_checked_seq = recs[-1].seq
        fit = fit_service(
            [r.prefill_block_tokens for r in recs],
            [r.decode_block_tokens for r in recs],
            [r.wall_s for r in recs],
            sessions=[r.sessions for r in recs],
            blocks=[r.blocks for r in recs],
        )
        if fit is None:
            return False
        # the emulation's sleep is not the device's
        live_step_s = fit.step_s(prof.blocks) / self.config.emulate_slowdown
        if not disagrees(prof, live_step_s, fit.samples):
            return False
        # once is enough: the entry is gone (the next start measures), and saying it every minute is
        # noise; and not at all when a move replaced this profile meanwhile
        if not self.lifecycle.note_profile_contradicted(prof):
            return False
        dropped = forget_profile(real_range(br), self.model_name)
        logger.warning(
            "live service (a lone decode step %.1f ms, fitted over %d batches) disagrees with the cached "
            "start-up profile (%.1f ms): %s",
            live_step_s * 1e3,
            fit.samples,
            prof.lone_step_s * 1e3,
            "dropped it; the next start measures again" if dropped else "it was already gone",
        )
        return dropped

    def _on_batch(self, record: dict) -> None:
        self.meter.on_batch(record)
        if self.service_log is not None:
            self.service_log.write(record)

    # -- orchestrator -------------------------------------------------------------------------
    def _join_orchestrator(self) -> None:
        deadline = time.monotonic() + self.config.orchestrator_wait_s
        while self.orchestrator is None:
            self.orchestrator = find_orchestrator(self.dht, self.model_name)
            if self.orchestrator is None:
                if time.monotonic() > deadline:
                    raise PetalsChainError(
                        f"--blocks auto: no orchestrator of {self.model_name} found in the DHT within "
                        f"{self.config.orchestrator_wait_s:.0f} s; start `petals-chain orchestrator` or pass "
                        "--blocks START:END"
                    )
                time.sleep(0.5)
        logger.info("orchestrator %s found; waiting for an assignment", self.orchestrator.peer_id)
        while not self._stop.is_set():
            a = self._ask_assignment()
            if a is not None and a.status == AssignmentStatus.ASSIGNED:
                self._load(a.start, a.end)
                self.assignment = a
                return
            if (
                a is not None
                and a.status == AssignmentStatus.UNUSED
                and a.plan_version != getattr(self, "_unused_version", None)
            ):
                self._unused_version = a.plan_version
                print(
                    f"standing by: {self.model_name} as {self.peer_id}: plan v{a.plan_version} leaves this "
                    "server without blocks; it will load blocks when a later plan assigns some",
                    flush=True,
                )
            self._stop.wait(self.config.assignment_poll_s)
            self._announce()

    def _ask_assignment(self):
        try:
            stub = OrchestratorService.get_stub(self.p2p, PeerID.from_base58(self.orchestrator.peer_id))
            resp = self.loop.run(stub.rpc_assignment(wire.request(AssignmentRequest()), timeout=5.0), timeout_s=7.0)
            return wire.decode_reply(wire.unpack(resp.metadata), AssignmentReply).assignment
        except Exception as e:
            logger.warning("asking the orchestrator for an assignment failed: %s", e)
            found = find_orchestrator(self.dht, self.model_name)  # it may have restarted under a new id
            if found is not None:
                self.orchestrator = found
            return None

    def _follow_assignments(self) -> None:
        """A later plan may move this server: reload when the range changes and no session is open (or
        at once, closing its sessions, when the assignment says `force`)."""
        while not self._stop.wait(max(2.0, self.config.assignment_poll_s)):
            a = self._ask_assignment()
            if (
                a is None
                or a.status != AssignmentStatus.ASSIGNED
                or (a.start, a.end) == (self.block_range.start, self.block_range.end)
            ):
                continue
            self._move_to(a.start, a.end, f"plan v{a.plan_version}", force=a.force)

    def _measure_relay_rtts(self) -> None:
        """A relayed server: DHT pings to each relay it is due for (`relay_rtts`, announced as
        ServerInfo.relay_rtt_s; the orchestrator adds its own RTT to the relay: petals_chain/swarm/reachability.py)."""
        relays = [r for m in self.relay_maddrs if (r := relay_peer_id(m)) is not None]
        for relay in self.relay_rtts.due(relays, time.monotonic()):
            self.relay_rtts.measure(relay, lambda p: dht_ping_s(self.dht, p), time.monotonic())

    def _measure_peer_rtts(self) -> None:
        """Keep `peer_rtts` fresh (announced with the next record): a new or due peer is probed
        within peer_rtt_check_s of appearing in the DHT, bounded by peer_rtt_max_peers. A relayed
        server keeps its RTTs to its relays fresh too."""
        first = True
        while first or not self._stop.wait(self.config.peer_rtt_check_s):
            first = False
            try:
                if self.relay_maddrs:
                    self._measure_relay_rtts()
                infos = fetch_servers(
                    self.dht,
                    self.model_name,
                    states=(ServerState.ONLINE, ServerState.JOINING),
                    allowed=self.config.allowed_peers,
                )
                stack = self.lifecycle.current
                start, end = (stack.block_range.start, stack.block_range.end) if stack is not None else (0, 0)
                peers = choose_peers(self.peer_id, start, end, infos, self.peer_rtts.max_peers)
                for peer in self.peer_rtts.due(peers, time.monotonic()):
                    if self._stop.is_set():
                        return
                    self.peer_rtts.measure(
                        peer, lambda p: ping_block_server_s(self.loop, self.p2p, p), time.monotonic()
                    )
            except Exception:  # noqa: BLE001 - a DHT hiccup or shutdown: try again next period
                logger.debug("measuring peer RTTs failed", exc_info=True)

    def _others_throughputs(self) -> list[float]:
        """Each block's decode throughput from the other online servers' records."""
        infos = fetch_servers(self.dht, self.model_name, allowed=self.config.allowed_peers)
        return block_throughputs(
            self.total_blocks,
            (
                HeldSpan(i.start, i.end, i.decode_s_per_token)
                for i in infos
                if i.peer_id != self.peer_id and i.end > i.start
            ),
        )

    def _rebalance(self) -> None:
        """--num-blocks: move to a better span when the swarm changed enough (PETALS' rule). The
        period is jittered so that servers seeing the same change do not all move at once, and the
        records are read again right before a move."""
        rng = random.Random(self.peer_id)
        n = self.config.num_blocks
        times = self.lifecycle.snapshot().times
        rate = 1.0 / times.decode_s_per_token if times.decode_s_per_token > 0 else 0.0
        while not self._stop.wait(self.config.rebalance_period_s * (0.5 + rng.random())):
            try:
                target = better_start(
                    self._others_throughputs(), self.block_range.start, n, rate, self.config.balance_quality
                )
            except Exception:  # noqa: BLE001 - a DHT hiccup: try again next period
                logger.warning("rebalance: could not read the swarm's records", exc_info=True)
                continue
            if target is not None:
                self._move_to(target, target + n, "rebalance: the swarm's weakest blocks moved")

    def _move_to(self, start: int, end: int, why: str, force: bool = False) -> bool:
        """Reload blocks [start, end) if no session is open, none waits in admission and no open is in
        flight (a session is never dropped for a move); returns whether it moved. The check and the
        refusal of new opens are one step (`ServerLifecycle.begin_move`). `force` (the orchestrator's
        drain deadline passed): move anyway; the open sessions are closed with `ServerMovingError` (their
        clients fail over, as when a server leaves) and the waiting opens refused with it, and the reload
        starts once they are gone (`_close_for_move`). A shutdown during the move is final: the move then
        neither puts its stack in place nor announces `online`."""
        if not self.lifecycle.begin_move(force=force):
            return False
        logger.info("%s: moving to blocks [%d, %d)", why, start, end)
        self._announce()  # joining
        moved = False
        try:
            if force:
                self._close_for_move(start, end, why)
            self._load(start, end)
            moved = not self.lifecycle.stopped
        except Exception:
            logger.exception("loading blocks [%d, %d) failed", start, end)
        finally:
            if self.lifecycle.end_move():
                self._announce()
        if moved:
            print(f"serving {self.model_name} blocks [{start}, {end}) as {self.peer_id} ({why})", flush=True)
        return moved

    def _close_for_move(self, start: int, end: int, why: str) -> None:
        """A forced move's first step (new opens are refused already): close what is open with
        `ServerMovingError`, then wait until the stack holds nothing (each stream ends after its running
        step is answered, each waiting open gives up), at most MOVE_CLOSE_WAIT_S; past that the reload
        starts anyway (the old stack is stopped when the new one is in place: a step stuck in it fails
        there, and its client fails over too)."""
        error = ServerMovingError(
            f"this server closed the session to move to blocks [{start}, {end}) ({why}: the orchestrator's "
            "drain deadline passed); fail the session over to another chain"
        )
        closed = self.loop.run(self._servicer.evict(error), timeout_s=10.0)
        deadline = time.monotonic() + self.MOVE_CLOSE_WAIT_S
        while not self.lifecycle.quiet() and time.monotonic() < deadline and not self._stop.is_set():
            self._stop.wait(0.02)  # the streams end on the loop thread; polled with a deadline
        if not self.lifecycle.quiet():
            logger.warning("forced move: sessions still open after %.0f s; reloading anyway", self.MOVE_CLOSE_WAIT_S)
        print(f"forced move ({why}): closed {closed} session(s) and waiting open(s); they fail over", flush=True)

    # -- records ------------------------------------------------------------------------------
    def info(self, view: LifecycleView | None = None) -> ServerInfo:
        """The record of one lifecycle snapshot (`view`; default: now): one stack, its profile, its state."""
        view = view if view is not None else self.lifecycle.snapshot()
        stack, times = view.stack, view.times
        if stack is None:  # --blocks auto, before the assignment: no blocks yet
            s_m, s_c, dtype = self._sizes
            return ServerInfo(
                peer_id=self.peer_id,
                model=self.model_name,
                start=0,
                end=0,
                state=ServerState.OFFLINE if view.state == ServerState.OFFLINE else ServerState.JOINING,
                memory_budget_bytes=self.config.memory_budget_bytes,
                block_bytes=s_m,
                kv_bytes_per_block=s_c,
                max_length_tokens=self.max_length_tokens,
                max_step_tokens=self.max_step_tokens,
                free_kv_slots=0,
                prefill_s_per_token=times.prefill_s_per_token,
                decode_s_per_token=times.decode_s_per_token,
                dtype=dtype,
                quant=self.config.quant,
                name=self.config.name,
                extra={"auto": True},
                peer_rtt_s=self.peer_rtts.view(),
                relay_rtt_s=self.relay_rtts.view(),
                adapters=[adapter_name(a) for a in self.config.adapters],
                reachability=self.reachability,
                relay_maddrs=self.relay_maddrs,
            )
        br, budget = stack.block_range, stack.budget
        per_session = br.kv_bytes_per_block(self.max_length_tokens) * (br.end - br.start)
        active = len(stack.sessions)
        # measured from the sessions' KV tensors, independently of the reservations that admit them
        allocated = stack.sessions.allocated_bytes()
        return ServerInfo(
            peer_id=self.peer_id,
            model=self.model_name,
            start=br.start,
            end=br.end,
            state=view.state,
            memory_budget_bytes=budget.memory_budget_bytes,
            block_bytes=br.block_bytes,
            kv_bytes_per_block=br.kv_bytes_per_block(self.max_length_tokens),
            max_length_tokens=self.max_length_tokens,
            max_step_tokens=self.max_step_tokens,
            free_kv_slots=budget.free_slots(per_session),
            prefill_s_per_token=times.prefill_s_per_token,
            decode_s_per_token=times.decode_s_per_token,
            dtype=str(br.dtype).removeprefix("torch."),
            quant=br.quant,
            name=self.config.name,
            active_sessions=active,
            adapters=list(br.adapters),
            peer_rtt_s=self.peer_rtts.view(),
            relay_rtt_s=self.relay_rtts.view(),
            reachability=self.reachability,
            relay_maddrs=self.relay_maddrs,
            extra={
                "queue_length": stack.scheduler.queue_length,
                "policy": stack.scheduler.policy.name,
                "admission_queue_length": len(stack.admission),
                "auto": self.auto,
                "prefix_cache": stack.prefix_cache.view() if stack.prefix_cache is not None else None,
                "relay": self._servicer.relay_index.view(),
                # streams this server opened to next hops (pushes) and the direct streams it served
                "direct_streams": {
                    "opened_direct": self._servicer.dialer.direct_opened,
                    "opened_p2p": self._servicer.dialer.p2p_opened,
                    "port": self.direct.port if self.direct is not None else None,
                    "refused": self.direct.refused if self.direct is not None else 0,
                },
                # the memory accounting (bytes): weights + reserved KV (sessions and cached prefixes)
                # must stay within memory_budget_bytes
                "weights_bytes": budget.weights_bytes,
                "kv_reserved_bytes": budget.reserved_bytes,
                "kv_peak_reserved_bytes": budget.peak_reserved_bytes,
                "kv_allocated_bytes": allocated,
            },
        )

    def _announce(self, timeout_s: float = 10.0, *, final: bool = False) -> None:
        """Store the record of one lifecycle snapshot. One at a time (`_announcing`); once offline only
        shutdown's own announcement (`final`) goes out, so `offline` is the last record stored."""
        with self._announcing:
            view = self.lifecycle.snapshot()
            if view.state == ServerState.OFFLINE and not final:
                return
            if not self.dht.is_alive():  # e.g. Ctrl-C or a group kill reached the DHT process first
                logger.warning("DHT process is gone; cannot announce state %r", view.state)
                return
            try:
                announce_server(self.dht, self.info(view), self.identity, self.config.record_ttl_s, timeout_s=timeout_s)
            except TimeoutError:
                logger.warning("announcing state %r timed out after %.0f s (will retry)", view.state, timeout_s)
            except Exception:
                logger.exception("announce failed (will retry)")

    def _announce_loop(self) -> None:
        while not self._stop.wait(self.config.announce_period_s):
            self._announce()
            try:
                self.check_profile()
            except Exception:  # a check must never stop the announcements
                logger.exception("checking the start-up profile against live service failed")

    # -- shutdown -----------------------------------------------------------------------------
    def _go_offline(self) -> None:
        """Offline for good (the lifecycle refuses every later transition), announced, and the
        serving stack stopped; later calls do nothing."""
        first, stack = self.lifecycle.shut_down()
        if first:
            self._announce(timeout_s=3.0, final=True)
        if stack is not None:
            stack.stop()

    def _stop_serving(self) -> None:
        """The serving stack stopped (without an announcement: a start-up unwinding past its DHT)."""
        _, stack = self.lifecycle.shut_down()
        if stack is not None:
            stack.stop()

    def shutdown(self) -> None:
        """Announce `offline` (final), stop serving, then tear down what the start-up started, in
        reverse order: threads, handlers and the direct listener, p2p, the loop, the DHT, the log."""
        self._stop.set()
        self._go_offline()
        self._resources.close()
