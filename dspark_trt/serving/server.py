"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over one in-flight batch.

    GET  /health               200 while serving, 503 while draining (public)
    GET  /metrics              Prometheus text (public; see metrics.py)
    GET  /v1/models
    POST /v1/completions       prompt(s) -> text; `stream: true` sends server-sent events
    POST /v1/chat/completions  messages -> reply (the target's chat template)

A request becomes one choice per prompt and per `n` (at most `max_choices`), each an engine
request of its own with its own seed (`choice_seed`); their answers come back together, or
interleaved by choice index when streamed. `logprobs` are the target's (`runtime/logprobs.py`),
shaped by `openai_logprobs.py`; `echo` puts the prompt, and with logprobs its tokens' logprobs,
before each completion. A body may come gzip- or deflate-encoded (`content_encoding.py`; 415 for
another encoding).

Every request goes to one `EngineThread`, so concurrent HTTP requests share each target step.
A client that disconnects, streaming or not, has its request cancelled (its KV slot is freed at
the next step). The event loop only moves bytes: decoding, validation and tokenisation run in a
worker thread, so a big or slow request never holds up `/health` or other clients' tokens.

Every error is OpenAI's error body, whatever raised it: 400 for bad input (protocol.py says
what is refused, and why), 401 for a bad key, 404/405 for a wrong route or method, 413 for a
body over `max_body_bytes` (as sent or decoded), 415 for an unknown Content-Encoding, 429 when
every slot runs a request and `max_queue` more wait, 503 while draining (both with Retry-After),
500 for our own bugs. SIGTERM stops accepting connections, lets in-flight requests finish, then
stops the engine.

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
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as RouteError
from starlette.requests import ClientDisconnect

from dspark_trt.errors import DsparkError, InvalidRequestError
from dspark_trt.runtime.engine_thread import EngineThread, QueueFullError, ShuttingDownError, StreamDelta
from dspark_trt.runtime.llm import LLM
from dspark_trt.runtime.logprobs import TokenLogprob
from dspark_trt.runtime.request import RequestStats
from dspark_trt.runtime.sampling import SamplingParams, mixed_seed
from dspark_trt.serving.content_encoding import BodyTooLargeError, UnsupportedEncodingError, decode_content
from dspark_trt.serving.metrics import ServerMetrics
from dspark_trt.serving.openai_logprobs import LogprobFormatter, TextOffsets
from dspark_trt.serving.protocol import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CHOICES, ChatCompletionRequest,
                                         CompletionRequest, decode_body, error_body, parse_request)

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


class Server:
    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None, max_queue: int | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_choices: int = DEFAULT_MAX_CHOICES):
        self.llm = llm
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_choices = max_choices  # a request's prompts x n
        self.logprob_formatter = LogprobFormatter(llm.tokenizer)
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
        # Off the event loop: inflating or decoding a 2 MB body or tokenising long prompts takes a while.
        prepared = await run_in_threadpool(self._prepare, raw, chat, request.headers.get("content-encoding"))
        return await self._respond(request, prepared)

    async def _read_body(self, request: Request) -> bytes:
        """The body as sent, refused with 413 as soon as it is known to exceed `max_body_bytes` (from
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

    def _prepare(self, raw: bytes, chat: bool, content_encoding: str | None = None) -> PreparedRequest:
        """Body bytes -> the validated request and its choices; HTTPError 4xx for anything wrong with
        them. Runs in a worker thread."""
        try:
            body = parse_request(ChatCompletionRequest if chat else CompletionRequest,
                                 decode_body(decode_content(raw, content_encoding, self.max_body_bytes)))
        except UnsupportedEncodingError as e:
            raise HTTPError(415, str(e), code="unsupported_content_encoding") from None
        except BodyTooLargeError as e:
            raise HTTPError(413, str(e), code="request_too_large") from None
        except InvalidRequestError as e:
            raise HTTPError(400, str(e), param=e.param) from None
        if body.model != self.model_name:
            raise HTTPError(400, f"model {body.model!r} is not served here; this server serves {self.model_name!r}",
                            param="model", code="model_not_found")
        try:
            return PreparedRequest(body, chat, self._choices(body, chat))
        except InvalidRequestError as e:
            raise HTTPError(400, str(e), param=e.param) from None

    def _choices(self, body, chat: bool) -> list[ChoiceSpec]:
        """One choice per prompt and per `n`, numbered prompt by prompt (OpenAI's order)."""
        num_prompts, n = 1 if chat else len(body.prompts()), body.num_choices_per_prompt
        # Before tokenising anything: a 2 MB list of tiny prompts is refused at once.
        limits = [(self.max_choices, "generates at most {} per request (serve --max-choices)")]
        if self.engine_thread.capacity is not None:  # more could never be admitted together: not a 429
            limits.append((self.engine_thread.capacity, "runs and queues at most {} requests at once "
                                                        "(serve --max-batch-size + --max-queue)"))
        for limit, what in limits:
            if num_prompts * n > limit:
                raise InvalidRequestError(f"the request asks for {num_prompts * n} choices ({num_prompts} prompt(s) "
                                          f"x n={n}); this server {what.format(limit)}", "n" if n > 1 else "prompt")
        prompts = [(self._chat_prompt(body), "")] if chat else self._completion_prompts(body)
        return [ChoiceSpec(index=p * n + i, prompt_index=p, prompt_ids=ids, echo_text=echo,
                           params=self._sampling_params(body, ids, chat, i))
                for p, (ids, echo) in enumerate(prompts) for i in range(n)]

    def _completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str]]:
        """Each prompt's token ids, and the text echo puts before its completions ("" without echo)."""
        prompts = []
        for i, prompt in enumerate(body.prompts()):
            try:
                ids = self.llm.encode(prompt)
                self.llm.engine.check_prompt(ids)
            except InvalidRequestError as e:  # which prompt of a list
                raise InvalidRequestError(str(e), f"prompt.{i}" if body.prompt_is_list else "prompt") from None
            echo = (prompt if isinstance(prompt, str) else self.llm.tokenizer.decode(ids)) if body.echo else ""
            prompts.append((ids, echo))
        return prompts

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
        ids = self.llm.encode_chat(messages)
        self.llm.engine.check_prompt(ids)
        return ids

    def _sampling_params(self, body, prompt_ids: list[int], chat: bool, sample_index: int) -> SamplingParams | None:
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
        if chat:
            logprobs, prompt_logprobs = (body.top_logprobs or 0) if body.logprobs else None, None
        else:
            logprobs = body.logprobs
            prompt_logprobs = logprobs if body.echo else None
            if max_tokens == 0 and prompt_logprobs is None:
                return None  # echo alone: the answer is the prompt, nothing to run
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              seed=choice_seed(body.seed, sample_index), stop=body.stop_list, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)

    async def _respond(self, request: Request, prepared: PreparedRequest):
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[tuple[int, StreamDelta]] = asyncio.Queue()  # (choice index, delta)
        arrival = time.perf_counter()
        runnable = [choice for choice in prepared.choices if choice.params is not None]
        for choice in prepared.choices:
            if choice.params is None:  # nothing to run: answered as it stands
                deltas.put_nowait((choice.index, StreamDelta("", [], "", "length", {"completion_tokens": 0})))
        try:  # all of a request's choices are admitted, or none (a 429 leaves nothing running)
            submitted = self.engine_thread.submit_all([
                (choice.prompt_ids, choice.params,
                 lambda d, index=choice.index: loop.call_soon_threadsafe(deltas.put_nowait, (index, d)))
                for choice in runnable])
        except (InvalidRequestError, QueueFullError, ShuttingDownError) as e:
            raise _submit_error(e) from None
        request_ids = {choice.index: request_id for choice, request_id in zip(runnable, submitted)}
        response_id = ("chatcmpl-" if prepared.chat else "cmpl-") + uuid.uuid4().hex[:24]
        timers = {choice.index: _LatencyTimer(self.metrics, arrival) for choice in prepared.choices}
        if prepared.body.stream:
            return StreamingResponse(self._stream(prepared, deltas, request_ids, response_id, timers),
                                     media_type="text/event-stream")
        return await self._collect(request, prepared, deltas, request_ids, response_id, timers)

    async def _collect(self, request: Request, prepared: PreparedRequest, deltas, request_ids: dict[int, str],
                       response_id: str, timers: dict):
        # Watch for the client leaving while we wait: tokens keep arriving every step, so only a
        # listener of its own sees the disconnect in time (within a step, not at max_tokens).
        watcher = asyncio.create_task(self._cancel_on_disconnect(request, list(request_ids.values())))
        results = {choice.index: _ChoiceResult() for choice in prepared.choices}
        try:
            while not all(result.finish_reason for result in results.values()):
                index, delta = await deltas.get()
                timers[index].observe(delta)
                results[index].add(delta)
        finally:
            watcher.cancel()
        reasons = {result.finish_reason for result in results.values()}
        if "abort" in reasons:  # cancelled: the client has gone (or the server is stopping)
            return JSONResponse(error_body("client disconnected"), 499)
        if "error" in reasons:
            error = next(result.error for result in results.values() if result.finish_reason == "error")
            raise HTTPError(500, f"generation failed: {error}", "server_error")
        # Off the event loop: formatting logprobs of many choices and long echoed prompts takes a while.
        choices = await run_in_threadpool(lambda: [self._choice_json(prepared, spec, results[spec.index])
                                                   for spec in prepared.choices])
        metrics = [result.metrics for result in results.values()]
        return {"id": response_id, "object": "chat.completion" if prepared.chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": prepared.usage(metrics), "dspark": speculative_stats(merged_metrics(metrics))}

    def _choice_json(self, prepared: PreparedRequest, spec: ChoiceSpec, result: _ChoiceResult) -> dict:
        body, text = prepared.body, "".join(result.pieces)
        if prepared.chat:
            logprobs = self.logprob_formatter.chat(result.logprobs) if body.logprobs else None
            return {"index": spec.index, "message": {"role": "assistant", "content": text},
                    "finish_reason": result.finish_reason, "logprobs": logprobs}
        logprobs = self._completion_logprobs(prepared, spec, result.token_ids, result.logprobs,
                                             result.prompt_logprobs, TextOffsets())
        return {"index": spec.index, "text": spec.echo_text + text, "finish_reason": result.finish_reason,
                "logprobs": logprobs}

    def _completion_logprobs(self, prepared: PreparedRequest, spec: ChoiceSpec, token_ids: list[int],
                             logprobs: list[TokenLogprob], prompt_logprobs: list[TokenLogprob | None] | None,
                             offsets: TextOffsets) -> dict | None:
        """A completions choice's `logprobs` (None when not asked for); with echo, `prompt_logprobs`
        (given with the choice's first tokens) go before the generated tokens'."""
        if prepared.body.logprobs is None:
            return None
        if prepared.body.echo and prompt_logprobs is not None:
            token_ids, logprobs = spec.prompt_ids + token_ids, prompt_logprobs + logprobs
        return self.logprob_formatter.completion(token_ids, logprobs, offsets)

    async def _stream(self, prepared: PreparedRequest, deltas, request_ids: dict[int, str], response_id: str,
                      timers: dict):
        body, chat = prepared.body, prepared.chat
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        specs = {spec.index: spec for spec in prepared.choices}
        started: set[int] = set()  # choices that have sent their first chunk
        text_offsets = {index: TextOffsets() for index in specs}  # completions logprobs' text_offset, per choice
        final_metrics: dict[int, dict] = {}

        def chunk(index: int, delta: StreamDelta, text: str) -> str:
            first, finished = index not in started, delta.finished
            if chat:
                message = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                logprobs = self.logprob_formatter.chat(delta.logprobs) if body.logprobs else None
                choice = {"index": index, "delta": message, "finish_reason": delta.finish_reason, "logprobs": logprobs}
            else:
                logprobs = self._completion_logprobs(prepared, specs[index], delta.token_ids, delta.logprobs,
                                                     delta.prompt_logprobs if first else None, text_offsets[index])
                choice = {"index": index, "text": text, "finish_reason": delta.finish_reason, "logprobs": logprobs}
            stats = {"num_tokens": len(delta.token_ids)}  # lets clients time each token (bench ITL)
            if finished:
                stats.update(speculative_stats(delta.metrics))
            payload = {"id": response_id, "object": kind, "created": created, "model": self.model_name,
                       "choices": [choice], "dspark": stats}
            return f"data: {json.dumps(payload)}\n\n"

        try:
            while len(final_metrics) < len(specs):
                index, delta = await deltas.get()
                timers[index].observe(delta)
                if delta.finish_reason == "error":
                    yield f"data: {json.dumps(error_body(f'generation failed: {delta.error}', 'server_error'))}\n\n"
                    break
                if delta.finished:
                    final_metrics[index] = delta.metrics
                first = index not in started
                text = (specs[index].echo_text if first else "") + delta.text
                if not (text or delta.finished or first or delta.logprobs):
                    continue
                # Logprobs (a long echoed prompt's above all) are formatted off the event loop.
                yield await run_in_threadpool(chunk, index, delta, text) if body.logprobs else chunk(index, delta, text)
                started.add(index)
            else:
                if body.stream_options and body.stream_options.include_usage:
                    payload = {"id": response_id, "object": kind, "created": created, "model": self.model_name,
                               "choices": [], "usage": prepared.usage(list(final_metrics.values()))}
                    yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for index, request_id in request_ids.items():
                if index not in final_metrics:  # the client went away (or the stream broke): free the memory
                    self.engine_thread.cancel(request_id)

    async def _cancel_on_disconnect(self, request: Request, request_ids: list[str]) -> None:
        # The body has been read, so the next ASGI message is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for request_id in request_ids:
            self.engine_thread.cancel(request_id)


@dataclass
class ChoiceSpec:
    """One choice a request asks for: its prompt and sampling parameters."""

    index: int  # OpenAI's choice index: prompt_index * n + sample index
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams | None  # None: nothing to run (echo with max_tokens 0 and no logprobs)
    echo_text: str  # put before the completion (completions' echo), "" otherwise


@dataclass
class PreparedRequest:
    body: CompletionRequest | ChatCompletionRequest
    chat: bool
    choices: list[ChoiceSpec]

    def usage(self, metrics: list[dict]) -> dict:
        """OpenAI's usage: each prompt counted once (however many choices it has), every choice's tokens."""
        prompt = sum(len(spec.prompt_ids) for spec in {spec.prompt_index: spec for spec in self.choices}.values())
        completion = sum(m.get("completion_tokens", 0) for m in metrics if m)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class _ChoiceResult:
    """A choice's deltas gathered (non-streaming)."""

    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: dict | None = None
    error: str | None = None

    def add(self, delta: StreamDelta) -> None:
        self.pieces.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason, self.metrics, self.error = delta.finish_reason, delta.metrics, delta.error


def choice_seed(seed: int | None, sample_index: int) -> int | None:
    """The seed of a request's `sample_index`-th choice: the request's own for the first (so `n=1`
    and the first of `n=2` agree), then a 64-bit mix of it and the index, so the choices are
    independent samples and seeds s and s + 1 do not share choices."""
    # Negative indices: the per-position noise of a request uses 0, 1, 2, .., so the streams never meet.
    return seed if seed is None or sample_index == 0 else mixed_seed(seed, -sample_index)


def _submit_error(error: Exception) -> HTTPError:
    if isinstance(error, QueueFullError):
        return HTTPError(429, str(error), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(error, ShuttingDownError):
        return HTTPError(503, str(error), "service_unavailable", headers={"Retry-After": "5"})
    return HTTPError(400, str(error), param=getattr(error, "param", None))


def merged_metrics(metrics: list[dict | None]) -> dict:
    """Several choices' speculation counts as one request's (tau as `RequestStats` defines it)."""
    stats = RequestStats(**{key: sum((m or {}).get(key, 0) for m in metrics)
                            for key in ("num_steps", "num_draft_tokens", "num_accepted_tokens")})
    return {"num_steps": stats.num_steps, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "accept_length": stats.accept_length}


def request_body_schema(model) -> dict:
    """OpenAPI `requestBody` of a route that parses its own body with `model` (see protocol.py),
    and the Content-Encoding it may come in."""
    return {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "parameters": [{"name": "Content-Encoding", "in": "header", "required": False,
                            "description": "gzip, deflate or identity (several, comma-separated, in the order "
                                           "applied); --max-body-bytes applies to the decoded body; others get 415",
                            "schema": {"type": "string"}}]}


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
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_choices: int = DEFAULT_MAX_CHOICES) -> None:
    """Serve until SIGTERM/SIGINT; then drain in-flight requests and stop."""
    import uvicorn

    server = Server(llm, model_name or llm.target.name, api_key=api_key, max_queue=max_queue,
                    max_body_bytes=max_body_bytes, max_choices=max_choices)
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
