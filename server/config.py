"""`ServerConfig`: everything `launch-server` was asked for (server/cli.py builds it), in one module
of its own so that the serving stack's factory and the block server both read it without importing
each other."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    adapters: list[str] = field(default_factory=list)  # PEFT LoRA folders (petals_chain/runtime/lora.py)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    identity_path: str | None = None
    allowed_peers: frozenset[str] | None = None  # private swarm: only these peers may call (None: anyone)
    name: str = ""
    policy: str = "fcfs"
    policy_args: dict = field(default_factory=dict)  # checked by server.policies.parse_policy_args
    max_batch_tokens: int = 2048
    batch_gather: float = 0.5  # StepScheduler's gather_fraction (0: never wait for expected sessions)
    prefill_tokens_while_decoding: int | None = None  # StepScheduler's cap on prompt rows while sessions decode
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
    test_corrupt: str | None = None  # TEST ONLY (server/corruption.py): return wrong hidden states this way
    test_corrupt_seed: int = 0
    cuda_graphs: bool = True  # on CUDA: replay captured graphs for decode steps (runtime/decode_graphs.py)
    assignment_poll_s: float = 1.0
    # self-placement without an orchestrator (server/block_selection.py): serve this many blocks,
    # chosen from the DHT records, and re-choose every ~rebalance_period_s when it helps enough
    num_blocks: int | None = None
    balance_quality: float = 0.75
    rebalance_period_s: float = 30.0
    announce_maddrs: list[str] = field(default_factory=list)  # --announce-maddrs / --public-maddrs
    use_relay: bool = True  # False (--no-relay): an unreachable server stops instead of joining through relays
    relay_service: bool = True  # False (--no-relay-service): a reachable server refuses to relay for others
    direct_port: int | None = None  # --direct-port: also serve the per-step streams on plain TCP (0: a free port)
    # RTTs to other servers (server/peer_rtts.py), announced as ServerInfo.peer_rtt_s for footnote 4's
    # tau_c,ij: every peer_rtt_check_s the DHT's records are read and chosen peers not measured within
    # peer_rtt_period_s are probed (peer_rtt_probes rpc_info round trips each), at most peer_rtt_max_peers
    peer_rtt_check_s: float = 10.0
    peer_rtt_period_s: float = 30.0
    peer_rtt_probes: int = 3
    peer_rtt_max_peers: int = 8
