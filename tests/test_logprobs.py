"""Logprobs in the runtime: the distribution they come from, and that speculation, chunked prefill
and batching do not change them (the real default target and its trained drafter)."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_trt import LLM, SamplingParams
from dspark_trt.errors import InvalidRequestError
from dspark_trt.runtime.sampling import target_logprobs, target_probs

PROMPT = "Question: A farmer has 12 cows and buys 7 more. How many cows does he have now?\nAnswer:"


@pytest.fixture(scope="module")
def speculative():
    return LLM(target="default", drafter="default", policy="all")  # every draft token verified


@pytest.fixture(scope="module")
def plain():
    return LLM(target="default", drafter=None, policy="none", max_batch_tokens=16)  # prompts in 16-token chunks


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=50),
    SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.5, top_k=20, top_p=0.9)])
def test_logprobs_are_the_log_of_the_distribution_sampled_from(params):
    logits = torch.randn(3, 500) * 4
    logprobs, probs = target_logprobs(logits, params), target_probs(logits, params)
    assert torch.equal(torch.isneginf(logprobs), probs == 0)  # the very tokens sampling leaves out
    kept = probs > 0
    torch.testing.assert_close(logprobs[kept].exp(), probs[kept], rtol=1e-5, atol=1e-7)


def test_greedy_requests_report_the_models_own_distribution():
    logits = torch.randn(2, 300)
    torch.testing.assert_close(target_logprobs(logits, SamplingParams(temperature=0)), torch.log_softmax(logits, -1))


def test_speculative_logprobs_equal_plain_decoding_and_prompt_scoring(speculative, plain):
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=3, prompt_logprobs=3)
    drafted = speculative.generate(PROMPT, params)[0]
    assert drafted.metrics["num_accepted_tokens"] > 0  # some tokens came from accepted drafts
    alone = plain.generate(PROMPT, params)[0]
    assert drafted.token_ids == alone.token_ids
    assert len(drafted.logprobs) == len(drafted.token_ids) and len(drafted.prompt_logprobs) == len(drafted.prompt_token_ids)
    for mine, theirs in zip(drafted.logprobs + drafted.prompt_logprobs[1:], alone.logprobs + alone.prompt_logprobs[1:]):
        assert mine.token_id == theirs.token_id
        assert abs(mine.logprob - theirs.logprob) < 2e-3
        assert [token for token, _ in mine.top] == [token for token, _ in theirs.top]
    # Scoring prompt + completion as one prompt (echo) reports the same values.
    scored = speculative.generate([drafted.prompt_token_ids + drafted.token_ids],
                                  SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=0))[0]
    assert scored.token_ids == [] and scored.finish_reason == "length"
    tail = scored.prompt_logprobs[len(drafted.prompt_token_ids):]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(drafted.logprobs, tail)) < 2e-3
    assert all(entry.top == [] for entry in tail)  # 0 alternatives asked for


def test_logprob_entries_are_consistent(speculative):
    out = speculative.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, logprobs=5, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None  # the first prompt token follows nothing
    for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:]):
        assert entry.token_id == token and len(entry.top) == 2
    for entry in out.logprobs:
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True) and len(values) == 5
        assert entry.top[0][0] == entry.token_id  # greedy: the chosen token is the most likely
        assert math.isclose(entry.top[0][1], entry.logprob)


def test_sampled_logprobs_follow_the_sampling_parameters(speculative):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=5, seed=3, logprobs=8)
    out = speculative.generate(PROMPT, params)[0]
    for entry in out.logprobs:
        assert entry.logprob > -math.inf  # a sampled token is one top-k kept
        values = [value for _, value in entry.top]
        assert all(v == -math.inf for v in values[5:]) and all(v > -math.inf for v in values[:5])
        assert math.isclose(sum(math.exp(v) for v in values[:5]), 1.0, rel_tol=1e-4)


def test_requests_without_logprobs_carry_none(speculative):
    out = speculative.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.logprobs is None and out.prompt_logprobs is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(logprobs=21), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(logprobs=True), "logprobs")])
def test_bad_logprob_parameters(kwargs, field):
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(**kwargs)
    assert raised.value.param == field
