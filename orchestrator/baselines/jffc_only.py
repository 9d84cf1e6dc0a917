"""'JFFC only' baseline (§4.2.3): the whole model on every server that can hold it plus one
session's cache, each such server a one-server chain, dispatched by JFFC."""

from __future__ import annotations

from orchestrator.model import (
    BlockInterval,
    ChainSpec,
    Cluster,
    InfeasibleClusterError,
    Placement,
    residual_slots,
)


def jffc_only_placement(cluster: Cluster) -> Placement:
    s = cluster.service
    L = s.num_blocks
    need = L * (s.block_size + s.cache_size)
    ranges = tuple(BlockInterval(0, L) if sv.memory >= need * (1 - 1e-12) else None for sv in cluster.servers)
    placement = Placement(ranges)
    slots = residual_slots(cluster, placement)
    placement = Placement(tuple(r if r is not None and slots[j] >= L else None for j, r in enumerate(ranges)))
    if not placement.used_servers():
        raise InfeasibleClusterError(
            f"JFFC-only: no server holds the whole model plus one session "
            f"({need:.6g} in the cluster's memory unit); use another policy or add memory"
        )
    return placement


def jffc_only_chains(cluster: Cluster, placement: Placement) -> list[ChainSpec]:
    """One chain per whole-model server: capacity floor(M~_j / L), time tau_c + L tau_p (eq. 2)."""
    L = cluster.service.num_blocks
    slots = residual_slots(cluster, placement)
    chains = []
    for j in placement.used_servers():
        sv = cluster.servers[j]
        chains.append(ChainSpec((j,), (BlockInterval(0, L),), slots[j] // L, sv.tau_c_s + sv.tau_p_s * L))
    chains.sort(key=lambda k: (k.service_time_s, k.servers))
    return chains
