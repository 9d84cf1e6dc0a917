"""The gateway's OpenAI features with the official `openai` client, in process: the gateway's
FastAPI app served by uvicorn on 127.0.0.1 over SmolLM2 split into two local block ranges (no
swarm processes, so these run in seconds; `test_api_gateway.py` drives the real CLI over a live
swarm). Exactness is against transformers on the same checkpoint."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai", reason="the gateway tests need the official `openai` package")

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
TOOL_TEMPLATE = Path(__file__).parent / "data" / "hermes_tools_template.jinja"


@pytest.fixture(scope="module")
def local_model(smollm2_path):
    from petals_chain.client.model import DistributedModelForCausalLM

    return DistributedModelForCausalLM.from_local_ranges(smollm2_path, [(0, 15), (15, 30)])


def _serve(model, tokenizer, **config):
    """Start a gateway over `model` in this process; returns (base url, stop)."""
    import uvicorn

    from petals_chain.api.gateway import Gateway, GatewayConfig

    gateway = Gateway(model, tokenizer, GatewayConfig(model_name=MODEL, **config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(gateway.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process gateway did not start"
        time.sleep(0.02)

    def stop():
        server.should_exit = True
        thread.join(10)
        gateway.shutdown()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", gateway, stop


@pytest.fixture(scope="module")
def served(local_model, smollm2_tokenizer):
    base, gateway, stop = _serve(local_model, smollm2_tokenizer, max_concurrent=4)
    yield base, gateway
    stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def _http(method, url, body=None, *, raw: bytes | None = None, headers: dict | None = None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        return urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as e:
        return e


def _chat_ids(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True, **kwargs
    )["input_ids"]


def _hf_logprobs(hf, ids: torch.Tensor, generated: list[int]) -> torch.Tensor:
    """HF's log_softmax over the vocabulary at each generated position [n, vocab]."""
    full = torch.cat([ids, torch.tensor([generated])], dim=1)
    with torch.no_grad():
        logits = hf(full).logits[0, ids.shape[1] - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1)


# -- item 8: nothing silently ignored ---------------------------------------------------------
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"store": True}, "store"),
        ({"made_up_field": 1}, "made_up_field"),
        ({"top_logprobs": 3}, None),  # needs logprobs=true
        ({"stream_options": {"include_usage": True}}, None),  # needs stream=true
    ],
)
def test_unimplemented_chat_fields_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body=extra
        )
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert next(iter(extra)) in err["message"]


@pytest.mark.parametrize("extra", [{"echo": True}, {"best_of": 3}, {"suffix": "end"}, {"frequency_penalty": 1}])
def test_unimplemented_completion_fields_are_400(client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == next(iter(extra))


def test_neutral_values_of_unimplemented_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        response_format={"type": "text"},
        user="alice",
    )
    assert r.usage.completion_tokens >= 1


def test_malformed_json_gets_a_message_a_person_can_act_on(served):
    r = _http("POST", served[0] + "/v1/completions", raw=b'{"model": "smollm2-135m", "prompt": ')
    err = json.loads(r.read())["error"]
    assert r.status == 400 and err["param"] is None
    assert "not valid JSON" in err["message"] and "line 1 column 37" in err["message"], err["message"]


# -- item 1: logprobs, usage in streams, request ids, n > 1 ----------------------------------
def test_chat_logprobs_equal_hf_log_softmax(client, smollm2_hf, smollm2_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5
    )
    entries = r.choices[0].logprobs.content
    generated = smollm2_tokenizer(r.choices[0].message.content, add_special_tokens=False)["input_ids"]
    ids = _chat_ids(smollm2_tokenizer, messages)
    expected_ids = smollm2_hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
    assert len(entries) == len(expected_ids) == r.usage.completion_tokens
    hf = _hf_logprobs(smollm2_hf, ids, expected_ids)
    for pos, (entry, token) in enumerate(zip(entries, expected_ids)):
        assert entry.token == smollm2_tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(hf[pos, token]), abs=1e-3)
        top = torch.topk(hf[pos], 5)
        assert [t.token for t in entry.top_logprobs] == [smollm2_tokenizer.decode([i]) for i in top.indices.tolist()]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the best
    assert generated == expected_ids or r.choices[0].finish_reason == "stop"


def test_completion_logprobs_and_streamed_logprobs_match(client, smollm2_hf, smollm2_tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ids = smollm2_tokenizer(prompt, return_tensors="pt").input_ids
    expected_ids = smollm2_hf.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :].tolist()
    hf = _hf_logprobs(smollm2_hf, ids, expected_ids)
    assert lp.tokens == [smollm2_tokenizer.decode([t]) for t in expected_ids]
    assert lp.token_logprobs == pytest.approx([float(hf[i, t]) for i, t in enumerate(expected_ids)], abs=1e-3)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    chunks = list(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, stream=True)
    )
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_stream_usage_and_logprobs_in_chat_chunks(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in full.choices[0].logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_request_id_is_echoed_or_generated_and_names_the_response(served):
    base = served[0]
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    r = _http("POST", base + "/v1/completions", body, headers={"X-Request-Id": "trace-42.a:b"})
    assert r.status == 200 and r.headers["X-Request-Id"] == "trace-42.a:b"
    assert json.loads(r.read())["id"] == "cmpl-trace-42.a:b"
    r = _http("POST", base + "/v1/completions", body)
    generated = r.headers["X-Request-Id"]
    assert r.status == 200 and len(generated) == 32 and json.loads(r.read())["id"] == "cmpl-" + generated
    r = _http("POST", base + "/v1/completions", body, headers={"X-Request-Id": "x" * 65})
    err = json.loads(r.read())["error"]
    assert r.status == 400 and err["param"] == "X-Request-Id" and r.headers["X-Request-Id"] != "x" * 65
    assert _http("GET", base + "/health").headers["X-Request-Id"]


def test_n_choices_sampled_with_seed_are_reproducible_and_distinct(client):
    def ask():
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=12,
            temperature=1.0,
            seed=7,
            n=3,
        )

    a, b = ask(), ask()
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1  # seeds 7, 8, 9: not three copies of one answer
    assert (
        a.usage.completion_tokens == sum(len(c.logprobs.content) if c.logprobs else 0 for c in a.choices)
        or a.usage.completion_tokens >= 3
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=12,
            temperature=1.0,
            seed=7,
            n=3,
            stream=True,
        )
    )
    by_index = {
        i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in range(3)
    }
    assert [by_index[i] for i in range(3)] == texts
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]


# -- item 6: tool calls -----------------------------------------------------------------------
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tools_on_a_template_without_them_are_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=4, tools=[WEATHER_TOOL]
        )
    assert e.value.body["param"] == "tools" and "--chat-template" in e.value.body["message"]


def test_tool_calls_with_a_template_that_renders_tools(local_model, smollm2_path, smollm2_hf):
    """A Hermes-style template (tests/data): the model, shown three calls, calls the tool for a
    fourth city; the reply (plain and streamed) carries it as tool_calls, parsed from exactly
    what transformers generates for the same prompt."""
    from transformers import AutoTokenizer

    from petals_chain.api.tools import parse_tool_calls

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = TOOL_TEMPLATE.read_text()
    base, _, stop = _serve(local_model, tokenizer, max_concurrent=2)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)

        def asked(city, i):
            return [
                {"role": "user", "content": f"What is the weather in {city}?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
                        }
                    ],
                },
            ]

        messages = [
            *asked("Paris", 1),
            *asked("Berlin", 2),
            *asked("Madrid", 3),
            {"role": "user", "content": "What is the weather in Rome?"},
        ]
        r = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=40, temperature=0
        )
        template_messages = [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in messages
        ]
        ids = _chat_ids(tokenizer, template_messages, tools=[WEATHER_TOOL])
        expected_text = tokenizer.decode(
            smollm2_hf.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :], skip_special_tokens=True
        )
        _, expected_calls = parse_tool_calls(expected_text)
        assert expected_calls, f"the model did not call the tool: {expected_text!r}"  # the test means something
        assert r.usage.prompt_tokens == ids.shape[1]  # the tools were rendered into the prompt
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("function", "get_weather", {"city": "Rome"})
        ]
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=40, temperature=0, stream=True
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == ""  # nothing of the call leaks as text
        streamed = [t for d in deltas for t in d.tool_calls or ()]
        assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
            (0, "get_weather", {"city": "Rome"})
        ]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "tool_calls"
        ]
    finally:
        stop()


TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    },
}


def test_forced_tool_calls_required_named_and_streamed(local_model, smollm2_path, smollm2_hf, client):
    """tool_choice "required" and a named function always reply with a call (of that function)
    whose arguments parse as JSON. Greedy, where the model's own best tokens already make valid
    JSON, the arguments are exactly what transformers generates after the forced opening."""
    from transformers import AutoTokenizer

    from petals_chain.api.constrain import json_object_prefix

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = TOOL_TEMPLATE.read_text()
    base, _, stop = _serve(local_model, tokenizer, max_concurrent=2)
    try:
        tool_client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        rome = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                    }
                ],
            },
            {"role": "user", "content": "And in Rome?"},
        ]
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = tool_client.chat.completions.create(
            model=MODEL, messages=rome, tools=[TIME_TOOL, WEATHER_TOOL], tool_choice=named, max_tokens=30, temperature=0
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None  # vLLM's finish for a named call
        [call] = choice.message.tool_calls
        template_rome = [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": {"city": "Paris"}}} for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in rome
        ]
        opening = '<tool_call>\n{"name": "get_weather", "arguments":'
        ids = torch.cat(
            [
                _chat_ids(tokenizer, template_rome, tools=[TIME_TOOL, WEATHER_TOOL]),
                torch.tensor([tokenizer.encode(opening)]),
            ],
            dim=1,
        )
        hf_text = tokenizer.decode(smollm2_hf.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1] :])
        ok, end = json_object_prefix(hf_text)
        assert ok and end is not None, hf_text  # the model's own arguments are JSON: the mask never acted
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(hf_text[:end])

        # "required" on a greeting the model would answer in words: a call of an offered function, sampled
        for seed in (1, 2):
            r = tool_client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello!"}],
                tools=[TIME_TOOL, WEATHER_TOOL],
                tool_choice="required",
                max_tokens=60,
                temperature=1.0,
                seed=seed,
            )
            choice = r.choices[0]
            if choice.finish_reason == "length":  # ran out of tokens inside the arguments: still a valid prefix
                assert choice.message.content.startswith('<tool_call>\n{"name": "get_')
                continue
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            assert choice.message.tool_calls[0].function.name in ("get_time", "get_weather")
            assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)

        chunks = list(
            tool_client.chat.completions.create(
                model=MODEL,
                messages=rome,
                tools=[TIME_TOOL, WEATHER_TOOL],
                tool_choice=named,
                max_tokens=30,
                temperature=0,
                stream=True,
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == ""  # nothing of the call leaks as text
        [streamed] = [t for d in deltas for t in d.tool_calls or ()]
        assert (streamed.function.name, json.loads(streamed.function.arguments)) == (
            call.function.name,
            json.loads(call.function.arguments),
        )
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        with pytest.raises(openai.BadRequestError) as e:
            tool_client.chat.completions.create(
                model=MODEL,
                messages=rome,
                tools=[WEATHER_TOOL],
                max_tokens=4,
                tool_choice={"type": "function", "function": {"name": "get_time"}},
            )
        assert e.value.body["param"] == "tool_choice.function.name"
    finally:
        stop()
    with pytest.raises(openai.BadRequestError) as e:  # a template without tools: still a 400, forced or not
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            max_tokens=4,
            tools=[WEATHER_TOOL],
            tool_choice="required",
        )
    assert e.value.body["param"] == "tools"


def test_ready_answers_503_with_the_backends_reason(served, local_model, monkeypatch):
    base, gateway = served
    assert _http("GET", base + "/ready").status == 200  # local block ranges are always dispatchable
    monkeypatch.setattr(local_model.backend, "unready_reason", lambda: "no chain of online servers covers blocks")
    gateway._ready = None  # forget the cached answer
    r = _http("GET", base + "/ready")
    body = json.loads(r.read())
    assert r.status == 503 and body["status"] == "unavailable" and "covers blocks" in body["reason"]
    assert _http("GET", base + "/health").status == 200  # liveness does not depend on the swarm
    gateway._ready = None
