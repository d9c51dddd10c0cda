"""The step loop: one target forward per step for every running request.

    step():
        admit waiting requests while there is room
        for each running request choose what it feeds:
            prefill  -> the next chunk of its prompt
            decode   -> [pending token] + its draft block (empty without a drafter)
        run the target once on the ragged batch
        for each request: verify the draft, commit accepted tokens + the corrected/bonus token,
                          roll its KV cache back past rejected drafts, check EOS/stop/length

The engine is synchronous and single-threaded; batching across callers (the HTTP server) is
done by feeding `add_request` between steps.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from dspark_trt.errors import InvalidRequestError
from dspark_trt.models.loading import LoadedTarget
from dspark_trt.runtime.proposer import Draft, Proposer
from dspark_trt.runtime.request import FinishReason, Request
from dspark_trt.runtime.threads import ensure_cpu_threads_cooperate
from dspark_trt.runtime.sampling import SamplingParams, sample, target_probs, verify_draft


class Engine:
    def __init__(self, target: LoadedTarget, proposer: Proposer | None = None,
                 max_batch_size: int = 32, max_batch_tokens: int = 2048, max_model_len: int = 2048,
                 feature_layers: tuple[int, ...] = ()):
        ensure_cpu_threads_cooperate()
        self.target = target
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

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
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
        request = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            generator=params.make_generator(),
        )
        self.waiting.append(request)
        return request

    def abort(self, request: Request) -> None:
        request.finish_reason = FinishReason.ABORT
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            self._release(request)

    def _release(self, request: Request) -> None:
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
        while self.waiting and self.pool.num_free_slots:
            request = self.waiting.popleft()
            request.cache = self.pool.allocate()
            self.running.append(request)
        if not self.running:
            return []

        decoding = [r for r in self.running if not r.in_prefill]
        drafts = self._drafts_for(decoding)
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
            torch.tensor(logits_indices),
            self.feature_layers,
        )

        updated, row, offset = [], 0, 0
        for request, tokens, draft in feeds:
            if draft is None:  # prefill chunk: logits only if it completes the prompt
                request.num_prompt_computed += len(tokens)
                num_kept, num_logit_rows = len(tokens), 0 if request.in_prefill else 1
                logits = output.logits[row : row + num_logit_rows]
                if num_logit_rows:
                    self._commit(request, [sample(target_probs(logits, request.params)[0], request.generator)])
            else:  # anchor + draft block: verify
                logits = output.logits[row : row + len(tokens)]
                num_logit_rows = len(tokens)
                num_accepted, next_token = verify_draft(draft.tokens, draft.probs, target_probs(logits, request.params),
                                                        request.generator, request.params.greedy)
                request.stats.record(len(draft.tokens), num_accepted)
                # The cache holds [.., pending, d_1..d_l]; keep pending and the accepted drafts.
                request.cache.truncate(request.cache.length - len(draft.tokens) + num_accepted)
                self._commit(request, draft.tokens[:num_accepted] + [next_token])
                num_kept = 1 + num_accepted
                logits = logits[:num_kept]
            # Hand over what the kept positions produced; rejected drafts' rows are dropped
            # together with their KV entries.
            request.new_logits = logits
            if output.features is not None:
                request.new_features = output.features[offset : offset + num_kept]
            row += num_logit_rows
            offset += len(tokens)
            updated.append(request)
            if hasattr(self.proposer, "observe"):  # keep the drafter's context current every step
                self.proposer.observe(request)
        for request in self.running:
            if request.finished:
                self._release(request)
        self.running = [r for r in self.running if not r.finished]
        return updated

    def _drafts_for(self, requests: list[Request]) -> dict[str, Draft]:
        if self.proposer is None or not requests:
            return {r.request_id: Draft([]) for r in requests}
        drafts = {}
        for request, draft in zip(requests, self.proposer.propose(requests)):
            # Never run past the context: the draft plus the anchor must fit in it.
            room = self.context_length - request.cache.length - 1
            room = min(room, request.params.max_tokens - len(request.output_token_ids))
            if len(draft.tokens) > room:
                room = max(room, 0)
                draft = Draft(draft.tokens[:room], None if draft.probs is None else draft.probs[:room])
            drafts[request.request_id] = draft
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
