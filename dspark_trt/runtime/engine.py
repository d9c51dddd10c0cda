"""The step loop: one target forward per step for every running request.

    step():
        plan    = scheduler.schedule()          admit waiting requests into free KV slots; who decodes;
                                                who the drafter runs for (the policy, from earlier confidences)
        blocks  = proposer.propose(drafting)    full draft blocks for those (an empty one for the rest)
        feeds   = scheduler.pack(plan, blocks)  each block cut to the policy's budget; prompt chunks
                                                in the rest of the token budget; which rows need logits
        run     = runner.run(feeds)             one target forward on the ragged batch
        verdict = rejection_sample(feeds, run)  accepted drafts + the recovered or bonus token
        postprocess                             commit (EOS / stop / length; logprobs of what was
                                                kept, scores of prompt chunks), roll the KV cache back
                                                past rejected drafts, hand kept features to the
                                                drafter, finish and release

Each part is its own module with typed inputs and outputs (`scheduler.Feed`,
`model_runner.RunnerOutput`, `rejection_sampler.Verdict`, `StepOutput`); this one only wires
them together and keeps the counters. The engine is synchronous and single-threaded;
batching across callers (the HTTP server) is done by feeding `add_request` between steps
(`engine_thread.py`). KV memory is a fixed pool of slots: a request waits in the queue until a
slot frees (admission control), so running out of memory means waiting, never a crash.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import torch

from dspark_trt.errors import InvalidRequestError
from dspark_trt.models.loading import LoadedTarget
from dspark_trt.runtime.model_runner import ModelRunner, RunnerOutput
from dspark_trt.runtime.output_processor import OutputProcessor
from dspark_trt.runtime.profile import LatencyProfile
from dspark_trt.runtime.proposer import Draft, Proposer
from dspark_trt.runtime.rejection_sampler import Verdict, rejection_sample
from dspark_trt.runtime.request import FinishReason, Request
from dspark_trt.runtime.sampling import PositionNoise, SamplingParams
from dspark_trt.runtime.scheduler import Feed, Scheduler, StepPlan
from dspark_trt.runtime.stats import EngineCounters, StepStats
from dspark_trt.runtime.threads import ensure_cpu_threads_cooperate
from dspark_trt.runtime.verify_policy import VerifyPolicy, resolve_policy


@dataclass
class StepOutput:
    """What one step did for one request: the tokens it committed and what the target computed
    at the positions it kept (its prompt chunk, or its anchor and accepted drafts)."""

    request: Request
    new_token_ids: list[int]  # committed this step (possibly none: a mid-prompt chunk)
    logits: torch.Tensor  # [kept positions with logits, vocab]
    features: torch.Tensor | None  # [kept positions, m * hidden], on the target's device; None: no feature layers


class Engine:
    def __init__(self, target: LoadedTarget, proposer: Proposer | None = None,
                 max_batch_size: int = 32, max_batch_tokens: int = 2048, max_model_len: int = 2048,
                 feature_layers: tuple[int, ...] = (), policy: VerifyPolicy | str | None = None,
                 profile: LatencyProfile | None = None, batch_invariant: bool = False):
        """`policy`: a name (`verify_policy.resolve_policy`; default `auto`) or a policy.
        `feature_layers`: target layers whose outputs every `StepOutput` carries (datagen caches
        them; default: the drafter's). `batch_invariant`: a request's tokens do not depend on what
        else is batched with it (bit-identical target logits, each request drafted on its own);
        slow, for reproducibility."""
        ensure_cpu_threads_cooperate()
        self.target = target
        self.policy = resolve_policy(policy, proposer is not None, proposer is not None and proposer.has_confidence)
        self.proposer = proposer if self.policy.uses_drafter else None  # plain decoding: the drafter keeps no state
        self.runner = ModelRunner(target, tuple(feature_layers) or (proposer.feature_layers if self.proposer else ()),
                                  batch_invariant)
        target.model.prepare()  # the first request should not pay the kernels' weight packing
        self.max_batch_size = max_batch_size
        # The longest sequence (prompt + output) a request may reach: the model's context, or
        # less to bound KV memory (every running request owns a slot of this many positions).
        self.context_length = min(target.config.max_position_embeddings, max_model_len)
        self.pool = target.model.new_pool(max_batch_size, self.context_length)
        self.scheduler = Scheduler(self.pool, self.policy, max_batch_tokens, self.context_length,
                                   max_logit_rows=getattr(target.model, "max_logit_rows", None),
                                   block_size=self.proposer.block_size if self.proposer is not None else 0)
        self.output_processor = OutputProcessor(target.tokenizer, target.eos_token_ids, self.context_length)
        self._ids = itertools.count()
        self.counters = EngineCounters()
        self.last_step = StepStats()
        self.profile = profile
        self._drafted_last_step: set[str] = set()  # who drafted in the previous step (`_propose`)
        if self.policy.needs_profile and profile is None:
            # No profile given: a quick one now beats deciding blind (which is verify-all).
            from dspark_trt.runtime.profile import measure_latency_profile

            self.profile = measure_latency_profile(target, self.proposer, max_batch_tokens=min(256, max_batch_tokens),
                                                   max_requests=max_batch_size, quick=True)
        self.policy.set_profile(self.profile)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.runner.feature_layers

    @property
    def batch_invariant(self) -> bool:
        return self.runner.batch_invariant

    @property
    def max_batch_tokens(self) -> int:
        return self.scheduler.max_batch_tokens

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def kv_usage(self) -> float:
        """Fraction of KV slots in use."""
        return 1.0 - self.pool.num_free_slots / self.pool.num_slots

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        self.check_prompt(prompt_token_ids)
        request = self.new_request(prompt_token_ids, params, request_id)
        self.enqueue(request)
        return request

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise `InvalidRequestError` for a prompt this engine cannot run."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(prompt_token_ids) >= self.context_length:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens but the model's context is "
                f"{self.context_length} tokens (the prompt must leave room for at least one new token)",
                "prompt",
            )
        vocab = self.target.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")

    def new_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        return Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            generator=params.make_generator(),
            noise=PositionNoise(params.seed) if params.seeded_sampling else None,
        )

    def enqueue(self, request: Request) -> None:
        """Queue a request; it is admitted when a KV slot is free (first come, first served)."""
        self.scheduler.add(request)

    def abort(self, request: Request) -> None:
        if not request.finished:  # a finished request keeps its reason; it is only cleaned up
            request.finish_reason = FinishReason.ABORT
            self.counters.record_finish(FinishReason.ABORT)
        if request in self.running:
            self._release(request)
        else:
            self.scheduler.finish(request)

    def _release(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(request)
        self.output_processor.release(request)
        self.scheduler.finish(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one target forward; return what it did for each request that ran."""
        step_start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        blocks = self._propose(plan) if plan.draft_now else None
        feeds = self.scheduler.pack(plan, blocks)
        run = self.runner.run(feeds)
        verdicts = rejection_sample(feeds, run.logits)
        outputs = self._postprocess(feeds, run, verdicts)
        self._finish_step(plan.stats, step_start)
        return outputs

    def _propose(self, plan: StepPlan) -> list[Draft]:
        """Full draft blocks (the drafter's trained block size) for the requests that draft, an
        empty one for each other decoding request: one per `plan.decoding`."""
        tick = time.perf_counter()
        if self.batch_invariant:  # a batched drafter pass would round each request's draft by the batch
            drafted = [block for request in plan.drafting for block in self.proposer.propose([request])]
        else:
            drafted = self.proposer.propose(plan.drafting)
        plan.stats.drafter_seconds = time.perf_counter() - tick
        plan.stats.num_drafting = len(plan.drafting)
        drafting = {request.request_id for request in plan.drafting}
        if drafting <= self._drafted_last_step:
            # A draft's cost as the policy weighs it: every request drafted last step too, so its
            # catch-up is one step's positions. After steps without drafting the catch-up is longer,
            # and counting it would make drafting look dearer the rarer it is, which stops it.
            self.policy.observe_drafter(plan.stats.num_drafting, plan.stats.drafter_seconds)
        self._drafted_last_step = drafting
        by_request = {id(request): block for request, block in zip(plan.drafting, drafted)}
        blocks = [by_request.get(id(request), Draft([])) for request in plan.decoding]
        return blocks

    def _postprocess(self, feeds: list[Feed], run: RunnerOutput, verdicts: list[Verdict]) -> list[StepOutput]:
        outputs = []
        for feed, logits, features, verdict in zip(feeds, run.logits, run.features, verdicts):
            request = feed.request
            if feed.is_prefill:
                start = request.num_prompt_computed
                request.num_prompt_computed += len(feed.token_ids)
                num_kept = len(feed.token_ids)
                if request.params.prompt_logprobs is not None:
                    self.output_processor.score_prompt(request, start, logits)
                token_rows = logits[-1:]  # the first output token comes from the prompt's last row
            else:
                num_verified = len(feed.draft.tokens)
                request.stats.record(num_verified, verdict.num_accepted)
                self.scheduler.record_verification(request, feed.draft, verdict.num_accepted)
                self.counters.record_verification(num_verified, verdict.num_accepted)
                # The cache holds [.., pending, d_1..d_l]; keep pending and the accepted drafts.
                request.cache.truncate(request.cache.length - num_verified + verdict.num_accepted)
                num_kept = 1 + verdict.num_accepted
                if num_kept < len(logits):  # rejected drafts' rows go with their KV entries
                    logits = logits[:num_kept]
                token_rows = logits
            committed = self.output_processor.commit(request, verdict.token_ids, token_rows)
            self.counters.num_generated_tokens += committed
            if features is not None:
                features = features[:num_kept] if num_kept < len(features) else features
                # Keep the drafter's context current every step. Not for a request that just
                # finished: EOS or a stop string inside the accepted drafts leaves kept positions
                # without a committed token after them, and its drafter state is released anyway.
                if self.proposer is not None and not request.finished and len(features):
                    self.proposer.observe(request, features)
            outputs.append(StepOutput(request, request.output_token_ids[len(request.output_token_ids) - committed:],
                                      logits, features))
        for request in list(self.running):
            if request.finished:
                self.counters.record_finish(request.finish_reason)
                self._release(request)
        return outputs

    def _finish_step(self, stats: StepStats, step_start: float) -> None:
        stats.step_seconds = time.perf_counter() - step_start
        if not stats.num_drafting:
            self._drafted_last_step = set()
        if stats.decoding_only:
            self.policy.observe_step(stats.num_decoding, stats.batch_tokens, stats.step_seconds, stats.drafter_seconds)
        self.counters.record_step(stats)
        self.last_step = stats
