"""`BlockServer`: hosts one contiguous block range in a hivemind swarm.

Life cycle: load blocks -> measure t_I/t_O (cached) -> join the DHT -> register RPC handlers ->
announce `online` every `announce_period_s` with an expiration of `record_ttl_s` (a dead server
disappears within seconds) -> on shutdown announce `offline`, stop, leave.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from hivemind.dht import DHT

from petals_chain.background_loop import BackgroundLoop
from petals_chain.dht_records import announce_server, model_key
from petals_chain.models.checkpoint import resolve_model_path
from petals_chain.protocol import BlockService
from petals_chain.runtime.block_range import BlockRange
from petals_chain.wire import ServerInfo
from server.handler import BlockServicer, OpenSession
from server.memory import KVBudget
from server.policies import make_policy
from server.profiling import cached_block_times
from server.scheduler import StepScheduler

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    model: str
    start: int
    end: int
    initial_peers: list[str]
    memory_budget_bytes: int = 2 * 2**30
    max_length_tokens: int = 2048
    dtype: str = "float32"
    quant: str = "none"
    device: str = "cpu"
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    identity_path: str | None = None
    name: str = ""
    policy: str = "fcfs"
    max_batch_tokens: int = 2048
    announce_period_s: float = 2.0
    record_ttl_s: float = 6.0
    num_threads: int | None = None


class BlockServer:
    def __init__(self, config: ServerConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_name = model_key(config.model)
        self.max_length_tokens = config.max_length_tokens
        path = resolve_model_path(config.model)
        self.block_range = BlockRange(path, config.start, config.end, dtype=config.dtype, quant=config.quant,
                                      device=config.device, model_path=path)
        self.budget = KVBudget(config.memory_budget_bytes, self.block_range.block_bytes * (config.end - config.start))
        self.times = cached_block_times(self.block_range, self.model_name)
        self.scheduler = StepScheduler(self.block_range, make_policy(config.policy),
                                       max_batch_tokens=config.max_batch_tokens)
        self.sessions: dict[str, OpenSession] = {}
        self._sessions_lock = threading.Lock()
        self.state = "joining"
        self.dht = DHT(initial_peers=config.initial_peers, host_maddrs=config.host_maddrs,
                       identity_path=config.identity_path, start=True)
        self.peer_id = str(self.dht.peer_id)
        self.loop = BackgroundLoop("server-p2p")
        self.servicer = BlockService(BlockServicer(self))
        self.p2p = self.loop.run(self.dht.replicate_p2p(), timeout_s=30)
        self.loop.run(self.servicer.add_p2p_handlers(self.p2p), timeout_s=30)
        self._stop = threading.Event()
        self._announce()
        self.state = "online"
        self._announce()
        self._announcer = threading.Thread(target=self._announce_loop, name="announcer", daemon=True)
        self._announcer.start()

    # -- records ------------------------------------------------------------------------------
    def info(self) -> ServerInfo:
        br = self.block_range
        per_session = br.kv_bytes_per_block(self.max_length_tokens) * (br.end - br.start)
        with self._sessions_lock:
            active = len(self.sessions)
        return ServerInfo(
            peer_id=self.peer_id, model=self.model_name, start=br.start, end=br.end, state=self.state,
            memory_budget_bytes=self.budget.memory_budget_bytes, block_bytes=br.block_bytes,
            kv_bytes_per_block=br.kv_bytes_per_block(self.max_length_tokens), max_length_tokens=self.max_length_tokens,
            free_kv_slots=self.budget.free_slots(per_session), prefill_s_per_token=self.times.prefill_s_per_token,
            decode_s_per_token=self.times.decode_s_per_token, dtype=str(br.dtype).removeprefix("torch."),
            quant=br.quant, name=self.config.name, active_sessions=active,
            extra={"queue_length": self.scheduler.queue_length, "policy": self.scheduler.policy.name},
        )

    def _announce(self) -> None:
        try:
            announce_server(self.dht, self.info(), self.config.record_ttl_s)
        except Exception:
            logger.exception("announce failed (will retry)")

    def _announce_loop(self) -> None:
        while not self._stop.wait(self.config.announce_period_s):
            self._announce()

    def on_session_opened(self, session: OpenSession) -> None:
        with self._sessions_lock:
            self.sessions[session.reservation_key] = session

    def on_session_closed(self, session: OpenSession) -> None:
        with self._sessions_lock:
            self.sessions.pop(session.reservation_key, None)

    # -- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self.state = "offline"
        self._announce()
        self.scheduler.stop()
        for step in (self.servicer.remove_p2p_handlers(self.p2p), self.p2p.shutdown()):
            try:
                self.loop.run(step, timeout_s=5)
            except Exception:
                logger.debug("p2p cleanup step failed during shutdown", exc_info=True)
        self.dht.shutdown()
        self.loop.stop()
