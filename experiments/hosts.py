"""Where the experiment's processes run: one small interface, two implementations.

- `Localhost` (petals_chain.local_swarm): every process on 127.0.0.1, no emulation (`--no-netem`;
  results are labelled so);
- `EmulatedHosts`: one emulated host per role (a network namespace of `netem.Network`, RIPE Atlas
  RTTs between hosts), the DHT peer, orchestrator and load generator on host `client`, server i on
  its own host.

Both give: `label`, `listen_maddr(role)`, `popen(role, argv, **kw)`, `fetch_json(role, url)` (an
HTTP GET made from inside the role's host: the orchestrator's status page listens on that host's
loopback), `rtt_ms` (the configured matrix, or None) and `close()`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import numpy as np

from petals_chain.local_swarm import Localhost as _Localhost

CLIENT_HOST = "client"  # DHT peer, orchestrator and load generator
_FETCH = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


class EmulationUnavailableError(RuntimeError):
    """WAN emulation cannot run here; the message says why and how to run without it."""


class Localhost(_Localhost):
    rtt_ms = None
    hosts: list[str] = []

    def fetch_json(self, role: str, url: str) -> dict:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)

    def close(self) -> None:
        pass


def ripe_atlas_hosts_rtt_ms(rtt_matrix_ms: np.ndarray, n_hosts: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """RTTs between `n_hosts` RIPE Atlas anchors drawn without replacement (seeded): (matrix, anchor indices)."""
    if n_hosts > rtt_matrix_ms.shape[0]:
        raise ValueError(f"need {n_hosts} hosts, the RTT matrix has {rtt_matrix_ms.shape[0]} anchors")
    idx = sorted(np.random.default_rng(seed).choice(rtt_matrix_ms.shape[0], size=n_hosts, replace=False).tolist())
    return rtt_matrix_ms[np.ix_(idx, idx)], idx


class EmulatedHosts:
    """`roles` -> hosts of one `netem.Network`: `client` holds dht/orchestrator/loadgen, every other role its own."""

    def __init__(self, server_names: list[str], rtt_ms: np.ndarray, *, backend: str = "auto", name: str = "pct1"):
        import netem

        if not hasattr(netem, "Network"):
            raise EmulationUnavailableError("this checkout has no WAN emulation (netem.Network); run with --no-netem")
        self.hosts = [CLIENT_HOST, *server_names]
        if rtt_ms.shape != (len(self.hosts), len(self.hosts)):
            raise ValueError(f"rtt matrix {rtt_ms.shape} does not match {len(self.hosts)} hosts")
        self.rtt_ms = rtt_ms
        self.net = netem.Network(self.hosts, rtt_ms.tolist(), backend=backend, name=name)
        try:
            self.net.__enter__()
        except netem.NetemError as e:
            raise EmulationUnavailableError(f"WAN emulation could not start: {e}; or run with --no-netem") from e
        self.label = f"netem ({self.net.backend} backend): {len(self.hosts)} emulated hosts, RIPE Atlas RTTs"

    def host_of(self, role: str) -> str:
        return role if role in self.hosts else CLIENT_HOST

    def listen_maddr(self, role: str) -> str:
        return f"/ip4/{self.net.address(self.host_of(role))}/tcp/0"

    def popen(self, role: str, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        return self.net.popen(self.host_of(role), argv, **popen_kwargs)

    def fetch_json(self, role: str, url: str) -> dict:
        out = subprocess.run(self.net.command(self.host_of(role), [sys.executable, "-c", _FETCH, url]),
                             capture_output=True, text=True, timeout=30, check=True)
        return json.loads(out.stdout)

    def measure_rtt_ms(self) -> list[list[float]]:
        return self.net.measure_rtt_ms()

    def close(self) -> None:
        self.net.__exit__(None, None, None)
