"""Table 1 results: per-request records -> the paper's table (summary.json / summary.md) and a CDF plot.

Times per request (seconds, from the replay's start): response = end - arrival, wait = start -
arrival (start = when the orchestrator's grant reached the client), service = end - start.
Failed requests are counted and listed, never folded into the statistics above. One more number
covers every request: `response_all_lower_bound_s`, the mean response over all requests with a
failed one counted at the moment it was given up (its acquire timeout, or the replay deadline):
a lower bound of what its response would have been, since it was never served. Without it a
policy that drops its slowest requests looks faster than one that serves them all.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PAPER_TABLE1 = {  # the paper's Table 1 (LLaMA-2-7B, 9 MIG instances, 1,000 requests), for side-by-side reading
    "petals": {
        "response_s": {"mean": 31.4, "median": 27.8, "p95": 68.5, "p99": 89.3},
        "wait_s": {"mean": 24.2, "median": 20.5, "p95": 61.3, "max": 142.6},
        "service_s": {"mean": 7.2, "median": 5.8, "p95": 18.9, "min": 0.8, "max": 52.3},
    },
    "bprr": {
        "response_s": {"mean": 19.8, "median": 16.9, "p95": 44.2, "p99": 61.7},
        "wait_s": {"mean": 12.6, "median": 9.7, "p95": 37.1, "max": 98.4},
        "service_s": {"mean": 7.2, "median": 5.9, "p95": 18.7, "min": 0.9, "max": 51.8},
    },
    "jffc-only": {
        "response_s": {"mean": 10.0, "median": 8.5, "p95": 22.1, "p99": 29.6},
        "wait_s": {"mean": 1.5, "median": 0.1, "p95": 7.8, "max": 25.1},
        "service_s": {"mean": 8.5, "median": 7.2, "p95": 20.3, "min": 1.1, "max": 55.8},
    },
    "proposed": {
        "response_s": {"mean": 7.3, "median": 6.5, "p95": 15.2, "p99": 21.4},
        "wait_s": {"mean": 0.6, "median": 0.1, "p95": 4.8, "max": 24.3},
        "service_s": {"mean": 6.7, "median": 5.7, "p95": 18.2, "min": 0.8, "max": 49.1},
    },
}
POLICY_ORDER = ("petals-2.2", "petals", "bprr", "jffc-only", "proposed")


def stats(values: list[float]) -> dict:
    if not values:
        return {k: None for k in ("mean", "median", "p95", "p99", "min", "max")}
    a = np.asarray(values, dtype=float)
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
        "min": float(a.min()),
        "max": float(a.max()),
    }


def times(rec: dict) -> tuple[float, float | None, float | None]:
    """(response, wait, service) of a finished record; wait and service are None where the start is not
    observable (real PETALS: a session waits for cache inside the servers)."""
    start = rec.get("start_s")
    return (
        rec["end_s"] - rec["arrival_s"],
        None if start is None else start - rec["arrival_s"],
        None if start is None else rec["end_s"] - start,
    )


def finished(rec: dict) -> bool:
    return rec.get("error") is None and rec.get("generated_tokens") == rec.get("output_tokens")


def given_up_response_s(rec: dict, deadline_at_s: float | None) -> float | None:
    """Response of a failed record counted at the moment it was given up: its own end (an acquire
    timeout, an error) or, with none, the replay deadline; None where neither is known."""
    end = rec.get("end_s")
    if end is None:
        end = deadline_at_s
    return None if end is None else max(0.0, end - rec["arrival_s"])


def response_all_lower_bound(records: list[dict], deadline_s: float | None) -> float | None:
    """Mean response over every record, failed ones at their give-up time (see the module doc);
    None where a failed record's give-up time is unknown (no deadline given)."""
    if not records:
        return None
    deadline_at = None if deadline_s is None else max(r["arrival_s"] for r in records) + deadline_s
    vals = [times(r)[0] if finished(r) else given_up_response_s(r, deadline_at) for r in records]
    return None if any(v is None for v in vals) else float(np.mean(vals))


def policy_summary(records: list[dict], expected: int, deadline_s: float | None = None) -> dict:
    """The issue's schema for one policy: counts and response / wait / service statistics."""
    ok = [r for r in records if finished(r)]
    t = [times(r) for r in ok]
    errors: dict[str, int] = {}
    for r in records:
        if not finished(r):
            key = (r.get("error") or "incomplete").split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": expected,
        "recorded": len(records),
        "finished": len(ok),
        "failed": len(records) - len(ok),
        "lost": expected - len(records),
        "errors": errors,
        "response_all_lower_bound_s": response_all_lower_bound(records, deadline_s),
        "response_s": stats([x[0] for x in t]),
        "wait_s": stats([x[1] for x in t if x[1] is not None]),
        "service_s": stats([x[2] for x in t if x[2] is not None]),
    }


def change(base: float | None, x: float | None) -> float | None:
    """x / base - 1, the paper's sign: negative is shorter (its proposed: 7.3 / 31.4 - 1 = -76.8 %)."""
    return None if base in (None, 0) or x is None else x / base - 1.0


def changes_vs(policies: dict, base: str) -> dict:
    if base not in policies:
        return {}
    b = policies[base]
    return {
        p: {
            "mean_response": change(b["response_s"]["mean"], s["response_s"]["mean"]),
            "mean_wait": change(b["wait_s"]["mean"], s["wait_s"]["mean"]),
            "p95_response": change(b["response_s"]["p95"], s["response_s"]["p95"]),
            "mean_response_all_lower_bound": change(
                b.get("response_all_lower_bound_s"), s.get("response_all_lower_bound_s")
            ),
        }
        for p, s in policies.items()
        if p != base
    }


def _f(x, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _cores(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def server_hosts_cpu_s(host_cpu: dict | None) -> float | None:
    """CPU seconds the server hosts (every host but `client`) used during a replay; None where a run
    has no per-host CPU or one of them is unknown."""
    used = [v.get("cpu_s") for h, v in (host_cpu or {}).items() if h != "client"]
    return None if not used or None in used else float(sum(used))


PEAK_SERVICE_WINDOW_S = 60.0


def peak_service(batches: list[dict], window_s: float = PEAK_SERVICE_WINDOW_S) -> dict | None:
    """A server's busiest window of its service log (`launch-server --service-log`: per batch `t_s`, the
    batch's end on CLOCK_MONOTONIC, `service_s`, `cpu_s`, `items`): the fraction of the window its batches
    ran (`busy`), the CPU cores they used, and the sessions per batch then. Whether compute or something
    else (the slots a plan gives, the network) bounds a run shows here: a server near busy 1 at its
    peak is compute-bound; one far below it while requests queue waits for work. None without batches."""
    ok = [b for b in batches if b.get("ok", True) and b.get("service_s") is not None]
    if not ok:
        return None
    t = np.array([b["t_s"] for b in ok], dtype=float)
    busy_s = np.array([b["service_s"] for b in ok], dtype=float)
    cpu_s = np.array([b.get("cpu_s") or 0.0 for b in ok], dtype=float)
    rows = np.array([len(b.get("items") or ()) for b in ok], dtype=float)
    order = np.argsort(t)
    t, busy_s, cpu_s, rows = t[order], busy_s[order], cpu_s[order], rows[order]
    # every window (t_i - window_s, t_i] ending at a batch's end; the busiest by its batches' service seconds
    lo = np.searchsorted(t, t - window_s, side="right")
    cum = np.concatenate([[0.0], np.cumsum(busy_s)])
    i = int(np.argmax(cum[1:] - cum[lo]))
    sel = slice(int(lo[i]), i + 1)
    return {
        "window_s": window_s,
        "busy": float(busy_s[sel].sum() / window_s),
        "cpu_cores": float(cpu_s[sel].sum() / window_s),
        "sessions_per_batch": float(rows[sel].mean()),
    }


def read_service_logs(out: Path, policy: str) -> dict[str, list[dict]]:
    """Server name -> its batches, from each `service_<policy>_<server>.jsonl` in a results folder."""
    return {
        path.stem.removeprefix(f"service_{policy}_"): [
            json.loads(line) for line in path.read_text().splitlines() if line.strip()
        ]
        for path in sorted(out.glob(f"service_{policy}_*.jsonl"))
    }


def read_peak_service(out: Path, policy: str) -> dict[str, dict]:
    """`peak_service` of each `service_<policy>_<server>.jsonl` in a results folder."""
    peaks = {}
    for server, batches in read_service_logs(out, policy).items():
        peak = peak_service(batches)
        if peak is not None:
            peaks[server] = peak
    return peaks


def _inputs_cut(sc: dict) -> str:
    n = sc.get("inputs_cut", 0)
    return f", {n} inputs cut to their last {sc['max_length_tokens']} tokens or fewer" if n else ""


def _load_line(sc: dict) -> str:
    if sc.get("peak_offered_cpu_load_estimate") is None or sc.get("offered_cpu_load_estimate") is None:
        return ""
    return (
        f" Offered CPU load by that W: {sc['offered_cpu_load_estimate']:.2f} over the whole replay, "
        f"{sc['peak_offered_cpu_load_estimate']:.2f} in its busiest {sc['peak_window_s']:.0f} s."
    )


def summary_markdown(summary: dict) -> str:
    pols = [p for p in POLICY_ORDER if p in summary["policies"]] + [
        p for p in summary["policies"] if p not in POLICY_ORDER
    ]
    P = summary["policies"]
    head = "| metric | " + " | ".join(pols) + " |\n|---|" + "---|" * len(pols)
    rows = [head]

    def row(label, f):
        rows.append(f"| {label} | " + " | ".join(f(p) for p in pols) + " |")

    rows.append("| **Response time (s)** |" + " |" * len(pols))
    for k in ("mean", "median", "p95", "p99", "max"):
        row(f"  {k}", lambda p, k=k: _f(P[p]["response_s"][k]))
    row("  mean of all requests, failed at give-up (lower bound)", lambda p: _f(P[p].get("response_all_lower_bound_s")))
    rows.append("| **Waiting time (s)** |" + " |" * len(pols))
    for k in ("mean", "median", "p95", "p99", "max"):
        row(f"  {k}", lambda p, k=k: _f(P[p]["wait_s"][k]))
    rows.append("| **Service time (s)** |" + " |" * len(pols))
    for k in ("mean", "median", "p95", "p99"):
        row(f"  {k}", lambda p, k=k: _f(P[p]["service_s"][k]))
    row("  min / max", lambda p: f"{_f(P[p]['service_s']['min'])} / {_f(P[p]['service_s']['max'])}")
    imp = summary.get("change_vs_petals", {})
    rows.append("| **Change vs PETALS policy** (negative: shorter) |" + " |" * len(pols))
    for k, label in (
        ("mean_response", "mean response"),
        ("mean_wait", "mean wait"),
        ("p95_response", "P95 response"),
        ("mean_response_all_lower_bound", "mean response of all requests (lower bound)"),
    ):
        row(f"  {label}", lambda p, k=k: _pct(imp.get(p, {}).get(k)))
    row("finished / failed / requests", lambda p: f"{P[p]['finished']} / {P[p]['failed']} / {P[p]['requests']}")
    row("c (lower bound) / chains", lambda p: f"{P[p].get('c', '—')} / {len(P[p].get('chains') or [])}")
    sc = summary["scale"]
    lines = [
        f"# Table 1 on the live swarm ({summary['where']})",
        "",
        f"command: `{summary['command']}`",
        "",
        f"Scale: time x{sc['time_scale']:.3g}, input length x{sc['length_scale']:.3g}, output length "
        f"x{sc['output_scale']:.3g}, max length {sc['max_length_tokens']} tokens; {sc['requests']} requests from "
        f"trace position {sc['offset']}: rate {sc['rate_per_s']:.3f} req/s (trace {sc['trace_rate_per_s']:.3f}), "
        f"inter-arrival CV {sc['interarrival_cv']:.2f} (trace {sc['trace_interarrival_cv']:.2f}), mean input "
        f"{sc['mean_input_tokens']:.1f} / output {sc['mean_output_tokens']:.1f} tokens (trace "
        f"{sc['trace_mean_input_tokens']:.0f} / {sc['trace_mean_output_tokens']:.1f}), {sc['truncated']} outputs "
        f"cut to fit{_inputs_cut(sc)}. {sc.get('time_scale_reason', '')}{_load_line(sc)}",
        "",
        "\n".join(rows),
        "",
    ]
    for p in pols:
        cpu = P[p].get("cpu")
        if cpu:
            finished = P[p].get("finished") or 0
            server_cpu = server_hosts_cpu_s(P[p].get("host_cpu"))
            servers = f", the server hosts' {server_cpu / finished:.2f}" if finished and server_cpu is not None else ""
            per_req = (
                f"; {cpu['ours_cpu_s'] / finished:.2f} CPU-s per finished request{servers} (the auto time scale "
                f"assumed {sc['cpu_s_per_request_estimate']:.2f})"
                if finished and sc.get("cpu_s_per_request_estimate")
                else ""
            )
            nice = (
                f", of which {100 * cpu['machine_nice']:.0f}% niced work of other users"
                if "machine_nice" in cpu
                else ""
            )
            lines.append(
                f"- {p}: CPU during the replay: our processes {cpu['ours_cpu_s']:.0f} CPU-s over "
                f"{cpu['wall_s']:.0f} s = {cpu['ours_cores']:.2f} of {cpu['n_cpus']} cores{per_req}; whole "
                f"machine busy {100 * cpu['machine_busy']:.0f}% (other users included{nice})"
            )
    shares = sc.get("cpu_shares")
    lines.append(f"- CPU isolation: {sc.get('cpu_shares_reason') or 'none (a run before CPU shares existed)'}")
    for p in pols:
        hc = P[p].get("host_cpu")
        if hc:
            lines.append(
                f"- {p}: CPU share / measured use per host during the replay (cores): "
                + ", ".join(f"{h} {v['share_cores']:.3f} / {_cores(v['used_cores'])}" for h, v in hc.items())
            )
            if P[p].get("daemons_exempted"):  # the servers' DHT processes and p2p daemons outside the shares
                lines.append(
                    f"- {p}: the servers' DHT processes and p2p daemons ran outside the shares, using (cores): "
                    + ", ".join(
                        f"{h} {_cores(v['daemons_cores'])}"
                        for h, v in hc.items()
                        if h != "client" and v.get("daemons_cores") is not None
                    )
                )
    for p in pols:
        peaks = P[p].get("peak_service")
        if peaks:
            lines.append(
                f"- {p}: each server's busiest {_f(next(iter(peaks.values()))['window_s'], 0)} s (busy "
                "fraction / CPU cores / sessions per batch): "
                + ", ".join(
                    f"{h} {v['busy']:.2f} / {v['cpu_cores']:.3f} / {v['sessions_per_batch']:.1f}"
                    for h, v in peaks.items()
                )
            )
    if shares is None and sc.get("slow_servers_emulated_slowdown"):
        lines.append(f"- slow servers: launch-server --emulate-slowdown {sc['slow_servers_emulated_slowdown']:.3f}")
    for p, why in summary.get("not_run", {}).items():
        lines.append(f"- {p}: not run: {why}")
    lines += [
        "",
        "The paper's Table 1 (LLaMA-2-7B on 9 MIG GPUs, 1,000 requests) for comparison: mean response "
        "PETALS 31.4, BPRR 19.8, JFFC-only 10.0, proposed 7.3 s (-76.8% vs PETALS).",
    ]
    return "\n".join(lines) + "\n"


def cdf_plot(records_by_policy: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for p in [q for q in POLICY_ORDER if q in records_by_policy] + [
        q for q in records_by_policy if q not in POLICY_ORDER
    ]:
        r = sorted(times(x)[0] for x in records_by_policy[p] if finished(x))
        if r:
            ax.step(r, np.arange(1, len(r) + 1) / len(r), where="post", label=f"{p} (n={len(r)})")
    ax.set_xlabel("response time (s)")
    ax.set_ylabel("CDF")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def complete_records(records: list[dict], requests, policy: str) -> list[dict]:
    """Every scheduled request gets a record: the load generator's, or one saying why there is none."""
    seen = {r["index"] for r in records}
    out = list(records)
    for r in requests:
        if r.index not in seen:
            out.append(
                {
                    "index": r.index,
                    "policy": policy,
                    "arrival_s": r.arrival_s,
                    "input_tokens": r.input_tokens,
                    "output_tokens": r.output_tokens,
                    "generated_tokens": 0,
                    "start_s": None,
                    "end_s": None,
                    "error": "NoRecordError: the load generator wrote no record (it crashed or was killed)",
                }
            )
    return sorted(out, key=lambda r: r["index"])


def rewrite_records(path: Path, requests, policy: str) -> list[dict]:
    records = complete_records(read_records(path) if path.exists() else [], requests, policy)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return records
