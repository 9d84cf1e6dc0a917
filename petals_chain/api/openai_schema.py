"""OpenAI API request bodies (validated with pydantic), error bodies and response/chunk shapes.

Field names and shapes follow OpenAI's API reference for `/v1/completions` and
`/v1/chat/completions`; only `n=1` is served (one session per request).
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    """An error the gateway answers in OpenAI's error JSON with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported: send one request per completion")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("send exactly one prompt per request (a string, or a list of one string)")
            return v[0]
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)


def completion_body(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                    usage: dict | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            **({"usage": usage} if usage is not None else {})}


def chat_body(rid: str, model: str, created: int, text: str, finish_reason: str, usage: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": usage}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               usage: dict | None = None, with_choice: bool = True) -> dict:
    choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}] if with_choice else []
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
            **({"usage": usage} if usage is not None else {})}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now_s() -> int:
    return int(time.time())
