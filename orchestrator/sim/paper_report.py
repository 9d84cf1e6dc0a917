"""Aggregate the Monte Carlo runs of orchestrator.sim.paper_experiments into summary data, PNG
plots (matplotlib, Agg) and a Markdown summary. Pure aggregation: no simulation here."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from orchestrator.sim.paper_experiments import DISPATCH_POLICIES, FIG8_POLICIES


def _mean(values) -> float | None:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else None


def _all_finite_mean(values) -> float | None:
    """Mean over runs, None unless every run has a finite value (an unstable run is infinite)."""
    if not values or any(x is None or not math.isfinite(x) for x in values):
        return None
    return float(np.mean(values))


# ---------------------------------------------------------------- aggregation


def aggregate_fig3(runs: list[dict]) -> list[dict]:
    keys = sorted({(p["J"], p["eta"], p["rate"]) for r in runs for p in r["points"]})
    out = []
    for J, eta, rate in keys:
        pts = [p for r in runs for p in r["points"] if p["J"] == J and p["eta"] == eta and p["rate"] == rate]
        gbp = [p["gbp_cr"] for p in pts]
        rand = [v for p in pts for v in p["random"]]
        both = [p for p in pts if p["gbp_cr"] is not None and p["random"]]
        out.append(
            {
                "J": J,
                "eta": eta,
                "rate": rate,
                "runs": len(pts),
                "gbp_cr_mean": _mean(gbp),
                "random_mean": _mean(rand),
                "random_best_mean": _mean([min(p["random"]) for p in pts if p["random"]]),
                "gbp_cr_at_least_as_good_as_best_random": sum(p["gbp_cr"] <= min(p["random"]) for p in both),
                "gbp_cr_strictly_better_than_median_random": sum(
                    p["gbp_cr"] < float(np.median(p["random"])) for p in both
                ),
                "comparable_runs": len(both),
                "random_feasible_per_run": _mean([len(p["random"]) for p in pts]),
            }
        )
    return out


def aggregate_fig4(runs: list[dict]) -> list[dict]:
    loads = [p["load"] for p in runs[0]["points"]]
    out = []
    for i, load in enumerate(loads):
        pts = [r["points"][i] for r in runs]
        row = {"load": load, "rate_mean": _mean([p["rate"] for p in pts])}
        for key in ("gca", "cK", "lower_bound", "ilp"):
            vals = [p[key] for p in pts]
            row[key] = _mean(vals)
            row[f"{key}_runs"] = sum(v is not None for v in vals)
        row["gca_equals_ilp_runs"] = sum(p["gca"] is not None and p["gca"] == p["ilp"] for p in pts)
        out.append(row)
    return out


def aggregate_fig5(runs: list[dict]) -> list[dict]:
    loads = [p["load"] for p in runs[0]["points"]]
    out = []
    for i, load in enumerate(loads):
        pts = [r["points"][i] for r in runs]
        row = {"load": load}
        for key in (*DISPATCH_POLICIES, "lower", "upper", "jffc_service_share"):
            row[key] = _mean([p[key] for p in pts])
        row["jffc_within_bounds_runs"] = sum(
            p["lower"] is not None and p["upper"] is not None and p["lower"] * 0.97 <= p["jffc"] <= p["upper"] * 1.03
            for p in pts
        )
        row["runs"] = len(pts)
        out.append(row)
    return out


def aggregate_fig67(runs: list[dict]) -> list[dict]:
    """Per arrival rate: mean curves over runs (per c), argmins, and the per-run regret of each
    predictor's c* measured by simulation."""
    out = []
    for ri, rate in enumerate(r["rate"] for r in runs[0]["rates"]):
        tables = [{row["c"]: row for row in r["rates"][ri]["rows"]} for r in runs]
        cs = sorted(set().union(*[t.keys() for t in tables]))
        curves: dict[str, list] = {"c": cs}
        for key in ("surrogate_s", "lower_s", "upper_s", "sim_s"):
            curves[key] = [_all_finite_mean([t[c][key] if c in t else None for t in tables]) for c in cs]
        argmin = {}
        for key in ("surrogate_s", "lower_s", "upper_s", "sim_s"):
            finite = [(v, c) for c, v in zip(cs, curves[key]) if v is not None]
            argmin[key] = min(finite)[1] if finite else None
        regrets: dict[str, list] = {k: [] for k in ("surrogate_s", "lower_s", "upper_s")}
        for t in tables:
            sims = [(row["sim_s"], c) for c, row in t.items() if row["sim_s"] is not None]
            if not sims:
                continue
            best = min(sims)[0]
            for key in regrets:
                finite = [(row[key], c) for c, row in t.items() if row[key] is not None]
                if not finite:
                    continue
                c_pick = min(finite)[1]
                s = t[c_pick]["sim_s"]
                regrets[key].append((s / best - 1.0) if s is not None else math.inf)
        out.append(
            {
                "rate": rate,
                "curves": curves,
                "c_star": {k.removesuffix("_s"): v for k, v in argmin.items()},
                "sim_at_c_star": {
                    k.removesuffix("_s"): (curves["sim_s"][cs.index(v)] if v is not None else None)
                    for k, v in argmin.items()
                },
                "mean_regret_vs_best_sim": {
                    k.removesuffix("_s"): (
                        _mean(v) if v and all(math.isfinite(x) for x in v) else (None if not v else math.inf)
                    )
                    for k, v in regrets.items()
                },
                "runs_unstable_pick": {
                    k.removesuffix("_s"): sum(1 for x in v if not math.isfinite(x)) for k, v in regrets.items()
                },
            }
        )
    return out


def aggregate_fig8(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    keys = sorted({(r["J"], r["eta"], r["rate"]) for r in runs})
    records, details = [], []
    for J, eta, rate in keys:
        rs = [r for r in runs if r["J"] == J and r["eta"] == eta and r["rate"] == rate]
        detail = {"J": J, "eta": eta, "rate": rate, "runs": len(rs)}
        for pol in (*FIG8_POLICIES, "proposed-c*"):
            ok = [r[pol] for r in rs if r[pol]["feasible"]]
            m = _mean([x["mean_response_s"] for x in ok])
            detail[pol] = {
                "mean_response_s": m,
                "feasible_runs": len(ok),
                "mean_wait_s": _mean([x["mean_wait_s"] for x in ok]),
                "mean_service_s": _mean([x["mean_service_s"] for x in ok]),
            }
            if pol in FIG8_POLICIES:
                records.append(
                    {
                        "J": J,
                        "eta": eta,
                        "policy": pol,
                        "mean_response_s": m,
                        "feasible_runs": len(ok),
                        "runs": len(rs),
                        "arrival_rate": rate,
                    }
                )
        p = detail["proposed"]["mean_response_s"]
        for base in ("petals", "bprr"):
            b = detail[base]["mean_response_s"]
            detail[f"reduction_vs_{base}"] = (1 - p / b) if p is not None and b else None
        details.append(detail)
    return records, details


def aggregate_leftover(runs: list[dict]) -> list[dict]:
    """Per (J, eta): mean response / rate / idle servers of each variant, and in how many runs the
    leftover placement changed the response time by more than 0.5 % either way."""
    from orchestrator.sim.paper_experiments import LEFTOVER_VARIANTS

    out = []
    for J, eta in sorted({(r["J"], r["eta"]) for r in runs}):
        rs = [r for r in runs if r["J"] == J and r["eta"] == eta]
        row: dict = {"J": J, "eta": eta, "runs": len(rs)}
        for name, _, _ in LEFTOVER_VARIANTS:
            ok = [r[name] for r in rs if r[name]["feasible"]]
            row[name] = {k: _mean([x[k] for x in ok]) for k in ("mean_response_s", "total_rate", "idle", "placed")}
        for base in ("c=7", "c*"):
            pairs = [
                (r[base]["mean_response_s"], r[f"{base} + leftover"]["mean_response_s"])
                for r in rs
                if r[base]["feasible"] and r[f"{base} + leftover"]["feasible"]
            ]
            row[f"{base}: runs better"] = sum(b < a * 0.995 for a, b in pairs)
            row[f"{base}: runs worse"] = sum(b > a * 1.005 for a, b in pairs)
        out.append(row)
    return out


# ---------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_fig3(runs: list[dict], agg: list[dict], out_dir: Path) -> Path:
    plt = _plt()
    panels = sorted({(a["J"], a["eta"]) for a in agg})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (J, eta) in zip(axes[0], panels):
        rates = sorted({a["rate"] for a in agg if a["J"] == J and a["eta"] == eta and a["comparable_runs"]})
        sel = lambda p, rate: p["J"] == J and p["eta"] == eta and p["rate"] == rate  # noqa: E731
        data = [[v for r in runs for p in r["points"] if sel(p, rate) for v in p["random"]] for rate in rates]
        ax.boxplot(data, positions=range(len(rates)), widths=0.5)
        gbp = [
            [p["gbp_cr"] for r in runs for p in r["points"] if sel(p, rate) and p["gbp_cr"] is not None]
            for rate in rates
        ]
        for i, g in enumerate(gbp):
            ax.scatter([i] * len(g), g, marker="*", color="red", s=60, zorder=3, label="GBP-CR" if i == 0 else None)
        ax.set_xticks(range(len(rates)), [f"λ={r:g}" for r in rates])
        ax.set_ylabel("c·K(c) (objective 10a scaled by c)")
        ax.set_title(f"Fig. 3: J={J}, η={eta:g}, c=7")
        from matplotlib.lines import Line2D

        ax.legend(
            [Line2D([], [], color="black"), Line2D([], [], marker="*", color="red", ls="")],
            ["100 random placements/run (box)", "GBP-CR (one star per run)"],
            loc="upper left",
        )
    fig.tight_layout()
    path = out_dir / "fig3_gbp_cr.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_fig4(agg: list[dict], out_dir: Path) -> Path:
    series = [
        ([a[key] for a in agg], label, style)
        for key, label, style in (
            ("cK", "c·K(c) (GBP-CR only)", "s-"),
            ("gca", "GCA", "o-"),
            ("ilp", "Optimal ILP", "x--"),
            ("lower_bound", "Lower bound ⌈λ/(ρ̄μ1)⌉", "v:"),
        )
    ]
    return _save_line_plot(
        [100 * a["load"] for a in agg],
        series,
        "λ (% of the total service rate of GCA's chains)",
        "# job servers for rate λ/ρ̄",
        "Fig. 4: GCA under a fixed GBP-CR placement (c=7)",
        out_dir / "fig4_gca.png",
    )


def plot_fig5(agg: list[dict], out_dir: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = [a["load"] for a in agg]
    for pol in DISPATCH_POLICIES:
        axes[0].plot(x, [a[pol] for a in agg], "o-" if pol == "jffc" else ".--", label=pol.upper())
    axes[0].set_title("Fig. 5(a): dispatch policies (GBP-CR c=7 + GCA)")
    axes[1].plot(x, [a["jffc"] for a in agg], "o-", label="JFFC (simulated)")
    axes[1].plot(x, [a["lower"] for a in agg], "v:", label="Thm 3.7 lower bound")
    axes[1].plot(x, [a["upper"] for a in agg], "^:", label="Thm 3.7 upper bound")
    axes[1].set_title("Fig. 5(b): JFFC vs Theorem 3.7 bounds")
    for ax in axes:
        ax.set_xlabel("load λ/ν")
        ax.set_ylabel("mean response time (s)")
        ax.legend()
    fig.tight_layout()
    path = out_dir / "fig5_jffc.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_fig6(agg67: list[dict], rate: float, out_dir: Path) -> Path | None:
    plt = _plt()
    match = [a for a in agg67 if abs(a["rate"] - rate) < 1e-12]
    if not match:
        return None
    a = match[0]
    cs = np.array(a["curves"]["c"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"surrogate_s": "c·K(c)/λ", "upper_s": "Thm 3.7 upper", "lower_s": "Thm 3.7 lower", "sim_s": "simulation"}
    for ax, zoom in zip(axes, (False, True)):
        for key, label in labels.items():
            y = np.array([v if v is not None else np.nan for v in a["curves"][key]], dtype=float)
            sel = cs <= 30 if zoom else np.ones_like(cs, dtype=bool)
            (line,) = ax.plot(cs[sel], y[sel], label=label)
            c_star = a["c_star"][key.removesuffix("_s")]
            if c_star is not None and (not zoom or c_star <= 30):
                ax.plot([c_star], [y[list(cs).index(c_star)]], "*", color=line.get_color(), ms=14)
        ax.set_xlabel("cache reservation c")
        ax.set_ylabel("mean response time (s)")
        ax.set_yscale("log")
        ax.set_title(f"Fig. 6{'(b) zoomed' if zoom else '(a) overall'}: λ={rate:g}")
        ax.legend()
    fig.tight_layout()
    path = out_dir / "fig6_tuning_c.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_fig7(agg67: list[dict], out_dir: Path) -> Path:
    series = [
        ([a["c_star"][key] for a in agg67], label, style)
        for key, label, style in (
            ("surrogate", "c·K(c)/λ", "s-"),
            ("upper", "Thm 3.7 upper", "^-"),
            ("lower", "Thm 3.7 lower", "v-"),
            ("sim", "simulation", "o--"),
        )
    ]
    return _save_line_plot(
        [a["rate"] for a in agg67],
        series,
        "arrival rate λ (req/s)",
        "c*",
        "Fig. 7: c* vs λ",
        out_dir / "fig7_c_star.png",
    )


def _save_line_plot(
    x: list[float], series: list[tuple[list, str, str]], xlabel: str, ylabel: str, title: str, path: Path
) -> Path:
    """One axes of lines (values None are gaps), labelled and saved as PNG."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for values, label, style in series:
        ax.plot(x, [v if v is not None else np.nan for v in values], style, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_fig8(records: list[dict], out_dir: Path) -> Path:
    plt = _plt()
    Js = sorted({r["J"] for r in records})
    fig, axes = plt.subplots(1, len(Js), figsize=(4 * len(Js), 4), squeeze=False)
    for ax, J in zip(axes[0], Js):
        etas = sorted({r["eta"] for r in records if r["J"] == J})
        width = 0.25
        for pi, pol in enumerate(FIG8_POLICIES):
            y = []
            for eta in etas:
                m = [r["mean_response_s"] for r in records if r["J"] == J and r["eta"] == eta and r["policy"] == pol]
                y.append(m[0] if m and m[0] is not None else np.nan)
            ax.bar(np.arange(len(etas)) + (pi - 1) * width, y, width, label=pol)
        ax.set_xticks(range(len(etas)), [f"η={e:g}" for e in etas])
        ax.set_title(f"Fig. 8: J={J}")
        ax.set_ylabel("mean response time (s)")
        ax.legend()
    fig.tight_layout()
    path = out_dir / "fig8_overall.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- markdown


def _f(x, digits=2) -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and math.isinf(x):
        return "∞"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown_summary(summary: dict) -> str:
    lines = [
        f"# Paper reproduction (section 4.1), {summary['mode']} mode, setup: {summary.get('setup', 'paper')}",
        "",
        f"tau_c reading: {summary.get('tau_c_reading', 'model')}; authors' choices on: "
        f"{', '.join(summary.get('authors_choices', [])) or 'none'}",
        "",
        f"Command: `{summary['command']}`  ",
        f"Runs per point: {summary['config']['runs']}, seed {summary['config']['seed']}, "
        f"RTTs: {summary['rtt_source']}, wall time {summary['wall_s']:.0f} s on {summary['workers']} worker(s).",
        "",
    ]
    lines += [
        "## Fig. 3: GBP-CR vs random feasible placements (c=7)",
        "",
        "| J | η | λ | GBP-CR c·K | random mean | best random (mean) | runs GBP-CR ≤ best random |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in summary.get("fig3", []):
        if not a["comparable_runs"]:
            continue
        lines.append(
            f"| {a['J']} | {a['eta']:g} | {a['rate']:g} | {_f(a['gbp_cr_mean'])} | {_f(a['random_mean'])} | "
            f"{_f(a['random_best_mean'])} | "
            f"{a['gbp_cr_at_least_as_good_as_best_random']}/{a['comparable_runs']} |"
        )
    lines += [
        "",
        "## Fig. 4: job servers needed for λ/ρ̄ (fixed GBP-CR placement, c=7)",
        "",
        "| load | c·K(c) | GCA | ILP | lower bound | runs GCA = ILP |",
        "|---|---|---|---|---|---|",
    ]
    for a in summary.get("fig4", []):
        lines.append(
            f"| {100 * a['load']:.0f}% | {_f(a['cK'])} | {_f(a['gca'])} | {_f(a['ilp'])} | {_f(a['lower_bound'])} | "
            f"{a['gca_equals_ilp_runs']}/{a['gca_runs']} |"
        )
    lines += [
        "",
        "## Fig. 5: mean response time (s) by dispatch policy; Theorem 3.7 bounds",
        "",
        "| load | JFFC | JSQ | JIQ | SED | SA-JSQ | lower | upper | JFFC service share | runs JFFC in bounds (±3%) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in summary.get("fig5", []):
        lines.append(
            f"| {a['load']:g} | {_f(a['jffc'])} | {_f(a['jsq'])} | {_f(a['jiq'])} | {_f(a['sed'])} | "
            f"{_f(a['sa-jsq'])} | "
            f"{_f(a['lower'])} | {_f(a['upper'])} | {_f(a['jffc_service_share'])} | "
            f"{a['jffc_within_bounds_runs']}/{a['runs']} |"
        )
    lines += [
        "",
        "## Figs. 6-7: c* by predictor and by simulation",
        "",
        "| λ | c* surrogate | c* upper | c* lower | c* simulation | sim at lower's c* | best sim | regret lower "
        "| regret upper | regret surrogate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in summary.get("fig67", []):
        cs, r = a["c_star"], a["mean_regret_vs_best_sim"]
        lines.append(
            f"| {a['rate']:g} | {_f(cs['surrogate'])} | {_f(cs['upper'])} | {_f(cs['lower'])} | {_f(cs['sim'])} | "
            f"{_f(a['sim_at_c_star']['lower'])} | {_f(a['sim_at_c_star']['sim'])} | "
            f"{_pct(r['lower'])} | {_pct(r['upper'])} | {_pct(r['surrogate'])} |"
        )
    lines += [
        "",
        "(regret: mean over runs of sim(c picked by the predictor on that run's instance) / min_c sim − 1)",
        "",
        "## Fig. 8: mean response time (s), proposed (GBP-CR c=7 + GCA + JFFC) vs PETALS vs BPRR",
        "",
        "| J | η | proposed | PETALS | BPRR | reduction vs PETALS | reduction vs BPRR | proposed with tuned c* |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in summary.get("fig8_details", []):
        lines.append(
            f"| {d['J']} | {d['eta']:g} | {_f(d['proposed']['mean_response_s'])} | "
            f"{_f(d['petals']['mean_response_s'])} | "
            f"{_f(d['bprr']['mean_response_s'])} | {_pct(d['reduction_vs_petals'])} | {_pct(d['reduction_vs_bprr'])} | "
            f"{_f(d['proposed-c*']['mean_response_s'])} |"
        )
    infeasible = [
        (d["J"], d["eta"], pol, d[pol]["feasible_runs"], d["runs"])
        for d in summary.get("fig8_details", [])
        for pol in (*FIG8_POLICIES, "proposed-c*")
        if d[pol]["feasible_runs"] < d["runs"]
    ]
    if infeasible:
        lines += [
            "",
            "Infeasible runs (policy could not place all blocks / form a chain): "
            + ", ".join(f"J={J} η={e:g} {p}: {ok}/{n} feasible" for J, e, p, ok, n in infeasible),
        ]
    if summary.get("fig8x_details"):
        lines += [
            "",
            "## Fig. 8 beyond the paper: higher arrival rates (J=20, η=0.2)",
            "",
            "| λ | proposed | PETALS | BPRR | reduction vs PETALS | reduction vs BPRR | proposed with tuned c* |",
            "|---|---|---|---|---|---|---|",
        ]
        for d in summary["fig8x_details"]:
            lines.append(
                f"| {d['rate']:g} | {_f(d['proposed']['mean_response_s'])} | {_f(d['petals']['mean_response_s'])} | "
                f"{_f(d['bprr']['mean_response_s'])} | {_pct(d['reduction_vs_petals'])} | "
                f"{_pct(d['reduction_vs_bprr'])} | "
                f"{_f(d['proposed-c*']['mean_response_s'])} |"
            )
    if summary.get("ablation"):
        lines += [
            "",
            "## Fig. 8 ablation: the authors' choices switched on one at a time (and off one at a time from all on)",
            "",
            "| variant | J | η | proposed | PETALS | BPRR | reduction vs PETALS | reduction vs BPRR |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in summary["ablation"]:
            for d in v["fig8_details"]:
                lines.append(
                    f"| {v['variant']} | {d['J']} | {d['eta']:g} | {_f(d['proposed']['mean_response_s'])} | "
                    f"{_f(d['petals']['mean_response_s'])} | {_f(d['bprr']['mean_response_s'])} | "
                    f"{_pct(d['reduction_vs_petals'])} | {_pct(d['reduction_vs_bprr'])} |"
                )
    if summary.get("leftover"):
        lines += [
            "",
            "## Beyond the paper: blocks for the servers GBP-CR leaves idle (Fig. 8 instances)",
            "",
            "| J | η | c=7 | c=7 + leftover | idle → placed | better/worse runs | c* | c* + leftover | idle → "
            "placed | better/worse runs |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for a in summary["leftover"]:
            cells = []
            for base in ("c=7", "c*"):
                x, y = a[base], a[f"{base} + leftover"]
                cells.append(
                    f"{_f(x['mean_response_s'])} | {_f(y['mean_response_s'])} | {_f(x['idle'], 1)} → "
                    f"{_f(y['placed'], 1)} | "
                    f"{a[f'{base}: runs better']}/{a[f'{base}: runs worse']}"
                )
            lines.append(f"| {a['J']} | {a['eta']:g} | " + " | ".join(cells) + " |")
    lines += ["", "Timings per figure (s): " + ", ".join(f"{k}: {v:.1f}" for k, v in summary["timings_s"].items()), ""]
    return "\n".join(lines)


def _pct(x) -> str:
    if x is None:
        return "—"
    if math.isinf(x):
        return "unstable"
    return f"{100 * x:.1f}%"
