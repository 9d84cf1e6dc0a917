"""The authors' simulation choices (their public code), each one a named switch.

Source: github.com/TingyangSunJeff/load_balance_llm_simulator at commit 058ff0d, mainly
``src/tests/test_overall_comparison_v4.m`` ("v4" below), ``src/utilities/construct_rtt_from_ripe_atlas.m``
("rtt.m") and ``config/PetalsProfiledParameters.m`` ("params.m"). Implemented from reading that
code; none of it is copied. ``--setup authors`` switches all of them on; the ablation in
scripts/reproduce_paper.py switches them on one at a time on top of the paper's setup.

Choices (name: what it changes; where the authors do it):
- ``tau_c``: tau_c_j = (RTT_j + 50 ms) + 19 RTT_j, i.e. 20 round trips with a 50 ms prefill
  extra and no per-step overhead (v4:535-536 and v4:663 ``RTT_input + (lc-1)*RTT``; rtt.m:163-164).
- ``tau_p``: tau_p = 89.7 ms (40 GB) / 178.4 ms (20 GB) per block per session: footnote 11 with
  their device numbers (156/78 TFLOPS, 1.02/0.51 GB/ms, l_in 2000, l_out 20; params.m:66-77,
  params.m:190-232, v4:589) instead of the paper's 109/175 ms.
- ``cache_size``: s_c = 2 * 14336 * (20 + 2000) * 2 B = 0.1158 GB for every policy (v4:305-311)
  instead of 0.11 GB.
- ``fast_low_rtt``: the floor(eta J) *lowest-RTT* servers get the fast GPUs (rtt.m:137-149), not a
  random subset.
- ``orchestrator_best_connected``: the orchestrator sits at the best-connected node, the anchor
  with the lowest median RTT (rtt.m:117-121), not at a random node. Over an RTT matrix we take
  the node with the smallest median RTT to all others.
- ``synthetic_rtt``: RTT(i, j) = 0.3 med_i + 0.3 med_j + 0.01 ms/km * great-circle distance, med
  = an anchor's median measured RTT to the RIPE Atlas monitors (rtt.m:96-114), instead of our
  geodesic calibration (netem.topology). Applied where the RTT matrix is loaded.
- ``petals_block_cap``: PETALS low-end (20 GB) servers hold at most 4 blocks (v4:1247-1249).
- ``petals_fixed_cache``: PETALS servers keep a fixed cache of 2 * 14336 * 4096 * 2 B = 0.2349 GB
  per hosted block, about 2 sessions (v4:1179-1201), not all leftover memory.
- ``bprr_active_wait``: BPRR's wait estimate for a server without enough free cache is its mean
  service time (tau_c_j + tau_p_j m_j) / (sessions holding cache on it), 0 when the cache fits
  (v4:1913-1935, v4:1956-1969), instead of exponential order statistics.
- ``commit_at_arrival``: PETALS and BPRR commit each job to a route at arrival and hold its cache
  from arrival, while it waits, until it completes (v4:1485-1520, v4:2040-2058).
- ``short_runs``: 300 jobs per run from an empty system, all counted (params.m:101, v4:596-613),
  instead of 5,000 jobs with the first 5 % dropped.

Not reproduced (and why): their ``proposed`` picks c with an M/M/c heuristic (v4:735-986) where we
use the paper's c = 7 (and c* from Theorem 3.7 as a second column); their JFFC starts queued jobs
only at the next arrival (v4:1040-1067), which only hurts the proposed stack; the 70 ms initial
delay per job (params.m:90) is common to all three policies; PETALS' per-server throughputs come
from profiled RPS (v4:1267-1289), ours from tau_p/tau_c.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

AUTHORS_PREFILL_EXTRA_S = 0.050  # v4:536 overhead_delay_input
AUTHORS_HIGH_TAU_P_S = 0.001 + 5 / 156 * 2000 / 1000 + 1.32 / 1.020 * 19 / 1000  # 89.7 ms (params.m:190-232)
AUTHORS_LOW_TAU_P_S = 0.001 + 5 / 78 * 2000 / 1000 + 1.32 / 0.510 * 19 / 1000  # 178.4 ms
AUTHORS_CACHE_SIZE_GB = 2 * 14336 * (20 + 2000) * 2 / 1e9  # v4:305
AUTHORS_PETALS_LOW_BLOCK_CAP = 4  # v4:1247-1249
AUTHORS_PETALS_CACHE_GB_PER_BLOCK = 2 * 14336 * 4096 * 2 / 1e9  # v4:1186 (attn_cache_tokens 4096, fp16 K+V)
AUTHORS_JOBS_PER_RUN = 300  # params.m:101
AUTHORS_RTT_LOCAL_SHARE = 0.3  # rtt.m:108-109
AUTHORS_RTT_MS_PER_KM = 0.01  # rtt.m:99


@dataclass(frozen=True)
class AuthorsChoices:
    """Which of the authors' choices are on (all off = the paper's setup as we read it)."""

    tau_c: bool = False
    tau_p: bool = False
    cache_size: bool = False
    fast_low_rtt: bool = False
    orchestrator_best_connected: bool = False
    synthetic_rtt: bool = False
    petals_block_cap: bool = False
    petals_fixed_cache: bool = False
    bprr_active_wait: bool = False
    commit_at_arrival: bool = False
    short_runs: bool = False

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def all_on(cls) -> "AuthorsChoices":
        return cls(**{n: True for n in cls.names()})

    @classmethod
    def parse(cls, spec: str) -> "AuthorsChoices":
        """ "" -> none; "all" -> all; else comma-separated names."""
        spec = spec.strip()
        if spec == "all":
            return cls.all_on()
        names = [s.strip() for s in spec.split(",") if s.strip()]
        bad = [n for n in names if n not in cls.names()]
        if bad:
            raise ValueError(f"unknown authors' choice(s) {bad}; choose from {', '.join(cls.names())} or 'all'")
        return cls(**{n: True for n in names})

    def with_on(self, name: str) -> "AuthorsChoices":
        return replace(self, **{name: True})

    def on(self) -> tuple[str, ...]:
        return tuple(n for n in self.names() if getattr(self, n))

    @property
    def any_on(self) -> bool:
        return bool(self.on())


def authors_rtt_ms(anchor_median_rtt_ms: np.ndarray, lat_deg: np.ndarray, lon_deg: np.ndarray) -> np.ndarray:
    """rtt.m:96-114: RTT(i, j) = 0.3 med_i + 0.3 med_j + 0.01 ms/km * d(i, j); 0 on the diagonal."""
    from netem.topology import pairwise_geodesic_km

    med = np.asarray(anchor_median_rtt_ms, dtype=float)
    rtt = AUTHORS_RTT_LOCAL_SHARE * (med[:, None] + med[None, :]) + AUTHORS_RTT_MS_PER_KM * pairwise_geodesic_km(
        lat_deg, lon_deg
    )
    np.fill_diagonal(rtt, 0.0)
    return rtt


def authors_rtt_ms_from_csv(path) -> np.ndarray:
    """The authors' synthetic RTT matrix for the RIPE Atlas CSV at ``path``. med = median of the
    anchor's per-monitor median RTTs (netem.topology keeps those); the authors pool all positive
    measurements of the anchor (rtt.m:55-63)."""
    from netem.topology import load_ripe_atlas_anchors

    a = load_ripe_atlas_anchors(path)
    rtt = np.where(a.monitor_rtt_ms > 0, a.monitor_rtt_ms, np.nan)
    return authors_rtt_ms(np.nanmedian(rtt, axis=1), a.lat_deg, a.lon_deg)
