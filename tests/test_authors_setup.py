"""tau_c shared by the simulator and the online orchestrator; each of the authors' choices
(orchestrator/sim/authors_setup.py) changes what it should, and only that."""

from __future__ import annotations

import math

import numpy as np
import pytest

import orchestrator.service.measurements as measurements
import orchestrator.service.registry as registry
import orchestrator.sim.paper_setup as paper_setup
from netem.topology import synthetic_rtt_ms
from orchestrator.baselines.options import BaselineOptions
from orchestrator.baselines.petals import PetalsRouter
from orchestrator.model import BlockInterval, Placement
from orchestrator.planner import make_baseline_router, plan
from orchestrator.session_times import SessionShape, tau_c_s
from orchestrator.sim import authors_setup as au
from orchestrator.sim.authors_setup import AuthorsChoices, authors_rtt_ms
from orchestrator.sim.paper_experiments import PaperConfig, baseline_options, fig8_run
from orchestrator.sim.paper_setup import draw_paper_instance, paper_tau_c_s, to_cluster
from tests.orchestrator_strategies import make_cluster


def test_one_tau_c_function_for_simulator_and_online_orchestrator():
    assert registry.tau_c_s is tau_c_s and paper_setup.tau_c_s is tau_c_s
    assert measurements.SessionShape is SessionShape
    assert paper_tau_c_s(0.030) == pytest.approx(20 * (0.030 + 0.018))  # model: 20 round trips
    assert paper_tau_c_s(0.030, "literal") == pytest.approx(0.048)  # one round trip
    assert paper_tau_c_s(0.030, authors=True) == pytest.approx(0.030 + 0.050 + 19 * 0.030)  # v4:663
    with pytest.raises(ValueError, match="reading"):
        paper_tau_c_s(0.03, "bogus")


def test_tau_c_reading_only_changes_tau_c():
    rtt = synthetic_rtt_ms(40, np.random.default_rng(0))
    a = draw_paper_instance(rtt, 20, 0.2, np.random.default_rng(5))
    b = draw_paper_instance(rtt, 20, 0.2, np.random.default_rng(5), tau_c_reading="literal")
    assert np.array_equal(a.rtt_s, b.rtt_s) and np.array_equal(a.is_high, b.is_high)
    assert np.allclose(a.tau_c_s, 20 * b.tau_c_s)


def _draw(choice: str | None, rtt=None, seed=5):
    rtt = synthetic_rtt_ms(60, np.random.default_rng(0)) if rtt is None else rtt
    authors = AuthorsChoices() if choice is None else AuthorsChoices().with_on(choice)
    return draw_paper_instance(rtt, 20, 0.2, np.random.default_rng(seed), authors=authors)


def test_instance_choices():
    base = _draw(None)
    tp = _draw("tau_p")
    assert set(np.round(tp.tau_p_s * 1000, 1)) == {89.7, 178.4} and np.array_equal(tp.is_high, base.is_high)
    assert np.array_equal(tp.tau_c_s, base.tau_c_s)
    assert _draw("cache_size").cache_size_gb == pytest.approx(0.1158, abs=1e-4) and base.cache_size_gb == 0.11
    tc = _draw("tau_c")
    assert np.allclose(tc.tau_c_s, 20 * tc.rtt_s + 0.05)
    fast = _draw("fast_low_rtt")
    assert fast.is_high.sum() == 4 and fast.rtt_s[fast.is_high].max() <= fast.rtt_s[~fast.is_high].min()
    # best-connected orchestrator: node 7 has a 1 ms RTT to everyone, all others >= 40 ms
    rtt = 40 + synthetic_rtt_ms(60, np.random.default_rng(1))
    rtt[7, :] = rtt[:, 7] = 1.0
    np.fill_diagonal(rtt, 0.0)
    for seed in range(3):
        assert np.allclose(_draw("orchestrator_best_connected", rtt, seed).rtt_s, 0.001)
        assert not np.allclose(_draw(None, rtt, seed).rtt_s, 0.001)


def test_authors_rtt_formula():
    med = np.array([10.0, 20.0, 30.0])
    lat, lon = np.array([50.0, 50.0, 40.0]), np.array([10.0, 10.0, 10.0])
    r = authors_rtt_ms(med, lat, lon)
    assert r[0, 0] == 0 and r[0, 1] == pytest.approx(0.3 * 10 + 0.3 * 20)  # same place: local delays only
    assert r[0, 2] == pytest.approx(0.3 * 40 + 0.01 * 1111.95, rel=1e-3)  # 10 degrees of latitude
    assert np.allclose(r, r.T)


def test_petals_block_cap_and_fixed_cache():
    inst = _draw(None)
    cluster = to_cluster(inst)
    capped = plan(cluster, "petals", baseline=baseline_options(AuthorsChoices(petals_block_cap=True), inst.is_high))
    free = plan(cluster, "petals")
    low = np.flatnonzero(~inst.is_high)
    assert max(capped.placement.num_blocks(j) for j in low) == 4 < max(free.placement.num_blocks(j) for j in low)
    assert capped.placement.num_blocks(int(np.flatnonzero(inst.is_high)[0])) == free.placement.num_blocks(
        int(np.flatnonzero(inst.is_high)[0])
    )
    opts = baseline_options(AuthorsChoices(petals_fixed_cache=True), inst.is_high)
    r = make_baseline_router("petals", cluster, free.placement, options=opts)
    plain = make_baseline_router("petals", cluster, free.placement)
    assert isinstance(r, PetalsRouter)
    for j in free.placement.used_servers():
        m = free.placement.num_blocks(j)
        assert (
            r.total_slots[j]
            == math.floor(m * au.AUTHORS_PETALS_CACHE_GB_PER_BLOCK / 0.11 + 1e-9)
            < plain.total_slots[j]
        )


def single_block_pair():
    cl = make_cluster([1.1, 1.1], [0.1, 0.5], [0.1, 0.5], num_blocks=1)
    return cl, Placement((BlockInterval(0, 1), BlockInterval(0, 1)))


def test_bprr_active_mean_wait():
    cl, p = single_block_pair()
    r = make_baseline_router("bprr", cl, p, options=BaselineOptions(bprr_wait="active-mean"))
    assert r.route(r.on_arrival(0)[0].chain_id).servers == (0,)
    wait = r._expected_wait_s()  # per link of r.links

    def one_block_link(j):
        return int(np.flatnonzero((r.links.pair_j == j) & (r.links.pair_m == 1))[0])

    assert wait[one_block_link(0)] == pytest.approx(0.2 / 1)  # (tau_c + tau_p m_j) / 1 holder
    assert wait[one_block_link(1)] == 0.0  # cache fits
    assert r.on_arrival(1) == []  # 0.2 + 0.2 < B's 1.0: waits for A, as the default estimate does


def test_commit_at_arrival_holds_cache_while_waiting():
    cl, p = single_block_pair()
    r = make_baseline_router("petals", cl, p, options=BaselineOptions(commit_at_arrival=True))
    r.on_arrival(0)  # A
    r.on_arrival(1)  # B
    assert r.on_arrival(2) == [] and r.queue_length == 1
    waiting_server = r.route(r._waiting[0][1]).servers[0]
    assert r.free_slots[waiting_server] == -1  # held while waiting
    assert r.holders_on[waiting_server] == 2
    plain = make_baseline_router("petals", cl, p)
    for i in range(3):
        plain.on_arrival(i)
    assert min(plain.free_slots) == 0  # without commit a waiting job holds nothing
    assert waiting_server == 0  # both full: job 2 waits on the fast server A
    assert r.on_arrival(3) == [] and r.free_slots[0] == -2  # job 3 also waits on A, behind job 2
    started = r.on_completion(0)  # A frees one slot: only job 2 (the earlier holder) fits
    assert [s.job_id for s in started] == [2] and r.queue_length == 1
    assert [s.job_id for s in r.on_completion(2)] == [3]


def test_short_runs_and_parse():
    assert AuthorsChoices.parse("all") == AuthorsChoices.all_on()
    assert AuthorsChoices.parse("tau_c, short_runs").on() == ("tau_c", "short_runs")
    with pytest.raises(ValueError, match="unknown"):
        AuthorsChoices.parse("tau_c,nope")
    rtt = synthetic_rtt_ms(60, np.random.default_rng(0))
    cfg = PaperConfig(runs=1, fig8_jobs=400, authors=AuthorsChoices(short_runs=True))
    out = fig8_run(rtt, 0, cfg, 10, 0.3)
    assert out["proposed"]["feasible"] and out["n_jobs"] == au.AUTHORS_JOBS_PER_RUN == 300
    assert fig8_run(rtt, 0, PaperConfig(runs=1, fig8_jobs=400), 10, 0.3)["n_jobs"] == 400
