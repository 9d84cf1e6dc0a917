"""`launch-server --num-blocks N`: PETALS' span choice and rebalancing rule (server/block_selection.py)."""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from server.block_selection import (
    HeldSpan,
    better_start,
    block_throughputs,
    choose_start,
    swarm_min_with,
)


def test_throughputs_sum_the_rates_of_the_servers_holding_each_block():
    spans = [HeldSpan(0, 3, 0.01), HeldSpan(2, 6, 0.02), HeldSpan(0, 0, 0.01), HeldSpan(1, 2, 0.0)]
    assert block_throughputs(6, spans) == [100.0, 100.0, 150.0, 50.0, 50.0, 50.0]


def test_a_new_server_covers_the_uncovered_blocks_first():
    assert choose_start([0.0] * 6, 3) == 0  # an empty swarm: the first span
    assert choose_start([5.0, 5.0, 5.0, 0.0, 0.0, 0.0], 3) == 3
    assert choose_start([5.0, 0.0, 5.0, 5.0, 5.0, 5.0], 2) == 0  # the hole, with its weaker neighbour


@given(st.lists(st.floats(min_value=0, max_value=1e3), min_size=1, max_size=40), st.integers(1, 40))
def test_the_chosen_span_has_the_lexicographically_smallest_sorted_throughputs(throughputs, n):
    assume(n <= len(throughputs))
    start = choose_start(throughputs, n)
    chosen = sorted(throughputs[start : start + n])
    assert all(chosen <= sorted(throughputs[i : i + n]) for i in range(len(throughputs) - n + 1))
    # so the swarm's weakest block after joining there is as strong as after joining anywhere
    best_min = max(swarm_min_with(throughputs, i, n, 1.0) for i in range(len(throughputs) - n + 1))
    assert swarm_min_with(throughputs, start, n, 1.0) == best_min


def test_a_server_moves_only_when_the_weakest_block_gains_enough():
    # two servers on [0, 3) and nobody on [3, 6): one of them moves
    assert better_start([10.0, 10.0, 10.0, 0.0, 0.0, 0.0], 0, 3, 10.0) == 3
    # balanced already: stay
    assert better_start([10.0, 10.0, 10.0, 0.0, 0.0, 0.0], 3, 3, 10.0) is None
    # the weakest block would gain only 9 -> 10 (quality 0.9 >= 0.75): not worth a reload, stay ...
    assert better_start([10.0, 10.0, 9.0, 9.0, 10.0, 10.0], 4, 2, 10.0) is None
    # ... unless the bar is higher
    assert better_start([10.0, 10.0, 9.0, 9.0, 10.0, 10.0], 4, 2, 10.0, balance_quality=0.95) == 2


@given(
    st.lists(st.floats(min_value=0, max_value=100), min_size=2, max_size=20),
    st.integers(1, 20),
    st.integers(0, 19),
    st.floats(min_value=0.1, max_value=100),
)
def test_a_move_never_makes_the_weakest_block_weaker(others, n, current, rate):
    assume(n <= len(others) and current <= len(others) - n)
    target = better_start(others, current, n, rate)
    if target is not None:
        assert swarm_min_with(others, target, n, rate) > swarm_min_with(others, current, n, rate)
