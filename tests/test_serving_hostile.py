"""The server under hostile clients (issue 17), as a real subprocess on 127.0.0.1: every class of bad
request gets a 4xx with OpenAI's error body (or the correct 200) and `/health` answers within a
second after each; exact admission (max_batch_size running + max_queue waiting, the rest 429);
clients that leave a non-streaming request free its slot within a step; big bodies are refused
without stalling anyone. The roots (sampler, admission rule, chat template `name`) are also
checked in process, where a failure says more."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from dspark_trt import LLM
from dspark_trt.errors import InvalidRequestError
from dspark_trt.runtime.engine_thread import EngineThread, QueueFullError
from dspark_trt.runtime.sampling import GREEDY_BELOW, SamplingParams, sample, target_probs
from dspark_trt.serving.protocol import ChatCompletionRequest, parse_request
from dspark_trt.serving.server import HTTPError, Server
from servers import ServerProcess

MAX_BATCH, MAX_QUEUE = 2, 2
CONTEXT = 2048
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def tiny_long(tiny_factory) -> Path:
    return tiny_factory("llama", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(tiny_long):
    process = ServerProcess("--target", str(tiny_long), "--drafter", "none", "--max-batch-size", str(MAX_BATCH),
                            "--max-queue", str(MAX_QUEUE))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def assert_openai_error(response: httpx.Response, status: int, param=None, fragment: str = "") -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS, body
    if param is not None:
        assert body["error"]["param"] == param, body
    assert fragment in body["error"]["message"], body
    return body["error"]


def assert_healthy(server) -> None:
    start = time.perf_counter()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert time.perf_counter() - start < 1.0


def wait_idle(server, timeout: float = 30.0) -> float:
    """Seconds until no KV slot is in use (the request freed its slot)."""
    start = time.perf_counter()
    while server.metric("vllm:kv_cache_usage_perc") > 0 and time.perf_counter() - start < timeout:
        time.sleep(0.02)
    return time.perf_counter() - start


# ---- the roots, in process ---------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-38, 1e-20, GREEDY_BELOW / 2, GREEDY_BELOW, 1e-3, 0.7,
                                         2.0, 1e30])
def test_every_temperature_gives_a_valid_distribution(temperature):
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)) * 20
    params = SamplingParams(temperature=temperature, seed=0)
    probs = target_probs(logits, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    if temperature < GREEDY_BELOW:  # greedy: the argmax, never the last vocabulary id
        assert params.greedy and probs.argmax(-1).tolist() == logits.argmax(-1).tolist()
        assert sample(probs[0], params.make_generator()) == int(logits[0].argmax())


@pytest.mark.parametrize("bad", [dict(temperature=float("inf")), dict(temperature=float("nan")),
                                 dict(seed=2**64), dict(seed=-(2**63) - 1), dict(seed=True)])
def test_out_of_range_sampling_params_are_invalid_requests(bad):
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(**bad)
    assert raised.value.param == next(iter(bad))


def test_64_bit_seeds_at_both_ends_work():
    for seed in (-(2**63), 2**64 - 1):
        SamplingParams(seed=seed).make_generator()


@pytest.fixture(scope="module")
def tiny_llm(tiny_long):
    return LLM(target=tiny_long, max_batch_size=MAX_BATCH)


def test_admission_counts_every_unfinished_request_once(tiny_llm):
    """Not started, so nothing leaves the inbox: exactly slots + queue are admitted (the old rule
    counted the inbox as waiting and took it off the free slots as well)."""
    thread = EngineThread(tiny_llm.engine, max_queue=MAX_QUEUE)
    params = SamplingParams(max_tokens=4)
    for _ in range(MAX_BATCH + MAX_QUEUE):
        thread.submit([1, 2, 3], params, lambda delta: None)
    with pytest.raises(QueueFullError, match="2 requests running and 2 waiting"):
        thread.submit([1, 2, 3], params, lambda delta: None)
    thread.start()
    thread.shutdown(drain=False, timeout=30)
    assert thread.num_unfinished == 0


def test_a_requests_choices_are_admitted_all_or_none(tiny_llm):
    """n choices that do not all fit are refused together: nothing is left running for a 429."""
    thread = EngineThread(tiny_llm.engine, max_queue=MAX_QUEUE)
    params = SamplingParams(max_tokens=4)
    thread.submit([1, 2, 3], params, lambda delta: None)
    room = MAX_BATCH + MAX_QUEUE - 1
    with pytest.raises(QueueFullError):
        thread.submit_all([([1, 2, 3], params, lambda delta: None)] * (room + 1))
    assert thread.num_unfinished == 1  # none of them was queued
    assert len(thread.submit_all([([1, 2, 3], params, lambda delta: None)] * room)) == room
    thread.start()
    thread.shutdown(drain=False, timeout=30)
    assert thread.num_unfinished == 0


def test_a_message_name_reaches_a_template_that_uses_it(tiny_llm):
    server = Server(tiny_llm, "tiny")
    body = parse_request(ChatCompletionRequest, {"model": "tiny", "messages": [
        {"role": "user", "content": "hi", "name": "ada"}]})
    with pytest.raises(HTTPError) as raised:  # SmolLM2's template has no place for it
        server._prepare(json.dumps(body.model_dump(exclude_none=True)).encode(), chat=True)
    assert raised.value.status == 400 and raised.value.param == "messages.0.name"
    tokenizer = tiny_llm.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }})"
                               "{% endif %}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    try:
        ids = server._chat_prompt(body)
    finally:
        tokenizer.chat_template = original
    assert "(ada)" in tokenizer.decode(ids)


def test_a_bug_of_ours_is_a_500_with_openai_body(tiny_llm, monkeypatch):
    from starlette.testclient import TestClient

    server = Server(tiny_llm, "tiny")

    def broken(raw, chat, content_encoding=None):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server, "_prepare", broken)
    response = TestClient(server.app(), raise_server_exceptions=False).post(
        "/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "internal server error (RuntimeError)", "type": "server_error",
                                        "param": None, "code": None}


# ---- every hostile class against the real server ---------------------------------------------

def body_of(model: str, **fields) -> bytes:
    return json.dumps({"model": model, **fields}).encode()


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello"}]

# (id, path, raw body given the model name, param, message fragment); all 400s.
BAD_REQUESTS = [
    ("deep-array", COMPLETIONS, lambda m: b"[" * 100_000 + b"]" * 100_000, None, "nests deeper"),
    ("deep-object", COMPLETIONS, lambda m: body_of(m, prompt="x", tools=json.loads('{"a":' * 200 + "1" + "}" * 200)),
     "tools", "nests deeper"),
    ("deep-in-prompt", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": ' % m.encode() + b"[" * 500 + b"]" * 500
     + b"}", "prompt", "nests deeper"),
    ("huge-int-seed", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": "x", "seed": %s}' % (m.encode(), b"9" * 5000),
     None, "digits"),
    ("long-int-max-tokens", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": "x", "max_tokens": %s}'
     % (m.encode(), b"9" * 45), "max_tokens", "context length"),
    ("raw-encoded-surrogate", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": "a\xed\xa0\x80"}' % m.encode(),
     None, "not UTF-8"),
    ("utf-16-body", COMPLETIONS, lambda m: json.dumps({"model": m, "prompt": "x"}).encode("utf-16"), None,
     "not UTF-8"),
    ("seed-past-64-bits", COMPLETIONS, lambda m: body_of(m, prompt="x", seed=2**64), "seed", "64-bit"),
    ("seed-below-64-bits", COMPLETIONS, lambda m: body_of(m, prompt="x", seed=-(2**63) - 1), "seed", "64-bit"),
    ("image-part", CHAT, lambda m: body_of(m, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages.0.content.0.type", "'text'"),
    ("text-part-not-a-string", CHAT, lambda m: body_of(m, messages=[{"role": "user", "content": [
        {"type": "text", "text": 5}]}]), "messages.0.content.0.text", "string"),
    ("text-part-without-text", CHAT, lambda m: body_of(m, messages=[{"role": "user", "content": [
        {"type": "text"}]}]), "messages.0.content.0.text", "missing"),
    ("part-not-an-object", CHAT, lambda m: body_of(m, messages=[{"role": "user", "content": ["hi"]}]),
     "messages.0.content.0", ""),
    ("surrogate-prompt", COMPLETIONS, lambda m: body_of(m, prompt="a\ud800b"), "prompt", "surrogate"),
    ("surrogate-content", CHAT, lambda m: body_of(m, messages=[{"role": "user", "content": "\udfff"}]),
     "messages.0.content", "surrogate"),
    ("surrogate-key", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": "x", "\\ud83d": 1}' % m.encode(), None,
     "surrogate"),
    ("surrogate-stop", COMPLETIONS, lambda m: body_of(m, prompt="x", stop=["ok", "\ud800"]), "stop.1", "surrogate"),
    ("nan", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": "x", "temperature": NaN}' % m.encode(), None, "NaN"),
    ("infinity", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": "x", "top_p": -Infinity}' % m.encode(), None,
     "Infinity"),
    ("overflowing-float", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": "x", "temperature": 1e999}'
     % m.encode(), None, "out of range"),
    ("invalid-utf8", COMPLETIONS, lambda m: b'{"model": "%s", "prompt": "\xff\xfe"}' % m.encode(), None,
     "not UTF-8"),
    ("not-json", COMPLETIONS, lambda m: b"{model: x}", None, "not valid JSON"),
    ("empty-body", COMPLETIONS, lambda m: b"", None, "not valid JSON"),
    ("array-body", COMPLETIONS, lambda m: b"[]", None, "JSON object"),
    ("null-body", CHAT, lambda m: b"null", None, "JSON object"),
    ("temperature-above-2", COMPLETIONS, lambda m: body_of(m, prompt="x", temperature=2.5), "temperature", "<= 2"),
    ("temperature-string", COMPLETIONS, lambda m: body_of(m, prompt="x", temperature="0.5"), "temperature", "number"),
    ("max-tokens-past-context", COMPLETIONS, lambda m: body_of(m, prompt="x", max_tokens=5000), "max_tokens",
     f"context length is {CONTEXT} tokens, but 5001"),
    ("max-completion-tokens-past-context", CHAT, lambda m: body_of(m, messages=USER, max_completion_tokens=CONTEXT),
     "max_completion_tokens", f"{CONTEXT} in the completion"),
    ("max-tokens-disagree", CHAT, lambda m: body_of(m, messages=USER, max_tokens=3, max_completion_tokens=4),
     "max_completion_tokens", "disagree"),
    ("max-tokens-string", COMPLETIONS, lambda m: body_of(m, prompt="x", max_tokens="4"), "max_tokens", "integer"),
    ("max-tokens-true", COMPLETIONS, lambda m: body_of(m, prompt="x", max_tokens=True), "max_tokens", "integer"),
    ("max-tokens-float", COMPLETIONS, lambda m: body_of(m, prompt="x", max_tokens=4.0), "max_tokens", "integer"),
    ("stream-yes", COMPLETIONS, lambda m: body_of(m, prompt="x", stream="yes"), "stream", "boolean"),
    ("stream-one", CHAT, lambda m: body_of(m, messages=USER, stream=1), "stream", "boolean"),
    ("prompt-false", COMPLETIONS, lambda m: body_of(m, prompt=[False]), "prompt.0", "integer"),
    ("prompt-mixed-batch", COMPLETIONS, lambda m: body_of(m, prompt=["a", 1]), "prompt.1", "string"),
    ("prompt-batch-of-nothing", COMPLETIONS, lambda m: body_of(m, prompt=[[5], []]), "prompt.1", "empty"),
    ("prompt-nested-too-deep", COMPLETIONS, lambda m: body_of(m, prompt=[[1, [2]]]), "prompt.0.1", "integer"),
    ("prompt-id-out-of-vocab", COMPLETIONS, lambda m: body_of(m, prompt=[1, 10**12]), "prompt", "token ids"),
    ("prompt-id-negative", COMPLETIONS, lambda m: body_of(m, prompt=[-1]), "prompt", "token ids"),
    ("prompt-empty-ids", COMPLETIONS, lambda m: body_of(m, prompt=[]), "prompt", "empty"),
    ("model-not-a-string", COMPLETIONS, lambda m: json.dumps({"model": 5, "prompt": "x"}).encode(), "model",
     "string"),
    ("n-true", COMPLETIONS, lambda m: body_of(m, prompt="x", n=True), "n", "integer"),
    ("message-name", CHAT, lambda m: body_of(m, messages=[{"role": "user", "content": "hi", "name": "ada"}]),
     "messages.0.name", "name"),
    ("tool-role", CHAT, lambda m: body_of(m, messages=[{"role": "tool", "content": "x"}]), "messages.0.role", ""),
    ("content-null", CHAT, lambda m: body_of(m, messages=[{"role": "assistant", "content": None}]),
     "messages.0.content", ""),
    ("no-messages", CHAT, lambda m: body_of(m, messages=[]), "messages", "empty"),
    ("too-many-stops", COMPLETIONS, lambda m: body_of(m, prompt="x", stop=[str(i) for i in range(17)]), "stop",
     "at most 16"),
    ("stop-too-long", COMPLETIONS, lambda m: body_of(m, prompt="x", stop="s" * 257), "stop", "256"),
    ("stream-options-field", COMPLETIONS, lambda m: body_of(m, prompt="x", stream=True,
                                                            stream_options={"include_usage": True, "x": 1}),
     "stream_options.x", "unsupported field"),
    ("stream-options-without-stream", COMPLETIONS, lambda m: body_of(m, prompt="x",
                                                                     stream_options={"include_usage": True}),
     "stream_options", "stream: true"),
    ("unknown-model", COMPLETIONS, lambda m: body_of("gpt-9", prompt="x"), "model", "not served"),
]


@pytest.mark.parametrize("path, raw, param, fragment", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_hostile_request_gets_400_with_openai_body(server, model, path, raw, param, fragment):
    response = httpx.post(f"{server.url}{path}", content=raw(model), headers={"content-type": "application/json"},
                          timeout=30)
    error = assert_openai_error(response, 400, param, fragment)
    assert error["type"] == "invalid_request_error"
    assert_healthy(server)


@pytest.mark.parametrize("method, path, status", [("POST", "/v1/nope", 404), ("GET", "/v2/models", 404),
                                                  ("GET", "/v1/completions", 405), ("DELETE", "/health", 405),
                                                  ("PUT", "/v1/chat/completions", 405)])
def test_wrong_routes_get_openai_bodies(server, method, path, status):
    response = httpx.request(method, f"{server.url}{path}")
    assert_openai_error(response, status, fragment=path)
    if status == 405:
        assert response.headers["allow"]
    assert_healthy(server)


def test_tiny_temperature_is_greedy_not_garbage(server, model):
    def text(**fields):
        response = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "The sea is",
                                                                       "max_tokens": 12, **fields}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    for temperature in (1e-38, 5e-324, 1e-6):
        assert text(temperature=temperature, seed=1) == greedy
    assert_healthy(server)


@pytest.mark.parametrize("fields", [
    dict(seed=2**64 - 1), dict(seed=-(2**63)), dict(temperature=2), dict(stop=["."] * 16, top_p=1),
    dict(prompt=[5] * (CONTEXT - 3)),  # prompt + max_tokens is exactly the context
    dict(prompt="\U0001f600 caf\u00e9 \u4e2d\u6587"), dict(n=1, logprobs=None, presence_penalty=0.0, user="u"),
])
def test_edge_values_are_served(server, model, fields):
    fields = {"prompt": "x", "max_tokens": 3, **fields}
    response = httpx.post(f"{server.url}/v1/completions", json={"model": model, **fields}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert_healthy(server)


def test_openapi_documents_the_request_bodies(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    components = schema["components"]["schemas"]
    assert components["CompletionRequest"]["properties"]["temperature"]["maximum"] == 2
    assert {"ChatMessage", "TextPart", "StreamOptions"} <= set(components)


# ---- big bodies -------------------------------------------------------------------------------

def health_latency_during(server, work) -> tuple[object, float]:
    """Run `work()` while polling /health; return its result and the slowest /health answer."""
    done, latencies = threading.Event(), []

    def poll():
        while not done.is_set():
            start = time.perf_counter()
            httpx.get(f"{server.url}/health", timeout=30)
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = work()
    finally:
        done.set()
        poller.join()
    return result, max(latencies)


def test_an_8_mb_body_is_refused_with_413_and_stalls_nobody(server, model):
    raw = body_of(model, prompt="hello world " * 700_000)
    assert len(raw) > 8_000_000
    response, slowest = health_latency_during(server, lambda: httpx.post(
        f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=60))
    assert_openai_error(response, 413, fragment="2097152 bytes")
    assert slowest < 1.0

    def chunked():  # no Content-Length: counted while it arrives
        for start in range(0, len(raw), 1 << 16):
            yield raw[start : start + (1 << 16)]

    response, slowest = health_latency_during(server, lambda: httpx.post(f"{server.url}/v1/completions",
                                                                         content=chunked(), timeout=60))
    assert_openai_error(response, 413)
    assert slowest < 1.0


def test_a_long_prompt_is_tokenised_off_the_event_loop(server, model):
    """Just under the body limit: tokenising it takes a while, in a worker thread, while /health answers."""
    raw = body_of(model, prompt="hello world " * 170_000)
    response, slowest = health_latency_during(server, lambda: httpx.post(
        f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=120))
    assert_openai_error(response, 400, "prompt", f"model's context is {CONTEXT} tokens")
    assert slowest < 1.0


# ---- admission and disconnects ----------------------------------------------------------------

def test_exactly_batch_plus_queue_requests_are_admitted(server, model):
    assert wait_idle(server) < 30
    burst = MAX_BATCH + MAX_QUEUE + 3
    start = threading.Barrier(burst)
    admitted_streams_open = threading.Event()
    body = {"model": model, "prompt": "A long story:", "max_tokens": 1500, "temperature": 1.0, "stream": True}

    def send(http: httpx.Client) -> int:
        start.wait()
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            if response.status_code == 200:
                admitted_streams_open.wait(60)  # hold the slot until every answer is in
            return response.status_code

    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=burst)) as http, \
            ThreadPoolExecutor(burst) as pool:
        futures = [pool.submit(send, http) for _ in range(burst)]
        deadline = time.time() + 60
        while sum(f.done() for f in futures) < burst - MAX_BATCH - MAX_QUEUE and time.time() < deadline:
            time.sleep(0.05)
        refused_early = [f.result() for f in futures if f.done()]
        admitted_streams_open.set()
        statuses = sorted(f.result() for f in futures)
    assert refused_early == [429] * (burst - MAX_BATCH - MAX_QUEUE)
    assert statuses == [200] * (MAX_BATCH + MAX_QUEUE) + [429] * (burst - MAX_BATCH - MAX_QUEUE)
    assert wait_idle(server) < 5  # the closed streams were cancelled
    assert_healthy(server)


@pytest.mark.parametrize("path, fields", [(COMPLETIONS, {"prompt": "Tell a very long story"}),
                                          (CHAT, {"messages": [{"role": "user", "content": "A long story, please"}]})])
def test_a_non_streaming_client_that_leaves_is_cancelled(server, model, path, fields):
    assert wait_idle(server) < 30
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    completed = server.metric("vllm:request_success_total", finished_reason="length")
    with pytest.raises(httpx.TimeoutException):  # 1900 tokens take seconds; the client leaves at 0.5 s
        httpx.post(f"{server.url}{path}", json={"model": model, "max_tokens": 1900, "temperature": 1.0, **fields},
                   timeout=0.5)
    assert wait_idle(server) < 1.0
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert server.metric("vllm:request_success_total", finished_reason="length") == completed
    assert_healthy(server)


def test_no_tracebacks_in_the_server_log(server):
    """Everything above was an expected refusal: nothing escaped as an exception."""
    log = server.log_path.read_text()
    assert "Traceback" not in log and "Exception" not in log, log[-3000:]
