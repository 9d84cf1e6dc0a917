"""Our own probes (the machine may have no `ping`): UDP round trips and TCP bulk throughput between
emulated hosts, from sockets opened inside their namespaces by this process."""

from __future__ import annotations

import select
import socket
import struct
import threading
import time

import numpy as np

from netem.errors import NetemError
from netem.system import socket_in_netns

_REQ, _REP = 1, 2
_FMT = "!BHHIdd"  # kind, from, to, round, t0 (CLOCK_REALTIME, s), echo hold (s)
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def _recv_stamped(s: socket.socket) -> tuple[bytes, tuple, float]:
    """(data, sender, kernel receive time): the kernel's timestamp, not when this process got the CPU, so a
    starved probe process does not inflate the RTT (the emulated network's own lateness still counts)."""
    data, anc, _, frm = s.recvmsg(64, 64)
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
            sec, nsec = struct.unpack("qq", raw[:16])
            return data, frm, sec + nsec * 1e-9
    return data, frm, time.time()


def measure_rtt_ms(
    namespaces: list[str], addresses: list[str], *, probes: int = 5, timeout_s: float = 3.0, clock=time.time
) -> list[list[float]]:
    """Median UDP round trip (ms) for every ordered pair (i initiates, j echoes); NaN where all probes
    were lost. All pairs probe at once, `probes` rounds, so this takes about probes x the largest RTT.
    Receive times are kernel timestamps and the echo reports how long it held the probe, which is
    subtracted: what remains is the network's round trip. `clock` must be CLOCK_REALTIME (time.time)."""
    n = len(namespaces)
    socks = []
    try:
        for ns, addr in zip(namespaces, addresses):
            s = socket_in_netns(ns, socket.AF_INET, socket.SOCK_DGRAM)
            socks.append(s)
            try:
                s.bind((addr, 0))
            except OSError as e:
                raise NetemError(
                    f"cannot bind {addr} in namespace {ns} ({e}): is the network up and its hub "
                    "running? (`petals-chain netem status`)"
                ) from None
            s.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
            s.setblocking(False)
        ports = [s.getsockname() for s in socks]
        by_fd = {s.fileno(): k for k, s in enumerate(socks)}
        samples: dict[tuple[int, int], list[float]] = {(i, j): [] for i in range(n) for j in range(n) if i != j}
        for r in range(probes):
            outstanding = set(samples)
            for i, j in outstanding:
                socks[i].sendto(struct.pack(_FMT, _REQ, i, j, r, clock(), 0.0), ports[j])
            deadline = clock() + timeout_s
            while outstanding and clock() < deadline:
                readable, _, _ = select.select(socks, [], [], max(0.0, deadline - clock()))
                for s in readable:
                    while True:
                        try:
                            data, frm, t_rx = _recv_stamped(s)
                        except BlockingIOError:
                            break
                        kind, i, j, rr, t0, hold = struct.unpack(_FMT, data)
                        if kind == _REQ:
                            s.sendto(struct.pack(_FMT, _REP, i, j, rr, t0, clock() - t_rx), frm)
                        elif rr == r and (i, j) in outstanding and by_fd[s.fileno()] == i:
                            samples[(i, j)].append((t_rx - t0 - hold) * 1e3)
                            outstanding.discard((i, j))
        out = [[0.0] * n for _ in range(n)]
        for (i, j), xs in samples.items():
            out[i][j] = float(np.median(xs)) if xs else float("nan")
        return out
    finally:
        for s in socks:
            s.close()


def measure_throughput_bit_s(
    src_ns: str,
    src_addr: str,
    dst_ns: str,
    dst_addr: str,
    *,
    duration_s: float = 2.0,
    warmup_s: float = 0.5,
    clock=time.monotonic,
) -> float:
    """Goodput (bit/s of TCP payload) of one bulk TCP stream src -> dst, counted at the receiver after a
    warm-up (slow start) over `duration_s`."""
    listener = socket_in_netns(dst_ns, socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((dst_addr, 0))
    listener.listen(1)
    sender = socket_in_netns(src_ns, socket.AF_INET, socket.SOCK_STREAM)
    stop = threading.Event()
    result: dict = {}

    def send() -> None:
        chunk = b"\0" * (256 * 1024)
        try:
            sender.connect(listener.getsockname())
            while not stop.is_set():
                sender.sendall(chunk)
        except OSError:
            pass

    t = threading.Thread(target=send, daemon=True)
    t.start()
    conn, _ = listener.accept()
    conn.settimeout(5.0)
    try:
        start = clock()
        counted, t_begin = 0, None
        while clock() - start < warmup_s + duration_s:
            got = len(conn.recv(1 << 20))
            if got == 0:
                break
            now = clock()
            if now - start >= warmup_s:
                if t_begin is None:
                    t_begin = now
                else:
                    counted += got
        elapsed = (clock() - t_begin) if t_begin is not None else 0.0
        result["bit_s"] = counted * 8 / elapsed if elapsed > 0 else 0.0
    finally:
        stop.set()
        conn.close()  # the sender's blocked sendall fails at once (connection reset)
        t.join(timeout=5)
        sender.close()
        listener.close()
    return result["bit_s"]
