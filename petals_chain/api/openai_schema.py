"""OpenAI API request bodies (validated with pydantic), error bodies and response/chunk shapes.

Field names and shapes follow OpenAI's API reference for `/v1/completions` and
`/v1/chat/completions`. A field the gateway does not implement is rejected with a 400 naming it
(or accepted only at its no-op value), never dropped silently.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from petals_chain.errors import InvalidRequestError, PetalsChainError

# Swarm-side failures that mean "no capacity / no healthy chain right now": the client may retry.
UNAVAILABLE_STATUS = 503


class APIError(Exception):
    """An error the gateway answers in OpenAI's error JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The error in the shape of the API `path` belongs to: Ollama's (`/api/...`) is one string."""
        return {"error": self.message} if path.startswith("/api/") else self.body()


class UnsupportedFieldError(ValueError):
    """A request field the gateway does not implement, sent at a value that would change the answer.
    Raised while pydantic validates a body; the gateway answers it as a 400, in the shape of the API the
    path belongs to, whose message names the field where it stands, why it is refused and what to do."""

    def __init__(self, field: str, why: str, fix: str):
        super().__init__(f"unsupported field '{field}': {why}; {fix}")
        self.field, self.why, self.fix = field, why, fix

    def message_at(self, location: str) -> str:
        """The message with the field's place in the body (`messages.0.images`), not only its name."""
        return f"unsupported field '{location}': {self.why}; {self.fix}"


def api_error_of(error: BaseException) -> APIError:
    """A session's failure as the HTTP error the client gets."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error))
    if isinstance(error, PetalsChainError):  # no chain, queue timeout, servers gone, out of cache
        return APIError(
            UNAVAILABLE_STATUS, f"the swarm cannot serve the request now: {error}", type="server_error", code=error.code
        )
    return APIError(500, f"internal error in the gateway: {type(error).__name__}: {error}", type="server_error")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


# Most choices one request may ask for (`n`): each is a session of its own through the swarm.
MAX_CHOICES = 16
# OpenAI's limit for chat's `top_logprobs`; completions' `logprobs` gets the same (vLLM does too).
MAX_TOP_LOGPROBS = 20


def _only_neutral(name: str, value: Any, neutral: tuple[Any, ...]) -> Any:
    """A field the gateway accepts only at its no-op value: anything else is a 400 naming it,
    never a silently dropped setting."""
    if value not in neutral:
        shown = " or ".join(repr(v) for v in neutral if v is not None) or "null"
        raise UnsupportedFieldError(name, "not implemented by this gateway", f"remove it (or send {shown})")
    return value


class _Common(BaseModel):
    # an unknown field is a 400 naming it (gateway.py words the message): nothing is silently ignored
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # not OpenAI's: vLLM's extension (and Ollama's option); None, 0 or -1: all tokens
    top_k: int | None = Field(default=None, ge=-1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user label: logged with the request id
    # accepted only at their no-op values (see `_only_neutral`)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v, info):
        return _only_neutral(info.field_name, v, (None, 0, 0.0))

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        return _only_neutral("logit_bias", v or None, (None,))

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @model_validator(mode="after")
    def _usage_needs_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def top_logprobs_count(self) -> int | None:
        """None: no logprobs; k: the sampled token's logprob and the k most likely alternatives."""
        raise NotImplementedError


class CompletionRequest(_Common):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError(
                    "send exactly one prompt per request (a string, or a list of one string); "
                    "use n for several completions of one prompt"
                )
            return v[0]
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v):
        return _only_neutral("echo", v, (False,))

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        return _only_neutral("best_of", v, (None, 1))

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return _only_neutral("suffix", v or None, (None,))

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer to that call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, v):
        if v != "text":
            raise ValueError(
                f"response_format {v!r} is not implemented by this gateway (no constrained "
                'decoding); remove it (or send {"type": "text"})'
            )
        return v


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ: send one of them")
            self.max_tokens = self.max_completion_tokens
        return self

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, text: str | None, finish_reason: str, logprobs: dict | None = None, tool_calls: list[dict] | None = None
) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(rid: str, model: str, created: int, choices: list[dict], usage: dict | None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        **({"usage": usage} if usage is not None else {}),
    }


def chat_body(rid: str, model: str, created: int, choices: list[dict], usage: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chat_chunk(rid: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        **({"usage": usage} if usage is not None else {}),
    }


def chat_delta(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """`cached_tokens`: prompt tokens the chain took from its servers' prefix caches (OpenAI's
    `prompt_tokens_details.cached_tokens`)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def served_by(result) -> dict:
    """Not OpenAI's: which chain of servers served a choice (`GenerationResult`) and how fast, added to
    the choice (and to a stream's finishing chunk) as `petals_chain`: the chat page shows it.
    `tokens_per_s`: the tokens after the first over the time from the first to the last, as the gateway
    timed them (None for fewer than two); `time_to_first_token_s` from the session's start."""
    times = result.token_times_s
    span_s = times[-1] - times[0] if len(times) > 1 else 0.0
    return {
        "chain": result.chain,
        "hops": result.hops,
        "failovers": result.failovers,
        "prefix_hit_tokens": result.prefix_hit_tokens,
        "tokens_per_s": (len(times) - 1) / span_s if span_s > 0 else None,
        "time_to_first_token_s": result.time_to_first_token_s,
    }


def now_s() -> int:
    return int(time.time())
