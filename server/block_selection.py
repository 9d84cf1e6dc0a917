"""Self-placement without an orchestrator (`launch-server --num-blocks N`), PETALS' rule.

Each block's throughput is the sum, over the online servers holding it, of that server's decode
rate for one block (1 / t_O, tokens per second). A joining server takes the contiguous span of N
blocks whose throughputs, sorted, are lexicographically smallest: it covers the swarm's weakest
blocks first (an uncovered block, 0 tokens/s, before anything else), as PETALS'
`_choose_best_start` does. A serving server re-chooses when moving would raise the swarm's weakest
block enough: when `min throughput now / min throughput after the best move < balance_quality`
(PETALS' `should_choose_other_blocks`, default 0.75).

Pure functions over (start, end, t_O) triples, so they are tested without a swarm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HeldSpan:
    """One online server's blocks `[start, end)` and its per-block decode time t_O (seconds)."""

    start: int
    end: int
    decode_s_per_token: float

    @property
    def rate(self) -> float:
        """Tokens per second one of its blocks serves (a server that reports no time counts as none)."""
        return 1.0 / self.decode_s_per_token if self.decode_s_per_token > 0 else 0.0


def block_throughputs(total_blocks: int, spans: Iterable[HeldSpan]) -> list[float]:
    rates = [0.0] * total_blocks
    for span in spans:
        for b in range(max(0, span.start), min(total_blocks, span.end)):
            rates[b] += span.rate
    return rates


def choose_start(throughputs: Sequence[float], num_blocks: int) -> int:
    """The start of the N-block span covering the weakest blocks (ties: the first such start)."""
    if not 1 <= num_blocks <= len(throughputs):
        raise ValueError(f"num_blocks must be in [1, {len(throughputs)}], got {num_blocks}")
    return min(range(len(throughputs) - num_blocks + 1), key=lambda i: (sorted(throughputs[i : i + num_blocks]), i))


def swarm_min_with(throughputs: Sequence[float], start: int, num_blocks: int, rate: float) -> float:
    """The weakest block's throughput if a server of `rate` held `[start, start + num_blocks)`."""
    return min(t + (rate if start <= b < start + num_blocks else 0.0) for b, t in enumerate(throughputs))


def better_start(
    others: Sequence[float], current_start: int, num_blocks: int, rate: float, balance_quality: float = 0.75
) -> int | None:
    """Where a server now at `current_start` should move, or None to stay. `others`: the blocks'
    throughputs without this server."""
    best = choose_start(others, num_blocks)
    if best == current_start:
        return None
    now = swarm_min_with(others, current_start, num_blocks, rate)
    after = swarm_min_with(others, best, num_blocks, rate)
    if after <= 0:
        return None  # the swarm cannot be covered by this move either: nothing gained
    return best if now / after < balance_quality else None
