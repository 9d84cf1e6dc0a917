"""The installed plan and the drain of the servers a re-plan moves: the orchestrator's one owner of
"what servers are told to load and which chains serve" (`InstalledPlan`, swapped whole by the control
thread; the assignment RPC reads the current one without a lock) and a re-plan's drain (`Drain`). Pure.

A re-plan that moves servers (`orchestrator/replan.py:decide`) does not tell them at once: first the
chains through them stop taking sessions (`Sessions.stop_granting`; the installed chains that avoid
them keep serving, so the plan that serves is always a set of complete chains with true capacities),
then `Drain.state` says when their sessions are gone, or the drain deadline passed, and only then is
the new plan installed (the movers' assignments change with it; past the deadline, with
--force-replan, the movers that still hold sessions are told to move at once: `InstalledPlan.forced`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from orchestrator.model import Cluster, Placement
from orchestrator.planner import Plan


@dataclass
class InstalledPlan:
    """One plan version: its cluster (index -> ``peers``), the placement servers are told to load, and
    the chains over it. Replaced whole (a new object per version); only ``installed`` changes in place,
    once, when every server reports its range online and the chains are handed to the sessions' owner."""

    version: int
    plan: Plan
    cluster: Cluster
    peers: list[str]  # cluster index -> peer id
    placement: Placement  # what servers are told to load
    chains: list  # ChainSpec over `placement`
    installed: bool = False
    created_s: float = 0.0
    # servers told to move now even while they hold sessions (a drain's deadline with --force-replan):
    # they close them (`ServerMovingError`) and their clients fail over
    forced: frozenset[str] = frozenset()
    _assigned: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._assigned = {
            p: (None if r is None else (r.start, r.end)) for p, r in zip(self.peers, self.placement.ranges)
        }

    def assignment(self, peer_id: str) -> tuple[int, int] | None:
        return self._assigned.get(peer_id)


DRAIN_STATES = ("draining", "drained", "deadline")


@dataclass(frozen=True)
class Drain:
    """Servers a re-plan moves, draining since ``started_s``: no new session is granted on a chain
    through them; ``pending`` is installed once none holds a session, or at ``deadline_s``."""

    movers: frozenset[str]
    started_s: float
    deadline_s: float
    pending: object  # what the service installs afterwards (its decided plan)
    epoch: int = 0  # the service's server-set epoch when the drain started (a join or loss re-decides)

    def __post_init__(self) -> None:
        if not self.deadline_s >= self.started_s:
            raise ValueError(f"drain deadline {self.deadline_s} before its start {self.started_s}")

    def busy(self, sessions_of: Callable[[str], int]) -> list[str]:
        return sorted(p for p in self.movers if sessions_of(p) > 0)

    def state(self, now_s: float, sessions_of: Callable[[str], int]) -> str:
        """``drained`` once no mover holds a session; else ``deadline`` from ``deadline_s`` on; else
        ``draining``."""
        if not self.busy(sessions_of):
            return "drained"
        return "deadline" if now_s >= self.deadline_s else "draining"
