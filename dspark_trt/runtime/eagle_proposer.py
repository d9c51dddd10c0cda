"""Drafting with an autoregressive (EAGLE-3-style or MTP-1) drafter in the step loop.

The drafter's cache holds the keys/values of every position t from 0 through the pending token
p, each computed from (x_t, fused target feature f_{t-1}): once the target has features up to
p-1, all of these inputs are final. `observe` extends it as the target commits tokens and keeps
the output at p.
`propose` then chains: the output at p predicts x_{p+1}; position p+1 takes (x_{p+1}, own
output at p); and so on for `block_size` tokens. The chain's keys are scratch, dropped each step.
"""

from __future__ import annotations

import torch

from dspark_trt.models.eagle import EagleDrafter
from dspark_trt.runtime.dspark_proposer import ContextCache
from dspark_trt.runtime.proposer import Draft, Proposer, draw_tokens, reads_draft_probs, to_target_vocab
from dspark_trt.runtime.request import Request


class EagleState:
    def __init__(self):
        self.cache = ContextCache(1)  # drafter keys/values of positions 0 .. pending
        self.last_output: torch.Tensor | None = None  # layer output at the newest position, [1, 1, d]


class EagleProposer(Proposer):
    def __init__(self, drafter: EagleDrafter):
        self.drafter = drafter.eval()
        self.feature_layers = tuple(drafter.config.feature_layers)
        self.block_size = drafter.config.block_size
        self.states: dict[str, EagleState] = {}
        # no confidence head (`has_confidence` stays False): fixed:K, all or none only

    @torch.inference_mode()
    def observe(self, request: Request, features: torch.Tensor) -> None:
        """Target features `[k, m * d]` of k more positions arrived, so k more positions have both
        inputs (x_t and f_{t-1}); on the first call also position 0, whose feature input is zero."""
        if not len(features):
            return
        state = self.states.setdefault(request.request_id, EagleState())
        fused = self.drafter.fuse_features(features.cpu())[None]  # [1, k, d]; drafts on the CPU
        start = state.cache.length
        if start == 0:
            fused = torch.cat([torch.zeros_like(fused[:, :1]), fused], dim=1)
        count = fused.shape[1]
        tokens = (request.prompt_token_ids + request.output_token_ids)[start : start + count]
        positions = torch.arange(start, start + count)[None]
        keys = torch.arange(start + count)
        mask = (keys[None] <= (start + torch.arange(count))[:, None])[None]  # causal, [1, count, start + count]
        x = self.drafter.inputs(torch.tensor(tokens)[None], fused)
        output, kv = self.drafter.step(x, positions, *self._context(state), mask)
        state.cache.append([kv])
        state.last_output = output[:, -1:]

    def _context(self, state: EagleState):
        if state.cache.length == 0:
            return self.drafter.empty_kv(1)
        return state.cache.views()[0]

    def release(self, request: Request) -> None:
        self.states.pop(request.request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[Draft]:
        return [self._draft(request) for request in requests]

    def _draft(self, request: Request) -> Draft:
        drafter, state = self.drafter, self.states[request.request_id]
        context_k, context_v = state.cache.views()[0]
        pending = state.cache.length - 1
        output = state.last_output
        tokens, distributions = [], []
        chain_k = context_k[:, :, :0]
        chain_v = context_v[:, :, :0]
        for j in range(self.block_size):
            choice, probs = draw_tokens(drafter.logits(output)[0], [request], j, drafter.draft_vocab)  # [1], [1, V_d] | None
            if probs is not None:
                distributions.append(probs[0])
            tokens.append(int(drafter.draft_vocab[choice[0]]))
            if j + 1 == self.block_size:
                break
            position = torch.tensor([[pending + j + 1]])
            x = drafter.inputs(torch.tensor([[tokens[-1]]]), drafter.next_feature(output))
            output, (k, v) = drafter.step(x, position, torch.cat([context_k, chain_k], 2),
                                          torch.cat([context_v, chain_v], 2), None)
            chain_k, chain_v = torch.cat([chain_k, k], 2), torch.cat([chain_v, v], 2)
        full_probs = None
        if distributions and reads_draft_probs(request):
            full_probs = to_target_vocab(torch.stack(distributions), drafter.draft_vocab, drafter.config.target_vocab_size)
        return Draft(tokens, full_probs)
