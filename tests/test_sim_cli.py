"""`petals-chain simulate`, the Azure trace loader and a smoke run of scripts/reproduce_paper.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from netem.topology import (
    AZURE_CODE_TRACE_FILENAME,
    DATA_ENV_VAR,
    DataNotFoundError,
    resolve_data_file,
)
from orchestrator.sim.cli import main

REPO = Path(__file__).resolve().parents[1]
CLUSTER = {
    "blocks": 8,
    "block_size": 1.0,
    "cache_size": 0.1,
    "arrival_rate": 0.5,
    "rho_bar": 0.7,
    "servers": [
        {"name": f"s{i}", "memory": 10.0 if i < 2 else 6.0, "tau_c": 0.05, "tau_p": 0.1 + 0.02 * i} for i in range(5)
    ],
}


def _run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_simulate_cluster_json(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(CLUSTER))
    rc, out, err = _run(["--cluster", str(path), "--jobs", "2000", "--seed", "3"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    assert data["policy"] == "proposed" and data["n_jobs"] == 2000 and data["mean_response_s"] > 0
    rc2, out2, _ = _run(["--cluster", str(path), "--jobs", "2000", "--seed", "3"], capsys)
    data2 = json.loads(out2)
    assert data2["mean_response_s"] == data["mean_response_s"]  # deterministic for a seed
    for policy in ("petals", "bprr"):
        rc, out, err = _run(["--cluster", str(path), "--jobs", "300", "--policy", policy], capsys)
        assert rc == 0, err and json.loads(out)["policy"] == policy


def test_simulate_paper_setup_synthetic(capsys):
    rc, out, err = _run(
        [
            "--paper-setup",
            "10",
            "0.3",
            "--synthetic-rtt",
            "--jobs",
            "1000",
            "--dispatch",
            "sed",
            "--job-sizes",
            "lognormal:2",
        ],
        capsys,
    )
    assert rc == 0, err
    data = json.loads(out)
    assert data["rtt_source"] == "synthetic" and data["dispatch"] == "sed" and data["job_sizes"] == "lognormal:2"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--cluster", "/nonexistent.json"], "cannot read"),
        (["--paper-setup", "10", "x", "--synthetic-rtt"], "--paper-setup"),
        (["--paper-setup", "10", "0.2", "--jobs", "0", "--synthetic-rtt"], "--jobs"),
        (["--paper-setup", "10", "0.2", "--policy", "nope"], "--policy"),
        (["--paper-setup", "10", "0.2", "--synthetic-rtt", "--job-sizes", "weird"], "--job-sizes"),
        ([], "required"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, needle, capsys):
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_bad_cluster_is_one_line_exit_2(tmp_path, capsys):
    bad = dict(CLUSTER, servers=[{"name": "x", "memory": 1.0, "tau_c": 0.1, "tau_p": 0.1}])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    rc, out, err = _run(["--cluster", str(path)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    path.write_text("{not json")
    rc, out, err = _run(["--cluster", str(path)], capsys)
    assert rc == 2 and "not valid JSON" in err


def test_azure_trace_loader():
    try:
        path = resolve_data_file(AZURE_CODE_TRACE_FILENAME)
    except DataNotFoundError as exc:
        pytest.skip(f"Azure trace absent ({exc}); set ${DATA_ENV_VAR} to the shared data folder")
    from orchestrator.sim.traces import load_azure_trace, trace_workload

    trace = load_azure_trace(path)
    assert len(trace.arrival_s) == 8819 and trace.arrival_s[0] == 0.0
    assert trace.mean_rate_per_s == pytest.approx(2.57, rel=0.02)
    arrivals, sizes = trace_workload(trace, target_rate_per_s=0.2)
    assert np.all(np.diff(arrivals) >= 0) and sizes.mean() == pytest.approx(1.0)
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(0.2, rel=1e-6)


def _run_script(name: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """scripts/<name> with `args`, from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )


def test_reproduce_paper_smoke(tmp_path):
    out = tmp_path / "paper"
    proc = _run_script(
        "reproduce_paper.py",
        *("--runs", "1", "--workers", "1", "--synthetic-rtt", "--only", "fig3,fig4,fig67", "--out", str(out)),
        timeout_s=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {"fig3", "fig4", "fig67"} <= summary.keys()
    assert (out / "fig3_gbp_cr.png").stat().st_size > 0 and (out / "summary.md").exists()


@pytest.mark.integration
def test_reproduce_paper_fig8_schema(tmp_path):
    out = tmp_path / "paper"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "reproduce_paper.py"),
            "--quick",
            "--runs",
            "1",
            "--workers",
            "1",
            "--synthetic-rtt",
            "--only",
            "fig8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads((out / "summary.json").read_text())["fig8"]
    assert {(r["J"], r["eta"]) for r in records} == {(J, e) for J in (10, 20, 30, 40) for e in (0.1, 0.2, 0.3, 0.4)}
    for r in records:
        assert {"J", "eta", "policy", "mean_response_s"} <= r.keys() and r["policy"] in ("proposed", "petals", "bprr")


def _reproduce(args, out, timeout):
    return subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "reproduce_paper.py"),
            *args,
            "--workers",
            "1",
            "--synthetic-rtt",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_reproduce_paper_authors_setup_fig8(tmp_path):
    out = tmp_path / "authors"
    proc = _reproduce(["--setup", "authors", "--quick", "--runs", "1", "--only", "fig8"], out, 240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["setup"] == "authors" and "short_runs" in summary["authors_choices"]
    assert {(r["J"], r["eta"]) for r in summary["fig8"]} == {
        (J, e) for J in (10, 20, 30, 40) for e in (0.1, 0.2, 0.3, 0.4)
    }
    bad = _reproduce(["--authors-choices", "tau_c,bogus", "--only", "fig8"], tmp_path / "bad", 60)
    assert bad.returncode == 2 and "bogus" in bad.stderr


@pytest.mark.integration
def test_reproduce_paper_authors_quick_runs_in_ci_time(tmp_path):
    """The command docs/results.md gives for the authors' setup, as CI runs it."""
    proc = _reproduce(["--setup", "authors", "--quick"], tmp_path / "q", 600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "q" / "summary.json").read_text())
    assert summary["setup"] == "authors" and {"fig3", "fig4", "fig5", "fig67", "fig8", "fig8x"} <= summary.keys()


def test_simulate_setup_flags(capsys):
    rc, out, err = _run(
        ["--paper-setup", "10", "0.3", "--synthetic-rtt", "--setup", "authors", "--policy", "petals"], capsys
    )
    assert rc == 0, err
    data = json.loads(out)
    assert data["setup"] == "authors" and data["n_jobs"] == 300 and data["tau_c_reading"] == "model"
    rc, out, err = _run(
        ["--paper-setup", "10", "0.3", "--synthetic-rtt", "--tau-c", "literal", "--jobs", "500"], capsys
    )
    assert rc == 0 and json.loads(out)["tau_c_reading"] == "literal"
    rc, out, err = _run(["--paper-setup", "10", "0.3", "--synthetic-rtt", "--authors-choices", "nope"], capsys)
    assert rc == 2 and "nope" in err


def test_sim_prefix_dispatch_counts_the_goals_over_seeds(tmp_path):
    """A small run of scripts/sim_prefix_dispatch.py with --goal-seeds: each seed's goals, and the count of
    seeds meeting each target agrees with them."""
    try:
        resolve_data_file(AZURE_CODE_TRACE_FILENAME)
    except DataNotFoundError as exc:
        pytest.skip(f"Azure trace absent ({exc}); set ${DATA_ENV_VAR} to the shared data folder")
    out = tmp_path / "sim"
    argv = ["--chains", "4", "--rhos", "0.6", "--fig7-rhos", "4.0", "--requests", "120", "--workers", "1"]
    proc = _run_script("sim_prefix_dispatch.py", *argv, "--goal-seeds", "0", "1", "--out", str(out), timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    by_seed = summary["goals_by_seed"]
    assert set(by_seed) == {"0", "1"} and by_seed["0"] == summary["goals"]
    assert by_seed["0"]["e2_over_jffc_mean"] != by_seed["1"]["e2_over_jffc_mean"]  # other prompts, other result
    mean_met = sum(g["e2_over_jffc_mean"] <= 0.5 for g in by_seed.values())
    thr_met = sum(g["next_to_a_flooder_by_rho"]["4.0"]["d2lpm_over_vtc_rr_throughput"] >= 1.5 for g in by_seed.values())
    assert summary["goals_met_in_seeds"]["e2_over_jffc_mean"] == f"{mean_met} of 2"
    assert summary["goals_met_in_seeds"]["d2lpm_over_vtc_rr_throughput (rho 4.0)"] == f"{thr_met} of 2"
