"""Every served family (tests/family_checkpoints.py) is exact against HF in-process: chained block
ranges, chunked prefill, mid-range entry, sessions batched together (prefills and decodes in one
call); and its KV bytes per token come from its config. Multi-turn sessions, concurrency and
prefix reuse through real servers: tests/test_families_live.py."""

from __future__ import annotations

import pytest
import torch

from petals_chain.errors import UnsupportedModelError
from petals_chain.models.family import REGISTRY, get_family
from petals_chain.runtime.block_range import BlockRange, StepInput
from tests.exactness_helpers import (
    chain_logits_per_step,
    chain_ranges,
    hf_logits_per_step,
)
from tests.family_checkpoints import VARIANTS, VOCAB, load_hf
from tests.test_device_placement import (
    FactoryCallsWithoutDevice,
    assert_graph_decode_equals_eager,
    run_every_step_kind,
)

LOGIT_TOLERANCE = 1e-5  # float32
# (KV heads, head dim) each variant's cache must have: Falcon's caches hold the real KV heads only
KV_LAYOUT = {
    "qwen2": (2, 16),
    "mistral": (2, 16),
    "mixtral": (2, 16),
    "bloom": (4, 16),
    "falcon-new": (2, 16),
    "falcon-mq": (1, 16),
    "falcon-seq": (4, 16),
}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_registry_discovers_every_family():
    assert {"llama", "qwen2", "mistral", "mixtral", "falcon", "bloom"} <= set(REGISTRY.model_types())

    class Config:
        model_type = "gpt_neox"

    with pytest.raises(UnsupportedModelError, match="bloom.*falcon.*llama"):
        get_family(Config())


@pytest.mark.parametrize("variant", VARIANTS)
@torch.inference_mode()
def test_ranges_chunked_prefill_and_midrange_entry_match_hf(tiny_family_path, variant):
    path = tiny_family_path(variant)
    hf = load_hf(path)
    ids = _ids(13, seed=1)  # longer than the sliding windows (5, 6 tokens)
    ref_logits, ref_tokens = hf_logits_per_step(hf, ids, steps=8)
    head, ranges = chain_ranges(path, [(0, 1), (1, 3), (3, 4)])
    logits, tokens = chain_logits_per_step(head, ranges, ids, steps=8, max_length=32)
    assert _max_diff(logits, ref_logits) <= LOGIT_TOLERANCE
    assert tokens == ref_tokens
    # chunked prefill: chunks past position 0 attend to the cache through an explicit mask
    kvs = [r.allocate_kv(32) for r in ranges]
    chunks = []
    for chunk in torch.split(ids, 5):
        x = head.embed_tokens(chunk)
        for r, kv in zip(ranges, kvs):
            x = r.forward([StepInput(kv, x)])[0]
        chunks.append(head.logits(x))
    assert float((torch.cat(chunks) - ref_logits[0]).abs().max()) <= LOGIT_TOLERANCE
    # a session entering a [1, 4) server at block 2 skips block 1 there
    _, (first, second) = chain_ranges(path, [(0, 2), (1, 4)])
    kv1, kv2 = first.allocate_kv(32), second.allocate_kv(32, first_block=2)
    x = second.forward([StepInput(kv2, first.forward([StepInput(kv1, head.embed_tokens(ids))])[0])])[0]
    assert float((head.logits(x) - ref_logits[0]).abs().max()) <= LOGIT_TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
@torch.inference_mode()
def test_batched_sessions_match_hf(tiny_family_path, variant):
    """3 sessions: their prefills in one call, then one batched call per decode step; a 4th session's
    prefill joins a decode step. Every session's greedy tokens equal HF's for its own prompt."""
    path = tiny_family_path(variant)
    hf = load_hf(path)
    prompts = [_ids(n, seed=10 + n) for n in (3, 9, 7, 4)]
    steps = 6
    refs = [hf_logits_per_step(hf, p, steps=steps - 1)[1] for p in prompts]
    head, (rng,) = chain_ranges(path, [(0, 4)])
    kvs = [rng.allocate_kv(24) for _ in prompts]
    outs = rng.forward([StepInput(kv, head.embed_tokens(p)) for kv, p in zip(kvs[:3], prompts[:3])])
    got = [[int(head.logits(o)[-1].argmax())] for o in outs]
    for step in range(steps - 1):
        inputs = [StepInput(kv, head.embed_tokens(torch.tensor([g[-1]]))) for kv, g in zip(kvs, got)]
        if step == 1:  # the 4th session's prompt arrives while the others decode
            inputs.append(StepInput(kvs[3], head.embed_tokens(prompts[3])))
        outs = rng.forward(inputs)
        for g, o in zip(got, outs[:3]):
            g.append(int(head.logits(o)[-1].argmax()))
        if step == 1:
            got.append([int(head.logits(outs[3])[-1].argmax())])
        elif step > 1:
            got[3].append(int(head.logits(outs[3])[-1].argmax()))
    assert got[:3] == refs[:3]
    assert got[3] == refs[3][: len(got[3])]


@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_bytes_per_token_from_config(tiny_family_path, variant):
    path = tiny_family_path(variant)
    rng = BlockRange(path, 0, 2, model_path=path)
    kv_heads, head_dim = KV_LAYOUT[variant]
    assert rng.kv_bytes_per_block(100) == 2 * kv_heads * head_dim * 100 * 4  # float32
    kv = rng.allocate_kv(100)
    assert tuple(kv.keys.shape) == (2, kv_heads, 100, head_dim) and kv.nbytes == 2 * rng.kv_bytes_per_block(100)


@pytest.mark.parametrize("variant", VARIANTS)
@torch.inference_mode()
def test_every_tensor_on_the_device_and_graph_decode_equals_eager(tiny_family_path, variant):
    """What tests/test_device_placement.py checks for Llama, for every family: no tensor made without
    a device on any step path, and the CUDA-graph decode body (whole-cache attention under a position
    mask: sliding windows and ALiBi included) computes what the eager decode computes."""
    path = tiny_family_path(variant)
    rng = BlockRange(path, 0, 4, model_path=path)
    with FactoryCallsWithoutDevice() as mode:
        run_every_step_kind(rng)
    assert mode.calls == []
    assert_graph_decode_equals_eager(rng, decode_steps=4)  # past the 5- and 6-token windows
