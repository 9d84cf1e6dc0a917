import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.bounds import (
    exact_ctmc_mean_response_time,
    exact_k2_mean_response_time,
    theorem37_bounds,
)
from orchestrator.model import BlockInterval, ChainSpec


def chain(t, c):
    return ChainSpec((0,), (BlockInterval(0, 1),), c, t)


def erlang_c_response_time(lam, mu, c):
    a = lam / mu
    rho = a / c
    terms = sum(a**k / math.factorial(k) for k in range(c))
    last = a**c / math.factorial(c) / (1 - rho)
    p_wait = last / (terms + last)
    return p_wait / (c * mu - lam) + 1 / mu


@pytest.mark.parametrize("c", [1, 3, 8])
def test_single_chain_bounds_are_exact_mmc(c):
    lam, t = 0.6 * c, 1.0
    b = theorem37_bounds([chain(t, c)], lam)
    want = erlang_c_response_time(lam, 1 / t, c)
    assert b.lower_s == pytest.approx(want) and b.upper_s == pytest.approx(want)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.2, 5.0), st.integers(1, 6), st.floats(0.2, 5.0), st.integers(1, 6), st.floats(0.02, 0.98))
def test_bounds_bracket_exact_k2(t1, c1, t2, c2, load):
    """Theorem 3.7 brackets the exact K=2 analysis of App. A.3, which equals a direct CTMC solve."""
    if t1 > t2:
        t1, t2, c1, c2 = t2, t1, c2, c1
    mu1, mu2 = 1 / t1, 1 / t2
    lam = load * (c1 * mu1 + c2 * mu2)
    exact = exact_k2_mean_response_time(mu1, c1, mu2, c2, lam)
    direct = exact_ctmc_mean_response_time([chain(t1, c1), chain(t2, c2)], lam)
    assert exact == pytest.approx(direct, rel=1e-6)
    b = theorem37_bounds([chain(t1, c1), chain(t2, c2)], lam)
    assert b.lower_s <= exact * (1 + 1e-9) and exact <= b.upper_s * (1 + 1e-9)
    assert b.lower_s >= t1 * (1 - 1e-9)  # nobody is faster than the fastest chain


def test_bounds_bracket_exact_k3():
    chains = [chain(1.0, 2), chain(1.7, 3), chain(4.0, 2)]
    for lam in (0.3, 1.5, 2.8):
        exact = exact_ctmc_mean_response_time(chains, lam)
        b = theorem37_bounds(chains, lam)
        assert b.lower_s <= exact <= b.upper_s


def test_k2_lower_bound_is_not_exact():
    """App. A.3 remark: jobs do not always sit on the fastest chains; the lower bound is strict."""
    lam = 1.0
    exact = exact_k2_mean_response_time(1.0, 2, 0.25, 2, lam)
    assert theorem37_bounds([chain(1.0, 2), chain(4.0, 2)], lam).lower_s < exact - 1e-6


def test_unstable_is_infinite():
    b = theorem37_bounds([chain(1.0, 2)], 2.0)
    assert math.isinf(b.lower_s) and math.isinf(b.upper_s)
    assert math.isinf(exact_k2_mean_response_time(1.0, 1, 1.0, 1, 3.0))
    assert math.isinf(theorem37_bounds([], 1.0).lower_s)


def test_large_total_capacity_is_numerically_stable():
    chains = [chain(2.0 + 0.001 * k, 500) for k in range(400)]  # C = 200 000
    nu = sum(k.capacity / k.service_time_s for k in chains)
    for load in (0.1, 0.9, 0.999):
        b = theorem37_bounds(chains, load * nu)
        assert math.isfinite(b.lower_s) and math.isfinite(b.upper_s)
        assert 2.0 <= b.lower_s <= b.upper_s <= 2.0 + 0.001 * 399 + 1e-6 or load > 0.99
    heavy = theorem37_bounds(chains, (1 - 1e-9) * nu)
    assert math.isfinite(heavy.lower_s) and heavy.lower_s > 100


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 10.0), st.integers(1, 50)), min_size=1, max_size=20), st.floats(0.01, 0.99))
def test_bounds_ordered_and_lower_bound_monotone_in_load(pairs, load):
    chains = [chain(t, c) for t, c in pairs]
    nu = sum(c / t for t, c in pairs)
    b1 = theorem37_bounds(chains, load * nu * 0.5)
    b2 = theorem37_bounds(chains, load * nu)
    assert b1.lower_s <= b1.upper_s * (1 + 1e-12)
    assert b1.lower_s <= b2.lower_s * (1 + 1e-9)
    # (the upper bound need not grow with load: at light load it puts every job on the slowest slot)
    assert b1.lower_s >= min(t for t, _ in pairs) * (1 - 1e-9)
