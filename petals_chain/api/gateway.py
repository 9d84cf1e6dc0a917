"""The OpenAI-compatible gateway: FastAPI app over one `DistributedModelForCausalLM`.

Why FastAPI + uvicorn: pydantic validation of OpenAI's request bodies in a few declarations (their
errors become OpenAI's 400 JSON here), Starlette's `StreamingResponse` for server-sent events with
client-disconnect detection (it cancels the stream's generator; we then cancel the session), and
uvicorn as a well-kept ASGI server. Each request is one session through the swarm (the model's
`ChainProvider`: the orchestrator's JFFC when the DHT has one, else client-side routing), run by
`engine.run_generation` in a worker thread; all sessions of the gateway share the client's
batched embedding / LM head (runtime/row_batcher.py).
"""
from __future__ import annotations

import asyncio
import json
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from petals_chain.api.admission import AdmissionQueue, CapacityError, make_admission_policy
from petals_chain.api.engine import GenerationResult, SamplingParams, run_generation
from petals_chain.api.metrics import GatewayMetrics
from petals_chain.api.openai_schema import (
    APIError, ChatRequest, CompletionRequest, chat_body, chat_chunk, completion_body, now_s, usage,
)
from petals_chain.errors import InvalidRequestError, PetalsChainError

# The client hung up before the answer: nobody reads this reply, but the request ends cleanly and
# is counted under nginx's "client closed request" status.
CLIENT_CLOSED_REQUEST = 499
# Swarm-side failures that mean "no capacity / no healthy chain right now": the client may retry.
UNAVAILABLE_STATUS = 503


@dataclass
class GatewayConfig:
    model_name: str
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> user label (the unit of fairness)
    max_concurrent: int = 8
    queue_timeout_s: float = 60.0
    max_length: int = 2048  # prompt + completion tokens of one session
    admission: str = "fifo"
    adapters: list[str] = field(default_factory=list)  # LoRA adapters offered as models named 'MODEL:ADAPTER'


class Gateway:
    def __init__(self, model, tokenizer, config: GatewayConfig, metrics: GatewayMetrics | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.queue = AdmissionQueue(config.max_concurrent, make_admission_policy(config.admission))
        self.executor = ThreadPoolExecutor(max_workers=config.max_concurrent, thread_name_prefix="api-session")
        self.app = self._build_app()

    # -- request handling ------------------------------------------------------------------
    def _user(self, request: Request) -> str:
        if not self.config.api_keys:
            return "anonymous"
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        user = self.config.api_keys.get(key)
        if user is None:
            raise APIError(401, "Incorrect API key provided: pass one of the gateway's --api-key values as "
                                "'Authorization: Bearer KEY'", code="invalid_api_key")
        return user

    def _model_names(self) -> list[str]:
        return [self.config.model_name] + [f"{self.config.model_name}:{a}" for a in self.config.adapters]

    def _check_model(self, name: str) -> str | None:
        """The LoRA adapter a request's model name asks for ('MODEL:ADAPTER'), None for the base model."""
        if name not in self._model_names():
            raise APIError(404, f"The model '{name}' does not exist; this gateway serves "
                                f"{', '.join(repr(n) for n in self._model_names())} (GET /v1/models)",
                           param="model", code="model_not_found")
        return name.partition(":")[2] or None

    def _params(self, body, prompt_ids: list[int]) -> SamplingParams:
        room = self.config.max_length - len(prompt_ids)
        max_tokens = body.max_tokens if body.max_tokens is not None else room
        if room < 1 or max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.config.max_length} tokens; the "
                                f"prompt has {len(prompt_ids)} and max_tokens asks for {max_tokens}: shorten the "
                                "prompt or lower max_tokens", param="max_tokens", code="context_length_exceeded")
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              stop=body.stop_list(), seed=body.seed)

    def _chat_prompt(self, body: ChatRequest) -> list[int]:
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])

    async def _start(self, user: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None):
        """Admit the request, start its session in a worker thread; returns (events queue, cancel flag).
        The slot goes back when the thread is done, whatever happens to the HTTP side."""
        self.metrics.waiting += 1
        try:
            await self.queue.acquire(user, len(prompt_ids), self.config.queue_timeout_s)
        except CapacityError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded") from None
        finally:
            self.metrics.waiting -= 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def work() -> GenerationResult:
            return run_generation(self.model, self.tokenizer, prompt_ids, params, cancel=cancel, adapter=adapter,
                                  on_text=lambda d: loop.call_soon_threadsafe(events.put_nowait, ("text", d)))

        def finished(fut) -> None:
            self.metrics.active_sessions -= 1
            result = None if fut.cancelled() or fut.exception() else fut.result()
            self.queue.release(user, len(prompt_ids), result.completion_tokens if result else 0)
            if result is not None:
                self.metrics.generation(len(prompt_ids), result.completion_tokens, result.time_to_first_token_s,
                                        result.finish_reason)
                events.put_nowait(("done", result))
            else:
                events.put_nowait(("error", fut.exception()))

        self.metrics.active_sessions += 1
        asyncio.wrap_future(self.executor.submit(work)).add_done_callback(finished)
        return events, cancel

    async def _collect(self, request: Request, events: asyncio.Queue, cancel: threading.Event) -> GenerationResult:
        """Wait for the whole result; a client that disconnects meanwhile cancels the session."""
        disconnect = asyncio.create_task(_wait_disconnect(request))
        try:
            while True:
                getter = asyncio.create_task(events.get())
                done, _ = await asyncio.wait({getter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    cancel.set()
                    raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the request; its session was cancelled")
                kind, value = getter.result()
                if kind == "done":
                    return value
                if kind == "error":
                    raise _api_error(value)
        finally:
            disconnect.cancel()

    def _stream(self, events: asyncio.Queue, cancel: threading.Event, first, make_chunk, final_chunks):
        async def sse():
            try:
                item = first
                while True:
                    kind, value = item
                    if kind == "text":
                        yield _sse(make_chunk(value))
                    elif kind == "done":
                        for chunk in final_chunks(value):
                            yield _sse(chunk)
                        yield "data: [DONE]\n\n"
                        return
                    else:
                        yield _sse(_api_error(value).body())
                        return
                    item = await events.get()
            finally:  # the client went away (Starlette cancels us) or the stream ended: stop the session
                cancel.set()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _first_event(self, events: asyncio.Queue, cancel: threading.Event, request: Request):
        """Before answering 200 to a streaming request, wait for its first event, so that a swarm
        without capacity still gets a proper error status instead of a broken stream."""
        disconnect = asyncio.create_task(_wait_disconnect(request))
        getter = asyncio.create_task(events.get())
        try:
            done, _ = await asyncio.wait({getter, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                cancel.set()
                raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the request; its session was cancelled")
        finally:
            disconnect.cancel()
        kind, value = getter.result()
        if kind == "error":
            raise _api_error(value)
        return kind, value

    async def completions(self, request: Request, body: CompletionRequest):
        user = self._user(request)
        adapter = self._check_model(body.model)
        prompt_ids = list(self.tokenizer(body.prompt)["input_ids"])
        params = self._params(body, prompt_ids)
        rid, created = "cmpl-" + uuid.uuid4().hex, now_s()
        events, cancel = await self._start(user, prompt_ids, params, adapter)
        if not body.stream:
            r = await self._collect(request, events, cancel)
            return completion_body(rid, body.model, created, r.text, r.finish_reason,
                                   usage(len(prompt_ids), r.completion_tokens))
        first = await self._first_event(events, cancel, request)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def final(r: GenerationResult):
            yield completion_body(rid, body.model, created, "", r.finish_reason, None)
            if include_usage:
                yield {**completion_body(rid, body.model, created, "", None, usage(len(prompt_ids), r.completion_tokens)),
                       "choices": []}

        return self._stream(events, cancel, first, lambda t: completion_body(rid, body.model, created, t, None, None),
                            final)

    async def chat(self, request: Request, body: ChatRequest):
        user = self._user(request)
        adapter = self._check_model(body.model)
        prompt_ids = self._chat_prompt(body)
        params = self._params(body, prompt_ids)
        rid, created = "chatcmpl-" + uuid.uuid4().hex, now_s()
        events, cancel = await self._start(user, prompt_ids, params, adapter)
        if not body.stream:
            r = await self._collect(request, events, cancel)
            return chat_body(rid, body.model, created, r.text, r.finish_reason, usage(len(prompt_ids), r.completion_tokens))
        first = await self._first_event(events, cancel, request)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        role_sent = [False]

        def chunk(text: str):
            delta = {"content": text} if role_sent[0] else {"role": "assistant", "content": text}
            role_sent[0] = True
            return chat_chunk(rid, body.model, created, delta, None)

        def final(r: GenerationResult):
            if not role_sent[0]:
                yield chunk("")
            yield chat_chunk(rid, body.model, created, {}, r.finish_reason)
            if include_usage:
                yield chat_chunk(rid, body.model, created, {}, None, usage(len(prompt_ids), r.completion_tokens),
                                 with_choice=False)

        return self._stream(events, cancel, first, chunk, final)

    # -- the app -------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="petals-chain OpenAI-compatible gateway", docs_url=None, redoc_url=None)
        gw = self

        app.add_middleware(_CountRequests, metrics=self.metrics)

        @app.exception_handler(APIError)
        async def api_error(_, e: APIError):
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(_, e: RequestValidationError):
            err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            msg = err.get("msg", "invalid request")
            where = f" ('{'.'.join(loc)}')" if loc else ""
            return JSONResponse(APIError(400, f"{msg}{where}", param=".".join(loc) or None).body(), status_code=400)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_, e: StarletteHTTPException):
            return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

        @app.get("/health")
        async def health():
            return {"status": "ok", "model": gw.config.model_name, "active_sessions": gw.metrics.active_sessions,
                    "waiting_requests": gw.metrics.waiting, "max_concurrent": gw.config.max_concurrent}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(gw.metrics.render(), media_type="text/plain; version=0.0.4")

        @app.get("/v1/models")
        async def models(request: Request):
            gw._user(request)
            return {"object": "list", "data": [gw._model_card(n) for n in gw._model_names()]}

        @app.get("/v1/models/{name}")
        async def model(name: str, request: Request):
            gw._user(request)
            gw._check_model(name)
            return gw._model_card(name)

        @app.post("/v1/completions")
        async def completions(request: Request, body: CompletionRequest):
            return await gw.completions(request, body)

        @app.post("/v1/chat/completions")
        async def chat(request: Request, body: ChatRequest):
            return await gw.chat(request, body)

        return app

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "petals-chain"}

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class _CountRequests:
    """Pure ASGI middleware counting requests by path and status (BaseHTTPMiddleware would wrap
    streaming responses and blur disconnect detection)."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            self.metrics.request(path if path in KNOWN_PATHS else "other", status[0])


KNOWN_PATHS = frozenset({"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _api_error(error: BaseException) -> APIError:
    """A session's failure as the HTTP error the client gets."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, InvalidRequestError):
        return APIError(400, str(error))
    if isinstance(error, PetalsChainError):  # no chain, queue timeout, servers gone, out of cache
        return APIError(UNAVAILABLE_STATUS, f"the swarm cannot serve the request now: {error}", type="server_error",
                        code=error.code)
    return APIError(500, f"internal error in the gateway: {type(error).__name__}: {error}", type="server_error")
