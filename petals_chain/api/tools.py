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
from typing import Any

from petals_chain.api.openai_schema import APIError, ChatMessage, ChatRequest

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN_TAG) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE_TAG) + r"|$)", re.S)
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_support", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


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
                    raise APIError(400, "an assistant message's tool_calls[].function.arguments is not valid JSON",
                                   param="messages") from None
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
    if choice not in (None, "auto"):
        raise APIError(400, "tool_choice 'required' or a named function is not implemented by this gateway (it would "
                            "need constrained decoding); use 'auto' or 'none'", param="tool_choice")
    for i, tool in enumerate(body.tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, 'each tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}',
                           param=f"tools.{i}")
    return list(body.tools)


def template_supports_tools(tokenizer) -> bool:
    probe = [{"role": "user", "content": "hi"}]
    try:
        with_tool = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True)
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
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
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
            start = len(self.text) - next((k for k in range(min(len(OPEN_TAG) - 1, len(self.text)), 0, -1)
                                           if self.text.endswith(OPEN_TAG[:k])), 0)
        out = self.text[self.sent:max(start, self.sent)]
        self.sent = max(start, self.sent)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(text still to send, tool calls)."""
        held = self.text[self.sent:]
        content, calls = parse_tool_calls(held)
        self.sent = len(self.text)
        return (content or "") if calls else held, calls
