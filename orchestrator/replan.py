"""Re-planning a loaded swarm (beyond the paper): from the installed placement to a new one without
losing capacity, moving as few servers as the new plan's chains need. Pure; the online service
(`orchestrator/service/core.py`) feeds it clusters and ranges, and drains the servers it moves.

- ``evaluate``: GCA (Alg. 2) on a placement, contended chains, total capacity sum_k c_k, nu (eq. 4)
  and the Theorem 3.7 bounds: the one yardstick every candidate and the installed plan are held to.
- ``equivalent_classes`` / ``relabel``: servers of the same memory whose tau^c, tau^p (and shared-
  compute terms) agree within ``rel`` are interchangeable to the planner (GBP-CR orders them by
  t_j / m_j, eq. 9, so a refit that reorders two of them swaps their ranges); within each class a
  server keeps its installed range whenever the new placement has that range for the class. That
  matching is maximal (ranges are matched only with equal ranges), so no relabelling moves fewer
  servers.
- ``constrained_placement``: the proposed policy's placement with servers fixed on their ranges
  (GBP-CR with fixed servers, `placement_gbp_cr.gbp_cr_fixed`, c tuned as §3.1.3 does over the
  c that change the free servers' m_j(c)).
- ``decide``: the candidates (the fresh plan relabelled; the installed placement with its gaps filled
  by idle servers, and with the leftover step for idle servers, both moving nobody), each held to the
  invariant *no lower total capacity, no higher model mean response* (the tuning objective: the
  Theorem 3.7 bound) than the installed placement on the same cluster; a candidate that moves
  servers must also gain at least ``min_gain`` (relative) over the best one that moves none, else
  nothing moves; at most ``max_moves`` servers move in one step (greedy: the step whose placement
  evaluates best).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from orchestrator.bounds import theorem37_bounds
from orchestrator.cache_gca import gca
from orchestrator.model import (
    BlockInterval,
    ChainSpec,
    Cluster,
    Placement,
    contended_chains,
    total_service_rate_per_s,
)
from orchestrator.placement_gbp_cr import _blocks_per_class, gbp_cr_fixed, max_capacity, server_arrays
from orchestrator.placement_leftover import place_leftover

REL_NOISE = 1e-9  # float noise between two evaluations of equal plans


@dataclass(frozen=True)
class Evaluated:
    placement: Placement
    chains: tuple[ChainSpec, ...]
    capacity: int  # sum_k c_k
    rate_per_s: float  # nu (eq. 4)
    lower_s: float  # Theorem 3.7 (inf when lambda >= nu or no chain)
    upper_s: float
    c: int | None = None

    def objective(self, tuning: str) -> float:
        """The model's mean response the tuning ranks by (``surrogate`` has no per-placement value:
        the lower bound stands in, as §4.1.2 recommends)."""
        return self.upper_s if tuning == "upper" else self.lower_s


def evaluate(cluster: Cluster, placement: Placement, c: int | None = None, chains=None) -> Evaluated:
    """GCA's chains on ``placement`` (or the given ``chains``), contended as the planner's are, and
    their capacity, nu and bounds."""
    if chains is None:
        chains = gca(cluster, placement).chains if placement.used_servers() else ()
    chains = tuple(contended_chains(cluster, chains))
    if not chains:
        return Evaluated(placement, (), 0, 0.0, math.inf, math.inf, c)
    b = theorem37_bounds(chains, cluster.arrival_rate_per_s)
    return Evaluated(
        placement, chains, sum(k.capacity for k in chains), total_service_rate_per_s(chains), b.lower_s, b.upper_s, c
    )


def not_worse(new: Evaluated, base: Evaluated, tuning: str) -> bool:
    """The invariant: total capacity no lower and the model's mean response no higher (when both
    are infinite, an overloaded swarm: nu no lower)."""
    if new.capacity < base.capacity:
        return False
    a, b = new.objective(tuning), base.objective(tuning)
    if math.isfinite(b):
        return a <= b * (1 + REL_NOISE)
    return math.isfinite(a) or new.rate_per_s >= base.rate_per_s * (1 - REL_NOISE)


def gain(new: Evaluated, base: Evaluated, tuning: str) -> float:
    """Relative gain of ``new`` over ``base``: in mean response when ``base``'s is finite, else in nu
    (inf when ``base`` has none)."""
    a, b = new.objective(tuning), base.objective(tuning)
    if math.isfinite(b):
        return (b - a) / b if b > 0 else 0.0
    if math.isfinite(a):
        return math.inf
    return (
        (new.rate_per_s - base.rate_per_s) / base.rate_per_s
        if base.rate_per_s > 0
        else (math.inf if new.rate_per_s > 0 else 0.0)
    )


def equivalent_classes(cluster: Cluster, rel: float) -> list[int]:
    """Server -> class id: the same memory and batch terms, tau^c and tau^p within ``rel`` of the
    class's first server (servers sorted by memory, tau^p, tau^c; a class is a run of that order)."""
    if not rel >= 0:
        raise ValueError(f"rel must be >= 0, got {rel}")
    sv = cluster.servers
    order = sorted(range(len(sv)), key=lambda j: (sv[j].memory, sv[j].tau_p_s, sv[j].tau_c_s, j))
    cls = [0] * len(sv)
    k, head = -1, None

    def close(a: float | None, b: float | None) -> bool:
        if a is None or b is None:
            return a is b
        return abs(a - b) <= rel * max(abs(a), abs(b))

    for j in order:
        s = sv[j]
        if head is None or not (
            s.memory == head.memory
            and close(s.tau_p_s, head.tau_p_s)
            and close(s.tau_c_s, head.tau_c_s)
            and close(s.batch_overhead_s, head.batch_overhead_s)
            and close(s.batch_block_overhead_s, head.batch_block_overhead_s)
        ):
            k, head = k + 1, s
        cls[j] = k
    return cls


def _key(r: BlockInterval | None) -> tuple[int, int] | None:
    return None if r is None else (r.start, r.end)


def relabel(
    target: Placement, installed: Placement, classes: list[int], busy: frozenset[int] = frozenset()
) -> Placement:
    """``target`` with its ranges permuted within classes of equivalent servers so that the most
    servers keep their installed range (see module docstring). Of the servers that must move, idle
    ones (no installed range) take ranges first, busy ones last."""
    n = len(target.ranges)
    if len(installed.ranges) != n or len(classes) != n:
        raise ValueError("target, installed and classes must cover the same servers")
    pool: dict[int, dict] = defaultdict(lambda: defaultdict(int))  # class -> range key -> count
    for j, r in enumerate(target.ranges):
        pool[classes[j]][_key(r)] += 1
    out: list[BlockInterval | None] = [None] * n
    done = [False] * n
    for j in sorted(range(n), key=lambda j: (j not in busy, j)):  # keep every installed range the class has
        r = installed.ranges[j]
        k = _key(r)
        if pool[classes[j]][k] > 0:
            pool[classes[j]][k] -= 1
            out[j], done[j] = r, True
    rest = sorted((j for j in range(n) if not done[j]), key=lambda j: (installed.ranges[j] is not None, j in busy, j))
    for j in rest:
        left = pool[classes[j]]
        real = sorted(k for k, v in left.items() if v > 0 and k is not None)
        k = real[0] if real else None
        left[k] -= 1
        out[j] = None if k is None else BlockInterval(*k)
    return Placement(tuple(out))


def movers(installed: Placement, target: Placement) -> list[int]:
    """Servers that hold blocks now and hold other blocks (or none) in ``target``: each must drain
    and reload. A server that gets blocks for the first time is not one (it holds no session)."""
    return [j for j, (a, b) in enumerate(zip(installed.ranges, target.ranges)) if a is not None and _key(a) != _key(b)]


def constrained_placement(
    cluster: Cluster,
    fixed: dict[int, BlockInterval],
    c: int | None,
    tuning: str,
) -> Evaluated | None:
    """The proposed policy's plan with ``fixed`` servers on their ranges: GBP-CR with fixed servers
    for ``c`` (None: every c whose free servers' m_j(c) differ, ranked by the tuning objective, ties
    to the smaller c, as tune_c). None when no c forms a chain."""
    free_arrays = server_arrays(cluster)
    cs = [c] if c is not None else list(range(1, max_capacity(cluster) + 1))
    seen: dict = {}
    best: Evaluated | None = None
    for cc in cs:
        # the placement depends on c through m_j(c) and the stopping target lambda / (rho_bar c)
        p = gbp_cr_fixed(cluster, cc, fixed)
        pk = (tuple(_blocks_per_class(cluster, cc, free_arrays)), p.key())
        if pk not in seen:
            seen[pk] = evaluate(cluster, p, cc)
        ev = seen[pk]
        if ev.chains and (best is None or _better(ev, best, tuning)):
            best = Evaluated(ev.placement, ev.chains, ev.capacity, ev.rate_per_s, ev.lower_s, ev.upper_s, cc)
    return best


def _better(a: Evaluated, b: Evaluated, tuning: str) -> bool:
    """tune_c's order: the objective, or nu when both are infinite; ties keep ``b``."""
    x, y = a.objective(tuning), b.objective(tuning)
    if math.isfinite(x) or math.isfinite(y):
        return x < y
    return a.rate_per_s > b.rate_per_s


def incremental(
    cluster: Cluster,
    installed: Placement,
    c: int,
    leftover: bool = False,
    tuning: str = "lower",
    as_is: Evaluated | None = None,
) -> Evaluated:
    """The re-plan after servers joined or left, without re-planning the swarm: every server that holds
    blocks keeps them (fixed), GBP-CR with fixed servers fills the chains a lost server broke with idle
    servers in Alg. 1's order (a joined server is one of them) and goes on while the target is not met;
    ``leftover`` then gives the idle servers blocks where GCA gains from them. Moves nobody. Cost: one
    GBP-CR pass over the free servers and one GCA over the placed ones, against the whole plan's c* sweep.

    The bound against the whole re-plan (``decide`` with this as the zero-move candidate): the whole plan
    replaces it only if it gains at least ``min_gain``; so while it stands, its objective is within
    1 / (1 - min_gain) of the whole plan's, unless the whole plan has less total capacity (the
    never-worse invariant refuses it then) (tests/test_replan.py checks both against the whole re-plan).

    Never worse than the installed placement as it stands (``not_worse`` under ``tuning``): GCA composes
    chains greedily and is not monotone in the placement, so a joined server's new blocks can leave it
    fewer slots (found by the property test: 19 against 20); then the joined server stays idle.
    ``as_is``: the installed placement already evaluated at ``c`` (``decide`` has it), else evaluated here
    when the repair placed anyone."""
    keep = {j: r for j, r in enumerate(installed.ranges) if r is not None}
    ev = evaluate(cluster, gbp_cr_fixed(cluster, c, keep), c)
    if leftover:
        lo = place_leftover(cluster, ev.placement, c)
        ev = evaluate(cluster, lo.placement, c, lo.gca.chains)
    if ev.placement == installed:
        return ev
    as_is = as_is if as_is is not None else evaluate(cluster, installed, c)
    return ev if not_worse(ev, as_is, tuning) else as_is


@dataclass(frozen=True)
class Decision:
    """What a re-plan installs: ``step`` (at most ``max_moves`` movers from the installed placement
    towards ``target``) or nothing (``install`` False, ``reason`` says why)."""

    install: bool
    reason: str
    baseline: Evaluated
    target: Evaluated | None = None
    step: Evaluated | None = None
    movers: tuple[int, ...] = ()  # of ``step``
    pending_movers: tuple[int, ...] = ()  # of ``target`` beyond the step (later re-plans)
    gain: float = 0.0
    candidates: dict = field(default_factory=dict)  # name -> Evaluated (for /status and tests)


def _step(
    cluster: Cluster, installed: Placement, target: Evaluated, moving: list[int], max_moves: int, tuning: str
) -> tuple[Evaluated, list[int]]:
    """At most ``max_moves`` of ``moving`` take their target ranges (servers new to blocks always do);
    greedy: each pick is the mover whose move evaluates best (capacity, then the objective)."""
    if len(moving) <= max_moves:
        return target, moving
    base = [
        r if j in moving or r is not None else target.placement.ranges[j] for j, r in enumerate(installed.ranges)
    ]  # idle servers load their target ranges in any step
    chosen: list[int] = []
    left = list(moving)
    cur = evaluate(cluster, Placement(tuple(base)), target.c)
    for _ in range(max_moves):
        best = None
        for j in left:
            trial = list(cur.placement.ranges)
            trial[j] = target.placement.ranges[j]
            ev = evaluate(cluster, Placement(tuple(trial)), target.c)
            k = (ev.capacity, -ev.objective(tuning), -j)
            if best is None or k > best[0]:
                best = (k, j, ev)
        _, j, cur = best
        chosen.append(j)
        left.remove(j)
    return cur, chosen


def decide(
    cluster: Cluster,
    installed: Placement,
    fresh: Evaluated,
    *,
    tuning: str = "lower",
    fixed: dict[int, BlockInterval] | None = None,
    busy: frozenset[int] = frozenset(),
    min_gain: float = 0.0,
    max_moves: int | None = None,
    equivalent_rel: float = 0.0,
    installed_c: int | None = None,
    leftover: bool = False,
) -> Decision:
    """The re-plan to install from ``installed`` (ranges per server of ``cluster``: what servers hold
    now; servers new to the swarm None) given the planner's ``fresh`` plan (see module docstring).
    ``fixed`` servers keep their ranges in every candidate (``fresh`` must already respect them: the
    caller plans with ``constrained_placement``); ``busy`` servers are the last to be relabelled away.
    Not installed (``install`` False) when nothing gains: the caller may still refresh the installed
    chains to ``baseline``'s (the same placement under the current model, moving nobody)."""
    fixed = dict(fixed or {})
    if max_moves is not None and max_moves < 1:
        raise ValueError(f"max_moves must be >= 1 (or None), got {max_moves}")
    if not min_gain >= 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    base = evaluate(cluster, installed, installed_c)
    if not installed.used_servers():  # the first plan (or every server lost): nothing to keep or move
        return Decision(True, "first plan", base, fresh, fresh, (), (), gain(fresh, base, tuning), {"fresh": fresh})
    rel = relabel(fresh.placement, installed, equivalent_classes(cluster, equivalent_rel), busy)
    if any(_key(rel.ranges[j]) != _key(r) for j, r in fixed.items()):
        rel = fresh.placement  # a fixed server shares its class and range with another: keep the planner's
    relabelled = fresh if rel == fresh.placement else evaluate(cluster, rel, fresh.c)
    tol = max(equivalent_rel, REL_NOISE)
    fo, ro = fresh.objective(tuning), relabelled.objective(tuning)
    if relabelled.capacity < fresh.capacity or (math.isfinite(fo) and not ro <= fo * (1 + tol)):
        relabelled = fresh  # equivalence within `equivalent_rel` is a model tolerance: never more than that
    cands = {"fresh": relabelled}
    # moving nobody: idle servers complete the installed placement's broken chains (repair), or join
    # it where GCA gains from them (leftover); the installed servers are fixed
    c0 = installed_c if installed_c is not None else fresh.c
    if c0 is not None:
        as_is = base if c0 == installed_c else None
        cands["repair"] = incremental(cluster, installed, c0, tuning=tuning, as_is=as_is)
        if leftover:
            cands["leftover"] = incremental(cluster, installed, c0, leftover=True, tuning=tuning, as_is=as_is)
    ok = {name: ev for name, ev in cands.items() if not_worse(ev, base, tuning)}
    still = [ev for ev in ok.values() if not movers(installed, ev.placement)]
    best_still = base
    for ev in still:
        if _better(ev, best_still, tuning) or (
            ev.capacity > best_still.capacity and not _better(best_still, ev, tuning)
        ):
            best_still = ev
    mv = movers(installed, relabelled.placement)
    if "fresh" not in ok:
        why = (
            "the new plan has less capacity or a higher model mean response than the installed one "
            f"(capacity {relabelled.capacity} vs {base.capacity}, objective "
            f"{relabelled.objective(tuning):.4g} vs {base.objective(tuning):.4g} s)"
        )
    elif not mv:
        why = "the new plan equals the installed one up to equivalent servers: nothing moves"
        best_still = relabelled if _better(relabelled, best_still, tuning) else best_still
    else:
        g = gain(relabelled, best_still, tuning)
        if g >= min_gain and g > 0:
            step, chosen = _step(cluster, installed, relabelled, mv, max_moves or len(mv), tuning)
            if not not_worse(step, base, tuning):
                step, chosen = relabelled, mv  # no partial step keeps the invariant: the whole move, drained
            return Decision(
                True,
                f"predicted gain {g:.3g} >= {min_gain:g}: {len(chosen)} of {len(mv)} server(s) move",
                base,
                relabelled,
                step,
                tuple(chosen),
                tuple(j for j in mv if j not in chosen),
                g,
                cands,
            )
        why = f"predicted gain {g:.3g} of the plan that moves {len(mv)} server(s) is below the threshold {min_gain:g}"
    if best_still is base or best_still.placement == installed:
        return Decision(False, why, base, candidates=cands)
    return Decision(
        True,
        why + "; idle servers join without moving any",
        base,
        best_still,
        best_still,
        (),
        (),
        gain(best_still, base, tuning),
        cands,
    )
