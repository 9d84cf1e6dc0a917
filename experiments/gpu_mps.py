"""GPU isolation for the GPU variant: nine servers on one GPU as independent devices, through CUDA MPS.

Without it, nine CUDA processes on one GPU time-slice it: one process's kernels wait while another's
run, so a lone decode step timed in a busy replay is 2-3x the same step timed alone (a GPU run in
docs/results.md: 12-17 ms against 5 ms; the model check's decode compute -0.34..-0.62). The paper's
servers were MIG slices; MIG is the GPU's configuration, which an experiment must not change. MPS
(the Multi-Process Service) is a user-space daemon: the processes that connect to it share one GPU
context, their kernels run side by side on the SMs instead of in turns, and
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` caps the SMs each process may use (so one server's long prefill
cannot take the whole GPU from the others). Memory bandwidth stays shared: MPS isolates less than MIG.

`mps_daemon(pct)` starts a control daemon with its own pipe and log folders (so it serves only the
processes given its environment, not other CUDA users of the machine), yields the environment those
processes need, and stops the daemon when the block ends, also on errors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from experiments.hosts import EmulationUnavailableError

CONTROL = "nvidia-cuda-mps-control"
# where NVIDIA's driver utilities lie when they are not on PATH (container images mount the driver there)
DRIVER_BIN_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin")


class MpsUnavailableError(EmulationUnavailableError):
    """MPS could not be started; the message says how to run without it."""


def find_control(path_env: str | None = None) -> str | None:
    found = shutil.which(CONTROL, path=path_env)
    if found:
        return found
    for d in DRIVER_BIN_DIRS:
        cand = Path(d) / CONTROL
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def _control(binary: str, env: dict[str, str], command: str, timeout_s: float = 20.0) -> str:
    """One command to the running daemon through its pipe (`get_server_list`, `quit`, ...)."""
    done = subprocess.run([binary], input=command + "\n", env=env, capture_output=True, text=True, timeout=timeout_s)
    return done.stdout.strip()


@contextmanager
def mps_daemon(
    sm_percent: float, *, binary: str | None = None, start_timeout_s: float = 20.0
) -> Iterator[dict[str, str]]:
    """Run an MPS control daemon for the block; yields the environment of its clients: the pipe and log
    folders and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` = `sm_percent` (each client's cap on the SMs)."""
    if not 0 < sm_percent <= 100:
        raise ValueError(f"--gpu-sm-percent must be in (0, 100], got {sm_percent:g}")
    binary = binary or find_control()
    if binary is None:
        raise MpsUnavailableError(
            f"--gpu-isolation mps: {CONTROL} is not on PATH nor in "
            f"{', '.join(DRIVER_BIN_DIRS)} (it ships with NVIDIA's driver utilities); "
            "install them or run with --gpu-isolation off"
        )
    # short folders: the daemon's control socket lies in the pipe folder, and a Unix socket's path is
    # limited to 107 bytes
    root = Path(tempfile.mkdtemp(prefix="pc-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}
    for d in env.values():
        Path(d).mkdir()
    full_env = {**os.environ, **env}
    started = subprocess.run([binary, "-d"], env=full_env, capture_output=True, text=True, timeout=start_timeout_s)
    if started.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise MpsUnavailableError(
            f"--gpu-isolation mps: `{CONTROL} -d` failed (exit {started.returncode}): "
            f"{(started.stderr or started.stdout).strip()[-500:]}; run with --gpu-isolation off"
        )
    try:
        # the daemon forks and returns at once; its control pipe appears when it listens
        deadline = time.monotonic() + start_timeout_s
        while not (root / "pipe" / "control").exists():
            if time.monotonic() > deadline:
                raise MpsUnavailableError(
                    f"--gpu-isolation mps: the MPS daemon made no control pipe in {root / 'pipe'} "
                    f"within {start_timeout_s:g} s (its log: {root / 'log'}); "
                    "run with --gpu-isolation off"
                )
            time.sleep(0.05)
        yield {**env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{sm_percent:g}"}
    finally:
        try:
            _control(binary, full_env, "quit")
        except (OSError, subprocess.TimeoutExpired):
            pass  # a daemon that cannot be told to quit dies with the machine; nothing else holds its folders
        shutil.rmtree(root, ignore_errors=True)


def server_list(env: dict[str, str], binary: str | None = None) -> list[str]:
    """PIDs of the MPS servers the daemon runs (one per user whose clients connected): non-empty once a
    client made its CUDA context through MPS, which is how a run shows that its servers used it."""
    binary = binary or find_control()
    if binary is None:
        return []
    try:
        out = _control(binary, {**os.environ, **env}, "get_server_list", timeout_s=10.0)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.split() if line.isdigit()]
