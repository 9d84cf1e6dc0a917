"""Tool calls for chat completions (`tools`, `tool_choice`, `tool_calls` in the reply).

The tools go to the model through its chat template (transformers' `apply_chat_template(tools=)`),
so only a template that renders them can offer them: `template_supports_tools` renders a probe
conversation with and without a probe tool and calls the template tool-capable when the two
differ (a template that ignores `tools` would otherwise get them silently dropped). The model's
reply is parsed for the Hermes convention that tool-capable templates of open models use (Qwen2.5,
Hermes, SmolLM3, ...): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call. Forcing a call (`tool_choice: "required"` or a named function) needs constrained decoding,
which the gateway does not do: a 400 says so.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from petals_chain.api.constrain import JsonObject, Literal, OneOf, TextConstraint
from petals_chain.api.openai_schema import APIError, ChatMessage, ChatRequest

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN_TAG) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE_TAG) + r"|$)", re.S)
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_support",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
_PROBE_ARGUMENTS = {"probe_key": 1}
# OpenAI's rule for function names; it also keeps a name from running into the template's quote after it
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A request message as chat templates expect it (tool-call arguments as objects, as
    transformers' templates render them)."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    raise APIError(
                        400,
                        "an assistant message's tool_calls[].function.arguments is not valid JSON",
                        param="messages",
                    ) from None
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def offered_tools(body: ChatRequest) -> list[dict] | None:
    """The tools to render into the prompt (None: none), or a 400 for what cannot be honoured."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None  # the model may not call a tool: it does not see them
    for i, tool in enumerate(body.tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                400,
                'each tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}',
                param=f"tools.{i}",
            )
        if not _NAME_RE.match(fn["name"]):
            raise APIError(
                400,
                f"tool name {fn['name']!r} must be 1 to 64 letters, digits, '_' or '-' (OpenAI's rule)",
                param=f"tools.{i}.function.name",
            )
    _forced_name(body)  # 400s for a tool_choice that is neither of OpenAI's forms
    return list(body.tools)


def _forced_name(body: ChatRequest) -> tuple[bool, str | None]:
    """(whether a call is forced, the function it must call or None for any offered one)."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    names = [t["function"]["name"] for t in body.tools or ()]
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise APIError(
            400,
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if fn.get("name") not in names:
        raise APIError(
            400,
            f"tool_choice names the function {fn.get('name')!r}, which is not among the offered "
            f"tools ({', '.join(names)}): offer it in 'tools' or name one of them",
            param="tool_choice.function.name",
        )
    return True, fn["name"]


@dataclass(frozen=True)
class ForcedCall:
    """A reply that must be one tool call: the constraint on its text, and the finish_reason of the
    reply (vLLM's and OpenAI's: "stop" for a named function, "tool_calls" for "required")."""

    constraint: TextConstraint
    finish_reason: str


def forced_call(tokenizer, body: ChatRequest) -> ForcedCall | None:
    """The constraint for `tool_choice: "required"` or a named function (None when no call is
    forced), read off the chat template: the text between the generation prompt and a probe call's
    name, between the name and its arguments, and after them up to the closing tag. 400 when the
    template does not render calls in the Hermes shape that `parse_tool_calls` reads."""
    forced, name = _forced_name(body)
    if not forced:
        return None
    opening, middle, closing = _call_shape(tokenizer)
    # the arguments object may start after whitespace: the model writes `{` with its own leading space
    middle = middle.rstrip()
    names = [name] if name is not None else [t["function"]["name"] for t in body.tools]
    segments = [Literal(opening), OneOf(tuple(n + middle for n in names)), JsonObject(), Literal(closing)]
    return ForcedCall(TextConstraint(segments), "stop" if name is not None else "tool_calls")


def _call_shape(tokenizer) -> tuple[str, str, str]:
    unsupported = APIError(
        400,
        'this chat template does not render tool calls as <tool_call>{"name": ..., '
        '"arguments": {...}}</tool_call>, the shape the gateway forces and parses; use '
        "tool_choice 'auto' or start the gateway with --chat-template FILE naming a "
        "Hermes-style template",
        param="tool_choice",
    )
    name = _PROBE_TOOL["function"]["name"]
    ask = [{"role": "user", "content": "hi"}]
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_probe", "type": "function", "function": {"name": name, "arguments": _PROBE_ARGUMENTS}}
        ],
    }
    try:
        prompt = tokenizer.apply_chat_template(ask, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(ask + [call], tools=[_PROBE_TOOL], tokenize=False)
    except Exception:
        raise unsupported from None
    reply = full[len(prompt) :] if full.startswith(prompt) else ""
    at_name = reply.find(name)
    at_args, args = next(
        (
            (reply.find(a, at_name), a)
            for a in (json.dumps(_PROBE_ARGUMENTS), json.dumps(_PROBE_ARGUMENTS, separators=(",", ":")))
            if at_name >= 0 and reply.find(a, at_name) >= 0
        ),
        (-1, ""),
    )
    at_close = reply.find(CLOSE_TAG, at_args + len(args))
    if min(at_name, at_args, at_close) < 0:
        raise unsupported
    shape = (
        reply[:at_name],
        reply[at_name + len(name) : at_args],
        reply[at_args + len(args) : at_close + len(CLOSE_TAG)],
    )
    # the parser must read a call in this shape back as exactly that call (one implementation of the format)
    content, calls = parse_tool_calls(shape[0] + "f" + shape[1] + '{"a": [1]}' + shape[2])
    if content is not None or [c["function"] for c in calls] != [{"name": "f", "arguments": '{"a": [1]}'}]:
        raise unsupported
    return shape


def template_supports_tools(tokenizer) -> bool:
    probe = [{"role": "user", "content": "hi"}]
    try:
        with_tool = tokenizer.apply_chat_template(
            probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that raises on tools does not support them
        return False
    return with_tool != tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: the text outside `<tool_call>` blocks (None when it is
    empty and there are calls), and the calls in OpenAI's shape. A block that is not a JSON object
    with a "name" leaves the reply as plain text (no calls)."""
    calls = []
    for body in _CALL_RE.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    if not calls:
        return text, []
    content = _CALL_RE.sub("", text).strip()
    return content or None, calls


class ToolCallStream:
    """Streams a reply's text while holding back whatever may be a tool call: from `<tool_call>` on
    (and any tail that could still grow into it); `finish()` parses what was held."""

    def __init__(self):
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> str:
        self.text += delta
        start = self.text.find(OPEN_TAG)
        if start < 0:  # hold a tail that may be the start of the tag
            start = len(self.text) - next(
                (k for k in range(min(len(OPEN_TAG) - 1, len(self.text)), 0, -1) if self.text.endswith(OPEN_TAG[:k])), 0
            )
        out = self.text[self.sent : max(start, self.sent)]
        self.sent = max(start, self.sent)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(text still to send, tool calls)."""
        held = self.text[self.sent :]
        content, calls = parse_tool_calls(held)
        self.sent = len(self.text)
        return (content or "") if calls else held, calls
