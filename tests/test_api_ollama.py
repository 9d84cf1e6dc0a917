"""The gateway's Ollama API with the official `ollama` client, in process: the gateway's app served by
uvicorn over SmolLM2 split into two local block ranges (as test_api_features.py does), so greedy text
is checked against HF and against the gateway's own OpenAI endpoint (one engine path)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.test_api_features import MODEL, _chat_ids, _serve

ollama = pytest.importorskip("ollama", reason="the Ollama API tests need the official `ollama` package")
openai = pytest.importorskip("openai", reason="the gateway tests need the official `openai` package")

pytestmark = pytest.mark.model

KEY = "sk-ollama-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(smollm2_path, smollm2_tokenizer):
    from petals_chain.client.model import DistributedModelForCausalLM

    model = DistributedModelForCausalLM.from_local_ranges(smollm2_path, [(0, 15), (15, 30)])
    base, gateway, stop = _serve(model, smollm2_tokenizer, max_concurrent=2, api_keys={KEY: "tester"})
    yield base
    stop()


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served, headers=AUTH, timeout=180)


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served + "/v1", api_key=KEY, max_retries=0, timeout=180)


def _post(url: str, body: dict, headers: dict | None = None):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)},
    )
    try:
        return urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as e:
        return e


def test_chat_greedy_equals_the_openai_endpoint_and_hf_streamed_or_not(client, oai, smollm2_hf, smollm2_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = _chat_ids(smollm2_tokenizer, messages)
    out = smollm2_hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    expected = smollm2_tokenizer.decode(out, skip_special_tokens=True)
    r = client.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 12})
    assert r.message.role == "assistant" and r.message.content == expected
    assert r.done and r.done_reason == ("length" if len(out) == 12 else "stop")
    assert r.eval_count == len(out) and r.prompt_eval_count == ids.shape[1] and r.total_duration > 0
    same = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert same.choices[0].message.content == expected
    parts = list(
        client.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 12}, stream=True)
    )
    assert "".join(p.message.content for p in parts) == expected
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == len(out)


def test_the_final_object_names_the_chain_that_served_it(served):
    r = _post(
        served + "/api/chat",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "options": {"temperature": 0, "num_predict": 1},
        },
    )
    assert r.headers["content-type"] == "application/x-ndjson"  # Ollama streams by default
    lines = [json.loads(line) for line in r.read().decode().splitlines()]
    assert lines[-1]["done"] and lines[-1]["petals_chain"]["chain"] == "local[0:15) -> local[15:30)"
    assert lines[-1]["petals_chain"]["tokens_per_s"] is None  # one token: no time between tokens


def test_generate_raw_equals_completions_and_its_context_continues(client, oai, smollm2_hf, smollm2_tokenizer):
    prompt = "The capital of France is"
    ids = smollm2_tokenizer(prompt, return_tensors="pt").input_ids
    out = smollm2_hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    expected = smollm2_tokenizer.decode(out, skip_special_tokens=True)
    r = client.generate(model=MODEL, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 8})
    assert r.response == expected
    assert oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text == expected
    assert list(r.context) == ids[0].tolist() + out.tolist()  # the conversation's tokens, for the next call
    streamed = list(
        client.generate(model=MODEL, prompt=prompt, raw=True, stream=True, options={"temperature": 0, "num_predict": 8})
    )
    assert "".join(p.response for p in streamed) == expected and list(streamed[-1].context) == list(r.context)
    # a follow-up with `context` continues those tokens: the same as asking for them in one prompt
    more = client.generate(
        model=MODEL, prompt=" Its", raw=True, context=r.context, options={"temperature": 0, "num_predict": 4}
    )
    full = ids[0].tolist() + out.tolist() + smollm2_tokenizer(" Its", add_special_tokens=False)["input_ids"]
    import torch

    hf_more = smollm2_hf.generate(torch.tensor([full]), max_new_tokens=4, do_sample=False)[0, len(full) :]
    assert more.response == smollm2_tokenizer.decode(hf_more, skip_special_tokens=True)
    assert more.prompt_eval_count == len(full)


def test_options_map_to_the_same_sampling_as_the_openai_endpoint(client, oai):
    messages = [{"role": "user", "content": "Tell me a story."}]
    options = {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 11, "num_predict": 10}
    a = client.chat(model=MODEL, messages=messages, options=options).message.content
    b = (
        oai.chat.completions.create(
            model=MODEL, messages=messages, temperature=1.0, top_p=0.9, seed=11, max_tokens=10, extra_body={"top_k": 20}
        )
        .choices[0]
        .message.content
    )
    assert a == b and a  # the same seed draws the same tokens through either API
    assert (
        client.chat(model=MODEL, messages=messages, options={**options, "top_k": 1}).message.content
        == client.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 10}).message.content
    )
    greedy = client.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 10}).message.content
    stop = greedy.split()[2]  # a word in the middle of the answer
    cut = client.chat(model=MODEL, messages=messages, options={"temperature": 0, "num_predict": 10, "stop": [stop]})
    assert cut.message.content == greedy[: greedy.find(stop)] and cut.done_reason == "stop"


@pytest.mark.parametrize(
    "options, words",
    [
        ({"mirostat_gamma": 1}, "unknown option 'mirostat_gamma'"),
        ({"num_gpu": 1}, "option 'num_gpu' configures how a local Ollama loads"),
        ({"repeat_penalty": 1.3}, "option 'repeat_penalty' is not implemented"),
        ({"num_predict": 0}, "option 'num_predict'"),
        ({"temperature": "hot"}, "option 'temperature'"),
        ({"num_ctx": 10**6}, "option 'num_ctx'"),
    ],
)
def test_unknown_or_unimplemented_options_are_a_clear_400(client, served, options, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "options": options, "stream": False}
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=body["messages"], options=options)
    assert e.value.status_code == 400 and words in e.value.error
    r = _post(served + "/api/chat", body)
    assert r.status == 400 and list(json.loads(r.read())) == ["error"]  # Ollama's error shape


def test_neutral_options_and_keep_alive_are_accepted(client):
    r = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        keep_alive="5m",
        options={"temperature": 0, "num_predict": 2, "repeat_penalty": 1.0, "mirostat": 0, "repeat_last_n": 64},
    )
    assert r.eval_count == 2


def test_errors_in_ollama_shape_with_the_right_status(client, served):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404 and "llama3" in e.value.error
    r = _post(served + "/api/generate", {"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer wrong"})
    assert r.status == 401 and "API key" in json.loads(r.read())["error"]
    r = _post(served + "/api/chat", {"model": MODEL, "messages": [], "made_up": 1})
    err = json.loads(r.read())
    assert r.status == 400 and list(err) == ["error"] and "made_up" in err["error"]
    r = _post(
        served + "/api/chat",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        },
    )
    assert r.status == 400 and "/v1/chat/completions" in json.loads(r.read())["error"]
    # Ollama's "load the model" request (no messages): answered at once, the swarm keeps it loaded
    assert client.chat(model=MODEL, messages=[]).done_reason == "load"
    # the body is JSON whatever the Content-Type says (Ollama's examples are `curl -d '{...}'`: form encoding)
    form = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}
    r = _post(served + "/api/chat", {"model": MODEL, "messages": [], "stream": False}, headers=form)
    assert r.status == 200 and json.loads(r.read())["done_reason"] == "load"
    req = urllib.request.Request(served + "/api/chat", data=b'{"model": ', method="POST", headers=AUTH)
    try:
        urllib.request.urlopen(req, timeout=30)
        raise AssertionError("malformed JSON was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and "not valid JSON" in json.loads(e.read())["error"]


def test_tags_show_and_version(client, served, smollm2_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_path)
    tags = client.list().models
    assert [m.model for m in tags] == [MODEL]
    assert tags[0].size == sum(f.stat().st_size for f in smollm2_path.glob("*.safetensors"))
    assert tags[0].details.family == config.model_type and tags[0].details.parameter_size.endswith("M")
    shown = client.show(MODEL)
    assert shown.modelinfo[f"{config.model_type}.block_count"] == config.num_hidden_layers
    assert shown.modelinfo["general.parameter_count"] > 100_000_000 and "temperature" in shown.parameters
    assert client.show(f"{MODEL}:latest").details.family == config.model_type  # Ollama's default tag
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404
    version = json.loads(urllib.request.urlopen(served + "/api/version", timeout=30).read())
    assert version["version"].count(".") == 2 and "petals_chain" in version
