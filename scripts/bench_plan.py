"""Time `plan` with c* tuning on a random heterogeneous cluster (default J=200 servers, L=80 blocks).

    python scripts/bench_plan.py [--servers 200] [--blocks 80] [--tuning lower] [--seed 0] [--reference]

Prints wall and CPU time (CPU time is what to compare on a shared machine). --reference also
plans with the implementation the planner replaced (per-c GBP-CR loop + networkx GCA, kept as
test oracles in tests/), checks that the plans are identical and prints the speed-up ratio.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.model import Cluster, Server, Service  # noqa: E402
from orchestrator.planner import plan  # noqa: E402


def random_cluster(num_servers: int, num_blocks: int, rng: np.random.Generator, arrival_rate_per_s: float) -> Cluster:
    """Two GPU types as in §4.1.1 (40 GB / 109 ms per block, 80 GB / 30 ms), 30 % fast, RTT-like tau_c."""
    servers = []
    for j in range(num_servers):
        fast = rng.random() < 0.3
        servers.append(Server(name=f"s{j}", memory=80.0 if fast else 40.0,
                              tau_c_s=float(rng.uniform(0.2, 1.0)),
                              tau_p_s=(0.03 if fast else 0.109) * float(rng.uniform(0.9, 1.1))))
    return Cluster(Service(num_blocks, 1.32, 0.11), tuple(servers), arrival_rate_per_s=arrival_rate_per_s, rho_bar=0.7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=80)
    ap.add_argument("--tuning", default="lower")
    ap.add_argument("--arrival-rate", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", action="store_true", help="also time the replaced implementation and compare plans")
    a = ap.parse_args()
    cluster = random_cluster(a.servers, a.blocks, np.random.default_rng(a.seed), a.arrival_rate)
    t0, c0 = time.perf_counter(), time.process_time()
    p = plan(cluster, "proposed", None, a.tuning)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if a.reference:
        from tests.test_planner_scale import reference_plan

        r0 = time.process_time()
        _, _, c, placement, chains = reference_plan(cluster, a.tuning)
        ref_cpu = time.process_time() - r0
        same = (p.c, p.placement, p.chains) == (c, placement, chains)
        print(f"reference: {ref_cpu:.2f} s CPU; plans identical: {same}; speed-up {ref_cpu / cpu:.1f}x")
    print(f"J={a.servers} L={a.blocks} tuning={a.tuning}: plan took {dt:.2f} s ({cpu:.2f} s CPU); c*={p.c}, "
          f"{len(p.table)} values of c tried, {len(p.chains)} chains, nu={p.total_rate_per_s:.3f}/s, "
          f"bounds=[{p.bounds.lower_s:.2f}, {p.bounds.upper_s:.2f}] s")


if __name__ == "__main__":
    main()
