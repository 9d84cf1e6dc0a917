"""`ServerLifecycle`: the one owner of a block server's lifecycle, under one lock.

What it owns: the state the server announces (joining -> online; online -> joining -> online for a
move; offline, which is final), the serving stack in place (`server/serving_stack.py`, swapped
whole), the start-up profile of that stack's range and the t_I/t_O announced from it, whether live
service contradicted that profile, whether a move is under way, and the opens in flight (past the
accepting check and not yet in the stack's session table, e.g. waiting for memory in admission).

The mover (`--blocks auto`'s assignments, `--num-blocks`' rebalancing), the start-up, `shutdown`,
the announcer and the handlers all go through it: readers take one `LifecycleView` (`snapshot`), so
a record describes one stack with its own profile and state, as PETALS' `Server.run` loop hands its
announcer one value per module container; writers make one transition each, so

- shutdown is final: after `shut_down` no transition leads back to online, and a stack a move
  finished loading too late is handed back to be stopped instead of being put in place;
- a move starts only while the stack holds no session, none waits in admission and no open is in
  flight (`begin_move`), and new opens are refused from then on: the check and the refusal are one
  step under the lock, and an open counts itself (`opening`) under the same lock before it reads
  the stack, so none slips in between. A forced move (the orchestrator's drain deadline) refuses new
  opens first and reloads only once what was open is closed (`quiet`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from petals_chain.errors import ServerUnavailableError
from petals_chain.wire.records import ServerState
from server.profiling import BlockTimes
from server.range_profile import RangeProfile
from server.serving_stack import ServingStack


@dataclass(frozen=True)
class LifecycleView:
    """One consistent reading of the lifecycle (what a record or a check is built from)."""

    state: ServerState
    stack: ServingStack | None  # None: `--blocks auto` before its assignment (the probe's times only)
    times: BlockTimes | None  # t_I, t_O announced (of the stack's range, or the one-block probe's)
    profile: RangeProfile | None  # the start-up profile `times` came from
    profile_contradicted: bool  # live service disagreed with `profile` once: checking it is done
    moving: bool


class ServerLifecycle:
    def __init__(self):
        self._lock = threading.Lock()
        self._state = ServerState.JOINING
        self._stack: ServingStack | None = None
        self._times: BlockTimes | None = None
        self._profile: RangeProfile | None = None
        self._profile_contradicted = False
        self._moving = False
        self._opening = 0  # opens past the accepting check, not yet registered or given up
        self._stack_handed_out = False  # shut_down gave the last stack to its caller to stop

    # -- readers ------------------------------------------------------------------------------
    def snapshot(self) -> LifecycleView:
        with self._lock:
            return LifecycleView(
                self._state, self._stack, self._times, self._profile, self._profile_contradicted, self._moving
            )

    @property
    def current(self) -> ServingStack | None:
        """The stack in place (one reference read: a handler keeps what it got)."""
        return self._stack

    @property
    def stopped(self) -> bool:
        return self._state == ServerState.OFFLINE

    @property
    def accepting(self) -> bool:
        """Whether a new session may open now."""
        with self._lock:
            return self._accepting()

    def _accepting(self) -> bool:
        return self._state == ServerState.ONLINE and not self._moving and self._stack is not None

    # -- the handlers' side -------------------------------------------------------------------
    @contextmanager
    def opening(self) -> Iterator[ServingStack]:
        """An open from its accepting check until it is in the stack's session table or gave up
        (a wait for memory in admission included): a move waits for it to leave."""
        with self._lock:
            if not self._accepting():
                raise ServerUnavailableError(
                    "this server holds no blocks right now (waiting for or loading its assignment); use another server"
                )
            self._opening += 1
            stack = self._stack
        try:
            yield stack
        finally:
            with self._lock:
                self._opening -= 1

    # -- transitions ----------------------------------------------------------------------------
    def set_profile(self, times: BlockTimes, profile: RangeProfile) -> None:
        """The one-block probe's profile (`--blocks auto`, `--num-blocks`), before any stack."""
        with self._lock:
            self._times, self._profile, self._profile_contradicted = times, profile, False

    def install(self, stack: ServingStack, times: BlockTimes, profile: RangeProfile) -> ServingStack | None:
        """Put `stack` in place with its range's profile, in one step. Returns the stack the caller
        must stop: the one replaced (None at the first), or `stack` itself once shut down."""
        with self._lock:
            if self._state == ServerState.OFFLINE:
                return stack
            old, self._stack = self._stack, stack
            self._times, self._profile, self._profile_contradicted = times, profile, False
            return old

    def go_online(self) -> bool:
        """The start-up's end: online (with a stack), unless shut down meanwhile."""
        with self._lock:
            if self._state == ServerState.OFFLINE or self._stack is None:
                return False
            self._state = ServerState.ONLINE
            return True

    def begin_move(self, force: bool = False) -> bool:
        """Start a move (state joining, opens refused) if the stack holds no session, none waits in
        admission and no open is in flight; False (nothing changed) otherwise. `force` (a re-plan's
        drain deadline passed): start it anyway; the caller then closes what is open (`BlockServer`'s
        forced move) and waits for `quiet` before it reloads."""
        with self._lock:
            if self._state != ServerState.ONLINE or self._moving:
                return False
            if not force and not self._quiet():
                return False
            self._moving, self._state = True, ServerState.JOINING
            return True

    def quiet(self) -> bool:
        """No session in the stack, none waiting in admission, no open in flight."""
        with self._lock:
            return self._quiet()

    def _quiet(self) -> bool:
        stack = self._stack
        return not self._opening and not (stack is not None and (len(stack.sessions) or len(stack.admission)))

    def end_move(self) -> bool:
        """The move is over (loaded or failed): online again, unless shut down meanwhile. Returns
        whether it went online (whether the caller announces it)."""
        with self._lock:
            self._moving = False
            if self._state == ServerState.OFFLINE:
                return False
            self._state = ServerState.ONLINE
            return True

    def shut_down(self) -> tuple[bool, ServingStack | None]:
        """Offline, for good: (whether this call made it so, the stack to stop). The stack is handed
        out once, to whichever caller comes first; a later `install` hands its stack back."""
        with self._lock:
            first = self._state != ServerState.OFFLINE
            self._state = ServerState.OFFLINE
            stack = None if self._stack_handed_out else self._stack
            self._stack_handed_out = True
            return first, stack

    def note_profile_contradicted(self, profile: RangeProfile) -> bool:
        """Live service disagreed with `profile`: True if it is still the one in place and this is
        the first time (the caller drops its cache entry), False otherwise (a move replaced it, or
        it was said already)."""
        with self._lock:
            if profile is not self._profile or self._profile_contradicted:
                return False
            self._profile_contradicted = True
            return True
