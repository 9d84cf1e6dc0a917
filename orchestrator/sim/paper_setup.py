"""The paper's simulation setting (section 4.1.1) as plain data.

BLOOM-176B-like service: L = 70 blocks, s_m = 1.32 GB per block, s_c = 0.11 GB of KV cache per
block per session (max length 2048). Two GPU types: high (40 GB, tau_p = 109 ms per block per
session) and low (20 GB, tau_p = 175 ms). One orchestrator and J servers at distinct randomly drawn
nodes of an RTT matrix (RIPE Atlas EU anchors, see netem.topology, or synthetic); a fraction eta of
the servers, drawn at random, are high. Defaults: J = 20, eta = 0.2, lambda = 0.2 req/s, rho_bar = 0.7.

tau_c has two readings (``TAU_C_READINGS``), both through orchestrator.session_times.tau_c_s, the
function the online orchestrator uses:
- "model" (default): the paper's definition of tau_c_j, the *total* communication time with server
  j over all tokens of a request (§3.1 after eq. 2), i.e. steps x (RTT + 18 ms) with steps = the
  mean output length, 20 tokens (§4.1.1);
- "literal": the sentence of §4.1.1 read literally, one round trip per request: RTT + 18 ms.
``AuthorsChoices`` (orchestrator.sim.authors_setup) switch in the authors' code's choices.

`PaperInstance.to_plan_json()` gives the cluster in the schema of the `plan`/`simulate` CLIs
(memory in GB, times in seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from orchestrator.session_times import SessionShape, tau_c_s
from orchestrator.sim.authors_setup import (
    AUTHORS_CACHE_SIZE_GB,
    AUTHORS_HIGH_TAU_P_S,
    AUTHORS_LOW_TAU_P_S,
    AUTHORS_PREFILL_EXTRA_S,
    AuthorsChoices,
)

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
MEAN_INPUT_TOKENS = 2000  # §4.1.1, from the Azure trace
MEAN_OUTPUT_TOKENS = 20
PAPER_SHAPE = SessionShape(MEAN_INPUT_TOKENS, MEAN_OUTPUT_TOKENS)
ONE_STEP_SHAPE = SessionShape(1, 1)  # the "literal" reading: one round trip per request
TAU_C_READINGS = ("model", "literal")


def paper_tau_c_s(rtt_s, reading: str = "model", authors: bool = False):
    """tau_c of the paper's setup for RTT(s) ``rtt_s`` (see module docstring); ``authors``: the
    authors' (RTT + 50 ms) + 19 RTT (overrides ``reading``)."""
    if authors:
        return tau_c_s(rtt_s, PAPER_SHAPE, 0.0, AUTHORS_PREFILL_EXTRA_S)
    if reading not in TAU_C_READINGS:
        raise ValueError(f"unknown tau_c reading {reading!r}; choose one of {TAU_C_READINGS}")
    return tau_c_s(rtt_s, PAPER_SHAPE if reading == "model" else ONE_STEP_SHAPE, TAU_C_OVERHEAD_S)


@dataclass(frozen=True)
class PaperInstance:
    """One drawn cluster: per-server arrays (index = server id)."""

    names: tuple[str, ...]
    memory_gb: np.ndarray
    tau_c_s: np.ndarray
    tau_p_s: np.ndarray
    rtt_s: np.ndarray  # RTT orchestrator -> server (without the 18 ms overhead)
    is_high: np.ndarray
    tau_c_reading: str = "model"
    authors: AuthorsChoices = AuthorsChoices()
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
    tau_c_reading: str = "model",
    authors: AuthorsChoices = AuthorsChoices(),
) -> PaperInstance:
    """Draw the orchestrator and `num_servers` servers at distinct nodes of `rtt_ms`, and
    round(eta * J) of them (at random) high-performance. ``authors`` switches in the authors'
    choices of node and GPU assignment, tau_c, tau_p and s_c (orchestrator.sim.authors_setup)."""
    n_nodes = rtt_ms.shape[0]
    if num_servers + 1 > n_nodes:
        raise ValueError(
            f"{num_servers} servers + orchestrator need {num_servers + 1} nodes, the RTT matrix has {n_nodes}"
        )
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta must lie in [0, 1], got {eta}")
    if authors.orchestrator_best_connected:
        # rtt.m:117-121: the client/orchestrator is the anchor with the lowest median RTT.
        off_diag = np.where(np.eye(n_nodes, dtype=bool), np.nan, rtt_ms)
        orch = int(np.nanargmin(np.nanmedian(off_diag, axis=1)))
        others = np.delete(np.arange(n_nodes), orch)
        servers = rng.choice(others, size=num_servers, replace=False)
    else:
        nodes = rng.choice(n_nodes, size=num_servers + 1, replace=False)
        orch, servers = nodes[0], nodes[1:]
    rtt_s = rtt_ms[orch, servers] / 1000.0
    n_high = int(round(eta * num_servers))
    is_high = np.zeros(num_servers, dtype=bool)
    if authors.fast_low_rtt:
        # rtt.m:137-149: the fast GPUs go to the lowest-RTT servers (floor(eta J) of them; equal
        # to round(eta J) on the paper's grid).
        is_high[np.argsort(rtt_s, kind="stable")[:n_high]] = True
    else:
        is_high[rng.choice(num_servers, size=n_high, replace=False)] = True
    high_tau_p, low_tau_p = (
        (AUTHORS_HIGH_TAU_P_S, AUTHORS_LOW_TAU_P_S) if authors.tau_p else (HIGH_TAU_P_S, LOW_TAU_P_S)
    )
    return PaperInstance(
        names=tuple(f"s{j}" for j in range(num_servers)),
        memory_gb=np.where(is_high, HIGH_MEMORY_GB, LOW_MEMORY_GB),
        tau_c_s=paper_tau_c_s(rtt_s, tau_c_reading, authors.tau_c),
        tau_p_s=np.where(is_high, high_tau_p, low_tau_p),
        rtt_s=rtt_s,
        is_high=is_high,
        cache_size_gb=AUTHORS_CACHE_SIZE_GB if authors.cache_size else CACHE_SIZE_GB,
        arrival_rate_per_s=arrival_rate_per_s,
        rho_bar=rho_bar,
        tau_c_reading=tau_c_reading,
        authors=authors,
    )


def to_cluster(instance: PaperInstance):
    """The core's Cluster for `instance` (parsed by the core's own JSON boundary)."""
    from orchestrator.cluster_io import cluster_from_dict

    return cluster_from_dict(instance.to_plan_json())
