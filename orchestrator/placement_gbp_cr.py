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

    @property
    def num_chains(self) -> int:
        return len(self.chains)

    @property
    def unused_servers(self) -> tuple[int, ...]:
        """Computed when asked, not stored: at J = 10^6 most servers are unused, and a tuple of their
        indices per c tried held more memory than the rest of the plan."""
        return tuple(self.placement.unused_servers())


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


class _Run:
    """Alg. 1's loop for one vector m(c), without its stopping rule, run only as far as some c asked
    (`extend`): everything a given c needs is a prefix of it (see GbpCrSweep). Lazy and compact: the
    servers' order (line 1/3) is sorted only as far as the loop reached (`_grow`: the smallest keys by
    a partition, then sorted; all of them once the loop needs them all), positions are numpy indices and
    each one's start block an int; BlockIntervals are made only for the prefix a result uses."""

    CHUNK = 4096  # servers whose m_j, t_j are gathered from the arrays at a time (and the first sorted prefix)

    def __init__(
        self, holders: np.ndarray, key: np.ndarray, m_arr: np.ndarray, t_arr: np.ndarray, busy, L: int
    ) -> None:
        self._holders, self._key = holders, key  # servers with m_j > 0, and their t_j / m_j
        self._m, self._t, self._busy, self._L = m_arr, t_arr, busy, L
        self.order = np.empty(0, dtype=np.int64)  # the first servers in line 1/3's order
        self.starts: list[int] = []  # start block per position in ``order`` processed so far
        self.chain_end_pos: list[int] = []  # position after the last server of each complete chain
        self.chain_times_s: list[float] = []
        self.nu_prefix: list[float] = []  # nu after each complete chain (line 8), summed in loop order
        self._a, self._nu, self._T, self._B = 1, 0.0, 0.0, 0.0  # line 2 (B: the chain's busiest shared server)

    @property
    def sorted_all(self) -> bool:
        return len(self.order) == len(self._holders)

    @property
    def done(self) -> bool:
        return self.sorted_all and len(self.starts) == len(self.order)

    def _grow(self, want: int) -> None:
        """``order`` with at least ``want`` servers (all if fewer hold blocks): by t_j / m_j, ties to the
        smaller index (lexsort: the last key is the primary one), as sorting all of them gives. The servers
        whose key is at most the want-th smallest are all of that order's first ones (ties included)."""
        holders, key = self._holders, self._key
        if want >= len(holders):
            self.order = holders[np.lexsort((holders, key))]
            return
        kth = np.partition(key, want - 1)[want - 1]
        sel = np.flatnonzero(key <= kth)
        sub = holders[sel]
        self.order = sub[np.lexsort((sub, key[sel]))]

    def extend(self, threshold: float) -> None:
        """Run the loop on until a complete chain brings nu to ``threshold`` or the servers run out."""
        L = self._L
        a, nu, T, B = self._a, self._nu, self._T, self._B
        starts, ends, times, nus = self.starts, self.chain_end_pos, self.chain_times_s, self.nu_prefix
        while not self.done and not (nus and nus[-1] >= threshold):
            pos0 = len(starts)
            if pos0 == len(self.order):
                self._grow(max(self.CHUNK, 2 * len(self.order)))
            idx = self.order[pos0 : pos0 + self.CHUNK]
            m, t = self._m[idx].tolist(), self._t[idx].tolist()  # the same numbers as one tolist() of all
            busy = None if self._busy is None else self._busy[idx].tolist()
            for i in range(len(m)):
                mj = m[i]
                a_j = min(a, L - mj + 1)  # line 4: shift the last server back so it ends at block L
                starts.append(a_j - 1)
                T += t[i]  # line 5
                if busy is not None:
                    B = max(B, busy[i])
                a = min(a + mj - 1, L) + 1  # line 6
                if a > L:  # line 7
                    T = max(T, B)
                    nu += 1.0 / T if T > 0 else math.inf  # line 8
                    ends.append(pos0 + i + 1)
                    times.append(T)
                    nus.append(nu)
                    a, T, B = 1, 0.0, 0.0  # line 12
                    if nu >= threshold:
                        break
        self._a, self._nu, self._T, self._B = a, nu, T, B


class GbpCrSweep:
    """GBP-CR (Alg. 1) for any number of c on one cluster, identical to running Alg. 1 per c.

    Alg. 1 depends on c through m(c) (eq. 8) and through the target lambda / (rho_bar c) of line
    9 only. m(c) takes few distinct values over c in [1, c_max] (it changes only where one of the
    servers' few memory sizes crosses a multiple of s_m + s_c c), and for a fixed m(c) the loop is
    the same for every c up to where it stops: so the loop runs once per distinct m(c) without the
    stopping rule, recording nu after each chain (the same float sums, in the same order), and c
    takes the prefix up to the first chain with nu >= target (bisection; nu only grows). The loop is
    run only as far as a c asked (`_Run.extend`): with J large and the target met by the first few
    chains, not over the idle servers. Results (placements included) are shared between the c that
    stop at the same chain. This makes the c* search of orchestrator.tuning linear in J for all c
    together instead of c_max times J.

    Memory: m(c) is non-increasing in c, so the c of one m(c) are contiguous, and so are the c of one
    result; a sweep in c order (the tuning's) needs only the latest run and result, and only those are
    kept (any other order is recomputed: the same result). At J = 10^6 the runs and results of every
    m(c) kept together took more memory than the rest of the plan.
    """

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.arrays = server_arrays(cluster)
        self._run: tuple[tuple, _Run] | None = None  # (m key, its run)
        self._result: tuple[tuple, GbpCrResult] | None = None  # ((m key, k), its result)
        self._intervals: dict[tuple[int, int], BlockInterval] = {}  # one object per distinct range

    def _new_run(self, m_arr: np.ndarray, c: int | None = None) -> _Run:
        """``c``: only with shared-compute servers (Server.batch_overhead_s), whose chain time is at
        least each such server's busy time for c sessions (model.contended_chains): then
        the run depends on c itself, not only on m(c)."""
        t_arr = self.arrays.tau_c_s + self.arrays.tau_p_s * m_arr  # eq. (9), the same float operations per server
        if c is None:
            busy = None
        else:  # Server.busy_s of c sessions through the server's m blocks
            b_arr = self.arrays.shared_per_block_s
            busy = np.nan_to_num(
                self.arrays.batch_overhead_s + m_arr * b_arr + c * (self.arrays.tau_p_s - b_arr) * m_arr, nan=0.0
            )
        holders = np.flatnonzero(m_arr > 0)
        # line 1, 3: by t_j / m_j (_Run sorts them as far as it needs)
        return _Run(holders, t_arr[holders] / m_arr[holders], m_arr, t_arr, busy, self.cluster.service.num_blocks)

    def _interval(self, start: int, end: int) -> BlockInterval:
        r = self._intervals.get((start, end))
        if r is None:
            r = self._intervals[(start, end)] = BlockInterval(start, end)
        return r

    def __call__(self, c: int) -> GbpCrResult:
        if c < 1:
            raise ValueError(f"capacity requirement c must be >= 1, got {c}")
        m_key = tuple(_blocks_per_class(self.cluster, c, self.arrays))
        contended = self.arrays.batch_overhead_s is not None
        if contended:
            m_key = (*m_key, c)  # the chain times depend on c itself
        if self._run is None or self._run[0] != m_key:
            m_arr = _blocks_array(self.cluster, c, self.arrays)
            self._run = (m_key, self._new_run(m_arr, c if contended else None))
        run = self._run[1]
        target = self.cluster.arrival_rate_per_s / (self.cluster.rho_bar * c)
        threshold = target * (1 - 1e-12)  # line 9-10 (relative tolerance)
        run.extend(threshold)
        k = bisect.bisect_left(run.nu_prefix, threshold)
        met = k < len(run.nu_prefix)
        key = (m_key, k)
        if self._result is not None and self._result[0] == key:
            res = self._result[1]
            return res if res.c == c else replace(res, c=c)
        # not met (the run is done): a trailing group keeps its blocks
        n_used = run.chain_end_pos[k] if met else len(run.order)
        n_chains = k + 1 if met else len(run.nu_prefix)
        used = run.order[:n_used]
        ranges: list[BlockInterval | None] = [None] * self.cluster.num_servers
        for j, a, m in zip(used.tolist(), run.starts[:n_used], run._m[used].tolist()):
            ranges[j] = self._interval(a, a + m)
        order = used.tolist()
        chains, start = [], 0
        for end in run.chain_end_pos[:n_chains]:
            chains.append(tuple(order[start:end]))
            start = end
        res = GbpCrResult(
            c=c,
            placement=Placement(tuple(ranges)),
            chains=tuple(chains),
            chain_times_s=tuple(run.chain_times_s[:n_chains]),
            scaled_rate_per_s=run.nu_prefix[n_chains - 1] if n_chains else 0.0,
            meets_target=met,
        )
        self._result = (key, res)
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
