"""`SessionReservation`: everything one session (or one row of a stateless forward) holds on a
server, acquired in one place and released in reverse order exactly once.

What it holds, in acquisition order: the KV budget (through the admission queue, which may wait for
memory), the session's KV tensors, the pin on the cached prompt prefix matched at open, the
scheduler's queue entries (its steps), and its place in the stack's `SessionTable`. Each
acquisition pushes its undo; `release` runs the undos last-in first-out, once, however often and
from wherever it is called (the handler's `finally`, a failed acquisition). So the session is gone
from the table before its memory is (allocated KV never exceeds reserved), and the admission queue
hands the freed memory out last, when nothing of the session is left.

Runs on the server's event loop (admission's futures live there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from petals_chain.runtime.kv_cache import SessionKV
from server.prefix_cache import PrefixPin
from server.serving_stack import ServingStack

logger = logging.getLogger(__name__)


class SessionReservation:
    def __init__(self, stack: ServingStack, key: str, session_id: str, client_id: str):
        self.stack = stack  # the stack it was acquired from: it releases there even after a swap
        self.key = key  # unique per stream: the budget's, the scheduler's and the table's key
        self.session_id = session_id
        self.client_id = client_id
        self.kv: SessionKV | None = None
        self.prefix_pin: PrefixPin | None = None
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._released = False

    @classmethod
    async def acquire(
        cls,
        stack: ServingStack,
        *,
        key: str,
        session_id: str,
        client_id: str,
        nbytes: int,
        max_length: int,
        first_block: int,
        adapter: str | None = None,
        wait_s: float | None = None,
        prefix_namespace: str = "",
        prefix_hashes: Sequence[str] = (),
        register: bool = True,
    ) -> SessionReservation:
        """Reserve `nbytes` (waiting in the admission queue up to `wait_s`; raises OutOfCacheError /
        AdmissionTimeoutError), allocate the KV (for the LoRA `adapter`, None: the base model), pin the
        matched prefix, register the session."""
        r = cls(stack, key, session_id, client_id)
        cache = stack.prefix_cache if prefix_hashes else None
        match = (lambda: cache.match(prefix_namespace, prefix_hashes) * cache.chunk_tokens) if cache else None
        try:
            await stack.admission.reserve(key, nbytes, session_id, client_id, wait_s, prefix_match=match)
            r._undo.append(("budget", lambda: (stack.budget.release(key), stack.admission.on_release())))
            r.kv = stack.block_range.allocate_kv(max_length, first_block, adapter)
            r._undo.append(("kv", r._drop_kv))
            if cache is not None:
                # pinned until the first step says how much of it the whole chain can use
                r.prefix_pin = cache.pin(prefix_namespace, prefix_hashes, client_id)
                r._undo.append(("prefix pin", lambda: cache.unpin(r.prefix_pin)))
                cache.count_asked(client_id, len(prefix_hashes) * cache.chunk_tokens)
            r._undo.append(("scheduled steps", lambda: stack.scheduler.cancel_session(key)))
            if register:
                stack.sessions.add(r)
                r._undo.append(("session table", lambda: stack.sessions.remove(key)))
        except BaseException:
            r.release()
            raise
        return r

    def hold(self, what: str, undo: Callable[[], None]) -> None:
        """Something more the session holds (e.g. its relay streams): undone first at release."""
        with self._lock:
            if not self._released:
                self._undo.append((what, undo))
                return
        undo()  # released already: give it back at once

    def _drop_kv(self) -> None:
        self.kv = None

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Undo every acquisition, newest first; later calls do nothing."""
        with self._lock:
            if self._released:
                return
            self._released = True
            undo, self._undo = self._undo, []
        for what, fn in reversed(undo):
            try:
                fn()
            except Exception:  # one failed undo must not keep the others (the memory) held
                logger.exception("releasing %s of session %s failed", what, self.key)
