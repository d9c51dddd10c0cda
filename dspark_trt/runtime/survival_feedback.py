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

A new request starts from what its *group* found rather than from 1: requests verified under the
same rule at the same temperature (`acceptance_group`). Calibration is fit on greedy acceptance;
a seeded request at T=1 is verified by the coupled rule, and the default drafter's blocks survive
it far less often (measured on this project's Xeon: 12-13% of drafted tokens against 17% greedy,
and 2 accepted of ~60 verified in a T=1 serving run at 4 requests, each new request re-learning
that from 1 and costing ~12% of the throughput). So the group keeps running totals too, decayed
so that they follow the traffic, and a request's factor is
(accepted + prior * group factor) / (predicted + prior): the group's until the request has shown
otherwise.

It owns these totals and nothing else: the scheduler applies `correct` to the survivals it hands
the policy, and the engine calls `record` after each verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_trt.runtime.sampling import SamplingParams

GROUP_DECAY = 0.9  # per verification recorded in a group: its totals weigh the last ~10 the most
Group = tuple  # `acceptance_group`'s key


def acceptance_group(params: SamplingParams, seeded: bool) -> Group:
    """What decides how often drafts survive besides the text itself: the verification rule (greedy
    match, the coupled rule of a seeded request, or rejection sampling) and the distribution the
    target samples (temperature, top-p, top-k)."""
    if params.greedy:
        return ("greedy",)
    return ("coupled" if seeded else "rejection", round(params.temperature, 2), params.top_p, params.top_k)


@dataclass
class SurvivalFeedback:
    prior_tokens: float = 2.0
    predicted: dict[str, float] = field(default_factory=dict)  # request id -> sum of verified prefix survivals
    accepted: dict[str, float] = field(default_factory=dict)  # request id -> draft tokens accepted
    group_predicted: dict[Group, float] = field(default_factory=dict)  # decayed, over the group's requests
    group_accepted: dict[Group, float] = field(default_factory=dict)

    def group_factor(self, group: Group | None) -> float:
        """(accepted + prior) / (predicted + prior) over the group's recent verifications: 1 without
        any (or without a group)."""
        prior = self.prior_tokens
        return (self.group_accepted.get(group, 0.0) + prior) / (self.group_predicted.get(group, 0.0) + prior)

    def factor(self, request_id: str, group: Group | None = None) -> float:
        """(accepted + prior * group factor) / (predicted + prior): the group's factor until the
        request's own verifications have shown otherwise."""
        prior = self.prior_tokens
        return ((self.accepted.get(request_id, 0.0) + prior * self.group_factor(group))
                / (self.predicted.get(request_id, 0.0) + prior))

    def correct(self, request_id: str, survival: list[float], group: Group | None = None) -> list[float]:
        """Prefix survivals as the policy should see them (non-increasing, each at most 1)."""
        factor = self.factor(request_id, group)
        return [min(1.0, a * factor) for a in survival]

    def record(self, request_id: str, verified_survival: list[float], num_accepted: int,
               group: Group | None = None) -> None:
        """The calibrated (uncorrected) prefix survivals of the positions just verified, and how many
        of them the target accepted."""
        if not verified_survival:
            return
        predicted = sum(verified_survival)
        self.predicted[request_id] = self.predicted.get(request_id, 0.0) + predicted
        self.accepted[request_id] = self.accepted.get(request_id, 0.0) + num_accepted
        if group is not None:
            self.group_predicted[group] = GROUP_DECAY * self.group_predicted.get(group, 0.0) + predicted
            self.group_accepted[group] = GROUP_DECAY * self.group_accepted.get(group, 0.0) + num_accepted

    def forget(self, request_id: str) -> None:
        """A request finished: its own totals go (its group's stay)."""
        self.predicted.pop(request_id, None)
        self.accepted.pop(request_id, None)
