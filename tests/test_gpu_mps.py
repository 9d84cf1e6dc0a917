"""The GPU variant's MPS isolation (experiments/gpu_mps.py): the daemon's life around a run, with a stand-in
control program where NVIDIA's is absent (tests/test_cuda.py runs the real one on a GPU host)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import gpu_mps
from experiments.gpu_mps import MpsUnavailableError, mps_daemon, server_list

REPO = Path(__file__).resolve().parents[1]

# A stand-in for nvidia-cuda-mps-control: `-d` makes the control pipe (as the daemon does when it
# listens); on stdin, `get_server_list` prints a server's pid and `quit` removes the pipe. Every call is
# appended to $FAKE_MPS_LOG with the pipe folder it was given.
FAKE = """#!/bin/sh
if [ "$1" = "-d" ]; then
    [ -n "$FAKE_MPS_FAIL" ] && { echo "cannot start: $FAKE_MPS_FAIL" >&2; exit 3; }
    touch "$CUDA_MPS_PIPE_DIRECTORY/control"
    echo "start $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
    exit 0
fi
read cmd
echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
case "$cmd" in
    get_server_list) echo 4242 ;;
    quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
esac
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    binary = tmp_path / "nvidia-cuda-mps-control"
    binary.write_text(FAKE)
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_MPS_LOG", str(log))
    return str(binary), log


def test_daemon_started_for_the_block_and_told_to_quit_after(fake_control):
    binary, log = fake_control
    with mps_daemon(40, binary=binary) as env:
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert (pipe / "control").exists()
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
        assert Path(env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
        # the pipe's path must fit a Unix socket's 107 bytes
        assert len(str(pipe / "control")) < 100
        assert server_list(env, binary) == ["4242"]
    calls = log.read_text().splitlines()
    assert calls[0] == f"start {pipe} {env['CUDA_MPS_LOG_DIRECTORY']}"
    assert calls[-1] == f"quit {pipe}"
    assert not pipe.parent.exists()  # its folders removed with it


def test_daemon_quits_when_the_run_fails(fake_control):
    binary, log = fake_control
    with pytest.raises(KeyError):
        with mps_daemon(25, binary=binary) as env:
            raise KeyError("a column failed")
    assert log.read_text().splitlines()[-1] == f"quit {env['CUDA_MPS_PIPE_DIRECTORY']}"
    assert not Path(env["CUDA_MPS_PIPE_DIRECTORY"]).exists()


def test_daemon_that_does_not_start_is_a_typed_error_with_the_way_out(fake_control, monkeypatch):
    binary, _ = fake_control
    monkeypatch.setenv("FAKE_MPS_FAIL", "no GPU")
    with pytest.raises(MpsUnavailableError, match="cannot start: no GPU.*--gpu-isolation off"):
        with mps_daemon(25, binary=binary):
            pytest.fail("the block must not run without a daemon")


def test_missing_control_program_says_where_it_was_looked_for(monkeypatch):
    monkeypatch.setattr(gpu_mps, "find_control", lambda path_env=None: None)
    with pytest.raises(MpsUnavailableError, match="nvidia-cuda-mps-control.*--gpu-isolation off"):
        with mps_daemon(25):
            pytest.fail("the block must not run without a daemon")


@pytest.mark.parametrize("pct", [0, -5, 101])
def test_sm_percent_out_of_range_is_refused(fake_control, pct):
    with pytest.raises(ValueError, match="gpu-sm-percent"):
        with mps_daemon(pct, binary=fake_control[0]):
            pass


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpu-isolation", "mps"], "needs --device cuda"),
        (["--gpu-isolation", "mps", "--device", "cuda", "--gpu-sm-percent", "150"], "at most 100"),
    ],
)
def test_cli_refuses_mps_where_it_cannot_apply(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "petals_chain.cli", "experiment", "table1", "--quick", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


def test_run_holds_one_daemon_for_all_columns(fake_control, monkeypatch):
    """experiments/run.py: `--gpu-isolation mps` yields the clients' environment for the columns and
    stops the daemon after them; off yields nothing and starts nothing."""
    from experiments import run
    from experiments.table1 import Table1Config

    binary, log = fake_control
    monkeypatch.setattr(gpu_mps, "find_control", lambda path_env=None: binary)
    with run.gpu_isolation(Table1Config(device="cuda", gpu_isolation="off")) as env:
        assert env == {}
    assert not log.exists()
    with run.gpu_isolation(Table1Config(device="cuda", gpu_isolation="mps", gpu_sm_percent=25)) as env:
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert log.read_text().startswith("start ")
    assert log.read_text().splitlines()[-1].startswith("quit ")
