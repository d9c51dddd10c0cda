"""Seeded sampling is reproducible under speculation: a seeded request's tokens come from noise keyed
by (seed, position), so they are the same whether its positions were drafted, verified in part,
or decoded plainly, and the coupled verification stays lossless (sampling.py's docstring)."""

from __future__ import annotations

import pytest
import torch

from dspark_trt import LLM, SamplingParams
from dspark_trt.runtime.sampling import PositionNoise, coupled_token, mixed_seed, verify_draft_coupled

PROMPT = "Question: A farmer has 12 cows and buys 7 more. How many cows does he have now?\nAnswer:"


def test_position_noise_depends_on_seed_and_position_only():
    a, b = PositionNoise(7, 100), PositionNoise(7, 100)
    b.at(5)
    assert torch.equal(a.at(3), b.at(3)) and torch.equal(a.at(5), b.at(5))  # order of use does not matter
    assert not torch.equal(a.at(3), a.at(4)) and not torch.equal(a.at(3), PositionNoise(8, 100).at(3))
    a.forget_before(5)
    assert torch.equal(a.at(3), b.at(3))  # drawn again, identically
    assert len({mixed_seed(s, i) for s in range(50) for i in range(50)}) == 2500


def test_coupled_verification_emits_exactly_the_targets_sample():
    """Whatever the draft, the emitted tokens are the Gumbel-max samples of the target at each
    position: so their distribution is the target's, and drafting cannot change them."""
    torch.manual_seed(0)
    vocab, trials = 6, 6000
    p = torch.softmax(torch.randn(3, vocab) * 1.5, -1)
    q = torch.softmax(torch.log(p) + torch.randn(3, vocab) * 0.7, -1)  # a drafter close to the target
    counts, accepted = torch.zeros(vocab), 0
    for seed in range(trials):
        noise = PositionNoise(seed, vocab)
        rows = [noise.at(k) for k in range(3)]
        draft = [coupled_token(torch.log(q[k]), rows[k]) for k in range(2)]  # the drafter's own noisy argmax
        num_accepted, token = verify_draft_coupled(draft, torch.log(p), rows)
        plain = coupled_token(torch.log(p[0]), rows[0])
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
