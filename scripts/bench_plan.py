"""Time `plan` with c* tuning on a random heterogeneous cluster (default J=200 servers, L=80 blocks).

    python scripts/bench_plan.py [--servers 200] [--blocks 80] [--tuning lower] [--seed 0]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from orchestrator.model import Cluster, Server, Service
from orchestrator.planner import plan


def random_cluster(num_servers: int, num_blocks: int, rng: np.random.Generator, arrival_rate_per_s: float) -> Cluster:
    """Two GPU types as in §4.1.1 (40 GB / 109 ms per block, 80 GB / 30 ms), 30 % fast, RTT-like tau_c."""
    servers = []
    for j in range(num_servers):
        fast = rng.random() < 0.3
        servers.append(Server(name=f"s{j}", memory_gb=80.0 if fast else 40.0,
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
    a = ap.parse_args()
    cluster = random_cluster(a.servers, a.blocks, np.random.default_rng(a.seed), a.arrival_rate)
    t0 = time.perf_counter()
    p = plan(cluster, "proposed", None, a.tuning)
    dt = time.perf_counter() - t0
    print(f"J={a.servers} L={a.blocks} tuning={a.tuning}: plan took {dt:.2f} s; c*={p.c}, "
          f"{len(p.table)} values of c tried, {len(p.chains)} chains, nu={p.total_rate_per_s:.3f}/s, "
          f"bounds=[{p.bounds.lower_s:.2f}, {p.bounds.upper_s:.2f}] s")


if __name__ == "__main__":
    main()
