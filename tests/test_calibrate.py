"""STS calibration on synthetic over-confident scores."""

import math

import torch

from dspark_trt.training.calibrate import auc, expected_calibration_error, fit_sts


def test_ece_and_auc_on_hand_checked_cases():
    assert math.isclose(expected_calibration_error(torch.tensor([0.9, 0.9]), torch.tensor([1.0, 0.0])), 0.4, rel_tol=1e-6)
    assert expected_calibration_error(torch.tensor([0.25, 0.75]), torch.tensor([0.25, 0.75])) == 0.0
    assert auc(torch.tensor([0.9, 0.8, 0.1]), torch.tensor([1.0, 1.0, 0.0])) == 1.0
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([1.0, 0.0])) == 0.0
    assert auc(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 0.0])) == 0.5


def test_sts_fixes_over_confident_scores():
    """True acceptance is sigmoid(z); the head reports 3z (over-confident). STS must recover
    temperatures near 3 and cut the ECE of every cumulative product."""
    generator = torch.Generator().manual_seed(0)
    true_logits = torch.randn(20000, 5, generator=generator) * 1.5 + 1.0
    accepted = torch.bernoulli(torch.sigmoid(true_logits), generator=generator)
    report = fit_sts(3.0 * true_logits, accepted)
    assert all(2.2 < t < 4.0 for t in report.temperatures), report.temperatures
    for before, after in zip(report.ece_before, report.ece_after):
        assert after < 0.5 * before and after < 0.02
    assert all(a > 0.6 for a in report.auc)


def test_sts_leaves_calibrated_scores_alone():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(20000, 3, generator=generator)
    accepted = torch.bernoulli(torch.sigmoid(logits), generator=generator)
    report = fit_sts(logits, accepted)
    assert all(0.8 < t < 1.25 for t in report.temperatures), report.temperatures
    assert not any(math.isnan(a) for a in report.auc)
