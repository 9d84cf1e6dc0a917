#!/usr/bin/env python
"""Reproduce the chain-serving paper's section 4.1 evaluation (Figs. 3-8) with the simulator.

    python scripts/reproduce_paper.py [--quick] [--runs N] [--workers N] [--only fig3,fig8,ablation]
                                      [--setup paper|authors] [--authors-choices tau_c,short_runs,...]
                                      [--tau-c model|literal] [--rtt-data PATH | --synthetic-rtt]
                                      [--out results/paper]

Writes PNG plots, summary.json (keys "setup", "tau_c_reading", "authors_choices", and "fig8":
[{"J", "eta", "policy", "mean_response_s"}, ...]) and summary.md under --out. Full mode: 20 Monte
Carlo runs per point; --quick: 3 runs, fewer jobs. --setup authors switches on every choice of the
paper authors' simulator (orchestrator/sim/authors_setup.py); --authors-choices switches on only
the named ones. "leftover" (not run by default) compares the proposed stack with and without blocks
for GBP-CR's idle servers on Fig. 8's instances. "ablation" (not run by default) reruns Fig. 8 at cfg.ablation_settings
with each
authors' choice on alone (on top of the paper setup) and off alone (from all on).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from netem.topology import (  # noqa: E402
    RIPE_ATLAS_FILENAME,
    DataNotFoundError,
    load_ripe_atlas_rtt_matrix,
    resolve_data_file,
    synthetic_rtt_ms,
)
from orchestrator.sim import paper_experiments as ex  # noqa: E402
from orchestrator.sim import paper_report as rep  # noqa: E402
from orchestrator.sim.authors_setup import AuthorsChoices, authors_rtt_ms_from_csv  # noqa: E402
from orchestrator.sim.paper_setup import TAU_C_READINGS  # noqa: E402

FIGURES = ("fig3", "fig4", "fig5", "fig67", "fig8", "fig8x", "ablation", "leftover")
DEFAULT_FIGURES = FIGURES[:-2]
SETUPS = ("paper", "authors")
_RTT_MS: dict = {}  # per worker process, set by _init_worker: {"ours": matrix, "authors": matrix}


def _load_rtt(rtt_path: str | None, synthetic_seed: int | None) -> dict:
    if synthetic_seed is not None:
        m = synthetic_rtt_ms(320, np.random.default_rng(synthetic_seed))
        return {"ours": m, "authors": m}  # the authors' formula needs the anchors' data
    return {"ours": load_ripe_atlas_rtt_matrix(rtt_path), "authors": authors_rtt_ms_from_csv(rtt_path)}


def _init_worker(rtt_path, synthetic_seed):
    global _RTT_MS
    _RTT_MS = _load_rtt(rtt_path, synthetic_seed)


def _task(fig: str, run: int, cfg: ex.PaperConfig, extra: tuple):
    t0 = time.perf_counter()
    fn = {
        "fig3": ex.fig3_run,
        "fig4": ex.fig4_run,
        "fig5": ex.fig5_run,
        "fig67": ex.fig67_run,
        "fig8": ex.fig8_run,
        "fig8x": ex.fig8_run,
        "ablation": ex.fig8_run,
        "leftover": ex.leftover_run,
    }[fig]
    variant = None
    if fig == "ablation":
        variant, extra = extra[0], extra[1:]
    rtt = _RTT_MS["authors" if cfg.authors.synthetic_rtt else "ours"]
    res = fn(rtt, run, cfg, *extra)
    if variant is not None:
        res["variant"] = variant
    return fig, res, time.perf_counter() - t0


def ablation_variants(base: ex.PaperConfig) -> list[tuple[str, ex.PaperConfig]]:
    """(name, config): the paper setup, each authors' choice on alone, all on, all on but one."""
    none, every = AuthorsChoices(), AuthorsChoices.all_on()
    out = [("paper setup", replace(base, authors=none))]
    out += [(f"+{n}", replace(base, authors=none.with_on(n))) for n in AuthorsChoices.names()]
    out += [("authors setup", replace(base, authors=every))]
    out += [(f"authors −{n}", replace(base, authors=replace(every, **{n: False}))) for n in AuthorsChoices.names()]
    return out


def _clean(x):
    """JSON has no Infinity/NaN: write them as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 runs per point and fewer jobs (a few minutes)")
    p.add_argument("--runs", type=int, default=None, help="Monte Carlo runs per point (default 20, quick 3)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--only", default=",".join(DEFAULT_FIGURES), help=f"comma-separated subset of {','.join(FIGURES)}")
    p.add_argument(
        "--setup",
        default="paper",
        choices=SETUPS,
        help="paper: the paper's §4.1.1 as we read it; authors: every choice of the authors' simulator",
    )
    p.add_argument(
        "--authors-choices",
        default="",
        help=f"comma-separated authors' choices to switch on (with --setup paper): {','.join(AuthorsChoices.names())}",
    )
    p.add_argument(
        "--tau-c",
        default="model",
        choices=TAU_C_READINGS,
        help="model: 20 x (RTT + 18 ms), the paper's definition of tau_c (default); literal: RTT + 18 ms",
    )
    p.add_argument(
        "--rtt-data",
        default=None,
        help="RIPE Atlas CSV or its folder (default: $PETALS_CHAIN_DATA, else ../shared/data)",
    )
    p.add_argument("--synthetic-rtt", action="store_true", help="use synthetic RTTs instead of RIPE Atlas")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--out", default=str(REPO_ROOT / "results" / "paper"))
    args = p.parse_args(argv)
    figs = [f.strip() for f in args.only.split(",") if f.strip()]
    bad = [f for f in figs if f not in FIGURES]
    if bad or args.workers < 1 or (args.runs is not None and args.runs < 1):
        print(f"reproduce_paper: bad --only {bad} / --workers / --runs", file=sys.stderr)
        return 2

    try:
        authors = AuthorsChoices.all_on() if args.setup == "authors" else AuthorsChoices.parse(args.authors_choices)
    except ValueError as e:
        print(f"reproduce_paper: --authors-choices: {e}", file=sys.stderr)
        return 2
    cfg = ex.PaperConfig.quick(args.seed) if args.quick else ex.PaperConfig(seed=args.seed)
    cfg = replace(cfg, tau_c_reading=args.tau_c, authors=authors)
    if args.runs is not None:
        cfg = replace(cfg, runs=args.runs)
    rtt_path, synthetic_seed, rtt_source = None, None, "synthetic"
    if args.synthetic_rtt:
        synthetic_seed = args.seed
    else:
        try:
            rtt_path = str(resolve_data_file(RIPE_ATLAS_FILENAME, args.rtt_data))
            rtt_source = f"RIPE Atlas EU ({rtt_path})"
        except DataNotFoundError as e:
            print(f"reproduce_paper: {e}; falling back to synthetic RTTs", file=sys.stderr)
            synthetic_seed = args.seed

    if authors.synthetic_rtt:
        rtt_source = (
            f"the authors' synthetic RTT formula over the RIPE Atlas EU anchors ({rtt_path})"
            if synthetic_seed is None
            else "synthetic (the authors' RTT formula needs the RIPE Atlas data)"
        )
    tasks = []
    for fig in figs:
        for run in range(cfg.runs):
            if fig in ("fig8", "leftover"):
                tasks += [(fig, run, cfg, (J, eta)) for J in cfg.fig8_servers for eta in cfg.fig8_etas]
            elif fig == "fig8x":
                tasks += [(fig, run, cfg, (*cfg.fig8x_setting, rate)) for rate in cfg.fig8x_rates_per_s]
            elif fig == "ablation":
                tasks += [
                    (fig, run, vcfg, (name, J, eta))
                    for name, vcfg in ablation_variants(cfg)
                    for J, eta in cfg.ablation_settings
                ]
            else:
                tasks.append((fig, run, cfg, ()))
    # Longest tasks first so the two workers finish together.
    weight = {"fig8x": 0, "ablation": 1, "leftover": 2, "fig5": 1, "fig8": 2, "fig67": 3, "fig4": 4, "fig3": 5}
    tasks.sort(key=lambda t: (weight[t[0]], -t[3][-2] if t[0] == "ablation" else (-t[3][0] if t[3] else 0)))

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, list] = {f: [] for f in figs}
    timings: dict[str, float] = {f: 0.0 for f in figs}
    t0 = time.perf_counter()
    if args.workers == 1:
        _init_worker(rtt_path, synthetic_seed)
        it = (_task(*t) for t in tasks)
        for fig, res, dt in tqdm(it, total=len(tasks), desc="simulating", unit="run"):
            results[fig].append(res)
            timings[fig] += dt
    else:
        with ProcessPoolExecutor(
            max_workers=args.workers, initializer=_init_worker, initargs=(rtt_path, synthetic_seed)
        ) as pool:
            futs = [pool.submit(_task, *t) for t in tasks]
            for fut in tqdm(as_completed(futs), total=len(futs), desc="simulating", unit="run"):
                fig, res, dt = fut.result()
                results[fig].append(res)
                timings[fig] += dt
    wall = time.perf_counter() - t0
    for fig in results:
        results[fig].sort(key=lambda r: (r.get("J", 0), r.get("eta", 0), r.get("rate", 0), r["run"]))

    summary: dict = {
        "setup": args.setup,
        "tau_c_reading": args.tau_c,
        "authors_choices": list(authors.on()),
        "mode": "quick" if args.quick else "full",
        "command": " ".join(
            ["python", "scripts/reproduce_paper.py", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
        ),
        "config": asdict(cfg),
        "rtt_source": rtt_source,
        "workers": args.workers,
        "wall_s": wall,
        "timings_s": {f"{k} (cpu)": v for k, v in timings.items()},
        "plots": [],
    }
    if "fig3" in results:
        summary["fig3"] = rep.aggregate_fig3(results["fig3"])
        summary["plots"].append(rep.plot_fig3(results["fig3"], summary["fig3"], out_dir).name)
    if "fig4" in results:
        summary["fig4"] = rep.aggregate_fig4(results["fig4"])
        summary["plots"].append(rep.plot_fig4(summary["fig4"], out_dir).name)
    if "fig5" in results:
        summary["fig5"] = rep.aggregate_fig5(results["fig5"])
        summary["plots"].append(rep.plot_fig5(summary["fig5"], out_dir).name)
    if "fig67" in results:
        summary["fig67"] = rep.aggregate_fig67(results["fig67"])
        p6 = rep.plot_fig6(summary["fig67"], cfg.arrival_rate_per_s, out_dir)
        if p6 is not None:
            summary["plots"].append(p6.name)
        summary["plots"].append(rep.plot_fig7(summary["fig67"], out_dir).name)
    if "fig8" in results:
        summary["fig8"], summary["fig8_details"] = rep.aggregate_fig8(results["fig8"])
        summary["plots"].append(rep.plot_fig8(summary["fig8"], out_dir).name)
    if "fig8x" in results:
        summary["fig8x"], summary["fig8x_details"] = rep.aggregate_fig8(results["fig8x"])
    if "leftover" in results:
        summary["leftover"] = rep.aggregate_leftover(results["leftover"])
    if "ablation" in results:
        summary["ablation"] = []
        for name, vcfg in ablation_variants(cfg):
            recs, details = rep.aggregate_fig8([r for r in results["ablation"] if r["variant"] == name])
            summary["ablation"].append(
                {"variant": name, "authors_choices": list(vcfg.authors.on()), "fig8": recs, "fig8_details": details}
            )
    (out_dir / "summary.md").write_text(rep.markdown_summary(summary))
    (out_dir / "summary.json").write_text(json.dumps(_clean(summary), indent=1))
    (out_dir / "runs.json").write_text(json.dumps(_clean(results)))
    print(f"wrote {out_dir}/summary.json, summary.md and {len(summary['plots'])} plots in {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
