"""scripts/bench_speculative.py's summary: paired ratios against the plain run of the same task and
repeat, medians per task then per kind, and the identical-output check (pure: no swarm)."""

from __future__ import annotations

import importlib.util

import pytest

from petals_chain.swarm.local import REPO_ROOT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_speculative", REPO_ROOT / "scripts" / "bench_speculative.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(task, repeat, k, seconds, output_ids=(1, 2, 3), kind="repetitive", steps=64, load=1.0, relay="server"):
    return {
        "rtt_ms": 50.0,
        "relay": relay,
        "task": task,
        "kind": kind,
        "k": k,
        "schedule": "constant" if k else "plain",
        "repeat": repeat,
        "seconds": seconds,
        "decode_seconds": seconds / 2,
        "tokens": 64,
        "decode_tokens": 32,
        "chain_steps": steps,
        "drafted_tokens": 0 if k == 0 else 100,
        "accepted_draft_tokens": 64 - steps,
        "output_ids": list(output_ids),
        "loadavg_1m_before": load,
    }


def test_paired_ratios_cancel_a_load_drift_that_totals_do_not():
    bench = load_bench()
    # repeat 1 ran 5x slower for every mode alike (a load spike): the paired ratio stays 2x in both
    # repeats, while the totals mix the spike in unevenly (the slow repeat dominates the seconds)
    rows = [
        _run("a", 0, 0, 10.0),
        _run("a", 0, 4, 5.0, steps=30),
        _run("a", 1, 0, 50.0, load=9.0),
        _run("a", 1, 4, 25.0, steps=30, load=9.0),
        _run("b", 0, 0, 10.0),
        _run("b", 0, 4, 2.5, steps=20),
        _run("b", 1, 0, 10.0),
        _run("b", 1, 4, 10.0, steps=20),
    ]
    bench.mark_identical(rows)
    assert all(r["identical_to_plain"] for r in rows)
    k4 = next(s for s in bench.summarize(rows) if s["k"] == 4)
    assert k4["per_task"]["a"]["speedup_median"] == pytest.approx(2.0)
    assert k4["per_task"]["b"]["speedup_median"] == pytest.approx(2.5)  # median of 4x and 1x
    assert k4["paired_speedup_median"] == pytest.approx(2.25)
    assert (k4["paired_speedup_min"], k4["paired_speedup_max"]) == (pytest.approx(1.0), pytest.approx(4.0))
    assert k4["steps_per_token"] == pytest.approx(100 / 256) and k4["repeats"] == 2
    assert k4["loadavg_1m"] == 9.0 and k4["identical"]
    assert "| 50 ms | server | repetitive | prompt lookup constant k=4 | 2.25x (1.00-4.00)" in bench.table(
        bench.summarize(rows)
    )


def test_an_output_that_differs_from_plain_is_flagged():
    bench = load_bench()
    rows = [_run("a", 0, 0, 10.0), _run("a", 0, 4, 5.0, output_ids=(1, 2, 4))]
    bench.mark_identical(rows)
    assert [r["identical_to_plain"] for r in rows] == [True, False]
    assert not next(s for s in bench.summarize(rows) if s["k"] == 4)["identical"]


def test_each_relay_is_paired_with_its_own_plain_runs():
    bench = load_bench()
    rows = [
        _run("a", 0, 0, 10.0),
        _run("a", 0, 4, 5.0, steps=30),
        _run("a", 0, 0, 20.0, relay="client"),
        _run("a", 0, 4, 5.0, steps=30, relay="client"),
    ]
    bench.mark_identical(rows)
    by_relay = {s["relay"]: s for s in bench.summarize(rows) if s["k"] == 4}
    assert by_relay["server"]["paired_speedup_median"] == pytest.approx(2.0)
    assert by_relay["client"]["paired_speedup_median"] == pytest.approx(4.0)
    assert [s["relay"] for s in bench.summarize(rows)][0] == "server"
