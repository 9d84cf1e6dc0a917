"""`petals-chain demo` (the README's main command) end to end, small: plan, chains, chat, sessions."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from petals_chain.swarm.local import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.model]


def test_demo_runs_the_orchestrated_swarm_and_stops_cleanly(smollm2_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "petals_chain.cli",
            "demo",
            "--sessions",
            "8",
            "--session-tokens",
            "6",
            "--max-new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=400,
    )
    text = out.stdout
    assert out.returncode == 0, text[-3000:] + out.stderr[-3000:]
    assert "plan v1, policy proposed, c = 3" in text
    assert text.count(" MiB  blocks ") == 4 and "chains:" in text and "capacity" in text
    assert "assistant: " in text and "tokens/s" in text
    rows = [line for line in text.splitlines() if line.strip().split("  ")[0].strip().isdigit() and " s  " in line]
    assert len(rows) == 8, text
    waits = [float(line.split()[3]) for line in rows]  # the orchestrator's queue wait column
    assert any(w > 0 for w in waits)  # 8 sessions on a total capacity of 6: someone queued
    assert "orchestrator: 9 sessions admitted, queue length 0" in text  # the chat + 8 sessions
    assert text.rstrip().endswith("done: all processes stopped")
    # the start is reported, not silent: the orchestrator's plan and each server's "serving" as they happen
    assert re.search(r"^  \[ *\d+ s\] orchestrator: plan v1 ", text, re.M), text[:3000]
    assert len(re.findall(r"^  \[ *\d+ s\] server\d: (serving|standing by)", text, re.M)) == 4, text[:3000]
    # the README shows a run of this code: its tables' explanations are the ones the demo prints now
    heads = ("  budget  ", "  blocks  ", "  tau_c   ", "  tau_p   ", "  blocks: ", "  wait (client)")
    explained = [line for line in text.splitlines() if line.startswith(heads)]
    assert len(explained) == 6, explained
    shown = re.search(r"<!-- readme-output: demo -->\n```\n(.*?)\n```", (REPO_ROOT / "README.md").read_text(), re.S)
    assert shown is not None, "README.md: the demo's output block (marked readme-output: demo) is missing"
    assert [line for line in explained if line not in shown.group(1).splitlines()] == [], (
        "the README's demo output is not what the demo prints now: paste a real run"
    )
