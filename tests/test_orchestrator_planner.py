import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.baselines.request_router import PerRequestRouter
from orchestrator.cluster_io import cluster_from_dict
from orchestrator.dispatch import JffcDispatcher
from orchestrator.model import InfeasibleClusterError, chain_slot_usage, residual_slots
from orchestrator.plan_cli import main
from orchestrator.planner import POLICIES, make_plan_dispatcher, plan
from orchestrator.tuning import tune_c
from tests.orchestrator_strategies import clusters, fig1_cluster, make_cluster, simulate

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cluster.json"


def test_tuning_picks_the_minimum_of_each_objective():
    cl = fig1_cluster(L=4, lam=1.0)
    for tuning in ("lower", "upper", "surrogate"):
        best, table = tune_c(cl, tuning)
        values = [r.objective(tuning) for r in table]
        assert best.row.objective(tuning) == min(values)
        assert best.row.c == min(r.c for r in table if r.objective(tuning) == min(values))  # ties: smaller c
    surrogate = {r.c: r.surrogate for r in table}
    assert surrogate[1] == 1 * next(r.gbp_chains for r in table if r.c == 1)


def test_fig1_regimes_in_tuning():
    """Fig. 1: light load prefers short chains (c=1); heavy load needs the long chain's capacity."""
    light = plan(fig1_cluster(L=4, tau_c=1.0, tau_p=0.2, lam=0.05))
    assert light.c < 4 and all(len(k.servers) == 1 for k in light.chains)
    # nu(1) = 4 / 1.8 = 2.2 < lambda = 2.5 < nu(16) = 4 * 16 / 4.8: only long chains are stable
    heavy = plan(fig1_cluster(L=4, tau_c=1.0, tau_p=0.2, lam=2.5))
    assert math.isfinite(heavy.bounds.lower_s) and heavy.total_rate_per_s > 2.5
    assert max(len(k.servers) for k in heavy.chains) > 1


def test_fixed_c_and_infeasible_c():
    cl = fig1_cluster(L=4, lam=1.0)
    p = plan(cl, c=16)
    assert p.c == 16 and len(p.chains) == 1 and p.chains[0].capacity == 16
    with pytest.raises(InfeasibleClusterError, match="lower c"):
        plan(cl, c=10_000)
    with pytest.raises(ValueError):
        plan(cl, policy="nope")


def test_infeasible_cluster_for_every_policy():
    cl = make_cluster([1.0, 1.0], [1.0, 1.0], [0.1, 0.1], num_blocks=5)
    for policy in POLICIES:
        with pytest.raises(InfeasibleClusterError):
            plan(cl, policy)


def _check_plan(cluster, p):
    L = cluster.service.num_blocks
    slots = residual_slots(cluster, p.placement)
    for j, r in enumerate(p.placement.ranges):
        if r is not None:  # blocks fit in memory
            assert r.num_blocks * cluster.service.block_size <= cluster.servers[j].memory + 1e-9
            assert 0 <= r.start < r.end <= L
    for k in p.chains:
        assert isinstance(k.capacity, int) and k.capacity >= 1
        assert [b.start for b in k.blocks][0] == 0 and k.blocks[-1].end == L
        assert all(a.end == b.start for a, b in zip(k.blocks, k.blocks[1:]))
    assert all(u <= s for u, s in zip(chain_slot_usage(p.chains, cluster.num_servers), slots))
    assert p.bounds.lower_s <= p.bounds.upper_s
    assert set(p.unused_servers) == set(p.placement.unused_servers())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    clusters(max_servers=7, max_blocks=6), st.sampled_from(POLICIES), st.sampled_from(["lower", "upper", "surrogate"])
)
def test_plans_on_random_clusters_are_valid(cluster, policy, tuning):
    try:
        p = plan(cluster, policy, tuning=tuning)
    except InfeasibleClusterError:
        return
    _check_plan(cluster, p)
    d = make_plan_dispatcher(p, cluster, np.random.default_rng(0))
    assert isinstance(d, PerRequestRouter if policy in ("petals", "bprr") else JffcDispatcher)
    starts = d.on_arrival(0)
    assert len(starts) == 1 and d.on_completion(0) == []


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_example(capsys):
    code, out, err = run_cli(["--cluster", str(EXAMPLE), "--table"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert {"c", "placement", "chains", "total_rate", "bounds", "table"} <= set(d)
    raw = json.loads(EXAMPLE.read_text())
    names = {s["name"] for s in raw["servers"]}
    assert set(d["placement"]) <= names
    for k in d["chains"]:
        assert set(k["servers"]) <= set(d["placement"]) and k["capacity"] >= 1 and k["service_time"] > 0
    assert d["bounds"]["lower"] <= d["bounds"]["upper"]
    in_chains = {s for k in d["chains"] for s in k["servers"]}
    assert set(d["idle_servers"]) == set(d["placement"]) - in_chains
    assert set(d["unused_servers"]) == names - set(d["placement"])
    assert len(d["table"]) >= 1 and any(r["c"] == d["c"] for r in d["table"])
    assert d["total_rate"] == pytest.approx(sum(k["capacity"] / k["service_time"] for k in d["chains"]))


@pytest.mark.parametrize("policy", POLICIES)
def test_cli_policies_and_fixed_c(policy, capsys):
    code, out, err = run_cli(["--cluster", str(EXAMPLE), "--policy", policy, "--c", "3", "--tuning", "upper"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["policy"] == policy and d["chains"]
    if policy == "proposed":
        assert d["c"] == 3


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.pop("blocks"), "missing field 'blocks'"),
        (lambda d: d["servers"][0].__setitem__("memory", -4), "memory"),
        (lambda d: d["servers"][1].pop("tau_p"), "missing field 'tau_p'"),
        (lambda d: d.__setitem__("arrival_rate", "fast"), "arrival_rate"),
        (lambda d: [s.__setitem__("memory", 1.0) for s in d["servers"]], "add servers or memory"),
    ],
)
def test_cli_bad_input_exit_2(tmp_path, capsys, mutate, needle):
    raw = json.loads(EXAMPLE.read_text())
    mutate(raw)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(raw))
    code, out, err = run_cli(["--cluster", str(f)], capsys)
    assert code == 2 and out == ""
    assert needle in err and len(err.strip().splitlines()) == 1


def test_cli_unreadable_and_bad_args(tmp_path, capsys):
    code, _, err = run_cli(["--cluster", str(tmp_path / "missing.json")], capsys)
    assert code == 2 and "cannot read" in err
    (tmp_path / "x.json").write_text("{not json")
    code, _, err = run_cli(["--cluster", str(tmp_path / "x.json")], capsys)
    assert code == 2 and "not valid JSON" in err
    code, _, _ = run_cli(["--cluster", str(EXAMPLE), "--c", "0"], capsys)
    assert code == 2


def test_umbrella_cli_dispatches_plan(capsys):
    from petals_chain.cli.main import main as umbrella

    assert umbrella(["plan", "--cluster", str(EXAMPLE), "--c", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["c"] == 2


def test_cli_leftover_placement_gives_the_idle_servers_blocks_as_the_api_does(capsys):
    code, out, _ = run_cli(["--cluster", str(EXAMPLE)], capsys)
    assert code == 0
    alone = json.loads(out)
    code, out, _ = run_cli(["--cluster", str(EXAMPLE), "--leftover-placement"], capsys)
    assert code == 0
    both = json.loads(out)
    assert alone["unused_servers"]  # the example leaves servers idle under GBP-CR alone
    cluster = cluster_from_dict(json.loads(EXAMPLE.read_text()))
    api = plan(cluster, "proposed", leftover=True)
    assert both["unused_servers"] == [cluster.servers[j].name for j in api.unused_servers]
    assert len(both["chains"]) == len(api.chains) > len(alone["chains"])


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_runs_the_example_to_completion(policy):
    cluster = cluster_from_dict(json.loads(EXAMPLE.read_text()))
    p = plan(cluster, policy)
    d = make_plan_dispatcher(p, cluster, np.random.default_rng(0))
    mean = simulate(d, 2.0, 1500, np.random.default_rng(1))
    fastest = min(k.service_time_s for k in p.chains)
    assert mean > 0.5 * fastest and d.queue_length == 0


@pytest.mark.parametrize("L", [3, 4, 6])
def test_fig1_service_rates_after_gca(L):
    """Fig. 1: c=1 gives L chains of capacity 1 (nu = L / (tau_c + L tau_p)); c=L^2 one chain of
    capacity L^2 (nu = L / (tau_c + tau_p))."""
    cl = fig1_cluster(L, tau_c=1.0, tau_p=0.2, lam=1000.0)
    short = plan(cl, c=1)
    assert [k.capacity for k in short.chains] == [1] * L
    assert short.total_rate_per_s == pytest.approx(L / (1.0 + L * 0.2))
    long = plan(cl, c=L * L)
    assert [(len(k.servers), k.capacity) for k in long.chains] == [(L, L * L)]
    assert long.total_rate_per_s == pytest.approx(L / (1.0 + 0.2))
