"""`petals-chain simulate`: plan a cluster under a policy and simulate it; print JSON.

    petals-chain simulate --cluster cluster.json [--policy proposed] [--dispatch jffc] [--jobs N] [--seed S]
    petals-chain simulate --paper-setup J ETA [--setup paper|authors] [--authors-choices A,B]
                          [--tau-c model|literal] [--rtt-data PATH] ...

Bad input: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from orchestrator.cli_args import parse_c, positive_float, positive_int

PROG = "petals-chain simulate"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from orchestrator.dispatch import DISPATCHERS
    from orchestrator.planner import POLICIES
    from orchestrator.tuning import TUNINGS

    p = _Parser(prog=PROG, description="Discrete-event simulation of a cluster under a serving policy (prints JSON).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--cluster",
        metavar="PATH",
        help="cluster JSON (plan schema: blocks, block_size, cache_size, arrival_rate, rho_bar, servers[{name, "
        "memory, tau_c, tau_p}])",
    )
    src.add_argument(
        "--paper-setup",
        nargs=2,
        metavar=("J", "ETA"),
        help="draw the paper's section 4.1.1 cluster with J servers, a fraction ETA of them high-performance",
    )
    p.add_argument(
        "--rtt-data",
        metavar="PATH",
        default=None,
        help="RIPE Atlas RTT CSV or its folder (default: $PETALS_CHAIN_DATA, else ../shared/data)",
    )
    p.add_argument("--synthetic-rtt", action="store_true", help="paper setup on synthetic RTTs instead of RIPE Atlas")
    p.add_argument(
        "--setup",
        choices=("paper", "authors"),
        default="paper",
        help="with --paper-setup: the paper's setting, or every choice of the authors' simulator (docs/results.md)",
    )
    p.add_argument(
        "--authors-choices",
        default="",
        metavar="A,B",
        help="with --paper-setup: switch on only these authors' choices (orchestrator/sim/authors_setup.py)",
    )
    p.add_argument(
        "--tau-c",
        choices=("model", "literal"),
        default="model",
        help="with --paper-setup: tau_c = 20 x (RTT + 18 ms) (model, default) or RTT + 18 ms (literal)",
    )
    p.add_argument("--arrival-rate", type=positive_float, default=None, help="override the arrival rate (req/s)")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="proposed",
        help="proposed (GBP-CR + GCA + JFFC, default) or a baseline (petals, bprr, jffc-only)",
    )
    p.add_argument(
        "--c",
        type=parse_c,
        default=7,
        help="cache reservation for 'proposed': N (default 7, as the paper's figures) or 'auto'",
    )
    p.add_argument("--tuning", choices=TUNINGS, default="lower", help="objective for --c auto (default lower bound)")
    p.add_argument(
        "--dispatch",
        choices=sorted(DISPATCHERS),
        default="jffc",
        help="dispatch policy over the chains (proposed, jffc-only)",
    )
    p.add_argument(
        "--workload",
        choices=("poisson", "azure"),
        default="poisson",
        help="Poisson/Exp(1), or the Azure code trace rescaled to the arrival rate",
    )
    p.add_argument(
        "--trace-data", metavar="PATH", default=None, help="Azure trace CSV or its folder (default: the data path)"
    )
    p.add_argument("--jobs", type=positive_int, default=20000, help="number of jobs (Poisson workload)")
    p.add_argument(
        "--job-sizes",
        default="exp",
        metavar="SPEC",
        help="job size distribution, mean 1 (Poisson workload): exp (default), det, lognormal:CV, gamma:CV",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of arrivals, job sizes and RTTs (default 0)")
    return p


def _cluster_and_meta(args) -> tuple[object, dict]:
    from orchestrator.cluster_io import cluster_from_dict

    if args.cluster is not None:
        try:
            with open(args.cluster, encoding="utf-8") as fh:
                raw = json.load(fh)
        except OSError as e:
            raise _UsageError(f"cannot read {args.cluster}: {e.strerror}")
        except json.JSONDecodeError as e:
            raise _UsageError(f"{args.cluster} is not valid JSON: {e.msg} at line {e.lineno}")
        if args.arrival_rate is not None and isinstance(raw, dict):
            raw = dict(raw, arrival_rate=args.arrival_rate)
        return cluster_from_dict(raw), {"cluster": args.cluster}, None

    from netem.topology import (
        RIPE_ATLAS_FILENAME,
        DataNotFoundError,
        load_ripe_atlas_rtt_matrix,
        resolve_data_file,
        synthetic_rtt_ms,
    )
    from orchestrator.sim.authors_setup import AuthorsChoices, authors_rtt_ms_from_csv
    from orchestrator.sim.paper_setup import (
        DEFAULT_ARRIVAL_RATE_PER_S,
        draw_paper_instance,
        to_cluster,
    )

    try:
        authors = AuthorsChoices.all_on() if args.setup == "authors" else AuthorsChoices.parse(args.authors_choices)
    except ValueError as e:
        raise _UsageError(f"--authors-choices: {e}")

    try:
        n_servers = int(args.paper_setup[0])
        eta = float(args.paper_setup[1])
    except ValueError:
        raise _UsageError(
            f"--paper-setup takes J (integer) and ETA (number in [0, 1]), got {' '.join(args.paper_setup)}"
        )
    if n_servers < 1 or not 0.0 <= eta <= 1.0:
        raise _UsageError(f"--paper-setup needs J >= 1 and 0 <= ETA <= 1, got {n_servers} {eta}")
    rng = np.random.default_rng([args.seed, 1])
    if args.synthetic_rtt:
        rtt, source = synthetic_rtt_ms(max(n_servers + 1, 2), rng), "synthetic"
    else:
        try:
            path = resolve_data_file(RIPE_ATLAS_FILENAME, args.rtt_data)
        except DataNotFoundError as e:
            raise _UsageError(f"{e} (or pass --synthetic-rtt)")
        if authors.synthetic_rtt:
            rtt, source = authors_rtt_ms_from_csv(path), f"authors' RTT formula over {path}"
        else:
            rtt, source = load_ripe_atlas_rtt_matrix(path), str(path)
    inst = draw_paper_instance(
        rtt,
        n_servers,
        eta,
        rng,
        arrival_rate_per_s=args.arrival_rate or DEFAULT_ARRIVAL_RATE_PER_S,
        tau_c_reading=args.tau_c,
        authors=authors,
    )
    meta = {
        "paper_setup": {"J": n_servers, "eta": eta},
        "setup": args.setup,
        "tau_c_reading": args.tau_c,
        "authors_choices": list(authors.on()),
        "rtt_source": source,
    }
    return to_cluster(inst), meta, inst


def _workload(args, cluster, rng):
    from orchestrator.sim.policy_runs import poisson_workload

    if args.workload == "poisson":
        try:
            return poisson_workload(cluster.arrival_rate_per_s, args.jobs, rng, args.job_sizes)
        except ValueError as e:
            raise _UsageError(f"--job-sizes: {e}")
    from netem.topology import DataNotFoundError
    from orchestrator.sim.traces import load_azure_trace, trace_workload

    try:
        trace = load_azure_trace(args.trace_data)
    except DataNotFoundError as e:
        raise _UsageError(str(e))
    return trace_workload(trace, target_rate_per_s=cluster.arrival_rate_per_s)


def run(args) -> dict:
    from orchestrator.planner import plan
    from orchestrator.policies import get_policy
    from orchestrator.sim.authors_setup import AUTHORS_JOBS_PER_RUN
    from orchestrator.sim.paper_experiments import baseline_options
    from orchestrator.sim.policy_runs import DEFAULT_WARMUP_FRACTION, simulate_plan

    cluster, meta, inst = _cluster_and_meta(args)
    opts = baseline_options(inst.authors, inst.is_high) if inst is not None else None
    short = inst is not None and inst.authors.short_runs
    if short:  # the authors' 300 jobs from an empty system, all counted
        args.jobs = AUTHORS_JOBS_PER_RUN
    p = plan(cluster, policy=args.policy, c=args.c, tuning=args.tuning, baseline=opts)
    arrivals, sizes = _workload(args, cluster, np.random.default_rng([args.seed, 2]))
    t0 = time.perf_counter()
    res = simulate_plan(
        p,
        cluster,
        arrivals,
        sizes,
        dispatch=args.dispatch,
        rng=np.random.default_rng([args.seed, 3]),
        warmup_fraction=0.0 if short else DEFAULT_WARMUP_FRACTION,
    )
    wall = time.perf_counter() - t0

    def num(x):
        return x if math.isfinite(x) else None

    out = {
        **meta,
        "policy": args.policy,
        "dispatch": args.policy if get_policy(args.policy).per_request else args.dispatch,
        "c": p.c,
        "arrival_rate": cluster.arrival_rate_per_s,
        "workload": args.workload,
        "job_sizes": args.job_sizes if args.workload == "poisson" else "azure-tokens",
        "seed": args.seed,
        "num_chains": len(p.chains),
        "total_rate": p.total_rate_per_s,
        "stable": p.total_rate_per_s > cluster.arrival_rate_per_s,
        "bounds": {"lower": num(p.bounds.lower_s), "upper": num(p.bounds.upper_s)},
        **res.summary(),
        "sim_wall_s": round(wall, 3),
    }
    return out


def main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        out = run(args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except _UsageError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # InvalidClusterError, InfeasibleClusterError, bad dispatch input
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
