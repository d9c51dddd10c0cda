"""The step loop: one target forward per step for every running request.

    step():
        admit waiting requests while there are free KV slots
        decoding requests: the policy decides whether the drafter runs (from earlier confidences);
            if so, draft a full block each, and the policy picks how many tokens each verifies
        for each running request choose what it feeds:
            prefill  -> the next chunk of its prompt
            decode   -> [pending token] + its verified draft tokens (none when nothing was drafted)
        run the target once on the ragged batch
        for each request: verify the draft, commit accepted tokens + the corrected/bonus token,
                          roll its KV cache back past rejected drafts, check EOS/stop/length

The engine is synchronous and single-threaded; batching across callers (the HTTP server) is
done by feeding `add_request` between steps (`engine_thread.py`). KV memory is a fixed pool of
slots: a request waits in the queue until a slot frees (admission control), so running out of
memory means waiting, never a crash.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dspark_trt.errors import InvalidRequestError
from dspark_trt.models.loading import LoadedTarget
from dspark_trt.models.target import TargetModel
from dspark_trt.runtime.profile import LatencyProfile
from dspark_trt.runtime.proposer import Draft, Proposer
from dspark_trt.runtime.request import FinishReason, Request
from dspark_trt.runtime.sampling import SamplingParams, next_token, target_probs, verify_draft
from dspark_trt.runtime.scheduler import VerifyPolicy, make_policy, prefix_survival
from dspark_trt.runtime.threads import ensure_cpu_threads_cooperate


@dataclass
class StepStats:
    """What one step did (the server's gauges and the benchmark read these)."""

    num_running: int = 0
    num_waiting: int = 0
    num_decoding: int = 0
    num_drafting: int = 0  # requests the drafter ran for (0 when the policy skipped drafting)
    batch_tokens: int = 0  # tokens the target processed (prefill chunks included)
    verify_budget: int = 0  # draft tokens sent to verification, summed over requests
    scheduler_seconds: float = 0.0  # the policy's own time
    drafter_seconds: float = 0.0
    step_seconds: float = 0.0


@dataclass
class EngineCounters:
    """Totals since start (Prometheus counters are read from these)."""

    num_steps: int = 0
    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    scheduler_seconds: float = 0.0
    step_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests

    def record_finish(self, reason: FinishReason) -> None:
        self.finished[reason.value] = self.finished.get(reason.value, 0) + 1

    def record_verification(self, num_verified: int, num_accepted: int) -> None:
        if num_verified == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_verified
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_verified:
            self.accepted_per_position.append(0)
        for k in range(num_accepted):
            self.accepted_per_position[k] += 1


class Engine:
    def __init__(self, target: LoadedTarget, proposer: Proposer | None = None,
                 max_batch_size: int = 32, max_batch_tokens: int = 2048, max_model_len: int = 2048,
                 feature_layers: tuple[int, ...] = (), policy: VerifyPolicy | str | None = None,
                 profile: LatencyProfile | None = None, batch_invariant: bool = False):
        """`batch_invariant`: a request's tokens do not depend on what else is batched with it
        (bit-identical target logits, each request drafted on its own); slow, for reproducibility."""
        ensure_cpu_threads_cooperate()
        if batch_invariant and not isinstance(target.model, TargetModel):
            raise InvalidRequestError("batch_invariant needs the built-in PyTorch target, not a "
                                      f"{type(target.model).__name__} backend", "batch_invariant")
        self.batch_invariant = batch_invariant
        self.target = target
        self.policy = self._check_policy(policy, proposer)
        if not self.policy.uses_drafter:
            proposer = None  # plain decoding: the drafter neither runs nor keeps state
        # Target layers whose outputs each step hands to requests (`Request.new_features`): what
        # the drafter conditions on, and what datagen caches for training.
        self.feature_layers = tuple(feature_layers) or tuple(getattr(proposer, "feature_layers", ()))
        self.proposer = proposer
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        # The longest sequence (prompt + output) a request may reach: the model's context, or
        # less to bound KV memory (every running request owns a slot of this many positions).
        self.context_length = min(target.config.max_position_embeddings, max_model_len)
        self.pool = target.model.new_pool(max_batch_size, self.context_length)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.counters = EngineCounters()
        self.last_step = StepStats()
        # Prefix survivals of each request's latest block: the lagged input of `should_draft`.
        self.survival: dict[str, list[float]] = {}
        self.steps_since_draft = 0
        self.explore_every = 16  # steps without drafting after which the drafter runs once anyway
        self.profile = profile
        if self.policy.needs_profile and profile is None:
            # No profile given: a quick one now beats deciding blind (which is verify-all).
            from dspark_trt.runtime.profile import measure_latency_profile

            self.profile = measure_latency_profile(target, proposer, max_batch_tokens=min(256, max_batch_tokens),
                                                   max_requests=max_batch_size, quick=True)
        self.policy.set_profile(self.profile)

    @staticmethod
    def _check_policy(policy: VerifyPolicy | str | None, proposer: Proposer | None) -> VerifyPolicy:
        if policy is None:
            policy = "all" if proposer is not None else "none"
        if policy == "auto":  # the best this drafter allows
            policy = "dspark" if getattr(proposer, "has_confidence", False) else ("all" if proposer else "none")
        if isinstance(policy, str):
            policy = make_policy(policy)
        if policy.uses_drafter and proposer is None:
            raise InvalidRequestError(f"policy {policy.name} needs a drafter (give one, or use policy none)", "policy")
        if policy.needs_confidence and not getattr(proposer, "has_confidence", False):
            raise InvalidRequestError(f"policy {policy.name} needs a drafter with a confidence head "
                                      "(a DSpark drafter); use fixed:K for this one", "policy")
        return policy

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
        )

    def enqueue(self, request: Request) -> None:
        """Queue a request; it is admitted when a KV slot is free (first come, first served)."""
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if not request.finished:  # a finished request keeps its reason; it is only cleaned up
            request.finish_reason = FinishReason.ABORT
            self.counters.record_finish(FinishReason.ABORT)
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            self._release(request)

    def _release(self, request: Request) -> None:
        self.survival.pop(request.request_id, None)
        if hasattr(self.proposer, "release"):
            self.proposer.release(request)
        if request.cache is not None:
            self.pool.free(request.cache)
            request.cache = None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one target forward; return the requests that committed tokens or finished."""
        step_start = time.perf_counter()
        while self.waiting and self.pool.num_free_slots:
            request = self.waiting.popleft()
            request.cache = self.pool.allocate()
            self.running.append(request)
            self.counters.num_prompt_tokens += len(request.prompt_token_ids)
        if not self.running:
            return []

        stats = StepStats(num_running=len(self.running), num_waiting=len(self.waiting))
        decoding = [r for r in self.running if not r.in_prefill]
        stats.num_decoding = len(decoding)
        drafts = self._drafts_for(decoding, stats)
        feeds: list[tuple[Request, list[int], Draft | None]] = []
        budget = self.max_batch_tokens
        for request in decoding:
            draft = drafts[request.request_id]
            feeds.append((request, [request.pending_token] + draft.tokens, draft))
            budget -= 1 + len(draft.tokens)
        for request in self.running:
            if request.in_prefill and (budget > 0 or not feeds):
                start = request.num_prompt_computed
                chunk = request.prompt_token_ids[start : start + max(budget, 1)]
                feeds.append((request, chunk, None))
                budget -= len(chunk)
        stats.batch_tokens = sum(len(tokens) for _, tokens, _ in feeds)

        # Logits: every position of a decode feed; the last prompt token of a finishing prefill.
        logits_indices, offset = [], 0
        for request, tokens, draft in feeds:
            if draft is not None:
                logits_indices.extend(range(offset, offset + len(tokens)))
            elif request.num_prompt_computed + len(tokens) == len(request.prompt_token_ids):
                logits_indices.append(offset + len(tokens) - 1)
            offset += len(tokens)
        output = self.target.model(
            torch.tensor([t for _, tokens, _ in feeds for t in tokens]),
            [len(tokens) for _, tokens, _ in feeds],
            [request.cache for request, _, _ in feeds],
            torch.tensor(logits_indices, dtype=torch.long),  # may be empty: mid-prompt chunks only
            self.feature_layers,
            # only passed when on: other backends (TensorRT) take no such argument, and __init__
            # allows the mode only with the PyTorch TargetModel
            **({"batch_invariant": True} if self.batch_invariant else {}),
        )
        # Sampling, verification and the drafter run on the CPU: a GPU target hands its rows over
        # once per step (a no-op for a CPU target).
        logits_rows = output.logits.cpu()  # [num_logits, vocab]
        feature_rows = output.features.cpu() if output.features is not None else None  # [tokens, m * hidden]

        updated, row, offset = [], 0, 0
        for request, tokens, draft in feeds:
            if draft is None:  # prefill chunk: logits only if it completes the prompt
                request.num_prompt_computed += len(tokens)
                num_kept, num_logit_rows = len(tokens), 0 if request.in_prefill else 1
                logits = logits_rows[row : row + num_logit_rows]
                if num_logit_rows:
                    self._commit(request, [next_token(logits[0], request.params, request.generator)])
            else:  # anchor + draft block: verify
                logits = logits_rows[row : row + len(tokens)]
                num_logit_rows = len(tokens)
                greedy = request.params.greedy  # greedy verification reads the argmax only: logits will do
                num_accepted, corrected = verify_draft(draft.tokens, draft.probs,
                                                       logits if greedy else target_probs(logits, request.params),
                                                       request.generator, greedy)
                request.stats.record(len(draft.tokens), num_accepted)
                self.counters.record_verification(len(draft.tokens), num_accepted)
                # The cache holds [.., pending, d_1..d_l]; keep pending and the accepted drafts.
                request.cache.truncate(request.cache.length - len(draft.tokens) + num_accepted)
                self._commit(request, draft.tokens[:num_accepted] + [corrected])
                num_kept = 1 + num_accepted
                logits = logits[:num_kept]
            # Hand over what the kept positions produced; rejected drafts' rows are dropped
            # together with their KV entries.
            request.new_logits = logits
            if feature_rows is not None:
                request.new_features = feature_rows[offset : offset + num_kept]
            row += num_logit_rows
            offset += len(tokens)
            updated.append(request)
            # Keep the drafter's context current every step. Not for a request that just finished:
            # EOS or a stop string inside the accepted drafts leaves kept positions without a
            # committed token after them, and its drafter state is released anyway.
            if hasattr(self.proposer, "observe") and not request.finished:
                self.proposer.observe(request)
        for request in self.running:
            if request.finished:
                self.counters.record_finish(request.finish_reason)
                self._release(request)
        self.running = [r for r in self.running if not r.finished]
        stats.step_seconds = time.perf_counter() - step_start
        self.counters.num_steps += 1
        self.counters.scheduler_seconds += stats.scheduler_seconds
        self.counters.step_seconds += stats.step_seconds
        self.last_step = stats
        return updated

    def _drafts_for(self, requests: list[Request], stats: StepStats) -> dict[str, Draft]:
        """Each request's draft block, cut to the tokens the policy wants verified."""
        no_drafts = {r.request_id: Draft([]) for r in requests}
        if self.proposer is None or not requests:
            return no_drafts
        tick = time.perf_counter()
        draft_now = self.policy.should_draft([self.survival.get(r.request_id) for r in requests])
        # Survivals only refresh when the drafter runs: explore now and then, so one bad block
        # (or a load spike) does not switch drafting off for good.
        draft_now = draft_now or self.steps_since_draft >= self.explore_every
        stats.scheduler_seconds += time.perf_counter() - tick
        if not draft_now:
            self.steps_since_draft += 1
            return no_drafts
        self.steps_since_draft = 0

        tick = time.perf_counter()
        if self.batch_invariant:  # a batched drafter pass would round each request's draft by the batch
            blocks = [block for request in requests for block in self.proposer.propose([request])]
        else:
            blocks = self.proposer.propose(requests)  # always full blocks: the trained block size
        stats.drafter_seconds = time.perf_counter() - tick
        stats.num_drafting = len(requests)

        tick = time.perf_counter()
        confidences = getattr(self.proposer, "last_confidences", {})
        survival, lengths = [], []
        for request, draft in zip(requests, blocks):
            # Never run past the context or max_tokens: the anchor, the draft and the bonus
            # token must all fit.
            room = min(self.context_length - request.cache.length - 1,
                       request.params.max_tokens - len(request.output_token_ids) - 1)
            lengths.append(max(0, min(len(draft.tokens), room)))
            confidence = confidences.get(request.request_id)
            row = prefix_survival(confidence.tolist()) if confidence is not None else []
            survival.append(row)
            if row:
                self.survival[request.request_id] = row
        budgets = self.policy.budgets(survival, lengths, len(requests))
        stats.scheduler_seconds += time.perf_counter() - tick

        drafts = {}
        for request, draft, count in zip(requests, blocks, budgets):
            drafts[request.request_id] = Draft(draft.tokens[:count], None if draft.probs is None else draft.probs[:count])
            stats.verify_budget += count
        return drafts

    def _commit(self, request: Request, tokens: list[int]) -> None:
        """Append tokens one at a time, stopping at EOS, a stop string, max_tokens or the context end.

        Checked token by token so that a speculative step that commits several tokens ends exactly
        where plain decoding would have.
        """
        params = request.params
        eos = self.target.eos_token_ids
        for token in tokens:
            request.output_token_ids.append(token)
            self.counters.num_generated_tokens += 1
            if token in eos and not params.ignore_eos:
                request.finish_reason = FinishReason.STOP
            elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.context_length:
                request.finish_reason = FinishReason.LENGTH
            if params.stop:
                self._update_text(request)
            if request.finished:
                break
        if not params.stop:
            self._update_text(request)

    def _update_text(self, request: Request) -> None:
        text = self.target.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        stops = request.params.stop
        if stops:
            # A stop string that was not in the old text must end in the new part of it.
            window_start = max(0, len(request.output_text) - max(map(len, stops)))
            hits = [i for i in (text.find(s, window_start) for s in stops) if i >= 0]
            if hits:
                text = text[: min(hits)]
                request.finish_reason = FinishReason.STOP
        request.output_text = text
