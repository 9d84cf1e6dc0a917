"""A preloaded launcher: one process that imports torch, transformers and hivemind once and forks the
swarm's processes from there, each running `python -m MODULE ARGS` as its own process (its own pid,
session and process group, its output on a pipe of the caller's, its exit status reported back).

Why: a server or DHT peer spends most of its start-up CPU importing (torch, transformers' model
registry, hivemind: ~7 of a SmolLM2 server's ~10 CPU-seconds on this project's CPU hosts), the same
imports in every process. A swarm of three servers and a DHT peer imports them once here instead of
four times. What a forked process shares with an exec'd one: the environment (this launcher is exec'd
with the swarm's), signal dispositions (Python's defaults; nothing is installed here), a fresh
`random` state (Python reseeds at fork; numpy's and torch's global generators are reseeded below), and
`__main__` (the module runs through `runpy` as `python -m` runs it). What differs: its command line
(`/proc/PID/cmdline` is this launcher's) and that it is this launcher's child, not the caller's,
hence `ForkedProcess`, a `subprocess.Popen` look-alike whose exit status comes over the control
socket.

Fork safety: this process never starts a Python thread (the loop below is single-threaded: select,
fork, reap), so no lock is held by a thread that would not exist in the child. The imports leave two
native threads (torch's and numpy's pools, idle); hivemind forks its DHT child from a server that
has loaded torch and its weights the same way.

Protocol (a SOCK_SEQPACKET socketpair, one message each): the caller sends
`{"module", "args", "cwd"}` as JSON with the write end of the child's output pipe attached
(SCM_RIGHTS); the launcher answers `pid N`, and `exit N CODE` when it reaps N (CODE as Popen's
returncode: negative for a signal). The caller closing its end ends the launcher (children go on).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

MAX_MESSAGE_BYTES = 1 << 16


class LauncherError(RuntimeError):
    """The preloaded launcher could not start or fork (its own words attached)."""


class ForkedProcess:
    """What `subprocess.Popen(..., stdout=PIPE, text=True, start_new_session=True)` gives, for a process the
    launcher forked: `pid`, `stdout` (text lines), `poll`, `wait`, `send_signal`, `terminate`, `kill`,
    `returncode`."""

    def __init__(self, pid: int, stdout, args: list[str]):
        self.pid = pid
        self.stdout = stdout
        self.args = args
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:  # by the launcher client's reader thread, once
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # as Popen: no signal to a pid that may be reused once reaped
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PreloadedLauncher:
    """`launcher = PreloadedLauncher(env, preload=[...])`; `launcher.spawn("server.cli", args)` -> a
    ForkedProcess; `launcher.close()`. One owner (a LocalSwarm); spawn is thread-safe."""

    def __init__(self, env: dict[str, str], preload: list[str], start_timeout_s: float = 120.0):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "petals_chain.process.preload", str(theirs.fileno()), *preload],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        theirs.close()
        self._lock = threading.Lock()  # one spawn request at a time: its `pid` answer is the next message
        self._pids: list[int] = []  # answers to spawn requests, in order (reader thread -> spawn)
        self._answer = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # an exit reported before spawn registered its child
        self._closed = False
        self._ready = False
        self.lines: list[str] = []  # the launcher's own output (its import errors, say)
        threading.Thread(target=self._drain_output, daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        with self._answer:  # the launcher says "ready" once its imports are done
            while not self._ready and self._proc.poll() is None and time.monotonic() < deadline:
                self._answer.wait(0.2)
            ready = self._ready
        if not ready:
            self.close()
            raise LauncherError("the preloaded launcher did not start: " + " | ".join(self.lines[-5:]))

    def _drain_output(self) -> None:
        for line in self._proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _read(self) -> None:
        while True:
            try:
                msg = self._sock.recv(MAX_MESSAGE_BYTES)
            except OSError:
                msg = b""
            if not msg:  # the launcher ended (or we closed): children it did not report stay unknown
                with self._answer:
                    self._closed = True
                    self._answer.notify_all()
                return
            kind, *rest = msg.decode().split()
            with self._answer:
                if kind == "ready":
                    self._ready = True
                elif kind == "pid":
                    self._pids.append(int(rest[0]))
                elif kind == "error":
                    self._pids.append(-1)
                    self.lines.append(" ".join(rest))
                elif kind == "exit":
                    pid, code = int(rest[0]), int(rest[1])
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early_exits[pid] = code
                    else:
                        child._set_exit(code)
                self._answer.notify_all()

    def spawn(self, module: str, args: list[str], timeout_s: float = 30.0) -> ForkedProcess:
        read_fd, write_fd = os.pipe()
        try:
            with self._lock:
                request = json.dumps({"module": module, "args": args, "cwd": os.getcwd()}).encode()
                socket.send_fds(self._sock, [request], [write_fd])
                deadline = time.monotonic() + timeout_s
                with self._answer:
                    while not self._pids and not self._closed and time.monotonic() < deadline:
                        self._answer.wait(0.2)
                    if not self._pids:
                        raise LauncherError("the preloaded launcher did not answer: " + " | ".join(self.lines[-5:]))
                    pid = self._pids.pop(0)
                    if pid < 0:
                        raise LauncherError("the preloaded launcher could not fork: " + " | ".join(self.lines[-5:]))
                    child = ForkedProcess(pid, os.fdopen(read_fd, "r"), [sys.executable, "-m", module, *args])
                    read_fd = -1
                    if pid in self._early_exits:
                        child._set_exit(self._early_exits.pop(pid))
                    else:
                        self._children[pid] = child
                    return child
        finally:
            os.close(write_fd)  # the child holds its own copy
            if read_fd >= 0:
                os.close(read_fd)

    def close(self) -> None:
        """Ends the launcher (the processes it forked go on; stop them first)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)


# -- the launcher process -----------------------------------------------------------------------------


def _serve(sock: socket.socket) -> dict | None:
    """Fork on each request; report pids and exit statuses. Returns in a forked child (its request)."""
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        while True:  # reap whatever ended (children are this process's: it alone can wait for them)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())
        if not readable:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 1)
        except OSError:
            msg, fds = b"", []
        if not msg:
            return None  # the owner closed its end
        request = json.loads(msg)
        try:
            pid = os.fork()
        except OSError as e:
            sock.send(f"error fork failed: {e}".encode())
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:
            sock.close()
            os.setsid()  # its own session and process group, as start_new_session=True
            out = fds[0]
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(null)
            os.close(out)
            os.chdir(request["cwd"])
            return request
        for fd in fds:
            os.close(fd)
        sock.send(f"pid {pid}".encode())


def _run_child(request: dict) -> None:
    import runpy

    # fresh seeds, as a new process has (Python's `random` is reseeded at fork by the interpreter)
    seed = int.from_bytes(os.urandom(4), "little")
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    sys.argv = [request["module"], *request["args"]]
    sys.path[0] = request["cwd"]  # `python -m` puts its working folder first (this launcher's was its own)
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def main() -> None:
    fd, preload = int(sys.argv[1]), sys.argv[2:]
    sock = socket.socket(fileno=fd)
    for name in preload:  # best effort: a module that fails to import here imports (or fails) in the child
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"preload: {name} did not import ({type(e).__name__}: {e})", flush=True)
    sock.send(b"ready")
    request = _serve(sock)
    if request is None:
        return
    _run_child(request)


if __name__ == "__main__":
    main()
