"""Leftover-server placement (orchestrator/placement_leftover.py): never lowers the rate GBP-CR +
GCA achieve, nor raises the Theorem 3.7 lower bound; uses idle servers when they help."""
from __future__ import annotations

import math

from hypothesis import HealthCheck, assume, given, settings, strategies as st

from orchestrator.bounds import theorem37_bounds
from orchestrator.cache_gca import gca
from orchestrator.model import chain_slot_usage, residual_slots, total_service_rate_per_s
from orchestrator.placement_gbp_cr import gbp_cr
from orchestrator.placement_leftover import place_leftover
from orchestrator.planner import plan
from tests.orchestrator_strategies import clusters, make_cluster


def test_two_small_idle_servers_form_a_third_chain():
    # Like the live case (400/400/200/200 MiB, c=4): two servers hold the whole model, two hold
    # half each; GBP-CR's 2 chains of the big ones meet the target and the small ones stay idle.
    cl = make_cluster([4.4, 4.4, 2.4, 2.4], [0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1], num_blocks=4,
                      block_size=1.0, cache_size=0.1, arrival_rate=2.0, rho_bar=0.7)
    g = gbp_cr(cl, 1)
    assert g.placement.unused_servers() == [2, 3] and g.num_chains == 2
    res = place_leftover(cl, g.placement, 1)
    assert res.placed == (2, 3) and {(r.start, r.end) for r in (res.placement.ranges[2], res.placement.ranges[3])} == {(0, 2), (2, 4)}
    before = total_service_rate_per_s(gca(cl, g.placement).chains)
    assert total_service_rate_per_s(res.gca.chains) > before
    p = plan(cl, "proposed", c=1, leftover=True)
    assert p.unused_servers == () and p.leftover_servers == (2, 3)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_servers=8, max_blocks=6), st.integers(1, 8))
def test_never_lowers_gca_rate_nor_raises_the_lower_bound(cluster, c):
    g = gbp_cr(cluster, c)
    assume(g.num_chains > 0)
    base = gca(cluster, g.placement)
    res = place_leftover(cluster, g.placement, c)
    nu0, nu1 = total_service_rate_per_s(base.chains), total_service_rate_per_s(res.gca.chains)
    assert nu1 >= nu0 * (1 - 1e-12)
    lam = cluster.arrival_rate_per_s
    b0, b1 = theorem37_bounds(base.chains, lam).lower_s, theorem37_bounds(res.gca.chains, lam).lower_s
    assert b1 <= b0 * (1 + 1e-12) or (math.isinf(b0) and math.isinf(b1))
    # GBP-CR's servers keep their ranges; only idle ones get new ones; memory is never over-committed
    for j, r in enumerate(g.placement.ranges):
        assert res.placement.ranges[j] == r or (r is None and j in res.placed)
    used = chain_slot_usage(res.gca.chains, cluster.num_servers)
    assert all(u <= s for u, s in zip(used, residual_slots(cluster, res.placement)))
    assert set(res.placed) | set(res.rejected) <= set(g.placement.unused_servers())
