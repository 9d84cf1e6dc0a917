"""Compute isolation for emulated hosts: each host a CPU share of its own, as each has its own network.

An emulated host with `cpu = 0.25` may use a quarter of one core per period, however busy the other
hosts are, so a server is an independent device of a stated speed (the paper's servers were MIG
slices), not a process competing with eight others for two cores.

- cgroup v2 (`/sys/fs/cgroup` is cgroup2 with the `cpu` controller): `cpu.max = "QUOTA PERIOD"`,
  usage from `cpu.stat` (`usage_usec`);
- cgroup v1 (what a Docker host on cgroup v1 has): `cpu.cfs_quota_us` / `cpu.cfs_period_us` in the
  `cpu` hierarchy, usage from `cpuacct.usage` (nanoseconds) in the `cpuacct` hierarchy (mounted
  apart or together with `cpu`);
- cpusets where cores allow (v1): when there are at least as many cores as limited hosts, host i
  is pinned to core i (`cpuset.cpus`), so no two hosts' threads share a core; otherwise no cpuset
  (hosts share the cores, each within its quota).

Every group is `<hierarchy>/petals-chain-netem/NAME-h<i>` (named like the host's namespace), so
`cleanup` finds and removes the groups of a run that crashed, after the processes in them are gone.
A process enters its host's groups by the `enter_argv` wrapper (`sh` writes its pid to each group's
`cgroup.procs`, then `exec`s the command): its children inherit them.

Each host also has a daemons group, `NAME-h<i>-daemons` (cpu and cpuacct only, no quota, measured):
`exempt` moves processes there that a real host runs on its own CPU beside the device the share
stands for (a server's hivemind DHT process and p2p daemon: the paper's MIG slice does not run
them). Why: in the Table 1 runs those two used 0.019 cores per server host, steadily (DHT stores
every 2 s by each server, the orchestrator's reads), 16 % of a 0.12-core slow host's share, so the
emulated device was that much slower than its stated share whenever it was busy.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from netem.errors import NetemError

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "petals-chain-netem"
# Why 10 ms and not the kernel's default 100 ms: CFS enforces a quota per period, so a host with
# 0.12 cores and a 100-ms period runs a short step at full speed while its 12 ms last, then waits
# up to 88 ms for the next period. A decode step (a few ms of CPU) then takes either its CPU time or
# up to a period more: the live fits of the Table 1 run saw 0.1-0.15 s of per-step overhead on such
# hosts, which a MIG slice (a steady, slower device) does not have. A 10-ms period bounds that wait
# to under 10 ms; the kernel's floor for a quota is 1 ms, so hosts below 0.1 cores get a longer period.
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel refuses shorter quotas
MAX_PERIOD_US = 1_000_000  # and longer periods


def quota_period_us(cores: float) -> tuple[int, int]:
    """(quota, period) in microseconds for a share of `cores` per period: PERIOD_US, or the shortest
    period whose quota is at least the kernel's 1 ms."""
    if not cores > 0:
        raise NetemError(f"a CPU share must be positive, got {cores}")
    # the share in millionths of a core, so the period's ceiling is exact integer arithmetic
    micro_cores = max(1, int(cores * 1_000_000))
    period = min(MAX_PERIOD_US, max(PERIOD_US, -(-MIN_QUOTA_US * 1_000_000 // micro_cores)))
    return max(MIN_QUOTA_US, int(round(cores * period))), period


class CpuLimitUnavailableError(NetemError):
    """CPU shares cannot be applied here; the message says why and what to do instead."""


@dataclass(frozen=True)
class CgroupLayout:
    """Where the groups live: `version` 1 or 2, the hierarchy directories used."""

    version: int
    cpu: Path  # cpu.max (v2) or cpu.cfs_quota_us (v1)
    acct: Path  # cpu.stat (v2) or cpuacct.usage (v1)
    cpuset: Path | None  # None: no cpuset controller usable


def detect(root: Path = CGROUP_ROOT) -> CgroupLayout:
    """The cgroup layout of this machine, or CpuLimitUnavailableError saying why none is usable."""
    controllers = root / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        parent = root
        sub = root / "cgroup.subtree_control"
        if sub.is_file() and "cpu" not in sub.read_text().split():
            try:  # v2: children get the cpu controller only when the parent delegates it
                sub.write_text("+cpu")
            except OSError as e:
                raise CpuLimitUnavailableError(
                    f"cgroup v2: cannot enable the cpu controller in {sub} ({e}); "
                    "run as root on the host, or without --cpu"
                ) from None
        # v2 pins no cores: the cpuset controller would need delegating too, and the quota is the point
        return CgroupLayout(2, parent, parent, None)
    cpu = next((p for p in (root / "cpu", root / "cpu,cpuacct") if (p / "cpu.cfs_quota_us").is_file()), None)
    if cpu is None:
        raise CpuLimitUnavailableError(
            f"no cgroup cpu controller under {root} (neither v2 cpu.max nor v1 cpu.cfs_quota_us); "
            "run without --cpu, or on a host that mounts cgroups"
        )
    acct = next((p for p in (root / "cpuacct", cpu) if (p / "cpuacct.usage").is_file()), None)
    if acct is None:
        raise CpuLimitUnavailableError(f"cgroup v1 without cpuacct under {root}: CPU use cannot be measured")
    cpuset = root / "cpuset" if (root / "cpuset" / "cpuset.cpus").is_file() else None
    return CgroupLayout(1, cpu, acct, cpuset)


def writable(layout: CgroupLayout) -> str | None:
    """None when groups can be made here, else the reason (tests skip with it)."""
    for d in {layout.cpu, layout.acct}:
        if not os.access(d, os.W_OK):
            return f"{d} is not writable (cgroups need root, and a container needs a writable /sys/fs/cgroup)"
    return None


def parse_shares(text: str) -> tuple[float | None, dict[str, float]]:
    """`0.25` (every host) or `KEY=0.25,KEY2=0.5` (per host or role; `*=0.1` for the rest) ->
    (default share, per-key shares). Shares are cores per period, > 0."""
    default, per = None, {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, eq, value = part.rpartition("=")
        try:
            share = float(value)
        except ValueError:
            share = float("nan")
        if not share > 0:
            raise NetemError(f"--cpu {text!r}: {part!r} is not a positive share of a core (e.g. 0.25, or fast=0.2)")
        if not eq or key == "*":
            default = share
        else:
            per[key] = share
    if default is None and not per:
        raise NetemError(f"--cpu {text!r}: give a share (0.25) or KEY=SHARE pairs")
    return default, per


SHARE_ENV = "PETALS_CHAIN_CPU_SHARE"  # set by `enter_argv` for what it starts inside a share


def own_cpu_share() -> float | None:
    """The calling process's CPU quota in cores (cgroup v2 cpu.max or v1 cfs quota), None when unlimited.

    Inside a netem host the cgroup files are not visible: `ip netns exec` remounts /sys for the
    namespace, and the cgroup mounts under /sys/fs/cgroup go with it. So the share that `enter_argv`
    put the process into, passed down in $PETALS_CHAIN_CPU_SHARE, is the answer where it is set
    (without it a server in a 0.19-core host profiled itself as a whole core and announced a device
    5x too fast); it also stands while `Network.cpu_unlimited` lifts the quota for loading."""
    try:
        env = float(os.environ.get(SHARE_ENV, ""))
    except ValueError:
        env = 0.0
    if env > 0:  # the host's share stands even while its quota is lifted (Network.cpu_unlimited)
        return env
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    quota = _cgroup_quota(lines)
    return None if quota is _UNREADABLE else quota


_UNREADABLE = object()


def _cgroup_quota(lines: list[str]):
    """The quota in cores from the first readable cpu controller (None: unlimited), or _UNREADABLE."""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max"
            try:
                quota, period = f.read_text().split()
                return None if quota == "max" else int(quota) / int(period)
            except (OSError, ValueError):
                continue
        if "cpu" in controllers.split(","):
            base = Path("/sys/fs/cgroup") / controllers / path.lstrip("/")
            try:
                quota = int((base / "cpu.cfs_quota_us").read_text())
                period = int((base / "cpu.cfs_period_us").read_text())
                return None if quota < 0 else quota / period
            except (OSError, ValueError):
                continue
    return _UNREADABLE


def group_name(network: str, i: int) -> str:
    return f"{network}-h{i}"


DAEMONS_SUFFIX = "-daemons"


def daemons_group_name(network: str, i: int) -> str:
    return f"{group_name(network, i)}{DAEMONS_SUFFIX}"


def _dirs(layout: CgroupLayout, name: str, with_cpuset: bool) -> list[Path]:
    out = [layout.cpu / PARENT / name]
    if layout.acct != layout.cpu:
        out.append(layout.acct / PARENT / name)
    if with_cpuset and layout.cpuset is not None and layout.cpuset not in (layout.cpu, layout.acct):
        out.append(layout.cpuset / PARENT / name)
    return out


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _mkdir(path: Path, inherit_cpuset_from: Path | None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if inherit_cpuset_from is not None:  # v1 cpuset: a group takes no task before cpus and mems are set
        for f in ("cpuset.cpus", "cpuset.mems"):
            if not (path / f).read_text().strip():
                (path / f).write_text((inherit_cpuset_from / f).read_text().strip() or "0")


@dataclass(frozen=True)
class HostShare:
    group: str
    cores: float  # the share: cores per period
    procs_files: tuple[str, ...]  # the cgroup.procs files a process of this host enters
    cpuset: str | None  # cores it is pinned to, or None
    daemons_group: str = ""  # its daemons group (no quota): `exempt` moves processes there
    daemons_procs_files: tuple[str, ...] = ()


def apply(network: str, shares: dict[int, float], layout: CgroupLayout | None = None) -> dict[int, HostShare]:
    """Make and configure the groups of the hosts in `shares` (host index -> cores, > 0)."""
    layout = layout or detect()
    why = writable(layout)
    if why:
        raise CpuLimitUnavailableError(f"cannot give emulated hosts CPU shares: {why}; run without --cpu")
    cores = _cores()
    pin = layout.cpuset is not None and len(shares) <= len(cores)
    out: dict[int, HostShare] = {}
    for k, (i, share) in enumerate(sorted(shares.items())):
        if not share > 0:
            raise NetemError(f"a CPU share must be positive, got {share} for host {i}")
        name = group_name(network, i)
        dirs = _dirs(layout, name, pin)
        cpuset = None
        for d in dirs:
            is_cpuset = layout.cpuset is not None and d.is_relative_to(layout.cpuset) and pin
            _mkdir(d.parent, layout.cpuset / "" if (is_cpuset and layout.version == 1) else None)
            _mkdir(d, d.parent if (is_cpuset and layout.version == 1) else None)
        set_quota(layout, name, share)
        if pin:
            cpuset = str(cores[k % len(cores)])
            cs_dir = layout.cpuset / PARENT / name
            (cs_dir / "cpuset.cpus").write_text(cpuset)
        daemons = daemons_group_name(network, i)
        daemon_dirs = _dirs(layout, daemons, with_cpuset=False)  # cpu and cpuacct: unlimited, measured
        for d in daemon_dirs:
            _mkdir(d, None)
        set_quota(layout, daemons, None)
        out[i] = HostShare(
            name,
            share,
            tuple(str(d / "cgroup.procs") for d in dirs),
            cpuset,
            daemons,
            tuple(str(d / "cgroup.procs") for d in daemon_dirs),
        )
    return out


def exempt(procs_files: tuple[str, ...], pids: list[int]) -> list[int]:
    """Move `pids` (whole processes) into a host's daemons group (`HostShare.daemons_procs_files`):
    they stop counting against the host's share. Returns the pids moved (a process that exited
    meanwhile is skipped)."""
    moved = []
    for pid in pids:
        try:
            for f in procs_files:
                Path(f).write_text(str(pid))
            moved.append(pid)
        except ProcessLookupError:  # ESRCH: the process is gone
            continue
        except OSError as e:
            raise NetemError(f"cannot move process {pid} into {procs_files}: {e}") from e
    return moved


def set_quota(layout: CgroupLayout, group: str, cores: float | None) -> None:
    """Set a host group's quota to `cores` per period, or lift it (None: unlimited)."""
    cpu_dir = layout.cpu / PARENT / group
    quota_us, period_us = (-1, PERIOD_US) if cores is None else quota_period_us(cores)
    if layout.version == 2:
        (cpu_dir / "cpu.max").write_text(f"{'max' if quota_us < 0 else quota_us} {period_us}")
    else:
        (cpu_dir / "cpu.cfs_period_us").write_text(str(period_us))
        (cpu_dir / "cpu.cfs_quota_us").write_text(str(quota_us))


def enter_argv(procs_files: tuple[str, ...], argv: list[str], cores: float | None = None) -> list[str]:
    """argv run inside the groups: `sh` moves itself into them, then becomes the command (with
    $PETALS_CHAIN_CPU_SHARE = `cores`, for a command that cannot read its cgroup: `own_cpu_share`)."""
    writes = " && ".join(f'echo $$ > "${{{k + 1}}}"' for k in range(len(procs_files)))
    export = "" if cores is None else f" && export {SHARE_ENV}={float(cores)!r}"
    script = f'{writes}{export} && shift {len(procs_files)} && exec "$@"'
    return ["sh", "-c", script, "netem-cpu", *procs_files, *argv]


def usage_s(layout: CgroupLayout, group: str) -> float | None:
    """CPU seconds the group's processes used so far (None when the group is gone)."""
    try:
        if layout.version == 2:
            for line in (layout.acct / PARENT / group / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return None
        return int((layout.acct / PARENT / group / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return None


def throttled_s(layout: CgroupLayout, group: str) -> float | None:
    """Seconds the group was held back by its quota (v1 throttled_time ns, v2 throttled_usec)."""
    try:
        for line in (layout.cpu / PARENT / group / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_usec":
                return int(value) / 1e6
            if key == "throttled_time":
                return int(value) / 1e9
    except (OSError, ValueError):
        pass
    return None


def owned_groups(network: str, layout: CgroupLayout) -> list[Path]:
    """Every group directory of network `network` (NAME-h<i>, NAME-h<i>-daemons) in every hierarchy used."""
    pat = re.compile(rf"^{re.escape(network)}-h\d+({re.escape(DAEMONS_SUFFIX)})?$")
    out = []
    for h in {layout.cpu, layout.acct, *([layout.cpuset] if layout.cpuset else [])}:
        parent = h / PARENT
        if parent.is_dir():
            out += [d for d in parent.iterdir() if d.is_dir() and pat.match(d.name)]
    return sorted(out)


def remove(network: str, layout: CgroupLayout | None = None) -> list[str]:
    """Remove the groups of `network` (their processes must be gone: cleanup kills them first; a task
    still inside is moved to the parent first so the group can go). Returns what it removed."""
    try:
        layout = layout or detect()
    except CpuLimitUnavailableError:
        return []
    removed = []
    for d in owned_groups(network, layout):
        procs = d / "cgroup.procs"
        try:
            for pid in procs.read_text().split():
                (d.parent.parent / "cgroup.procs").write_text(pid)  # to the hierarchy's root group
        except OSError:
            pass
        try:
            d.rmdir()
            removed.append(f"cgroup {d}")
        except OSError:
            pass
    for h in {layout.cpu, layout.acct, *([layout.cpuset] if layout.cpuset else [])}:
        try:  # the shared parent goes with the last network's groups
            (h / PARENT).rmdir()
        except OSError:
            pass  # absent, or another network's groups still in it
    return removed
