"""The model check (the paper's Figs. 9-10): per-server times measured during the runs against the
orchestrator's model of footnote 11.

Per hop of every finished request the load generator recorded the client's time of each step and
the server's own time (queue + compute; `server_s` in the step reply), so
- compute, measured: the server's time of the prefill step, and summed over the decode steps;
  model: the orchestrator's at the end of the run: with a calibrated fit, t_o + m (t_B + t_I l_in)
  and (l_out - 1)(t_o + m (t_B + t_O)), t_o per step and server, t_B per block and step; without one, m (t_o + t_I
  l_in) and
  m t_O (l_out - 1) with the start-up t_I, t_O and the per-block t_o default; m = the hop's blocks;
- communication, measured: client time - server time (prefill step; decode steps summed);
  model: one and (l_out - 1) times RTT + the measured per-hop cost (tau_c = l_out (RTT + hop cost)),
  RTT as the orchestrator measured it, plus for the prefill step the measured transfer of l_in
  tokens' hidden states there and back (`transfer_s_per_token`).
`model_error` (summary.json): per server, measured / model - 1 of the means over lone requests.
`model_drift` (summary.json, `lone_step_drift`): the probe runs after the replay the model was fitted
on, so a change of the machine's speed between the two reads as model error. Each server's service
log says how much: the same lone decode step (one session, one token, the same blocks) timed by the
server itself in the replay and in the probe; `decode_compute_net_of_drift` divides the probe's wall
ratio out of that policy's decode-compute error. A diagnostic beside `model_error`, never instead of it.
"Lone" requests ran while no other request was in service: there the server time is compute
only; under load it includes waiting for the server's batch. Besides the replay's lone requests (under
the trace's bursts there may be none), the model probe (`probe_<policy>.jsonl`: after the replay, sessions
through each chain one after another) gives each chain's servers lone requests.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

QUANTITIES = ("prefill_compute", "decode_compute", "prefill_comm", "decode_comm")
T_O_S = 0.001  # t_o of footnote 11, the orchestrator's default --per-block-overhead-ms


def lone_indices(records: list[dict]) -> set[int]:
    ok = [r for r in records if r.get("start_s") is not None and r.get("end_s") is not None]
    out = set()
    for r in ok:
        if not any(o is not r and o["start_s"] < r["end_s"] and r["start_s"] < o["end_s"] for o in ok):
            out.add(r["index"])
    return out


def hop_points(records: list[dict], servers: dict[str, dict], *, probe: bool = False) -> list[dict]:
    """One point per (request, hop): measured and modelled times of the four quantities. `probe`: the
    records are the model probe's (run one after another after the replay): each ran alone."""
    lone = {r["index"] for r in records} if probe else lone_indices(records)
    pts = []
    for r in records:
        if r.get("error") is not None or not r.get("hops"):
            continue
        for h in r["hops"]:
            s = servers.get(h["name"])
            if s is None or h["prefill_server_s"] is None or h["decode_server_s"] is None or s.get("rtt_s") is None:
                continue
            m, l_in, n_dec = h["blocks"], h["prefill_tokens"], h["decode_steps"]
            hop = s.get("hop_cost_s") or 0.0
            transfer = (s.get("transfer_s_per_token") or 0.0) * l_in  # absent before the transfer term
            t_o = s.get("t_o")
            if t_o is None:  # the start-up model: footnote 11's t_o per block
                pre, dec = m * (T_O_S + s["t_I"] * l_in), m * s["t_O"] * n_dec
            else:  # calibrated: t_o per step and server
                t_B = s.get("t_B") or 0.0  # absent in runs before the per-block term
                pre, dec = t_o + m * (t_B + s["t_I"] * l_in), n_dec * (t_o + m * (t_B + s["t_O"]))
            pts.append(
                {
                    "policy": r["policy"],
                    "index": r["index"],
                    "server": h["name"],
                    "lone": r["index"] in lone,
                    "probe": probe,
                    "measured": {
                        "prefill_compute": h["prefill_server_s"],
                        "decode_compute": h["decode_server_s"],
                        "prefill_comm": h["prefill_client_s"] - h["prefill_server_s"],
                        "decode_comm": h["decode_client_s"] - h["decode_server_s"],
                    },
                    "model": {
                        "prefill_compute": pre,
                        "decode_compute": dec,
                        "prefill_comm": s["rtt_s"] + hop + transfer,
                        "decode_comm": (s["rtt_s"] + hop) * n_dec,
                    },
                }
            )
    return pts


def error_table(points: list[dict]) -> dict:
    """Per server and quantity: n, mean measured, mean model, relative error of the means, median of
    per-point relative errors; over all points and over lone requests only."""
    out: dict = {}
    for subset in ("all", "lone"):
        # "all": the replay's finished requests (the probe's ran after it, alone); "lone": alone in the system
        sel = [p for p in points if (p["lone"] if subset == "lone" else not p.get("probe"))]
        for server in sorted({p["server"] for p in sel}):
            ps = [p for p in sel if p["server"] == server]
            row = {}
            for q in QUANTITIES:
                meas = np.array([p["measured"][q] for p in ps])
                mod = np.array([p["model"][q] for p in ps])
                keep = mod > 0
                if not keep.any():
                    continue
                row[q] = {
                    "n": int(keep.sum()),
                    "measured_mean_s": float(meas[keep].mean()),
                    "model_mean_s": float(mod[keep].mean()),
                    "rel_error_of_means": float(meas[keep].mean() / mod[keep].mean() - 1),
                    "median_rel_error": float(np.median(meas[keep] / mod[keep] - 1)),
                }
            out.setdefault(subset, {})[server] = row
    return out


MODEL_ERROR_QUANTITIES = ("prefill_compute", "decode_compute", "decode_comm")


def model_error(table: dict) -> dict:
    """summary.json's `model_error`: per server, measured / model - 1 (of the means over requests alone
    in the system) of prefill compute, decode compute and decode communication."""
    return {
        server: {q: row[q]["rel_error_of_means"] for q in MODEL_ERROR_QUANTITIES if q in row}
        for server, row in table.get("lone", {}).items()
    }


def model_error_markdown(errors: dict, bound: float = 0.25) -> str:
    if not errors:
        return "Model error: no request ran alone in the system, so none is computed.\n"
    lines = [
        f"Model error (measured / model - 1, requests alone in the system; goal |decode_compute| <= {bound:.2f}):",
        "",
        "| server | " + " | ".join(MODEL_ERROR_QUANTITIES) + " |",
        "|---|" + "---|" * len(MODEL_ERROR_QUANTITIES),
    ]
    for server, row in errors.items():
        cells = [f"{row[q]:+.2f}" if q in row else "—" for q in MODEL_ERROR_QUANTITIES]
        if "decode_compute" in row and abs(row["decode_compute"]) > bound:
            cells[1] += " (over the bound)"
        lines.append(f"| {server} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def error_markdown(table: dict) -> str:
    lines = []
    for subset, title in (("lone", "requests alone in the system"), ("all", "all finished requests (under load)")):
        rows = table.get(subset, {})
        if not rows:
            lines.append(f"No {title}.\n")
            continue
        lines += [
            f"Relative error (measured / model - 1, of the means; median of per-request errors in brackets), {title}:",
            "",
            "| server | n | " + " | ".join(QUANTITIES) + " |",
            "|---|---|" + "---|" * len(QUANTITIES),
        ]
        for server, row in rows.items():
            n = max((v["n"] for v in row.values()), default=0)
            cells = [
                f"{100 * row[q]['rel_error_of_means']:+.0f}% ({100 * row[q]['median_rel_error']:+.0f}%)"
                if q in row
                else "—"
                for q in QUANTITIES
            ]
            lines.append(f"| {server} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def phase_clients(logs: dict[str, list[dict]], probed: bool) -> tuple[str | None, str | None]:
    """(replay client, probe client) of one policy's service logs (server name -> batches). Each phase
    of a run is its own load-generator process, so its own client id, in the order warm-up, replay,
    probe: the probe's client is the last to appear on any server (when the run probed), the replay's
    the one with the most batches of the rest."""
    first: dict[str, float] = {}
    count: dict[str, int] = {}
    for batches in logs.values():
        for b in batches:
            for client, _, _ in b["items"]:
                first[client] = min(first.get(client, math.inf), b["t_s"])
                count[client] = count.get(client, 0) + 1
    if not first:
        return None, None
    order = sorted(first, key=first.get)
    probe = order[-1] if probed and len(order) > 1 else None
    rest = [c for c in order if c != probe]
    return max(rest, key=lambda c: count[c]), probe


def _lone_decode(batches: list[dict], client: str) -> dict[int, list[tuple[float, float]]]:
    """(wall_s, cpu_s) of `client`'s lone decode batches (one item: one token, not a prefill), by blocks."""
    out: dict[int, list[tuple[float, float]]] = {}
    for b in batches:
        items = b["items"]
        if b.get("ok", True) and len(items) == 1 and items[0][0] == client and items[0][1] == 1 and not items[0][2]:
            out.setdefault(int(b["blocks"][0]), []).append((float(b["service_s"]), float(b["cpu_s"])))
    return out


MIN_DRIFT_BATCHES = 5


def lone_step_drift(logs: dict[str, list[dict]], probed: bool) -> dict[str, dict]:
    """Per server: the median lone decode step (wall and CPU ms) in the replay and in the probe, on the
    block count the probe ran most, and their ratios (probe / replay); servers with fewer than
    MIN_DRIFT_BATCHES such steps in either phase are left out."""
    replay, probe = phase_clients(logs, probed)
    if replay is None or probe is None:
        return {}
    out = {}
    for server, batches in sorted(logs.items()):
        a, b = _lone_decode(batches, replay), _lone_decode(batches, probe)
        both = [k for k in b if len(b[k]) >= MIN_DRIFT_BATCHES and len(a.get(k, ())) >= MIN_DRIFT_BATCHES]
        if not both:
            continue
        blocks = max(both, key=lambda k: len(b[k]))
        ra, rb = np.asarray(a[blocks]), np.asarray(b[blocks])
        wa, wb = np.median(ra, axis=0), np.median(rb, axis=0)
        out[server] = {
            "blocks": blocks,
            "replay_n": len(ra),
            "probe_n": len(rb),
            "replay_wall_ms": 1e3 * wa[0],
            "probe_wall_ms": 1e3 * wb[0],
            "replay_cpu_ms": 1e3 * wa[1],
            "probe_cpu_ms": 1e3 * wb[1],
            "wall_ratio": wb[0] / wa[0],
            "cpu_ratio": wb[1] / wa[1],
        }
    return out


def model_drift(points: list[dict], logs_by_policy: dict[str, dict[str, list[dict]]]) -> dict:
    """summary.json's `model_drift`: per policy and server, `lone_step_drift` and that policy's own
    decode-compute error over its lone requests, raw and with the probe's wall ratio divided out."""
    out = {}
    for policy, logs in logs_by_policy.items():
        mine = [p for p in points if p["policy"] == policy or p["policy"] == f"{policy}-probe"]
        drift = lone_step_drift(logs, probed=any(p.get("probe") for p in mine))
        errors = model_error(error_table(mine))
        for server, d in drift.items():
            e = errors.get(server, {}).get("decode_compute")
            d["decode_compute_error"] = e
            d["decode_compute_net_of_drift"] = None if e is None else (1 + e) / d["wall_ratio"] - 1
        if drift:
            out[policy] = drift
    return out


def model_drift_markdown(drift: dict) -> str:
    if not drift:
        return ""
    lines = [
        "The machine between the replay and the probe (`model_drift`): each server's median lone decode step "
        "(one session, one token) in the replay the model was fitted on and in the probe, timed by the server; "
        "the decode-compute error of that policy's lone requests, raw and with the wall ratio divided out:",
        "",
        "| policy | server | blocks | replay wall / CPU (ms) | probe wall / CPU (ms) | probe / replay wall, CPU "
        "| decode_compute | net of drift |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, rows in drift.items():
        for server, d in rows.items():
            e, n = d["decode_compute_error"], d["decode_compute_net_of_drift"]
            lines.append(
                f"| {policy} | {server} | {d['blocks']} | {d['replay_wall_ms']:.0f} / {d['replay_cpu_ms']:.1f} "
                f"({d['replay_n']}) | {d['probe_wall_ms']:.0f} / {d['probe_cpu_ms']:.1f} ({d['probe_n']}) | "
                f"{d['wall_ratio']:.2f}, {d['cpu_ratio']:.2f} | {'—' if e is None else f'{e:+.2f}'} | "
                f"{'—' if n is None else f'{n:+.2f}'} |"
            )
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 8))
    for ax, q in zip(axes.flat, QUANTITIES):
        for kind, color in (("fast", "tab:blue"), ("slow", "tab:orange")):
            for lone, marker in ((False, "."), (True, "x")):
                ps = [p for p in points if p["server"].startswith(kind) and p["lone"] == lone]
                if ps:
                    ax.scatter(
                        [p["model"][q] for p in ps],
                        [p["measured"][q] for p in ps],
                        s=10,
                        marker=marker,
                        color=color,
                        alpha=0.6,
                        label=f"{kind}{' (alone)' if lone else ''}",
                    )
        lim = max([p["model"][q] for p in points] + [p["measured"][q] for p in points] + [1e-3])
        ax.plot([0, lim], [0, lim], "k--", lw=1, label="model = measured")
        ax.set_title(q.replace("_", " "), fontsize=10)
        ax.set_xlabel("model (s)")
        ax.set_ylabel("measured (s)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
