"""Test oracle: GCA (Alg. 2) read literally, networkx Dijkstra on G^{(l-1)} = (J_+, E^{(l-1)}).

The planner's orchestrator.cache_gca.gca runs the same algorithm as an end-indexed dynamic program;
tests check the two agree. This was the production implementation before the planner was made
fast enough for 10,000 servers (issue 12).
"""

from __future__ import annotations

import networkx as nx

from orchestrator.cache_gca import GcaResult, _allocate
from orchestrator.model import (
    SINK,
    SOURCE,
    ChainSpec,
    Cluster,
    Placement,
    link_time_s,
    residual_slots,
    routing_links,
)


def gca_networkx(cluster: Cluster, placement: Placement, residual: list[int] | None = None) -> GcaResult:
    """Alg. 2 literally, with networkx Dijkstra on G^{(l-1)} = (J_+, E^{(l-1)}).

    ``residual`` overrides the starting slots M^{(0)}_j (default M~_j of eq. 3)."""
    M = list(residual_slots(cluster, placement) if residual is None else residual)
    g = nx.DiGraph()
    g.add_nodes_from([SOURCE, SINK])
    for i, j, m_ij in routing_links(placement, cluster.service.num_blocks):
        if j == SINK:
            g.add_edge(i, j, weight=0.0, m=0)
        elif M[j] >= m_ij:  # line 2
            g.add_edge(i, j, weight=link_time_s(cluster.servers[j], m_ij), m=m_ij)
    chains: list[ChainSpec] = []
    while True:
        try:
            nodes = nx.dijkstra_path(g, SOURCE, SINK, weight="weight")  # line 5
        except nx.NetworkXNoPath:  # line 4: j_0 no longer connected to j_{J+1}
            break
        path = nodes[1:-1]
        chain = _allocate(cluster, placement, path, M)  # lines 6-8
        chains.append(chain)
        for j in set(path):  # lines 9-12, for every link into a touched server
            for i in list(g.predecessors(j)):
                if M[j] < g.edges[i, j]["m"]:
                    g.remove_edge(i, j)
    return GcaResult(chains=tuple(chains), residual_slots_after=tuple(M))
