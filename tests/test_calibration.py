"""The calibrated service model: the fit recovers known t_I / t_O / t_o from synthetic service
records; re-plan triggers and hysteresis with an injected clock (pure)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from orchestrator.service.calibration import ReplanTrigger, ServiceWindow, fit_service


@settings(max_examples=30, deadline=None)
@given(t_I=st.floats(1e-5, 1e-3), t_O=st.floats(1e-4, 2e-2), overhead=st.floats(0.1, 2.0),
       blocks=st.integers(1, 30), seed=st.integers(0, 10**6), outliers=st.floats(0.0, 0.15))
def test_fit_recovers_known_times_despite_noise_and_outliers(t_I, t_O, overhead, blocks, seed, outliers):
    # t_o as a fraction of a 3-session decode step: a term far below the 2 % timer jitter of the
    # batches it rides on cannot be told from noise by any fit
    t_o = overhead * 3 * t_O * blocks
    rng = np.random.default_rng(seed)
    n = 150
    prefill = np.where(rng.random(n) < 0.2, rng.integers(8, 256, n), 0) * blocks  # block-tokens
    decode = np.where(prefill > 0, 0, rng.integers(1, 8, n)) * blocks  # 1..7 sessions decoding
    assume((prefill > 0).sum() >= 3)  # t_I needs prefill batches to be seen at all
    wall = t_o + t_I * prefill + t_O * decode
    wall = wall * rng.normal(1.0, 0.02, n)  # timer jitter
    bad = rng.random(n) < outliers
    wall[bad] *= rng.uniform(1.5, 6.0, bad.sum())  # batches slowed by a neighbour (only ever slower)
    fit = fit_service(prefill, decode, wall)
    assert fit is not None and fit.samples == n
    assert fit.t_O_s == pytest.approx(t_O, rel=0.1)
    assert fit.t_I_s == pytest.approx(t_I, rel=0.15, abs=0.05 * t_O)
    assert fit.t_o_s == pytest.approx(t_o, rel=0.25, abs=0.05 * t_O * blocks)


def test_fit_needs_decode_batches_and_the_window_its_minimum():
    assert fit_service([10, 20, 30], [0, 0, 0], [0.1, 0.2, 0.3]) is None
    w = ServiceWindow(min_batches=5)
    for seq in range(4):
        w.add_batch(seq, 0, 10, 0.01 + 0.001 * 10, 0.01)
    assert w.fit() is None
    w.add_batch(3, 0, 10, 99.0, 0.0)  # a record read twice (cursor) is ignored
    w.add_batch(4, 0, 20, 0.01 + 0.001 * 20, 0.02)
    f = w.fit()
    assert f.t_O_s == pytest.approx(0.001, rel=1e-3) and f.t_o_s == pytest.approx(0.01, rel=1e-2)
    w.add_hop(0.005, 0.002)
    w.add_hop(0.001, 0.002)  # below the RTT: counts as no extra cost
    w.add_hop(0.004, 0.002)
    assert w.hop_cost == pytest.approx(0.002)


def test_replan_trigger_fires_after_the_hold_and_has_hysteresis():
    t = ReplanTrigger(enter=0.2, exit=0.1, hold_s=30.0, min_interval_s=100.0)
    t.planned(10.0, 4, now_s=0.0)
    assert not t.observe(10.5, 4, now_s=10.0)  # 5 %: nothing
    assert not t.observe(13.0, 4, now_s=110.0)  # 30 %: armed at 110
    assert not t.observe(11.5, 4, now_s=125.0)  # 15 %: between exit and enter: still armed
    assert t.observe(13.0, 4, now_s=140.0)  # held 30 s above enter: due
    t.planned(13.0, 4, now_s=141.0)
    assert not t.observe(13.0, 4, now_s=500.0)  # the new reference
    assert not t.observe(13.0, 6, now_s=510.0)  # c* moved: armed
    assert not t.observe(13.5, 4, now_s=530.0)  # back within exit: disarmed
    assert not t.observe(13.0, 6, now_s=541.0)  # armed again at 541 ...
    assert t.observe(13.0, 6, now_s=571.0)  # ... due 30 s later


def test_replan_trigger_waits_for_the_minimum_interval():
    t = ReplanTrigger(enter=0.2, exit=0.1, hold_s=0.0, min_interval_s=60.0)
    t.planned(1.0, 2, now_s=0.0)
    assert not t.observe(2.0, 2, now_s=30.0)
    assert t.observe(2.0, 2, now_s=60.0)
    with pytest.raises(ValueError):
        ReplanTrigger(enter=0.1, exit=0.2)
