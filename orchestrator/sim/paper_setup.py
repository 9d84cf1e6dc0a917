"""The paper's simulation setting (section 4.1.1) as plain data.

BLOOM-176B-like service: L = 70 blocks, s_m = 1.32 GB per block, s_c = 0.11 GB of KV cache per
block per session (max length 2048). Two GPU types: high (40 GB, tau_p = 109 ms per block per
session) and low (20 GB, tau_p = 175 ms). One orchestrator and J servers at distinct randomly drawn
nodes of an RTT matrix (RIPE Atlas EU anchors, see netem.topology, or synthetic); a fraction eta of
the servers, drawn at random, are high; tau_c_j = RTT(orchestrator, j) + 18 ms. Defaults: J = 20,
eta = 0.2, lambda = 0.2 req/s, rho_bar = 0.7.

`PaperInstance.to_plan_json()` gives the cluster in the schema of the `plan`/`simulate` CLIs
(memory in GB, times in seconds).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_BLOCKS = 70
BLOCK_SIZE_GB = 1.32
CACHE_SIZE_GB = 0.11
HIGH_MEMORY_GB = 40.0
HIGH_TAU_P_S = 0.109
LOW_MEMORY_GB = 20.0
LOW_TAU_P_S = 0.175
TAU_C_OVERHEAD_S = 0.018
DEFAULT_ARRIVAL_RATE_PER_S = 0.2
DEFAULT_RHO_BAR = 0.7


@dataclass(frozen=True)
class PaperInstance:
    """One drawn cluster: per-server arrays (index = server id)."""

    names: tuple[str, ...]
    memory_gb: np.ndarray
    tau_c_s: np.ndarray
    tau_p_s: np.ndarray
    rtt_s: np.ndarray  # RTT orchestrator -> server (without the 18 ms overhead)
    is_high: np.ndarray
    num_blocks: int = NUM_BLOCKS
    block_size_gb: float = BLOCK_SIZE_GB
    cache_size_gb: float = CACHE_SIZE_GB
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S
    rho_bar: float = DEFAULT_RHO_BAR

    @property
    def num_servers(self) -> int:
        return len(self.names)

    def to_plan_json(self) -> dict:
        return {
            "blocks": self.num_blocks,
            "block_size": self.block_size_gb,
            "cache_size": self.cache_size_gb,
            "arrival_rate": self.arrival_rate_per_s,
            "rho_bar": self.rho_bar,
            "servers": [
                {"name": n, "memory": float(m), "tau_c": float(c), "tau_p": float(p), "rtt": float(r)}
                for n, m, c, p, r in zip(self.names, self.memory_gb, self.tau_c_s, self.tau_p_s, self.rtt_s)
            ],
        }


def draw_paper_instance(
    rtt_ms: np.ndarray,
    num_servers: int,
    eta: float,
    rng: np.random.Generator,
    *,
    arrival_rate_per_s: float = DEFAULT_ARRIVAL_RATE_PER_S,
    rho_bar: float = DEFAULT_RHO_BAR,
) -> PaperInstance:
    """Draw the orchestrator and `num_servers` servers at distinct nodes of `rtt_ms`, and
    round(eta * J) of them (at random) high-performance."""
    n_nodes = rtt_ms.shape[0]
    if num_servers + 1 > n_nodes:
        raise ValueError(f"{num_servers} servers + orchestrator need {num_servers + 1} nodes, the RTT matrix has {n_nodes}")
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta must lie in [0, 1], got {eta}")
    nodes = rng.choice(n_nodes, size=num_servers + 1, replace=False)
    orch, servers = nodes[0], nodes[1:]
    rtt_s = rtt_ms[orch, servers] / 1000.0
    n_high = int(round(eta * num_servers))
    is_high = np.zeros(num_servers, dtype=bool)
    is_high[rng.choice(num_servers, size=n_high, replace=False)] = True
    return PaperInstance(
        names=tuple(f"s{j}" for j in range(num_servers)),
        memory_gb=np.where(is_high, HIGH_MEMORY_GB, LOW_MEMORY_GB),
        tau_c_s=rtt_s + TAU_C_OVERHEAD_S,
        tau_p_s=np.where(is_high, HIGH_TAU_P_S, LOW_TAU_P_S),
        rtt_s=rtt_s,
        is_high=is_high,
        arrival_rate_per_s=arrival_rate_per_s,
        rho_bar=rho_bar,
    )


def to_cluster(instance: PaperInstance):
    """The core's Cluster for `instance` (parsed by the core's own JSON boundary)."""
    from orchestrator.cluster_io import cluster_from_dict

    return cluster_from_dict(instance.to_plan_json())
