"""`launch-server --memory-budget auto`: the device's free memory minus the margin, or a clear error."""

from __future__ import annotations

import pytest
import torch

from petals_chain.errors import InvalidRequestError
from server.memory_budget import (
    AUTO_MARGIN_MIN_BYTES,
    auto_memory_budget,
    free_and_total_bytes,
)


def test_auto_budget_on_cpu_is_available_memory_minus_the_margin():
    free, total = free_and_total_bytes("cpu")
    budget = auto_memory_budget("cpu")
    assert 0 < budget <= free - AUTO_MARGIN_MIN_BYTES
    assert budget >= free - max(AUTO_MARGIN_MIN_BYTES, total // 10) - 64 * 2**20  # MemAvailable moves a little


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_auto_budget_on_cuda_without_cuda_says_how_to_fix():
    with pytest.raises(InvalidRequestError, match="CUDA build of torch"):
        auto_memory_budget("cuda")


def test_launch_server_parses_auto():
    from server.cli import build_parser

    peer = (
        "/ip4/127.0.0.1/tcp/1/p2p/QmW91aaAN3fKnU9CDMMrWLyRmaiaBFqwKKgqDTm6LaWpUc"  # well-formed (the parser checks it)
    )
    args = build_parser().parse_args(["--initial-peers", peer, "--memory-budget", "auto"])
    assert args.memory_budget == "auto"
    assert build_parser().parse_args(["--initial-peers", peer, "--memory-budget", "3GiB"]).memory_budget == 3 * 2**30
