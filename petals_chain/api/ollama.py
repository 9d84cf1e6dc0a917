"""The Ollama API on the gateway: `/api/chat`, `/api/generate` (NDJSON streams or one JSON object),
`/api/tags`, `/api/show`, `/api/version`, following Ollama's API reference (docs/api.md in
ollama/ollama), so the official `ollama` client, Open WebUI, Continue and editors that speak it work.

One engine path: a request here becomes prompt ids and `SamplingParams` and goes through the
gateway's own admission, sessions (`engine.run_generation` in its worker threads) and metrics, exactly
as an OpenAI request does; only the request and response shapes are Ollama's. Errors are Ollama's
`{"error": "..."}` with the HTTP status (the gateway's handlers pick the shape by the `/api/` path).

Options: `temperature`, `top_p`, `top_k`, `seed`, `num_predict`, `stop` map to the same sampling as
the OpenAI endpoints; `num_ctx` caps the session's context (at most the gateway's `--max-length`).
Ollama options the gateway does not implement are accepted only at the value that turns them off
(`repeat_penalty` 1, `mirostat` 0, ...); options that configure a local Ollama's loading
(`num_gpu`, `num_thread`, ...) and names Ollama does not know are a 400 naming the option.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from petals_chain.api.engine import GenerationResult, SamplingParams
from petals_chain.api.openai_schema import APIError, UnsupportedFieldError, api_error_of, served_by

# The Ollama release whose API these endpoints follow. Clients compare /api/version against the
# versions that introduced features (Open WebUI, for one), so it is Ollama's numbering, not ours.
OLLAMA_API_VERSION = "0.12.0"

# What a request gets for an option it does not send: Ollama's own defaults for its models
# (`ollama show --parameters` of most library models), except repeat_penalty (1: not implemented).
DEFAULT_OPTIONS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}

# options the gateway implements (mapped onto SamplingParams / the session's context)
SAMPLING_OPTIONS = frozenset({"temperature", "top_p", "top_k", "seed", "num_predict", "stop", "num_ctx"})
# Ollama options the gateway does not implement: accepted only at the value that switches them off
NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {
    "repeat_penalty": (1, 1.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "mirostat": (0,),
    "typical_p": (1, 1.0),
    "tfs_z": (1, 1.0),
    "min_p": (0, 0.0),
}
# they only qualify repeat_penalty, which must be 1 (off): any value changes nothing
QUALIFIER_OPTIONS = frozenset({"repeat_last_n", "penalize_newline", "mirostat_tau", "mirostat_eta"})
# how a local Ollama loads and runs its model: the swarm's servers decide that for themselves
LOAD_OPTIONS = frozenset(
    {
        "num_gpu",
        "main_gpu",
        "num_thread",
        "num_batch",
        "numa",
        "low_vram",
        "use_mmap",
        "use_mlock",
        "vocab_only",
        "embedding_only",
        "logits_all",
        "f16_kv",
        "num_keep",
    }
)


class Options(BaseModel):
    """The implemented options, validated (types and ranges) after `sampling_options` sorted them out."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # 0: all tokens
    seed: int | None = None
    num_predict: int | None = None  # -1: until a stop (or the context is full); -2: fill the context
    stop: list[str] | None = None
    num_ctx: int | None = Field(default=None, ge=1)

    @field_validator("num_predict")
    @classmethod
    def _predict(cls, v):
        if v is not None and v < 1 and v not in (-1, -2):
            raise ValueError("num_predict must be >= 1, or -1 (until a stop) or -2 (fill the context)")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v):
        return [v] if isinstance(v, str) else v


def sampling_options(options: dict[str, Any] | None) -> Options:
    """A request's `options` as the implemented ones; anything else is a 400 naming the option."""
    options = dict(options or {})
    for name, value in options.items():
        if name in SAMPLING_OPTIONS or name in QUALIFIER_OPTIONS:
            continue
        if name in NEUTRAL_OPTIONS:
            if value not in NEUTRAL_OPTIONS[name] and value is not None:
                raise APIError(
                    400,
                    f"option '{name}' is not implemented by this gateway; remove it from 'options' "
                    f"(or send {NEUTRAL_OPTIONS[name][0]}, which turns it off)",
                    param="options",
                )
        elif name in LOAD_OPTIONS:
            raise APIError(
                400,
                f"option '{name}' configures how a local Ollama loads its model; the swarm's servers "
                "choose their own devices and threads: remove it from 'options'",
                param="options",
            )
        else:
            raise APIError(
                400,
                f"unknown option '{name}' in 'options'; this gateway implements "
                f"{', '.join(sorted(SAMPLING_OPTIONS))} (docs/api.md)",
                param="options",
            )
    try:
        return Options.model_validate({k: v for k, v in options.items() if k in SAMPLING_OPTIONS})
    except ValidationError as e:
        err = e.errors()[0]
        name = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"option '{name}': {err['msg'].removeprefix('Value error, ')}", param="options") from None


def unsupported(why: str, fix: str = "remove it", *, off: tuple[Any, ...] | None = None) -> AfterValidator:
    """A field Ollama defines that this gateway does not implement: accepted only at a value that leaves it
    off (any falsy value, or one of `off`); any other value is an `UnsupportedFieldError`, which the
    gateway answers as a 400 in Ollama's shape naming the field, `why` and `fix`."""

    def check(value, info: ValidationInfo):
        if (value in off) if off is not None else not value:
            return value
        raise UnsupportedFieldError(info.field_name, why, fix)

    return AfterValidator(check)


TEXT_ONLY = unsupported("the swarm serves a text-only model")
TOOLS_ON_OPENAI = unsupported(
    "tool calls are served on the OpenAI endpoint", "send the request to /v1/chat/completions with 'tools'"
)
LOGPROBS_ON_OPENAI = unsupported(
    "logprobs are served on the OpenAI endpoints", "ask /v1/chat/completions with logprobs=true and top_logprobs"
)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: Annotated[list[str] | None, TEXT_ONLY] = None
    thinking: str | None = None
    tool_calls: Annotated[list[dict[str, Any]] | None, TOOLS_ON_OPENAI] = None
    tool_name: str | None = None


class _Body(BaseModel):
    # an unknown field is a 400 naming it: nothing is silently ignored
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    stream: bool = True  # Ollama's default
    options: dict[str, Any] | None = None
    format: Annotated[
        str | dict[str, Any] | None,
        unsupported("structured output is not implemented by this gateway", off=(None, "")),
    ] = None
    # how long a local Ollama keeps the model loaded; a swarm's servers keep theirs loaded: no effect
    keep_alive: float | str | None = None
    think: Annotated[
        bool | str | None, unsupported("this model does not think", "remove it (or send false)", off=(None, False))
    ] = None
    logprobs: Annotated[bool | None, LOGPROBS_ON_OPENAI] = None
    top_logprobs: Annotated[int | None, LOGPROBS_ON_OPENAI] = None


class ChatBody(_Body):
    messages: list[Message] = Field(default_factory=list)  # none: Ollama's "load the model" request
    tools: Annotated[list[dict[str, Any]] | None, TOOLS_ON_OPENAI] = None


class GenerateBody(_Body):
    prompt: str = ""  # empty: Ollama's "load the model" request
    system: str | None = None
    template: Annotated[
        str | None,
        unsupported(
            "the gateway renders the model's chat template (or its --chat-template), not one per request",
            "send raw=true with a rendered prompt instead",
        ),
    ] = None
    context: list[int] | None = None  # a previous answer's `context`: the conversation's tokens so far
    raw: bool = False  # the prompt as it is, without the chat template
    suffix: Annotated[str | None, unsupported("fill in the middle is not implemented by this gateway")] = None
    images: Annotated[list[str] | None, TEXT_ONLY] = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    name: str | None = None  # Ollama's older name of the field
    verbose: bool | None = None


def created_at() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)


class OllamaAPI:
    """The Ollama endpoints over one `Gateway` (its admission queue, worker threads and metrics)."""

    def __init__(self, gateway):
        self.gw = gateway
        self._facts: dict[str, Any] | None = None

    # -- models -----------------------------------------------------------------------------------
    def _adapter(self, name: str) -> str | None:
        """The gateway's model check, with Ollama's default tag: 'MODEL:latest' is the base model."""
        base = self.gw.config.model_name
        return self.gw._check_model(base if name == f"{base}:latest" else name)

    def facts(self) -> dict[str, Any]:
        """What /api/tags and /api/show say about the checkpoint the client head was loaded from."""
        if self._facts is None:
            head = getattr(self.gw.model, "head", None)
            path = getattr(head, "model_path", None)
            config = getattr(head, "config", None) or getattr(self.gw.model, "config", None)
            size_bytes, params = 0, 0
            if path is not None:
                from safetensors import safe_open

                for f in sorted(path.glob("*.safetensors")):
                    size_bytes += f.stat().st_size
                    with safe_open(f, framework="pt") as t:
                        for key in t.keys():
                            n = 1
                            for d in t.get_slice(key).get_shape():
                                n *= d
                            params += n
            digest = hashlib.sha256(
                json.dumps(config.to_dict() if config is not None else {}, sort_keys=True, default=str).encode()
            ).hexdigest()
            family = getattr(config, "model_type", "") or ""
            dtype = str(getattr(config, "torch_dtype", None) or getattr(config, "dtype", None) or "")
            quant = {
                "torch.float32": "F32",
                "float32": "F32",
                "torch.bfloat16": "BF16",
                "bfloat16": "BF16",
                "torch.float16": "F16",
                "float16": "F16",
            }.get(dtype, dtype.upper() or "unknown")
            self._facts = {
                "size": size_bytes,
                "parameters": params,
                "digest": digest,
                "family": family,
                "quantization": quant,
                "config": config,
                "modified_at": datetime.fromtimestamp(
                    max((f.stat().st_mtime for f in path.glob("*")), default=0), timezone.utc
                ).isoformat()
                if path is not None
                else created_at(),
            }
        return self._facts

    def _details(self) -> dict[str, Any]:
        f = self.facts()
        p = f["parameters"]
        size = f"{p / 1e9:.1f}B" if p >= 1e9 else f"{p / 1e6:.0f}M" if p else "unknown"
        return {
            "parent_model": "",
            "format": "safetensors",
            "family": f["family"],
            "families": [f["family"]] if f["family"] else None,
            "parameter_size": size,
            "quantization_level": f["quantization"],
        }

    def tags(self) -> dict[str, Any]:
        f = self.facts()
        return {
            "models": [
                {
                    "name": n,
                    "model": n,
                    "modified_at": f["modified_at"],
                    "size": f["size"],
                    "digest": hashlib.sha256((f["digest"] + n).encode()).hexdigest(),
                    "details": self._details(),
                }
                for n in self.gw._model_names()
            ]
        }

    def show(self, name: str) -> dict[str, Any]:
        self._adapter(name)
        f = self.facts()
        config = f["config"]
        arch = f["family"] or "unknown"
        info: dict[str, Any] = {
            "general.architecture": arch,
            "general.parameter_count": f["parameters"],
            f"{arch}.context_length": self.gw.config.max_length,
        }
        for key, attr in (
            ("embedding_length", "hidden_size"),
            ("block_count", "num_hidden_layers"),
            ("attention.head_count", "num_attention_heads"),
            ("attention.head_count_kv", "num_key_value_heads"),
            ("vocab_size", "vocab_size"),
        ):
            if getattr(config, attr, None) is not None:
                info[f"{arch}.{key}"] = getattr(config, attr)
        parameters = "\n".join(f"{k:<15}{v}" for k, v in DEFAULT_OPTIONS.items())
        template = self.gw.tokenizer.chat_template or ""
        return {
            "modelfile": f"# served by petals-chain over a swarm\nFROM {name}\n"
            + "".join(f"PARAMETER {k} {v}\n" for k, v in DEFAULT_OPTIONS.items()),
            "parameters": parameters,
            "template": template if isinstance(template, str) else "",
            "details": self._details(),
            "model_info": info,
            "modified_at": f["modified_at"],
            "capabilities": ["completion"],
        }

    # -- generation -------------------------------------------------------------------------------
    def _params(self, options: Options, prompt_ids: list[int]) -> SamplingParams:
        limit = self.gw.config.max_length
        if options.num_ctx is not None:
            if options.num_ctx > limit:
                raise APIError(
                    400,
                    f"option 'num_ctx' {options.num_ctx} is more than this gateway's context of "
                    f"{limit} tokens (--max-length): lower it",
                    param="options",
                )
            limit = options.num_ctx
        room = limit - len(prompt_ids)
        want = options.num_predict if options.num_predict not in (None, -1, -2) else room
        if room < 1 or want > room:
            raise APIError(
                400,
                f"the context is {limit} tokens; the prompt has {len(prompt_ids)} and num_predict "
                f"asks for {want}: shorten the conversation or lower num_predict",
                param="options",
            )
        pick = {
            k: getattr(options, k) if getattr(options, k) is not None else DEFAULT_OPTIONS.get(k)
            for k in ("temperature", "top_p", "top_k")
        }
        gw = self.gw.config
        return SamplingParams(
            max_tokens=want,
            temperature=pick["temperature"],
            top_p=pick["top_p"],
            top_k=pick["top_k"] or 0,
            stop=tuple(options.stop or ()),
            seed=options.seed,
            prompt_lookup_tokens=gw.prompt_lookup_tokens,
            prompt_lookup_schedule=gw.prompt_lookup_schedule,
        )

    def _chat_ids(self, body: ChatBody) -> list[int]:
        return self.gw._template_ids([{"role": m.role, "content": m.content} for m in body.messages])

    def _generate_ids(self, body: GenerateBody) -> list[int]:
        if body.raw or not self.gw.tokenizer.chat_template:
            if body.system:
                raise APIError(
                    400,
                    "'system' needs the chat template: drop raw=true, or put the system text into the raw prompt",
                    param="system",
                )
            ids = list(self.gw.tokenizer(body.prompt, add_special_tokens=not body.context)["input_ids"])
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": body.prompt}
            ]
            ids = self.gw._template_ids(messages)
        vocab = len(self.gw.tokenizer)
        context = list(body.context or ())
        if any(not 0 <= t < vocab for t in context):
            raise APIError(
                400,
                f"'context' holds token ids outside the vocabulary (0..{vocab - 1}): send the "
                "context a previous answer returned",
                param="context",
            )
        return context + ids

    async def run(self, request: Request, body: ChatBody | GenerateBody):
        chat = isinstance(body, ChatBody)
        user = self.gw._user(request)
        adapter = self._adapter(body.model)
        options = sampling_options(body.options)
        if (chat and not body.messages) or (not chat and not body.prompt):
            return self._loaded(body, chat)  # Ollama's "load the model" request: the swarm has it loaded
        prompt_ids = self._chat_ids(body) if chat else self._generate_ids(body)
        params = self._params(options, prompt_ids)
        events, cancel = await self.gw._start(request, user, prompt_ids, [params], adapter, streamed=body.stream)
        arrived_s = request.state.arrived_s
        if not body.stream:
            result = (await self.gw._collect(request, events, cancel, 1))[0]
            return {**self._piece(body, chat, result.text), **self._final(body, chat, prompt_ids, result, arrived_s)}
        first = await self.gw._first_event(request, events, cancel)
        return StreamingResponse(
            self._ndjson(body, chat, prompt_ids, events, cancel, first, arrived_s),
            media_type="application/x-ndjson",
            headers={"Cache-Control": "no-cache"},
        )

    async def _ndjson(
        self,
        body,
        chat: bool,
        prompt_ids: list[int],
        events: asyncio.Queue,
        cancel: threading.Event,
        first,
        arrived_s: float,
    ):
        try:
            item = first
            while True:
                _, kind, value = item
                if kind == "text":
                    if value[0]:
                        yield _line({**self._piece(body, chat, value[0]), "done": False})
                elif kind == "done":
                    yield _line(
                        {**self._piece(body, chat, ""), **self._final(body, chat, prompt_ids, value, arrived_s)}
                    )
                    return
                else:
                    yield _line({"error": api_error_of(value).message})
                    return
                item = await events.get()
        finally:  # the client went away (Starlette cancels us) or the stream ended: stop the session
            cancel.set()

    def _piece(self, body, chat: bool, text: str) -> dict[str, Any]:
        head = {"model": body.model, "created_at": created_at()}
        if chat:
            return {**head, "message": {"role": "assistant", "content": text}}
        return {**head, "response": text}

    def _final(self, body, chat: bool, prompt_ids: list[int], r: GenerationResult, arrived_s: float) -> dict:
        """The closing object's counts and times (nanoseconds, as Ollama's): prompt evaluation is the
        time to the first token (the session's open and the prompt's step), evaluation the time from
        the first token to the last; total is from the request's arrival (admission wait included)."""
        first_s = r.time_to_first_token_s or 0.0
        out = {
            "done": True,
            "done_reason": r.finish_reason,
            "total_duration": _ns(time.perf_counter() - arrived_s),
            "load_duration": 0,
            "prompt_eval_count": len(prompt_ids) - r.prefix_hit_tokens,
            "prompt_eval_duration": _ns(first_s),
            "eval_count": r.completion_tokens,
            "eval_duration": _ns(r.token_times_s[-1] - r.token_times_s[0]) if r.token_times_s else 0,
            # not Ollama's: the chain of servers that served the answer (the chat page's footer)
            "petals_chain": served_by(r),
        }
        if not chat:
            out["context"] = list(prompt_ids) + list(r.token_ids)
        return out

    def _loaded(self, body, chat: bool) -> dict[str, Any]:
        return {**self._piece(body, chat, ""), "done": True, "done_reason": "load"}


async def _parse(request: Request, cls: type[BaseModel]) -> BaseModel:
    """The body as JSON whatever its Content-Type: Ollama's own examples are `curl -d '{...}'`, which
    sends form encoding. Errors go to the gateway's validation handler (a 400 in Ollama's shape)."""
    try:
        return cls.model_validate_json(await request.body() or b"{}")
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _line(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":")) + "\n"


def add_routes(app: FastAPI, gateway) -> OllamaAPI:
    api = OllamaAPI(gateway)

    @app.post("/api/chat")
    async def chat(request: Request):
        return await api.run(request, await _parse(request, ChatBody))

    @app.post("/api/generate")
    async def generate(request: Request):
        return await api.run(request, await _parse(request, GenerateBody))

    @app.get("/api/tags")
    async def tags(request: Request):
        gateway._user(request)
        return await asyncio.to_thread(api.tags)  # the first call reads the checkpoint's headers

    @app.post("/api/show")
    async def show(request: Request):
        gateway._user(request)
        body = await _parse(request, ShowBody)
        name = body.model or body.name
        if not name:
            raise APIError(400, "'model' is required: the name of a model /api/tags lists", param="model")
        return await asyncio.to_thread(api.show, name)

    @app.get("/api/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            ours = package_version("petals-chain")
        except PackageNotFoundError:
            ours = "unknown"
        return {"version": OLLAMA_API_VERSION, "petals_chain": ours}

    return api
