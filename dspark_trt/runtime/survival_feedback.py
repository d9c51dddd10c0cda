"""What verification found, fed back into the survival probabilities the verify policy sees.

The confidence head is calibrated offline (STS on held-out training rows, `training/calibrate.py`).
On traffic unlike that data it can be overconfident: at batch 1 on MT-Bench (T=0, measured on this
project's Zen 4 CPU) the policy verified first draft tokens it predicted to survive about half the
time, and 29% did. It then drafts and verifies where that does not pay, and decoding runs slower
than plain decoding. So each request keeps two running totals over the positions it verified: the
tokens they were predicted to accept (the sum of their prefix survivals a_j: the expected number
of accepted tokens of a verified prefix is exactly that sum) and the tokens they did accept. The
policy sees each new block's survivals scaled by (accepted + prior) / (predicted + prior), capped
at 1: a request whose drafts keep failing stops being drafted for, one whose drafts do better than
predicted verifies more. `prior_tokens` is how many predicted tokens of evidence it takes to move
the factor halfway from 1 (calibration is trusted until the request has shown otherwise).

Why it stays lossless: the factor depends only on the outcomes of earlier steps, so whether
position j is verified still never depends on the draft token x_j (see `verify_policy.py`), and
Algorithm 1 keeps its early stop.

It owns these totals and nothing else: the scheduler applies `correct` to the survivals it hands
the policy, and the engine calls `record` after each verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SurvivalFeedback:
    prior_tokens: float = 2.0
    predicted: dict[str, float] = field(default_factory=dict)  # request id -> sum of verified prefix survivals
    accepted: dict[str, float] = field(default_factory=dict)  # request id -> draft tokens accepted

    def factor(self, request_id: str) -> float:
        """(accepted + prior) / (predicted + prior): 1 until verification has shown otherwise."""
        prior = self.prior_tokens
        return (self.accepted.get(request_id, 0.0) + prior) / (self.predicted.get(request_id, 0.0) + prior)

    def correct(self, request_id: str, survival: list[float]) -> list[float]:
        """Prefix survivals as the policy should see them (non-increasing, each at most 1)."""
        factor = self.factor(request_id)
        return [min(1.0, a * factor) for a in survival]

    def record(self, request_id: str, verified_survival: list[float], num_accepted: int) -> None:
        """The calibrated (uncorrected) prefix survivals of the positions just verified, and how many
        of them the target accepted."""
        if not verified_survival:
            return
        self.predicted[request_id] = self.predicted.get(request_id, 0.0) + sum(verified_survival)
        self.accepted[request_id] = self.accepted.get(request_id, 0.0) + num_accepted

    def forget(self, request_id: str) -> None:
        self.predicted.pop(request_id, None)
        self.accepted.pop(request_id, None)
