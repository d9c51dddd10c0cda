"""Verification policies: Algorithm 1 on hand-computed cases, why its early stop matters
(the paper's appendix-A counterexample, run through the real verifier), the lagged and
threshold policies, skipping the drafter under load, and losslessness in the engine."""

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import binomtest

from dspark_trt import LLM, SamplingParams
from dspark_trt.errors import InvalidRequestError
from dspark_trt.runtime.profile import LatencyProfile
from dspark_trt.runtime.proposer import Draft
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.scheduler import Scheduler
from dspark_trt.runtime.stats import StepStats
from dspark_trt.runtime.survival_feedback import SurvivalFeedback
from dspark_trt.runtime.sampling import sample, verify_draft
from dspark_trt.models.drafter_io import save_drafter
from dspark_trt.models.loading import load_target
from dspark_trt.runtime.verify_policy import (DRAFTER_SCALE_WEIGHT, Costs, DSparkPolicy, LaggedDSparkPolicy,
                                          NoSpeculation, VerifyPolicy, algorithm1, best_budget, candidate_counts,
                                          make_policy, prefix_survival, top_k_budgets)
from tiny_drafters import make_drafter


@pytest.fixture(scope="module")
def target(tiny_llama):
    return load_target(tiny_llama)


def costs(batch_tokens, seconds, drafter_requests=(), drafter_seconds=()):
    return Costs(LatencyProfile("test", "test", list(batch_tokens), list(seconds),
                                list(drafter_requests), list(drafter_seconds)))


def decoding_request(request_id: str, length: int = 0, max_tokens: int = 2) -> Request:
    """A request as the scheduler's drafting choice reads it: its id, its length, its token budget."""
    return Request(request_id, [0] * length, SamplingParams(max_tokens=max_tokens, temperature=0.0), torch.Generator())


def any_drafting(policy, lagged_survival, block_size=2) -> bool:
    """Whether the drafter runs at all this step."""
    return any(policy.drafting(lagged_survival, block_size))


def test_prefix_survival_is_the_running_product():
    assert prefix_survival([0.9, 0.5, 0.2]) == pytest.approx([0.9, 0.45, 0.09])


def test_algorithm1_hand_computed():
    # Two requests; batch 2 (anchors only) takes 1.0 s and each extra token 0.1 s, then a jump.
    cost = costs([2, 3, 4, 5, 6], [1.0, 1.1, 1.2, 1.5, 1.6])
    survival = [[0.9, 0.6], [0.8, 0.2]]
    # rate: none 2/1.0 = 2.0; +0.9 -> 2.9/1.1 = 2.64; +0.8 -> 3.7/1.2 = 3.08; +0.6 -> 4.3/1.5 = 2.87 stop.
    assert algorithm1(survival, cost, num_drafting=0) == [1, 1]
    # A cheap machine admits everything; an expensive extra token admits nothing.
    assert algorithm1(survival, costs([2, 6], [1.0, 1.0001]), 0) == [2, 2]
    assert algorithm1(survival, costs([2, 3], [1.0, 2.0]), 0) == [0, 0]


def test_algorithm1_stops_early_where_a_global_search_would_not():
    # Batch 6 is faster than batch 5 (a jagged curve): only a search past the dip finds it.
    cost = costs([2, 3, 4, 5, 6], [1.0, 1.1, 1.2, 1.5, 1.25])
    survival = [[0.9, 0.6], [0.8, 0.2]]
    assert algorithm1(survival, cost, 0) == [1, 1]
    assert algorithm1(survival, cost, 0, early_stop=False) == [2, 2]  # 4.5 / 1.25 = 3.6 > 3.08
    assert best_budget(survival, cost, 0)[0] == 4
    assert top_k_budgets(survival, 3) == [2, 1]


def test_drafter_cost_enters_the_objective():
    survival = [[0.5, 0.25]] * 4
    cheap = costs([4, 12], [1.0, 1.2], [1, 4], [0.01, 0.02])
    dear = costs([4, 12], [1.0, 1.2], [1, 4], [5.0, 10.0])
    for cost, should in ((cheap, True), (dear, False)):
        policy = DSparkPolicy()
        policy.costs = cost
        assert any_drafting(policy, survival) is should
    policy = DSparkPolicy()
    policy.costs = cheap
    assert any_drafting(policy, [None] * 4) is True  # no history yet: draft once to learn
    assert policy.drafting([None] * 4, 2) == [True, False, False, False]  # ... for one request, not the batch
    policy.costs = dear
    assert policy.drafting([None] * 4, 2) == [False] * 4  # ... where a draft could pay at all


def test_where_no_draft_could_pay_nothing_drafts_not_even_to_explore(target):
    # Verifying costs 0.3 s a token above 4 tokens and a draft 0.5 s: one request's whole block of 2
    # (4 + 2 tokens in 1.6 + 0.5 s) loses to plain decoding (4 in 1.0 s), so no draft can pay.
    dear = costs([4, 6], [1.0, 1.6], [1], [0.5])
    policy = DSparkPolicy()
    policy.costs = dear
    assert not policy.could_pay(4, 2)
    assert policy.could_pay(4, 0)  # block size unknown: no bound
    policy.costs = costs([4, 6], [1.0, 1.02], [1], [0.01])
    assert policy.could_pay(4, 2) and policy.could_pay(1, 2)
    assert VerifyPolicy().could_pay(4, 2) and not NoSpeculation().could_pay(4, 2)
    policy.costs = dear
    requests = [decoding_request(name) for name in "abcd"]
    for block_size, drafts in ((2, False), (0, True)):  # without the bound it tries once, then explores
        scheduler = Scheduler(target.model.new_pool(1, 16), policy, max_batch_tokens=16, context_length=16,
                              explore_every=2, block_size=block_size)
        assert any(scheduler._drafting(requests, StepStats()) for _ in range(50)) is drafts


def test_explorations_are_bounded_by_the_best_block_drafted_so_far(target):
    """At 4 requests a sure block of 2 would pay (6 tokens in 1.03 s against 4 in 1.0 s); blocks
    that have survived at best 1% and 0.01% would not. With only such evidence (the prior of
    finished requests and the running requests' latest blocks, position by position the best of
    them) there is nothing to explore for; with no evidence at all, or a request decoding alone, a
    perfect block is the bound."""
    policy = DSparkPolicy()
    policy.costs = costs([4, 5, 6], [1.0, 1.01, 1.02], [1], [0.01])
    assert policy.could_pay(4, 2) and not policy.could_pay(4, 2, [0.01, 0.0001])
    assert policy.could_pay(4, 2, [0.9, 0.5])
    scheduler = Scheduler(target.model.new_pool(1, 16), policy, max_batch_tokens=16, context_length=16,
                          explore_every=2, block_size=2)
    requests = [decoding_request(name) for name in "abcd"]
    assert scheduler.best_known_survival(requests) is None
    scheduler.prior = [0.01, 0.0001]
    scheduler.survival["a"] = [0.005, 0.0002]
    assert scheduler.best_known_survival(requests) == [0.01, 0.0002]
    assert not any(scheduler._drafting(requests, StepStats()) for _ in range(50))
    alone = [requests[0]]  # decoding alone, a request explores whatever the evidence: nothing to break
    assert any(scheduler._drafting(alone, StepStats()) for _ in range(50))
    scheduler.survival["b"] = [0.9, 0.5]  # one running request's block survived well: worth a look again
    assert scheduler.best_known_survival(requests) == [0.9, 0.5]


def test_a_long_catch_up_counts_against_drafting(target):
    # One request whose draft pays when its context is current: (1 + 0.9 + 0.81) / (1.1 + 0.3) s
    # beats 1 / 1 s; with 3,000 positions to catch up on first, at 1 ms each, it does not.
    policy = DSparkPolicy()
    policy.costs = Costs(LatencyProfile("test", "test", [1, 2, 3, 4], [1.0, 1.05, 1.1, 1.15], [1, 2], [0.3, 0.4],
                                        catch_up_seconds_per_position=1e-3))
    assert policy.drafting([[0.9, 0.81]], 2, [0]) == [True]
    assert policy.drafting([[0.9, 0.81]], 2, [3000]) == [False]
    # Two alike: the one that drafted last step (nothing to catch up on) drafts, alone.
    assert policy.drafting([[0.9, 0.81]] * 2, 2, [3000, 0]) == [False, True]
    # The scheduler counts what a request missed since it last drafted (its prompt, if it never did),
    # beyond the step's worth the profiled draft already includes, spread over the steps it has left.
    scheduler = Scheduler(target.model.new_pool(1, 16), policy, max_batch_tokens=16, context_length=16, block_size=2)
    request = decoding_request("r", length=300)
    assert scheduler._catch_up_positions(request) == 298  # its last step: all of it
    request.params.max_tokens = 22  # 11 steps left
    assert scheduler._catch_up_positions(request) == 298 // 11
    scheduler.survival["r"] = [0.9, 0.81]
    policy.costs = costs([1, 2, 3], [1.0, 1.05, 1.1], [1], [0.3])  # no catch-up cost: it drafts
    assert scheduler._drafting([request], StepStats())
    request.output_token_ids = [7, 8, 9]
    assert scheduler._catch_up_positions(request) == 0  # one position missed since, over 9 steps


def test_requests_that_have_not_drafted_are_judged_by_what_finished_ones_found(target):
    """Before any request finishes, one new request tries; after, new requests get the running mean
    of finished requests' (corrected) survivals: a poor drafter stops being tried on every new
    batch of requests, a good one drafts for them straight away."""
    policy = DSparkPolicy()
    policy.costs = costs([1, 2, 3, 4], [1.0, 1.05, 1.1, 1.15], [1, 2], [0.3, 0.4])
    scheduler = Scheduler(target.model.new_pool(1, 16), policy, max_batch_tokens=16, context_length=16, block_size=2)
    first, second = decoding_request("first"), decoding_request("second")
    assert scheduler._drafting([first, second], StepStats()) == [first]  # nothing known: one tries
    for survival, drafts in (([0.1, 0.01], False), ([0.95, 0.9], True)):
        scheduler = Scheduler(target.model.new_pool(1, 16), policy, max_batch_tokens=16, context_length=16,
                              block_size=2, explore_every=1000)
        scheduler.survival["done"] = survival
        scheduler.finish(SimpleNamespace(request_id="done", cache=None))
        assert scheduler.prior == survival
        assert bool(scheduler._drafting([first, second], StepStats())) is drafts, survival
    scheduler.survival["later"] = [0.15, 0.11]
    scheduler.finish(SimpleNamespace(request_id="later", cache=None))
    assert scheduler.prior == pytest.approx([0.75 * 0.95 + 0.25 * 0.15, 0.75 * 0.9 + 0.25 * 0.11])


def test_drafting_is_judged_by_the_rule_that_will_verify():
    # One request; a jagged curve: 2 tokens cost 2x one, 3 tokens no more than 2. The global search
    # finds 2.2 tokens / 2.1 s = 1.05 tok/s, above plain decoding's 1.0, but Algorithm 1 stops at
    # the first draft token (1.6 / 2.1 < 1 / 1.1) and would verify nothing: a draft for nothing.
    cost = costs([1, 2, 3], [1.0, 2.0, 2.0], [1], [0.1])
    survival = [[0.6, 0.6]]
    assert best_budget(survival, cost, 1)[1] > cost.rate(1, 1, 0, 1)
    assert algorithm1(survival, cost, 1) == [0]
    policy = DSparkPolicy()
    policy.costs = cost
    assert any_drafting(policy, survival) is False
    # Where Algorithm 1 itself gains, it drafts.
    policy.costs = costs([1, 2, 3], [1.0, 1.05, 1.1], [1], [0.1])
    assert any_drafting(policy, survival) is True


def test_explorations_back_off_while_drafting_does_not_pay(target):

    class Never(DSparkPolicy):
        def drafting(self, lagged_survival, block_size, catch_up_positions=None):
            return [self.pays] * len(lagged_survival)

    policy = Never()
    policy.pays = False
    scheduler = Scheduler(target.model.new_pool(1, 16), policy, max_batch_tokens=16, context_length=16,
                          explore_every=4)

    def drafted_steps(num_steps):
        decoding = [decoding_request("r")]
        return [step for step in range(num_steps) if scheduler._drafting(decoding, StepStats())]

    # Gaps of 4, 8, 16, 32, then capped at 16 x 4 = 64 steps.
    assert drafted_steps(4 + 1 + 8 + 1 + 16 + 1 + 32 + 1 + 64 + 1 + 64 + 1) == [4, 13, 30, 63, 128, 193]
    policy.pays = True  # a gain found again: every step drafts, and the gap is back to 4
    assert drafted_steps(3) == [0, 1, 2]
    policy.pays = False
    assert drafted_steps(6) == [4]


def test_only_the_requests_worth_drafting_for_draft():
    # Four requests; the drafter costs 0.1 s for one, 0.4 s for four. Only request 2 drafts well:
    # drafting for all four (2.95 + 0.15 + ...) / (1.2 + 0.4) loses to drafting for it alone.
    policy = DSparkPolicy()
    policy.costs = costs([4, 5, 6, 8], [1.0, 1.02, 1.04, 1.2], [1, 4], [0.1, 0.4])
    lagged = [[0.05, 0.01], [0.1, 0.02], [0.95, 0.9], None]
    assert policy.drafting(lagged, 2) == [False, False, True, False]
    assert candidate_counts(3) == [1, 2, 3] and candidate_counts(40) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 40]
    policy.costs = costs([4, 8], [1.0, 1.0001], [1, 4], [0.001, 0.004])  # free drafts: everyone drafts
    assert policy.drafting(lagged, 2) == [True] * 4
    policy.costs = costs([4, 8], [1.0, 2.0], [1, 4], [0.5, 2.0])  # dear drafts and verification: nobody
    assert policy.drafting(lagged, 2) == [False] * 4 and not any_drafting(policy, lagged)


def test_an_exploration_drafts_for_the_request_that_waited_longest(target):
    policy = DSparkPolicy()
    policy.costs = costs([1, 8], [1.0, 8.0], [1], [5.0])  # drafting never pays
    scheduler = Scheduler(target.model.new_pool(1, 16), policy, max_batch_tokens=16, context_length=16,
                          explore_every=2)
    requests = [decoding_request(name) for name in "abc"]
    for request in requests:
        scheduler.survival[request.request_id] = [0.5]
    explored = [[r.request_id for r in scheduler._drafting(requests, StepStats())] for _ in range(20)]
    assert [ids for ids in explored if ids] == [["a"], ["b"], ["c"]]  # one at a time, gaps 2, 4, 8


def test_survival_feedback_scales_what_the_policy_sees_by_what_verification_found():
    feedback = SurvivalFeedback(prior_tokens=2.0)
    assert feedback.correct("r", [0.8, 0.4]) == [0.8, 0.4]  # no evidence yet: calibration is trusted
    for _ in range(10):  # predicted 0.8 + 0.4 = 1.2 accepted tokens per verification, got 0.3
        feedback.record("r", [0.8, 0.4], 0 if _ % 10 else 3)
    factor = (3 + 2.0) / (12 + 2.0)
    assert feedback.factor("r") == pytest.approx(factor)
    assert feedback.correct("r", [0.8, 0.4]) == pytest.approx([0.8 * factor, 0.4 * factor])
    feedback.record("s", [0.5], 1)  # better than predicted: scaled up, never past 1
    assert feedback.correct("s", [0.9, 0.6]) == pytest.approx([1.0, 0.6 * 3 / 2.5])
    feedback.record("s", [], 1)  # nothing verified: no evidence
    assert feedback.factor("s") == pytest.approx(3 / 2.5)
    feedback.forget("r")
    assert feedback.factor("r") == 1.0


def test_an_overconfident_drafter_stops_being_drafted_for(target):
    """The scheduler hands the policy survivals corrected by the request's verifications: drafts
    predicted to survive 90% that the target keeps rejecting stop being drafted."""
    policy = DSparkPolicy()
    policy.costs = costs([1, 2, 3], [1.0, 1.05, 1.1], [1], [0.3])
    scheduler = Scheduler(target.model.new_pool(1, 16), policy, max_batch_tokens=16, context_length=16)
    request = decoding_request("r")
    scheduler.survival["r"] = [0.9, 0.81]
    assert scheduler._drafting([request], StepStats())  # (1 + 0.9 + 0.81) / 1.4 s beats 1 / 1 s
    verified = Draft([5, 6], confidences=torch.tensor([0.9, 0.9]))
    for _ in range(5):
        scheduler.record_verification(request, verified, 0)
    assert not scheduler._drafting([request], StepStats())
    scheduler.finish(SimpleNamespace(request_id="r", cache=None))
    assert scheduler.feedback.factor("r") == 1.0


def test_measured_draft_costs_scale_the_profiled_ones():
    cost = costs([1, 2], [1.0, 1.1], [1, 2], [0.2, 0.3])
    assert cost.drafter_seconds(1) == pytest.approx(0.2)
    for _ in range(200):  # every draft measured at twice its profiled cost
        cost.observe_drafter(1, 0.4)
    assert cost.drafter_scale == pytest.approx(2.0, rel=1e-6)
    assert cost.drafter_seconds(2) == pytest.approx(0.6, rel=1e-6)
    assert cost.rate(2.0, 2, 1, 1) == pytest.approx(2.0 / (1.1 + 0.4), rel=1e-6)
    policy = DSparkPolicy()
    policy.costs = cost
    policy.observe_drafter(1, 0.2)  # the policy forwards what the engine measured
    assert cost.drafter_scale == pytest.approx(2.0 + DRAFTER_SCALE_WEIGHT * (1.0 - 2.0), rel=1e-6)


def appendix_a_first_token_distribution(early_stop: bool, num_samples: int = 6000, seed: int = 0) -> float:
    """P(first committed token = 0) when verification budgets come from Algorithm 1.

    Target p = (0.5, 0.5); the drafter proposes x_1 ~ q = (0.9, 0.1). c_1 = 0.3, and the second
    position's confidence looks at x_1 (as the confidence head does): c_2 = 0.95 if x_1 = 0 else 0.05.
    The latency curve is jagged: verifying one draft token costs 1.5 s, two cost the same 1.5 s.
    """
    p = torch.tensor([0.5, 0.5])
    q = torch.tensor([0.9, 0.1])
    cost = costs([1, 2, 3], [1.0, 1.5, 1.5])
    generator = torch.Generator().manual_seed(seed)
    zeros = 0
    for _ in range(num_samples):
        draft = [sample(q, generator), sample(q, generator)]
        survival = prefix_survival([0.3, 0.95 if draft[0] == 0 else 0.05])
        (budget,) = algorithm1([survival], cost, 0, early_stop=early_stop)
        accepted, next_token = verify_draft(draft[:budget], q.expand(budget, 2), p.expand(budget + 1, 2),
                                            generator, greedy=False)
        first = draft[0] if accepted else next_token
        zeros += first == 0
    return zeros


def test_appendix_a_without_the_early_stop_the_distribution_is_wrong():
    num_samples = 6000
    # Without the early stop x_1 is verified exactly when x_1 = 0 (then a_2 makes the pair pay):
    # P(0) = 0.9 * (0.5 / 0.9) + 0.1 * 0.5 = 0.55 instead of 0.5.
    biased = appendix_a_first_token_distribution(early_stop=False, num_samples=num_samples)
    assert binomtest(biased, num_samples, 0.5).pvalue < 1e-6
    assert binomtest(biased, num_samples, 0.55).pvalue > 1e-3
    exact = appendix_a_first_token_distribution(early_stop=True, num_samples=num_samples)
    assert binomtest(exact, num_samples, 0.5).pvalue > 1e-3


def test_early_stop_stays_exact_when_it_does_verify():
    """Same drafts, a curve where the first token pays on its own: Algorithm 1 verifies it (and the
    second only when x_1 = 0 makes a_2 large) and the committed token is still p-distributed."""
    p = torch.tensor([0.5, 0.5])
    q = torch.tensor([0.9, 0.1])
    cost = costs([1, 2, 3], [1.0, 1.2, 1.45])
    generator = torch.Generator().manual_seed(1)
    zeros, verified = 0, 0
    for _ in range(6000):
        draft = [sample(q, generator), sample(q, generator)]
        survival = prefix_survival([0.3, 0.95 if draft[0] == 0 else 0.05])
        (budget,) = algorithm1([survival], cost, 0)
        verified += budget >= 1
        accepted, next_token = verify_draft(draft[:budget], q.expand(budget, 2), p.expand(budget + 1, 2),
                                            generator, greedy=False)
        zeros += (draft[0] if accepted else next_token) == 0
    assert verified == 6000
    assert binomtest(zeros, 6000, 0.5).pvalue > 1e-3


def test_lagged_budget_comes_from_old_confidences():
    policy = LaggedDSparkPolicy()
    policy.costs = costs([2, 3, 4, 5, 6], [1.0, 1.1, 1.2, 1.5, 1.25])
    assert any_drafting(policy, [[0.9, 0.6], [0.8, 0.2]])  # global search over the jagged curve: K = 4
    assert policy.lagged_budget == 4
    # This step's confidences are lower, but the budget was fixed beforehand: top 4 slots.
    assert policy.budgets([[0.5, 0.1], [0.4, 0.3]], [2, 2], 2) == [2, 2]
    policy.lagged_budget = 1
    assert policy.budgets([[0.5, 0.1], [0.6, 0.3]], [2, 2], 2) == [0, 1]


def test_threshold_fixed_and_none_policies():
    assert make_policy("threshold:0.5").budgets([[0.9, 0.6, 0.4], [0.3]], [3, 1], 2) == [2, 0]
    assert make_policy("fixed:2").budgets([[], []], [7, 1], 2) == [2, 1]
    none = make_policy("none")
    assert not none.uses_drafter and none.budgets([[]], [7], 1) == [0]
    for bad in ("fixed:-1", "fixed:x", "threshold:2", "bogus"):
        with pytest.raises(InvalidRequestError, match="policy"):
            make_policy(bad)


def test_policies_need_what_they_use(tiny_llama, target, tmp_path):
    save_drafter(make_drafter(target, kind="dflash"), tmp_path / "dflash")
    with pytest.raises(InvalidRequestError, match="confidence head"):
        LLM(target=tiny_llama, drafter=tmp_path / "dflash", policy="dspark")
    with pytest.raises(InvalidRequestError, match="needs a drafter"):
        LLM(target=tiny_llama, policy="fixed:3")


@pytest.mark.parametrize("policy", ["none", "fixed:2", "threshold:0.3", "dspark", "dspark-lagged"])
def test_every_policy_is_lossless_at_temperature_zero(tiny_llama, target, tmp_path, policy):
    save_drafter(make_drafter(target), tmp_path / "dspark")
    prompts = ["The quick brown fox", "def fibonacci(n):", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in LLM(target=tiny_llama).generate(prompts, params)]
    llm = LLM(target=tiny_llama, drafter=tmp_path / "dspark", policy=policy)
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    if policy != "none":
        assert llm.engine.counters.num_steps > 0
        assert llm.engine.profile is not None or not llm.engine.policy.needs_profile


def test_only_steady_state_drafts_scale_the_drafter_cost(tiny_llama, target, tmp_path):
    """A draft right after steps without drafting also catches up on every position it missed;
    counting it would make drafting look dearer the rarer it is. The engine reports a draft's time
    only when every request drafting drafted in the previous step too."""
    save_drafter(make_drafter(target), tmp_path / "dspark")

    class Alternating(DSparkPolicy):
        def __init__(self, every: int):
            super().__init__()
            self.every, self.calls, self.observed = every, 0, []

        def drafting(self, lagged_survival, block_size, catch_up_positions=None):
            self.calls += 1
            return [self.calls % self.every == 0] * len(lagged_survival)

        def observe_drafter(self, num_drafting, seconds):
            self.observed.append(num_drafting)

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for every, observed in ((2, False), (1, True)):
        policy = Alternating(every)
        llm = LLM(target=tiny_llama, drafter=tmp_path / "dspark", policy=policy)
        llm.generate(["The quick brown fox"], params)
        assert bool(policy.observed) is observed, every


def test_decoding_steps_teach_the_costs_what_the_profile_does_not_see():
    """The profile times one request's blocks with nothing around the forward; a step of 8 requests
    that takes 0.3 ms more per request, and 0.2 ms more per verified draft token beyond that, is
    learned as such (running means over steps), and the objective counts both."""
    cost = costs([1, 8, 16], [0.010, 0.0136, 0.0152], [1, 4], [0.002, 0.004])
    for _ in range(400):  # plain steps of 8 requests
        cost.observe_step(8, 8, 0.0136 + 8 * 0.0003, 0.0)
    assert cost.request_seconds == pytest.approx(0.0003, rel=1e-6) and cost.token_seconds == 0.0
    for _ in range(400):  # steps where 4 of them drafted (3.9 ms) and 8 draft tokens were verified
        cost.observe_step(8, 16, 0.0152 + 0.0039 + 8 * 0.0003 + 8 * 0.0002, 0.0039)
    assert cost.token_seconds == pytest.approx(0.0002, rel=1e-6)
    assert cost.request_seconds == pytest.approx(0.0003, rel=1e-6)
    assert cost.rate(12.0, 16, 4, 8) == pytest.approx(12.0 / (0.0152 + 0.004 + 8 * 0.0003 + 8 * 0.0002), rel=1e-6)
    cost.observe_step(8, 8, 0.001, 0.0)  # faster than the profile: noise, never a negative overhead
    assert cost.request_seconds == pytest.approx(0.95 * 0.0003, rel=1e-6)


def test_a_learned_verification_overhead_stops_drafting_that_only_the_profile_says_pays():
    """At 8 requests with half-sure drafts the profile alone says drafting pays; once steps show
    each verified draft token costing 1 ms more than it says, it no longer does, and the policy
    decodes plainly. The policy's costs are what the engine's steps teach it (`observe_step`)."""
    policy = DSparkPolicy()
    policy.costs = costs([1, 8, 16, 24], [0.010, 0.0136, 0.0152, 0.0168], [1, 8], [0.001, 0.002])
    rows = [[0.8, 0.64, 0.51, 0.41]] * 8
    assert any(policy.drafting(rows, 4))
    for _ in range(400):
        policy.observe_step(8, 16, 0.0152 + 0.002 + 8 * 0.001, 0.002)
    assert policy.costs.token_seconds == pytest.approx(0.001, rel=1e-6)
    assert not any(policy.drafting(rows, 4))


def test_the_engine_reports_every_decoding_step_to_the_policy(tiny_llama, target, tmp_path):
    """Against a profile that says a target step takes a nanosecond (and a draft 10 s, so nothing
    drafts), every real decoding step is unexplained time: the engine hands each one to the
    policy, whose learned per-request overhead grows from zero."""
    save_drafter(make_drafter(target), tmp_path / "dspark")
    profile = LatencyProfile("torch-cpu", "cpu:test", [1, 256], [1e-9, 1e-9], [1, 64], [10.0, 10.0])
    policy = DSparkPolicy()
    llm = LLM(target=tiny_llama, drafter=tmp_path / "dspark", policy=policy, profile=profile, dtype="float32")
    assert policy.costs.request_seconds == 0.0
    llm.generate(["The quick brown fox"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert llm.engine.counters.num_drafts == 0 and policy.costs.token_seconds == 0.0
    assert policy.costs.request_seconds > 0.0


def test_the_policy_is_asked_again_only_when_its_inputs_changed(target):
    """While nothing is drafted, survivals, feedback and costs stay as they were: the same requests
    get the last answer without another search; a draft, or another set of requests, asks again."""
    policy = DSparkPolicy()
    policy.costs = costs([1, 2, 3], [1.0, 1.05, 1.1], [1], [5.0])  # drafting never pays
    calls = []
    original = policy.drafting
    policy.drafting = lambda lagged, block_size, positions: calls.append(len(lagged)) or original(lagged, block_size)
    scheduler = Scheduler(target.model.new_pool(2, 16), policy, max_batch_tokens=16, context_length=16,
                          explore_every=4)
    a, b = decoding_request("a"), decoding_request("b")
    scheduler.survival.update(a=[0.5], b=[0.5])
    drafted = [bool(scheduler._drafting([a], StepStats())) for _ in range(4)]
    assert drafted == [False] * 4 and calls == [1]
    assert scheduler._drafting([a], StepStats())  # the exploration at the gap of 4 drafts
    scheduler._drafting([a], StepStats())  # ... so the next step asks again
    scheduler._drafting([a, b], StepStats())  # as does another set of requests
    assert calls == [1, 1, 2]
