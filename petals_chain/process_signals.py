"""Signal handling around the processes petals-chain starts.

hivemind's DHT runs in a forked child process. A child inherits the parent's Python signal
handlers; if those only set an Event of the parent (as a server's SIGTERM handler does), the child
would ignore SIGTERM and a clean shutdown could hang. `start_dht` forks it with default handlers.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from hivemind.dht import DHT

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


def start_dht(**dht_kwargs) -> DHT:
    """`hivemind.dht.DHT(start=True, **dht_kwargs)` whose child process has default signal handlers."""
    with default_signal_handlers():
        return DHT(start=True, **dht_kwargs)


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
