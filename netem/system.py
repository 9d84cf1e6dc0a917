"""The host side: capability checks, `ip`/`tc` invocation, entering a network namespace.

Only objects whose names the caller passes are touched; nothing here enumerates or changes the
host's own interfaces or routes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

from netem.errors import MissingCapabilityError, NetemError

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
_CAP_NET_ADMIN = 12


def has_cap_net_admin() -> bool:
    """CAP_NET_ADMIN in the effective set (root normally has it; a container may not)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def require_capabilities(*, tc: bool, tun: bool) -> None:
    """Fail at once, saying what is needed, when the emulator cannot work here."""
    problems = []
    if os.geteuid() != 0 or not has_cap_net_admin():
        problems.append("root with CAP_NET_ADMIN (run with sudo, or a container with --cap-add NET_ADMIN)")
    for tool in ("ip",) + (("tc",) if tc else ()):
        if shutil.which(tool) is None:
            problems.append(f"the `{tool}` binary (Debian/Ubuntu: apt-get install iproute2)")
    if tun and not os.path.exists("/dev/net/tun"):
        problems.append("/dev/net/tun (modprobe tun; in a container: --device /dev/net/tun)")
    if problems:
        raise MissingCapabilityError("netem needs " + "; ".join(problems))


def run(argv: list[str], *, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """Run one `ip`/`tc` command; a failure raises NetemError with the command and its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise NetemError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def netns_pids(ns: str) -> list[int]:
    out = run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(x) for x in out.split()]


def kill_netns_processes(ns: str, grace_s: float = 3.0) -> None:
    """SIGTERM every process living in namespace `ns` (one we created), SIGKILL what is left after grace_s
    (the poll returns as soon as all are gone; servers announcing `offline` need a few seconds)."""
    pids = [p for p in netns_pids(ns) if p != os.getpid()]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            pids = [p for p in netns_pids(ns) if p != os.getpid()]
            if not pids:
                return
            time.sleep(0.05)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def socket_in_netns(ns: str, family: int, type_: int) -> socket.socket:
    """A socket created inside network namespace `ns` (it stays bound to it).

    setns() changes the namespace of the calling OS thread only, so a throwaway thread enters the
    namespace, creates the socket and exits; the caller's thread never leaves its own namespace.
    """
    result: dict = {}

    def worker() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
            try:
                if _libc().setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({ns}): {os.strerror(err)}")
            finally:
                os.close(fd)
            result["sock"] = socket.socket(family, type_)
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e

    t = threading.Thread(target=worker, name=f"netns-{ns}")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["sock"]
