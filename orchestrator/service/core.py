"""The online orchestrator: a hivemind peer that plans block placement for the servers that
announce themselves, installs chains once they are online, and dispatches sessions.

Threads: hivemind's DHT; a `BackgroundLoop` that runs the RPC handlers; a control thread (once a
`tick_s`) that reads server records from the DHT, measures RTTs, expires leases, drops lost
servers, plans and installs. All shared state is guarded by `self.lock`, which the sessions'
owner (`orchestrator.service.sessions.Sessions`: leases, waiting sessions, grants not yet picked up)
shares; a grant wakes the poll that waits for it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

from orchestrator.bounds import theorem37_bounds
from orchestrator.cluster_io import plan_to_dict
from orchestrator.dispatch import PROMPT_AWARE, ServerCost
from orchestrator.model import Cluster, Placement
from orchestrator.planner import Plan, make_baseline_router
from orchestrator.policies import get_policy
from orchestrator.replan import Evaluated
from orchestrator.service.calibration import (
    FittedProfile,
    ReplanTrigger,
    ServiceWindow,
    own_else_swarm_median,
    scaled_profile_fit,
)
from orchestrator.service.installed import Drain, InstalledPlan
from orchestrator.service.measurements import LengthEstimator
from orchestrator.service.planning import (
    ModelCheckInputs,
    Outcome,
    PlanInputs,
    PlannerSettings,
    PlannerWorker,
    decide_plan,
    model_check_plan,
)
from orchestrator.service.prefix_reports import PrefixReportReader
from orchestrator.service.registry import (
    Overheads,
    ServerRecord,
    batch_overhead_s,
    cluster_to_dict,
    lost_servers,
    rtt_partners,
    server_params,
)
from orchestrator.service.reports import ServerReports
from orchestrator.service.sessions import UNPICKED_GRANT_TTL_S, Sessions
from orchestrator.session_times import SessionShape
from petals_chain.errors import UnknownAdapterError
from petals_chain.process.loop import BackgroundLoop
from petals_chain.process.signals import start_dht
from petals_chain.swarm.identity import SwarmIdentity
from petals_chain.swarm.reachability import RelayRoutes, dht_ping_s, relayed_rtt_s
from petals_chain.swarm.records import announce_orchestrator, fetch_servers, model_key
from petals_chain.transport.protocol import (
    OrchestratorService,
    fetch_service_records,
    ping_block_server_s,
)
from petals_chain.wire.messages import Assignment, AssignmentStatus, Hop
from petals_chain.wire.records import OrchestratorInfo, ServerState

logger = logging.getLogger(__name__)

RTT_RETRY_S = 15.0  # how often a server that did not answer the RTT probes is probed again
# how often a measured server's RTT is taken again between re-plans (one server per tick): a WAN's
# RTTs drift, and a sample taken while either end was overloaded must not stay on /status and in the
# next plan for as long as nothing else changes
RTT_REFRESH_S = 30.0


@dataclass
class OrchestratorConfig:
    model: str
    initial_peers: list[str]
    num_blocks: int
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    policy: str = "proposed"
    c: int | None = None
    tuning: str = "lower"
    leftover_placement: bool = False  # blocks for servers GBP-CR leaves idle (orchestrator/placement_leftover.py)
    arrival_rate_per_s: float = 0.5
    rho_bar: float = 0.7
    mean_input_tokens: float = 64.0
    mean_output_tokens: float = 32.0
    # how many finished sessions the two means above count as in the running length estimate: 1 lets the
    # first sessions replace them; an experiment that states the whole workload's means gives its size
    length_prior_sessions: float = 1.0
    per_block_overhead_s: float = 0.001  # t_o of footnote 11 (the paper's ~1 ms)
    per_step_overhead_s: float = 0.0
    relay: str = "server"  # how clients relay (their default): tau_c per footnote 4 ("server") or x RTT ("client")
    server_compute: str = "auto"  # how servers serve concurrent sessions (registry.SERVER_COMPUTE)
    kv_plan_tokens: int | None = None  # session length the cache reservation s_c is planned for (None: max_length)
    expected_servers: int = 0  # plan as soon as this many servers are measured (0: after settle_s)
    expected_wait_s: float = 180.0  # ... or, when fewer are measured, this long after the first registration
    settle_s: float = 5.0  # plan once no new server appeared for this long
    replan_period_s: float = 60.0
    force_replan: bool = False  # move servers that hold live sessions too
    lease_ttl_s: float = 15.0
    queue: str = "fifo"  # central queue order: fifo (JFFC, the paper) or fair (VTC counters per client)
    dispatch: str = "jffc"  # chain dispatcher (orchestrator.dispatch) for policies over static chains
    prefix_sharing: str = "client"  # whose prefixes a prompt-aware dispatcher matches (the servers' scope)
    prefix_index_entries: int = 1 << 18  # bound of the global prefix index (LRU)
    # DLPM's Q^u and D2LPM's Q^w, in expected sessions' charge (w_in l_in + w_out l_out, as learned)
    client_quantum_sessions: float = 1.0
    chain_quantum_sessions: float = 4.0
    fair_skips: int = 32  # d2lpm: other clients' grants a credit holder's waiting session may see first (0: none)
    # the calibrated service model (orchestrator/service/calibration.py)
    calibrate: bool = True  # plan from live service fits once a server has enough batches
    service_poll_s: float = 2.0  # how often servers' batch records are read
    calibration_min_batches: int = 20
    model_check_s: float = 10.0  # how often the calibrated model's plan is compared with the installed one
    replan_enter: float = 0.2  # re-plan when the planned rate or c* moved by more than this (relative) ...
    replan_exit: float = 0.1  # ... re-armed only after it came back within this
    replan_hold_s: float = 30.0  # ... continuously for this long
    model_replan_period_s: float = 300.0  # ... at most once per this (slower than churn: a re-plan may reload servers)
    max_model_replans: int | None = None  # ... and at most this many times (None: no limit)
    # Re-plans (orchestrator/replan.py): servers a re-plan moves first drain (no new session on their chains)
    # for up to this long; then the re-plan is made again with the servers still holding sessions fixed
    drain_timeout_s: float = 60.0
    max_moves_per_replan: int | None = None  # at most this many servers holding blocks move per re-plan
    replan_min_gain: float = 0.02  # a re-plan that moves servers must gain this much (relative) in the model
    equivalent_servers_rel: float = 0.05  # servers this close in tau^c, tau^p (same memory) are interchangeable
    incremental_replan: bool = True  # a join or leave is re-planned at once with the placed servers fixed
    # plan in a spawned worker process once this many servers are measured (0: always in the control thread):
    # a planner thread shares the GIL with the RPC handlers (planning.py)
    plan_process_min_servers: int = 1000
    max_acquire_timeout_s: float = 600.0
    rtt_probes: int = 5
    announce_period_s: float = 2.0
    tick_s: float = 0.5
    # a server whose record is missing from the DHT this long is dropped (one that announced OFFLINE at once):
    # registry.lost_servers says why one missed read must not end its chains
    lost_after_s: float = 10.0
    identity_path: str | None = None
    allowed_peers: frozenset[str] | None = None  # private swarm: plan with and answer only these peers
    exclude_after_reports: int = 3  # verification reports from this many distinct peers exclude a server


PlanState = InstalledPlan  # the name the tests and the Table 1 driver knew


@dataclass(frozen=True)
class _Snapshot:
    """The planner's inputs, copied under the lock (the planner then runs without it)."""

    records: list[ServerRecord]
    sessions_per_peer: dict[str, int]
    current: InstalledPlan | None
    model_moved: bool
    epoch: int
    shape: SessionShape
    can_drain: bool  # a move can be drained first (static chains installed, --drain-timeout > 0)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no inf


def _copy_record(r: ServerRecord) -> ServerRecord:
    """A record as the planner reads it (its info and fits are replaced whole, never edited: a shallow copy
    is a snapshot). Spelled out: copy.copy costs ~3x as much, and the snapshot is taken under the lock."""
    return ServerRecord(r.info, r.rtt_s, r.last_seen_s, r.fit, r.hop_cost_s, r.transfer_s_per_token, r.scaled_fit)


def _chain_key(chains) -> tuple:
    return tuple((k.servers, k.blocks, k.capacity, round(k.service_time_s, 12)) for k in chains)


def _as_plan(policy: str, ev: Evaluated, cluster: Cluster, tuning: str) -> Plan:
    """The Plan record of an evaluated placement (what /plan-input and the trigger read)."""
    return Plan(
        policy=policy,
        c=ev.c,
        placement=ev.placement,
        chains=ev.chains,
        total_rate_per_s=ev.rate_per_s,
        bounds=theorem37_bounds(ev.chains, cluster.arrival_rate_per_s) if ev.chains else None,
        unused_servers=tuple(ev.placement.unused_servers()),
        tuning=tuning,
    )


def first_plan_due(
    now_s: float,
    measured: int,
    expected: int,
    last_change_s: float,
    settle_s: float,
    first_registration_s: float,
    expected_wait_s: float,
) -> bool:
    """Whether to make the first plan with `measured` servers whose RTT is known.

    Without `expected`, once no server appeared for `settle_s`. With it, once `expected` are measured,
    or (settled) `expected_wait_s` after the first registration. Why not plan on settling alone: a
    server still loading its weights can miss every RTT probe, and a first plan without it leaves it
    idle until the next re-plan.
    """
    settled = now_s - last_change_s >= settle_s
    if not expected:
        return settled
    return measured >= expected or (settled and now_s - first_registration_s >= expected_wait_s)


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, clock=time.monotonic):
        self._init_state(config, clock)
        self.identity = SwarmIdentity.load_or_create(config.identity_path)
        self.dht = start_dht(
            initial_peers=config.initial_peers, host_maddrs=config.host_maddrs, **self.identity.dht_kwargs()
        )
        self.peer_id = str(self.dht.peer_id)
        self.loop = BackgroundLoop("orchestrator-p2p")
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout_s=30)
        from orchestrator.service.rpc import OrchestratorRpc

        self.servicer = OrchestratorService(OrchestratorRpc(self), config.allowed_peers)
        self.loop.run(self.servicer.add_p2p_handlers(self.p2p), timeout_s=30)
        self._stop = threading.Event()
        self._announce()
        self._control = threading.Thread(target=self._control_loop, name="orchestrator-control", daemon=True)
        self._control.start()

    @classmethod
    def offline(cls, config: OrchestratorConfig, clock) -> "Orchestrator":
        """The orchestrator's state and decisions without a DHT, RPCs or control thread (tests drive
        `tick`-level methods with their own clock)."""
        orch = cls.__new__(cls)
        orch._init_state(config, clock)
        orch.peer_id = "offline"
        return orch

    def _init_state(self, config: OrchestratorConfig, clock) -> None:
        self.config = config
        self.clock = clock
        self.model = model_key(config.model)
        self.lock = threading.RLock()
        self._plan_lock = threading.Lock()  # one plan at a time; never taken by an RPC handler
        self.drain: Drain | None = None  # a re-plan's movers draining
        self._epoch = 0  # counts changes of the server set (a plan made over an older one may be stale)
        self.last_decision: str | None = None  # why the last re-plan moved what it moved (or nothing)
        self.last_plan_timing: dict = {}
        self.replan_history: list[dict] = []  # the last re-plan decisions (/status replan.history)
        self._whole_pending = False  # an incremental re-plan ran: the whole one follows at the period
        self.records: dict[str, ServerRecord] = {}
        self.lengths = LengthEstimator(
            SessionShape(config.mean_input_tokens, config.mean_output_tokens), prior_weight=config.length_prior_sessions
        )
        self.overheads = Overheads(config.per_block_overhead_s, config.per_step_overhead_s)
        self.policy = get_policy(config.policy)
        # where plans run: this thread for small swarms, a worker process for large ones (planning.py)
        self.planner = PlannerWorker(config.plan_process_min_servers)
        self.prefix_reports = PrefixReportReader()  # the servers' prefix-cache reports, into the prefix index
        # one lock: the sessions' owner shares it, so the plan and the sessions change together
        self.sessions = Sessions(
            lease_ttl_s=config.lease_ttl_s,
            queue=config.queue,
            lock=self.lock,
            prefix_sharing=config.prefix_sharing,
            prefix_index_entries=config.prefix_index_entries,
            quantum_sessions=(config.client_quantum_sessions, config.chain_quantum_sessions),
            fair_skips=config.fair_skips or None,
        )
        self.sessions.set_expected_tokens(config.mean_input_tokens, config.mean_output_tokens)
        self.current: InstalledPlan | None = None  # the plan servers are loading / running (swapped whole)
        self.plan_error: str | None = None
        self.last_change_s = self.clock()
        self.known_changed = False  # server set differs from the one of the current plan
        self._rtt_tried: dict[str, float] = {}
        self.windows: dict[str, ServiceWindow] = {}  # per server: its batches and hop costs (calibration)
        self._fit_failing: set[str] = set()  # servers whose last fit raised (said once until one succeeds)
        self.trigger = ReplanTrigger(
            config.replan_enter, config.replan_exit, config.replan_hold_s, config.model_replan_period_s
        )
        self.model_moved = False  # the calibrated model moved the plan: re-plan (never forced)
        self.model_moved_s = -math.inf  # ... since then
        self._model_retry_s = -math.inf  # ... a deferred one is tried again from then (servers were busy)
        self.model_replans = 0
        # `hold_model_replans` (SIGUSR1): the calibrated model decides no further re-plan (churn still re-plans)
        self.model_replans_held = False
        self._last_service_poll_s = -math.inf
        self._last_model_check_s = -math.inf
        self.first_registration_s = math.inf
        self.events: list[str] = []
        self.http_port = 0
        self.relay_routes = RelayRoutes()  # servers behind NATs: dialed through their relays (reachability.py)
        self.reports = ServerReports(config.exclude_after_reports)  # clients' verification reports (reports.py)

    # -- announcements ----------------------------------------------------------------------
    def info(self) -> OrchestratorInfo:
        return OrchestratorInfo(
            self.peer_id, self.model, self.config.policy, self.current.version if self.current else 0, self.http_port
        )

    def _announce(self) -> None:
        try:
            announce_orchestrator(self.dht, self.info(), self.identity, 3 * self.config.announce_period_s)
        except Exception:
            logger.exception("announce failed (will retry)")

    def log_event(self, text: str) -> None:
        logger.info(text)
        with self.lock:
            self.events.append(f"{time.strftime('%H:%M:%S')} {text}")
            del self.events[:-50]
        print(text, flush=True)

    # -- control loop -----------------------------------------------------------------------
    def _control_loop(self) -> None:
        last_announce = 0.0
        while not self._stop.wait(self.config.tick_s):
            try:
                now = self.clock()
                if now - last_announce >= self.config.announce_period_s:
                    self._announce()
                    last_announce = now
                self.tick(now)
            except Exception:
                logger.exception("control loop iteration failed")

    def tick(self, now: float) -> None:
        found = fetch_servers(
            self.dht,
            self.model,
            states=(ServerState.JOINING, ServerState.ONLINE, ServerState.OFFLINE),
            allowed=self.config.allowed_peers,
        )
        found = [i for i in found if i.peer_id not in self.reports.excluded()]  # reported by k peers: never planned
        offline = {i.peer_id for i in found if i.state == ServerState.OFFLINE}
        infos = {i.peer_id: i for i in found if i.peer_id not in offline}
        self.relay_routes.update(infos.values())
        new = [p for p in infos if p not in self.records]
        for p in new:  # measure tau_c outside the lock: it takes round trips
            self._rtt_tried[p] = now
            rtt = self.measure_rtt(p)
            with self.lock:
                self.records[p] = ServerRecord(infos[p], rtt, now)
                self._epoch += 1
                self.first_registration_s = min(self.first_registration_s, now)
                self.last_change_s = now
                self.known_changed = True
            self.log_event(
                f"server {infos[p].name or p} registered: "
                f"budget {infos[p].memory_budget_bytes / 2**20:.0f} MiB, "
                f"rtt {'n/a' if rtt is None else f'{rtt * 1e3:.2f} ms'}"
            )
        with self.lock:
            for p, info in infos.items():
                rec = self.records[p]
                rec.info, rec.last_seen_s = info, now
            lost = lost_servers(
                {p: r.last_seen_s for p, r in self.records.items()}, set(infos), offline, now, self.config.lost_after_s
            )
            retry = [
                p
                for p, r in self.records.items()
                if r.rtt_s is None and p in infos and now - self._rtt_tried.get(p, -1e9) >= RTT_RETRY_S
            ]
            oldest = min(  # the oldest measurement past RTT_REFRESH_S, one per tick so that a tick stays short
                (
                    (self._rtt_tried.get(p, -1e9), p)
                    for p, r in self.records.items()
                    if r.rtt_s is not None and p in infos and now - self._rtt_tried.get(p, -1e9) >= RTT_REFRESH_S
                ),
                default=None,
            )
        for p in retry + ([oldest[1]] if oldest else []):  # unreachable ones now and then, not every tick
            self._remeasure_rtt(p, now)
        if lost:
            self.drop_servers(lost, now, why="left the DHT")
        if now - self._last_service_poll_s >= self.config.service_poll_s:
            self._last_service_poll_s = now
            self.collect_service()
            if self.config.dispatch in PROMPT_AWARE:  # the servers' prefix caches, for the prefix index
                with self.lock:
                    serving = [p for p, r in self.records.items() if r.info.has_blocks]
                self.prefix_reports.collect(self.loop, self.p2p, self.sessions, serving)
        if now - self._last_model_check_s >= self.config.model_check_s:
            self._last_model_check_s = now
            self.check_model(now)
        with self.lock:
            expired, _ = self.sessions.expire(now)
            # waiters whose client vanished mid-wait: no RPC polls them any more
            self.sessions.timeouts(now - 5.0)
            self.sessions.abandoned(now, UNPICKED_GRANT_TTL_S)
        for sid in expired:
            self.log_event(f"lease of session {sid[:8]} expired (no heartbeat): slot returned")
        self._maybe_plan(now)
        self._maybe_install(now)

    # -- the calibrated model ---------------------------------------------------------------------
    def window(self, peer_id: str) -> ServiceWindow:
        w = self.windows.get(peer_id)
        if w is None:
            w = self.windows[peer_id] = ServiceWindow(min_batches=self.config.calibration_min_batches)
        return w

    def collect_service(self) -> None:
        """Read each serving server's new batch records (outside the lock: round trips), refit."""
        with self.lock:
            peers = {p: self.window(p).last_seq for p, r in self.records.items() if r.info.has_blocks}
        changed = []
        for p, since in peers.items():
            got = fetch_service_records(self.loop, self.p2p, p, since)
            if not got:
                continue
            with self.lock:
                w = self.window(p)
                if got[-1].seq < w.last_seq:  # the server restarted its count
                    w.last_seq = -1
                for b in got:
                    w.add_batch(
                        b.seq, b.prefill_block_tokens, b.decode_block_tokens, b.wall_s, b.cpu_s, b.sessions, b.blocks
                    )
            changed.append(p)
        self.refit(changed)

    def refit(self, peers: list[str] | None = None) -> None:
        """Fit the windows of `peers` (default: all) outside the lock (the RPC handlers share it; only
        this thread adds batches), then publish the fits and every server's current hop cost."""
        on = self.config.calibrate
        with self.lock:
            todo = {
                p: (self.windows[p], self.records[p].info.decode_s_per_token)
                for p in (self.records if peers is None else peers)
                if p in self.windows and p in self.records
            }
        fits = {}
        for p, (w, profile) in todo.items():
            try:
                fits[p] = w.fit(t_O_profile_s=profile) if on else None
                self._fit_failing.discard(p)
            except Exception:  # one server's window must not stop the others' fits or the control loop
                if p not in self._fit_failing:  # once, not at every poll while its window stays so
                    self._fit_failing.add(p)
                    logger.exception(
                        "fitting server %s's service records failed; its previous model stays", self.name_of(p)
                    )
        with self.lock:
            measured, transfer = {}, {}
            for p, rec in self.records.items():
                w = self.windows.get(p)
                if p in fits:
                    rec.fit = fits[p]
                measured[p] = w.hop_cost if (w is not None and on) else None
                transfer[p] = w.transfer if (w is not None and on) else None
            hop, per_token = own_else_swarm_median(measured), own_else_swarm_median(transfer)
            for p, rec in self.records.items():
                rec.hop_cost_s, rec.transfer_s_per_token = hop[p], per_token[p]
            # servers without a fit of their own: a fitted twin's, scaled by their profiles (scaled_profile_fit)
            donors = [
                FittedProfile(r.fit, r.info.prefill_s_per_token, r.info.decode_s_per_token, r.info.end - r.info.start)
                for r in self.records.values()
                if r.fit is not None
            ]
            for rec in self.records.values():
                rec.scaled_fit = (
                    scaled_profile_fit(rec.info.prefill_s_per_token, rec.info.decode_s_per_token, donors)
                    if on and rec.fit is None
                    else None
                )

    def check_model(self, now: float) -> None:
        """Would the calibrated model plan differently enough to re-plan? (hysteresis: ReplanTrigger)"""
        with self.lock:
            cur = self.current
            if cur is None or not cur.installed or self.model_moved or not self.config.calibrate:
                return
            if self.model_replans_held or (
                self.config.max_model_replans is not None and self.model_replans >= self.config.max_model_replans
            ):
                return
            # Only a *fitted* model may move the plan: until a server the installed plan uses has a live
            # fit, the "difference" is the start-up profile against itself plus whatever joined or left
            # (a server whose record expired and came back), and acting on it would spend a re-plan
            # (the Table 1 driver allows one) on numbers no batch has confirmed. Not *every* planned
            # server: JFFC sends a warm-up to the fastest chains, and a server on a chain no session
            # reached would then block the calibrated re-plan for good.
            placed = [p for p in cur.peers if cur.assignment(p) is not None]
            if not any(p in self.records and self.records[p].fit is not None for p in placed):
                return
            records = [_copy_record(r) for r in self.records.values() if r.rtt_s is not None]
            shape = self.lengths.shape
        # outside the lock (the RPC handlers take it); a large swarm's in the planner's worker process
        inputs = ModelCheckInputs(PlannerSettings.of(self.config), self.overheads, records, shape)
        planned = self.planner.run(model_check_plan, inputs, len(records))
        if planned is None:
            return
        rate_per_s, c_star = planned
        with self.lock:
            if self.trigger.observe(rate_per_s, c_star, now):
                ref_rate, ref_c = self.trigger.reference
                self.model_moved, self.model_moved_s = True, now
                moved = f"planned rate {ref_rate:.3g} -> {rate_per_s:.3g}/s, c* {ref_c} -> {c_star}"
            else:
                return
        self.log_event(f"the calibrated service model moved the plan ({moved}): re-planning")

    def model_view(self, peer_id: str) -> dict:
        """Model vs measured for /status: the announced start-up profile, the live fit, the hop cost."""
        rec, w = self.records.get(peer_id), self.windows.get(peer_id)
        f = rec.fit if rec else None
        scaled = rec.scaled_fit if rec else None
        return {
            "announced": {"t_I": rec.info.prefill_s_per_token, "t_O": rec.info.decode_s_per_token} if rec else None,
            "fitted": None
            if f is None
            else {
                "t_I": f.t_I_s,
                "t_O": f.t_O_s,
                "t_o": f.t_o_s,
                "t_B": f.t_B_s,
                "blocks_separable": f.blocks_separable,
                "samples": f.samples,
                "median_abs_rel_residual": f.median_abs_rel_residual,
                "t_O_from_profile": f.t_O_from_profile,
                "t_o_lone_batches": f.t_o_lone_batches,
            },
            "hop_cost": rec.hop_cost_s if rec else None,  # planned with: its own, else the swarm's median
            "hop_cost_own": None if w is None else w.hop_cost,
            "transfer_s_per_token": rec.transfer_s_per_token if rec else None,  # its own, else the swarm's
            "transfer_own": None if w is None else w.transfer,
            "batches": 0 if w is None else len(w.batches),
            "cpu_per_wall": None if w is None else w.cpu_per_wall,
            "scaled": None
            if scaled is None
            else {"t_I": scaled.t_I_s, "t_O": scaled.t_O_s, "t_o": scaled.t_o_s, "t_B": scaled.t_B_s},
            "source": "live" if f is not None else "scaled profile" if scaled is not None else "announced",
        }

    def _remeasure_rtt(self, peer_id: str, now: float) -> None:
        """Probe a registered server's RTT again; a missed probe keeps the last value (None or good)."""
        self._rtt_tried[peer_id] = now
        rtt = self.measure_rtt(peer_id)
        with self.lock:
            if peer_id in self.records and rtt is not None:
                self.records[peer_id].rtt_s = rtt

    def measure_rtt(self, peer_id: str) -> float | None:
        """Shortest round trip of rpc_info to the server (None when it does not answer). A relayed server's
        RTT is the path clients' traffic takes: ours to its relay plus its own to the relay, as it reports
        it (`relayed_rtt_s`); without a report, probed after dialing it through its relays."""
        # every time, not throttled: the NATed server keeps re-opening its own direct connection (assignment
        # polls, DHT stores), and its streams (service polls, assignments) must reach it either way
        self.loop.run(self.relay_routes.connect(self.p2p, peer_id, via_relay_only=True))
        reported = self.relay_routes.server_to_relay_s.get(peer_id)
        if reported:
            to_relay = {}
            for relay in reported:
                pings = [
                    x for x in (dht_ping_s(self.dht, relay) for _ in range(self.config.rtt_probes)) if x is not None
                ]
                to_relay[relay] = min(pings) if pings else None  # the shortest, as below
            rtt = relayed_rtt_s(to_relay, reported)
            if rtt is not None:
                return rtt
        # a probe here may still run over a direct connection the NATed server opened (see reachability.py).
        # The minimum, not the median: queueing in either process (a busy event loop, a starved CPU) only
        # ever adds to the path's round trip, so the shortest probe is the best estimate of it (as TCP's
        # and BBR's min-RTT filters do); the servers' own load is planned from their service times
        samples = [ping_block_server_s(self.loop, self.p2p, peer_id) for _ in range(self.config.rtt_probes)]
        samples = [x for x in samples if x is not None]
        return min(samples) if samples else None

    def drop_servers(self, peers: list[str], now: float, why: str) -> None:
        with self.lock:
            gone = [p for p in peers if p in self.records]
            for p in gone:
                del self.records[p]
            if not gone:
                return
            self._epoch += 1
            dropped, _ = self.sessions.drop_servers(set(gone), now)
            self.last_change_s = now
            self.known_changed = True
            cur = self.current
            if cur is not None and cur.installed and self.sessions.mode == "router":
                self._install_router(cur, now, exclude=set(gone))
        for p in gone:
            self.log_event(f"server {p[-8:]} {why}: its chains are gone; {len(dropped)} session(s) must fail over")

    # -- planning ------------------------------------------------------------------------------
    def _maybe_plan(self, now: float) -> None:
        if self.drain is not None:
            self._drain_step(now)
            return
        with self.lock:
            if self._incremental_due(now):
                quick = True
            elif self._plan_due(now):
                quick = False
            else:
                return
        if quick:  # a join or a leave: repaired at once, moving nobody; the whole re-plan at the period
            self._plan(now, incremental=True)
            return
        with self.lock:
            peers = [p for p, r in self.records.items() if r.rtt_s is not None]
        # fresh RTTs right before planning (those taken at registration may have met loading servers)
        rtts = {p: self.measure_rtt(p) for p in peers}
        for p in peers:
            self._rtt_tried[p] = now
        with self.lock:
            for p, rtt in rtts.items():
                if p in self.records and rtt is not None:
                    self.records[p].rtt_s = rtt
            due = self._plan_due(self.clock())
        if due:
            self._plan(now)

    def _plan_due(self, now: float) -> bool:
        measured = [r for r in self.records.values() if r.rtt_s is not None]
        if not measured or self.drain is not None:
            return False
        cur = self.current
        if cur is None:
            c = self.config
            return first_plan_due(
                now,
                len(measured),
                c.expected_servers,
                self.last_change_s,
                c.settle_s,
                self.first_registration_s,
                c.expected_wait_s,
            )
        if self.model_moved:  # the trigger already waited its hold and the minimum interval
            return now >= self._model_retry_s
        if not (self.known_changed or self._whole_pending):
            return False
        stale = any(p not in self.records for p in cur.peers if cur.assignment(p))
        due = now - cur.created_s >= self.config.replan_period_s
        # an installed plan keeps serving on its surviving chains until the slow time scale comes
        # round; a plan still loading that lost a server could never come online
        return due or (stale and not cur.installed)

    def _incremental_due(self, now: float) -> bool:
        """Servers joined or left an installed plan of the proposed policy: re-plan incrementally now
        (orchestrator/replan.py:incremental), before the whole re-plan's period comes round."""
        cur = self.current
        return (
            self.known_changed
            and not self.model_moved
            and self.drain is None
            and cur is not None
            and cur.installed
            and self.policy.tunes_c
            and self.config.incremental_replan
            and now - cur.created_s < self.config.replan_period_s
            and any(r.rtt_s is not None for r in self.records.values())
        )

    # The planner runs outside `self.lock` (which the RPC handlers take, through the sessions' owner): a
    # snapshot of its inputs is taken under the lock, the plan is made without it, and the result is
    # applied under it again, unless a server it plans with was dropped meanwhile (then it re-plans at
    # the next tick). `_plan_lock` only keeps two plans from running at once (the control thread plans;
    # tests call `_plan` directly); no RPC handler takes it.
    def _snapshot(self) -> _Snapshot:
        with self.lock:
            return _Snapshot(
                [_copy_record(r) for r in self.records.values() if r.rtt_s is not None],
                self.sessions.sessions_per_peer(),
                self.current,
                self.model_moved,
                self._epoch,
                self.lengths.shape,
                self._can_drain(),
            )

    def _can_drain(self) -> bool:
        cur = self.current
        return cur is not None and cur.installed and self.config.drain_timeout_s > 0 and self.sessions.mode == "chains"

    def _plan(
        self, now: float, fixed_peers: frozenset[str] = frozenset(), drain: bool = True, incremental: bool = False
    ) -> None:
        """Re-plan (or make the first plan) and apply it: at once, or after draining the servers it moves.
        `fixed_peers`: servers the planner must keep on their ranges (busy movers at a drain's deadline).
        `incremental`: every server holding blocks keeps them, idle ones fill what a lost one broke."""
        with self._plan_lock:
            t0 = time.perf_counter()
            snap = self._snapshot()
            t1 = time.perf_counter()
            out = self._decide(snap, fixed_peers, incremental)
            t2 = time.perf_counter()
            with self.lock:
                self._apply(out, snap, now, drain)
                # after an incremental re-plan the whole one is still owed (at the period)
                self._whole_pending = incremental and out.error is None
            t3 = time.perf_counter()
            # /status: how long the last plan took, and how much of it held the lock the RPC handlers take
            self.last_plan_timing = {"snapshot_s": t1 - t0, "plan_s": t2 - t1, "apply_s": t3 - t2}

    def _decide(self, snap: _Snapshot, fixed_peers: frozenset[str], incremental: bool = False) -> Outcome:
        """The planner and the re-plan decision, on the snapshot only (no lock held): in this thread, or
        in the planner's worker process for a large swarm (`planning.PlannerWorker`)."""
        cur = snap.current
        inputs = PlanInputs(
            PlannerSettings.of(self.config),
            self.overheads,
            snap.records,
            snap.sessions_per_peer,
            snap.shape,
            current_c=cur.plan.c if cur is not None else None,
            has_current=cur is not None,
            can_drain=snap.can_drain,
            fixed_peers=frozenset(fixed_peers),
            incremental=incremental,
        )
        return self.planner.run(decide_plan, inputs, len(snap.records))

    def _apply(self, out: Outcome, snap: _Snapshot, now: float, drain: bool) -> None:
        """Under the lock: install the decided plan, start draining its movers, or say why not."""
        cfg = self.config
        if out.error is not None:
            if self.plan_error != out.error:
                self.log_event(f"cannot plan yet: {out.error}")
            self.plan_error = out.error
            self.sessions.set_no_chain_reason(out.error if self.current is None else None)
            self.known_changed = False
            return
        if snap.epoch != self._epoch and any(p not in self.records for p in out.peers):
            self.known_changed = True  # a server it planned with left meanwhile: plan again at the next tick
            return
        self.plan_error = None
        self.sessions.set_no_chain_reason(None)
        d, cur = out.decision, self.current
        was_model = self.model_moved
        self.known_changed = False
        self.model_moved = False
        self.model_replans += int(was_model)
        self.trigger.planned(out.fresh.rate_per_s, out.fresh.c, now)
        self.last_decision = d.reason
        tuning = cfg.tuning
        ev = d.step if d.install else d.baseline
        # what each re-plan decided, in the current model's terms (/status replan.history): the invariant
        # compares the installed step with the installed placement re-evaluated on the same cluster
        self.replan_history.append(
            {
                "at_s": now,
                "servers": len(out.peers),
                "installed": d.install,
                "reason": d.reason,
                "model": was_model,
                "movers": [self.name_of(out.peers[j]) for j in d.movers],
                "pending_movers": [self.name_of(out.peers[j]) for j in d.pending_movers],
                "baseline": {"capacity": d.baseline.capacity, "objective_s": _finite(d.baseline.objective(tuning))},
                "result": {"capacity": ev.capacity, "objective_s": _finite(ev.objective(tuning))},
            }
        )
        del self.replan_history[:-20]
        if not d.install:
            if (
                cur is not None
                and cur.installed
                and d.baseline.chains
                and _chain_key(d.baseline.chains) != _chain_key(cur.chains)
            ):
                # the same placement under the current model: its chains, moving nobody
                self._new_version(out, d.baseline, now, "refreshed chains; " + d.reason)
            else:
                self.log_event(f"re-plan not installed: {d.reason}")
            return
        moving = {out.peers[j] for j in d.movers}
        if (
            drain
            and moving
            and cur is not None
            and cur.installed
            and cfg.drain_timeout_s > 0
            and self.sessions.mode == "chains"
        ):
            self.sessions.stop_granting(moving, now)
            self.drain = Drain(frozenset(moving), now, now + cfg.drain_timeout_s, out, self._epoch)
            self.log_event(
                f"re-plan: {d.reason}; draining {', '.join(sorted(self.name_of(p) for p in moving))} "
                f"(no new session on their chains; up to {cfg.drain_timeout_s:g} s) before they move"
            )
            return
        self._new_version(out, d.step, now, d.reason, moving)

    def _new_version(self, out: Outcome, ev: Evaluated, now: float, why: str, moving: set[str] = frozenset()) -> None:
        cfg = self.config
        peers, cluster = out.peers, out.cluster
        prev = self.current
        version = (prev.version if prev else 0) + 1
        if moving:  # servers that will reload take their old chains with them (drained: none holds a session)
            self.sessions.drop_servers(set(moving), now)
        # --force-replan: the movers are told to move even while they hold sessions (they close them and
        # the clients fail over); a forced move not yet made stays forced while its range stays the same
        forced = set(moving) if cfg.force_replan else set()
        if prev is not None:
            new_ranges = {p: (None if r is None else (r.start, r.end)) for p, r in zip(peers, ev.placement.ranges)}
            for p in prev.forced:
                rec = self.records.get(p)
                want = prev.assignment(p)
                if want is not None and new_ranges.get(p) == want and rec and (rec.info.start, rec.info.end) != want:
                    forced.add(p)
        # the planner's own Plan (its c* table, leftover servers) when it is what is installed
        plan = (
            out.plan
            if out.plan is not None and out.plan.placement == ev.placement
            else _as_plan(cfg.policy, ev, cluster, cfg.tuning)
        )
        self.current = InstalledPlan(
            version, plan, cluster, peers, ev.placement, list(ev.chains), created_s=now, forced=frozenset(forced)
        )
        placed = [(p, r) for p, r in zip(peers, ev.placement.ranges) if r is not None]
        unused = [p for p, r in zip(peers, ev.placement.ranges) if r is None]
        desc = ", ".join(
            [f"{self.name_of(p)}=[{r.start},{r.end})" for p, r in placed[:40]]
            + ([f"... {len(placed) - 40} more"] if len(placed) > 40 else [])
            + ([f"{self.name_of(p)}=unused" for p in unused] if len(unused) <= 8 else [f"{len(unused)} servers unused"])
        )
        pinned = [self.name_of(p) for p in out.pinned]
        self.log_event(
            f"plan v{version} ({cfg.policy}, c={plan.c}): {desc}; {why}"
            + (f"; kept (live sessions or fixed --blocks): {', '.join(pinned)}" if pinned else "")
        )

    def _drain_step(self, now: float) -> None:
        """A drain in progress: install its plan once the movers hold no session; at the deadline, re-plan
        with the movers that still do fixed on their ranges (GBP-CR/GCA re-run around them), or, with
        --force-replan, move them anyway (their sessions fail over, as on churn)."""
        with self.lock:
            dr = self.drain
            per_peer = self.sessions.sessions_per_peer()

            def sessions_of(p: str) -> int:
                rec = self.records.get(p)
                return per_peer.get(p, 0) + (rec.info.active_sessions if rec is not None else 0)

            state = dr.state(now, sessions_of)
            if state == "draining":
                return
            busy = frozenset(dr.busy(sessions_of))
            # every server holding a session keeps its range in the re-plan, not only the movers: the plan
            # made without a drain moves idle servers only
            holding = frozenset(p for p in self.records if sessions_of(p) > 0)
            self.drain = None
            out = dr.pending
            if dr.epoch == self._epoch and (state == "drained" or self.config.force_replan):
                if busy:
                    self.log_event(
                        f"drain deadline: {', '.join(self.name_of(p) for p in busy)} still hold "
                        "sessions; told to move at once (--force-replan): they close them and the clients fail over"
                    )
                self._new_version(
                    out,
                    out.decision.step,
                    now,
                    out.decision.reason + f"; drained in {now - dr.started_s:.1f} s",
                    set(dr.movers),
                )
                return
            self.known_changed = True
        why = (
            "servers joined or left while draining: re-planning"
            if dr.epoch != self._epoch
            else f"drain deadline: {', '.join(self.name_of(p) for p in busy)} still hold sessions: re-planning "
            "with them kept on their ranges"
        )
        self.log_event(why)
        self._plan(now, fixed_peers=holding, drain=False)
        with self.lock:  # chains drained for a move that was not made take sessions again
            if self.current is not None and self.current.installed and self.sessions.draining():
                self._install_chains(self.current, now)

    def _maybe_install(self, now: float) -> None:
        with self.lock:
            cur = self.current
            if cur is None or cur.installed:
                return
            for p in cur.peers:
                want = cur.assignment(p)
                if want is None:
                    continue
                rec = self.records.get(p)
                if rec is None or rec.info.state != ServerState.ONLINE or (rec.info.start, rec.info.end) != want:
                    return
            cur.installed = True
            if self.policy.per_request:
                self._install_router(cur, now)
            else:
                self._install_chains(cur, now)
            chains = self.sessions.chain_views()
        self.log_event(
            f"plan v{cur.version} online: {len(chains)} chain(s) installed: "
            + "; ".join(
                f"{'->'.join(self.name_of(p) for p in ch['servers'])} cap {ch['capacity']} T={ch['service_time']:.3f}s"
                for ch in chains
                if ch["dispatchable"]
            )
        )

    def _install_chains(self, cur: InstalledPlan, now: float) -> None:
        max_len = {p: self.records[p].info.max_length_tokens for p in cur.peers if p in self.records}
        specs = []
        for k in cur.chains:
            hops = tuple(Hop(cur.peers[j], b.start, b.end) for j, b in zip(k.servers, k.blocks))
            if all(h.peer_id in max_len for h in hops):
                specs.append((hops, k.capacity, k.dispatch_time_s, min(max_len[h.peer_id] for h in hops)))
        self.sessions.install_chains(
            specs, cur.version, now, dispatch=self.config.dispatch, server_costs=self._server_costs(cur.peers)
        )  # E2's load cost

    def _server_costs(self, peers) -> dict:
        """Each server's calibrated t_I, t_O per block and token (its start-up profile until a fit has them)."""
        out = {}
        for p in peers:
            rec = self.records.get(p)
            if rec is not None:
                f = rec.model_fit
                t_in = rec.info.prefill_s_per_token if f is None or f.t_I_s is None else f.t_I_s
                t_out = rec.info.decode_s_per_token if f is None else f.t_O_s
                out[p] = ServerCost(float(t_in), float(t_out))
        return out

    def _install_router(self, cur: InstalledPlan, now: float, exclude: set[str] = frozenset()) -> None:
        """Router mode: a per-request router over the plan's placement, without lost servers."""
        keep = [j for j, p in enumerate(cur.peers) if p not in exclude and p in self.records]
        cluster = Cluster(
            cur.cluster.service,
            tuple(cur.cluster.servers[j] for j in keep),
            cur.cluster.arrival_rate_per_s,
            cur.cluster.rho_bar,
        )
        placement = Placement(tuple(cur.placement.ranges[j] for j in keep))
        peers = [cur.peers[j] for j in keep]
        try:
            router = make_baseline_router(cur.plan.policy, cluster, placement)
        except ValueError as e:
            self.log_event(f"no route left over the surviving servers: {e}")
            self.sessions.install_chains([], cur.version, now)  # the old routes drain; sessions wait
            return
        max_len = {p: self.records[p].info.max_length_tokens for p in peers}
        self.sessions.install_router(router, peers, max_len, cur.version, now)

    # -- called from RPC handlers on the loop ---------------------------------------------------
    def release(self, session_id: str, input_tokens: int, output_tokens: int, hops=None) -> bool:
        """A session ended: its slot frees; its lengths update the expected ones, its hops' network
        times the per-hop cost. Returns whether it held a lease."""
        with self.lock:
            for h in hops or ():
                rec = self.records.get(h.peer_id)
                if rec is not None and rec.rtt_s is not None:
                    if h.steps > 0:
                        self.window(h.peer_id).add_hop(h.comm_s / h.steps, rec.rtt_s)
                    self.window(h.peer_id).add_prompt(h.prompt_steps, h.prompt_tokens, h.prompt_comm_s, rec.rtt_s)
            known = self.sessions.holds_lease(session_id)
            self.sessions.release(session_id, self.clock(), input_tokens=input_tokens, output_tokens=output_tokens)
            if known:
                self.lengths.observe(input_tokens, output_tokens)
                shape = self.lengths.shape
                self.sessions.set_expected_tokens(shape.mean_input_tokens, shape.mean_output_tokens)
            return known

    def peers_without_adapter(self, adapter: str) -> set[str]:
        """Servers a session with LoRA `adapter` must not use; UnknownAdapterError when none serves it."""
        with self.lock:
            served = sorted({a for rec in self.records.values() for a in rec.info.adapters})
            if adapter not in served:
                raise UnknownAdapterError(
                    f"no server of this swarm serves adapter {adapter!r}; served adapters: "
                    f"{served or 'none'}. Choose one of them, or start servers with "
                    "--adapters PATH"
                )
            return {p for p, rec in self.records.items() if adapter not in rec.info.adapters}

    def name_of(self, peer_id: str) -> str:
        rec = self.records.get(peer_id)
        return rec.info.name if rec and rec.info.name else peer_id[-8:]

    def assignment_for(self, peer_id: str) -> Assignment:
        """Read from the installed plan without the lock: `self.current` is replaced whole, never edited
        (a drain keeps the movers on their old ranges until the new plan is installed)."""
        cur = self.current
        if cur is None or peer_id not in cur._assigned:
            return Assignment(AssignmentStatus.PENDING, cur.version if cur else 0)
        r = cur.assignment(peer_id)
        return (
            Assignment(AssignmentStatus.UNUSED, cur.version)
            if r is None
            else Assignment(AssignmentStatus.ASSIGNED, cur.version, *r, force=peer_id in cur.forced)
        )

    # -- views ---------------------------------------------------------------------------------
    def status(self) -> dict:
        with self.lock:
            cur = self.current
            shape = self.lengths.shape
            servers = []
            partners = rtt_partners(list(self.records.values()))
            for p, rec in sorted(self.records.items(), key=lambda kv: (kv[1].info.start, kv[0])):
                i = rec.info
                try:
                    tau_c, tau_p = server_params(rec, shape, self.overheads, self.config.relay, partners.get(p, []))
                except ValueError:
                    tau_c, tau_p = None, None
                assigned = cur.assignment(p) if cur else None
                f = rec.model_fit
                servers.append(
                    {
                        "peer_id": p,
                        "name": i.name,
                        "start": i.start,
                        "end": i.end,
                        "memory": i.memory_budget_bytes,
                        "tau_p": tau_p,
                        "tau_c": tau_c,
                        "state": i.state,
                        "rtt": rec.rtt_s,
                        "t_I": i.prefill_s_per_token if f is None or f.t_I_s is None else f.t_I_s,
                        "t_O": i.decode_s_per_token if f is None else f.t_O_s,
                        "t_o": None if f is None else f.t_o_s,
                        "t_B": None if f is None else f.t_B_s,
                        "hop_cost": rec.hop_cost_s,
                        "transfer_s_per_token": rec.transfer_s_per_token,
                        "batch_overhead": batch_overhead_s(rec, shape, self.config.server_compute),
                        "model": self.model_view(p),
                        "assigned": list(assigned) if assigned else None,
                        "active_sessions": i.active_sessions,
                        "auto": bool(i.extra.get("auto", False)),
                        "reachability": str(i.reachability),
                    }
                )
            return {
                "model": self.model,
                "peer_id": self.peer_id,
                "policy": self.config.policy,
                "plan_version": cur.version if cur else 0,
                "plan_installed": bool(cur and cur.installed),
                "c": cur.plan.c if cur else None,
                "plan_error": self.plan_error,
                "model_replans": self.model_replans,
                "model_replans_held": self.model_replans_held,
                "model_replan_pending": self.model_moved,
                "replan": {
                    "last_decision": self.last_decision,
                    "last_plan_timing": dict(self.last_plan_timing),
                    "history": [dict(h) for h in self.replan_history],
                    "draining": sorted(self.name_of(p) for p in self.drain.movers) if self.drain else [],
                    "drain_deadline_in_s": (self.drain.deadline_s - self.clock()) if self.drain else None,
                    "drain_timeout_s": self.config.drain_timeout_s,
                    "max_moves_per_replan": self.config.max_moves_per_replan,
                    "min_gain": self.config.replan_min_gain,
                },
                "num_blocks": self.config.num_blocks,
                "servers": servers,
                "chains": self.sessions.chain_views(),
                "queue_length": self.sessions.queue_length,
                "queue_order": self.sessions.queue_order,
                "sessions": len(self.sessions.leases),
                "dispatch": self.config.dispatch,
                "prefix": self.sessions.prefix_status(),
                "expected_lengths": {
                    "input_tokens": shape.mean_input_tokens,
                    "output_tokens": shape.mean_output_tokens,
                    "finished_sessions": self.lengths.sessions,
                },
                "metrics": {
                    "admitted": self.sessions.metrics.admitted,
                    "released": self.sessions.metrics.released,
                    "expired": self.sessions.metrics.expired,
                    "timed_out": self.sessions.metrics.timed_out,
                    "dropped": self.sessions.metrics.dropped,
                },
                "events": list(self.events[-15:]),
            }

    def hold_model_replans(self) -> bool:
        """From now on the calibrated model decides no re-plan (a server joining or leaving still re-plans;
        one already decided goes ahead). For a measurement that must run on one plan: the Table 1 driver
        holds them once its calibration warm-up had its chance to re-plan, so the replay never meets one.
        Returns whether a decided re-plan is still pending."""
        with self.lock:
            first, self.model_replans_held = not self.model_replans_held, True
            pending = self.model_moved
        if first:
            self.log_event(
                "calibrated re-plans held: from now on the plan moves only when servers join or leave"
                + (" (the re-plan already decided goes ahead)" if pending else "")
            )
        return pending

    def plan_input(self) -> dict:
        """The measured inputs of the current plan, as `petals-chain plan` takes them, and its output."""
        with self.lock:
            cur = self.current
            if cur is None:
                return {"cluster": None, "plan": None}
            return {
                "cluster": cluster_to_dict(cur.cluster),
                "policy": cur.plan.policy,
                "c": self.config.c,
                "tuning": self.config.tuning,
                "plan": plan_to_dict(cur.plan, cur.cluster),
                "assignment": {p: cur.assignment(p) for p in cur.peers},
            }

    # -- shutdown ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.planner.close()  # a plan running in the worker is abandoned: the control thread ends at once
        self._control.join(timeout=10)
        try:
            self.loop.run(self.servicer.remove_p2p_handlers(self.p2p), timeout_s=5)
        except Exception:
            logger.debug("removing handlers failed", exc_info=True)
        try:
            self.loop.run(self.p2p.shutdown(), timeout_s=5)
        except Exception:
            logger.debug("p2p shutdown failed", exc_info=True)
        self.dht.shutdown()
        self.loop.stop()
