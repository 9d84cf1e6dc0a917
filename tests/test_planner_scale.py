"""The fast planner (GbpCrSweep + end-indexed GCA) gives the same plans as the per-c, networkx
implementation it replaced (tests/gbp_cr_reference.py, tests/gca_reference.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.bounds import theorem37_bounds
from orchestrator.model import Cluster, Server, Service, total_service_rate_per_s
from orchestrator.placement_gbp_cr import GbpCrSweep, gbp_cr, max_capacity
from orchestrator.planner import plan
from orchestrator.tuning import TUNINGS
from tests.gbp_cr_reference import gbp_cr_loop
from tests.gca_reference import gca_networkx
from tests.orchestrator_strategies import clusters, make_cluster


def random_cluster(rng: np.random.Generator, num_servers: int, num_blocks: int, rate: float) -> Cluster:
    """scripts/bench_plan.py's cluster family, plus a third GPU type."""
    servers = []
    for j in range(num_servers):
        kind = rng.integers(3)
        servers.append(
            Server(
                f"s{j}",
                memory=(80.0, 40.0, 20.0)[kind],
                tau_c_s=float(rng.uniform(0.2, 1.0)),
                tau_p_s=(0.03, 0.109, 0.175)[kind] * float(rng.uniform(0.9, 1.1)),
            )
        )
    return Cluster(Service(num_blocks, 1.32, 0.11), tuple(servers), arrival_rate_per_s=rate, rho_bar=0.7)


def reference_plan(cluster: Cluster, tuning: str):
    """tune_c as it was: GBP-CR per c, networkx GCA per distinct placement, Theorem 3.7 bounds."""
    best = None
    for c in range(1, max_capacity(cluster) + 1):
        g = gbp_cr_loop(cluster, c)
        if g.num_chains == 0:
            continue
        chains = gca_networkx(cluster, g.placement).chains
        b = theorem37_bounds(chains, cluster.arrival_rate_per_s)
        obj = {"lower": b.lower_s, "upper": b.upper_s, "surrogate": c * g.num_chains if g.meets_target else math.inf}[
            tuning
        ]
        rate = total_service_rate_per_s(chains)
        if best is None or (obj < best[0] if (math.isfinite(obj) or math.isfinite(best[0])) else rate > best[1]):
            best = (obj, rate, c, g.placement, chains)
    return best


def _gbp_facts(g) -> tuple:
    """Everything a GBP-CR result says, for comparing two of them field by field."""
    return (g.placement, g.chains, g.chain_times_s, g.scaled_rate_per_s, g.meets_target, g.unused_servers, g.c)


@pytest.mark.parametrize("seed", range(6))
def test_plan_identical_to_reference_on_random_clusters(seed):
    rng = np.random.default_rng(seed)
    J = int(rng.integers(20, 120))
    cluster = random_cluster(rng, J, int(rng.integers(20, 81)), rate=float(J / rng.uniform(20, 80)))
    for tuning in TUNINGS:
        p = plan(cluster, "proposed", None, tuning)
        _, _, c, placement, chains = reference_plan(cluster, tuning)
        assert (p.c, p.placement, p.chains) == (c, placement, chains)


@st.composite
def tied_clusters(draw, max_servers=10, max_blocks=6):
    """Servers drawn from two or three kinds: many share t_j / m_j, so Alg. 1's order is decided by the
    index (its tie rule)."""
    L = draw(st.integers(1, max_blocks))
    kinds = draw(
        st.lists(st.tuples(st.sampled_from([2.0, 4.0, 8.0]), st.sampled_from([0.1, 0.2])), min_size=2, max_size=3)
    )
    picks = draw(st.lists(st.integers(0, len(kinds) - 1), min_size=2, max_size=max_servers))
    mem = [kinds[k][0] for k in picks]
    tau = [kinds[k][1] for k in picks]
    lam = draw(st.floats(min_value=0.01, max_value=50.0))
    return make_cluster(mem, tau, [0.01] * len(picks), L, 1.0, 0.25, lam, 0.7)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(clusters(max_servers=8, max_blocks=6), tied_clusters()), st.integers(1, 12), st.integers(1, 3))
def test_a_lazy_sweep_in_tiny_chunks_equals_per_c_loop(cluster, c, chunk):
    """The sweep's run sorts and walks its servers only as far as a c needs (`_Run.CHUNK` at a time: a
    partition, then a sort of the smallest keys, ties included); with chunks of 1-3 servers every boundary
    is crossed, and every result still equals Alg. 1 run for that c alone (ties in t_j / m_j included)."""
    from unittest.mock import patch

    from orchestrator.placement_gbp_cr import _Run

    with patch.object(_Run, "CHUNK", chunk):
        sweep = GbpCrSweep(cluster)
        for cc in (c + 3, c, 1, c + 3, c):  # in any order, repeated
            assert _gbp_facts(sweep(cc)) == _gbp_facts(gbp_cr_loop(cluster, cc))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(max_servers=8, max_blocks=6), st.integers(1, 12))
def test_sweep_equals_per_c_loop(cluster, c):
    sweep = GbpCrSweep(cluster)
    for cc in (c, 1, c + 3, c):  # in any order, repeated
        assert _gbp_facts(sweep(cc)) == _gbp_facts(gbp_cr_loop(cluster, cc))
    assert _gbp_facts(gbp_cr(cluster, c)) == _gbp_facts(gbp_cr_loop(cluster, c))
