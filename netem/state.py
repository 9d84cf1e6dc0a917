"""Names of everything a network creates, and its state file.

Every namespace, link, TUN device and hub process of network NAME is named `NAME-...`; the state
file `<state dir>/NAME.json` is written *before* anything is created, so `down`/`cleanup` can find
the leftovers of a run that crashed at any point (even SIGKILL) and removes only those names.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from netem.errors import NetemError, NetworkNotFoundError, TopologyError

DEFAULT_NAME = "pcnet"
DEFAULT_SUBNET = "10.213.0.0/16"
STATE_ENV_VAR = "PETALS_CHAIN_NETEM_STATE_DIR"
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")  # NAME-t999 must fit IFNAMSIZ (15 characters)
MAX_HOSTS = 1000


def validate_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise NetemError(
            f"network name {name!r}: use 1-8 lowercase letters/digits starting with a letter "
            "(it prefixes every interface name, which Linux limits to 15 characters)"
        )
    return name


def state_dir(environ: dict[str, str] | None = None) -> Path:
    """`$PETALS_CHAIN_NETEM_STATE_DIR`, else /run/petals-chain-netem (root), else /tmp/petals-chain-netem."""
    env = os.environ if environ is None else environ
    if env.get(STATE_ENV_VAR):
        return Path(env[STATE_ENV_VAR])
    return Path("/run/petals-chain-netem") if os.access("/run", os.W_OK) else Path("/tmp/petals-chain-netem")


def host_netns(name: str, i: int) -> str:
    return f"{name}-h{i}"


def switch_netns(name: str) -> str:
    """Kernel backend: the namespace holding the bridge (nothing is created in the host's own namespace)."""
    return f"{name}-sw"


def tun_dev(name: str, i: int) -> str:
    return f"{name}-t{i}"


def nat_netns(name: str, i: int) -> str:
    """A host behind an emulated NAT runs here; NAME-h<i> is then its router (netem/nat.py)."""
    return f"{name}-n{i}"


def nat_addresses(i: int) -> tuple[str, str]:
    """(router, host) addresses of host i's private /24 behind its NAT: 192.168.<i+1>.1 and .2."""
    if not 0 <= i <= 253:
        raise NetemError(f"host index {i}: only hosts 0..253 can sit behind an emulated NAT")
    return f"192.168.{i + 1}.1", f"192.168.{i + 1}.2"


def veth_host_dev(name: str, i: int) -> str:
    return f"{name}-e{i}"


def veth_switch_dev(name: str, i: int) -> str:
    return f"{name}-v{i}"


def bridge_dev(name: str) -> str:
    return f"{name}-br"


def owned_netns(name: str, existing: list[str]) -> list[str]:
    """The namespaces in `existing` that network `name` created: exactly NAME-h<i>, NAME-n<i>, NAME-sw,
    NAME-probe."""
    pat = re.compile(rf"^{re.escape(name)}-(h\d+|n\d+|sw|probe)$")
    return [ns for ns in existing if pat.match(ns)]


def host_addresses(n_hosts: int, subnet: str = DEFAULT_SUBNET) -> list[str]:
    """Host i gets the (i+1)-th address of `subnet` (a private range kept inside the namespaces)."""
    net = ipaddress.IPv4Network(subnet)
    if not net.is_private:
        raise TopologyError(f"subnet {subnet} is not a private range; use one like 10.213.0.0/16")
    if n_hosts > min(MAX_HOSTS, net.num_addresses - 2):
        raise TopologyError(f"{n_hosts} hosts do not fit in {subnet} (at most {min(MAX_HOSTS, net.num_addresses - 2)})")
    return [str(net.network_address + i + 1) for i in range(n_hosts)]


@dataclass
class NetworkState:
    """What `up` created, as written to the state file (JSON)."""

    name: str
    backend: str
    hosts: list[str]
    addresses: list[str]
    rtt_ms: list[list[float]]
    subnet: str = DEFAULT_SUBNET
    bandwidth_bit_s: float | None = None
    jitter_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0
    hub_pid: int | None = None
    owner_pid: int | None = None
    extra: dict = field(default_factory=dict)
    behind_nat: list[int] = field(default_factory=list)  # host indices whose processes sit behind a NAT router

    def netns(self, i: int) -> str:
        """Host i's WAN namespace (its router's, when it sits behind a NAT)."""
        return host_netns(self.name, i)

    def process_netns(self, i: int) -> str:
        """Where host i's processes run: its private namespace behind the NAT, else its WAN namespace."""
        return nat_netns(self.name, i) if i in self.behind_nat else host_netns(self.name, i)

    def process_address(self, i: int) -> str:
        """The address host i's processes listen on (a private one behind a NAT)."""
        return nat_addresses(i)[1] if i in self.behind_nat else self.addresses[i]

    def index(self, host: str | int) -> int:
        if isinstance(host, int) and 0 <= host < len(self.hosts):
            return host
        if host in self.hosts:
            return self.hosts.index(host)
        raise NetemError(f"no host {host!r} in network {self.name}; hosts: {', '.join(self.hosts)}")


def state_path(name: str, directory: Path | None = None) -> Path:
    return (directory or state_dir()) / f"{validate_name(name)}.json"


def write_state(state: NetworkState, directory: Path | None = None) -> Path:
    path = state_path(state.name, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def read_state(name: str, directory: Path | None = None) -> NetworkState:
    path = state_path(name, directory)
    try:
        return NetworkState(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise NetworkNotFoundError(
            f"no network {name!r} is up (no {path}); start one with `petals-chain netem up`"
        ) from None


def recorded_names(directory: Path | None = None) -> list[str]:
    d = directory or state_dir()
    return sorted(p.stem for p in d.glob("*.json") if _NAME_RE.match(p.stem)) if d.is_dir() else []
