"""Seeded sampling is reproducible under speculation: a seeded request's tokens come from noise keyed
by (seed, position), so they are the same whether its positions were drafted, verified in part,
or decoded plainly, and the coupled verification stays lossless (sampling.py's docstring)."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_trt import LLM, SamplingParams
from dspark_trt.kernels import cpu_kernels
from dspark_trt.runtime.sampling import (PositionNoise, coupled_token, coupled_tokens, gumbel_noise, mixed_seed,
                                         verify_draft_coupled)

PROMPT = "Question: A farmer has 12 cows and buys 7 more. How many cows does he have now?\nAnswer:"


def test_position_noise_depends_on_seed_position_and_token_only():
    a, b = PositionNoise(7), PositionNoise(7)
    assert a.key(3) == b.key(3) and a.key(3) != a.key(4) and a.key(3) != PositionNoise(8).key(3)
    assert len({mixed_seed(s, i) for s in range(50) for i in range(50)}) == 2500
    ids = torch.arange(5000)
    noise = gumbel_noise(a.key(3), ids)
    assert torch.equal(noise, gumbel_noise(b.key(3), ids))
    assert torch.equal(gumbel_noise(a.key(3), ids[[4999, 7, 100]]), noise[[4999, 7, 100]])  # each token's own
    assert not torch.equal(noise, gumbel_noise(a.key(4), ids))


def test_position_noise_is_gumbel_distributed():
    """Standard Gumbel: mean Euler's gamma, variance pi^2 / 6, and P(g <= x) = exp(-exp(-x)), over
    many tokens and keys (a bad hash shows as bias or correlation between neighbouring ids)."""
    noise = torch.cat([gumbel_noise(mixed_seed(seed, 0), torch.arange(20000)) for seed in range(10)])
    assert abs(float(noise.mean()) - 0.5772) < 0.01 and abs(float(noise.var()) - 1.6449) < 0.03
    for x in (-1.0, 0.0, 1.0, 3.0):
        assert abs(float((noise <= x).double().mean()) - math.exp(-math.exp(-x))) < 0.005
    neighbours = torch.corrcoef(torch.stack([noise[:-1], noise[1:]]))[0, 1]
    assert abs(float(neighbours)) < 0.01
    assert float(noise.max()) < 36.8  # 52 random bits: -log(-log(1 - 2^-53)) = 36.7


@pytest.mark.skipif(not cpu_kernels.available(),
                    reason=f"our CPU kernels do not run here: {cpu_kernels.unavailable_reason()}")
def test_the_kernels_coupled_tokens_are_the_references():
    """`coupled_tokens` through the C kernel against `argmax(logprobs + gumbel_noise)` in PyTorch,
    over a 49k vocabulary and a drafter's subset of it (its `ids`)."""
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(8, 49152, generator=generator) * 2, -1)
    keys = [mixed_seed(seed, 1) for seed in range(8)]
    expected = [int(torch.argmax(row.double() + gumbel_noise(key, torch.arange(49152))))
                for row, key in zip(logprobs, keys)]
    assert coupled_tokens(logprobs, keys) == expected
    logits, temperatures = logprobs * 3.0 + 1.5, [0.5 + 0.25 * k for k in range(8)]  # raw logits, 1 / T each
    expected = [int(torch.argmax(row.double() * (1.0 / t) + gumbel_noise(key, torch.arange(49152))))
                for row, key, t in zip(logits, keys, temperatures)]
    assert coupled_tokens(logits, keys, scales=[1.0 / t for t in temperatures]) == expected
    subset = torch.randperm(49152, generator=generator)[:8192]
    expected = [int(torch.argmax(row.double() + gumbel_noise(key, subset))) for row, key in zip(logprobs[:, subset], keys)]
    assert coupled_tokens(logprobs[:, subset], keys, subset) == expected


def test_coupled_verification_emits_exactly_the_targets_sample():
    """Whatever the draft, the emitted tokens are the Gumbel-max samples of the target at each
    position: so their distribution is the target's, and drafting cannot change them."""
    torch.manual_seed(0)
    vocab, trials = 6, 6000
    p = torch.softmax(torch.randn(3, vocab) * 1.5, -1)
    q = torch.softmax(torch.log(p) + torch.randn(3, vocab) * 0.7, -1)  # a drafter close to the target
    counts, accepted = torch.zeros(vocab), 0
    for seed in range(trials):
        noise = PositionNoise(seed)
        keys = [noise.key(k) for k in range(3)]
        draft = [coupled_token(torch.log(q[k]), keys[k]) for k in range(2)]  # the drafter's own noisy argmax
        num_accepted, token = verify_draft_coupled(draft, torch.log(p), keys)
        plain = coupled_token(torch.log(p[0]), keys[0])
        assert (draft[0] if num_accepted else token) == plain  # first token: the same as without a draft
        counts[plain] += 1
        accepted += num_accepted > 0
    expected = p[0] * trials
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom, p = 0.001
    tv = float((p[0] - q[0]).abs().sum() / 2)
    assert accepted / trials >= (1 - tv) / (1 + tv) - 0.03  # the coupling's guaranteed acceptance


@pytest.fixture(scope="module")
def llms():
    return {policy: LLM(target="default", drafter="default", policy=policy) for policy in ("none", "all", "dspark")}


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, temperature=1.0, seed=5),
                                    SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, top_k=40, seed=-3)])
def test_a_seed_gives_the_same_text_under_every_policy(llms, params):
    outputs = {policy: llm.generate(PROMPT, params)[0] for policy, llm in llms.items()}
    assert outputs["all"].metrics["num_accepted_tokens"] > 0  # drafts were accepted, not only corrected
    assert outputs["all"].token_ids == outputs["none"].token_ids == outputs["dspark"].token_ids
    # ... and under load: the same request beside others.
    crowd = llms["dspark"].generate([PROMPT, "Hello", "Count to ten:", PROMPT], [params, SamplingParams(max_tokens=30),
                                    SamplingParams(max_tokens=30, temperature=1.0), params])
    assert crowd[0].token_ids == crowd[3].token_ids == outputs["none"].token_ids


def test_seeds_differ_and_unseeded_requests_still_sample(llms):
    llm = llms["all"]
    texts = {llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=seed))[0].text for seed in range(4)}
    assert len(texts) == 4
    unseeded = {llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.0))[0].text for _ in range(3)}
    assert len(unseeded) > 1
