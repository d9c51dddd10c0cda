"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one in-flight batch.

    GET  /health               200 while serving, 503 while draining (public)
    GET  /metrics              Prometheus text (public; see metrics.py)
    GET  /v1/models
    POST /v1/completions       prompt -> text; `stream: true` sends server-sent events
    POST /v1/chat/completions  messages -> reply (the target's chat template)

Every request goes to one `EngineThread`, so concurrent HTTP requests share each target step.
A client that disconnects, streaming or not, has its request cancelled (its KV slot is freed at
the next step). The event loop only moves bytes: decoding, validation and tokenisation run in a
worker thread, so a big or slow request never holds up `/health` or other clients' tokens.

Every error is OpenAI's error body, whatever raised it: 400 for bad input (protocol.py says
what is refused, and why), 401 for a bad key, 404/405 for a wrong route or method, 413 for a
body over `max_body_bytes`, 429 when every slot runs a request and `max_queue` more wait, 503
while draining (both with Retry-After), 500 for our own bugs. SIGTERM stops accepting
connections, lets in-flight requests finish, then stops the engine.

Responses carry OpenAI's `usage`, plus a `dspark` object with the request's speculative
statistics (steps, draft and accepted tokens, acceptance length tau).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as RouteError
from starlette.requests import ClientDisconnect

from dspark_trt.errors import DsparkError, InvalidRequestError
from dspark_trt.runtime.engine_thread import EngineThread, QueueFullError, ShuttingDownError, StreamDelta
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.sampling import SamplingParams
from dspark_trt.serving.metrics import ServerMetrics
from dspark_trt.serving.protocol import (DEFAULT_MAX_BODY_BYTES, ChatCompletionRequest, CompletionRequest,
                                         decode_body, error_body, parse_request)

PUBLIC_PATHS = ("/health", "/metrics")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.error_type, self.param, self.code, self.headers = status, error_type, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), self.error_type, self.param, self.code), self.status,
                            headers=self.headers)


def speculative_stats(metrics: dict) -> dict:
    steps = metrics.get("num_steps", 0)
    return {"num_steps": steps, "num_draft_tokens": metrics.get("num_draft_tokens", 0),
            "num_accepted_tokens": metrics.get("num_accepted_tokens", 0),
            "accept_length": metrics.get("accept_length", 1.0),
            "mean_verify_budget": metrics.get("num_draft_tokens", 0) / steps if steps else 0.0}


def usage_of(metrics: dict) -> dict:
    prompt, completion = metrics.get("prompt_tokens", 0), metrics.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Server:
    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None, max_queue: int | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.engine_thread = EngineThread(llm.engine, max_queue=max_queue)
        self.metrics = ServerMetrics(self.engine_thread, model_name)
        self.engine_thread.on_step = self._observe_step

    def _observe_step(self, stats) -> None:
        if stats.num_decoding:
            self.metrics.verify_budget_per_step.observe(stats.verify_budget)

    # ---- the app ----------------------------------------------------------------------------

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self.engine_thread.start()
            yield
            # uvicorn has already waited for open connections; stop the engine cleanly.
            await asyncio.to_thread(self.engine_thread.shutdown, True, 30.0)

        app = FastAPI(title="dspark-trt", lifespan=lifespan, docs_url=None, redoc_url=None)

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            if self.api_key is not None and request.url.path not in PUBLIC_PATHS:
                header = request.headers.get("authorization", "")
                scheme, _, token = header.partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                    return HTTPError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     "authentication_error", code="invalid_api_key").response()
            return await call_next(request)  # route errors: the HTTPError handler below

        @app.exception_handler(HTTPError)
        async def http_error(request: Request, exc: HTTPError):
            return exc.response()

        @app.exception_handler(RouteError)
        async def route_error(request: Request, exc: RouteError):  # unknown path, wrong method
            where = f"{request.method} {request.url.path}"
            message = {404: f"invalid URL ({where})", 405: f"method not allowed ({where})"}.get(
                exc.status_code, f"{exc.detail} ({where})")
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            return HTTPError(exc.status_code, message, code=code, headers=exc.headers).response()

        @app.exception_handler(Exception)
        async def server_error(request: Request, exc: Exception):  # a bug of ours: still OpenAI's body
            return HTTPError(500, f"internal server error ({type(exc).__name__})", "server_error").response()

        @app.get("/health")
        async def health():
            if self.engine_thread.draining:
                return JSONResponse({"status": "draining"}, 503)
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "dspark-trt"}]}

        @app.post("/v1/completions", openapi_extra=request_body_schema(CompletionRequest))
        async def completions(request: Request):
            return await self._serve(request, chat=False)

        @app.post("/v1/chat/completions", openapi_extra=request_body_schema(ChatCompletionRequest))
        async def chat_completions(request: Request):
            return await self._serve(request, chat=True)

        app.openapi = lambda: openapi_with_request_models(app)
        return app

    # ---- requests ---------------------------------------------------------------------------

    async def _serve(self, request: Request, chat: bool):
        raw = await self._read_body(request)
        # Off the event loop: decoding a 2 MB body or tokenising a long prompt takes a while.
        body, prompt_ids, params = await run_in_threadpool(self._prepare, raw, chat)
        return await self._respond(request, body, prompt_ids, params, chat)

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed `max_body_bytes` (from
        Content-Length before reading a byte; counted while reading a chunked one)."""
        too_large = HTTPError(413, f"the request body is larger than this server's limit of {self.max_body_bytes} "
                                   "bytes (serve --max-body-bytes)", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:  # gone before it finished sending: nobody to answer
            raise HTTPError(499, "client disconnected") from None
        return b"".join(chunks)

    def _prepare(self, raw: bytes, chat: bool):
        """Body bytes -> (validated request, prompt token ids, sampling parameters); HTTPError 400
        for anything wrong with them. Runs in a worker thread."""
        try:
            body = parse_request(ChatCompletionRequest if chat else CompletionRequest, decode_body(raw))
        except InvalidRequestError as e:
            raise HTTPError(400, str(e), param=e.param) from None
        if body.model != self.model_name:
            raise HTTPError(400, f"model {body.model!r} is not served here; this server serves {self.model_name!r}",
                            param="model", code="model_not_found")
        try:
            prompt_ids = self._chat_prompt(body) if chat else self.llm.encode(body.prompt)
            self.llm.engine.check_prompt(prompt_ids)
            return body, prompt_ids, self._sampling_params(body, prompt_ids, chat)
        except InvalidRequestError as e:
            raise HTTPError(400, str(e), param=e.param) from None

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The chat template's token ids. A message's `name` goes to the template; where the template
        has no place for it (it renders the same without), it is a 400 rather than dropped."""
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        named = [{**message, "name": m.name} if m.name is not None else message
                 for message, m in zip(messages, body.messages)]
        # A template that refuses a conversation (roles out of order, ...) is an InvalidRequestError
        # from the LLM's render_chat, so a 400 like any other.
        if named != messages and getattr(self.llm.tokenizer, "chat_template", None):
            if self.llm.render_chat(named) == self.llm.render_chat(messages):
                first = next(i for i, m in enumerate(body.messages) if m.name is not None)
                raise InvalidRequestError(f"the chat template of {self.model_name} has no place for a message's "
                                          "name, so it would be ignored; leave it out", f"messages.{first}.name")
            messages = named
        return self.llm.encode_chat(messages)

    def _sampling_params(self, body, prompt_ids: list[int], chat: bool) -> SamplingParams:
        context = self.llm.engine.context_length
        max_tokens = body.output_limit
        if max_tokens is None:
            max_tokens = max(context - len(prompt_ids), 1)
        elif len(prompt_ids) + max_tokens > context:  # vLLM's and OpenAI's answer, not a silent cap
            what = "messages" if chat else "prompt"
            raise InvalidRequestError(
                f"this model's maximum context length is {context} tokens, but {len(prompt_ids) + max_tokens} "
                f"were requested ({len(prompt_ids)} in the {what}, {max_tokens} in the completion); reduce the "
                f"length of the {what} or {body.output_limit_field}", body.output_limit_field)
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              seed=body.seed, stop=body.stop_list)

    async def _respond(self, request: Request, body, prompt_ids: list[int], params: SamplingParams, chat: bool):
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[StreamDelta] = asyncio.Queue()
        arrival = time.perf_counter()
        try:
            request_id = self.engine_thread.submit(prompt_ids, params,
                                                   lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d))
        except InvalidRequestError as e:
            raise HTTPError(400, str(e), param=e.param) from None
        except QueueFullError as e:
            raise HTTPError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except ShuttingDownError as e:
            raise HTTPError(503, str(e), "service_unavailable", headers={"Retry-After": "5"}) from None
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        timer = _LatencyTimer(self.metrics, arrival)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._stream(deltas, request_id, response_id, chat, include_usage, timer)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._collect(request, deltas, request_id, response_id, chat, timer)

    async def _collect(self, request: Request, deltas, request_id, response_id, chat, timer):
        # Watch for the client leaving while we wait: tokens keep arriving every step, so only a
        # listener of its own sees the disconnect in time (within a step, not at max_tokens).
        watcher = asyncio.create_task(self._cancel_on_disconnect(request, request_id))
        pieces = []
        try:
            while True:
                delta = await deltas.get()
                timer.observe(delta)
                pieces.append(delta.text)
                if delta.finished:
                    break
        finally:
            watcher.cancel()
        if delta.finish_reason == "abort":  # cancelled: the client has gone (or the server is stopping)
            return JSONResponse(error_body("client disconnected"), 499)
        if delta.finish_reason == "error":
            raise HTTPError(500, f"generation failed: {delta.error}", "server_error")
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": delta.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": response_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": [choice],
                "usage": usage_of(delta.metrics), "dspark": speculative_stats(delta.metrics)}

    async def _stream(self, deltas, request_id, response_id, chat, include_usage, timer):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish_reason: str | None, first: bool = False, **extra) -> str:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
            payload = {"id": response_id, "object": kind, "created": created, "model": self.model_name,
                       "choices": [choice], **extra}
            return f"data: {json.dumps(payload)}\n\n"

        finished = False
        first = True
        try:
            while not finished:
                delta = await deltas.get()
                timer.observe(delta)
                finished = delta.finished
                if delta.finish_reason == "error":
                    yield f"data: {json.dumps(error_body(f'generation failed: {delta.error}', 'server_error'))}\n\n"
                    break
                if not (delta.text or finished or first):
                    continue
                stats = {"num_tokens": len(delta.token_ids)}  # lets clients time each token (bench ITL)
                if finished:
                    stats.update(speculative_stats(delta.metrics))
                extra = {"dspark": stats}
                yield chunk(delta.text, delta.finish_reason if finished else None, first, **extra)
                first = False
                if finished and include_usage:
                    payload = {"id": response_id, "object": kind, "created": created, "model": self.model_name,
                               "choices": [], "usage": usage_of(delta.metrics)}
                    yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the stream broke): free the request's memory
                self.engine_thread.cancel(request_id)


    async def _cancel_on_disconnect(self, request: Request, request_id: str) -> None:
        # The body has been read, so the next ASGI message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.engine_thread.cancel(request_id)


def request_body_schema(model) -> dict:
    """OpenAPI `requestBody` of a route that parses its own body with `model` (see protocol.py)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def openapi_with_request_models(app: FastAPI) -> dict:
    """FastAPI's schema plus the request models the routes name (they validate bodies themselves,
    so that refusals are OpenAI's errors, not FastAPI's), for clients and schema fuzzers."""
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatCompletionRequest):
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model_schema.pop("$defs", {}))
            components[model.__name__] = model_schema
        app.openapi_schema = schema
    return app.openapi_schema


class _LatencyTimer:
    """Time to first token, inter-token latency and end-to-end latency of one request."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.last: float | None = None

    def observe(self, delta: StreamDelta) -> None:
        now = time.perf_counter()
        if delta.token_ids:
            if self.last is None:
                self.metrics.time_to_first_token.observe(now - self.arrival)
            else:
                gap = (now - self.last) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.metrics.inter_token_latency.observe(gap)
            self.last = now
        if delta.finished:
            self.metrics.e2e_latency.observe(now - self.arrival)


def run_server(llm: LLM, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               max_queue: int | None = None, model_name: str | None = None, log_level: str = "info",
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Serve until SIGTERM/SIGINT; then drain in-flight requests and stop."""
    import uvicorn

    server = Server(llm, model_name or llm.target.name, api_key=api_key, max_queue=max_queue,
                    max_body_bytes=max_body_bytes)
    config = uvicorn.Config(server.app(), host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=None)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Refuse new work at once (503 on kept-alive connections); uvicorn stops accepting
            # connections and waits for the open ones, the engine finishes what runs.
            server.engine_thread.refuse_new()
            super().handle_exit(sig, frame)

    try:
        DrainingServer(config).run()
    except OSError as e:
        raise DsparkError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
