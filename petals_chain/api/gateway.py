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
import logging
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from petals_chain.api import chat_page, ollama, tools
from petals_chain.api.admission import (
    AdmissionQueue,
    CapacityError,
    make_admission_policy,
)
from petals_chain.api.engine import (
    GenerationResult,
    SamplingParams,
    TokenLogprob,
    run_generation,
)
from petals_chain.api.metrics import CONTENT_TYPE, GatewayMetrics
from petals_chain.api.openai_schema import (
    APIError,
    ChatRequest,
    CompletionRequest,
    UnsupportedFieldError,
    api_error_of,
    chat_body,
    chat_choice,
    chat_chunk,
    chat_delta,
    completion_body,
    completion_choice,
    now_s,
    served_by,
    usage,
)

logger = logging.getLogger(__name__)

# The client hung up before the answer: nobody reads this reply, but the request ends cleanly and
# is counted under nginx's "client closed request" status.
CLIENT_CLOSED_REQUEST = 499
# A client's X-Request-Id goes into session ids and log lines: keep it short and plain.
REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
# /ready asks the DHT at most this often (probes come every few seconds from every replica's orchestrator)
READY_CACHE_S = 1.0


@dataclass
class GatewayConfig:
    model_name: str
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> user label (the unit of fairness)
    max_concurrent: int = 8
    queue_timeout_s: float = 60.0
    max_length: int = 2048  # prompt + completion tokens of one session
    admission: str = "fifo"
    adapters: list[str] = field(default_factory=list)  # LoRA adapters offered as models named 'MODEL:ADAPTER'
    prompt_lookup_tokens: int = 0  # --speculative ngram:K (0: off)
    prompt_lookup_schedule: str = "adaptive"  # --speculative-schedule
    chat_page: bool = True  # the chat page at / (--no-chat-page: off)


class Gateway:
    def __init__(self, model, tokenizer, config: GatewayConfig, metrics: GatewayMetrics | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or GatewayMetrics(config.model_name)
        if getattr(model, "head", None) is not None:
            self.metrics.watch_client_head(model.head)
        self.queue = AdmissionQueue(config.max_concurrent, make_admission_policy(config.admission))
        self.executor = ThreadPoolExecutor(max_workers=config.max_concurrent, thread_name_prefix="api-session")
        self._ready: tuple[float, str | None] | None = None  # (when checked, reason or None)
        self.app = self._build_app()

    # -- request handling ------------------------------------------------------------------
    def _user(self, request: Request) -> str:
        if not self.config.api_keys:
            return "anonymous"
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        user = self.config.api_keys.get(key)
        if user is None:
            raise APIError(
                401,
                "Incorrect API key provided: pass one of the gateway's --api-key values as 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )
        return user

    def _model_names(self) -> list[str]:
        return [self.config.model_name] + [f"{self.config.model_name}:{a}" for a in self.config.adapters]

    def _check_model(self, name: str) -> str | None:
        """The LoRA adapter a request's model name asks for ('MODEL:ADAPTER'), None for the base model."""
        if name not in self._model_names():
            raise APIError(
                404,
                f"The model '{name}' does not exist; this gateway serves "
                f"{', '.join(repr(n) for n in self._model_names())} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return name.partition(":")[2] or None

    def _params(self, body, prompt_ids: list[int], forced: tools.ForcedCall | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i samples with seed + i (each
        reproducible, and not n copies of one answer). `forced`: the reply must be this tool call."""
        room = self.config.max_length - len(prompt_ids)
        max_tokens = body.max_tokens if body.max_tokens is not None else room
        if room < 1 or max_tokens > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.config.max_length} tokens; the "
                f"prompt has {len(prompt_ids)} and max_tokens asks for {max_tokens}: shorten the "
                "prompt or lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if body.n > self.config.max_concurrent:
            raise APIError(
                400,
                f"n={body.n} is more than the gateway's {self.config.max_concurrent} concurrent "
                "sessions (--max-concurrent): ask for fewer choices",
                param="n",
            )
        if body.n > 1 and body.temperature == 0:
            logger.info("n=%d with temperature 0: the choices will be identical", body.n)
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k or 0, 0),
                stop=body.stop_list(),
                seed=None if body.seed is None else body.seed + i,
                top_logprobs=body.top_logprobs_count(),
                prompt_lookup_tokens=self.config.prompt_lookup_tokens,
                prompt_lookup_schedule=self.config.prompt_lookup_schedule,
                constraint=forced.constraint if forced else None,
            )
            for i in range(body.n)
        ]

    def _chat_prompt(self, body: ChatRequest) -> tuple[list[int], bool, tools.ForcedCall | None]:
        """The prompt's token ids, whether the reply is parsed for tool calls, and the call the
        reply must be (tool_choice 'required' or a named function)."""
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        messages = [tools.template_message(m) for m in body.messages]
        offered = tools.offered_tools(body)  # 400s for what the gateway cannot honour
        kwargs = {}
        if offered:
            if not tools.template_supports_tools(self.tokenizer):
                raise APIError(
                    400,
                    f"the chat template of {self.config.model_name} does not support tools (it "
                    "renders the same prompt with and without them); start the gateway with "
                    "--chat-template FILE naming a template that does, or send the request "
                    "without 'tools'",
                    param="tools",
                )
            kwargs["tools"] = offered
        forced = tools.forced_call(self.tokenizer, body) if offered else None
        return self._template_ids(messages, **kwargs), bool(offered), forced

    def _template_ids(self, messages: list[dict], **kwargs) -> list[int]:
        """The chat template's prompt for `messages` (the OpenAI and Ollama chat endpoints both)."""
        if not self.tokenizer.chat_template:
            raise APIError(
                400,
                "this model has no chat template: use /v1/completions (or /api/generate with raw=true)",
                param="messages",
            )
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, **kwargs)[
                "input_ids"
            ]
        except Exception as e:  # a template's own raise_exception (e.g. roles that must alternate)
            raise APIError(400, f"the model's chat template rejected the messages: {e}", param="messages") from None
        return list(ids)

    async def _start(
        self,
        request: Request,
        user: str,
        prompt_ids: list[int],
        params: list[SamplingParams],
        adapter: str | None = None,
        streamed: bool = True,
    ):
        """Admit each choice and start its session in a worker thread; returns (events queue of
        (choice index, kind, value), cancel flag shared by the choices). A choice's slot goes back
        when its thread is done, whatever happens to the HTTP side. `streamed`: the reply's text is
        shown as it comes (a spot check's rollback cannot take it back: engine.ShownText)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        request_id = request.state.request_id
        arrived_s = request.state.arrived_s
        for index, choice_params in enumerate(params):
            queued_s = time.perf_counter()
            self.metrics.waiting += 1
            try:
                await self.queue.acquire(user, len(prompt_ids), self.config.queue_timeout_s)
            except CapacityError as e:
                cancel.set()  # choices already running stop: the request fails as a whole
                raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded") from None
            except BaseException:
                cancel.set()
                raise
            finally:
                self.metrics.waiting -= 1
            self.metrics.queue_time.observe(time.perf_counter() - queued_s)
            self._submit(
                loop,
                events,
                cancel,
                user,
                prompt_ids,
                choice_params,
                index,
                f"{request_id}.{index}.{uuid.uuid4().hex[:8]}",
                arrived_s,
                adapter,
                streamed,
            )
        return events, cancel

    def _submit(
        self,
        loop,
        events: asyncio.Queue,
        cancel: threading.Event,
        user: str,
        prompt_ids: list[int],
        params: SamplingParams,
        index: int,
        session_id: str,
        arrived_s: float,
        adapter: str | None = None,
        streamed: bool = True,
    ) -> None:
        def work() -> GenerationResult:
            return run_generation(
                self.model,
                self.tokenizer,
                prompt_ids,
                params,
                cancel=cancel,
                session_id=session_id,
                adapter=adapter,
                streamed=streamed,
                on_text=lambda d, lp: loop.call_soon_threadsafe(events.put_nowait, (index, "text", (d, lp))),
            )

        def finished(fut) -> None:
            self.metrics.active_sessions -= 1
            result = None if fut.cancelled() or fut.exception() else fut.result()
            self.queue.release(user, len(prompt_ids), result.completion_tokens if result else 0)
            if result is None:
                error = fut.exception() if not fut.cancelled() else APIError(503, "the gateway is shutting down")
                logger.warning("session %s failed: %s", session_id, error)
                events.put_nowait((index, "error", error))
                return
            self.metrics.generation(
                prompt_tokens=len(prompt_ids),
                completion_tokens=result.completion_tokens,
                finish_reason=result.finish_reason,
                ttft_s=result.time_to_first_token_s,
                token_times_s=result.token_times_s,
                e2e_s=time.perf_counter() - arrived_s,
                hops=result.hops,
                failovers=result.failovers,
                prefix_hit_tokens=result.prefix_hit_tokens,
                drafted_tokens=result.drafted_tokens,
                accepted_draft_tokens=result.accepted_draft_tokens,
            )
            logger.info(
                "session %s (%s): %d prompt tokens (%d from prefix caches), %d generated, %s, chain %s%s",
                session_id,
                user,
                len(prompt_ids),
                result.prefix_hit_tokens,
                result.completion_tokens,
                result.finish_reason,
                result.chain,
                f", {result.verification_restarts} rollback(s) after spot-check catches"
                if result.verification_restarts
                else "",
            )
            events.put_nowait((index, "done", result))

        self.metrics.active_sessions += 1
        asyncio.wrap_future(self.executor.submit(work)).add_done_callback(finished)

    async def _next_event(self, request: Request, events: asyncio.Queue, cancel: threading.Event):
        """The next event, or a 499 (and the sessions cancelled) if the client disconnects first."""
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
        return getter.result()

    async def _collect(
        self, request: Request, events: asyncio.Queue, cancel: threading.Event, n: int
    ) -> list[GenerationResult]:
        """Wait for every choice's result; a client that disconnects meanwhile cancels the sessions."""
        results: dict[int, GenerationResult] = {}
        while len(results) < n:
            index, kind, value = await self._next_event(request, events, cancel)
            if kind == "error":
                cancel.set()
                raise api_error_of(value)
            if kind == "done":
                results[index] = value
        return [results[i] for i in range(n)]

    def _stream(self, events: asyncio.Queue, cancel: threading.Event, first, n: int, on_text, on_done, on_end):
        """Server-sent events: `on_text(index, text, logprobs)` and `on_done(index, result)` yield
        chunks for one choice, `on_end(results)` the closing ones (usage) after every choice is done."""

        async def sse():
            results: dict[int, GenerationResult] = {}
            try:
                item = first
                while True:
                    index, kind, value = item
                    if kind == "text":
                        for chunk in on_text(index, *value):
                            yield _sse(chunk)
                    elif kind == "done":
                        results[index] = value
                        for chunk in on_done(index, value):
                            yield _sse(chunk)
                        if len(results) == n:
                            for chunk in on_end([results[i] for i in range(n)]):
                                yield _sse(chunk)
                            yield "data: [DONE]\n\n"
                            return
                    else:
                        yield _sse(api_error_of(value).body())
                        return
                    item = await events.get()
            finally:  # the client went away (Starlette cancels us) or the stream ended: stop the sessions
                cancel.set()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _first_event(self, request: Request, events: asyncio.Queue, cancel: threading.Event):
        """Before answering 200 to a streaming request, wait for its first event, so that a swarm
        without capacity still gets a proper error status instead of a broken stream."""
        item = await self._next_event(request, events, cancel)
        if item[1] == "error":
            cancel.set()
            raise api_error_of(item[2])
        return item

    # -- logprobs in OpenAI's two shapes ---------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None

        def one(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries
            ],
            "refusal": None,
        }

    def _completion_logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        """Completions' legacy shape; `text_offset` counts characters of the completion from `offset`."""
        if entries is None:
            return None
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    # -- the endpoints ---------------------------------------------------------------------------
    async def completions(self, request: Request, body: CompletionRequest):
        user = self._user(request)
        adapter = self._check_model(body.model)
        prompt_ids = list(self.tokenizer(body.prompt)["input_ids"])
        params = self._params(body, prompt_ids)
        rid, created = "cmpl-" + request.state.request_id, now_s()
        events, cancel = await self._start(request, user, prompt_ids, params, adapter, streamed=bool(body.stream))
        if not body.stream:
            results = await self._collect(request, events, cancel, body.n)
            return completion_body(
                rid,
                body.model,
                created,
                [
                    {
                        **completion_choice(i, r.text, r.finish_reason, self._completion_logprobs(r.logprobs)),
                        "petals_chain": served_by(r),
                    }
                    for i, r in enumerate(results)
                ],
                _usage(len(prompt_ids), results),
            )
        first = await self._first_event(request, events, cancel)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        offsets = [0] * body.n  # per choice: characters streamed so far (logprobs' text_offset)

        def on_text(index, text, entries):
            logprobs = self._completion_logprobs(entries if body.logprobs is not None else None, offsets[index])
            offsets[index] += sum(len(t) for t in logprobs["tokens"]) if logprobs else 0
            yield completion_body(rid, body.model, created, [completion_choice(index, text, None, logprobs)], None)

        def on_done(index, r: GenerationResult):
            yield completion_body(
                rid,
                body.model,
                created,
                [{**completion_choice(index, "", r.finish_reason), "petals_chain": served_by(r)}],
                None,
            )

        def on_end(results):
            if include_usage:
                yield completion_body(rid, body.model, created, [], _usage(len(prompt_ids), results))

        return self._stream(events, cancel, first, body.n, on_text, on_done, on_end)

    async def chat(self, request: Request, body: ChatRequest):
        user = self._user(request)
        adapter = self._check_model(body.model)
        prompt_ids, with_tools, forced = self._chat_prompt(body)
        params = self._params(body, prompt_ids, forced)
        # a forced call's reply finishes as vLLM's does: "stop" for a named function, "tool_calls" for "required"
        call_finish = forced.finish_reason if forced else "tool_calls"
        rid, created = "chatcmpl-" + request.state.request_id, now_s()
        events, cancel = await self._start(request, user, prompt_ids, params, adapter, streamed=bool(body.stream))
        if not body.stream:
            results = await self._collect(request, events, cancel, body.n)
            choices = []
            for i, r in enumerate(results):
                content, calls = tools.parse_tool_calls(r.text) if with_tools else (r.text, [])
                finish = call_finish if calls else r.finish_reason
                choices.append(
                    {
                        **chat_choice(i, content, finish, self._chat_logprobs(r.logprobs), calls),
                        "petals_chain": served_by(r),
                    }
                )
            return chat_body(rid, body.model, created, choices, _usage(len(prompt_ids), results))
        first = await self._first_event(request, events, cancel)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        role_sent = [False] * body.n
        # with tools, text that may be a tool call is held back until it is known not to be one
        holders = [tools.ToolCallStream() if with_tools else None for _ in range(body.n)]

        def delta_chunk(index: int, delta: dict, finish_reason=None, logprobs=None):
            if not role_sent[index]:
                delta = {"role": "assistant", **delta}
                role_sent[index] = True
            return chat_chunk(rid, body.model, created, [chat_delta(index, delta, finish_reason, logprobs)])

        def on_text(index, text, entries):
            logprobs = self._chat_logprobs(entries if body.logprobs else None)
            if holders[index] is not None:
                text = holders[index].push(text)
            if text or logprobs:
                yield delta_chunk(index, {"content": text}, logprobs=logprobs)

        def on_done(index, r: GenerationResult):
            finish = r.finish_reason
            if holders[index] is not None:
                rest, calls = holders[index].finish()
                if rest:
                    yield delta_chunk(index, {"content": rest})
                if calls:
                    finish = call_finish
                    yield delta_chunk(index, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
            if not role_sent[index]:
                yield delta_chunk(index, {"content": ""})
            last = delta_chunk(index, {}, finish)
            last["choices"][0]["petals_chain"] = served_by(r)
            yield last

        def on_end(results):
            if include_usage:
                yield chat_chunk(rid, body.model, created, [], _usage(len(prompt_ids), results))

        return self._stream(events, cancel, first, body.n, on_text, on_done, on_end)

    async def ready(self) -> tuple[bool, str]:
        now = time.monotonic()
        if self._ready is None or now - self._ready[0] > READY_CACHE_S:
            try:
                reason = await asyncio.wait_for(asyncio.to_thread(self.model.backend.unready_reason), 15)
            except Exception as e:  # a DHT that does not answer is a reason too
                reason = f"cannot read the swarm's records: {type(e).__name__}: {e}"
            self._ready = (time.monotonic(), reason)
        reason = self._ready[1]
        return reason is None, reason or "a full chain of servers is dispatchable"

    # -- the app -------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="petals-chain OpenAI-compatible gateway", docs_url=None, redoc_url=None)
        gw = self

        app.add_middleware(_RequestContext, metrics=self.metrics)

        # errors in the shape of the API the path belongs to: OpenAI's under /v1, Ollama's under /api
        @app.exception_handler(APIError)
        async def api_error(request: Request, e: APIError):
            return JSONResponse(e.body_for(request.url.path), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, e: RequestValidationError):
            return JSONResponse(
                _validation_error(e.errors(), await request.body()).body_for(request.url.path), status_code=400
            )

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            return JSONResponse(
                APIError(e.status_code, str(e.detail)).body_for(request.url.path), status_code=e.status_code
            )

        @app.get("/health")
        async def health():
            """Liveness: the process answers (a swarm without servers is /ready's business)."""
            return {
                "status": "ok",
                "model": gw.config.model_name,
                "active_sessions": gw.metrics.active_sessions,
                "waiting_requests": gw.metrics.waiting,
                "max_concurrent": gw.config.max_concurrent,
            }

        @app.get("/ready")
        async def ready():
            """Readiness: 200 once a full chain for the model is dispatchable, else 503 with the reason."""
            ok, reason = await gw.ready()
            return JSONResponse(
                {"status": "ready" if ok else "unavailable", "model": gw.config.model_name, "reason": reason},
                status_code=200 if ok else 503,
            )

        @app.get("/metrics")
        async def metrics():
            return Response(gw.metrics.render(), media_type=CONTENT_TYPE)

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

        ollama.add_routes(app, gw)
        chat_page.add_routes(app, enabled=gw.config.chat_page, api_key_required=bool(gw.config.api_keys))
        return app

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "petals-chain"}

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class _RequestContext:
    """Pure ASGI middleware (BaseHTTPMiddleware would wrap streaming responses and blur disconnect
    detection): gives each request its id (the client's `X-Request-Id`, else a fresh one), echoed
    in the response's `X-Request-Id` and carried into the session ids the orchestrator and servers
    log; notes the arrival time (end-to-end latency); counts requests by path and status."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        request_id = given if given is not None else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["arrived_s"] = request_id, time.perf_counter()

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode("latin-1"))],
                }
            await send(message)

        try:
            if not REQUEST_ID_RE.match(request_id):
                error = APIError(
                    400,
                    "X-Request-Id must be 1 to 64 characters of letters, digits and . _ : - "
                    "(it names the request's sessions in the swarm's logs); send a shorter id",
                    param="X-Request-Id",
                )
                state["request_id"] = request_id = uuid.uuid4().hex
                return await JSONResponse(error.body_for(scope.get("path", "")), status_code=400)(
                    scope, receive, send_status
                )
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            self.metrics.request(path if path in KNOWN_PATHS else "other", status[0])


def _validation_error(errors: list[dict], raw_body: bytes) -> APIError:
    """pydantic's first complaint about a request body as OpenAI's 400, worded for a person."""
    err = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if err.get("type") == "json_invalid":
        try:
            json.loads(raw_body)
            detail = err.get("ctx", {}).get("error", "invalid JSON")
        except ValueError as e:  # json's own message names line and column
            detail = str(e)
        return APIError(
            400,
            f"the request body is not valid JSON ({detail}); send one JSON object with "
            "'Content-Type: application/json'",
        )
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return APIError(
            400,
            f"unsupported field '{param}': this gateway does not implement it; remove it from the "
            "request (the supported fields: docs/reference.md for the OpenAI API, docs/api.md for Ollama's)",
            param=param,
        )
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedFieldError):
        return APIError(400, cause.message_at(param or cause.field), param=param)
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    if err.get("type") == "missing":
        msg = "this required field is missing"
    return APIError(400, f"{msg} ('{param}')" if param else msg, param=param)


KNOWN_PATHS = frozenset(
    {
        "/health",
        "/ready",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/api/chat",
        "/api/generate",
        "/api/tags",
        "/api/show",
        "/api/version",
        *chat_page.PATHS,
    }
)


def _usage(prompt_tokens: int, results: list[GenerationResult]) -> dict:
    """A request's usage over its choices; cached tokens: what every choice's chain took from its
    prefix caches (each choice is a session of its own)."""
    return usage(
        prompt_tokens, sum(r.completion_tokens for r in results), min((r.prefix_hit_tokens for r in results), default=0)
    )


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
