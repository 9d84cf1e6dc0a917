"""Start a private swarm on 127.0.0.1 as real processes: a DHT peer and block servers.

Used by `petals-chain demo`, the tests and the benchmarks. Every process gets its own process
group, so stopping the swarm (also on Ctrl-C or an exception) leaves no stray process, p2p daemons
included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from petals_chain.process.preload import ForkedProcess, PreloadedLauncher
from petals_chain.process.signals import deferred_interrupts

# Where a process of the swarm runs: role ("dht", "orchestrator", "server0", ...) -> (argv prefix that
# runs a command on that host, IPv4 address it listens on). The default runs everything here on
# 127.0.0.1; an emulated WAN (netem) passes `lambda role: (net.command(host_of[role], []), net.address(...))`.
Placement = Callable[[str], tuple[list[str], str]]


def on_localhost(role: str) -> tuple[list[str], str]:
    return [], "127.0.0.1"


REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout this module was imported from
# What the preloaded launcher imports once for every process it forks: most of a server's and a DHT
# peer's start-up CPU (torch, transformers' Llama and config registry, hivemind, the server's own modules)
PRELOAD_MODULES = (
    "torch",
    "transformers.models.llama.modeling_llama",
    "hivemind.dht.dht",
    "hivemind.p2p",
    "safetensors.torch",
    "petals_chain.cli.main",
    "petals_chain.transport.membership",
    "petals_chain.runtime.block_range",
    "server.block_server",
    "server.cli",
)


class SwarmStartError(RuntimeError):
    """A process of the swarm did not start. `reason` is one line (the child's own last words, so a
    user reads why, e.g. the server's refusal of its budget); `output` is the child's output tail."""

    def __init__(self, what: str, lines: list[str]):
        self.reason = f"{what}: {last_words(lines)}"
        self.output = "\n".join(lines[-20:])
        super().__init__(f"{self.reason}\n{self.output}" if self.output else self.reason)


def last_words(lines: list[str]) -> str:
    """The last non-empty line a child printed (its error, when it failed), or why there is none."""
    return next((line.strip() for line in reversed(lines) if line.strip()), "it printed nothing")


@dataclass
class ServerProcess:
    name: str
    start: int | None  # None until an auto server reports the range it was assigned
    end: int | None
    process: subprocess.Popen | ForkedProcess
    lines: list[str] = field(default_factory=list)
    peer_id: str = ""

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


def _reader(proc: subprocess.Popen, sink: list[str], ready: threading.Event, is_ready: Callable[[str], bool]) -> None:
    for line in proc.stdout:
        sink.append(line.rstrip("\n"))
        if is_ready(line):
            ready.set()
    ready.set()  # EOF: the process ended; callers check whether it is alive


def _contains(*markers: str) -> Callable[[str], bool]:
    return lambda line: any(m in line for m in markers)


def _is_peer_maddr(line: str) -> bool:
    """A line `petals-chain dht` prints its address on: a multiaddr with a peer id. (Not any line
    holding "/p2p/": a traceback through hivemind/p2p/p2p_daemon.py holds it too, and was once taken
    for the address.)"""
    line = line.strip()
    return line.startswith("/") and "/p2p/" in line and " " not in line


class LocalSwarm:
    """`with LocalSwarm(model, [(0, 10), (10, 20), (20, 30)]) as swarm:` -> swarm.initial_peers."""

    def __init__(
        self,
        model: str,
        ranges: list[tuple[int, int] | None],
        *,
        server_args: list[str] | None = None,
        per_server_args: list[list[str]] | None = None,
        start_timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
        orchestrator_args: list[str] | None = None,
        placement: Placement = on_localhost,
        names: list[str] | None = None,
        preload: bool | None = None,
    ):
        """`ranges[i] = None` starts server i with `--blocks auto`; `orchestrator_args` (a list, possibly
        empty) starts `petals-chain orchestrator` with them before the servers; `placement` says on which
        host each process runs and which address it listens on; `names[i]` names server i (default its role
        `server<i>`); `preload` (default: on unless `PETALS_CHAIN_PRELOAD=0`) forks the processes that run
        here (not through a placement's command prefix) from one launcher that imported torch, transformers and
        hivemind once (`process/preload.py`) instead of exec'ing each."""
        self.names = names
        self.model = model
        self.ranges = ranges
        self.server_args = server_args or []
        self.per_server_args = per_server_args or [[] for _ in ranges]
        self.start_timeout_s = start_timeout_s
        pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, **(env or {})}
        self.orchestrator_args = orchestrator_args
        self.placement = placement
        self.orchestrator_process: subprocess.Popen | ForkedProcess | None = None
        self.orchestrator_lines: list[str] = []
        self.orchestrator_peer_id = ""
        self.orchestrator_url = ""
        self.dht_process: subprocess.Popen | ForkedProcess | None = None
        self.initial_peers: list[str] = []
        self.servers: list[ServerProcess] = []
        if preload is None:
            preload = self.env.get("PETALS_CHAIN_PRELOAD", "1") != "0"
        self.preload = preload
        self._launcher: PreloadedLauncher | None = None
        self._launcher_lock = threading.Lock()
        self._extra: list[subprocess.Popen | ForkedProcess] = []  # started by `spawn`

    def _preloaded(self) -> PreloadedLauncher:
        with self._launcher_lock:
            if self._launcher is None:
                modules = list(PRELOAD_MODULES)
                if self.orchestrator_args is not None:
                    modules.append("orchestrator.service.core")
                self._launcher = PreloadedLauncher(self.env, modules, start_timeout_s=self.start_timeout_s)
            return self._launcher

    def spawn(self, role: str, args: list[str]) -> subprocess.Popen | ForkedProcess:
        """Run `python ARGS` as the swarm runs its own processes (on `role`'s host, preloaded where it can,
        output on `.stdout`, in a session of its own): e.g. `petals-chain api` next to the swarm. The swarm
        stops it with its own processes if it still runs then."""
        proc = self._spawn(role, args)
        self._extra.append(proc)
        return proc

    def _spawn(self, role: str, args: list[str]) -> subprocess.Popen | ForkedProcess:
        prefix, _ = self.placement(role)
        if self.preload and not prefix and args[0] == "-m":
            return self._preloaded().spawn(args[1], args[2:])
        return subprocess.Popen(
            [*prefix, sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            start_new_session=True,
        )

    def _maddr(self, role: str) -> str:
        return f"/ip4/{self.placement(role)[1]}/tcp/0"

    def start(self, *, wait_servers: bool = True) -> "LocalSwarm":
        """`wait_servers=False`: return once the servers are spawned (a caller that waits for the
        orchestrator's plan instead: a server the plan leaves out never reports a range)."""
        try:
            self.dht_process = self._spawn(
                "dht", ["-m", "petals_chain.cli", "dht", "--host-maddrs", self._maddr("dht")]
            )
            lines: list[str] = []
            ready = threading.Event()
            threading.Thread(target=_reader, args=(self.dht_process, lines, ready, _is_peer_maddr), daemon=True).start()
            peer = next(filter(_is_peer_maddr, lines), None) if ready.wait(60) else None
            if peer is None or self.dht_process.poll() is not None:
                raise SwarmStartError("the DHT peer did not start", lines)
            self.initial_peers = [peer.strip()]
            if self.orchestrator_args is not None:
                self.start_orchestrator(self.orchestrator_args, timeout_s=self.start_timeout_s)
            for i, rng in enumerate(self.ranges):
                start, end = rng if rng is not None else (None, None)
                self.add_server(
                    start,
                    end,
                    extra_args=self.per_server_args[i],
                    wait=False,
                    name=self.names[i] if self.names else None,
                )
            if wait_servers:
                self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start_orchestrator(self, args: list[str], timeout_s: float = 60.0) -> None:
        self.orchestrator_lines = []
        self.orchestrator_process = self._spawn(
            "orchestrator",
            [
                "-m",
                "petals_chain.cli",
                "orchestrator",
                "--model",
                self.model,
                "--initial-peers",
                *self.initial_peers,
                "--host-maddrs",
                self._maddr("orchestrator"),
                "--http-host",
                self.placement("orchestrator")[1],
                *args,
            ],
        )
        ready = threading.Event()
        threading.Thread(
            target=_reader,
            args=(self.orchestrator_process, self.orchestrator_lines, ready, _contains("orchestrator ready")),
            daemon=True,
        ).start()
        if not ready.wait(timeout_s) or self.orchestrator_process.poll() is not None:
            raise SwarmStartError("the orchestrator did not start", self.orchestrator_lines)
        line = next(line for line in self.orchestrator_lines if line.startswith("orchestrator ready"))
        self.orchestrator_peer_id = line.split(" as ")[1].split(",")[0].strip()
        self.orchestrator_url = line.rsplit("status ", 1)[1].strip()

    def kill_orchestrator(self, sig: int = signal.SIGKILL) -> None:
        if self.orchestrator_process is not None:
            if sig == signal.SIGKILL:
                _crash(self.orchestrator_process)
            else:
                _signal_group(self.orchestrator_process, sig)
            self.orchestrator_process.wait(timeout=30)

    def kill_dht(self) -> None:
        """The bootstrap DHT peer (also the relay of servers behind a NAT) crashes, p2pd included."""
        if self.dht_process is not None:
            _crash(self.dht_process)
            self.dht_process.wait(timeout=30)

    def add_server(
        self,
        start: int | None,
        end: int | None,
        *,
        extra_args: list[str] | None = None,
        wait: bool = True,
        name: str | None = None,
        num_blocks: int | None = None,
    ) -> ServerProcess:
        """`start = end = None`: `--blocks auto` (the orchestrator assigns the range); `num_blocks`:
        `--num-blocks N --no-orchestrator` (the server chooses its own span)."""
        role = f"server{len(self.servers)}"
        name = name or role
        blocks = (
            ["--num-blocks", str(num_blocks), "--no-orchestrator"]
            if num_blocks is not None
            else ["--blocks", "auto" if start is None else f"{start}:{end}"]
        )
        proc = self._spawn(
            role,
            [
                "-m",
                "server.cli",
                "--model",
                self.model,
                *blocks,
                "--initial-peers",
                *self.initial_peers,
                "--host-maddrs",
                self._maddr(role),
                "--name",
                name,
                *self.server_args,
                *(extra_args or []),
            ],
        )
        sp = ServerProcess(name, start, end, proc)
        sp._ready = threading.Event()  # type: ignore[attr-defined]
        threading.Thread(
            target=_reader, args=(proc, sp.lines, sp._ready, _contains("serving ", "standing by: ")), daemon=True
        ).start()
        self.servers.append(sp)
        if wait:
            self.wait_ready([sp])
        return sp

    def wait_ready(self, servers: list[ServerProcess] | None = None) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for sp in servers or self.servers:
            if not sp._ready.wait(max(0.0, deadline - time.monotonic())) or not sp.alive:  # type: ignore[attr-defined]
                state = "exited" if not sp.alive else f"not ready within {self.start_timeout_s:.0f} s"
                raise SwarmStartError(f"{sp.name} [{sp.start}:{sp.end}) did not start ({state})", sp.lines)
            line = next((line for line in sp.lines if line.startswith(("serving ", "standing by: "))), None)
            if line is None:  # it ended (e.g. was killed) just as it was starting
                raise SwarmStartError(f"{sp.name} ended before it was ready", sp.lines)
            sp.peer_id = line.split(" as ")[1].split()[0].rstrip(":")
            if line.startswith("serving "):
                rng = line.split("blocks [", 1)[1].split(")", 1)[0]
                sp.start, sp.end = (int(x) for x in rng.split(", "))

    def kill_server(self, sp: ServerProcess, sig: int = signal.SIGKILL) -> None:
        """SIGKILL takes the server, its DHT child and its p2pd down at once (a crash); any other signal
        goes to the server process alone, which then shuts down its own DHT child (a clean stop)."""
        if sig == signal.SIGKILL:
            _crash(sp.process)
        else:
            sp.process.send_signal(sig)
        sp.process.wait(timeout=30)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM each main process (servers announce offline and stop their DHT child), then
        SIGKILL whatever is left in their process groups. Ctrl-C during this is deferred."""
        with deferred_interrupts():
            self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> None:
        procs = [*self._extra, *(sp.process for sp in self.servers)]
        procs += [p for p in (self.orchestrator_process, self.dht_process) if p]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:  # whatever did not stop, and any p2p daemon left in the group
            _signal_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with self._launcher_lock:
            launcher, self._launcher = self._launcher, None
        if launcher is not None:  # after its children: their exit statuses come through it
            launcher.close()

    def __enter__(self) -> "LocalSwarm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _crash(proc: subprocess.Popen) -> None:
    """SIGKILL a process, its group and every descendant. Why the descendants too: a DHT child
    (`process_signals.ParentBoundDHT`) sits in a process group of its own, and its p2pd outlives a kill
    of the parent's group until the child's watchdog sees the parent gone (0.28 s measured on a quiet
    machine, PARENT_CHECK_PERIOD_S plus a wake-up; longer under load): long enough for a small model's
    session to finish its last decode steps through a relay the test meant to cut off (seen in CI)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    _signal_group(proc, signal.SIGKILL)
    for child in descendants:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stops a process started with `start_new_session=True` next to a swarm (a `petals-chain api`, say):
    SIGTERM, up to `timeout_s` for it to exit, then SIGKILL whatever is left in its process group (its
    p2p daemon)."""
    proc.send_signal(signal.SIGTERM)  # a no-op once it has exited
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
