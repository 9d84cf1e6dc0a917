"""LoRA adapters (PEFT format) chosen per session: exact against HF + peft, sessions with different
adapters (and none) in one batch, a typed error naming the served adapters for an unknown one.
Through real servers: tests/test_lora_live.py."""

from __future__ import annotations

import json

import pytest
import torch

from petals_chain.client.model import DistributedModelForCausalLM
from petals_chain.errors import UnknownAdapterError, UnsupportedModelError
from petals_chain.runtime.block_range import BlockRange, StepInput
from petals_chain.runtime.client_head import ClientHead
from tests.exactness_helpers import hf_logits_per_step
from tests.family_checkpoints import VOCAB, load_hf, load_hf_with_lora, save_random_lora

# per family: two adapters on different layers (one with rsLoRA scaling)
TARGETS = {
    "llama": (["q_proj", "v_proj", "gate_proj"], ["o_proj", "down_proj", "k_proj"]),
    "bloom": (["query_key_value", "dense_h_to_4h"], ["dense", "dense_4h_to_h"]),
}


@pytest.fixture(scope="module")
def lora_models(tiny_llama_path, tiny_family_path, tmp_path_factory):
    """family -> (base path, [adapter paths])."""
    out = {}
    for family, base in (("llama", tiny_llama_path), ("bloom", tiny_family_path("bloom"))):
        root = tmp_path_factory.mktemp(f"lora-{family}")
        first, second = TARGETS[family]
        out[family] = (
            base,
            [
                save_random_lora(base, root / "alpha", first, seed=1),
                save_random_lora(base, root / "beta", second, r=2, alpha=4, use_rslora=True, seed=2),
            ],
        )
    return out


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["llama", "bloom"])
@torch.inference_mode()
def test_adapters_match_hf_peft_and_batch_with_each_other(lora_models, family):
    base, adapters = lora_models[family]
    refs = {
        None: load_hf(base),
        "alpha": load_hf_with_lora(base, adapters[0]),
        "beta": load_hf_with_lora(base, adapters[1]),
    }
    prompts = {None: _ids(7, 1), "alpha": _ids(9, 2), "beta": _ids(5, 3)}
    expected = {name: hf_logits_per_step(hf, prompts[name], steps=5) for name, hf in refs.items()}
    # the adapters change the model (else exactness would prove nothing)
    base_logits = hf_logits_per_step(refs[None], prompts["alpha"], steps=0)[0][0]
    assert float((expected["alpha"][0][0] - base_logits).abs().max()) > 1e-2
    head = ClientHead(base, model_path=base)
    ranges = [
        BlockRange(base, s, e, model_path=base, config=head.config, adapters=adapters)
        for s, e in ((0, 2), (2, head.family.num_blocks(head.config)))
    ]
    assert ranges[0].adapters == ["alpha", "beta"]
    kvs = {name: [r.allocate_kv(32, adapter=name) for r in ranges] for name in prompts}
    names = list(prompts)
    inputs = [head.embed_tokens(prompts[n]) for n in names]
    logits = {n: [] for n in names}
    tokens = {n: [] for n in names}
    for _ in range(6):  # prefill of all three sessions in one call, then batched decode steps
        for r_i, r in enumerate(ranges):
            inputs = r.forward([StepInput(kvs[n][r_i], x) for n, x in zip(names, inputs)])
        for n, x in zip(names, inputs):
            logits[n].append(head.logits(x))
            tokens[n].append(int(logits[n][-1][-1].argmax()))
        inputs = [head.embed_tokens(torch.tensor([tokens[n][-1]])) for n in names]
    for n in names:
        assert tokens[n] == expected[n][1], n
        assert max(float((a - b).abs().max()) for a, b in zip(logits[n], expected[n][0])) <= 1e-5, n


def test_generate_with_active_adapter_and_unknown_adapter(lora_models):
    base, adapters = lora_models["llama"]
    model = DistributedModelForCausalLM.from_local_ranges(
        base, [(0, 3), (3, 6)], adapters=adapters, active_adapter="beta"
    )
    ids = _ids(6, 4).unsqueeze(0)
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert model.generate(ids, **kw).tolist() == load_hf_with_lora(base, adapters[1]).generate(ids, **kw).tolist()
    with model.inference_session(max_length=32, adapter="alpha"):  # a per-session choice
        assert model.generate(ids, **kw).tolist() == load_hf_with_lora(base, adapters[0]).generate(ids, **kw).tolist()
    with pytest.raises(UnknownAdapterError, match="'gamma'.*alpha.*beta"):
        with model.inference_session(max_length=32, adapter="gamma"):
            pass


def test_adapters_the_runtime_cannot_serve_are_refused(lora_models, tmp_path):
    base, adapters = lora_models["llama"]
    dora = tmp_path / "dora"
    dora.mkdir()
    for f in adapters[0].iterdir():
        (dora / f.name).write_bytes(f.read_bytes())
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(UnsupportedModelError, match="use_dora"):
        BlockRange(base, 0, 2, model_path=base, adapters=[dora])
    with pytest.raises(Exception, match="not a PEFT adapter folder"):
        BlockRange(base, 0, 2, model_path=base, adapters=[tmp_path])


class _DigitsTokenizer:
    """Text is token ids as space-separated numbers: enough tokenizer for the gateway's completions."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [int(t) for t in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids]


def test_gateway_model_names_pick_the_adapter(lora_models):
    """Through the gateway's HTTP API (in process, the official client): model 'MODEL:ADAPTER' runs
    the session with that adapter (greedy text equals HF + peft); /v1/models lists each adapter;
    an unknown one is a 404 naming what is served."""
    from tests.test_api_features import MODEL, _serve, openai

    base, adapters = lora_models["llama"]
    model = DistributedModelForCausalLM.from_local_ranges(base, [(0, 3), (3, 6)], adapters=adapters)
    url, _, stop = _serve(model, _DigitsTokenizer(), adapters=["alpha", "beta"])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL, f"{MODEL}:alpha", f"{MODEL}:beta"]
        ids = _ids(6, 5)
        for name, hf in ((None, load_hf(base)), ("beta", load_hf_with_lora(base, adapters[1]))):
            ref = hf.generate(ids.unsqueeze(0), max_new_tokens=5, do_sample=False)[0, 6:]  # its eos: the config's
            out = client.completions.create(
                model=MODEL + (f":{name}" if name else ""),
                max_tokens=5,
                temperature=0,
                prompt=" ".join(str(i) for i in ids.tolist()),
            )
            assert out.choices[0].text == "".join(f" {t}" for t in ref.tolist()), name
        with pytest.raises(openai.NotFoundError, match=f"{MODEL}:gamma.*'{MODEL}:alpha', '{MODEL}:beta'"):
            client.completions.create(model=f"{MODEL}:gamma", prompt="5 6", max_tokens=2)
    finally:
        stop()
