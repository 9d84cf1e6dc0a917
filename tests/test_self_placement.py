"""`launch-server --num-blocks N` without an orchestrator: servers choose their spans from the DHT
records (the swarm's weakest blocks first), re-choose when a server leaves, and clients route as
usual; greedy text equals transformers'."""

from __future__ import annotations

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.swarm.local import LocalSwarm
from tests.swarm_helpers import wait_for

pytestmark = pytest.mark.integration

SERVER_ARGS = ["--num-threads", "1", "--rebalance-period", "1"]


def serving_span(sp) -> tuple[int, int]:
    """The latest span a server said it serves (its first line, then one per move)."""
    line = [line for line in sp.lines if line.startswith("serving ")][-1]
    start, end = line.split("blocks [", 1)[1].split(")", 1)[0].split(", ")
    return int(start), int(end)


def test_servers_place_themselves_and_fill_a_gap_left_by_a_dead_one(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    ref = hf.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with LocalSwarm(str(tiny_llama_path), [], server_args=SERVER_ARGS) as swarm:
        a = swarm.add_server(None, None, num_blocks=3)
        assert serving_span(a) == (0, 3)  # an empty swarm: the first span
        b = swarm.add_server(None, None, num_blocks=3)
        assert serving_span(b) == (3, 6)  # the uncovered blocks
        c = swarm.add_server(None, None, num_blocks=3)
        assert serving_span(c) in ((0, 3), (3, 6))
        client = DistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=swarm.initial_peers)
        try:
            assert (
                client.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0).tolist()
                == ref.tolist()
            )
            # the lone holder of one half dies: one of the two on the other half moves over
            lone, pair = (b, (a, c)) if serving_span(c) == (0, 3) else (a, (b, c))
            gap = serving_span(lone)
            swarm.kill_server(lone)
            wait_for(
                lambda: {serving_span(sp) for sp in pair} == {(0, 3), (3, 6)},
                90,
                f"a server to move to the blocks {gap} the dead one left",
            )

            def generates_as_hf():
                try:
                    return (
                        client.generate(
                            ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
                        ).tolist()
                        == ref.tolist()
                    )
                except Exception:  # noqa: BLE001 - the mover's record may not be online yet
                    return False

            wait_for(generates_as_hf, 60, "a generation through the re-placed swarm")
        finally:
            client.backend.shutdown()
