"""`netem.Network`: N emulated hosts, one network namespace each, pairwise RTTs, one API for both backends.

    with netem.Network(["a", "b"], [[0, 40], [40, 0]]) as net:
        subprocess.run(net.command("a", ["python", "-c", "..."]))

Leaving the block, an exception or SIGTERM (in the main thread) removes everything; `cleanup()`
removes what a crashed run left (the state file is written before anything is created).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from netem import cpu as netem_cpu
from netem import kernel, nat
from netem.errors import MissingCapabilityError, NetemError, NetworkExistsError
from netem.probe import measure_rtt_ms
from netem.state import (
    DEFAULT_NAME,
    DEFAULT_SUBNET,
    NetworkState,
    host_addresses,
    nat_addresses,
    owned_netns,
    read_state,
    recorded_names,
    state_dir,
    state_path,
    write_state,
)
from netem.system import kill_netns_processes, list_netns, require_capabilities, run
from netem.topology import validate_rtt_matrix

BACKENDS = ("auto", "kernel", "userspace")
HUB_START_TIMEOUT_S = 30.0


def choose_backend(requested: str, name: str) -> tuple[str, str]:
    """(backend, why). `auto` tries a netem qdisc in a throwaway namespace of ours."""
    if requested not in BACKENDS:
        raise NetemError(f"backend {requested!r}: choose one of {', '.join(BACKENDS)}")
    if requested == "userspace":
        return "userspace", "requested"
    ok, detail = kernel.kernel_has_netem(f"{name}-probe")
    if requested == "kernel":
        if not ok:
            raise MissingCapabilityError(
                f"backend kernel needs the sch_netem qdisc (modprobe sch_netem), which this "
                f"kernel refused: {detail}; use --backend userspace"
            )
        return "kernel", "requested"
    return ("kernel", "the kernel has sch_netem") if ok else ("userspace", f"the kernel has no sch_netem ({detail})")


def _hub_argv_matches(cmd: list[bytes], name: str) -> bool:
    """`python -m netem.hub NAME [DIR]`: how every hub is started, so a recycled pid is never taken for ours."""
    return (
        b"netem.hub" in cmd
        and cmd.index(b"netem.hub") + 1 < len(cmd)
        and cmd[cmd.index(b"netem.hub") + 1] == name.encode()
    )


def hub_alive(pid: int | None, name: str) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().split(b"\0")
    except OSError:
        return False
    return _hub_argv_matches(cmd, name)


def hub_pids(name: str) -> list[int]:
    """Every running hub of network `name`, also one whose pid never reached the state file (its `up` was
    killed right after starting it)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and hub_alive(int(p), name)]


def cleanup(name: str | None = None, *, directory=None, grace_s: float = 8.0) -> list[str]:
    """Remove network `name` (or every recorded network plus the default name): its hub, the processes in its
    namespaces, the namespaces (which takes their veths, bridge, TUNs and qdiscs along), its state file.
    Returns what it removed. Touches only objects named NAME-h<i>, NAME-sw, NAME-probe."""
    names = [name] if name else sorted(set(recorded_names(directory)) | {DEFAULT_NAME})
    removed = []
    for nm in names:
        for pid in hub_pids(nm):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + grace_s
            while hub_alive(pid, nm) and time.monotonic() < deadline:
                time.sleep(0.02)
            if hub_alive(pid, nm):
                os.kill(pid, signal.SIGKILL)
            removed.append(f"hub pid {pid}")
        for ns in owned_netns(nm, list_netns()):
            kill_netns_processes(ns, grace_s)
            run(["ip", "netns", "del", ns], check=False)
            removed.append(f"netns {ns}")
        removed += netem_cpu.remove(nm)  # after the processes in them are gone
        path = state_path(nm, directory)
        for leftover in (path.with_suffix(".hub.log"), path.with_suffix(".hub.json"), path):
            if leftover.exists():
                leftover.unlink()
                removed.append(str(leftover))
    return removed


class Network:
    """Emulated hosts with pairwise RTTs. See the module docstring; `backend` says which one runs."""

    def __init__(
        self,
        hosts: list[str],
        rtt_ms: list[list[float]],
        *,
        backend: str = "auto",
        bandwidth_bit_s: float | None = None,
        jitter_ms: float = 0.0,
        loss: float = 0.0,
        name: str = DEFAULT_NAME,
        subnet: str = DEFAULT_SUBNET,
        seed: int = 0,
        state_directory=None,
        detach: bool = False,
        hub_realtime: bool = True,
        log=None,
        cpu: dict[str | int, float] | None = None,
        behind_nat: list[str] | None = None,
    ):
        """`cpu`: host (name or index) -> CPU share in cores (e.g. 0.25) for the hosts that get one
        (netem/cpu.py: cgroup v2 cpu.max or v1 cfs quota; cores pinned where there are enough).
        `behind_nat`: hosts whose processes sit behind an emulated NAT router (netem/nat.py): they
        can reach every host, but no host can open a connection to them."""
        rtt = validate_rtt_matrix(hosts, rtt_ms)
        if bandwidth_bit_s is not None and not bandwidth_bit_s > 0:
            raise NetemError(f"bandwidth_bit_s must be positive (got {bandwidth_bit_s})")
        if not 0.0 <= loss < 1.0 or jitter_ms < 0:
            raise NetemError(f"loss must lie in [0, 1) and jitter_ms be >= 0 (got {loss}, {jitter_ms})")
        self.requested_backend = backend
        self.directory = state_directory
        self.detach = detach  # True (the CLI's `up`): leaving does not tear down; `down` does
        self.log = log or (lambda msg: None)
        self.state = NetworkState(
            name=name,
            backend="",
            hosts=list(hosts),
            addresses=host_addresses(len(hosts), subnet),
            rtt_ms=rtt,
            subnet=subnet,
            bandwidth_bit_s=bandwidth_bit_s,
            jitter_ms=jitter_ms,
            loss=loss,
            seed=seed,
            owner_pid=os.getpid(),
            extra={"hub_realtime": hub_realtime},
        )
        self.state.behind_nat = sorted({self.state.index(h) for h in behind_nat or ()})
        for i in self.state.behind_nat:
            nat_addresses(i)  # refuses an index it cannot give a private subnet, before anything exists
        self._prev_sigterm = None
        self._up = False
        self.cpu_shares = {self.state.index(h): float(v) for h, v in (cpu or {}).items()}

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "Network":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        if not self.detach:
            self.down()

    def up(self) -> "Network":
        require_capabilities(tc=self.requested_backend != "userspace", tun=self.requested_backend != "kernel")
        st = self.state
        tool = nat.nat_tool() if st.behind_nat else None  # missing tools: say so before creating anything
        if state_path(st.name, self.directory).exists() or owned_netns(st.name, list_netns()):
            raise NetworkExistsError(
                f"network {st.name!r} is already up (or a crashed run left it): "
                f"`petals-chain netem down --name {st.name}` removes it, or pick another name"
            )
        write_state(st, self.directory)  # first: whatever happens next, cleanup can find it
        self._up = True
        self._install_sigterm()
        try:
            st.backend, why = choose_backend(self.requested_backend, st.name)
            self.log(f"netem: backend {st.backend} ({why})")
            write_state(st, self.directory)
            for i in range(len(st.hosts)):
                ns = st.netns(i)
                run(["ip", "netns", "add", ns])
                run(["ip", "-n", ns, "link", "set", "lo", "up"])
                for key in ("all", "default"):  # IPv4 only: no router solicitations into the emulated links
                    run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv6.conf.{key}.disable_ipv6=1"])
            if st.backend == "kernel":
                kernel.apply(st)
            else:
                self._start_hub()
            for i in st.behind_nat:
                nat.apply_nat(st, i, tool)
            if st.behind_nat:
                self.log(
                    f"netem: behind NAT ({tool}): "
                    + ", ".join(f"{st.hosts[i]} {st.process_address(i)}" for i in st.behind_nat)
                )
            if self.cpu_shares:
                shares = netem_cpu.apply(st.name, self.cpu_shares)
                st.extra["cpu"] = {
                    str(i): {
                        "group": s.group,
                        "cores": s.cores,
                        "procs": list(s.procs_files),
                        "cpuset": s.cpuset,
                        "daemons_group": s.daemons_group,
                        "daemons_procs": list(s.daemons_procs_files),
                    }
                    for i, s in shares.items()
                }
                write_state(st, self.directory)
                self.log(
                    "netem: CPU shares "
                    + ", ".join(
                        f"{st.hosts[i]}={s.cores:g}" + (f" (core {s.cpuset})" if s.cpuset else "")
                        for i, s in shares.items()
                    )
                )
        except BaseException:
            self.down()
            raise
        return self

    def _start_hub(self) -> None:
        st = self.state
        log_path = state_path(st.name, self.directory).with_suffix(".hub.log")
        argv = [sys.executable, "-m", "netem.hub", st.name] + ([str(self.directory)] if self.directory else [])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                p
                for p in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH"))
                if p
            ),
        }
        with open(log_path, "ab") as log_fh:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log_fh, start_new_session=True, env=env
            )
        st.hub_pid = proc.pid
        write_state(st, self.directory)
        ready, _, _ = select.select([proc.stdout], [], [], HUB_START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line.strip() != b"ready":
            proc.kill()
            raise NetemError(
                f"the delay hub did not start within {HUB_START_TIMEOUT_S:.0f} s; its log: {log_path}: "
                + log_path.read_text()[-2000:]
            )
        self._hub = proc

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        self._restore_sigterm()
        hub = getattr(self, "_hub", None)
        cleanup(self.state.name, directory=self.directory)
        if hub is not None:
            hub.wait(timeout=10)  # reap our child

    def _install_sigterm(self) -> None:
        import threading

        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:

            def _term(*_):
                raise SystemExit(128 + signal.SIGTERM)  # unwinds through __exit__, which tears down

            self._prev_sigterm = signal.signal(signal.SIGTERM, _term)

    def _restore_sigterm(self) -> None:
        if self._prev_sigterm is not None:
            signal.signal(signal.SIGTERM, self._prev_sigterm)
            self._prev_sigterm = None

    # -- the API ---------------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        return self.state.backend

    @property
    def hosts(self) -> list[str]:
        return list(self.state.hosts)

    @property
    def name(self) -> str:
        return self.state.name

    def address(self, host: str | int) -> str:
        """The address the host's processes listen on: a private one for a host behind a NAT."""
        return self.state.process_address(self.state.index(host))

    def wan_address(self, host: str | int) -> str:
        """The host's address on the emulated WAN (its router's, for a host behind a NAT)."""
        return self.state.addresses[self.state.index(host)]

    def netns(self, host: str | int) -> str:
        """The namespace the host's processes run in (the private one behind a NAT)."""
        return self.state.process_netns(self.state.index(host))

    def behind_nat(self, host: str | int) -> bool:
        return self.state.index(host) in self.state.behind_nat

    def command(self, host: str | int, argv: list[str]) -> list[str]:
        return command_in(self.state, host, argv)

    def prefix(self, host: str | int) -> list[str]:
        """The argv prefix that runs a command inside the host (`prefix(h) + argv == command(h, argv)`):
        in its namespace, and in its CPU groups when it has a share."""
        return _host_prefix(self.state, host)

    @contextmanager
    def cpu_unlimited(self) -> Iterator[None]:
        """Lift every host's CPU quota for the duration, then set it again: for work nobody measures
        (processes importing and loading weights at a tenth of a core took minutes). Servers keep
        profiling as devices of their share: the profile counts CPU seconds divided by the share
        (server/range_profile.py), and the share comes from $PETALS_CHAIN_CPU_SHARE."""
        shares = self.state.extra.get("cpu", {}) if self.state is not None else {}
        if not shares:
            yield
            return
        layout = netem_cpu.detect()
        for s in shares.values():
            netem_cpu.set_quota(layout, s["group"], None)
        try:
            yield
        finally:
            for s in shares.values():
                netem_cpu.set_quota(layout, s["group"], s["cores"])

    def cpu_report(self) -> dict[str, dict]:
        """Per host with a CPU share: the share (cores), the pinned core, CPU seconds used so far and
        seconds held back by the quota (the experiment turns them into measured use), and the CPU
        seconds of its exempted daemons (`daemons_cpu_s`, outside the share)."""
        return cpu_report(self.state)

    def exempt(self, host: str | int, pids: list[int]) -> list[int]:
        """Move processes of `host` out of its CPU share into its daemons group (no quota, still
        measured): what a real host runs on its own CPU beside the device (netem/cpu.py). Returns the
        pids moved; none when the host has no share."""
        share = self.state.extra.get("cpu", {}).get(str(self.state.index(host)))
        if share is None or not share.get("daemons_procs"):
            return []
        return netem_cpu.exempt(tuple(share["daemons_procs"]), pids)

    def popen(self, host: str | int, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), **popen_kwargs)

    def set_rtt_ms(self, rtt_ms: list[list[float]]) -> None:
        """Change the emulated RTTs of a running network (same hosts): packets already in flight keep
        their delays, later ones get the new ones."""
        self.state.rtt_ms = validate_rtt_matrix(self.state.hosts, rtt_ms)
        write_state(self.state, self.directory)
        if self.state.backend == "kernel":
            for cmd in kernel.change_delays_programme(self.state):
                run(cmd)
        elif not hub_alive(self.state.hub_pid, self.state.name):
            raise NetemError(f"the delay hub of network {self.state.name} is not running; bring the network up again")
        else:
            os.kill(self.state.hub_pid, signal.SIGHUP)

    def measure_rtt_ms(self, probes: int = 5) -> list[list[float]]:
        return measure_state_rtt_ms(self.state, probes=probes)

    @classmethod
    def attach(cls, name: str = DEFAULT_NAME, state_directory=None) -> "Network":
        """A handle on a network that `petals-chain netem up` (another process) brought up; never tears it down."""
        st = read_state(name, state_directory)
        net = cls.__new__(cls)
        net.state, net.directory, net.detach, net._up, net._prev_sigterm = st, state_directory, True, False, None
        net.requested_backend, net.log = st.backend, (lambda msg: None)
        return net


def _host_prefix(state: NetworkState, host: str | int) -> list[str]:
    i = state.index(host)
    base = ["ip", "netns", "exec", state.process_netns(i)]  # behind a NAT: its private namespace
    share = state.extra.get("cpu", {}).get(str(i))
    # the cgroup wrapper runs outside the namespace: `ip netns exec` remounts /sys for the namespace
    return base if share is None else netem_cpu.enter_argv(tuple(share["procs"]), base, cores=share["cores"])


def cpu_report(state: NetworkState) -> dict[str, dict]:
    shares = state.extra.get("cpu", {})
    if not shares:
        return {}
    layout = netem_cpu.detect()
    return {
        state.hosts[int(i)]: {
            "cores": s["cores"],
            "cpuset": s["cpuset"],
            "cpu_s": netem_cpu.usage_s(layout, s["group"]),
            "throttled_s": netem_cpu.throttled_s(layout, s["group"]),
            "daemons_cpu_s": (netem_cpu.usage_s(layout, s["daemons_group"]) if s.get("daemons_group") else None),
        }
        for i, s in shares.items()
    }


def command_in(state: NetworkState, host: str | int, argv: list[str]) -> list[str]:
    """argv run inside the host's namespace (`ip netns exec`) and CPU groups, keeping the caller's
    user, cwd and env."""
    if not argv:
        raise NetemError("no command given to run inside the host")
    return [*_host_prefix(state, host), *argv]  # same as Network.prefix


def measure_state_rtt_ms(state: NetworkState, probes: int = 5) -> list[list[float]]:
    n = len(state.hosts)
    return measure_rtt_ms([state.netns(i) for i in range(n)], state.addresses, probes=probes)


__all__ = ["Network", "cleanup", "choose_backend", "command_in", "hub_alive", "state_dir"]
