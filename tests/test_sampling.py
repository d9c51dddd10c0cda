"""Sampling parameters, target distributions and the lossless verification rule."""

import pytest
import torch
from scipy.stats import chisquare

from dspark_trt.errors import InvalidRequestError
from dspark_trt.runtime.sampling import SamplingParams, sample, target_probs, verify_draft


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_tokens=-3), dict(max_tokens=2.5),
                                 dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(seed="x"), dict(stop=[""])])
def test_invalid_sampling_params_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_greedy_is_a_point_mass_on_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    probs = target_probs(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k_and_top_p_truncate_then_renormalise():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert torch.allclose(top_k, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    top_p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))[0]  # 0.5 + 0.3 reaches 0.7
    assert torch.allclose(top_p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    hot = target_probs(logits, SamplingParams(temperature=2.0))[0]
    assert torch.allclose(hot, torch.softmax(logits[0] / 2, -1))


def test_sample_never_picks_zero_probability_and_follows_the_distribution():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(probs, generator) for _ in range(6000)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert chisquare(counts[[1, 3, 4]].double().numpy(), (probs[[1, 3, 4]].double() * 6000).numpy()).pvalue > 1e-3


def test_greedy_verification_accepts_the_matching_prefix():
    probs = torch.eye(5)[[3, 1, 4, 2]]  # target argmax 3, 1, 4, 2 at the anchor and after each draft
    generator = torch.Generator()
    assert verify_draft([3, 1, 4], None, probs, generator, greedy=True) == (3, 2)  # all pass: bonus 2
    assert verify_draft([3, 0, 4], None, probs, generator, greedy=True) == (1, 1)  # corrected at slot 2
    assert verify_draft([0, 1, 4], None, probs, generator, greedy=True) == (0, 3)
    assert verify_draft([], None, probs[:1], generator, greedy=True) == (0, 3)


VOCAB = 6
TARGET = torch.tensor([[0.40, 0.25, 0.20, 0.10, 0.05, 0.00],  # p_1: token 5 impossible
                       [0.05, 0.05, 0.10, 0.30, 0.50, 0.00],  # p_2
                       [0.10, 0.20, 0.30, 0.40, 0.00, 0.00]])  # p_3 (bonus)
ADVERSARIAL_DRAFTS = {
    "mass where the target has none": torch.tensor([[0.05, 0.05, 0.05, 0.05, 0.05, 0.75],
                                                    [0.30, 0.00, 0.00, 0.00, 0.00, 0.70]]),
    "uniform": torch.full((2, VOCAB), 1 / VOCAB),
    "reversed": torch.tensor([[0.00, 0.05, 0.10, 0.20, 0.25, 0.40], [0.50, 0.30, 0.10, 0.05, 0.05, 0.0]]),
    "equal to the target": TARGET[:2].clone(),
}


def run_verification(draft_probs: torch.Tensor | None, fixed_draft: list[int] | None, trials: int, seed: int):
    """Sample drafts, verify, and return the first two committed tokens of every trial."""
    generator = torch.Generator().manual_seed(seed)
    firsts, seconds = [], []
    for _ in range(trials):
        if fixed_draft is None:
            draft = [sample(draft_probs[k], generator) for k in range(2)]
        else:
            draft = fixed_draft
        accepted, next_token = verify_draft(draft, draft_probs if fixed_draft is None else None, TARGET,
                                            generator, greedy=False)
        committed = draft[:accepted] + [next_token]
        if len(committed) < 2:  # the target's own next step would sample p_2: emulate it
            committed.append(sample(TARGET[1], generator))
        firsts.append(committed[0])
        seconds.append(committed[1])
    return torch.tensor(firsts), torch.tensor(seconds)


def assert_distribution(samples: torch.Tensor, expected: torch.Tensor):
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = expected.double() / expected.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives zero probability"
    result = chisquare(counts[support].numpy(), (expected[support] * len(samples)).numpy())
    assert result.pvalue > 1e-4, f"distribution differs from the target (p = {result.pvalue:.2e})"
    tv = 0.5 * (counts / len(samples) - expected).abs().sum()
    assert tv < 0.02


@pytest.mark.parametrize("name", list(ADVERSARIAL_DRAFTS))
def test_rejection_sampling_reproduces_the_target_distribution(name):
    firsts, seconds = run_verification(ADVERSARIAL_DRAFTS[name], None, trials=20000, seed=11)
    assert_distribution(firsts, TARGET[0])
    assert_distribution(seconds, TARGET[1])


@pytest.mark.parametrize("fixed_draft", [[5, 5], [0, 4], [3, 0]])
def test_point_mass_drafts_reproduce_the_target_distribution(fixed_draft):
    firsts, seconds = run_verification(None, fixed_draft, trials=20000, seed=5)
    assert_distribution(firsts, TARGET[0])
    assert_distribution(seconds, TARGET[1])


def test_a_wrong_verifier_is_caught():
    """The statistical check has teeth: always accepting the draft is detected."""
    generator = torch.Generator().manual_seed(0)
    draft_probs = ADVERSARIAL_DRAFTS["reversed"]
    firsts = torch.tensor([sample(draft_probs[0], generator) for _ in range(20000)])
    with pytest.raises(AssertionError):
        assert_distribution(firsts, TARGET[0])
