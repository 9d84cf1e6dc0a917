"""The re-plan's pure step, and where it runs (issue 54: plan off the request path).

`PlanInputs` is everything one re-plan decides from, copied under the service's lock by the control
thread; `decide_plan` turns it into an `Outcome` (the cluster, the decision of `orchestrator/replan.py`,
the planner's own Plan) without reading or writing the service; the control thread then applies the
outcome under the lock (`Orchestrator._apply`: the one owner of the installed plan swaps it in whole).

`PlannerWorker` runs such a pure step in a spawned process once the swarm is large
(`--plan-process-min-servers`): a planner thread in the service's process shares its GIL with the RPC
handlers' event loop, and the planner's long C calls (numpy, sorts over J servers) hold it for tens of
milliseconds, which an acquire then waits for (scripts/bench_replan.py). In its own process the
plan costs the handlers only the pickling of its inputs and outcome, in chunks (`CHUNK_ITEMS`). Small
swarms plan in the calling thread (a process round trip would cost more than their plan).
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import signal
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, TypeVar

from orchestrator.cache_gca import gca
from orchestrator.model import BlockInterval, Cluster, InfeasibleClusterError, Placement, contended_chains
from orchestrator.placement_leftover import place_leftover
from orchestrator.planner import Plan
from orchestrator.planner import plan as run_plan
from orchestrator.policies import get_policy
from orchestrator.replan import Decision, Evaluated, constrained_placement, decide, evaluate
from orchestrator.replan import incremental as incremental_plan
from orchestrator.service.registry import HeldRange, Overheads, ServerRecord, build_cluster, keep_held_ranges
from orchestrator.session_times import SessionShape

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class PlannerSettings:
    """The orchestrator's flags a plan reads (a copy: the config may change between plans)."""

    num_blocks: int
    policy: str
    c: int | None
    tuning: str
    leftover_placement: bool
    arrival_rate_per_s: float
    rho_bar: float
    relay: str
    server_compute: str
    kv_plan_tokens: int | None
    force_replan: bool
    replan_min_gain: float
    max_moves_per_replan: int | None
    equivalent_servers_rel: float

    @classmethod
    def of(cls, config) -> "PlannerSettings":
        """From an `OrchestratorConfig` (not imported: the service's core imports this module)."""
        return cls(**{f: getattr(config, f) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class PlanInputs:
    settings: PlannerSettings
    overheads: Overheads
    records: list[ServerRecord]  # measured servers (copies: `core._copy_record`)
    sessions_per_peer: dict[str, int]  # the orchestrator's leases per server
    shape: SessionShape
    current_c: int | None  # the installed plan's c (None: none, or a baseline's)
    has_current: bool  # a plan is installed (or loading): its servers' ranges are what is held
    can_drain: bool  # a move can be drained first (static chains installed, --drain-timeout > 0)
    fixed_peers: frozenset[str] = frozenset()  # must keep their ranges (busy movers at a drain's deadline)
    incremental: bool = False  # every server holding blocks keeps them; idle ones fill what a lost one broke


@dataclass
class Outcome:
    error: str | None = None
    cluster: Cluster | None = None
    peers: list[str] = field(default_factory=list)
    decision: Decision | None = None
    fresh: Evaluated | None = None
    pinned: list[str] = field(default_factory=list)
    plan: Plan | None = None  # a baseline's own Plan, or the whole plan (the proposed policy's is made from `decision`)


def held_ranges(records: list[ServerRecord], sessions_per_peer: dict[str, int]) -> dict[str, HeldRange]:
    """What each server holds now (fixed: started with --blocks START:END; busy: it holds sessions)."""
    held = {}
    for r in records:
        info = r.info
        if info.has_blocks:
            busy = bool(sessions_per_peer.get(info.peer_id, 0) or info.active_sessions)
            held[info.peer_id] = HeldRange(info.start, info.end, fixed=not info.extra.get("auto", False), busy=busy)
    return held


def _cluster_of(inp):
    """The planner's cluster (and its peers, in index order) from a plan's or a model check's inputs."""
    cfg = inp.settings
    return build_cluster(
        inp.records,
        cfg.num_blocks,
        inp.shape,
        cfg.arrival_rate_per_s,
        cfg.rho_bar,
        inp.overheads,
        relay=cfg.relay,
        compute=cfg.server_compute,
        kv_plan_tokens=cfg.kv_plan_tokens,
    )


def decide_plan(inp: PlanInputs) -> Outcome:
    """The planner and the re-plan decision on `inp` alone (run in the control thread or a worker process)."""
    cfg = inp.settings
    whole = None
    try:
        cluster, peers = _cluster_of(inp)
        index = {p: j for j, p in enumerate(peers)}
        held = {p: h for p, h in held_ranges(inp.records, inp.sessions_per_peer).items() if p in index}
        if not get_policy(cfg.policy).tunes_c:
            return _decide_overlay(cfg, cluster, peers, held)
        # without a drain (none possible, or none wanted) a server holding sessions keeps its range,
        # unless --force-replan: then they fail over, as on churn
        keep_busy = not inp.can_drain and not cfg.force_replan
        fixed = {
            index[p]: BlockInterval(h.start, h.end)
            for p, h in held.items()
            if h.fixed or p in inp.fixed_peers or (keep_busy and h.busy)
        }
        installed = Placement(tuple(BlockInterval(held[p].start, held[p].end) if p in held else None for p in peers))
        if inp.incremental and inp.current_c is not None:
            fresh = incremental_plan(cluster, installed, inp.current_c, cfg.leftover_placement, cfg.tuning)
        elif fixed:
            fresh = constrained_placement(cluster, fixed, cfg.c, cfg.tuning)
            if fresh is None:
                raise InfeasibleClusterError("with the fixed servers on their ranges no complete chain forms")
            if cfg.leftover_placement:
                lo = place_leftover(cluster, fresh.placement, fresh.c)
                fresh = evaluate(cluster, lo.placement, fresh.c, lo.gca.chains)
        else:
            whole = run_plan(cluster, cfg.policy, c=cfg.c, tuning=cfg.tuning, leftover=cfg.leftover_placement)
            fresh = evaluate(cluster, whole.placement, whole.c, whole.chains)
    except ValueError as e:  # InvalidClusterError / InfeasibleClusterError
        return Outcome(error=str(e))
    busy = frozenset(index[p] for p, h in held.items() if h.busy)
    d = decide(
        cluster,
        installed if inp.has_current else Placement((None,) * len(peers)),
        fresh,
        tuning=cfg.tuning,
        fixed=fixed,
        busy=busy,
        min_gain=cfg.replan_min_gain,
        max_moves=cfg.max_moves_per_replan,
        equivalent_rel=cfg.equivalent_servers_rel,
        installed_c=inp.current_c if inp.has_current else None,
        leftover=cfg.leftover_placement,
    )
    return Outcome(
        cluster=cluster,
        peers=peers,
        decision=d,
        fresh=fresh,
        pinned=[p for p in held if index[p] in fixed],
        plan=whole,
    )


def _decide_overlay(cfg: PlannerSettings, cluster: Cluster, peers: list[str], held: dict[str, HeldRange]) -> Outcome:
    """The baselines (petals, bprr, jffc-only) plan the whole swarm; servers that must not move keep their
    ranges over it (`keep_held_ranges`), and GCA builds the chains over what servers will hold."""
    result = run_plan(cluster, cfg.policy, c=cfg.c, tuning=cfg.tuning, leftover=cfg.leftover_placement)
    ranges, pinned = keep_held_ranges(list(result.placement.ranges), peers, held, force=cfg.force_replan)
    placement = Placement(tuple(ranges))
    chains = tuple(contended_chains(cluster, gca(cluster, placement).chains)) if pinned else result.chains
    ev = evaluate(cluster, placement, result.c, chains)
    d = Decision(True, "baseline policy: planned whole", ev, ev, ev)
    return Outcome(cluster=cluster, peers=peers, decision=d, fresh=ev, pinned=pinned, plan=result)


@dataclass(frozen=True)
class ModelCheckInputs:
    settings: PlannerSettings
    overheads: Overheads
    records: list[ServerRecord]
    shape: SessionShape


def model_check_plan(inp: ModelCheckInputs) -> tuple[float, int | None] | None:
    """The calibrated model's whole plan, as the re-plan trigger reads it: (nu, c*), or None when it cannot
    plan (the trigger then waits)."""
    cfg = inp.settings
    try:
        cluster, _ = _cluster_of(inp)
        p = run_plan(cluster, cfg.policy, c=cfg.c, tuning=cfg.tuning, leftover=cfg.leftover_placement)
    except ValueError:
        return None
    return p.total_rate_per_s, p.c


# The worker's inputs (J server records) and outcomes (a cluster of J servers) cross the pipe pickled. One
# `pickle.dumps` or `loads` is one C call that holds the GIL throughout (J = 10,000 records: 80 ms, during
# which no acquire is served), so their long lists go in chunks of this many items, one call each: between
# two chunks the RPC handlers' thread takes the GIL (the stall is one chunk's, ~2 ms).
CHUNK_ITEMS = 256


def _pack(obj) -> tuple[object, list]:
    """`obj` without its long list, and that list (empty when it has none)."""
    if isinstance(obj, (PlanInputs, ModelCheckInputs)):
        return replace(obj, records=[]), list(obj.records)
    if isinstance(obj, Outcome) and obj.cluster is not None:
        c = obj.cluster
        return (replace(obj, cluster=None), (c.service, c.arrival_rate_per_s, c.rho_bar)), list(c.servers)
    return obj, []


def _unpack(shell, items: list):
    if isinstance(shell, (PlanInputs, ModelCheckInputs)):
        return replace(shell, records=items)
    if isinstance(shell, tuple) and len(shell) == 2 and isinstance(shell[0], Outcome):
        out, (service, rate, rho) = shell
        return replace(out, cluster=Cluster(service, tuple(items), rate, rho))
    return shell


def _send(conn, head, obj) -> None:
    shell, items = _pack(obj)
    chunks = range(0, len(items), CHUNK_ITEMS)
    conn.send_bytes(pickle.dumps((head, shell, len(chunks)), pickle.HIGHEST_PROTOCOL))
    for i in chunks:
        conn.send_bytes(pickle.dumps(items[i : i + CHUNK_ITEMS], pickle.HIGHEST_PROTOCOL))


def _receive(conn):
    head, shell, n = pickle.loads(conn.recv_bytes())
    items: list = []
    for _ in range(n):
        items.extend(pickle.loads(conn.recv_bytes()))
    return head, _unpack(shell, items)


def _serve(conn) -> None:
    """The worker process: run each (fn, inputs) it is sent and send back ("ok", result) or ("error", exc),
    until its pipe closes (the service shut it down, or died). A terminal's Ctrl-C reaches the whole process
    group: the service stops its worker in order (`PlannerWorker.close`), so the worker ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            fn, inputs = _receive(conn)
        except (EOFError, OSError):
            return
        try:
            kind, value = "ok", fn(inputs)
        except Exception as e:  # noqa: BLE001 - raised again in the service, as if the step ran there
            kind, value = "error", e
        _send(conn, kind, value)


class WorkerDied(Exception):
    """The planner's worker process ended while it held a step."""


class PlannerWorker:
    """Where pure plan steps run: in the caller's thread below `min_servers` servers (0: always), else in
    one spawned worker process (`_serve`), started at the first such step and kept for the next ones. The
    control thread is its one caller (`_lock` also keeps a test's direct `_plan` from interleaving with it).
    A worker that died (killed, out of memory) is replaced at the next step; the step it was running runs
    in the calling thread instead, so a re-plan is never lost to it."""

    POLL_S = 0.5  # how often a wait for the worker's reply checks that it is alive

    def __init__(self, min_servers: int):
        if min_servers < 0:
            raise ValueError(f"min_servers must be >= 0 (0: never a process), got {min_servers}")
        self.min_servers = min_servers
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None
        self._closed = False
        self.last_where = "none"  # where the last step ran: "thread" or "process" (scripts/bench_replan.py)

    def uses_process(self, servers: int) -> bool:
        return self.min_servers > 0 and servers >= self.min_servers

    def run(self, fn: Callable[..., T], inputs, servers: int) -> T:
        """`fn(inputs)`: a module-level pure function of picklable inputs (the worker imports it by name).
        Its exceptions are raised here, as if it ran in this thread."""
        with self._lock:
            if self._closed or not self.uses_process(servers):
                self.last_where = "thread"
                return fn(inputs)
            try:
                kind, value = self._in_worker(fn, inputs)
            except WorkerDied as e:
                if self._closed:
                    raise  # shut down while it planned: the plan is abandoned
                logger.warning("the planner's worker process died (%s); planning in the control thread this once", e)
                self._stop_worker()
                self.last_where = "thread"
                return fn(inputs)
            self.last_where = "process"
        if kind == "error":
            raise value
        return value

    def _in_worker(self, fn, inputs):
        if self._proc is None or not self._proc.is_alive():
            self._stop_worker()
            # spawn, not fork: the service has threads (the DHT's, the RPC loop's) a fork would copy mid-step
            ctx = multiprocessing.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(child,), name="orchestrator-planner", daemon=True)
            self._proc.start()
            child.close()
        try:
            _send(self._conn, fn, inputs)
            while not self._conn.poll(self.POLL_S):
                if not self._proc.is_alive():
                    raise WorkerDied(f"exit code {self._proc.exitcode}")
            return _receive(self._conn)
        except (EOFError, OSError) as e:
            raise WorkerDied(str(e) or type(e).__name__) from e

    def _stop_worker(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()  # the worker's recv ends: it returns
        if proc is not None:
            proc.join(timeout=2.0)
            if proc.is_alive():  # mid-step: it would finish a plan nobody waits for
                proc.kill()
                proc.join(timeout=5.0)

    def close(self) -> None:
        """Stop the worker at once (a step running in it is abandoned: its caller gets `WorkerDied`); later
        steps run in the calling thread. Written by the closing thread only: `_closed`, and the kill."""
        self._closed = True
        proc = self._proc  # one reference read; the caller waiting on it (holding `_lock`) sees it die
        if proc is not None and proc.is_alive():
            proc.kill()
        with self._lock:
            self._stop_worker()
