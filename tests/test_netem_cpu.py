"""CPU shares for emulated hosts (netem/cpu.py): a share is applied (a busy process gets about its
share of a core), reported, and removed by cleanup, also after a crash. Needs writable cgroups
(and, for the network test, root with /dev/net/tun); skips saying why otherwise. Every group and
network is removed in a finally/fixture even when a test fails."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

import netem
from netem import cpu as netem_cpu
from netem.errors import MissingCapabilityError
from netem.system import require_capabilities

BUSY_S = 1.5
BUSY = f"import time\nt = time.time()\nwhile time.time() - t < {BUSY_S}: pass"


def test_quota_and_period_keep_the_share_and_the_kernels_1_ms_floor():
    assert netem_cpu.quota_period_us(0.2) == (2_000, 10_000)
    assert netem_cpu.quota_period_us(1.5) == (15_000, 10_000)  # more than a core: quota > period
    assert netem_cpu.quota_period_us(0.05) == (1_000, 20_000)  # below 0.1 cores the period grows
    assert netem_cpu.quota_period_us(0.0001) == (1_000, 1_000_000)  # the kernel's longest period
    for cores in (0.013, 0.05, 0.12, 0.193, 0.5, 2.0):
        quota, period = netem_cpu.quota_period_us(cores)
        assert quota >= 1_000 and 10_000 <= period <= 1_000_000
        assert quota / period == pytest.approx(cores, rel=0.01)
    with pytest.raises(netem.errors.NetemError, match="positive"):
        netem_cpu.quota_period_us(0.0)


@pytest.fixture
def layout():
    try:
        lay = netem_cpu.detect()
    except netem_cpu.CpuLimitUnavailableError as e:
        pytest.skip(str(e))
    why = netem_cpu.writable(lay)
    if why:
        pytest.skip(why)
    return lay


def test_a_share_caps_a_busy_process_and_cleanup_removes_the_groups(layout):
    name = "c" + uuid.uuid4().hex[:6]
    try:
        shares = netem_cpu.apply(name, {0: 0.2, 1: 1.0}, layout)
        assert {s.cores for s in shares.values()} == {0.2, 1.0}
        assert len(netem_cpu.owned_groups(name, layout)) >= 2
        started = time.monotonic()
        procs = [
            subprocess.Popen(netem_cpu.enter_argv(shares[i].procs_files, [sys.executable, "-c", BUSY])) for i in (0, 1)
        ]
        for p in procs:
            assert p.wait(timeout=60) == 0
        wall_s = time.monotonic() - started
        capped, free = (netem_cpu.usage_s(layout, shares[i].group) for i in (0, 1))
        # the capped host got at most its fifth of a core over the wall time it ran (the interpreter's
        # start-up included, which a loaded machine stretches), plus a period of slack; how much more
        # the whole-core host got depends on how busy the machine is, so only its accounting is checked
        assert 0 < capped <= 0.2 * wall_s + 0.1, (capped, wall_s)
        assert free > 0 and netem_cpu.throttled_s(layout, shares[0].group) is not None
        group = layout.cpu / netem_cpu.PARENT / shares[0].group
        if layout.version == 2:
            quota, period = (int(v) for v in (group / "cpu.max").read_text().split())
        else:
            quota, period = (int((group / f).read_text()) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        assert (quota, period) == (2_000, 10_000)  # 0.2 of a 10 ms period
    finally:
        removed = netem_cpu.remove(name, layout)
    assert removed and not netem_cpu.owned_groups(name, layout)


def _need_tun() -> None:
    """The userspace backend's hosts need root and /dev/net/tun: skip saying which is missing."""
    try:
        require_capabilities(tc=False, tun=True)
    except MissingCapabilityError as e:
        pytest.skip(str(e))


def test_a_network_host_with_a_share_runs_in_its_groups_and_down_removes_them(layout):
    _need_tun()
    name = "c" + uuid.uuid4().hex[:6]
    try:
        with netem.Network(["a", "b"], [[0, 10], [10, 0]], backend="userspace", name=name, cpu={"a": 0.25}) as net:
            assert net.prefix("b")[:3] == ["ip", "netns", "exec"]  # no share: no group
            out = subprocess.run(
                net.command("a", ["cat", "/proc/self/cgroup"]), capture_output=True, text=True, timeout=30, check=True
            ).stdout
            assert f"{name}-h0" in out
            # a server in the host must see its share (the start-up profile is keyed and timed by it),
            # although `ip netns exec` hides the cgroup files: through $PETALS_CHAIN_CPU_SHARE
            code = "from netem.cpu import own_cpu_share; print(own_cpu_share())"
            shares = [
                subprocess.run(
                    net.command(h, [sys.executable, "-c", code]), capture_output=True, text=True, timeout=60, check=True
                ).stdout.strip()
                for h in ("a", "b")
            ]
            assert shares == ["0.25", "None"]
            used_before_s = net.cpu_report()["a"]["cpu_s"]
            started = time.monotonic()
            subprocess.run(net.command("a", [sys.executable, "-c", BUSY]), timeout=60, check=True)
            wall_s = time.monotonic() - started
            report = net.cpu_report()
            assert set(report) == {"a"} and report["a"]["cores"] == 0.25
            # the quota caps use at a quarter of the wall time the run took (its interpreter's start
            # included, which a loaded machine stretches), plus one 100-ms period of slack
            assert 0 < report["a"]["cpu_s"] - used_before_s <= 0.25 * wall_s + 0.1, (report["a"], wall_s)
            quota_file = (
                layout.cpu
                / netem_cpu.PARENT
                / f"{name}-h0"
                / ("cpu.max" if layout.version == 2 else "cpu.cfs_quota_us")
            )
            with net.cpu_unlimited():  # loading nobody measures: no quota, the share still announced
                assert quota_file.read_text().split()[0] in ("max", "-1")
                lifted = subprocess.run(
                    net.command("a", [sys.executable, "-c", code]),
                    capture_output=True,
                    text=True,
                    timeout=60,
                    check=True,
                ).stdout.strip()
                assert lifted == "0.25"
            assert int(quota_file.read_text().split()[0]) == 2_500  # 0.25 of the 10-ms period
        assert not netem_cpu.owned_groups(name, layout)
    finally:
        netem.cleanup(name)
    assert not netem_cpu.owned_groups(name, layout)


def test_cleanup_removes_the_groups_a_crashed_run_left(layout):
    name = "c" + uuid.uuid4().hex[:6]
    netem_cpu.apply(name, {3: 0.5}, layout)  # as if `up` died right after making them
    try:
        assert netem_cpu.owned_groups(name, layout)
        netem.cleanup(name)
        assert not netem_cpu.owned_groups(name, layout)
    finally:
        netem_cpu.remove(name, layout)


# a process that starts a real hivemind DHT (its forked DHT process starts the p2p daemon), as a
# server does, says so, and lives until its stdin closes
DHT_HOLDER = """
import sys
from petals_chain.process.signals import start_dht
dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
print("ready", flush=True)
sys.stdin.read()
dht.shutdown()
"""


def _proc_file(pid: int, name: str) -> str:
    with open(f"/proc/{pid}/{name}") as f:
        return f.read()


def _cgroups_of(pid: int) -> str:
    return _proc_file(pid, "cgroup")


def test_a_servers_dht_daemons_leave_the_share_and_are_still_measured(layout):
    from experiments.hosts import daemon_pids

    _need_tun()
    name = "c" + uuid.uuid4().hex[:6]
    holder = None
    try:
        with netem.Network(["a", "b"], [[0, 10], [10, 0]], backend="userspace", name=name, cpu={"a": 0.25}) as net:
            with net.cpu_unlimited():  # importing hivemind at a quarter of a core is slow, and not the point
                holder = subprocess.Popen(
                    net.command("a", [sys.executable, "-c", DHT_HOLDER]),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                assert holder.stdout.readline().strip() == "ready"
            pids = daemon_pids(holder.pid)
            names = {pid: _proc_file(pid, "comm").strip() for pid in pids}
            assert "p2pd" in names.values() and len(pids) == 2, names  # the DHT process and its daemon
            assert all(f"{name}-h0" in _cgroups_of(pid) for pid in pids)
            assert net.exempt("b", pids) == []  # a host without a share has nothing to leave
            assert sorted(net.exempt("a", pids)) == sorted(pids)
            for pid in pids:
                assert f"{name}-h0-daemons" in _cgroups_of(pid), _cgroups_of(pid)
            holder_groups = _cgroups_of(holder.pid)  # the server itself stays inside its share
            assert f"{name}-h0" in holder_groups and f"{name}-h0-daemons" not in holder_groups
            report = net.cpu_report()["a"]
            assert report["daemons_cpu_s"] is not None and report["daemons_cpu_s"] >= 0.0
            assert len(netem_cpu.owned_groups(name, layout)) >= 2
            holder.stdin.close()
            assert holder.wait(timeout=60) == 0
        assert not netem_cpu.owned_groups(name, layout)  # both groups of the host went with the network
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        netem.cleanup(name)
    assert not netem_cpu.owned_groups(name, layout)
