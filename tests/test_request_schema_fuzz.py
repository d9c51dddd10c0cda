"""Property tests of the request schema (hypothesis; fixed examples and derandomised, so CI is fast
and reproducible): any body, valid-looking or not, becomes either a runnable request or a 400 that
names a field of the client's JSON; never another exception. In process over the whole preparation
path (decode, validate, tokenise, chat template, sampling parameters), then over HTTP against a
real server, where any answer but 200 must be OpenAI's error body and /health must stay up."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dspark_trt import LLM
from dspark_trt.serving.protocol import ChatCompletionRequest, CompletionRequest
from dspark_trt.serving.server import HTTPError, Server
from servers import ServerProcess

CONTEXT = 64  # every valid request generates a few tokens at most: the HTTP property stays fast
MODEL = "fuzz-model"

# Every text, lone surrogates included (hypothesis leaves them out by default).
texts = st.text(alphabet=st.characters(exclude_categories=()), max_size=12)
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.integers(min_value=-3, max_value=70) | st.floats() | texts)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=10)

FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"]) | json_values},
                              optional={"text": texts | json_values, "image_url": json_values})
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]) | json_values},
    optional={"content": texts | st.lists(parts | json_values, max_size=3) | json_values,
              "name": texts | json_values, "extra": json_values}), max_size=3)


@st.composite
def bodies(draw) -> tuple[bool, object]:
    """(chat?, a JSON value): mostly a valid request with a few fields replaced, added or removed."""
    chat = draw(st.booleans())
    if draw(st.integers(0, 9)) == 0:  # now and then anything at all
        return chat, draw(json_values)
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"})
    # The served multi-choice and logprobs fields, often at values that run (so that their answers,
    # not only their refusals, are exercised); prompt lists of text and of ids.
    body.update(draw(st.fixed_dictionaries({}, optional={
        "n": st.integers(0, 3), "logprobs": st.booleans() | st.integers(0, 3), "top_logprobs": st.integers(0, 3),
        "echo": st.booleans(), "max_tokens": st.integers(0, 2), "stream": st.booleans(),
        "prompt": st.lists(st.sampled_from(["Hi", "a b", ""]) | st.lists(st.integers(0, 40), max_size=3),
                           max_size=3)})))
    body.update(draw(st.dictionaries(st.sampled_from(FIELDS) | texts, json_values, max_size=3)))
    if chat and draw(st.booleans()):
        body["messages"] = draw(messages)
    for field in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        del body[field]
    return chat, body


def encode(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # NaN and lone surrogates go out as written


FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def tiny_short(tiny_factory):
    return tiny_factory("llama", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def prepare(tiny_short):
    """The server's preparation step (what runs in its worker thread), in process."""
    server = Server(LLM(target=tiny_short, max_batch_size=1), MODEL)
    return server._prepare, server.llm.engine


KNOWN_KEYS = set(FIELDS) | {"role", "content", "name", "type", "text", "include_usage"}


def assert_names_a_field(param, body) -> None:
    """`param` is a path into the client's JSON; only its last step may be a key that is not there
    (a missing field we know, or the client's unknown one)."""
    if param is None:
        return
    node, parts = body, param.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:  # the rest is one key (the client's keys may hold dots)
            rest = ".".join(parts[i:])
            assert (isinstance(node, dict) and rest in node) or rest in KNOWN_KEYS, (param, body)
            return


@settings(FUZZ, max_examples=400)
@given(case=bodies())
def test_any_body_is_a_runnable_request_or_a_400(prepare, case):
    run, engine = prepare
    chat, body = case
    try:
        prepared = run(encode(body), chat)
    except HTTPError as e:
        assert e.status == 400 and str(e)
        assert_names_a_field(e.param, body)
        return
    assert prepared.body.model == MODEL and prepared.choices
    assert [choice.index for choice in prepared.choices] == list(range(len(prepared.choices)))
    for choice in prepared.choices:
        params, prompt_ids = choice.params, choice.prompt_ids
        if params is None:  # echo alone (max_tokens 0, no logprobs): answered with the prompt, nothing runs
            assert not chat and body.get("echo") is True and body.get("max_tokens") == 0 and not body.get("logprobs")
            assert prompt_ids
            continue
        assert prompt_ids and len(prompt_ids) + params.max_tokens <= engine.context_length
        assert params.max_tokens >= 1 or (not chat and body.get("echo") is True)
        assert all(0 <= t < engine.target.config.vocab_size for t in prompt_ids)


@settings(FUZZ, max_examples=150)
@given(raw=st.binary(max_size=64) | texts.map(lambda text: text.encode("utf-8", "surrogatepass")))
def test_any_bytes_are_a_request_or_a_400(prepare, raw):
    run, _ = prepare
    try:
        run(raw, False)
    except HTTPError as e:
        assert e.status == 400


@pytest.fixture(scope="module")
def server(tiny_short):
    process = ServerProcess("--target", str(tiny_short), "--drafter", "none", "--served-model-name", MODEL,
                            "--max-batch-size", "2")
    yield process
    process.stop()


@settings(FUZZ, max_examples=60)
@given(case=bodies(), compressed=st.booleans())
def test_any_body_over_http_is_a_200_or_an_openai_400(server, case, compressed):
    chat, body = case
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"content-type": "application/json"}
    raw = encode(body)
    if compressed:  # sent gzip-encoded: the same answer as sent plain
        raw, headers["content-encoding"] = gzip.compress(raw), "gzip"
    response = httpx.post(f"{server.url}{path}", content=raw, timeout=30, headers=headers)
    if response.status_code == 200:
        if body.get("stream") is True:
            assert response.text.endswith("data: [DONE]\n\n")
        else:
            choices = response.json()["choices"]
            assert len(choices) >= 1 and sorted(c["index"] for c in choices) == list(range(len(choices)))
            if body.get("logprobs") not in (None, False):  # asked for: there, one entry per token at least
                assert all(c["logprobs"] is not None for c in choices)
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health", timeout=1).status_code == 200
