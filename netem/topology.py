"""Topology loaders: where the shared data lives, the RIPE Atlas EU RTT data set, pairwise RTTs.

The RIPE Atlas file (`LearningDataset_RTT_RipeAtlasEU.csv`, RIPE NCC Atlas, CC BY 4.0) holds RTTs
from 4 monitors (`latency_m1..m4`, ms) to 320 European anchors, with each anchor's latitude and
longitude, but no anchor-to-anchor matrix. `calibrate_geodesic_rtt` derives one:

1. each anchor's RTT to each monitor is the median over its measurements;
2. each monitor's location is unknown: it is put at the point of a 0.5-degree grid over Europe
   where the linear model `rtt = a_m + b_m * distance` fits that monitor's 320 RTTs best
   (least squares);
3. with those locations, one pooled least-squares line `rtt = base_ms + ms_per_km * distance`
   over all (anchor, monitor) pairs, slope clipped to at least 0.01 ms/km (light in fibre);
4. the residuals split into a per-monitor part (median over anchors) and a per-anchor "access"
   part `anchor_excess_ms` (median over monitors of what is left);
5. anchor-to-anchor RTT: `base_ms + ms_per_km * geodesic_km(i, j) + excess_i + excess_j`,
   floored at `min_rtt_ms`; zero on the diagonal.

This module imports nothing of the other project packages (orchestrator and the experiment
scripts import it), and every loader takes a path: nothing here reads a global default except
`resolve_data_dir`, the one function that says where the shared data folder is.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA_ENV_VAR = "PETALS_CHAIN_DATA"
RIPE_ATLAS_FILENAME = "LearningDataset_RTT_RipeAtlasEU.csv"
AZURE_CODE_TRACE_FILENAME = "AzureLLMInferenceTrace_code.csv"
EARTH_RADIUS_KM = 6371.0088
_N_MONITORS = 4


class DataNotFoundError(FileNotFoundError):
    """A data file the caller asked for is not where the data-path scheme says."""


def resolve_data_dir(
    explicit: str | os.PathLike | None = None, *, environ: dict[str, str] | None = None
) -> Path | None:
    """The shared data folder: `explicit` if given, else `$PETALS_CHAIN_DATA`, else the `data/` folder
    of `../shared` relative to the repository root when present; None when none of them applies."""
    env = os.environ if environ is None else environ
    if explicit is not None:
        return Path(explicit)
    if env.get(DATA_ENV_VAR):
        return Path(env[DATA_ENV_VAR])
    repo_root = Path(__file__).resolve().parents[1]
    candidate = repo_root.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None


def resolve_data_file(
    filename: str, explicit: str | os.PathLike | None = None, *, environ: dict[str, str] | None = None
) -> Path:
    """Path of one data file. `explicit` may name the file itself or a folder holding it; otherwise
    the folder comes from `resolve_data_dir`. Raises DataNotFoundError with the places it looked."""
    if explicit is not None and Path(explicit).is_file():
        return Path(explicit)
    folder = resolve_data_dir(explicit, environ=environ)
    if folder is None:
        raise DataNotFoundError(
            f"{filename} not found: pass a path, set ${DATA_ENV_VAR}, or put it in ../shared/data next to the "
            f"repository"
        )
    path = folder / filename
    if not path.is_file():
        raise DataNotFoundError(f"{filename} not found at {path}")
    return path


@dataclass(frozen=True)
class AtlasAnchors:
    """RIPE Atlas anchors: coordinates and the median RTT (ms) from each of the 4 monitors."""

    anchor_ids: tuple[int, ...]
    lat_deg: np.ndarray  # (n,)
    lon_deg: np.ndarray  # (n,)
    monitor_rtt_ms: np.ndarray  # (n, 4), median over the anchor's measurements

    @property
    def n_anchors(self) -> int:
        return len(self.anchor_ids)


def load_ripe_atlas_anchors(path: str | os.PathLike) -> AtlasAnchors:
    """Read the RIPE Atlas EU CSV (measure_id, anchor_id, ..., latency_m1..m4, latitude, longitude)."""
    per_anchor: dict[int, dict] = {}
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        needed = {"anchor_id", "latitude", "longitude"} | {f"latency_m{i}" for i in range(1, _N_MONITORS + 1)}
        missing = needed - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not a RIPE Atlas RTT file, missing columns {sorted(missing)}")
        for row in reader:
            anchor = int(row["anchor_id"])
            entry = per_anchor.setdefault(
                anchor, {"lat": float(row["latitude"]), "lon": float(row["longitude"]), "rtt": []}
            )
            entry["rtt"].append([float(row[f"latency_m{i}"]) for i in range(1, _N_MONITORS + 1)])
    if not per_anchor:
        raise ValueError(f"{path}: no measurements")
    ids = tuple(sorted(per_anchor))
    rtt = np.array([np.nanmedian(np.array(per_anchor[a]["rtt"]), axis=0) for a in ids])
    return AtlasAnchors(
        anchor_ids=ids,
        lat_deg=np.array([per_anchor[a]["lat"] for a in ids]),
        lon_deg=np.array([per_anchor[a]["lon"] for a in ids]),
        monitor_rtt_ms=rtt,
    )


def geodesic_km(lat1_deg, lon1_deg, lat2_deg, lon2_deg) -> np.ndarray:
    """Great-circle distance (haversine), broadcasting over arrays."""
    lat1, lon1, lat2, lon2 = (np.radians(np.asarray(x, dtype=float)) for x in (lat1_deg, lon1_deg, lat2_deg, lon2_deg))
    h = np.sin((lat2 - lat1) / 2) ** 2 + np.cos(lat1) * np.cos(lat2) * np.sin((lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * np.arcsin(np.sqrt(np.clip(h, 0.0, 1.0)))


def pairwise_geodesic_km(lat_deg: np.ndarray, lon_deg: np.ndarray) -> np.ndarray:
    return geodesic_km(lat_deg[:, None], lon_deg[:, None], lat_deg[None, :], lon_deg[None, :])


@dataclass(frozen=True)
class GeodesicRttModel:
    """RTT(i, j) = base_ms + ms_per_km * km(i, j) + anchor_excess_ms[i] + anchor_excess_ms[j]."""

    base_ms: float
    ms_per_km: float
    anchor_excess_ms: np.ndarray  # (n,)
    monitor_lat_deg: np.ndarray  # (4,) fitted
    monitor_lon_deg: np.ndarray  # (4,)
    fit_mae_ms: float  # in-sample mean absolute error on the measured anchor-monitor RTTs
    min_rtt_ms: float = 0.5


def _best_monitor_location(lat, lon, rtt, grid_lat, grid_lon) -> tuple[float, float]:
    best = (np.inf, 0.0, 0.0)
    for glat in grid_lat:
        d = geodesic_km(glat, grid_lon[:, None], lat[None, :], lon[None, :])  # (len(grid_lon), n)
        dm = d - d.mean(axis=1, keepdims=True)
        rm = rtt - rtt.mean()
        slope = (dm @ rm) / np.maximum((dm * dm).sum(axis=1), 1e-9)
        slope = np.maximum(slope, 0.0)
        resid = rm[None, :] - slope[:, None] * dm
        sse = (resid * resid).sum(axis=1)
        k = int(np.argmin(sse))
        if sse[k] < best[0]:
            best = (float(sse[k]), float(glat), float(grid_lon[k]))
    return best[1], best[2]


def calibrate_geodesic_rtt(
    anchors: AtlasAnchors, *, min_ms_per_km: float = 0.01, min_rtt_ms: float = 0.5
) -> GeodesicRttModel:
    """Fit the geodesic RTT model of the module docstring to the anchors' monitor RTTs."""
    lat, lon, rtt = anchors.lat_deg, anchors.lon_deg, anchors.monitor_rtt_ms
    grid_lat = np.arange(34.0, 71.0, 0.5)
    grid_lon = np.arange(-25.0, 45.5, 0.5)
    mon = [_best_monitor_location(lat, lon, rtt[:, m], grid_lat, grid_lon) for m in range(rtt.shape[1])]
    mon_lat = np.array([m[0] for m in mon])
    mon_lon = np.array([m[1] for m in mon])
    dist = geodesic_km(lat[:, None], lon[:, None], mon_lat[None, :], mon_lon[None, :])  # (n, 4)
    ok = np.isfinite(rtt)
    x, y = dist[ok], rtt[ok]
    slope = max(float(np.polyfit(x, y, 1)[0]), min_ms_per_km)
    base = float(np.mean(y - slope * x))
    resid = np.where(ok, rtt - (base + slope * dist), np.nan)
    monitor_part = np.nanmedian(resid, axis=0)
    anchor_excess = np.nanmedian(resid - monitor_part[None, :], axis=1)
    anchor_excess = np.nan_to_num(anchor_excess)
    pred = base + slope * dist + monitor_part[None, :] + anchor_excess[:, None]
    mae = float(np.nanmean(np.abs(np.where(ok, pred - rtt, np.nan))))
    return GeodesicRttModel(
        base_ms=base,
        ms_per_km=slope,
        anchor_excess_ms=anchor_excess,
        monitor_lat_deg=mon_lat,
        monitor_lon_deg=mon_lon,
        fit_mae_ms=mae,
        min_rtt_ms=min_rtt_ms,
    )


def pairwise_rtt_ms(anchors: AtlasAnchors, model: GeodesicRttModel) -> np.ndarray:
    """Symmetric anchor-to-anchor RTT matrix (ms) under `model`; zero diagonal."""
    km = pairwise_geodesic_km(anchors.lat_deg, anchors.lon_deg)
    e = model.anchor_excess_ms
    rtt = model.base_ms + model.ms_per_km * km + e[:, None] + e[None, :]
    rtt = np.maximum(rtt, model.min_rtt_ms)
    np.fill_diagonal(rtt, 0.0)
    return rtt


def synthetic_rtt_ms(
    n_nodes: int, rng: np.random.Generator, *, base_ms: float = 5.0, ms_per_km: float = 0.02
) -> np.ndarray:
    """RTT matrix of `n_nodes` points drawn uniformly over a European box (lat 36-60, lon -10-30),
    RTT = base_ms + ms_per_km * geodesic km; for runs without the RIPE Atlas file."""
    lat = rng.uniform(36.0, 60.0, n_nodes)
    lon = rng.uniform(-10.0, 30.0, n_nodes)
    rtt = base_ms + ms_per_km * pairwise_geodesic_km(lat, lon)
    np.fill_diagonal(rtt, 0.0)
    return rtt


def load_ripe_atlas_rtt_matrix(path: str | os.PathLike) -> np.ndarray:
    """Convenience: load the RIPE Atlas CSV and return the calibrated pairwise RTT matrix (ms)."""
    anchors = load_ripe_atlas_anchors(path)
    return pairwise_rtt_ms(anchors, calibrate_geodesic_rtt(anchors))


# -- emulated topologies: host names + a validated RTT matrix -------------------------------------


@dataclass(frozen=True)
class Topology:
    """Hosts and their symmetric RTT matrix (ms, zero diagonal), what `netem.Network` emulates."""

    hosts: tuple[str, ...]
    rtt_ms: tuple[tuple[float, ...], ...]
    source: str  # "ripe:<seed>", "synthetic:<seed>" or the JSON file's path


def validate_rtt_matrix(hosts, rtt_ms, *, where: str = "topology") -> list[list[float]]:
    """The matrix as lists of floats, or a ValueError saying what is wrong: one distinct non-empty name per
    host, an n x n matrix of finite non-negative numbers, zero diagonal, symmetric (within 1e-6 ms)."""
    from netem.errors import TopologyError

    hosts = list(hosts)
    if not hosts or not all(isinstance(h, str) and h and h.strip() == h and " " not in h for h in hosts):
        raise TopologyError(f"{where}: 'hosts' must be a non-empty list of names without spaces, got {hosts!r}")
    if len(set(hosts)) != len(hosts):
        raise TopologyError(f"{where}: host names must be distinct, got {hosts!r}")
    try:
        m = np.array(rtt_ms, dtype=float)
    except (TypeError, ValueError):
        raise TopologyError(f"{where}: 'rtt_ms' must be a square list of lists of numbers") from None
    n = len(hosts)
    if m.shape != (n, n):
        raise TopologyError(f"{where}: 'rtt_ms' must be {n} x {n} for {n} hosts, got shape {m.shape}")
    if not np.all(np.isfinite(m)) or np.any(m < 0):
        raise TopologyError(f"{where}: RTTs must be finite and >= 0 ms")
    if np.any(np.diag(m) != 0):
        raise TopologyError(f"{where}: the diagonal (a host to itself) must be 0, got {np.diag(m).tolist()}")
    bad = np.argwhere(np.abs(m - m.T) > 1e-6)
    if len(bad):
        i, j = bad[0]
        raise TopologyError(
            f"{where}: RTTs must be symmetric: rtt_ms[{i}][{j}] = {m[i, j]} but "
            f"rtt_ms[{j}][{i}] = {m[j, i]} ({hosts[i]} <-> {hosts[j]})"
        )
    return m.tolist()


def load_topology_json(path: str | os.PathLike) -> Topology:
    """`{"hosts": ["a", "b", ...], "rtt_ms": [[0, 40, ...], ...]}`, validated by `validate_rtt_matrix`."""
    import json

    from netem.errors import TopologyError

    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TopologyError(f"{path}: no such topology file") from None
    except json.JSONDecodeError as e:
        raise TopologyError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict) or set(doc) - {"hosts", "rtt_ms"} or not {"hosts", "rtt_ms"} <= set(doc):
        raise TopologyError(f'{path}: expected exactly {{"hosts": [...], "rtt_ms": [[...], ...]}}')
    m = validate_rtt_matrix(doc["hosts"], doc["rtt_ms"], where=str(path))
    return Topology(tuple(doc["hosts"]), tuple(tuple(r) for r in m), str(path))


def ripe_topology(n_hosts: int, rng: np.random.Generator, path: str | os.PathLike, *, seed_label: str = "") -> Topology:
    """`n_hosts` RIPE Atlas anchors drawn at random without replacement (as the paper picks nodes), with the
    calibrated anchor-to-anchor RTTs; hosts are named `anchor<ID>`."""
    anchors = load_ripe_atlas_anchors(path)
    if not 1 <= n_hosts <= anchors.n_anchors:
        from netem.errors import TopologyError

        raise TopologyError(f"--hosts must lie in 1..{anchors.n_anchors} for the RIPE Atlas data")
    full = pairwise_rtt_ms(anchors, calibrate_geodesic_rtt(anchors))
    pick = np.sort(rng.choice(anchors.n_anchors, size=n_hosts, replace=False))
    m = full[np.ix_(pick, pick)]
    m = (m + m.T) / 2
    return Topology(
        tuple(f"anchor{anchors.anchor_ids[k]}" for k in pick), tuple(tuple(r) for r in m.tolist()), f"ripe:{seed_label}"
    )


def synthetic_topology(n_hosts: int, rng: np.random.Generator, *, seed_label: str = "") -> Topology:
    """`synthetic_rtt_ms` points; hosts are named h0, h1, ..."""
    m = synthetic_rtt_ms(n_hosts, rng)
    return Topology(
        tuple(f"h{i}" for i in range(n_hosts)), tuple(tuple(r) for r in m.tolist()), f"synthetic:{seed_label}"
    )
