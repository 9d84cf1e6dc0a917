"""Signal handling and life cycle of the processes petals-chain starts.

hivemind's DHT runs in a forked child process, which starts the p2p daemon (p2pd) as its own
child. Two things go wrong with hivemind's defaults:

- A child inherits the parent's Python signal handlers; if those only set an Event of the parent
  (as a server's SIGTERM handler does), the child would ignore SIGTERM and a clean shutdown could
  hang. `start_dht` forks it with default handlers.
- An operator's `kill -9 PID` of a server ends only that process: its DHT child and p2pd ran on,
  orphaned, and kept the server's libp2p connections open, so clients saw a silent peer until
  their 32-s step timeout instead of a closed stream. `start_dht`'s child watches its parent and,
  when the parent is gone, kills its own children (p2pd) and exits (`_exit_with_parent`).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from hivemind.dht import DHT
from hivemind.p2p import P2PDaemonError

from petals_chain.errors import P2PStartError

logger = logging.getLogger(__name__)
# How often a DHT child checks that its parent lives: bounds how long a SIGKILLed server's p2pd
# (and so its open connections) outlives it.
PARENT_CHECK_PERIOD_S = 0.25

_HANDLED = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def default_signal_handlers() -> Iterator[None]:
    """Restore default SIGINT/SIGTERM handling for the duration (children forked inside keep it)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; it is also the one that installed them
        return
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in _HANDLED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ParentBoundDHT(DHT):
    """hivemind's DHT whose child process (p2pd included) ends when the process that started it dies.

    A watchdog thread rather than only PR_SET_PDEATHSIG: the parent-death signal fires when the
    *thread* that forked exits (a client may start its DHT from a short-lived thread), and a signal
    would kill the child without stopping its p2pd; polling getppid() has neither problem."""

    def run(self) -> None:
        # Out of the parent's process group: a Ctrl-C in the terminal (SIGINT to the foreground
        # group) reaches only the parent, which then shuts down in order (a server announces
        # `offline` through this DHT first); otherwise p2pd died of the SIGINT at once and the
        # parent's shutdown waited for timeouts on a dead daemon. A group kill still ends this
        # process within PARENT_CHECK_PERIOD_S: its parent is gone.
        os.setpgid(0, 0)
        threading.Thread(
            target=_exit_with_parent, args=(self._parent_pid,), name="exit-with-parent", daemon=True
        ).start()
        super().run()


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_PERIOD_S)
    import psutil

    # The parent is gone (e.g. kill -9): take our own children (p2pd) with us, then leave at once:
    # a clean shutdown would talk to peers on behalf of a server that no longer exists.
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    os._exit(0)


def start_dht(**dht_kwargs) -> DHT:
    """`hivemind.dht.DHT(start=True, **dht_kwargs)` whose child process has default signal handlers
    and ends with its parent; a daemon that does not start is a `P2PStartError` of one line."""
    with default_signal_handlers():
        try:
            return ParentBoundDHT(start=True, **dht_kwargs)
        except P2PDaemonError as e:
            raise P2PStartError(describe_p2p_error(e, dht_kwargs.get("initial_peers") or [])) from None


def describe_p2p_error(error: Exception, initial_peers: list) -> str:
    """hivemind's P2PDaemonError (the daemon's log lines) as one line that says what to do."""
    text = str(error)
    # the daemon's lines start with a Go timestamp: "2026/11/23 07:03:38 failed to parse ..."
    reasons = [
        re.sub(r"^(Daemon failed to start:\s*)?\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\s*", "", line).strip()
        for line in text.splitlines()
        if line.strip()
    ]
    reason = next((r for r in reasons if r), text.strip() or type(error).__name__)
    if "bootstrap peers" in reason:
        peers = " ".join(str(p) for p in initial_peers)
        return (
            f"none of the initial peers answered ({peers}): check that the address is the one "
            "`petals-chain dht` printed, that the peer is running and that this host can reach it"
        )
    if "multiaddr" in reason:
        return f"the p2p daemon refused an address: {reason}; use e.g. /ip4/0.0.0.0/tcp/31337"
    return f"the p2p daemon did not start: {reason}"


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while cleaning up (main thread only), then raise KeyboardInterrupt if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: received.append(s)) for sig in _HANDLED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            raise KeyboardInterrupt


def wait_handling_signals(stop: threading.Event, poll_s: float = 0.25) -> None:
    """Block the main thread until `stop` is set, running Python's signal handlers meanwhile.

    Why not `stop.wait()`: CPython runs signal handlers on the main thread only, and the kernel may deliver
    a process-directed signal (SIGUSR1, SIGTERM from a parent) to any of the process's other threads
    (hivemind's, the HTTP server's). Then the main thread, blocked in a lock wait with no timeout, is
    never interrupted and the handler waits until something else wakes it: a SIGUSR1 to the orchestrator
    once went unhandled for over 90 s. Waking every `poll_s` bounds that delay.

    Why not `stop.wait(poll_s)` either, but a sleep and the lock-free `is_set()`: the handlers set `stop`,
    and a handler runs on this thread between two bytecodes, possibly while this thread holds the
    Event's internal (non-reentrant) lock inside `wait()`; its `stop.set()` then waits for that lock
    forever (a launch-server hung on Ctrl-C, its main thread in `on_signal` -> `Event.set` ->
    `Condition.__enter__` under `Event.wait`). Sleeping holds no lock, and `time.sleep` returns to its
    remaining time after a handler: `stop` set by a handler or by another thread is seen within `poll_s`."""
    while not stop.is_set():
        time.sleep(poll_s)
