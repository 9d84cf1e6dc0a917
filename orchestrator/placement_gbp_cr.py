"""GBP-CR: Greedy Block Placement with Cache Reservation (Alg. 1, eqs 8, 9, 12, 13)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

import numpy as np

from orchestrator.model import (
    BlockInterval,
    Cluster,
    InfeasibleClusterError,
    Placement,
    robust_floor_div,
)


@dataclass(frozen=True)
class GbpCrResult:
    """Outcome of Alg. 1 for one capacity requirement c.

    ``chains`` are GBP-CR's disjoint server groups that completed all L blocks (k_1(c), k_2(c), ...
    of eq. 13) in construction order; ``chain_times_s`` their sum_j t_j(c). ``num_chains`` is K(c)
    when ``meets_target`` (nu >= lambda/(rho_bar c)), else the number of complete chains formed
    before running out of servers. ``unused_servers`` got no blocks (loop stopped before them, or
    m_j(c) = 0). Servers of a trailing incomplete group keep their blocks, as Alg. 1 leaves them.
    """

    c: int
    placement: Placement
    chains: tuple[tuple[int, ...], ...]
    chain_times_s: tuple[float, ...]
    scaled_rate_per_s: float  # nu of Alg. 1 = sum_k 1 / sum_{j in k} t_j(c)
    meets_target: bool
    unused_servers: tuple[int, ...]

    @property
    def num_chains(self) -> int:
        return len(self.chains)


@dataclass(frozen=True)
class ServerArrays:
    """Per-server parameters as numpy arrays, built once per cluster by the c* search (which runs
    GBP-CR for every c in [1, c_max]) instead of once per c."""

    memory_values: tuple[float, ...]  # distinct memory sizes
    memory_class: np.ndarray  # server -> index into memory_values
    tau_c_s: np.ndarray
    tau_p_s: np.ndarray
    batch_overhead_s: np.ndarray | None = None  # NaN where None; None when no server shares its compute
    shared_per_block_s: np.ndarray | None = None  # Server.shared_per_block_s (with batch_overhead_s)


def server_arrays(cluster: Cluster) -> ServerArrays:
    mem = np.array([sv.memory for sv in cluster.servers], dtype=float)
    values, inverse = np.unique(mem, return_inverse=True)
    shared = [sv.batch_overhead_s for sv in cluster.servers]
    overhead = (
        None
        if all(o is None for o in shared)
        else np.array([math.nan if o is None else o for o in shared], dtype=float)
    )
    return ServerArrays(
        tuple(float(v) for v in values),
        inverse,
        np.array([sv.tau_c_s for sv in cluster.servers], dtype=float),
        np.array([sv.tau_p_s for sv in cluster.servers], dtype=float),
        overhead,
        None if overhead is None else np.array([sv.shared_per_block_s for sv in cluster.servers]),
    )


def _blocks_per_class(cluster: Cluster, c: int, arrays: ServerArrays) -> list[int]:
    s = cluster.service
    per_block = s.block_size + s.cache_size * c
    return [min(robust_floor_div(v, per_block), s.num_blocks) for v in arrays.memory_values]


def _blocks_array(cluster: Cluster, c: int, arrays: ServerArrays) -> np.ndarray:
    """Eq. (8) for every server; the floor division runs once per distinct memory size."""
    return np.array(_blocks_per_class(cluster, c, arrays), dtype=np.int64)[arrays.memory_class]


def blocks_per_server(cluster: Cluster, c: int, arrays: ServerArrays | None = None) -> list[int]:
    """m_j(c) = min(floor(M_j / (s_m + s_c c)), L) (eq. 8), robust to float noise."""
    return _blocks_array(cluster, c, arrays or server_arrays(cluster)).tolist()


def max_capacity(cluster: Cluster) -> int:
    """c_max = floor((max_j M_j - s_m) / s_c) (§3.1.3); 0 if no server can hold one block+slot."""
    s = cluster.service
    best = max(sv.memory for sv in cluster.servers)
    return max(0, robust_floor_div(best - s.block_size, s.cache_size))


def gbp_cr(cluster: Cluster, c: int) -> GbpCrResult:
    """Alg. 1 for one c (see GbpCrSweep)."""
    return GbpCrSweep(cluster)(c)


@dataclass(frozen=True)
class _FullRun:
    """Alg. 1's loop for one vector m(c), run past the stopping rule until the servers run out:
    everything a given c needs is a prefix of it (see GbpCrSweep)."""

    order: list[int]  # servers with m_j > 0, in line 1/3's order
    ranges: list[BlockInterval]  # per position in ``order``
    chain_end_pos: list[int]  # position after the last server of each complete chain
    chain_times_s: list[float]
    nu_prefix: list[float]  # nu after each complete chain (line 8), summed in loop order


class GbpCrSweep:
    """GBP-CR (Alg. 1) for any number of c on one cluster, identical to running Alg. 1 per c.

    Alg. 1 depends on c through m(c) (eq. 8) and through the target lambda / (rho_bar c) of line
    9 only. m(c) takes few distinct values over c in [1, c_max] (it changes only where one of the
    servers' few memory sizes crosses a multiple of s_m + s_c c), and for a fixed m(c) the loop is
    the same for every c up to where it stops: so the loop runs once per distinct m(c) without the
    stopping rule, recording nu after each chain (the same float sums, in the same order), and c
    takes the prefix up to the first chain with nu >= target (bisection; nu only grows). Results
    (placements included) are shared between the c that stop at the same chain. This makes the c*
    search of orchestrator.tuning linear in J for all c together instead of c_max times J.
    """

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.arrays = server_arrays(cluster)
        self._runs: dict[tuple, _FullRun] = {}
        self._results: dict[tuple, GbpCrResult] = {}

    def _full_run(self, m_arr: np.ndarray, c: int | None = None) -> _FullRun:
        """``c``: only with shared-compute servers (Server.batch_overhead_s), whose chain time is at
        least each such server's busy time for c sessions (model.contended_chains): then
        the run depends on c itself, not only on m(c)."""
        L = self.cluster.service.num_blocks
        t_arr = self.arrays.tau_c_s + self.arrays.tau_p_s * m_arr  # eq. (9), the same float operations per server
        if c is None:
            busy = None
        else:  # Server.busy_s of c sessions through the server's m blocks
            b_arr = self.arrays.shared_per_block_s
            busy = np.nan_to_num(
                self.arrays.batch_overhead_s + m_arr * b_arr + c * (self.arrays.tau_p_s - b_arr) * m_arr, nan=0.0
            )
        holders = np.flatnonzero(m_arr > 0)
        # line 1, 3: by t_j / m_j, ties to the smaller index (lexsort: last key is the primary one)
        order = holders[np.lexsort((holders, t_arr[holders] / m_arr[holders]))].tolist()
        m, t = m_arr.tolist(), t_arr.tolist()
        ranges, ends, times, nus = [], [], [], []
        a, nu, T, B = 1, 0.0, 0.0, 0.0  # line 2 (B: the chain's busiest shared-compute server)
        for pos, j in enumerate(order):
            a_j = min(a, L - m[j] + 1)  # line 4: shift the last server back so it ends at block L
            ranges.append(BlockInterval(a_j - 1, a_j - 1 + m[j]))
            T += t[j]  # line 5
            if busy is not None:
                B = max(B, float(busy[j]))
            a = min(a + m[j] - 1, L) + 1  # line 6
            if a > L:  # line 7
                T = max(T, B)
                nu += 1.0 / T if T > 0 else math.inf  # line 8
                ends.append(pos + 1)
                times.append(T)
                nus.append(nu)
                a, T, B = 1, 0.0, 0.0  # line 12
        return _FullRun(order, ranges, ends, times, nus)

    def __call__(self, c: int) -> GbpCrResult:
        if c < 1:
            raise ValueError(f"capacity requirement c must be >= 1, got {c}")
        m_arr = _blocks_array(self.cluster, c, self.arrays)
        m_key = tuple(_blocks_per_class(self.cluster, c, self.arrays))
        contended = self.arrays.batch_overhead_s is not None
        if contended:
            m_key = (*m_key, c)  # the chain times depend on c itself
        run = self._runs.get(m_key)
        if run is None:
            run = self._runs[m_key] = self._full_run(m_arr, c if contended else None)
        target = self.cluster.arrival_rate_per_s / (self.cluster.rho_bar * c)
        k = bisect.bisect_left(run.nu_prefix, target * (1 - 1e-12))  # line 9-10 (relative tolerance)
        met = k < len(run.nu_prefix)
        key = (m_key, k)
        res = self._results.get(key)
        if res is not None:
            return res if res.c == c else replace(res, c=c)
        n_used = run.chain_end_pos[k] if met else len(run.order)  # not met: a trailing group keeps its blocks
        n_chains = k + 1 if met else len(run.nu_prefix)
        ranges: list[BlockInterval | None] = [None] * len(m_arr)
        for j, r in zip(run.order[:n_used], run.ranges[:n_used]):
            ranges[j] = r
        chains, start = [], 0
        for end in run.chain_end_pos[:n_chains]:
            chains.append(tuple(run.order[start:end]))
            start = end
        used = np.zeros(len(m_arr), dtype=bool)
        used[run.order[:n_used]] = True
        res = GbpCrResult(
            c=c,
            placement=Placement(tuple(ranges)),
            chains=tuple(chains),
            chain_times_s=tuple(run.chain_times_s[:n_chains]),
            scaled_rate_per_s=run.nu_prefix[n_chains - 1] if n_chains else 0.0,
            meets_target=met,
            unused_servers=tuple(np.flatnonzero(~used).tolist()),
        )
        self._results[key] = res
        return res


def gbp_cr_or_raise(cluster: Cluster, c: int) -> GbpCrResult:
    """gbp_cr, raising InfeasibleClusterError when not even one complete chain forms."""
    res = gbp_cr(cluster, c)
    if res.num_chains == 0:
        s = cluster.service
        total = sum(blocks_per_server(cluster, c))
        raise InfeasibleClusterError(
            f"with cache reservation c={c} the servers hold {total} blocks in total (each block needs "
            f"{s.block_size + s.cache_size * c:.6g} in the cluster's memory unit), fewer than the model's "
            f"{s.num_blocks}: "
            f"add servers or memory, or lower c"
        )
    return res


def gbp_cr_fixed(cluster: Cluster, c: int, fixed: dict[int, BlockInterval]) -> Placement:
    """GBP-CR (Alg. 1) with some servers' ranges given (beyond the paper: a server that holds live
    sessions, or was started on fixed blocks, keeps its range). Pure.

    The fixed servers seed chains: in Alg. 1's order (t_j / m_j, eq. 9, over their own ranges) each
    joins the first seeded chain whose blocks it does not overlap, else starts one. Each seeded chain's
    uncovered block intervals are then filled with the free servers in Alg. 1's order, line 4-6
    within the gap (a server that does not fit is shifted back to end at the gap's end, or starts at
    block 0); then Alg. 1 goes on with the servers left, counting the seeded chains' scaled rate
    (line 8) towards the target lambda / (rho_bar c) of line 9. The chains themselves are GCA's on the
    returned placement (fixed servers included), as for GBP-CR's. With no fixed server this is
    exactly Alg. 1 (`gbp_cr(cluster, c).placement`)."""
    if c < 1:
        raise ValueError(f"capacity requirement c must be >= 1, got {c}")
    L = cluster.service.num_blocks
    for j, r in fixed.items():
        if not 0 <= j < cluster.num_servers or r is None or not 0 <= r.start < r.end <= L:
            raise ValueError(f"fixed server {j}: range {r} is not within [0, {L}) of a server of the cluster")
    if not fixed:
        return gbp_cr(cluster, c).placement
    arrays = server_arrays(cluster)
    m = _blocks_array(cluster, c, arrays).tolist()
    t = [sv.tau_c_s + sv.tau_p_s * mj for sv, mj in zip(cluster.servers, m)]  # eq. (9)
    ranges: list[BlockInterval | None] = [None] * cluster.num_servers
    for j, r in fixed.items():
        ranges[j] = BlockInterval(r.start, r.end)

    def t_fixed(j: int) -> float:
        sv, n = cluster.servers[j], fixed[j].end - fixed[j].start
        return sv.tau_c_s + sv.tau_p_s * n

    seeds: list[list[int]] = []  # fixed servers of each seeded chain
    covered: list[np.ndarray] = []
    for j in sorted(fixed, key=lambda j: (t_fixed(j) / (fixed[j].end - fixed[j].start), j)):
        r = fixed[j]
        for k, cov in enumerate(covered):
            if not cov[r.start : r.end].any():
                cov[r.start : r.end] = True
                seeds[k].append(j)
                break
        else:
            cov = np.zeros(L, dtype=bool)
            cov[r.start : r.end] = True
            covered.append(cov)
            seeds.append([j])
    free = [
        j
        for j in sorted(
            (j for j in range(cluster.num_servers) if j not in fixed and m[j] > 0), key=lambda j: (t[j] / m[j], j)
        )
    ]
    pos = 0
    nu = 0.0
    for k, cov in enumerate(covered):
        T = sum(t_fixed(j) for j in seeds[k])
        complete = True
        gaps, b = [], 0
        while b < L:  # the maximal uncovered intervals [g0, g1)
            if cov[b]:
                b += 1
                continue
            g0 = b
            while b < L and not cov[b]:
                b += 1
            gaps.append((g0, b))
        for g0, g1 in gaps:
            a = g0
            while a < g1:
                if pos >= len(free):
                    complete = False
                    break
                j = free[pos]
                pos += 1
                start = max(0, min(a, g1 - m[j]))  # line 4, within the gap
                ranges[j] = BlockInterval(start, start + m[j])
                T += t[j]  # line 5
                a = start + m[j]  # line 6
            if not complete:
                break
        if complete:
            nu += 1.0 / T if T > 0 else math.inf  # line 8
    target = cluster.arrival_rate_per_s / (cluster.rho_bar * c)
    a, T = 1, 0.0
    while pos < len(free) and nu < target * (1 - 1e-12):  # lines 3-12 on the servers left
        j = free[pos]
        pos += 1
        a_j = min(a, L - m[j] + 1)
        ranges[j] = BlockInterval(a_j - 1, a_j - 1 + m[j])
        T += t[j]
        a = min(a + m[j] - 1, L) + 1
        if a > L:
            nu += 1.0 / T if T > 0 else math.inf
            a, T = 1, 0.0
    return Placement(tuple(ranges))
