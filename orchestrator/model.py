"""System model of the paper (§2.1): servers, service, cluster, placement, routing graph, chains.

Conventions (see DESIGN.md):
- memory quantities (``memory``, ``block_size``, ``cache_size``) carry no unit in their names on
  purpose: the paper's setup and `petals-chain plan` examples use GB, the live orchestrator bytes;
  any single unit works as long as memory, block size and cache size share it. Times are in
  seconds (``*_s``).
- Block indices are 0-based and ranges half-open ``[start, end)``. The paper numbers blocks
  1..L and writes a server's range as ``{a_j, ..., a_j + m_j - 1}``; so ``start = a_j - 1`` and
  ``end = a_j - 1 + m_j``. The conversion happens only inside the algorithm modules.
- The dummy source j_0 of the paper "ends" at block 0 (``end = 0``), the dummy sink j_{J+1}
  "starts" at block L; in this module they are the integers ``SOURCE = -1`` and ``SINK = -2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import compress, count, repeat
from operator import is_, is_not
from typing import Iterable, Sequence

SOURCE = -1
SINK = -2

# How a live server's compute serves concurrent sessions (Server.batch_overhead_s; the orchestrator's
# --server-compute): "auto" = shared where a live fit measured its marginal per-session cost (t_O apart
# from the per-step t_o, on any device), the paper's parallel model until then; "shared" = every
# server, the start-up profile's t_O standing in where no fit exists yet; "parallel" = the paper's.
SERVER_COMPUTE = ("auto", "shared", "parallel")

# Relative tolerance for floor divisions of float memory sizes: (2 - 1) / 0.1 = 9.999999999999998
# must count 10 slots, not 9.
_FLOOR_REL_TOL = 1e-9


class InfeasibleClusterError(ValueError):
    """The cluster cannot host a complete chain (or the input is inconsistent)."""


class InvalidClusterError(ValueError):
    """The cluster description is malformed (missing/negative/ill-typed fields)."""


def robust_floor_div(numerator: float, denominator: float) -> int:
    """floor(numerator / denominator), snapping quotients within 1e-9 (relative) of an integer.

    Used for every slot/block count of eqs (3) and (8) so that float noise never loses a slot.
    """
    if denominator <= 0:
        raise ValueError(f"denominator must be positive, got {denominator}")
    q = numerator / denominator
    r = round(q)
    if abs(q - r) <= _FLOOR_REL_TOL * max(1.0, abs(q)):
        return int(r)
    return int(math.floor(q))


@dataclass(frozen=True)
class Server:
    """A physical server j: memory M_j, per-session communication time tau^c_j, per-block
    per-session computation time tau^p_j (§2.1.1). ``rtt_s`` is optional and only used by the
    PETALS baseline router.

    ``batch_overhead_s`` is not the paper's: set (>= 0), the server's compute is *shared* by the
    sessions it serves at once (one CPU, or any device that runs batches back to back), and it is
    the part of a session's compute that a batch pays once whatever its size (steps x t_o of the
    calibrated fit); its per-session, per-block part is tau^p_j. Then n sessions on the server keep
    it busy ``batch_overhead_s + n m tau^p_j`` per session lifetime, and no session can be served
    faster than that (`contended_chains`). None (the default): the paper's model, where
    concurrent sessions do not slow each other (GPU batches, §2.1.1).

    ``batch_block_overhead_s`` (with ``batch_overhead_s``; None = 0): the part of tau^p_j that a batch
    pays once per block whatever its sessions (steps x t_B of the calibrated fit: reading a block's
    weights costs about as much for 1 row as for 3). tau^p_j stays a session's time alone (it includes
    this part, so T_k is the lone chain time), and n sessions through m blocks keep the server busy
    ``batch_overhead_s + m batch_block_overhead_s + n m (tau^p_j - batch_block_overhead_s)``."""

    name: str
    memory: float
    tau_c_s: float
    tau_p_s: float
    rtt_s: float | None = None
    batch_overhead_s: float | None = None
    batch_block_overhead_s: float | None = None

    @property
    def shared_per_block_s(self) -> float:
        """The per-block part of tau^p a batch pays once (0 unless shared compute with a block overhead)."""
        return (
            self.batch_block_overhead_s if (self.batch_overhead_s is not None and self.batch_block_overhead_s) else 0.0
        )

    def busy_s(self, blocks: int, sessions: float) -> float | None:
        """How long `sessions` sessions through `blocks` of this server's blocks keep it busy per
        session lifetime (one batch per step carries all of them); None for the paper's servers."""
        if self.batch_overhead_s is None:
            return None
        b = self.shared_per_block_s
        return self.batch_overhead_s + blocks * b + sessions * blocks * (self.tau_p_s - b)


@dataclass(frozen=True)
class Service:
    """The served model: L blocks of size s_m, KV cache of s_c per block per session."""

    num_blocks: int
    block_size: float
    cache_size: float


@dataclass(frozen=True)
class Cluster:
    """Everything the planner needs: service, servers, demand lambda and target load rho_bar."""

    service: Service
    servers: tuple[Server, ...]
    arrival_rate_per_s: float
    rho_bar: float = 0.7

    def __post_init__(self) -> None:
        validate_cluster(self)

    @property
    def num_servers(self) -> int:
        return len(self.servers)


def validate_cluster(cluster: Cluster) -> None:
    """Raise InvalidClusterError with a user-facing message if a field is out of range."""
    s = cluster.service
    if not isinstance(s.num_blocks, int) or s.num_blocks < 1:
        raise InvalidClusterError(f"'blocks' must be a positive integer, got {s.num_blocks!r}")
    if not s.block_size > 0:
        raise InvalidClusterError(f"'block_size' must be > 0, got {s.block_size!r}")
    if not s.cache_size > 0:
        raise InvalidClusterError(f"'cache_size' must be > 0, got {s.cache_size!r}")
    if not (cluster.arrival_rate_per_s > 0 and math.isfinite(cluster.arrival_rate_per_s)):
        raise InvalidClusterError(f"'arrival_rate' must be a positive number, got {cluster.arrival_rate_per_s!r}")
    if not 0 < cluster.rho_bar < 1:
        raise InvalidClusterError(f"'rho_bar' must lie in (0, 1), got {cluster.rho_bar!r}")
    if not cluster.servers:
        raise InvalidClusterError("'servers' is empty: list at least one server")
    names = set()
    for sv in cluster.servers:
        if sv.name in names:
            raise InvalidClusterError(f"server name {sv.name!r} appears twice: names must be unique")
        names.add(sv.name)
        if not (sv.memory >= 0 and math.isfinite(sv.memory)):
            raise InvalidClusterError(f"server {sv.name!r}: 'memory' must be a non-negative number, got {sv.memory!r}")
        if not (sv.tau_c_s >= 0 and math.isfinite(sv.tau_c_s)):
            raise InvalidClusterError(f"server {sv.name!r}: 'tau_c' must be a non-negative number, got {sv.tau_c_s!r}")
        if not (sv.tau_p_s >= 0 and math.isfinite(sv.tau_p_s)):
            raise InvalidClusterError(f"server {sv.name!r}: 'tau_p' must be a non-negative number, got {sv.tau_p_s!r}")
        if sv.tau_c_s == 0 and sv.tau_p_s == 0:
            raise InvalidClusterError(f"server {sv.name!r}: 'tau_c' and 'tau_p' cannot both be 0")
        if sv.rtt_s is not None and not sv.rtt_s >= 0:
            raise InvalidClusterError(f"server {sv.name!r}: 'rtt' must be >= 0, got {sv.rtt_s!r}")
        if sv.batch_overhead_s is not None and not (sv.batch_overhead_s >= 0 and math.isfinite(sv.batch_overhead_s)):
            raise InvalidClusterError(
                f"server {sv.name!r}: 'batch_overhead' must be a non-negative number, got {sv.batch_overhead_s!r}"
            )
        if sv.batch_block_overhead_s is not None and not (0 <= sv.batch_block_overhead_s <= sv.tau_p_s):
            raise InvalidClusterError(
                f"server {sv.name!r}: 'batch_block_overhead' must lie in [0, tau_p] (it is the "
                f"part of tau_p a batch pays once per block), got {sv.batch_block_overhead_s!r}"
            )


@dataclass(frozen=True)
class BlockInterval:
    """Half-open block interval [start, end) of the system model (what holds a range's weights at
    run time is another thing: `petals_chain.runtime.block_range.BlockRange`)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"invalid block range [{self.start}, {self.end})")

    @property
    def num_blocks(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Placement:
    """Block placement (a, m): ``ranges[j]`` is server j's range, or None if j hosts nothing."""

    ranges: tuple[BlockInterval | None, ...]

    def num_blocks(self, j: int) -> int:
        r = self.ranges[j]
        return 0 if r is None else r.num_blocks

    @cached_property
    def _used(self) -> tuple[int, ...]:
        # once per placement (GCA asks twice), and compress/count/map run in C: a plan of 10^6 servers
        # scans a placement of 10^6 ranges per GCA run
        return tuple(compress(count(), map(is_not, self.ranges, repeat(None))))

    def used_servers(self) -> list[int]:
        return list(self._used)

    def unused_servers(self) -> list[int]:
        return list(compress(count(), map(is_, self.ranges, repeat(None))))

    def key(self) -> tuple:
        return tuple(None if r is None else (r.start, r.end) for r in self.ranges)


@dataclass(frozen=True)
class ChainSpec:
    """A server chain k: servers in order, the blocks each processes (m_ij of eq. 2), its
    capacity c_k (concurrent sessions) and mean service time T_k (eq. 2).

    ``lone_time_s`` (not the paper's): set by `contended_chains` when it raised T_k to the busy time
    of a shared-compute server with the chain full; the chain's time with one session (eq. 2's T_k).
    Between one session and c_k a session's time grows from it to T_k (`session_time_s`)."""

    servers: tuple[int, ...]
    blocks: tuple[BlockInterval, ...]
    capacity: int
    service_time_s: float
    lone_time_s: float | None = None

    @property
    def dispatch_time_s(self) -> float:
        """What JFFC ranks the chain by: eq. 2's T_k, the lone time where contention raised T_k (the
        fastest free chain is the one a new session finishes soonest on; ranking contended chains by
        their full-chain busy time sent light load to slower chains)."""
        return self.service_time_s if self.lone_time_s is None else self.lone_time_s

    def session_time_s(self, sessions: int) -> float:
        """A session's time with `sessions` in the chain: T_k for the paper's chains; on a shared
        server the busy time grows with the sessions it serves back to back, so max(lone time,
        T_k x sessions / c_k) (T_k is the busy time at c_k)."""
        if self.lone_time_s is None:
            return self.service_time_s
        return max(self.lone_time_s, self.service_time_s * sessions / self.capacity)


def residual_slots(cluster: Cluster, placement: Placement) -> list[int]:
    """M~_j = floor((M_j - s_m m_j) / s_c) (eq. 3), cache slots left after hosting the blocks.

    Servers without blocks get 0 (they take no part in any chain)."""
    s = cluster.service
    out = [0] * len(placement.ranges)
    by_memory_blocks: dict[tuple[float, int], int] = {}  # servers mostly share a few (M_j, m_j)
    for j in placement.used_servers():  # at J = 10^6 most hold nothing: visit only those that do
        sv, r = cluster.servers[j], placement.ranges[j]
        key = (sv.memory, r.end - r.start)
        slots = by_memory_blocks.get(key)
        if slots is None:
            slots = by_memory_blocks[key] = max(0, robust_floor_div(sv.memory - s.block_size * key[1], s.cache_size))
        out[j] = slots
    return out


def link_time_s(server: Server, m_ij: int) -> float:
    """Cost tau^c_j + tau^p_j m_ij of traversing link (i, j) (eq. 2)."""
    return server.tau_c_s + server.tau_p_s * m_ij


def routing_links(placement: Placement, num_blocks: int) -> list[tuple[int, int, int]]:
    """The routing graph E_{a,m} with dummy source/sink, as (i, j, m_ij) triples.

    (i, j) is a link iff a_j <= a_i + m_i <= a_j + m_j - 1 (§2.1.1); in 0-based half-open
    terms: start_j <= end_i < end_j, and m_ij = end_j - end_i. The source has end 0; the sink has
    start L (links into it carry m = 1 in the paper, but cost nothing and need no memory).
    """
    ends: dict[int, int] = {SOURCE: 0}
    for j, r in enumerate(placement.ranges):
        if r is not None:
            ends[j] = r.end
    links = []
    for i, e_i in ends.items():
        for j, r in enumerate(placement.ranges):
            if r is not None and r.start <= e_i < r.end:
                links.append((i, j, r.end - e_i))
        if e_i == num_blocks:
            links.append((i, SINK, 1))
    return links


def chain_from_path(cluster: Cluster, placement: Placement, path: Sequence[int], capacity: int) -> ChainSpec:
    """Build a ChainSpec from a server path (without source/sink), computing m_ij and T_k (eq. 2)."""
    prev_end = 0
    blocks = []
    t = 0.0
    for j in path:
        r = placement.ranges[j]
        if r is None or not (r.start <= prev_end < r.end):
            raise ValueError(f"path {list(path)} is not a valid chain at server {j}")
        blocks.append(BlockInterval(prev_end, r.end))
        t += link_time_s(cluster.servers[j], r.end - prev_end)
        prev_end = r.end
    if prev_end != cluster.service.num_blocks:
        raise ValueError(f"path {list(path)} ends at block {prev_end}, not {cluster.service.num_blocks}")
    return ChainSpec(servers=tuple(path), blocks=tuple(blocks), capacity=int(capacity), service_time_s=t)


def chain_slot_usage(chains: Iterable[ChainSpec], num_servers: int) -> list[int]:
    """Cache slots each server commits to the chains: sum_k c_k m_ij (left side of eq. 3)."""
    used = [0] * num_servers
    for k in chains:
        for j, b in zip(k.servers, k.blocks):
            used[j] += k.capacity * b.num_blocks
    return used


def server_busy_s(cluster: Cluster, chains: Iterable[ChainSpec]) -> list[float | None]:
    """How long each server with shared compute (``batch_overhead_s`` set) is busy serving one
    session lifetime of every chain through it at full capacity: batch_overhead_j + (blocks the
    chains use on j) x the per-block batch part + sum_k c_k m_kj (tau^p_j - that part) (one batch per
    step carries all of them: the optimistic end, since saturated servers do batch their queued
    steps). None for the paper's servers."""
    chains = list(chains)
    out: list[float | None] = []
    for j, sv in enumerate(cluster.servers):
        if sv.batch_overhead_s is None:
            out.append(None)
            continue
        spans = [(b, k.capacity) for k in chains for i, b in zip(k.servers, k.blocks) if i == j]
        used = set().union(*(range(b.start, b.end) for b, _ in spans)) if spans else set()
        b_s = sv.shared_per_block_s
        out.append(sv.batch_overhead_s + len(used) * b_s + sum(c * b.num_blocks * (sv.tau_p_s - b_s) for b, c in spans))
    return out


def saturating_capacity(cluster: Cluster, chain: ChainSpec) -> int:
    """The sessions at which chain k's busiest shared-compute server saturates: the smallest n whose
    busy time (`Server.busy_s`: batch_overhead_j + n m_kj tau^p_j, the per-block batch part once) reaches the chain's
    uncontended time T_k. Up to it
    each session adds a full session's worth of throughput; past it a session only stretches every
    session's time by m tau^p (throughput grows by the amortised overhead alone), so a job is better
    kept in JFFC's central queue or sent to another chain. The chain's capacity if no server is shared."""
    n = chain.capacity
    for j, b in zip(chain.servers, chain.blocks):
        sv = cluster.servers[j]
        per_session_s = b.num_blocks * (sv.tau_p_s - sv.shared_per_block_s)
        if sv.batch_overhead_s is None or per_session_s <= 0:
            continue
        spare_s = chain.service_time_s - sv.batch_overhead_s - b.num_blocks * sv.shared_per_block_s
        n = min(n, 1 if spare_s <= 0 else math.ceil(spare_s / per_session_s * (1 - 1e-12)))
    return max(1, n)


def contended_chains(cluster: Cluster, chains: Iterable[ChainSpec]) -> tuple[ChainSpec, ...]:
    """Chains on shared-compute servers (``batch_overhead_s`` set): capacities cut to where their
    servers saturate (`saturating_capacity`), then T_k raised to the busy time of the chain's most
    loaded shared server with every chain through it full (`server_busy_s`): a server that runs n
    sessions' work back to back cannot finish one session's share sooner than all n (the asymptote of
    a closed queueing network: cycle time >= n x the bottleneck's demand). Identity for the paper's
    servers (``batch_overhead_s`` None), so every paper result is unchanged. Order kept."""
    chains = tuple(chains)
    if all(cluster.servers[j].batch_overhead_s is None for k in chains for j in k.servers):
        return chains
    capped = [replace(k, capacity=saturating_capacity(cluster, k)) for k in chains]
    busy = server_busy_s(cluster, capped)
    out = []
    for k in capped:
        worst = max((busy[j] for j in k.servers if busy[j] is not None), default=0.0)
        out.append(k if worst <= k.service_time_s else replace(k, service_time_s=worst, lone_time_s=k.service_time_s))
    return tuple(out)


def total_service_rate_per_s(chains: Iterable[ChainSpec]) -> float:
    """nu = sum_k c_k mu_k (eq. 4)."""
    return float(sum(k.capacity / k.service_time_s for k in chains))
