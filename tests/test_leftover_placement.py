"""Leftover-server placement (orchestrator/placement_leftover.py): never lowers the rate GBP-CR +
GCA achieve, nor raises the Theorem 3.7 lower bound; uses idle servers when they help."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from orchestrator.bounds import theorem37_bounds
from orchestrator.cache_gca import gca
from orchestrator.model import (
    chain_slot_usage,
    contended_chains,
    residual_slots,
    total_service_rate_per_s,
)
from orchestrator.placement_gbp_cr import gbp_cr, max_capacity
from orchestrator.placement_leftover import (
    TIE_REL,
    place_leftover,
    tune_c_with_leftover,
)
from orchestrator.planner import plan
from orchestrator.tuning import evaluate_c, tune_c
from tests.orchestrator_strategies import clusters, make_cluster


def test_two_small_idle_servers_form_a_third_chain():
    # Like the live case (400/400/200/200 MiB, c=4): two servers hold the whole model, two hold
    # half each; GBP-CR's 2 chains of the big ones meet the target and the small ones stay idle.
    cl = make_cluster(
        [4.4, 4.4, 2.4, 2.4],
        [0.1, 0.1, 0.1, 0.1],
        [0.1, 0.1, 0.1, 0.1],
        num_blocks=4,
        block_size=1.0,
        cache_size=0.1,
        arrival_rate=2.0,
        rho_bar=0.7,
    )
    g = gbp_cr(cl, 1)
    assert g.placement.unused_servers() == [2, 3] and g.num_chains == 2
    res = place_leftover(cl, g.placement, 1)
    assert res.placed == (2, 3) and {(r.start, r.end) for r in (res.placement.ranges[2], res.placement.ranges[3])} == {
        (0, 2),
        (2, 4),
    }
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


def _installed_rate(cluster, c):
    """nu of GBP-CR + leftover + GCA for one c, computed directly; None if GBP-CR forms no chain."""
    g = gbp_cr(cluster, c)
    if g.num_chains == 0:
        return None
    return total_service_rate_per_s(contended_chains(cluster, place_leftover(cluster, g.placement, c).gca.chains))


def test_the_live_table1_cluster_gets_the_tied_c_with_more_slots():
    # The calibrated plan of a Table 1 run (docs/results.md) (MB, s): 3 fast servers that hold all 30 blocks,
    # 6 slow ones that hold 17 at c = 1 (2 sessions) or 15 at c = 5..8 (8 sessions). At lambda = 1.04/s the
    # lower bound is the fast chains' service time for every c up to 7 (c = 1 and 5 differ by 1.6e-5);
    # tune_c takes c = 1 (30 slots after the leftover step), the tie rule c = 5 (48).
    fast, slow = (503.3, 0.603, 0.155), (251.7, 0.70, 0.334)
    servers = [fast] * 3 + [slow] * 6
    cl = make_cluster(
        [m for m, _, _ in servers],
        [t for _, t, _ in servers],
        [p for _, _, p in servers],
        num_blocks=30,
        block_size=14.16,
        cache_size=0.321,
        arrival_rate=1.042,
        rho_bar=0.7,
    )
    old = plan(cl, "proposed", c=tune_c(cl, "lower")[0].row.c, leftover=True)
    new = plan(cl, "proposed", leftover=True)
    assert old.c == 1 and sorted(ch.capacity for ch in old.chains) == [2, 2, 2, 8, 8, 8]
    assert new.c > 1 and sorted(ch.capacity for ch in new.chains) == [8] * 6
    assert new.total_rate_per_s > old.total_rate_per_s
    assert new.bounds.lower_s <= old.bounds.lower_s * (1 + TIE_REL)
    assert new.unused_servers == ()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    clusters(max_servers=6, max_blocks=5),
    st.sampled_from(["lower", "upper", "surrogate"]),
    st.sampled_from([0.0, TIE_REL, 0.1]),
)
def test_leftover_tuning_keeps_the_objective_within_the_tie_and_takes_the_widest_installed_plan(cluster, tuning, tie):
    rows = {
        c: cand.row.objective(tuning)
        for c in range(1, max_capacity(cluster) + 1)
        if (cand := evaluate_c(cluster, c)) is not None
    }
    assume(rows)
    choice, table = tune_c_with_leftover(cluster, tuning, tie)
    assert [r.c for r in table] == sorted(rows)
    best = min(rows.values())
    assert choice.objective == rows[choice.c]
    tied = [c for c, o in rows.items() if math.isinf(best) or o <= best * (1 + tie)]
    assert choice.c in tied
    rates = {c: _installed_rate(cluster, c) for c in tied}
    assert choice.rate_per_s == rates[choice.c]
    assert choice.rate_per_s >= max(rates.values())
    assert choice.c == min(c for c in tied if rates[c] == choice.rate_per_s)
    # with no tie tolerance and a unique best objective this is tune_c's c
    if tie == 0.0 and sum(o == best for o in rows.values()) == 1 and math.isfinite(best):
        assert choice.c == tune_c(cluster, tuning)[0].row.c
    # the plan `plan(..., leftover=True)` installs is this choice at the default tolerance
    if tie == TIE_REL:
        p = plan(cluster, "proposed", tuning=tuning, leftover=True)
        assert p.c == choice.c and p.placement == choice.result.placement


def test_leftover_tuning_rejects_bad_arguments():
    cl = make_cluster([4.4, 4.4], [0.1, 0.1], [0.1, 0.1], num_blocks=4)
    with pytest.raises(ValueError, match="tuning must be one of"):
        tune_c_with_leftover(cl, "fastest")
    with pytest.raises(ValueError, match="tie_rel"):
        tune_c_with_leftover(cl, "lower", -0.1)
