"""Device bugs caught on machines without a GPU.

On CUDA a tensor made without `device=` lands on the CPU and the next op fails (`launch-server
--device cuda` died that way in its start-up profile). These tests run the runtime on the CPU under
a TorchFunctionMode that records every factory call (torch.ones, arange, tensor, ...) made from
petals_chain's own code without an explicit device, through every path of a step: prefill, decode,
a multi-token step after a prefix (the attention mask), sessions entering mid-range (row
selection), the CUDA-graph decode body, and the client head.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from petals_chain.runtime.block_range import BlockRange, StepInput
from petals_chain.runtime.client_head import ClientHead

FACTORIES = {
    torch.ones,
    torch.zeros,
    torch.empty,
    torch.full,
    torch.arange,
    torch.tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
    torch.eye,
    torch.as_tensor,
}
OURS = str(Path(__file__).resolve().parents[1] / "petals_chain")
TORCH = str(Path(torch.__file__).parent)


class FactoryCallsWithoutDevice(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH):
                frame = frame.f_back
            # called by our own code (a library's internal tensors, e.g. transformers building its
            # rotary inv_freq on the CPU before we move the module, are that library's business)
            if frame is not None and frame.f_code.co_filename.startswith(OURS):
                self.calls.append(f"{func.__name__} at {frame.f_code.co_filename}:{frame.f_lineno}")
        return func(*args, **kwargs)


def run_every_step_kind(block_range: BlockRange) -> None:
    g = torch.Generator().manual_seed(0)
    h = block_range.hidden_size
    a = block_range.allocate_kv(32)
    b = block_range.allocate_kv(32, first_block=block_range.start + 1)
    block_range.forward([StepInput(a, torch.randn(5, h, generator=g))])  # prefill
    block_range.forward(
        [
            StepInput(a, torch.randn(3, h, generator=g)),  # multi-token step after a prefix
            StepInput(b, torch.randn(4, h, generator=g)),
        ]
    )  # entering mid-range
    block_range.forward([StepInput(a, torch.randn(1, h, generator=g)), StepInput(b, torch.randn(1, h, generator=g))])
    positions = torch.tensor([a.past_tokens, b.past_tokens], device=block_range.device)
    block_range._graph_body(torch.randn(2, h, generator=g), positions, [a, b])


def test_runtime_makes_every_tensor_on_its_device(tiny_llama_path):
    block_range = BlockRange(tiny_llama_path, 0, 6, model_path=tiny_llama_path)
    head = ClientHead(tiny_llama_path, model_path=tiny_llama_path)
    with FactoryCallsWithoutDevice() as mode:
        run_every_step_kind(block_range)
        head.logits(head.embed_tokens(torch.tensor([[1, 2, 3]], device="cpu")))
        # a range built under the mode too: the rotary table and caches
        BlockRange(tiny_llama_path, 2, 4, model_path=tiny_llama_path).allocate_kv(8)
    assert mode.calls == []


def test_the_recorder_catches_a_tensor_made_without_a_device():
    """The check above can fail: a factory call without a device from a file of ours is recorded
    (and one with a device, or from elsewhere, is not)."""
    code = compile("torch.ones(2, dtype=torch.bool)\ntorch.zeros(2, device='cpu')", f"{OURS}/example.py", "exec")
    with FactoryCallsWithoutDevice() as mode:
        exec(code, {"torch": torch})
        torch.ones(3)
    assert mode.calls == [f"ones at {OURS}/example.py:1"]


def test_graph_decode_body_equals_the_eager_decode(tiny_llama_path):
    """The captured decode (whole-cache attention with a position mask, KV written by index_copy)
    computes what the eager decode computes, and writes the same KV."""
    assert_graph_decode_equals_eager(BlockRange(tiny_llama_path, 0, 6, model_path=tiny_llama_path), decode_steps=3)


def assert_graph_decode_equals_eager(br: BlockRange, decode_steps: int) -> None:
    """Two sessions (one entering at the range's third block) decode `decode_steps` tokens eagerly
    and through the graph body; outputs and written KV agree."""
    g = torch.Generator().manual_seed(1)
    kvs_eager = [br.allocate_kv(24), br.allocate_kv(24, first_block=br.start + 2)]
    kvs_graph = [br.allocate_kv(24), br.allocate_kv(24, first_block=br.start + 2)]
    prompts = [torch.randn(7, br.hidden_size, generator=g), torch.randn(3, br.hidden_size, generator=g)]
    for kvs in (kvs_eager, kvs_graph):
        br.forward([StepInput(kv, p) for kv, p in zip(kvs, prompts)])
    for _ in range(decode_steps):
        x = torch.randn(2, br.hidden_size, generator=g)
        eager = torch.cat(br.forward([StepInput(kv, x[i : i + 1]) for i, kv in enumerate(kvs_eager)]))
        positions = torch.tensor([kv.past_tokens for kv in kvs_graph])
        graph = br._graph_body(x, positions, kvs_graph)
        for kv in kvs_graph:
            kv.past_tokens += 1
        torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
    for ke, kg in zip(kvs_eager, kvs_graph):
        n = ke.past_tokens
        torch.testing.assert_close(kg.keys[:, :, :n], ke.keys[:, :, :n])
        torch.testing.assert_close(kg.values[:, :, :n], ke.values[:, :, :n])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CPU suite checks the graph body above")
def test_cuda_graph_replays_equal_eager(tiny_llama_path):
    br_graph = BlockRange(tiny_llama_path, 0, 6, model_path=tiny_llama_path, device="cuda")
    br_eager = BlockRange(tiny_llama_path, 0, 6, model_path=tiny_llama_path, device="cuda", cuda_graphs=False)
    g = torch.Generator().manual_seed(2)
    kv_g, kv_e = br_graph.allocate_kv(40), br_eager.allocate_kv(40)
    prompt = torch.randn(5, br_graph.hidden_size, generator=g)
    br_graph.forward([StepInput(kv_g, prompt)])
    br_eager.forward([StepInput(kv_e, prompt)])
    for _ in range(6):
        x = torch.randn(1, br_graph.hidden_size, generator=g)
        out_g = br_graph.forward([StepInput(kv_g, x)])[0]
        out_e = br_eager.forward([StepInput(kv_e, x)])[0]
        torch.testing.assert_close(out_g, out_e, rtol=1e-4, atol=1e-4)
    assert br_graph.graphs.replays >= 4 and br_graph.graphs.captures == 1


def test_decode_graphs_serve_changing_batches_from_one_capture(tiny_llama_path):
    """DecodeGraphs' selection on a CPU (capture = a plain call on the static buffers): batches whose
    sessions change from step to step replay the graph of the recently active set, with dummy rows for
    absent sessions, and every output and every real KV position equals the eager runtime's."""
    from petals_chain.runtime.decode_graphs import DecodeGraphs, call_capture

    graphed = BlockRange(tiny_llama_path, 0, 6, model_path=tiny_llama_path)
    graphed.graphs = DecodeGraphs(
        graphed._graph_body,
        hidden_size=graphed.hidden_size,
        dtype=graphed.dtype,
        device=graphed.device,
        version=graphed._encode_positions_version,
        capture=call_capture,
    )
    eager = BlockRange(tiny_llama_path, 0, 6, model_path=tiny_llama_path)
    g = torch.Generator().manual_seed(3)
    firsts = [0, 0, 3]
    kvs = {name: [r.allocate_kv(40, first_block=f) for f in firsts] for name, r in (("g", graphed), ("e", eager))}
    for i, n in enumerate([6, 2, 4]):
        x = torch.randn(n, graphed.hidden_size, generator=g)
        for name, r in (("g", graphed), ("e", eager)):
            r.forward([StepInput(kvs[name][i], x)])
    schedule = [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0], [1, 2], [2, 0], [1], [0, 1, 2], [2], [0, 1]]
    for batch in schedule:
        x = torch.randn(len(batch), graphed.hidden_size, generator=g)
        out_g = graphed.forward([StepInput(kvs["g"][i], x[j : j + 1]) for j, i in enumerate(batch)])
        out_e = eager.forward([StepInput(kvs["e"][i], x[j : j + 1]) for j, i in enumerate(batch)])
        for a, b in zip(out_g, out_e):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for kg, ke in zip(kvs["g"], kvs["e"]):
        assert kg.past_tokens == ke.past_tokens
        torch.testing.assert_close(
            kg.keys[:, :, : kg.past_tokens], ke.keys[:, :, : ke.past_tokens], rtol=1e-5, atol=1e-5
        )
    graphs = graphed.graphs
    assert graphs.captures == 1  # one capture served every batch after the second sighting of the set
    assert graphs.replays == len(schedule) - 1 and graphs.padded_rows > 0
