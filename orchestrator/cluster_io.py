"""JSON boundary of the planner: cluster description in, plan out (schema in docs/orchestrator.md)."""

from __future__ import annotations

import math
from typing import Any

from orchestrator.model import Cluster, InvalidClusterError, Server, Service
from orchestrator.planner import Plan


def _number(d: dict, key: str, where: str) -> float:
    if key not in d:
        raise InvalidClusterError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidClusterError(f"{where}: field {key!r} must be a finite number, got {v!r}")
    return float(v)


def cluster_from_dict(d: Any) -> Cluster:
    """Parse and validate the input JSON object; raises InvalidClusterError with a fix hint."""
    if not isinstance(d, dict):
        raise InvalidClusterError("the cluster file must hold a JSON object")
    blocks = d.get("blocks")
    if "blocks" not in d:
        raise InvalidClusterError("cluster: missing field 'blocks'")
    if isinstance(blocks, bool) or not isinstance(blocks, int):
        if isinstance(blocks, float) and blocks.is_integer():
            blocks = int(blocks)
        else:
            raise InvalidClusterError(f"cluster: 'blocks' must be a positive integer, got {blocks!r}")
    service = Service(
        num_blocks=blocks,
        block_size=_number(d, "block_size", "cluster"),
        cache_size=_number(d, "cache_size", "cluster"),
    )
    servers_raw = d.get("servers")
    if not isinstance(servers_raw, list):
        raise InvalidClusterError("cluster: 'servers' must be a list of {name, memory, tau_c, tau_p} objects")
    servers = []
    for idx, s in enumerate(servers_raw):
        where = f"servers[{idx}]"
        if not isinstance(s, dict):
            raise InvalidClusterError(f"{where}: must be an object with name, memory, tau_c, tau_p")
        if "name" not in s:
            raise InvalidClusterError(f"{where}: missing field 'name'")
        rtt = _number(s, "rtt", where) if "rtt" in s else None
        overhead = _number(s, "batch_overhead", where) if "batch_overhead" in s else None
        block_overhead = _number(s, "batch_block_overhead", where) if "batch_block_overhead" in s else None
        servers.append(
            Server(
                name=str(s["name"]),
                memory=_number(s, "memory", where),
                tau_c_s=_number(s, "tau_c", where),
                tau_p_s=_number(s, "tau_p", where),
                rtt_s=rtt,
                batch_overhead_s=overhead,
                batch_block_overhead_s=block_overhead,
            )
        )
    rho_bar = _number(d, "rho_bar", "cluster") if "rho_bar" in d else 0.7
    return Cluster(
        service=service,
        servers=tuple(servers),
        arrival_rate_per_s=_number(d, "arrival_rate", "cluster"),
        rho_bar=rho_bar,
    )


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no Infinity: unstable bounds print as null


def plan_to_dict(p: Plan, cluster: Cluster, include_table: bool = False) -> dict:
    names = [s.name for s in cluster.servers]
    out: dict[str, Any] = {
        "policy": p.policy,
        "c": p.c,
        "placement": {
            names[j]: {"start": r.start, "end": r.end} for j, r in enumerate(p.placement.ranges) if r is not None
        },
        "chains": [
            {
                "servers": [names[j] for j in k.servers],
                "blocks": [[b.start, b.end] for b in k.blocks],
                "capacity": k.capacity,
                "service_time": k.service_time_s,
            }
            for k in p.chains
        ],
        "total_rate": p.total_rate_per_s,
        "bounds": {"lower": _num(p.bounds.lower_s), "upper": _num(p.bounds.upper_s)},
        "unused_servers": [names[j] for j in p.unused_servers],
        "idle_servers": [names[j] for j in p.placement.used_servers() if all(j not in k.servers for k in p.chains)],
        "stable": p.total_rate_per_s > cluster.arrival_rate_per_s,
    }
    if p.tuning is not None:
        out["tuning"] = p.tuning
    if include_table:
        out["table"] = [
            {
                "c": r.c,
                "gbp_chains": r.gbp_chains,
                "meets_target": r.meets_target,
                "surrogate": _num(r.surrogate),
                "gca_chains": r.gca_chains,
                "total_rate": r.total_rate_per_s,
                "lower": _num(r.lower_s),
                "upper": _num(r.upper_s),
            }
            for r in p.table
        ]
    return out
