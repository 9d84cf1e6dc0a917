"""`petals-chain plan`: read a cluster JSON, print the plan as JSON (docs/orchestrator.md)."""

from __future__ import annotations

import json
import sys

from orchestrator.cli_args import parse_c
from orchestrator.cluster_io import cluster_from_dict, plan_to_dict
from orchestrator.planner import POLICIES, plan
from orchestrator.tuning import TUNINGS
from petals_chain.cli.args import CliParser


def main(argv: list[str]) -> int:
    parser = CliParser(
        prog="petals-chain plan", description="Plan block placement and server chains for a cluster (GBP-CR + GCA)."
    )
    parser.add_argument("--cluster", required=True, help="cluster JSON file (schema: docs/orchestrator.md)")
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="proposed",
        help="proposed (GBP-CR + GCA, default) or a baseline (docs/orchestrator.md)",
    )
    parser.add_argument(
        "--c",
        type=parse_c,
        default=None,
        help="cache reservation c of GBP-CR: 'auto' (tuned, default) or N; policy proposed only",
    )
    parser.add_argument(
        "--tuning",
        choices=TUNINGS,
        default="lower",
        help="objective for tuning c (default: lower); policy proposed only",
    )
    parser.add_argument(
        "--leftover-placement",
        action="store_true",
        help="also place blocks on the servers GBP-CR leaves idle, as `petals-chain orchestrator "
        "--leftover-placement` does, c auto's ties going to the widest of those plans (policy proposed only)",
    )
    parser.add_argument("--table", action="store_true", help="include the per-c tuning table")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its message
        return int(e.code or 0)
    try:
        with open(args.cluster, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        print(f"petals-chain plan: cannot read {args.cluster}: {e.strerror}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as e:
        print(f"petals-chain plan: {args.cluster} is not valid JSON: {e.msg} at line {e.lineno}", file=sys.stderr)
        return 2
    try:
        cluster = cluster_from_dict(raw)
        result = plan(cluster, policy=args.policy, c=args.c, tuning=args.tuning, leftover=args.leftover_placement)
    except ValueError as e:  # InvalidClusterError, InfeasibleClusterError
        print(f"petals-chain plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan_to_dict(result, cluster, include_table=args.table), indent=2))
    return 0
