"""launch-server --emulate-slowdown (server/emulation.py): an explicitly named emulation, off by default."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.cli import build_parser
from server.emulation import SlowedBlockRange, maybe_slowed, real_range, slowed_times
from server.profiling import BlockTimes


class FakeRange:
    start, end = 3, 7

    def __init__(self, clock, compute_s):
        self.clock, self.compute_s, self.calls = clock, compute_s, []

    def forward(self, steps):
        self.calls.append(steps)
        self.clock.t += self.compute_s
        return [f"out{i}" for i, _ in enumerate(steps)]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_batch_takes_k_times_its_compute_and_keeps_its_outputs():
    clock = Clock()
    slept = []
    inner = FakeRange(clock, compute_s=0.25)
    r = SlowedBlockRange(inner, 3.0, clock=clock, sleep=slept.append)
    assert r.forward(["a", "b"]) == ["out0", "out1"]
    assert inner.calls == [["a", "b"]]
    assert slept == [pytest.approx(0.5)]  # (K - 1) x 0.25 s
    assert (r.start, r.end) == (3, 7) and real_range(r) is inner  # everything else is the real range's


def test_off_by_default_and_validated():
    assert (
        build_parser()
        .parse_args(["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmW91aaAN3fKnU9CDMMrWLyRmaiaBFqwKKgqDTm6LaWpUc"])
        .emulate_slowdown
        == 1.0
    )
    inner = FakeRange(Clock(), 0.0)
    assert maybe_slowed(inner, 1.0) is inner and real_range(inner) is inner
    with pytest.raises(ValueError, match=">= 1"):
        SlowedBlockRange(inner, 0.5)
    assert slowed_times(BlockTimes(1e-4, 2e-3), 1.5) == BlockTimes(pytest.approx(1.5e-4), pytest.approx(3e-3))


def test_cli_rejects_a_speedup():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.cli",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/1/p2p/QmW91aaAN3fKnU9CDMMrWLyRmaiaBFqwKKgqDTm6LaWpUc",
            "--emulate-slowdown",
            "0.5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--emulate-slowdown must be >= 1" in out.stderr
