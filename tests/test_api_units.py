"""The gateway's pure parts: stop-string scanning, admission queue and policy, error mapping, metrics."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from petals_chain.api.admission import (
    AdmissionQueue,
    CapacityError,
    FifoPolicy,
    make_admission_policy,
)
from petals_chain.api.engine import StopScanner
from petals_chain.api.metrics import GatewayMetrics
from petals_chain.errors import (
    AcquireTimeoutError,
    MaxLengthExceededError,
    NoChainError,
    ServerUnavailableError,
)

text_st = st.text(alphabet="abcXY \ufffd", max_size=30)


@given(
    text=text_st,
    stops=st.lists(st.text(alphabet="abcXY", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
@settings(max_examples=300, deadline=None)
def test_stop_scanner_streams_exactly_the_text_before_the_first_stop(text, stops, cuts):
    assume("\ufffd" not in text[-1:])  # the final text of a finished generation has no half character
    scanner = StopScanner(tuple(stops))
    sent = ""
    pushed = [text[:n] for n in sorted(cuts)] + [text]
    for prefix in pushed:
        sent += scanner.push(prefix, final=prefix is text)
        if scanner.stopped:
            break
    # the generation stops at the first pushed text that contains a stop string, cut where the
    # earliest one in it begins (as servers that check stop strings token by token do)
    hit = next((p for p in pushed if any(s in p for s in stops)), None)
    expected = text if hit is None else hit[: min(hit.find(s) for s in stops if s in hit)]
    assert sent == expected == scanner.sent
    assert scanner.stopped == (hit is not None)


def test_stop_scanner_holds_back_a_possible_stop_prefix_and_half_characters():
    s = StopScanner(("END",))
    assert s.push("Hello E") == "Hello "
    assert s.push("Hello EN") == ""
    assert s.push("Hello ENx") == "ENx"
    assert s.push("Hello ENx \ufffd") == " "
    assert s.push("Hello ENx é END more") == "é " and s.stopped


def _run(coro):
    return asyncio.run(coro)


def test_admission_fifo_order_timeout_and_cancel():
    async def scenario():
        q = AdmissionQueue(1, FifoPolicy())
        await q.acquire("a", 5, timeout_s=1)
        order = []

        async def waiter(user):
            await q.acquire(user, 5, timeout_s=30)
            order.append(user)

        tasks = [asyncio.create_task(waiter(u)) for u in ("b", "c", "d")]
        while len(q.waiting) < 3:
            await asyncio.sleep(0)
        tasks[1].cancel()  # "c" gives its place up (its client went away)
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        assert [t.user for t in q.waiting] == ["b", "d"]
        q.release("a", 5, 7)
        await tasks[0]
        q.release("b", 5, 7)
        await tasks[2]
        assert order == ["b", "d"] and q.active == 1
        with pytest.raises(CapacityError, match="retry later"):
            await q.acquire("e", 5, timeout_s=0.01)
        assert not q.waiting and q.active == 1
        q.release("d", 5, 7)
        assert q.active == 0

    _run(scenario())


def test_admission_policy_by_name():
    assert make_admission_policy("fifo").name == "fifo" and make_admission_policy("vtc").name == "vtc"
    with pytest.raises(ValueError, match="choose one of fifo, vtc"):
        make_admission_policy("lottery")


def _admission_order(policy_name: str, arrivals: list[tuple[str, int]], output_tokens: int) -> list[str]:
    """Users in the order their requests get the one slot: all `arrivals` (user, prompt tokens)
    queue behind a first request of "heavy", then each finishes with `output_tokens`."""

    async def scenario():
        q = AdmissionQueue(1, make_admission_policy(policy_name))
        await q.acquire("heavy", 10, timeout_s=1)
        order: list[str] = []

        async def waiter(user, tokens):
            await q.acquire(user, tokens, timeout_s=30)
            order.append(user)

        tasks = []
        for user, tokens in arrivals:
            tasks.append(asyncio.create_task(waiter(user, tokens)))
            await asyncio.sleep(0)
        q.release("heavy", 10, output_tokens)
        for i in range(len(arrivals)):
            while len(order) <= i:
                await asyncio.sleep(0)
            q.release(order[i], 0, output_tokens)
        await asyncio.gather(*tasks)
        assert q.active == 0 and not q.waiting
        return order

    return _run(scenario())


def test_vtc_admission_serves_a_light_user_between_a_heavy_users_backlog():
    arrivals = [("heavy", 10)] * 4 + [("light", 10)] * 2
    assert _admission_order("fifo", arrivals, 20) == ["heavy"] * 4 + ["light"] * 2
    # light is lifted to heavy's counter when it arrives, then is behind by every heavy request served
    assert _admission_order("vtc", arrivals, 20) == ["light", "heavy", "light", "heavy", "heavy", "heavy"]


@given(st.lists(st.sampled_from("abc"), min_size=2, max_size=24), st.integers(0, 50))
@settings(max_examples=60, deadline=None)
def test_vtc_admission_keeps_backlogged_users_within_one_request(users, output_tokens):
    """Equal requests: while two users both wait, their admitted counts differ by at most one
    request (plus heavy's first, admitted before anyone waited)."""
    assume(len(set(users)) > 1)
    order = _admission_order("vtc", [(u, 10) for u in users], output_tokens)
    assert sorted(order) == sorted(users)
    remaining = Counter(users)
    served = Counter({"heavy": 1})
    for u in order:
        backlogged = [x for x in remaining if remaining[x] > 0]
        if len(backlogged) > 1:
            counts = [served[x] for x in backlogged]
            assert max(counts) - min(counts) <= 2
        served[u] += 1
        remaining[u] -= 1


def test_swarm_errors_map_to_http_statuses():
    from petals_chain.api.openai_schema import api_error_of as _api_error

    assert _api_error(NoChainError("none")).status == 503
    assert _api_error(AcquireTimeoutError("queued too long")).status == 503
    assert _api_error(ServerUnavailableError("gone")).status == 503
    assert _api_error(MaxLengthExceededError("too long")).status == 400
    assert _api_error(RuntimeError("bug")).status == 500


def test_metrics_use_vllm_names_under_the_petals_chain_prefix():
    m = GatewayMetrics("m1")
    m.active_sessions, m.waiting = 3, 2
    m.generation(
        prompt_tokens=5,
        completion_tokens=30,
        finish_reason="length",
        ttft_s=0.4,
        token_times_s=[1.0, 1.25, 1.75],
        e2e_s=2.0,
        hops=2,
        failovers=1,
        prefix_hit_tokens=4,
    )
    m.generation(
        prompt_tokens=5,
        completion_tokens=1,
        finish_reason="cancelled",
        ttft_s=None,
        token_times_s=[],
        e2e_s=0.5,
        hops=2,
        failovers=0,
        prefix_hit_tokens=0,
    )
    m.request("/v1/completions", 200)
    text = m.render().decode()
    for line in [
        'petals_chain:num_requests_running{model_name="m1"} 3.0',
        'petals_chain:num_requests_waiting{model_name="m1"} 2.0',
        'petals_chain:prompt_tokens_total{model_name="m1"} 10.0',
        'petals_chain:generation_tokens_total{model_name="m1"} 31.0',
        'petals_chain:request_success_total{finished_reason="length",model_name="m1"} 1.0',
        'petals_chain:request_success_total{finished_reason="abort",model_name="m1"} 1.0',
        'petals_chain:time_to_first_token_seconds_bucket{le="0.5",model_name="m1"} 1.0',
        'petals_chain:inter_token_latency_seconds_count{model_name="m1"} 2.0',
        'petals_chain:inter_token_latency_seconds_sum{model_name="m1"} 0.75',
        'petals_chain:e2e_request_latency_seconds_count{model_name="m1"} 2.0',
        'petals_chain:request_hops_sum{model_name="m1"} 4.0',
        'petals_chain:failovers_total{model_name="m1"} 1.0',
        'petals_chain:prefix_cache_hit_tokens_total{model_name="m1"} 4.0',
        'petals_chain:http_requests_total{endpoint="/v1/completions",status="200"} 1.0',
    ]:
        assert line in text, line
    assert "# TYPE petals_chain:request_queue_time_seconds histogram" in text


def test_metrics_export_the_client_heads_lm_batching_read_at_scrape_time():
    """calls / batches is sessions per LM head run: what bench_api reports for concurrent requests."""
    from types import SimpleNamespace

    import torch

    from petals_chain.runtime.row_batcher import RowBatcher

    batcher = RowBatcher(lambda rows: rows * 2)
    m = GatewayMetrics("m1")
    m.watch_client_head(SimpleNamespace(logits_batched=batcher))
    assert 'petals_chain:client_head_lm_calls_total{model_name="m1"} 0.0' in m.render().decode()
    batcher(torch.ones(2, 3))
    batcher(torch.ones(1, 3))
    text = m.render().decode()  # no re-registration: the counters are the batcher's own, read now
    for line in [
        'petals_chain:client_head_lm_calls_total{model_name="m1"} 2.0',
        'petals_chain:client_head_lm_batches_total{model_name="m1"} 2.0',
        'petals_chain:client_head_lm_rows_total{model_name="m1"} 3.0',
        "# TYPE petals_chain:client_head_lm_batches_total counter",
    ]:
        assert line in text, line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--initial-peers", "garbage"], "bad --initial-peers"),
        (["--initial-peers", "/ip4/127.0.0.1/tcp/5"], "no /p2p/PEERID part"),
        (
            ["--initial-peers", "/ip4/127.0.0.1/tcp/5/p2p/12D3KooWJ2xx", "--max-concurrent", "0"],
            "--max-concurrent must be >= 1",
        ),
        (["--initial-peers", "/ip4/127.0.0.1/tcp/5/p2p/12D3KooWJ2xx", "--port", "70000"], "--port must be in 0..65535"),
    ],
)
def test_api_cli_bad_arguments_exit_2_with_one_clear_line(args, message, capsys):
    from petals_chain.cli.api import main

    assert main(["--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_tool_calls_are_parsed_and_held_back_while_streaming():
    from petals_chain.api.tools import ToolCallStream, parse_tool_calls

    reply = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(reply)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert parse_tool_calls("no calls <tool_call> {not json") == ("no calls <tool_call> {not json", [])
    stream = ToolCallStream()
    sent = "".join(stream.push(reply[i : i + 3]) for i in range(0, len(reply), 3))
    assert sent == "Let me check."  # nothing of the call leaked as text
    rest, streamed_calls = stream.finish()
    assert rest == "" and [c["function"] for c in streamed_calls] == [c["function"] for c in calls]
    plain = ToolCallStream()
    assert plain.push("a <tool") == "a " and plain.push(" box") == "<tool box" and plain.finish() == ("", [])


# -- forced tool calls: the constraint on the reply's text (api/constrain.py) -------------------------
json_st = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet='ab"\\\n\u00e9\u4e2d', max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)


@given(
    obj=st.dictionaries(st.text(alphabet='xy"', max_size=3), json_st, max_size=3),
    indent=st.sampled_from([None, 0, 2]),
    compact=st.booleans(),
    ascii_only=st.booleans(),
    tail=st.text(alphabet="}\n<x", max_size=3),
)
@settings(max_examples=300, deadline=None)
def test_every_prefix_of_a_json_object_is_valid_and_it_ends_where_it_closes(obj, indent, compact, ascii_only, tail):
    from petals_chain.api.constrain import json_object_prefix

    text = " " + json.dumps(obj, indent=indent, ensure_ascii=ascii_only, separators=(",", ":") if compact else None)
    for n in range(len(text)):
        assert json_object_prefix(text[:n]) == (True, None), text[:n]
    assert json_object_prefix(text + tail) == (True, len(text))


@given(text=st.text(alphabet='{}[]",: 0123456789.-eEtrunlfasx\\\n', max_size=24))
@settings(max_examples=500, deadline=None)
def test_json_object_check_agrees_with_json_loads(text):
    """A text the checker calls a whole object is one for `json.loads`, and the other way round;
    a text it refuses is no prefix of any object (no extension of it parses)."""
    from petals_chain.api.constrain import json_object_prefix

    try:
        whole = isinstance(json.loads(text), dict) and text.rstrip() == text
    except ValueError:
        whole = False
    ok, end = json_object_prefix(text)
    assert (ok and end == len(text)) == whole
    if not ok:
        for tail in ('"', "0", "}", "]}", '"}', "0}", "e}", ":0}", '":0}', "]}]}", "}}"):
            try:
                assert not isinstance(json.loads(text + tail), dict), tail
            except ValueError:
                pass


def test_text_constraint_forces_literals_and_narrows_choices():
    from petals_chain.api.constrain import JsonObject, Literal, OneOf, TextConstraint

    c = TextConstraint([Literal("<a>"), OneOf(('get_time"', 'get_weather"')), JsonObject(), Literal("</a>")])
    assert c.check("").ok and c.check("").forced == "<a>get_"
    assert (
        c.check("<").forced == "a>get_" and c.check("<a>").forced == "get_" and c.check("<a>get_w").forced == 'eather"'
    )
    assert not c.check("<b").ok and not c.check("<a>set").ok and not c.check('<a>get_time" x').ok
    assert c.check('<a>get_time" {"k": [1, 2]').ok and c.check('<a>get_time" {"k": [1, 2]').forced == ""
    assert c.check('<a>get_time" {"k": [1, 2]}</').forced == "a>" and c.check('<a>get_time" {}').forced == "</a>"
    one = TextConstraint([Literal("<a>"), OneOf(('f"',)), Literal(":"), JsonObject(), Literal("</a>")])
    assert one.check("<").forced == 'a>f":'  # a single choice is forced like a literal
    done = c.check('<a>get_time" {"k": [1, 2]}</a>')
    assert done.ok and done.complete and not c.check('<a>get_time" {}</a>x').ok
    with pytest.raises(ValueError):
        OneOf(("get", "get_time"))  # a prefix of another: ambiguous where it ends


def test_forced_call_is_read_off_the_template_and_parses_back(smollm2_tokenizer):
    from pathlib import Path

    from petals_chain.api.openai_schema import APIError, ChatRequest
    from petals_chain.api.tools import forced_call, parse_tool_calls

    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    body = ChatRequest(
        model="m",
        messages=[{"role": "user", "content": "x"}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    with pytest.raises(APIError) as e:  # SmolLM2's own template renders no tool calls
        forced_call(smollm2_tokenizer, body)
    assert e.value.param == "tool_choice" and "--chat-template" in str(e.value)
    tokenizer = smollm2_tokenizer.__class__.from_pretrained(smollm2_tokenizer.name_or_path)
    tokenizer.chat_template = (Path(__file__).parent / "data" / "hermes_tools_template.jinja").read_text()
    forced = forced_call(tokenizer, body)
    assert forced.finish_reason == "stop"  # vLLM's (and OpenAI's) for a named function
    reply = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert forced.constraint.check(reply).complete and forced.constraint.check("").forced == reply[: reply.index(" {")]
    assert parse_tool_calls(reply)[1][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    required = forced_call(tokenizer, body.model_copy(update={"tool_choice": "required"}))
    assert required.finish_reason == "tool_calls" and required.constraint.check(reply).complete


def test_engine_keeps_a_random_model_inside_the_forced_call(tiny_chat_path):
    """A random model ranks JSON-breaking tokens first almost every step: the mask must carry it.
    Every reply is a valid prefix of the call; a finished one is exactly one call with an object as
    arguments; forced tokens get logprobs like sampled ones."""
    import threading

    import torch
    from transformers import AutoTokenizer

    from petals_chain.api.constrain import JsonObject, Literal, OneOf, TextConstraint
    from petals_chain.api.engine import SamplingParams, run_generation
    from petals_chain.api.tools import parse_tool_calls
    from petals_chain.client.model import DistributedModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_path)
    model = DistributedModelForCausalLM.from_local_ranges(tiny_chat_path, [(0, 2), (2, 4)])
    constraint = TextConstraint(
        [
            Literal('<tool_call>\n{"name": "'),
            OneOf(('get_time"', 'get_weather"')),
            Literal(', "arguments":'),
            JsonObject(),
            Literal("}\n</tool_call>"),
        ]
    )
    prompt = tokenizer("What is the weather in Rome?")["input_ids"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only slow a loaded machine down
    try:
        for temperature, seed in ((0.0, None), (1.0, 0), (1.0, 1)):
            params = SamplingParams(
                max_tokens=40, temperature=temperature, seed=seed, top_logprobs=2, constraint=constraint
            )
            r = run_generation(model, tokenizer, prompt, params, cancel=threading.Event(), on_text=lambda *_: None)
            assert constraint.check(r.text).ok, r.text
            assert r.text.startswith('<tool_call>\n{"name": "get_') and len(r.logprobs) == r.completion_tokens
            if r.finish_reason == "stop":
                content, calls = parse_tool_calls(r.text)
                assert (
                    content is None
                    and len(calls) == 1
                    and isinstance(json.loads(calls[0]["function"]["arguments"]), dict)
                )
            else:
                assert r.finish_reason == "length" and r.completion_tokens == 40
    finally:
        torch.set_num_threads(threads)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def ollama_app():
    """The gateway's app over no model: a request body is validated before anything reaches the swarm."""
    from fastapi.testclient import TestClient

    from petals_chain.api.gateway import Gateway, GatewayConfig

    return TestClient(Gateway(object(), None, GatewayConfig(model_name="smollm2-135m")).app)


@pytest.mark.parametrize(
    "path, body, field, words",
    [
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            "messages.0.images",
            "text-only",
        ),
        (
            "/api/chat",
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]},
            "messages.0.tool_calls",
            "/v1/chat/completions with 'tools'",
        ),
        ("/api/chat", {"tools": [TOOL]}, "tools", "/v1/chat/completions with 'tools'"),
        ("/api/chat", {"format": "json"}, "format", "structured output"),
        ("/api/chat", {"format": {"type": "object"}}, "format", "structured output"),
        ("/api/chat", {"think": True}, "think", "send false"),
        ("/api/chat", {"think": "high"}, "think", "send false"),
        ("/api/generate", {"logprobs": True}, "logprobs", "/v1/chat/completions with logprobs=true"),
        ("/api/generate", {"top_logprobs": 3}, "top_logprobs", "/v1/chat/completions with logprobs=true"),
        ("/api/generate", {"template": "{{ .Prompt }}"}, "template", "raw=true"),
        ("/api/generate", {"suffix": "}"}, "suffix", "fill in the middle"),
        ("/api/generate", {"images": ["aGk="]}, "images", "text-only"),
    ],
)
def test_unsupported_ollama_fields_are_a_400_naming_the_field_and_what_to_do(ollama_app, path, body, field, words):
    r = ollama_app.post(path, json={"model": "smollm2-135m", **body})
    assert r.status_code == 400 and list(r.json()) == ["error"], r.text  # Ollama's error shape
    message = r.json()["error"]
    assert message.startswith(f"unsupported field '{field}': ") and words in message, message
    assert "; " in message.removeprefix(f"unsupported field '{field}': ")  # why, then what to do


def test_unsupported_ollama_fields_at_their_off_values_are_accepted(ollama_app):
    from pydantic import ValidationError

    from petals_chain.api.ollama import GenerateBody
    from petals_chain.api.openai_schema import UnsupportedFieldError

    off = {
        "format": "",
        "think": False,
        "logprobs": False,
        "top_logprobs": 0,
        "images": [],
        "suffix": "",
        "template": "",
    }
    r = ollama_app.post("/api/generate", json={"model": "smollm2-135m", "stream": False, **off})
    assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text  # an empty prompt: "load the model"
    with pytest.raises(ValidationError) as e:  # the typed error, under pydantic's report
        GenerateBody.model_validate({"model": "m", "suffix": "x"})
    cause = e.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, UnsupportedFieldError) and cause.field == "suffix"
