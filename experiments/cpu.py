"""How busy the CPUs were during a replay: our processes (each swarm process and its children, e.g.
p2p daemons) and the whole machine (everyone on it, other users included)."""

from __future__ import annotations

import os
import time

import psutil


def _tree(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            out += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return out


def _cpu_s(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


class CpuMeter:
    """`m = CpuMeter(pids); m.add(pid); m.sample() now and then; m.report()` -> CPU-seconds of our
    processes and the machine's busy fraction. Sampling keeps the CPU time of processes that exit
    before the report (their last sample counts)."""

    def __init__(self, pids: list[int], clock=time.monotonic):
        self.clock = clock
        self.pids = list(pids)
        self.t0 = clock()
        self.machine0 = psutil.cpu_times()
        self.ours0 = _cpu_s(_tree(self.pids))
        self.last = dict(self.ours0)

    def add(self, pid: int) -> None:
        self.pids.append(pid)

    def sample(self) -> None:
        self.last.update(_cpu_s(_tree(self.pids)))

    def report(self) -> dict:
        self.sample()
        wall = self.clock() - self.t0
        used = sum(v - self.ours0.get(pid, 0.0) for pid, v in self.last.items())
        m0, m1 = self.machine0, psutil.cpu_times()
        busy = lambda t: t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)  # noqa: E731
        total = lambda t: busy(t) + t.idle + getattr(t, "iowait", 0.0)  # noqa: E731
        n = os.cpu_count() or 1
        return {
            "wall_s": wall,
            "ours_cpu_s": used,
            "ours_cores": used / wall if wall > 0 else 0.0,
            "n_cpus": n,
            "machine_busy": (busy(m1) - busy(m0)) / max(1e-9, total(m1) - total(m0)),
            # niced work (e.g. other jobs run with `nice -n 19` beside an experiment) gets CPU only
            # when ours does not want it, but it is part of "busy"
            "machine_nice": (m1.nice - m0.nice) / max(1e-9, total(m1) - total(m0)),
        }
