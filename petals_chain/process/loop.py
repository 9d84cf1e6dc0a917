"""An asyncio event loop on a daemon thread, for sync code that talks to hivemind's async P2P."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self, name: str = "petals-chain-loop"):
        # The standard library's loop, not uvloop's: with uvloop (0.22-0.23) a process running two of
        # these loops (a client's chain and its orchestrator link) segfaulted inside run_forever in CI
        # (tests/test_fuzz_rpc.py; docs/results.md); uvloop saved ~0.05 ms per hop, within the runs' spread
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (raises TimeoutError after `timeout_s`)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
