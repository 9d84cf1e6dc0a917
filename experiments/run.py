"""Runs the whole Table 1 experiment: scale the trace, one fresh swarm per policy, results + model check.

Everything the results are computed from is written as it is measured (`scale.json`,
`requests.json`, `records_<policy>.jsonl`, `run_<policy>.json`), so `--recompute` rebuilds the
summary, plots and model check from a results folder (also of a run that was stopped half-way).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

from experiments import model_check, report, workload
from experiments.hosts import EmulationUnavailableError
from experiments.table1 import (
    PETALS_22,
    Table1Config,
    choose_scale,
    measured_block_times,
    run_petals_column,
    run_policy,
)


def rtt_matrix(cfg: Table1Config):
    """RTTs between the client host and the servers' hosts: RIPE Atlas anchors drawn with the seed."""
    from experiments.hosts import ripe_atlas_hosts_rtt_ms
    from netem.topology import (
        RIPE_ATLAS_FILENAME,
        load_ripe_atlas_rtt_matrix,
        resolve_data_file,
    )

    full = load_ripe_atlas_rtt_matrix(resolve_data_file(RIPE_ATLAS_FILENAME, cfg.rtt_data))
    return ripe_atlas_hosts_rtt_ms(full, cfg.servers + 1, cfg.seed)


# settings that may differ between the runs whose columns share one results folder (`--extend`):
# where things are read from or written to, and this run's own policies; everything else (the
# workload, the swarm, the orchestrator's options) must be the same, or the columns are not comparable
EXTEND_MAY_DIFFER = frozenset(
    {
        "policies",
        "out",
        "command",
        "netem_name",
        "petals_work",
        "data",
        "rtt_data",
        "calibrate_from",
        "extra",
        "warmup_timeout_s",
        "probe_timeout_s",
        "extend",
    }
)


class ExtendMismatchError(ValueError):
    """`--extend` into a folder of another workload or swarm."""


def extend_base(cfg: Table1Config, out: Path) -> dict:
    """The recorded run that `cfg` (with `extend`) adds columns to: its scale.json, after checking that
    every setting but EXTEND_MAY_DIFFER is the same. Raises ExtendMismatchError (or FileNotFoundError)."""
    meta_file = out / "scale.json"
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"--extend: no scale.json in {out}; give the --out folder of an earlier "
            "`petals-chain experiment table1` run (or leave --extend out to start one)"
        )
    meta = json.loads(meta_file.read_text())
    # a run recorded before `daemons_in_share` existed ran its servers' daemons inside the hosts' shares;
    # one recorded before `max_batch_tokens` existed ran the servers' default budget, 2048
    mine, theirs = asdict(cfg), {"daemons_in_share": True, "max_batch_tokens": 2048, **meta["config"]}
    differ = sorted(k for k in set(mine) | set(theirs) if k not in EXTEND_MAY_DIFFER and mine.get(k) != theirs.get(k))
    if differ:
        raise ExtendMismatchError(
            f"--extend: {out} holds a run with other settings "
            f"({', '.join(f'{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here' for k in differ)}); "
            f"repeat its command ({meta['command']}) with other --policies, or use another --out"
        )
    return meta


def run_table1(cfg: Table1Config) -> dict:
    """Run `cfg.policies` into `cfg.out`; with `cfg.extend`, as further columns of the run recorded
    there (same requests, scale and RTTs: `extend_base`), the summary covering all its columns."""
    from orchestrator.sim.traces import load_azure_trace
    from petals_chain.models.checkpoint import load_config

    out = Path(cfg.out)
    base = extend_base(cfg, out) if cfg.extend else None
    out.mkdir(parents=True, exist_ok=True)
    trace = load_azure_trace(cfg.data)
    times, path = measured_block_times(cfg.model, cfg.device, cfg.dtype)
    num_blocks = load_config(path).num_hidden_layers
    # an auto time scale is measured again at each start; the columns added must replay at the recorded one
    scale, info = choose_scale(
        cfg if base is None else replace(cfg, time_scale=base["scale"]["time_scale"]), trace, num_blocks, times
    )
    info["num_blocks"] = num_blocks
    rtt_ms, anchors = rtt_matrix(cfg) if cfg.netem else (None, [])
    scale_out = {k: v for k, v in info.items() if not k.startswith("_")}
    record = {
        "command": cfg.command,
        "scale": scale_out,
        "config": asdict(cfg),
        "rtt_anchor_indices": anchors,
        "rtt_ms": None if rtt_ms is None else rtt_ms.tolist(),
    }
    if base is not None:
        recorded = json.loads((out / "requests.json").read_text()) if (out / "requests.json").is_file() else None
        if recorded is not None and recorded != json.loads(json.dumps([r.to_dict() for r in info["_requests"]])):
            raise ExtendMismatchError(
                f"--extend: the requests recorded in {out}/requests.json differ from this "
                "command's (another trace file?); use another --out"
            )
        if base["rtt_anchor_indices"] != anchors:
            raise ExtendMismatchError(
                f"--extend: the RTT anchors recorded in {out} differ from this command's "
                "(another RIPE Atlas file?); use another --out"
            )
        # the recorded run stays what it was (its command, scale and time scale's reason); the folder's
        # policies are its and these, and each extending command is kept
        policies = list(dict.fromkeys([*base["config"]["policies"], *cfg.policies]))
        record = {
            **base,
            "config": {**base["config"], "policies": policies},
            "extended_by": [*base.get("extended_by", []), cfg.command],
        }
    (out / "scale.json").write_text(json.dumps(record, indent=1))
    print(
        f"table1: {scale_out['requests']} requests, rate {scale_out['rate_per_s']:.3f} req/s (trace "
        f"{scale_out['trace_rate_per_s']:.3f}), time x{scale.time_scale:.3g}, input x{scale.length_scale:.3g}, "
        f"output x{scale.output_scale:.3g}, inter-arrival CV {scale_out['interarrival_cv']:.2f}; "
        f"estimated CPU load {scale_out['offered_cpu_load_estimate']:.2f} (busiest {scale_out['peak_window_s']:.0f} s: "
        f"{scale_out['peak_offered_cpu_load_estimate']:.2f}). {scale_out['time_scale_reason']}",
        flush=True,
    )
    t0 = time.monotonic()
    with gpu_isolation(cfg) as gpu_env:
        run_columns(cfg, info, rtt_ms, out, times, path, gpu_env)
    return write_results(out, time.monotonic() - t0)


@contextmanager
def gpu_isolation(cfg: Table1Config) -> Iterator[dict[str, str]]:
    """The GPU variant's isolation for the whole run: an MPS daemon (experiments/gpu_mps.py) with
    `--gpu-isolation mps`, else nothing."""
    if cfg.gpu_isolation == "off":
        yield {}
        return
    from experiments.gpu_mps import mps_daemon

    with mps_daemon(cfg.gpu_sm_percent) as env:
        print(
            f"table1: GPU isolation by MPS ({env['CUDA_MPS_PIPE_DIRECTORY']}), each process capped at "
            f"{cfg.gpu_sm_percent:.0f} % of the SMs",
            flush=True,
        )
        yield env


def run_columns(cfg: Table1Config, info: dict, rtt_ms, out: Path, times, path, gpu_env: dict[str, str]) -> None:
    """Each policy's column in turn, its record written as soon as it ends."""
    for policy in cfg.policies:
        if policy == PETALS_22:
            from petals_chain.runtime.block_range import BlockRange

            probe = BlockRange(path, 0, 1, model_path=path)
            r = run_petals_column(cfg, info, rtt_ms, out, times, probe.block_bytes, probe.hidden_size)
            if r.get("unavailable"):
                print(f"[petals-2.2] not run: {r['unavailable']}", flush=True)
        else:
            try:
                r = run_policy(cfg, policy, info, rtt_ms, out, gpu_env=gpu_env)
            except EmulationUnavailableError:
                raise  # every policy would fail the same way
            except RuntimeError as e:  # this policy's swarm did not come up: say so, go on with the next
                print(f"[{policy}] failed: {e}", flush=True)
                r = {"policy": policy, "unavailable": f"its swarm did not come up: {e}"}
        (out / f"run_{policy}.json").write_text(json.dumps({k: v for k, v in r.items() if k != "records"}, indent=1))


def write_results(out: Path, wall_s: float | None = None) -> dict:
    """summary.json / summary.md / cdf.png / model check from the files of a results folder."""
    meta = json.loads((out / "scale.json").read_text())
    n_requests = meta["scale"]["requests"]
    sc = meta["scale"]
    if (
        "peak_offered_cpu_load_estimate" not in sc
        and (out / "requests.json").exists()
        and sc.get("cpu_s_per_request_estimate")
        and sc.get("server_cpu_capacity")
    ):  # a run before it was recorded
        arrivals = [r["arrival_s"] for r in json.loads((out / "requests.json").read_text())]
        sc["peak_window_s"] = workload.PEAK_WINDOW_S
        sc["peak_offered_cpu_load_estimate"] = workload.peak_offered_load(
            arrivals, sc["cpu_s_per_request_estimate"], sc["server_cpu_capacity"]
        )
    runs = {}
    for policy in meta["config"]["policies"]:
        facts_file, rec_file = out / f"run_{policy}.json", out / f"records_{policy}.jsonl"
        if not facts_file.exists() and not rec_file.exists():
            continue
        facts = (
            json.loads(facts_file.read_text())
            if facts_file.exists()
            else {"policy": policy, "loadgen_error": "the run was stopped before this policy finished"}
        )
        facts["records"] = report.read_records(rec_file) if rec_file.exists() else []
        runs[policy] = facts
    where = next((r["where"] for r in runs.values() if "where" in r), "")
    policies, unavailable = {}, {}
    for p, r in runs.items():
        if r.get("unavailable"):
            unavailable[p] = r["unavailable"]
            continue
        s = report.policy_summary(r["records"], n_requests, meta["config"].get("deadline_s"))
        s.update(
            {
                k: r.get(k)
                for k in (
                    "c",
                    "placement",
                    "left_out_of_plan",
                    "unused_by_plan",
                    "chains",
                    "servers",
                    "final_servers",
                    "host_cpu",
                    "daemons_exempted",
                    "cpu",
                    "startup_s",
                    "probe",
                    "final_metrics",
                    "loadgen_exit",
                    "loadgen_error",
                    "loadgen_tail",
                )
            }
        )
        s["peak_service"] = report.read_peak_service(out, p)
        policies[p] = s
    summary = {
        "command": meta["command"],
        "where": where,
        "scale": meta["scale"],
        "config": meta["config"],
        "rtt_ms": meta["rtt_ms"],
        "rtt_anchor_indices": meta["rtt_anchor_indices"],
        "wall_s": wall_s,
        "policies": policies,
        "not_run": unavailable,
        "change_vs_petals": report.changes_vs(policies, "petals"),
        "paper": report.PAPER_TABLE1,
    }
    points = []
    for p, r in runs.items():
        if p == PETALS_22:
            continue
        model = r.get("final_servers") or r.get("servers") or {}
        points += model_check.hop_points(r["records"], model)
        probe_file = out / f"probe_{p}.jsonl"
        if probe_file.exists():  # the model probe's sessions, each alone (experiments/table1.py model_probe)
            points += model_check.hop_points(report.read_records(probe_file), model, probe=True)
    table = model_check.error_table(points)
    summary["model_check"] = table
    summary["model_error"] = model_check.model_error(table)
    summary["model_drift"] = model_check.model_drift(
        points, {p: report.read_service_logs(out, p) for p in runs if p != PETALS_22}
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    md = report.summary_markdown(summary)
    md += (
        "\n## Model check (paper Figs. 9-10)\n\n"
        + model_check.model_error_markdown(summary["model_error"])
        + "\n"
        + model_check.model_drift_markdown(summary["model_drift"])
        + "\n"
        + model_check.error_markdown(table)
    )
    (out / "summary.md").write_text(md)
    (out / "model_check.json").write_text(json.dumps({"points": points, "errors": table}))
    report.cdf_plot(
        {p: r["records"] for p, r in runs.items() if r["records"]},
        out / "cdf.png",
        f"response time CDF, {n_requests} requests, {where}",
    )
    if points:
        model_check.plot(points, out / "model_check.png")
    return summary
