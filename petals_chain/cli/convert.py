"""`petals-chain convert`: convert the embedded model into the cache ahead of time."""

from __future__ import annotations

import time

from petals_chain.cli.args import CliParser


def main(argv: list[str]) -> int:
    parser = CliParser(prog="petals-chain convert", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="model name or local checkpoint folder")
    args = parser.parse_args(argv)
    from petals_chain.models.checkpoint import (
        resolve_model_path,  # torch: after the arguments are checked
    )

    start_s = time.perf_counter()
    path = resolve_model_path(args.model)
    print(f"{args.model}: {path} ({time.perf_counter() - start_s:.1f} s)")
    return 0
