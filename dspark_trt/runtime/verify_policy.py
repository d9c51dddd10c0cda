"""Verification policies: how many draft tokens each request verifies this step.

Every step the engine drafts a full block for each decoding request (a drafter never runs
with fewer tokens than its trained block) and then asks the policy for `l_r`, the number of
draft tokens of request r the target checks. The rest are dropped before the target sees them.

    auto          the default everywhere (`LLM`, `serve`, `Engine`): `dspark` for a drafter with a
                  confidence head, `all` for one without, `none` without a drafter (`resolve_policy`)
    none          plain decoding: no drafter runs at all
    all           verify the whole block
    fixed:K       l_r = K (MTP-1 is the MTP-1 drafter with fixed:1)
    threshold:H   verify positions while the prefix survival a_{r,j} = prod_{i<=j} c_{r,i} >= H
    dspark        Algorithm 1 of the paper: walk all (r, j) by descending a_{r,j}, admit while
                  expected tokens per second improves, stop at the first non-improvement
    dspark-lagged the budget K comes from confidences one step old (global search over K, no
                  early stop, so a jagged latency curve is fully exploited); the K slots then go
                  to the current top-K prefix survivals

Objective (vLLM's form, which counts the drafter too):
    expected committed tokens / (drafter seconds(num drafting) + target seconds(batch tokens)
                                 + what the engine measured beyond the profile: per request, per verified token)
with the expected tokens `sum_r (1 + sum_{j<=l_r} a_{r,j})` and the batch tokens `sum_r (1 + l_r)`
(`Costs`: the profile's curves, corrected by every decoding step the engine reports).

Why losslessness survives: whether position j of request r is verified may depend on anything
but the draft token x_{r,j} itself. `c_{r,j}` looks at x_{r,j-1}, never x_{r,j}. Algorithm 1's early
stop makes admitting (r, j) depend only on items with a larger survival, i.e. never on
a_{r,j+1} (which depends on x_{r,j}); searching past a non-improvement would (the paper's
appendix A; `tests/test_scheduler.py` shows the bias). The lagged budget is fixed before the
current block exists, and a top-K set is decided by larger values only.

Drafting itself is a choice, per request (`drafting`): with confidences from earlier steps, the
policy compares the rate its own verification rule would reach if the k most promising requests
drafted (the drafter's cost for k included, and its catch-up on every position they missed since
they last drafted: the profile's `catch_up_seconds_per_position`) against plain decoding, and drafts for the best k, or
for none, so speculation never runs where it is expected to be slower; a request's drafter state
catches up on the context it missed before it drafts again (see `DSparkProposer.observe`).

This module is pure Python over floats and decides nothing else: admission and the token
budget are the scheduler's (`scheduler.py`), tensors and requests the engine's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dspark_trt.errors import InvalidRequestError
from dspark_trt.runtime.profile import LatencyProfile

POLICY_NAMES = ("auto", "none", "all", "fixed:K", "threshold:H", "dspark", "dspark-lagged")
DEFAULT_POLICY = "auto"
DRAFTER_SCALE_WEIGHT = 0.1  # each measured draft's share in the running drafter-cost scale (`Costs`)
STEP_OVERHEAD_WEIGHT = 0.05  # each decoding step's share in the running step overheads (`Costs.observe_step`)


def prefix_survival(confidences: list[float]) -> list[float]:
    """a_j = prod_{i<=j} c_i: the probability that draft tokens 1..j all survive."""
    survival, running = [], 1.0
    for c in confidences:
        running *= c
        survival.append(running)
    return survival


@dataclass
class Costs:
    """Step-time lookups the objective needs (from a `LatencyProfile`), corrected by what serving
    measures.

    The profile times the drafter on a synthetic request, best of a few; a real draft also pays
    for what its request brings (copy-bias lookups, Markov rows seen for the first time, noise on a
    shared machine): 15-20% more at batch 1 here. An underestimated draft cost is the way to draft
    where it does not pay, so `observe_drafter` keeps a running mean of measured / profiled seconds
    (`DRAFTER_SCALE_WEIGHT` per observation) that scales every drafter lookup.

    The profile also times the target on one request's blocks, with nothing around the forward. A
    decoding step of n requests pays more: each request's attention over its own context, its
    sampling and bookkeeping (`request_seconds` each), and each verified draft token its logit row's
    rejection sampling and its share of the extra attention and features (`token_seconds` each).
    Measured on a 2-core Xeon at 8 requests: a plain step 16.5 ms against the profile's 13.5, a step
    verifying 8.8 draft tokens 2.4 ms over what the profile and the measured draft explained, so
    drafting looked ~10% cheaper than it was and ran ~5% slower than plain decoding. `observe_step`
    learns both from every decoding step (running means, `STEP_OVERHEAD_WEIGHT` per step)."""

    profile: LatencyProfile
    drafter_scale: float = 1.0
    catch_up_seconds: float = 0.0  # what drafting adds this step for positions its requests missed (`plus_catch_up`)
    request_seconds: float = 0.0  # a decoding request's step cost beyond the profile's (learned)
    token_seconds: float = 0.0  # a verified draft token's step cost beyond the profile's (learned)

    def plus_catch_up(self, positions: int) -> "Costs":
        """These costs with a draft's catch-up on `positions` missed positions added to it. (A
        copy: what `observe_step` learns meanwhile goes to the policy's own `Costs`.)"""
        return replace(self, catch_up_seconds=self.profile.catch_up_seconds(positions)) if positions > 0 else self

    def drafter_seconds(self, num_drafting: int) -> float:
        return self.profile.drafter_seconds(num_drafting) * self.drafter_scale

    def observe_drafter(self, num_drafting: int, seconds: float) -> None:
        profiled = self.profile.drafter_seconds(num_drafting)
        if profiled > 0 and seconds > 0:
            self.drafter_scale += DRAFTER_SCALE_WEIGHT * (seconds / profiled - self.drafter_scale)

    def observe_step(self, num_requests: int, batch_tokens: int, step_seconds: float, drafter_seconds: float) -> None:
        """A decoding step (no prompt tokens) of `num_requests` requests and `batch_tokens` tokens took
        `step_seconds`, of which the draft `drafter_seconds` (its catch-up included). A step without
        draft tokens updates the per-request overhead; one with them, the per-token overhead beyond
        it. Both stay >= 0: the profile's curve is a best-of-few, so anything below it is noise."""
        if num_requests <= 0 or step_seconds <= 0:
            return
        unexplained = step_seconds - drafter_seconds - self.profile.target_seconds(batch_tokens)
        draft_tokens = batch_tokens - num_requests
        if draft_tokens <= 0:
            sample = max(0.0, unexplained / num_requests)
            self.request_seconds += STEP_OVERHEAD_WEIGHT * (sample - self.request_seconds)
        else:
            sample = max(0.0, (unexplained - num_requests * self.request_seconds) / draft_tokens)
            self.token_seconds += STEP_OVERHEAD_WEIGHT * (sample - self.token_seconds)

    def rate(self, expected_tokens: float, batch_tokens: int, num_drafting: int, num_requests: int) -> float:
        """Expected committed tokens per second of a decoding step of `num_requests` requests
        verifying `batch_tokens - num_requests` draft tokens, `num_drafting` of them drafting."""
        seconds = self.profile.target_seconds(batch_tokens) + self.drafter_seconds(num_drafting)
        seconds += num_requests * self.request_seconds + (batch_tokens - num_requests) * self.token_seconds
        if num_drafting > 0:
            seconds += self.catch_up_seconds
        return expected_tokens / seconds


def algorithm1(survival: list[list[float]], costs: Costs, num_drafting: int,
               early_stop: bool = True) -> list[int]:
    """The paper's Algorithm 1: verify budgets `l_r` from prefix survivals `survival[r][j]`.

    Items are walked by descending survival (ties: earlier position first, so a request's
    positions always come in order); each is admitted while it raises the objective, and the
    walk stops at the first one that does not. `early_stop=False` instead takes the best prefix
    of the whole walk (a global search over the *current* survivals): it exists only for the
    tests that show why that is wrong. It would admit position j because admitting j and j+1
    together pays, and whether it pays depends on a_{j+1}, i.e. on the sampled token x_j.
    """
    if not early_stop:
        total, _ = best_budget(survival, costs, num_drafting)
        return top_k_budgets(survival, total)
    num_requests = len(survival)
    budgets = [0] * num_requests
    expected, batch = float(num_requests), num_requests
    best = costs.rate(expected, batch, num_drafting, num_requests)
    for a, j, r in _by_descending_survival(survival):
        candidate = costs.rate(expected + a, batch + 1, num_drafting, num_requests)
        if candidate <= best:
            break
        best, expected, batch = candidate, expected + a, batch + 1
        budgets[r] = j + 1
    return budgets


def _by_descending_survival(survival: list[list[float]]) -> list[tuple[float, int, int]]:
    """(a, j, r) for every draft position, highest survival first; ties go to the earlier position,
    so each request's positions come in order (survival never rises along a block)."""
    return sorted(((a, j, r) for r, row in enumerate(survival) for j, a in enumerate(row)),
                  key=lambda item: (-item[0], item[1], item[2]))


def best_budget(survival: list[list[float]], costs: Costs, num_drafting: int) -> tuple[int, float]:
    """Global search: the total budget K (top-K survivals) with the highest rate, and that rate."""
    num_requests = len(survival)
    values = sorted((a for row in survival for a in row), reverse=True)
    best_k, best_rate = 0, costs.rate(num_requests, num_requests, num_drafting, num_requests)
    expected = float(num_requests)
    for k, a in enumerate(values, start=1):
        expected += a
        rate = costs.rate(expected, num_requests + k, num_drafting, num_requests)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


def candidate_counts(num_requests: int) -> list[int]:
    """How many requests to try drafting for: each count up to 8, then doublings and all of them
    (a step's decision stays ~O(log n) Algorithm 1 walks at large batches)."""
    counts = list(range(1, min(num_requests, 8) + 1))
    while counts and counts[-1] * 2 < num_requests:
        counts.append(counts[-1] * 2)
    return counts + ([num_requests] if num_requests > 8 else [])


def top_k_budgets(survival: list[list[float]], total: int) -> list[int]:
    """Give `total` verify slots to the highest prefix survivals (prefix-closed per request)."""
    budgets = [0] * len(survival)
    for _, j, r in _by_descending_survival(survival)[:total]:
        budgets[r] = max(budgets[r], j + 1)
    return budgets


class VerifyPolicy:
    """Base: verify everything drafted (subclasses narrow it)."""

    name = "all"
    uses_drafter = True
    needs_confidence = False
    needs_profile = False

    def __init__(self):
        self.costs: Costs | None = None

    def set_profile(self, profile: LatencyProfile | None) -> None:
        self.costs = Costs(profile) if profile is not None else None

    def drafting(self, lagged_survival: list[list[float] | None], block_size: int,
                 catch_up_positions: list[int] | None = None) -> list[bool]:
        """Which requests the drafter runs for this step, from survivals of earlier steps (None =
        unknown) of drafts of `block_size` tokens, and the positions each would first catch up on
        (beyond a step's worth): every one, for a policy that does not weigh the drafter's cost."""
        return [self.uses_drafter] * len(lagged_survival)

    def could_pay(self, num_decoding: int, block_size: int, best_survival: list[float] | None = None) -> bool:
        """Whether drafting could beat plain decoding at all with `num_decoding` decoding requests:
        always, for a policy that does not weigh the drafter's cost."""
        return self.uses_drafter

    def observe_drafter(self, num_drafting: int, seconds: float) -> None:
        """A draft for `num_drafting` requests took `seconds` (the engine measures every draft)."""
        if self.costs is not None:
            self.costs.observe_drafter(num_drafting, seconds)

    def observe_step(self, num_requests: int, batch_tokens: int, step_seconds: float, drafter_seconds: float) -> None:
        """A decoding step took `step_seconds` (`Costs.observe_step`)."""
        if self.costs is not None:
            self.costs.observe_step(num_requests, batch_tokens, step_seconds, drafter_seconds)

    def budgets(self, survival: list[list[float]], draft_lengths: list[int], num_drafting: int) -> list[int]:
        return list(draft_lengths)


class NoSpeculation(VerifyPolicy):
    name = "none"
    uses_drafter = False

    def budgets(self, survival, draft_lengths, num_drafting):
        return [0] * len(draft_lengths)


class FixedPolicy(VerifyPolicy):
    def __init__(self, num_tokens: int):
        super().__init__()
        self.num_tokens = num_tokens
        self.name = f"fixed:{num_tokens}"

    def budgets(self, survival, draft_lengths, num_drafting):
        return [min(self.num_tokens, n) for n in draft_lengths]


class ThresholdPolicy(VerifyPolicy):
    needs_confidence = True

    def __init__(self, threshold: float):
        super().__init__()
        self.threshold = threshold
        self.name = f"threshold:{threshold:g}"

    def budgets(self, survival, draft_lengths, num_drafting):
        return [min(n, sum(1 for a in row if a >= self.threshold)) for row, n in zip(survival, draft_lengths)]


class DSparkPolicy(VerifyPolicy):
    """Algorithm 1 with its early stop, plus the drafter-cost-aware choice to skip drafting."""

    name = "dspark"
    needs_confidence = True
    needs_profile = True

    def __init__(self):
        super().__init__()
        # (best total budget, its rate) of the last `drafting`, over the requests it chose
        self.last_plan: tuple[int, float] | None = None

    def drafting(self, lagged_survival, block_size, catch_up_positions=None):
        """The requests worth drafting for: the k most promising (by their first draft token's
        survival), for the k whose expected rate beats plain decoding by the most; none when no k
        does. A draft's cost grows with the requests it drafts for (profiled), and with the
        positions they have to catch up on first (a request that has not drafted for a while: its
        context is behind by every position since), so under load a few confident requests that
        keep drafting draft while the rest decode plainly."""
        self.last_plan = None
        count = len(lagged_survival)
        if self.costs is None:
            return [True] * count
        known = [row for row in lagged_survival if row]
        if not known:  # nothing drafted yet: one request tries (a draft for many costs up to a step,
            # with their prompts to catch up), the rest follow its lead; unless no draft could pay
            return [r == 0 and self.could_pay(count, block_size) for r in range(count)]
        fallback = [sum(col) / len(col) for col in zip(*known)]  # the average known request
        rows = [row if row else fallback for row in lagged_survival]
        # most promising first; between equals, the one with less to catch up on
        order = sorted(range(count), key=lambda r: (-rows[r][0], catch_up_positions[r] if catch_up_positions else 0))
        best_k, best_rate, best_rows = 0, self.costs.rate(count, count, 0, count), None  # plain decoding
        for k in candidate_counts(count):
            chosen = set(order[:k])
            drafted = [row if r in chosen else [] for r, row in enumerate(rows)]  # no row: does not draft
            positions = sum(catch_up_positions[r] for r in chosen) if catch_up_positions else 0
            rate = self.expected_rate(drafted, k, positions)
            if rate > best_rate:
                best_k, best_rate, best_rows = k, rate, drafted
        if best_k:
            self.last_plan = best_budget(best_rows, self.costs, best_k)
        return [bool(row) for row in best_rows] if best_k else [False] * count

    def could_pay(self, num_decoding, block_size, best_survival=None):
        """Whether one request's draft would beat plain decoding with `num_decoding` decoding
        requests, were its block as good as the best evidence says: `best_survival`, the best prefix
        survivals drafts have shown (`Scheduler.best_known_survival`), or, with none yet, all
        `block_size` tokens sure to survive. Where even that loses (at high concurrency a draft, or
        the target's extra rows, costs more than such a block saves), the scheduler neither tries
        nor explores: measured on a 2-core Xeon at 32 requests, those drafts cost ~2% of the
        throughput and verified 0.7 tokens each; and in a closed-loop serving bench each one that
        gained a token put its request a step out of the lock step in which the others prefill and
        finish together, so every later prefill stalled the rest (8-32 requests: 2-4% per-user
        speed, with almost nothing drafted). Lossless: it reads only costs, counts and survivals of
        earlier blocks, never a draft token."""
        if self.costs is None or block_size <= 0:
            return True
        best = best_survival[:block_size] if best_survival else [1.0] * block_size
        return self.expected_rate([best] + [[] for _ in range(num_decoding - 1)], 1) > \
            self.costs.rate(num_decoding, num_decoding, 0, num_decoding)

    def expected_rate(self, survival: list[list[float]], num_drafting: int, catch_up_positions: int = 0) -> float:
        """Tokens per second if the requests with a row draft (catching up on `catch_up_positions`
        missed positions first) and `budgets` then picks from `survival`.

        The rule that will pick (Algorithm 1, early stop included), not the best budget of a global
        search: that one can be above what the step will verify, and drafting for it would then
        cost more than it returns, i.e. run slower than plain decoding."""
        costs = self.costs.plus_catch_up(catch_up_positions)
        count = len(survival)
        budgets = algorithm1(survival, costs, num_drafting)
        expected = count + sum(sum(row[:budget]) for row, budget in zip(survival, budgets))
        return costs.rate(expected, count + sum(budgets), num_drafting, count)

    def budgets(self, survival, draft_lengths, num_drafting):
        if self.costs is None:
            return list(draft_lengths)
        rows = [row[:n] for row, n in zip(survival, draft_lengths)]
        return algorithm1(rows, self.costs, num_drafting)


class LaggedDSparkPolicy(DSparkPolicy):
    """Section 5.2 of the paper: budget from old confidences, slots to current top-K."""

    name = "dspark-lagged"

    def __init__(self):
        super().__init__()
        self.lagged_budget = 0

    def expected_rate(self, survival, num_drafting, catch_up_positions=0):
        # the budget it will verify: a global search's
        _, rate = best_budget(survival, self.costs.plus_catch_up(catch_up_positions), num_drafting)
        return rate

    def drafting(self, lagged_survival, block_size, catch_up_positions=None):
        chosen = super().drafting(lagged_survival, block_size, catch_up_positions)
        # The budget that pays best given that the drafter runs: also right for a step that drafts
        # only to refresh survivals (exploration), whose drafter cost is spent either way.
        self.lagged_budget = -1 if self.last_plan is None else self.last_plan[0]  # -1: verify whole blocks
        return chosen

    def budgets(self, survival, draft_lengths, num_drafting):
        rows = [row[:n] for row, n in zip(survival, draft_lengths)]
        if self.lagged_budget < 0:
            return list(draft_lengths)
        return top_k_budgets(rows, self.lagged_budget)


def resolve_policy(spec: VerifyPolicy | str | None, has_drafter: bool, has_confidence: bool) -> VerifyPolicy:
    """The one place a policy name becomes a policy: `None` means `DEFAULT_POLICY` (`auto`), and
    `auto` the best the drafter allows. A policy the drafter cannot serve is an error."""
    if spec is None:
        spec = DEFAULT_POLICY
    if isinstance(spec, str) and spec.strip() == "auto":
        spec = "dspark" if has_confidence else ("all" if has_drafter else "none")
    policy = make_policy(spec) if isinstance(spec, str) else spec
    if policy.uses_drafter and not has_drafter:
        raise InvalidRequestError(f"policy {policy.name} needs a drafter (give one, or use policy none)", "policy")
    if policy.needs_confidence and not has_confidence:
        raise InvalidRequestError(f"policy {policy.name} needs a drafter with a confidence head "
                                  "(a DSpark drafter); use fixed:K for this one", "policy")
    return policy


def make_policy(spec: str) -> VerifyPolicy:
    """Parse `none`, `all`, `fixed:K`, `threshold:H`, `dspark` or `dspark-lagged` (not `auto`:
    that needs the drafter, see `resolve_policy`)."""
    spec = spec.strip()
    if spec == "none":
        return NoSpeculation()
    if spec == "dspark":
        return DSparkPolicy()
    if spec == "dspark-lagged":
        return LaggedDSparkPolicy()
    if spec == "all":
        return VerifyPolicy()
    name, _, value = spec.partition(":")
    try:
        if name == "fixed":
            num_tokens = int(value)
            if num_tokens < 0:
                raise ValueError
            return FixedPolicy(num_tokens)
        if name == "threshold":
            threshold = float(value)
            if not 0.0 <= threshold <= 1.0 or math.isnan(threshold):
                raise ValueError
            return ThresholdPolicy(threshold)
    except ValueError:
        raise InvalidRequestError(f"bad policy {spec!r}: fixed:K needs an integer K >= 0, "
                                  f"threshold:H a number H in [0, 1]", "policy") from None
    raise InvalidRequestError(f"unknown policy {spec!r}; choose one of {', '.join(POLICY_NAMES)}", "policy")
