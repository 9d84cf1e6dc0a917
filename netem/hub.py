"""The userspace delay hub: one process holding every host's TUN file descriptor.

Each host namespace routes the emulated subnet into its TUN device. The hub reads each IPv4
packet, finds the destination host by address, and releases the packet into the destination's
TUN after (a) the source link's serialisation time at `bandwidth_bit_s` and (b) the pair's one-way
delay RTT/2 (+ uniform jitter); loss drops a packet with that probability. Timers are a heap.

`python -m netem.hub STATE.json` creates the TUN devices (in its own namespace, then moved into
the hosts' namespaces: the file descriptors stay attached), prints `ready`, and serves until
SIGTERM/SIGINT. TUN devices vanish with the process, so a killed hub leaves none behind.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from netem.state import NetworkState, read_state, state_dir, tun_dev
from netem.system import run

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
# Jumbo frames. Why not larger: at 64 KiB the receiving kernel often stopped growing a connection's TCP
# window (rcv_ssthresh stuck at 81-99 KB: a 64-KiB packet's buffer overhead), so a fresh connection
# moved ~81 KB per RTT (a 4.6 MB transfer 2.8 s at 50 ms instead of ~0.4 s; tests/test_netem_emulation.py
# ::test_receive_window_grows_both_ways_on_a_session_like_stream). Why not 1500, the real WAN's: the hub
# then carried 218 MB/s against 880 at 9000 and was up to 14.6 ms late (p90) under bulk load on 2 cores.
TUN_MTU_BYTES = 9000
HUB_NICE = -10
HUB_RT_PRIORITY = 1
READ_BURST = 64  # packets drained per device per wake-up, so one busy host cannot starve the others


@dataclass
class LinkModel:
    """When each packet reaches its destination (pure: no I/O, clock and RNG passed in).

    deliver = depart + one_way_s[src][dst] + U(-jitter, +jitter), where depart is when the source's
    uplink finishes serialising it (a FIFO at `rate_bytes_per_s`; none = infinite); a packet that
    would wait behind more than `queue_limit_bytes` is dropped (tail drop, like a router buffer).
    Deliveries of one pair never overtake each other (jitter would reorder TCP segments otherwise).
    """

    one_way_s: np.ndarray  # (n, n)
    rate_bytes_per_s: float | None = None
    jitter_s: float = 0.0
    loss: float = 0.0
    queue_limit_bytes: int = 16 * 2**20
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def __post_init__(self) -> None:
        n = len(self.one_way_s)
        self.uplink_free_at_s = [0.0] * n
        self.last_delivery_s = np.zeros((n, n))
        self.dropped = 0

    def schedule(self, src: int, dst: int, size_bytes: int, now_s: float) -> float | None:
        """Delivery time of a packet read at `now_s`, or None when it is dropped."""
        if self.loss > 0 and self.rng.random() < self.loss:
            self.dropped += 1
            return None
        depart = now_s
        if self.rate_bytes_per_s:
            start = max(now_s, self.uplink_free_at_s[src])
            if (start - now_s) * self.rate_bytes_per_s > self.queue_limit_bytes:
                self.dropped += 1
                return None
            depart = start + size_bytes / self.rate_bytes_per_s
            self.uplink_free_at_s[src] = depart
        deliver = depart + self.one_way_s[src][dst]
        if self.jitter_s > 0:
            deliver = max(depart, deliver + self.rng.uniform(-self.jitter_s, self.jitter_s))
        deliver = max(deliver, self.last_delivery_s[src][dst])
        self.last_delivery_s[src][dst] = deliver
        return float(deliver)


def open_tun(dev: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def setup_tuns(state: NetworkState) -> list[int]:
    """Create each host's TUN, move it into the host's namespace and give it the host's address
    with a route for the whole emulated subnet (and nothing else: no default route)."""
    prefix = state.subnet.split("/")[1]
    fds = []
    for i, addr in enumerate(state.addresses):
        dev, ns = tun_dev(state.name, i), state.netns(i)
        fds.append(open_tun(dev))
        run(["ip", "link", "set", dev, "netns", ns])
        run(["ip", "-n", ns, "link", "set", dev, "mtu", str(TUN_MTU_BYTES), "up"])
        run(["ip", "-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", dev])
    return fds


class Hub:
    """The I/O loop around a LinkModel: select() on the TUN fds (microsecond timeouts), a timer heap."""

    def __init__(self, fds: list[int], addresses: list[str], model: LinkModel, clock=time.monotonic):
        self.fds = fds
        self.by_fd = {fd: i for i, fd in enumerate(fds)}
        self.by_addr = {bytes(int(x) for x in a.split(".")): i for i, a in enumerate(addresses)}
        self.model = model
        self.clock = clock
        self.heap: list[tuple[float, int, int, bytes]] = []
        self.seq = 0
        self.packets = 0
        self.bytes = 0
        self.late_s: list[float] = []  # how late each delayed packet left the heap (the hub's own error)

    def stats(self) -> dict:
        late = np.array(self.late_s[-100000:]) * 1e3 if self.late_s else np.zeros(1)
        return {
            "packets": self.packets,
            "bytes": self.bytes,
            "dropped": self.model.dropped,
            "delayed_packets": len(self.late_s),
            "late_ms_mean": float(late.mean()),
            "late_ms_p50": float(np.percentile(late, 50)),
            "late_ms_p99": float(np.percentile(late, 99)),
            "late_ms_max": float(late.max()),
        }

    def _ingest(self, fd: int, now_s: float) -> None:
        src = self.by_fd[fd]
        for _ in range(READ_BURST):
            try:
                pkt = os.read(fd, TUN_MTU_BYTES + 64)
            except BlockingIOError:
                return
            if len(pkt) < 20 or pkt[0] >> 4 != 4:
                continue  # not IPv4 (the namespaces have IPv6 off; anything else is dropped)
            dst = self.by_addr.get(pkt[16:20])
            if dst is None:
                continue
            at = self.model.schedule(src, dst, len(pkt), now_s)
            if at is None:
                continue
            self.packets += 1
            self.bytes += len(pkt)
            if at <= now_s:
                self._write(dst, pkt)
            else:
                self.seq += 1
                heapq.heappush(self.heap, (at, self.seq, dst, pkt))

    def _write(self, dst: int, pkt: bytes) -> None:
        try:
            os.write(self.fds[dst], pkt)
        except OSError:
            pass  # destination down or its backlog full: the packet is lost, as on a wire

    def serve(self, stop_after_s: float | None = None) -> None:
        end = None if stop_after_s is None else self.clock() + stop_after_s
        while end is None or self.clock() < end:
            now = self.clock()
            timeout = None if not self.heap else max(0.0, self.heap[0][0] - now)
            if end is not None:
                timeout = min(timeout if timeout is not None else 1.0, max(0.0, end - now))
            readable, _, _ = select.select(self.fds, [], [], timeout)
            now = self.clock()
            for fd in readable:
                self._ingest(fd, now)
            now = self.clock()
            while self.heap and self.heap[0][0] <= now:
                at, _, dst, pkt = heapq.heappop(self.heap)
                self._write(dst, pkt)
                self.late_s.append(now - at)
            if len(self.late_s) > 200000:
                del self.late_s[:100000]


def raise_priority(realtime: bool) -> str:
    """The hub is the network: its timers must not wait behind the emulated hosts' compute. Measured here
    (2 shared cores, load ~6): at normal priority, or nice -10, deliveries were p99 7-10 ms late (a 4 ms
    scheduler tick behind busy processes); under SCHED_FIFO priority 1, p99 0.08 ms. The kernel's RT
    throttling (sched_rt_runtime_us) still leaves other processes >= 5% of a core, and the hub is one
    thread, so it can take at most one core, and only while packets flow."""
    if realtime:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(HUB_RT_PRIORITY))
            return f"SCHED_FIFO {HUB_RT_PRIORITY}"
        except (OSError, AttributeError):
            pass
    try:
        os.nice(HUB_NICE)
        return f"nice {HUB_NICE}"
    except OSError:
        return "normal"


def model_for(state: NetworkState) -> LinkModel:
    return LinkModel(
        one_way_s=np.asarray(state.rtt_ms, dtype=float) / 2e3,
        rate_bytes_per_s=None if not state.bandwidth_bit_s else state.bandwidth_bit_s / 8.0,
        jitter_s=state.jitter_ms / 1e3,
        loss=state.loss,
        rng=np.random.default_rng(state.seed),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name, directory = argv[0], (argv[1] if len(argv) > 1 else None)
    state = read_state(name, Path(directory) if directory else None)

    def _exit(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    fds = setup_tuns(state)
    scheduling = raise_priority(bool(state.extra.get("hub_realtime", True)))
    hub = Hub(fds, state.addresses, model_for(state))
    stats_path = Path(directory or state_dir()) / f"{name}.hub.json"

    def _dump(*_):  # SIGUSR1: write the counters and the delay-error summary next to the state file
        stats_path.write_text(json.dumps({**hub.stats(), "scheduling": scheduling}))

    signal.signal(signal.SIGUSR1, _dump)

    def _reload(*_):  # SIGHUP: new RTTs from the state file (Network.set_rtt_ms); queued packets keep theirs
        hub.model.one_way_s = np.asarray(read_state(name, Path(directory) if directory else None).rtt_ms) / 2e3

    signal.signal(signal.SIGHUP, _reload)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the parent may have gone: never write to its pipe again
    hub.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
