"""The preloaded launcher (petals_chain/process/preload.py): forked processes behave as exec'd ones do
where the swarm relies on it: output, exit codes (signals negative), their own session, cwd, fresh RNG
state, `python -m` semantics, and a launcher that ends when its owner closes it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from petals_chain.process.preload import LauncherError, PreloadedLauncher

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def launcher():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    launcher = PreloadedLauncher(env, ["json", "random"])
    yield launcher
    launcher.close()


def _tool(tmp_path: Path, body: str) -> str:
    """A module in tmp_path run with `-m` (tmp_path is the child's cwd, so it imports from there)."""
    (tmp_path / "probe_mod.py").write_text(body)
    return "probe_mod"


def test_output_exit_code_cwd_and_argv(launcher, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mod = _tool(
        tmp_path,
        "import os, sys\nprint('cwd', os.getcwd())\nprint('argv', sys.argv[1:])\n"
        "print('main', __name__)\nprint('err', file=sys.stderr)\nsys.exit(int(sys.argv[1]))\n",
    )
    p = launcher.spawn(mod, ["7", "x"])
    out = p.stdout.read()
    assert p.wait(timeout=30) == 7 and p.poll() == 7
    assert f"cwd {tmp_path}" in out and "argv ['7', 'x']" in out and "main __main__" in out and "err" in out


def test_own_session_signals_and_negative_codes(launcher, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mod = _tool(tmp_path, "import signal\nprint('up', flush=True)\nsignal.pause()\n")  # until signalled
    p = launcher.spawn(mod, [])
    assert p.stdout.readline().strip() == "up"
    assert p.poll() is None
    assert os.getpgid(p.pid) == p.pid and os.getsid(p.pid) == p.pid  # as start_new_session=True
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    p.send_signal(signal.SIGTERM)  # after the exit: nothing is signalled (the pid may be reused)
    q = launcher.spawn(mod, [])
    assert q.stdout.readline().strip() == "up"
    q.kill()
    assert q.wait(timeout=30) == -signal.SIGKILL


def test_a_failing_module_and_a_fast_exit_are_reported(launcher, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = launcher.spawn("no_such_module_here", [])
    assert p.wait(timeout=30) == 1 and "No module named" in p.stdout.read()
    mod = _tool(tmp_path, "")
    quick = [launcher.spawn(mod, []) for _ in range(5)]  # exits that may beat the pid's registration
    assert [q.wait(timeout=30) for q in quick] == [0] * 5


def test_each_child_draws_its_own_random_numbers(launcher, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mod = _tool(tmp_path, "import random\nprint(random.random())\n")
    draws = set()
    for _ in range(3):
        p = launcher.spawn(mod, [])
        draws.add(p.stdout.read().strip())
        p.wait(timeout=30)
    assert len(draws) == 3


def test_closing_ends_the_launcher_and_a_closed_one_refuses():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launcher = PreloadedLauncher(env, [])
    pid = launcher._proc.pid
    launcher.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises((LauncherError, OSError)):
        launcher.spawn("json.tool", ["--help"], timeout_s=2)


def test_a_launcher_whose_owner_dies_ends_too(tmp_path):
    """The owner's end of the socket closes with its process: the launcher sees it and exits."""
    script = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from petals_chain.process.preload import PreloadedLauncher\n"
        "launcher = PreloadedLauncher(dict(os.environ), [])\n"
        "print(launcher._proc.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    # polled: not our child, and reaped by whoever adopted it (or left a zombie where nobody reaps)
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the launcher outlived its owner"
        time.sleep(0.1)
