"""The per-request routers' shortest path (orchestrator/baselines/request_router.py) over flattened links
equals the per-server dynamic programme it replaced: same path, ties included, for any placement and costs."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.baselines.request_router import RouteLinks, end_dp_shortest_path
from orchestrator.model import BlockInterval, Placement


def per_server_reference(placement: Placement, num_blocks: int, link_cost) -> list[int] | None:
    """The routers' former loop: servers by (end, index), each window D[start:end] + cost(j, m)."""
    used = sorted(placement.used_servers(), key=lambda j: (placement.ranges[j].end, j))
    D = np.full(num_blocks + 1, math.inf)
    D[0] = 0.0
    best, pred = [-1] * (num_blocks + 1), {}
    for j in used:
        r = placement.ranges[j]
        e_lo = np.arange(r.start, r.end)
        window = D[r.start : r.end] + link_cost(j, r.end - e_lo)
        k = int(np.argmin(window))
        if window[k] < D[r.end]:
            D[r.end], best[r.end], pred[j] = window[k], j, r.start + k
    if not math.isfinite(D[num_blocks]):
        return None
    path, e = [], num_blocks
    while e > 0:
        path.append(best[e])
        e = pred[best[e]]
    return path[::-1]


@st.composite
def placements_and_costs(draw):
    num_blocks = draw(st.integers(1, 12))
    n = draw(st.integers(1, 10))
    ranges = []
    for _ in range(n):
        if draw(st.booleans()) and ranges:
            ranges.append(None)  # a server with no blocks
            continue
        start = draw(st.integers(0, num_blocks - 1))
        ranges.append(BlockInterval(start, draw(st.integers(start + 1, num_blocks))))
    placement = Placement(tuple(ranges))
    links = RouteLinks.of(placement)
    # few distinct values (ties are where orders differ) and some missing links
    values = st.sampled_from([0.5, 1.0, 1.0, 2.0, 3.0, math.inf])
    costs = np.array(draw(st.lists(values, min_size=len(links.pair_m), max_size=len(links.pair_m))), dtype=float)
    return placement, num_blocks, links, costs


@settings(max_examples=300, deadline=None)
@given(placements_and_costs())
def test_flattened_links_give_the_per_server_programmes_path(case):
    placement, num_blocks, links, costs = case
    by_link = {(int(j), int(m)): c for j, m, c in zip(links.pair_j, links.pair_m, costs)}

    def link_cost(j, m):
        return np.array([by_link[(j, int(x))] for x in m])

    assert end_dp_shortest_path(links, num_blocks, costs) == per_server_reference(placement, num_blocks, link_cost)


def test_links_enumerate_every_start_of_every_used_server():
    placement = Placement((BlockInterval(0, 3), None, BlockInterval(2, 5), BlockInterval(0, 5)))
    links = RouteLinks.of(placement)
    assert links.order == (0, 2, 3)  # by end, then index
    assert list(links.pair_j) == [0, 0, 0, 2, 2, 2, 3, 3, 3, 3, 3]
    assert list(links.pair_m) == [3, 2, 1, 3, 2, 1, 5, 4, 3, 2, 1]
    assert list(links.pair_lo + links.pair_m) == [3] * 3 + [5] * 8
