"""The scheduler: which requests run this step, whether the drafter runs, and what each feeds.

It owns the queues (`waiting`, `running`), the KV pool's slots, the token budget of a step
(`max_batch_tokens`, which chunked prefill fills after the decode feeds) and the inputs of the
verify policy (each request's prefix survivals of its latest block, corrected by what its earlier
verifications found: `survival_feedback.py`). Per step, in two calls
with the drafter in between:

    schedule()            admit waiting requests while KV slots are free (first come, first
                          served; out of memory means waiting, never a crash); the decoding
                          requests; which of them draft (the policy, from survivals of earlier
                          steps; now and then one that has not drafted for a while, to explore)
    pack(plan, blocks)    each decode feed: [pending token] + the draft cut to the policy's
                          budget; then prompt chunks of prefilling requests into what is left of
                          the token budget; and, once, which rows of each feed need logits (every
                          row of a prompt whose tokens are scored, within a per-step row budget)

It runs no model and commits nothing (the engine does); how many tokens to verify is the
policy's decision (`verify_policy.py`), made here only in the sense of being asked.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dspark_trt.models.kv_cache import KVPool
from dspark_trt.runtime.profile import KEPT_PER_STEP
from dspark_trt.runtime.proposer import Draft
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.stats import StepStats
from dspark_trt.runtime.survival_feedback import SurvivalFeedback
from dspark_trt.runtime.verify_policy import VerifyPolicy, prefix_survival

# A prompt whose tokens are scored (prompt_logprobs) needs a logit row per token: one step gives
# scored prompt chunks this many rows in all, so their logits stay ~50 MB (256 x a 49k vocabulary,
# fp32) however many such prompts run (the soak saw the server's RSS swing by ~100 MB at 512).
PROMPT_LOGPROBS_ROWS = 256
PRIOR_WEIGHT = 0.25  # a finished request's share in the survival prior for requests that have not drafted


@dataclass
class Feed:
    """What one request feeds the target this step."""

    request: Request
    token_ids: list[int]  # a prompt chunk, or [pending token] + draft.tokens
    draft: Draft | None  # None: a prompt chunk
    num_logit_rows: int  # logits it needs: every row of a decode feed or of a scored prompt's chunk (prompt
    # logprobs), the last of a prompt's final chunk, else 0
    completes_prompt: bool = False  # a prompt chunk that ends its prompt: the first output token follows it

    @property
    def is_prefill(self) -> bool:
        return self.draft is None


@dataclass
class StepPlan:
    decoding: list[Request]  # requests past their prompt, in running order
    drafting: list[Request]  # those the drafter runs for this step (in the same order; may be none)
    stats: StepStats
    feeds: list[Feed] = field(default_factory=list)  # filled by `Scheduler.pack`

    @property
    def draft_now(self) -> bool:
        return bool(self.drafting)


class Scheduler:
    def __init__(self, pool: KVPool, policy: VerifyPolicy, max_batch_tokens: int, context_length: int,
                 explore_every: int = 16, max_logit_rows: int | None = None, block_size: int = 0):
        self.pool = pool
        self.policy = policy
        self.max_batch_tokens = max_batch_tokens
        # Logit rows one forward can return (a TensorRT engine's profile bounds them; None: no bound).
        self.max_logit_rows = max_logit_rows
        self.context_length = context_length
        self.block_size = block_size  # the drafter's block (0: unknown), what the policy's bound assumes
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Prefix survivals of each request's latest block: the lagged input of `drafting`.
        self.survival: dict[str, list[float]] = {}
        # What finished requests' drafts survived (a running mean): how a request that has not
        # drafted yet is judged, rather than letting it try whenever no running request has drafted.
        self.prior: list[float] | None = None
        # What verification found so far, per request: scales the survivals the policy sees.
        self.feedback = SurvivalFeedback()
        self.steps_since_draft = 0
        self.explore_every = explore_every  # steps without drafting after which the drafter runs once anyway
        self.explore_gap = explore_every  # the current gap: doubles while explorations keep finding no gain
        self.last_drafted: dict[str, int] = {}  # request id -> the step it last drafted in (who explores next)
        self.drafted_length: dict[str, int] = {}  # request id -> its length when it last drafted (what it caught up to)
        self.num_steps = 0
        # The policy's last choice and what it was made from: its inputs (survivals, feedback, the
        # drafter's measured cost) only change when something was drafted, so while nothing is, the
        # same requests get the same answer without asking again (~0.1-0.3 ms a step at 8-32).
        self._inputs_changed = True
        self._last_choice: tuple[tuple[str, ...], list[bool]] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan | None:
        """Admit, then plan the step; None when nothing runs."""
        admitted = []
        while self.waiting and self.pool.num_free_slots:
            request = self.waiting.popleft()
            request.cache = self.pool.allocate()
            self.running.append(request)
            admitted.append(request)
        if not self.running:
            return None
        stats = StepStats(num_running=len(self.running), num_waiting=len(self.waiting))
        stats.admitted_prompt_tokens = sum(len(r.prompt_token_ids) for r in admitted)
        decoding = [r for r in self.running if not r.in_prefill]
        stats.num_decoding = len(decoding)
        return StepPlan(decoding, self._drafting(decoding, stats), stats)

    def _drafting(self, decoding: list[Request], stats: StepStats) -> list[Request]:
        """The decoding requests the drafter runs for this step."""
        self.num_steps += 1
        if not self.policy.uses_drafter or not decoding:
            return []
        tick = time.perf_counter()
        ids = tuple(r.request_id for r in decoding)
        if self._inputs_changed or self._last_choice is None or self._last_choice[0] != ids:
            lagged = [self.survival.get(r.request_id) for r in decoding]
            # A request that has not drafted yet is judged by what finished requests' drafts survived
            # (None before any has: the policy then lets one try).
            chosen = self.policy.drafting([self.feedback.correct(r.request_id, row) if row else self.prior
                                           for r, row in zip(decoding, lagged)], self.block_size,
                                          [self._catch_up_positions(r) for r in decoding])
            self._last_choice, self._inputs_changed = (ids, chosen), False
        chosen = self._last_choice[1]
        drafting = [request for request, draft in zip(decoding, chosen) if draft]
        # Survivals only refresh when the drafter runs: explore now and then, so one bad block
        # (or a load spike) does not switch drafting off for good. An exploration drafts for one
        # request, the one that has gone longest without (a draft for one costs a fraction of a
        # step); while explorations keep finding no gain the gap doubles (16, 32, .. 256 steps), so
        # text the drafter cannot predict costs at most a fraction of a percent over plain
        # decoding, and a gain found again resets the gap. Where no draft could pay at this batch
        # (`VerifyPolicy.could_pay`: with other requests decoding, even a block as good as any
        # drafted so far), there is nothing to find: no exploration. A request decoding alone
        # breaks no lock step and its exploration costs a fraction of a step, so there the bound
        # stays a perfect block: with the evidence as bound, one poor first block stopped batch-1
        # GSM8K from ever drafting again (0.99x plain, against 1.62x in the run before).
        if drafting:
            self.explore_gap = self.explore_every
        elif self.steps_since_draft >= self.explore_gap and self.policy.could_pay(
                len(decoding), self.block_size, self.best_known_survival(decoding) if len(decoding) > 1 else None):
            drafting = [min(decoding, key=lambda r: self.last_drafted.get(r.request_id, -1))]
            self.explore_gap = min(2 * self.explore_gap, 16 * self.explore_every)
        for request in drafting:
            self.last_drafted[request.request_id] = self.num_steps
            self.drafted_length[request.request_id] = request.num_tokens
        self._inputs_changed = self._inputs_changed or bool(drafting)  # a draft updates survivals and costs
        stats.scheduler_seconds += time.perf_counter() - tick
        self.steps_since_draft = 0 if drafting else self.steps_since_draft + 1
        return drafting

    def best_known_survival(self, decoding: list[Request]) -> list[float] | None:
        """Position by position, the best prefix survival any block has shown: the running
        requests' latest blocks (as drafted) and the prior of finished ones. None before any
        block: no evidence, so no bound but a perfect block."""
        rows = [self.survival[r.request_id] for r in decoding if r.request_id in self.survival]
        rows += [self.prior] if self.prior else []
        if not rows:
            return None
        return [max(row[j] for row in rows if j < len(row)) for j in range(max(len(row) for row in rows))]

    def _update_prior(self, row: list[float]) -> None:
        """Fold a finished request's last (corrected) survivals into the prior for new requests."""
        if self.prior is None or len(self.prior) != len(row):
            self.prior = list(row)
        else:
            self.prior = [(1 - PRIOR_WEIGHT) * old + PRIOR_WEIGHT * new for old, new in zip(self.prior, row)]

    def _catch_up_positions(self, request: Request) -> int:
        """The catch-up this step's draft for `request` is charged, in positions: the positions it
        missed beyond a step's worth (which the profiled draft already includes; all since it last
        drafted, its prompt if it never did), spread over the steps it has left (at `KEPT_PER_STEP`
        tokens a step). A catch-up is paid once and lets every later step draft; charged whole to
        one step it made a request that paused look dearer the longer it paused, so it never
        resumed (measured: batch-1 GSM8K ~15% slower with the whole catch-up charged to one step)."""
        missed = max(0, request.num_tokens - self.drafted_length.get(request.request_id, 0) - KEPT_PER_STEP)
        steps_left = max(1, (request.params.max_tokens - len(request.output_token_ids)) // KEPT_PER_STEP)
        return missed // steps_left

    def pack(self, plan: StepPlan, blocks: list[Draft] | None) -> list[Feed]:
        """The step's feeds from the full draft `blocks` of `plan.decoding` (None: nothing drafted; an
        empty block for a request that did not draft)."""
        drafts = self._verify_budgets(plan, blocks) if blocks is not None else [Draft([]) for _ in plan.decoding]
        feeds, budget = [], self.max_batch_tokens
        for request, draft in zip(plan.decoding, drafts):
            tokens = [request.pending_token] + draft.tokens
            feeds.append(Feed(request, tokens, draft, num_logit_rows=len(tokens)))
            budget -= len(tokens)
        rows_left = (self.max_logit_rows or 2**62) - sum(feed.num_logit_rows for feed in feeds)
        scored_rows_left = PROMPT_LOGPROBS_ROWS
        for request in self.running:
            if request.in_prefill and (budget > 0 or not feeds):
                start = request.num_prompt_computed
                scored = request.params.prompt_logprobs is not None  # every row's logits, not the last one's
                size = min(max(budget, 1), scored_rows_left, rows_left) if scored else max(budget, 1)
                chunk = request.prompt_token_ids[start : start + size]
                completes = start + len(chunk) == len(request.prompt_token_ids)
                rows = len(chunk) if scored else int(completes)
                if not chunk or rows > rows_left:
                    continue  # no logit rows left this step: the next one
                feeds.append(Feed(request, chunk, None, rows, completes))
                budget -= len(chunk)
                rows_left -= rows
                scored_rows_left -= rows if scored else 0
        plan.feeds = feeds
        plan.stats.batch_tokens = sum(len(feed.token_ids) for feed in feeds)
        return feeds

    def _verify_budgets(self, plan: StepPlan, blocks: list[Draft]) -> list[Draft]:
        """Each request's block cut to the tokens the policy wants verified."""
        tick = time.perf_counter()
        survival, lengths = [], []
        for request, draft in zip(plan.decoding, blocks):
            # Never run past the context or max_tokens: the anchor, the draft and the bonus
            # token must all fit.
            room = min(self.context_length - request.cache.length - 1,
                       request.params.max_tokens - len(request.output_token_ids) - 1)
            lengths.append(max(0, min(len(draft.tokens), room)))
            row = prefix_survival(draft.confidences.tolist()) if draft.confidences is not None else []
            survival.append(self.feedback.correct(request.request_id, row))
            if row:
                self.survival[request.request_id] = row  # as drafted: corrected when used
        budgets = self.policy.budgets(survival, lengths, len(plan.drafting))  # the drafter ran for these
        plan.stats.scheduler_seconds += time.perf_counter() - tick
        plan.stats.verify_budget = sum(budgets)
        return [draft.cut(count) for draft, count in zip(blocks, budgets)]

    def record_verification(self, request: Request, verified: Draft, num_accepted: int) -> None:
        """The engine verified `verified` (the block as cut) and the target accepted `num_accepted`."""
        if verified.confidences is not None and verified.tokens:
            self.feedback.record(request.request_id, prefix_survival(verified.confidences.tolist()), num_accepted)

    def finish(self, request: Request) -> None:
        """Take a finished or aborted request out of the queues and free its KV slot."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        row = self.survival.pop(request.request_id, None)
        if row:
            self._update_prior(self.feedback.correct(request.request_id, row))
        self.last_drafted.pop(request.request_id, None)
        self.drafted_length.pop(request.request_id, None)
        self.feedback.forget(request.request_id)
        if request.cache is not None:
            self.pool.free(request.cache)
            request.cache = None
