"""The OpenAI-compatible server, as a real subprocess on 127.0.0.1, driven by the `openai` client
and raw HTTP: completions and chat (plain and streamed), usage, every bad input, API keys,
cancellation freeing KV memory, queue overflow, graceful shutdown, and lossless policies."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from dspark_trt import LLM, SamplingParams
from dspark_trt.models.drafter_io import save_drafter
from dspark_trt.models.loading import load_target
from servers import ServerProcess
from tiny_drafters import make_drafter

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def tiny_long(tiny_factory) -> Path:
    """A tiny target with a long context, so a request can run long enough to be cancelled."""
    return tiny_factory("llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def drafter_dir(tiny_long, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("drafter") / "dspark"
    save_drafter(make_drafter(load_target(tiny_long)), folder)
    return folder


@pytest.fixture(scope="module")
def server(tiny_long, drafter_dir):
    process = ServerProcess("--target", str(tiny_long), "--drafter", str(drafter_dir), "--policy", "dspark",
                            "--api-key", API_KEY, "--max-batch-size", "4")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def plain_llm(tiny_long):
    return LLM(target=tiny_long)


def test_completion_and_usage_match_plain_decoding(client, model_name, plain_llm):
    prompt = "The quick brown fox"
    response = client.completions.create(model=model_name, prompt=prompt, max_tokens=20, temperature=0)
    expected = plain_llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0))[0]
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    stats = response.model_extra["dspark"]
    assert stats["num_steps"] >= 1 and stats["accept_length"] >= 1.0


def test_streamed_completion_equals_the_plain_one(client, model_name):
    kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=30, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1


def test_chat_plain_and_streamed(client, model_name, plain_llm):
    messages = [{"role": "user", "content": "Say something about the sea."}]
    response = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0)
    expected = plain_llm.chat(messages, SamplingParams(max_tokens=24, temperature=0))[0]
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids)
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_stop_strings_cut_streamed_and_plain_text_alike(client, model_name, plain_llm):
    prompt = "Once upon a time"
    free_text = plain_llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0))[0].text
    stop = free_text[len(free_text) // 2 : len(free_text) // 2 + 3]  # a stop string that does occur
    expected = plain_llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert expected.finish_reason == "stop" and stop not in expected.text
    kwargs = dict(model=model_name, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert client.completions.create(**kwargs).choices[0].text == expected.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == expected.text  # nothing of the stop string leaked out before it completed


def test_raw_sse_ends_with_done(server, model_name):
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": model_name, "prompt": "Hi", "max_tokens": 5, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_sampled_requests_with_a_seed_are_reproducible(client, model_name):
    kwargs = dict(model=model_name, prompt="Numbers:", max_tokens=16, temperature=1.0, seed=42)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "x", "temperature": -0.5}, "temperature", ">= 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"prompt": "x", "logit_bias": {"5": 3}}, "logit_bias", "unsupported"),
    ({"prompt": "x", "frobnicate": True}, "frobnicate", "unsupported field"),
    ({"prompt": "x", "n": 0}, "n", ">= 1"),
    ({"prompt": ["a", "b"], "n": 40}, "n", "at most 64"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "[0, 20]"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs", "logprobs: N"),
    ({"prompt": ["a", ""]}, "prompt.1", "empty"),
    ({"prompt": ["a", 1]}, "prompt.1", "valid string"),
    ({"max_tokens": 3}, "prompt", "missing"),
    ({"prompt": ""}, "prompt", "empty"),
])
def test_bad_completion_requests_get_400(server, model_name, body, param, fragment):
    response = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": model_name, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and fragment in error["message"]


def test_invalid_json_unknown_model_and_long_prompt(server, model_name):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}/v1/completions", headers=headers, content=b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/completions", headers=headers, json={"model": "gpt-9", "prompt": "x"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "model_not_found"
    long_prompt = list(range(10, 2100))  # token ids: longer than the 2048-token context
    response = httpx.post(f"{server.url}/v1/completions", headers=headers, json={"model": model_name, "prompt": long_prompt})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "2090 tokens" in message and "2048 tokens" in message
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=headers,
                          json={"model": model_name, "messages": [{"role": "wizard", "content": "x"}]})
    assert response.status_code == 400 and "messages" in response.json()["error"]["param"]


def test_api_key_is_enforced_except_health_and_metrics(server, model_name):
    body = {"model": model_name, "prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_metrics_use_vllm_names(server, client, model_name):
    before = {name: server.metric(name) for name in ("vllm:spec_decode_num_draft_tokens_total",
                                                     "vllm:spec_decode_num_accepted_tokens_total",
                                                     "vllm:generation_tokens_total")}
    response = client.completions.create(model=model_name, prompt="Count: 1, 2,", max_tokens=12, temperature=0)
    stats = response.model_extra["dspark"]
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "dspark:verify_budget_per_step_bucket", "dspark:policy_request_overhead_seconds",
                 "dspark:policy_token_overhead_seconds", "dspark:policy_drafter_cost_scale"):
        assert name in text, name
    # The dspark policy's learned costs: it has seen decoding steps, so the drafter scale and the
    # overheads are numbers (the overheads never negative).
    assert server.metric("dspark:policy_drafter_cost_scale") > 0
    assert server.metric("dspark:policy_request_overhead_seconds") >= 0
    assert server.metric("dspark:policy_token_overhead_seconds") >= 0
    # The counters move by exactly what the response says happened.
    assert server.metric("vllm:spec_decode_num_draft_tokens_total") - before["vllm:spec_decode_num_draft_tokens_total"] \
        == stats["num_draft_tokens"]
    assert server.metric("vllm:spec_decode_num_accepted_tokens_total") \
        - before["vllm:spec_decode_num_accepted_tokens_total"] == stats["num_accepted_tokens"]
    assert server.metric("vllm:generation_tokens_total") - before["vllm:generation_tokens_total"] \
        == response.usage.completion_tokens


@pytest.mark.parametrize("policy", ["none", "fixed:3", "threshold:0.2", "dspark", "dspark-lagged"])
def test_every_policy_serves_the_plain_text_at_temperature_zero(tiny_long, drafter_dir, plain_llm, policy):
    server = ServerProcess("--target", str(tiny_long), "--drafter", str(drafter_dir), "--policy", policy)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for prompt in ("def add(a, b):", "The capital of France"):
            expected = plain_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0].text
            response = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
            assert response.choices[0].text == expected
            if policy.startswith("fixed"):
                assert response.model_extra["dspark"]["num_draft_tokens"] > 0
    finally:
        server.stop()


def test_client_disconnect_cancels_and_frees_memory(server, model_name):
    aborted_before = server.metric("vllm:request_success_total", finished_reason="abort")
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": model_name, "prompt": "Tell a very long story", "max_tokens": 1900,
                            "temperature": 1.0, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.metric("vllm:kv_cache_usage_perc") > 0
    deadline = time.time() + 30
    while time.time() < deadline and server.metric("vllm:kv_cache_usage_perc") > 0:
        time.sleep(0.2)
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    assert server.metric("vllm:num_requests_running") == 0
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted_before + 1


def test_queue_overflow_and_graceful_shutdown(tiny_long):
    """One KV slot and a queue of one: a third concurrent request gets 429. Then SIGTERM: the running
    stream finishes completely, new connections are refused, and the process exits cleanly."""
    server = ServerProcess("--target", str(tiny_long), "--drafter", "none", "--max-batch-size", "1",
                           "--max-queue", "1")
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "A long story:", "max_tokens": 400, "temperature": 1.0, "seed": 1,
                "stream": True}
        with httpx.Client(timeout=120) as http:
            first = http.send(http.build_request("POST", f"{server.url}/v1/completions", json=body), stream=True)
            first_lines = first.iter_lines()
            next(first_lines)  # running
            second = http.send(http.build_request("POST", f"{server.url}/v1/completions", json=body), stream=True)
            third = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=60)
            assert third.status_code == 429 and third.headers["retry-after"]
            assert third.json()["error"]["code"] == "queue_full"
            second.close()

            server.process.send_signal(signal.SIGTERM)
            rest = [line for line in first_lines if line]
            assert rest[-1] == "data: [DONE]"
            final = json.loads(rest[-2][len("data: "):])
            assert final["choices"][0]["finish_reason"] in ("length", "stop")
            first.close()
        # uvicorn re-raises the SIGTERM after its graceful shutdown: the conventional exit for it.
        assert server.process.wait(60) in (0, -signal.SIGTERM)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server.url}/health", timeout=2)
    finally:
        server.stop()
