"""`petals-chain api` as a real process over a live local swarm, driven by the official `openai`
client (and raw HTTP where a client library would hide what we test). The swarm and the gateway are
conftest's `live_gateway`, which tests/test_chat_page.py shares."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.swarm_helpers import LIVE_GATEWAY_KEY

openai = pytest.importorskip(
    "openai", reason="the gateway tests need the official `openai` package (pip install openai)"
)

pytestmark = [pytest.mark.integration, pytest.mark.model]

KEY = LIVE_GATEWAY_KEY
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def swarm(live_gateway):
    """The shared swarm (conftest's `live_gateway`): two servers, [0, 15) and [15, 30), with info logs."""
    return live_gateway.swarm


@pytest.fixture(scope="module")
def gateway(live_gateway):
    """The shared `petals-chain api` process (--max-concurrent 4); its base URL (…/v1)."""
    return live_gateway.v1


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway, api_key=KEY, max_retries=0, timeout=180)


def _http(method, url, body=None, *, raw: bytes | None = None, key: str = KEY, timeout_s: float = 120):
    """Plain HTTP (stdlib), for what a client library would hide: returns the open response."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        return e


def _chat_ids(tokenizer, content):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def _hf_text(hf, tokenizer, ids, n):
    out = hf.generate(ids, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), out.shape[1] - ids.shape[1]


def _metric(gateway, name):
    text = _http("GET", gateway.removesuffix("/v1") + "/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_models_lists_the_swarm_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion_greedy_equals_hf(client, smollm2_hf, smollm2_tokenizer):
    question = "What is the capital of France?"
    expected, n = _hf_text(smollm2_hf, smollm2_tokenizer, _chat_ids(smollm2_tokenizer, question), 16)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
    )
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if n == 16 else "stop")
    assert r.usage.prompt_tokens == _chat_ids(smollm2_tokenizer, question).shape[1]
    assert r.usage.completion_tokens == n and r.usage.total_tokens == r.usage.prompt_tokens + n


def test_streaming_chat_chunks_add_up_to_the_same_answer(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_streaming_wire_format_ends_with_done(gateway):
    with _http(
        "POST",
        gateway + "/completions",
        {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0, "stream": True},
    ) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.decode().strip() for line in r if line.strip()]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_completion_with_stop_and_seed(client, smollm2_hf, smollm2_tokenizer):
    prompt = "The capital of France is"
    ids = smollm2_tokenizer(prompt, return_tensors="pt").input_ids
    expected, _ = _hf_text(smollm2_hf, smollm2_tokenizer, ids, 10)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == expected
    stop = expected.strip().split()[1]  # a word in the middle of the answer
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected[: expected.find(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.95, seed=1234
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),  # more than --max-concurrent 4
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, "max_tokens"),
    ],
)
def test_bad_chat_requests_get_400_in_openai_error_json(gateway, body, param):
    r = _http("POST", gateway + "/chat/completions", {"model": MODEL, **body})
    payload = json.loads(r.read())
    assert r.status == 400, payload
    err = payload["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_json_is_400_not_500(gateway):
    r = _http("POST", gateway + "/completions", raw=b'{"model": "smollm2-135m", "prompt": ')
    assert r.status == 400 and "error" in json.loads(r.read())


def test_bad_request_wrong_key_unknown_model_via_openai(client, gateway):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=gateway, api_key="wrong", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found"
    # and the gateway keeps serving
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_disconnect_cancels_the_session_and_frees_its_slot(gateway):
    cancelled_before = _metric(gateway, 'petals_chain:request_success_total{finished_reason="abort"')
    with _http(
        "POST",
        gateway + "/chat/completions",
        {
            "model": MODEL,
            "max_tokens": 500,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story."}],
            "stream": True,
        },
    ) as r:
        for line in r:
            if line.startswith(b"data: "):
                break  # first chunk received: hang up
    deadline = time.monotonic() + 60
    while _metric(gateway, 'petals_chain:request_success_total{finished_reason="abort"') == cancelled_before:
        assert time.monotonic() < deadline, "the session was not cancelled after the client disconnected"
        time.sleep(0.2)
    health = json.loads(_http("GET", gateway.removesuffix("/v1") + "/health").read())
    assert health["active_sessions"] == 0  # the session left its chain (closed, released)


def test_disconnect_during_a_non_streaming_request_cancels_it(gateway):
    cancelled_before = _metric(gateway, 'petals_chain:request_success_total{finished_reason="abort"')
    with pytest.raises(OSError):  # the client gives up (socket timeout) and closes the connection
        _http(
            "POST",
            gateway + "/completions",
            {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "temperature": 0},
            timeout_s=3,
        ).read()
    deadline = time.monotonic() + 60
    while _metric(gateway, 'petals_chain:request_success_total{finished_reason="abort"') == cancelled_before:
        assert time.monotonic() < deadline, "the session was not cancelled after the client disconnected"
        time.sleep(0.2)
    assert _metric(gateway, 'petals_chain:http_requests_total{endpoint="/v1/completions",status="499"}') >= 1


def test_concurrent_greedy_requests_each_equal_hf(client, smollm2_hf, smollm2_tokenizer):
    questions = ["What is 2 + 2?", "Name a fruit.", "What color is the sky?", "Say hello in French."]
    expected = [_hf_text(smollm2_hf, smollm2_tokenizer, _chat_ids(smollm2_tokenizer, q), 10)[0] for q in questions]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def ask(i):
        try:
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": questions[i]}], max_tokens=10, temperature=0
            )
            results[i] = r.choices[0].message.content
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors, errors
    assert [results[i] for i in range(len(questions))] == expected


def test_ready_once_a_full_chain_is_dispatchable_and_health_is_liveness(gateway):
    root = gateway.removesuffix("/v1")
    r = _http("GET", root + "/ready")
    assert r.status == 200 and json.loads(r.read())["status"] == "ready"
    assert json.loads(_http("GET", root + "/health").read())["status"] == "ok"


def test_request_id_reaches_every_servers_log(gateway, swarm, client):
    r = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        temperature=0,
        extra_headers={"X-Request-Id": "trace-7f3a"},
    )
    assert r.headers["x-request-id"] == "trace-7f3a" and r.parse().id == "chatcmpl-trace-7f3a"
    deadline = time.monotonic() + 30
    while not all(any("session trace-7f3a." in line for line in s.lines) for s in swarm.servers):
        assert time.monotonic() < deadline, "a server's log does not name the request id"
        time.sleep(0.2)


def test_second_chat_turn_reuses_the_first_turns_prefix_on_every_hop(gateway, client, smollm2_hf, smollm2_tokenizer):
    history = "Remember these words: " + ", ".join(f"word{i}" for i in range(60)) + "."
    messages = [{"role": "user", "content": history}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Which word came first?"},
    ]
    hits_before = _metric(gateway, "petals_chain:prefix_cache_hit_tokens_total")
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    hit = _metric(gateway, "petals_chain:prefix_cache_hit_tokens_total") - hits_before
    first_prompt = first.usage.prompt_tokens
    # every whole 16-token chunk of the first turn's prompt (its KV is what the first session cached)
    assert first_prompt - 16 < hit <= first_prompt, (hit, first_prompt)
    expected, _ = _hf_text(
        smollm2_hf,
        smollm2_tokenizer,
        smollm2_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"],
        6,
    )
    assert second.choices[0].message.content == expected  # reuse changes nothing in the answer
