"""RIPE Atlas loader, data-path resolution and the derived RTT matrix."""

from __future__ import annotations

import numpy as np
import pytest

from netem.topology import (
    DATA_ENV_VAR,
    RIPE_ATLAS_FILENAME,
    DataNotFoundError,
    calibrate_geodesic_rtt,
    geodesic_km,
    load_ripe_atlas_anchors,
    pairwise_rtt_ms,
    resolve_data_dir,
    resolve_data_file,
    synthetic_rtt_ms,
)


def _ripe_path():
    try:
        return resolve_data_file(RIPE_ATLAS_FILENAME)
    except DataNotFoundError as exc:
        pytest.skip(f"RIPE Atlas data absent ({exc}); set ${DATA_ENV_VAR} to the shared data folder")


def test_resolve_data_dir_order(tmp_path):
    assert resolve_data_dir(tmp_path, environ={DATA_ENV_VAR: "/elsewhere"}) == tmp_path
    assert str(resolve_data_dir(None, environ={DATA_ENV_VAR: "/elsewhere"})) == "/elsewhere"
    with pytest.raises(DataNotFoundError):
        resolve_data_file("nope.csv", tmp_path)


def test_geodesic_known_distance():
    # Paris - London ~ 344 km
    assert geodesic_km(48.8566, 2.3522, 51.5074, -0.1278) == pytest.approx(344, rel=0.02)


def test_synthetic_rtt_is_symmetric_positive():
    r = synthetic_rtt_ms(12, np.random.default_rng(0))
    assert np.allclose(r, r.T) and np.all(np.diag(r) == 0) and np.all(r[~np.eye(12, dtype=bool)] > 0)


def test_ripe_atlas_loader_and_calibration():
    anchors = load_ripe_atlas_anchors(_ripe_path())
    assert anchors.n_anchors == 320 and anchors.monitor_rtt_ms.shape == (320, 4)
    model = calibrate_geodesic_rtt(anchors)
    assert 0.01 <= model.ms_per_km < 0.1
    assert model.fit_mae_ms < 5.0
    rtt = pairwise_rtt_ms(anchors, model)
    off = rtt[~np.eye(320, dtype=bool)]
    assert np.allclose(rtt, rtt.T) and off.min() >= model.min_rtt_ms and 10 < np.median(off) < 60


def test_bad_file_is_a_clear_error(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_ripe_atlas_anchors(p)
