"""`BlockServer`: hosts one contiguous block range in a hivemind swarm.

Life cycle: load blocks -> measure t_I/t_O (cached) -> join the DHT -> register RPC handlers ->
announce `online` every `announce_period_s` with an expiration of `record_ttl_s` (a dead server
disappears within seconds) -> on shutdown announce `offline`, stop, leave.

With `start=end=None` (`--blocks auto`) the range comes from the orchestrator: measure t_I/t_O on
one block loaded temporarily -> join the DHT and register handlers -> announce `joining` with no
blocks (budget, s_m, s_c, t_I, t_O) -> ask the orchestrator (rpc_assignment) until it assigns a
range -> load exactly that range -> announce `online`. A later plan may move the server; it moves
only while it holds no session.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID

from petals_chain.background_loop import BackgroundLoop
from petals_chain.process_signals import start_dht
from petals_chain.dht_records import announce_server, model_key
from petals_chain.swarm_identity import SwarmIdentity
from petals_chain.models.checkpoint import resolve_model_path
from petals_chain import wire
from petals_chain.errors import PetalsChainError
from petals_chain.messages import AssignmentReply, AssignmentRequest, AssignmentStatus
from petals_chain.orchestrator_records import find_orchestrator
from petals_chain.protocol import BlockService, OrchestratorService
from petals_chain.runtime.block_range import BlockRange
from petals_chain.wire import ServerInfo, ServerState
from server.handler import BlockServicer, ServicerLimits
from server.emulation import real_range, slowed_times
from server.service_log import ServiceLog
from server.profiling import cached_block_times
from server.serving_stack import StackSlot, build_stack

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    model: str
    start: int | None  # None (with end None): take the range the orchestrator assigns
    end: int | None
    initial_peers: list[str]
    memory_budget_bytes: int = 2 * 2**30
    max_length_tokens: int = 2048
    dtype: str = "float32"
    quant: str = "none"
    device: str = "cpu"
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    identity_path: str | None = None
    allowed_peers: frozenset[str] | None = None  # private swarm: only these peers may call (None: anyone)
    name: str = ""
    policy: str = "fcfs"
    policy_args: dict = field(default_factory=dict)  # checked by server.policies.parse_policy_args
    max_batch_tokens: int = 2048
    session_idle_timeout_s: float = 300.0
    admission_timeout_s: float = 10.0
    admission_queue: int = 64
    service_log: str | None = None  # JSONL path: one line per batch (bench_fairness reads it)
    prefix_sharing: str = "client"  # prefix KV cache scope: client | swarm | off (server/prefix_cache.py)
    prefix_cache_max_bytes: int | None = None
    prefix_cache_min_bytes: int = 0  # memory set aside for the prefix cache: sessions never take it
    max_step_tokens: int | None = None  # most tokens one step/forward request carries (None: max_length_tokens)
    announce_period_s: float = 2.0
    record_ttl_s: float = 6.0
    num_threads: int | None = None
    orchestrator_wait_s: float = 30.0
    emulate_slowdown: float = 1.0  # EMULATION (server/emulation.py): batches take this many times their compute
    cuda_graphs: bool = True  # on CUDA: replay captured graphs for decode steps (runtime/decode_graphs.py)
    assignment_poll_s: float = 1.0


class BlockServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_name = model_key(config.model)
        self.max_length_tokens = config.max_length_tokens
        self.session_idle_timeout_s = config.session_idle_timeout_s
        self.service_log = ServiceLog(config.service_log) if config.service_log else None
        self.max_step_tokens = config.max_step_tokens or config.max_length_tokens
        self.path = resolve_model_path(config.model)
        self.auto = config.start is None
        self.stacks = StackSlot()  # the serving stack (server/serving_stack.py): one value, swapped whole
        self.orchestrator = None
        if self.auto:  # measure on one block loaded for the purpose, before holding any
            probe = BlockRange(self.path, 0, 1, dtype=config.dtype, quant=config.quant, device=config.device,
                               model_path=self.path)
            self.times = slowed_times(cached_block_times(probe, self.model_name), config.emulate_slowdown)
            self._sizes = (probe.block_bytes, probe.kv_bytes_per_block(self.max_length_tokens),
                           str(probe.dtype).removeprefix("torch."))
            del probe
        else:
            self._load(config.start, config.end)
            self.times = slowed_times(cached_block_times(real_range(self.stacks.current.block_range),
                                                         self.model_name), config.emulate_slowdown)
        self.state = ServerState.JOINING
        self.identity = SwarmIdentity.load_or_create(config.identity_path)
        self.dht = start_dht(initial_peers=config.initial_peers, host_maddrs=config.host_maddrs,
                             **self.identity.dht_kwargs())
        self.peer_id = str(self.dht.peer_id)
        self.loop = BackgroundLoop("server-p2p")
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout_s=30)
        limits = ServicerLimits(self.max_length_tokens, self.max_step_tokens, self.session_idle_timeout_s)
        self._servicer = BlockServicer(limits, self.stacks, self.info, self.p2p)
        self.servicer = BlockService(self._servicer, config.allowed_peers)
        self.loop.run(self.servicer.add_p2p_handlers(self.p2p), timeout_s=30)
        self._stop = threading.Event()
        try:
            self._announce()
            if self.auto:
                self._join_orchestrator()
        except BaseException:
            self.shutdown()
            raise
        self._set_state(ServerState.ONLINE)
        self._announce()
        self._announcer = threading.Thread(target=self._announce_loop, name="announcer", daemon=True)
        self._announcer.start()
        if self.auto:
            threading.Thread(target=self._follow_assignments, name="assignments", daemon=True).start()

    def _load(self, start: int, end: int) -> None:
        """Build a stack for [start, end) and swap it in; the old one (which holds no session: a move
        waits for that) stops after the swap, so no handler ever sees a half-replaced stack."""
        stack = build_stack(self.config, self.path, start, end,
                            on_batch=self.service_log.write if self.service_log else None)
        old = self.stacks.swap(stack)
        if old is not None:
            old.stop()

    def _set_state(self, state: ServerState) -> None:
        self.state = state
        self.stacks.set_accepting(state == ServerState.ONLINE)

    # -- orchestrator -------------------------------------------------------------------------
    def _join_orchestrator(self) -> None:
        deadline = time.monotonic() + self.config.orchestrator_wait_s
        while self.orchestrator is None:
            self.orchestrator = find_orchestrator(self.dht, self.model_name)
            if self.orchestrator is None:
                if time.monotonic() > deadline:
                    raise PetalsChainError(
                        f"--blocks auto: no orchestrator of {self.model_name} found in the DHT within "
                        f"{self.config.orchestrator_wait_s:.0f} s; start `petals-chain orchestrator` or pass --blocks START:END")
                time.sleep(0.5)
        logger.info("orchestrator %s found; waiting for an assignment", self.orchestrator.peer_id)
        while not self._stop.is_set():
            a = self._ask_assignment()
            if a is not None and a.status == AssignmentStatus.ASSIGNED:
                self._load(a.start, a.end)
                self.assignment = a
                return
            if (a is not None and a.status == AssignmentStatus.UNUSED
                    and a.plan_version != getattr(self, "_unused_version", None)):
                self._unused_version = a.plan_version
                print(f"standing by: {self.model_name} as {self.peer_id}: plan v{a.plan_version} leaves this "
                      "server without blocks; it will load blocks when a later plan assigns some", flush=True)
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
        """A later plan may move this server: reload when the range changes and no session is open."""
        while not self._stop.wait(max(2.0, self.config.assignment_poll_s)):
            a = self._ask_assignment()
            stack = self.stacks.current
            if (a is None or a.status != AssignmentStatus.ASSIGNED
                    or (a.start, a.end) == (stack.block_range.start, stack.block_range.end)):
                continue
            if len(stack.sessions):
                continue
            logger.info("plan v%d moves this server to blocks [%d, %d)", a.plan_version, a.start, a.end)
            self._set_state(ServerState.JOINING)
            self._announce()
            try:
                self._load(a.start, a.end)
            except Exception:
                logger.exception("loading the assigned blocks failed")
                continue
            self._set_state(ServerState.ONLINE)
            self._announce()
            print(f"serving {self.model_name} blocks [{a.start}, {a.end}) as {self.peer_id} (plan v{a.plan_version})",
                  flush=True)

    # -- records ------------------------------------------------------------------------------
    def info(self) -> ServerInfo:
        stack = self.stacks.current  # one read: the whole record describes one stack
        if stack is None:  # --blocks auto, before the assignment: no blocks yet
            s_m, s_c, dtype = self._sizes
            return ServerInfo(
                peer_id=self.peer_id, model=self.model_name, start=0, end=0, state=ServerState.JOINING,
                memory_budget_bytes=self.config.memory_budget_bytes, block_bytes=s_m, kv_bytes_per_block=s_c,
                max_length_tokens=self.max_length_tokens, max_step_tokens=self.max_step_tokens, free_kv_slots=0,
                prefill_s_per_token=self.times.prefill_s_per_token, decode_s_per_token=self.times.decode_s_per_token,
                dtype=dtype, quant=self.config.quant, name=self.config.name, extra={"auto": True})
        br, budget = stack.block_range, stack.budget
        per_session = br.kv_bytes_per_block(self.max_length_tokens) * (br.end - br.start)
        active = len(stack.sessions)
        # measured from the sessions' KV tensors, independently of the reservations that admit them
        allocated = stack.sessions.allocated_bytes()
        return ServerInfo(
            peer_id=self.peer_id, model=self.model_name, start=br.start, end=br.end, state=self.state,
            memory_budget_bytes=budget.memory_budget_bytes, block_bytes=br.block_bytes,
            kv_bytes_per_block=br.kv_bytes_per_block(self.max_length_tokens), max_length_tokens=self.max_length_tokens,
            max_step_tokens=self.max_step_tokens,
            free_kv_slots=budget.free_slots(per_session), prefill_s_per_token=self.times.prefill_s_per_token,
            decode_s_per_token=self.times.decode_s_per_token, dtype=str(br.dtype).removeprefix("torch."),
            quant=br.quant, name=self.config.name, active_sessions=active,
            extra={"queue_length": stack.scheduler.queue_length, "policy": stack.scheduler.policy.name,
                   "admission_queue_length": len(stack.admission), "auto": self.auto,
                   "prefix_cache": stack.prefix_cache.view() if stack.prefix_cache is not None else None,
                   "relay": self._servicer.relay_index.view(),
                   # the memory accounting (bytes): weights + reserved KV (sessions and cached prefixes)
                   # must stay within memory_budget_bytes
                   "weights_bytes": budget.weights_bytes, "kv_reserved_bytes": budget.reserved_bytes,
                   "kv_peak_reserved_bytes": budget.peak_reserved_bytes, "kv_allocated_bytes": allocated},
        )

    def _announce(self, timeout_s: float = 10.0) -> None:
        if not self.dht.is_alive():  # e.g. Ctrl-C or a group kill reached the DHT process first
            logger.warning("DHT process is gone; cannot announce state %r", self.state)
            return
        try:
            announce_server(self.dht, self.info(), self.identity, self.config.record_ttl_s, timeout_s=timeout_s)
        except TimeoutError:
            logger.warning("announcing state %r timed out after %.0f s (will retry)", self.state, timeout_s)
        except Exception:
            logger.exception("announce failed (will retry)")

    def _announce_loop(self) -> None:
        while not self._stop.wait(self.config.announce_period_s):
            self._announce()

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._set_state(ServerState.OFFLINE)
        self._announce(timeout_s=3.0)
        stack = self.stacks.current
        if stack is not None:
            stack.stop()
        try:
            self.loop.run(self.servicer.remove_p2p_handlers(self.p2p), timeout_s=5)
        except Exception:
            logger.debug("removing handlers failed during shutdown", exc_info=True)
        try:
            self.loop.run(self.p2p.shutdown(), timeout_s=5)  # its tasks must end before the loop stops
        except Exception:
            logger.debug("p2p shutdown failed", exc_info=True)
        self.dht.shutdown()
        self.loop.stop()
        if self.service_log is not None:
            self.service_log.close()
