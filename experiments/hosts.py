"""Where the experiment's processes run: one small interface, two implementations.

- `Localhost`: every process on 127.0.0.1, no emulation (`--no-netem`; results are labelled so);
- `EmulatedHosts`: one emulated host per server (a network namespace of `netem.Network`, RIPE Atlas
  RTTs between hosts) plus host `client` for the DHT peer, the orchestrator and the load generator.

Both give: `label`, `placement(role)` (role -> (argv prefix, address): what `LocalSwarm` takes;
roles are `dht`, `orchestrator`, `loadgen`, `server<i>` and the servers' names), `listen_maddr(role)`,
`popen(role, argv, **kw)`, `fetch_json(role, url)` (an HTTP GET made from inside the role's host)
and `close()`.
"""

from __future__ import annotations

import abc
import contextlib
import json
import subprocess
import sys
import urllib.request

import numpy as np
import psutil

CLIENT_HOST = "client"  # DHT peer, orchestrator and load generator
_FETCH = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


class EmulationUnavailableError(RuntimeError):
    """WAN emulation cannot run here; the message says why and how to run without it."""


class _Hosts(abc.ABC):
    @abc.abstractmethod
    def placement(self, role: str) -> tuple[list[str], str]:
        """(argv prefix that runs a command on the role's host, the host's listen address)."""

    def listen_maddr(self, role: str) -> str:
        return f"/ip4/{self.placement(role)[1]}/tcp/0"

    def popen(self, role: str, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.placement(role)[0], *argv], **popen_kwargs)

    def fetch_json(self, role: str, url: str) -> dict:
        out = subprocess.run(
            [*self.placement(role)[0], sys.executable, "-c", _FETCH, url],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return json.loads(out.stdout)

    def cpu_report(self) -> dict:
        """Per host with a CPU share: share, CPU seconds used, seconds throttled (none without shares)."""
        return {}

    def cpu_unlimited(self) -> contextlib.AbstractContextManager:
        """Hosts' CPU quotas lifted for the duration (loading that is not measured); none here."""
        return contextlib.nullcontext()

    def exempt_daemons(self, server_pids: dict[str, int]) -> dict[str, list[int]]:
        """Each server's DHT process and p2p daemon out of its host's CPU share (netem/cpu.py: a real
        host runs them on its own CPU beside the device); server name -> pids moved. None here."""
        return {}

    def close(self) -> None:
        pass


class Localhost(_Hosts):
    label = "localhost (no network emulation)"
    rtt_ms = None

    def placement(self, role: str) -> tuple[list[str], str]:
        return [], "127.0.0.1"

    def fetch_json(self, role: str, url: str) -> dict:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)


def daemon_pids(root_pid: int) -> list[int]:
    """The p2p daemons (`p2pd`) under `root_pid` and the processes that started them (hivemind's DHT
    process; never `root_pid` itself, the server), parents first."""
    try:
        tree = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out: list[int] = []
    for p in tree:
        try:
            if p.name() != "p2pd":
                continue
            parent = p.ppid()
        except psutil.NoSuchProcess:
            continue
        out += [q for q in (parent, p.pid) if q != root_pid and q not in out]
    return out


def ripe_atlas_hosts_rtt_ms(rtt_matrix_ms: np.ndarray, n_hosts: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """RTTs between `n_hosts` RIPE Atlas anchors drawn without replacement (seeded): (matrix, anchor indices)."""
    if n_hosts > rtt_matrix_ms.shape[0]:
        raise ValueError(f"need {n_hosts} hosts, the RTT matrix has {rtt_matrix_ms.shape[0]} anchors")
    idx = sorted(np.random.default_rng(seed).choice(rtt_matrix_ms.shape[0], size=n_hosts, replace=False).tolist())
    return rtt_matrix_ms[np.ix_(idx, idx)], idx


class EmulatedHosts(_Hosts):
    """Host `client` and one host per server name, in one `netem.Network` (its RTT matrix in that order)."""

    def __init__(
        self,
        server_names: list[str],
        rtt_ms: np.ndarray,
        *,
        backend: str = "auto",
        name: str,
        cpu: dict[str, float] | None = None,
    ):
        import netem

        if not hasattr(netem, "Network"):
            raise EmulationUnavailableError("this checkout has no WAN emulation (netem.Network); run with --no-netem")
        self.server_names = list(server_names)
        self.hosts = [CLIENT_HOST, *server_names]
        if rtt_ms.shape != (len(self.hosts), len(self.hosts)):
            raise ValueError(f"rtt matrix {rtt_ms.shape} does not match {len(self.hosts)} hosts")
        self.rtt_ms = rtt_ms
        self.net = netem.Network(self.hosts, rtt_ms.tolist(), backend=backend, name=name, cpu=cpu)
        try:
            self.net.__enter__()
        except netem.NetemError as e:
            raise EmulationUnavailableError(f"WAN emulation could not start: {e}; or run with --no-netem") from e
        self.label = f"netem ({self.net.backend} backend): {len(self.hosts)} emulated hosts, RIPE Atlas RTTs" + (
            ", a CPU share each" if cpu else ""
        )
        self.name = name

    def host_of(self, role: str) -> str:
        if role in self.hosts:
            return role
        if role.startswith("server") and role[6:].isdigit() and int(role[6:]) < len(self.server_names):
            return self.server_names[int(role[6:])]
        return CLIENT_HOST

    def placement(self, role: str) -> tuple[list[str], str]:
        host = self.host_of(role)
        return self.net.prefix(host), self.net.address(host)

    def cpu_report(self) -> dict:
        return self.net.cpu_report()

    def cpu_unlimited(self) -> contextlib.AbstractContextManager:
        return self.net.cpu_unlimited()

    def exempt_daemons(self, server_pids: dict[str, int]) -> dict[str, list[int]]:
        return {name: self.net.exempt(self.host_of(name), daemon_pids(pid)) for name, pid in server_pids.items()}

    def close(self) -> None:
        self.net.__exit__(None, None, None)
