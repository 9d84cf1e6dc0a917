"""argparse value types shared by the orchestrator's commands (plan, simulate, orchestrator)."""

from __future__ import annotations

import argparse

# the positive-number types are the one set every command shares (light: no torch, no hivemind)
from petals_chain.cli.args import positive_float, positive_int

__all__ = ["parse_c", "positive_float", "positive_int"]


def parse_c(text: str) -> int | None:
    """`--c`: 'auto' (None: tune it) or a positive integer."""
    if text == "auto":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or auto: tuned)") from None
