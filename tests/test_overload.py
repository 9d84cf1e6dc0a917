"""Overload (scripts/overload.py): twice the swarm's capacity in concurrent sessions, for many turnovers.

No chain holds more sessions than its capacity, no server's memory accounting ever exceeds its
budget (and the budget really binds: one more session would not fit), every queued session gets its
grant or a typed error, nothing hangs, and every completed greedy output equals HF.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from petals_chain.swarm.local import REPO_ROOT

pytestmark = [pytest.mark.integration]


def load_overload_script():
    spec = importlib.util.spec_from_file_location("overload_script", REPO_ROOT / "scripts" / "overload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_twice_the_capacity_stays_within_budgets_and_loses_nothing(tiny_llama_path):
    overload = load_overload_script()
    # in-process, so the swarm's `with` block stops every process even when an assertion fails;
    # 0.9 MiB per server: GBP-CR splits the 6 blocks over two servers that hold 2 sessions each;
    # 12 s of overload: 24 s turned the capacity over about 100 times at load average 8 (5 are asserted)
    args = overload.build_parser().parse_args(
        [
            "--minutes",
            "0.2",
            "--model",
            str(tiny_llama_path),
            "--servers",
            "4",
            "--budget",
            "0.9MiB",
            "--tokens",
            "6",
            "--factor",
            "2",
            "--acquire-timeout",
            "60",
            "--hang-s",
            "90",
        ]
    )
    summary = overload.run(args)
    text = json.dumps(summary)
    assert summary["lost"] == 0 and summary["unfinished_clients"] == 0, text
    assert summary["n_budget_violations"] == 0, text
    assert summary["started"] == summary["completed"] + summary["failed"] + summary["lost"], text
    # the only failures overload may cause are the typed timeouts of a queue
    assert set(summary["errors"]) <= {"AcquireTimeoutError", "AdmissionTimeoutError"}, text
    assert summary["capacity"] >= 1 and summary["clients"] == 2 * summary["capacity"], text
    # the swarm was really overloaded: full chains, a queue, the capacity turned over many times
    assert summary["max_in_use"] == summary["capacity"] and summary["max_queue_length"] >= 1, text
    assert summary["turnovers"] >= 5, text
    used = [s for s in summary["servers"] if s.get("kv_peak_reserved_bytes")]
    assert used, text
    for s in used:
        assert s["weights_bytes"] + s["kv_peak_reserved_bytes"] <= s["memory_budget_bytes"], text
        assert s["kv_allocated_bytes_max"] <= s["kv_reserved_bytes_max"], text
        assert s["rss_bytes_max"] > 0, text
    # ... and the budget was what bound it: at the peak, one more session would not have fitted
    assert any(
        s["weights_bytes"] + s["kv_peak_reserved_bytes"] + s["kv_bytes_per_session"] > s["memory_budget_bytes"]
        for s in used
    ), text
