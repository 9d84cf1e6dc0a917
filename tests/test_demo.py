"""`petals-chain demo` (the README's main command) end to end, small: plan, chains, chat, sessions."""
from __future__ import annotations

import subprocess
import sys

import pytest

from petals_chain.swarm.local import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.model]


def test_demo_runs_the_orchestrated_swarm_and_stops_cleanly(smollm2_path):
    out = subprocess.run([sys.executable, "-m", "petals_chain.cli", "demo", "--sessions", "8", "--session-tokens", "6",
                          "--max-new-tokens", "8"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=400)
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
