"""Time `plan` with c* tuning on a random heterogeneous cluster (default J=200 servers, L=80 blocks).

    python scripts/bench_plan.py [--servers 200] [--blocks 80] [--tuning lower] [--seed 0] [--reference]
                                 [--incremental] [--json F]

Prints wall and CPU time (CPU time is what to compare on a shared machine). --reference also
plans with the implementation the planner replaced (per-c GBP-CR loop + networkx GCA, kept as
test oracles in tests/), checks that the plans are identical and prints the speed-up ratio.
--incremental then re-plans after one server leaves (the first server of the fastest chain) and after
one joins (a fast server), incrementally (orchestrator/replan.py:incremental: the placed servers fixed)
and whole, and prints both times and objectives (the ratio is the incremental re-plan's speed-up).
Peak memory is the process's max RSS (ru_maxrss) after everything ran.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.model import Cluster, Placement, Server, Service  # noqa: E402
from orchestrator.planner import plan  # noqa: E402
from orchestrator.replan import evaluate, incremental  # noqa: E402


def random_cluster(num_servers: int, num_blocks: int, rng: np.random.Generator, arrival_rate_per_s: float) -> Cluster:
    """Two GPU types as in §4.1.1 (40 GB / 109 ms per block, 80 GB / 30 ms), 30 % fast, RTT-like tau_c."""
    servers = []
    for j in range(num_servers):
        fast = rng.random() < 0.3
        servers.append(
            Server(
                name=f"s{j}",
                memory=80.0 if fast else 40.0,
                tau_c_s=float(rng.uniform(0.2, 1.0)),
                tau_p_s=(0.03 if fast else 0.109) * float(rng.uniform(0.9, 1.1)),
            )
        )
    return Cluster(Service(num_blocks, 1.32, 0.11), tuple(servers), arrival_rate_per_s=arrival_rate_per_s, rho_bar=0.7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=80)
    ap.add_argument("--tuning", default="lower")
    ap.add_argument("--arrival-rate", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", action="store_true", help="also time the replaced implementation and compare plans")
    ap.add_argument("--incremental", action="store_true", help="also time re-plans after one leave and one join")
    ap.add_argument(
        "--leftover",
        action="store_true",
        help="also plan with the leftover step (--leftover-placement): capacity, nu, bound, time",
    )
    ap.add_argument("--json", default=None, help="write the measurements to this file")
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
    print(
        f"J={a.servers} L={a.blocks} tuning={a.tuning}: plan took {dt:.2f} s ({cpu:.2f} s CPU); c*={p.c}, "
        f"{len(p.table)} values of c tried, {len(p.chains)} chains, nu={p.total_rate_per_s:.3f}/s, "
        f"bounds=[{p.bounds.lower_s:.2f}, {p.bounds.upper_s:.2f}] s"
    )
    out = {
        "servers": a.servers,
        "blocks": a.blocks,
        "tuning": a.tuning,
        "whole_plan_s": dt,
        "whole_plan_cpu_s": cpu,
        "c": p.c,
        "chains": len(p.chains),
        "lower_s": p.bounds.lower_s,
    }
    if a.incremental:
        out.update(churn(cluster, p, a.tuning))
    if a.leftover:
        lo, t_lo, cpu_lo = _timed(lambda: plan(cluster, "proposed", None, a.tuning, leftover=True))
        out["leftover"] = {
            "cpu_s": cpu_lo,
            "wall_s": t_lo,
            "cpu_ratio": cpu_lo / cpu,
            "c": lo.c,
            "capacity_off": sum(k.capacity for k in p.chains),
            "capacity_on": sum(k.capacity for k in lo.chains),
            "nu_off": p.total_rate_per_s,
            "nu_on": lo.total_rate_per_s,
            "lower_s_off": p.bounds.lower_s,
            "lower_s_on": lo.bounds.lower_s,
            "idle_off": len(p.unused_servers),
            "placed": len(lo.leftover_servers),
        }
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["date"] = time.strftime("%Y-%m-%d %H:%M")
    print(json.dumps(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


def _timed(f):
    t0, c0 = time.perf_counter(), time.process_time()
    r = f()
    return r, time.perf_counter() - t0, time.process_time() - c0


def churn(cluster: Cluster, p, tuning: str) -> dict:
    """One leave (the first server of the fastest chain) and one join (a fast server), each re-planned
    incrementally (the placed servers fixed) and whole."""
    out = {}
    lost = p.chains[0].servers[0]
    keep = [j for j in range(cluster.num_servers) if j != lost]
    left = replace(cluster, servers=tuple(cluster.servers[j] for j in keep))
    placed = Placement(tuple(p.placement.ranges[j] for j in keep))
    new = Server(name="joined", memory=80.0, tau_c_s=0.2, tau_p_s=0.03)
    joined = replace(cluster, servers=(*cluster.servers, new))
    placed_j = Placement((*p.placement.ranges, None))
    for name, cl, inst in (("leave", left, placed), ("join", joined, placed_j)):
        before = evaluate(cl, inst, p.c)
        inc, t_inc, cpu_inc = _timed(lambda: incremental(cl, inst, p.c))
        whole, t_whole, cpu_whole = _timed(lambda: plan(cl, "proposed", None, tuning))
        out[name] = {
            "incremental_s": t_inc,
            "incremental_cpu_s": cpu_inc,
            "whole_s": t_whole,
            "whole_cpu_s": cpu_whole,
            "cpu_speedup": cpu_whole / cpu_inc,
            "capacity_before": before.capacity,
            "capacity_incremental": inc.capacity,
            "capacity_whole": sum(k.capacity for k in whole.chains),
            "lower_s_before": before.lower_s,
            "lower_s_incremental": inc.lower_s,
            "lower_s_whole": whole.bounds.lower_s,
        }
        print(
            f"{name}: incremental {t_inc:.3f} s ({cpu_inc:.3f} s CPU), "
            f"whole {t_whole:.2f} s ({cpu_whole:.2f} s CPU); "
            f"capacity {before.capacity} -> {inc.capacity} (whole {out[name]['capacity_whole']}), lower bound "
            f"{before.lower_s:.3f} -> {inc.lower_s:.3f} s (whole {whole.bounds.lower_s:.3f} s)"
        )
    return out


if __name__ == "__main__":
    main()
