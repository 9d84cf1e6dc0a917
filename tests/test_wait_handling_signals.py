"""The main thread's wait of the long-running commands (petals_chain.process.signals.wait_handling_signals):
it ends when a signal handler or another thread sets the stop event, and it never blocks inside the event's
own lock, where a handler that sets the event on the same thread would wait for that lock forever."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from petals_chain.process.signals import wait_handling_signals


class _NoBlockingWait(threading.Event):
    """An event whose blocking wait fails the test: `Event.wait` holds the event's non-reentrant lock while
    it checks the flag, and a handler running on that thread at that moment deadlocks in `set()`."""

    def wait(self, timeout=None):
        raise AssertionError("wait_handling_signals must not block in the stop event's wait()")


def test_the_wait_never_holds_the_stop_events_lock_and_sees_another_threads_set():
    stop = _NoBlockingWait()
    setter = threading.Timer(0.3, stop.set)
    setter.start()
    try:
        wait_handling_signals(stop, poll_s=0.05)
    finally:
        setter.cancel()
    assert stop.is_set()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_a_signal_handler_that_sets_the_stop_event_ends_the_wait():
    stop = threading.Event()
    handled = []

    def on_signal(signum, _frame):
        handled.append(signum)
        stop.set()  # what launch-server, the orchestrator and the DHT command do on Ctrl-C / SIGTERM

    previous = signal.signal(signal.SIGUSR1, on_signal)
    # from another thread, as a parent's kill may land on any of the process's threads
    sender = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
    sender.start()
    try:
        wait_handling_signals(stop, poll_s=0.05)
    finally:
        sender.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert handled == [signal.SIGUSR1] and stop.is_set()
