"""Drafting with a trained DSpark/DFlash drafter inside the step loop.

Per request the proposer keeps the drafter's *context cache*: for every backbone layer, the
keys/values of the fused target features of every position the target has committed. Each
step the engine hands over the features of the positions it kept (`observe`), so the cache is
current even when a request verified nothing; `propose` then drafts one block per request:

    hidden = backbone([pending, MASK x (gamma-1)] at positions p .. p+gamma-1, context < p)
    U = hidden @ LM head (draft vocabulary)
    for k in 1..gamma:                      # the sequential head, left to right
        p_k = softmax((U_k + B(x_{k-1})) / T)    x_k = argmax p_k  (T = 0)  or  x_k ~ p_k
        c_k = confidence(h_k, x_{k-1})

The draft distributions are returned over the full target vocabulary, so verification is exact.
"""

from __future__ import annotations

import torch

from dspark_trt.models.drafter import DSparkDrafter
from dspark_trt.runtime.proposer import Draft
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.sampling import sample


class ContextCache:
    """Drafter keys/values of one request's context, `[1, kv_heads, capacity, head_dim]` per layer."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def append(self, per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        count = per_layer[0][0].shape[2]
        for i, (k, v) in enumerate(per_layer):
            if self.keys[i] is None or self.length + count > self.keys[i].shape[2]:
                capacity = max(2 * (self.length + count), 64)
                grown_k = k.new_zeros(1, k.shape[1], capacity, k.shape[3])
                grown_v = torch.zeros_like(grown_k)
                if self.keys[i] is not None:
                    grown_k[:, :, : self.length] = self.keys[i][:, :, : self.length]
                    grown_v[:, :, : self.length] = self.values[i][:, :, : self.length]
                self.keys[i], self.values[i] = grown_k, grown_v
            self.keys[i][:, :, self.length : self.length + count] = k
            self.values[i][:, :, self.length : self.length + count] = v
        self.length += count

    def views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.keys, self.values)]


class DSparkProposer:
    def __init__(self, drafter: DSparkDrafter):
        self.drafter = drafter.eval()
        self.feature_layers = tuple(drafter.config.feature_layers)
        self.block_size = drafter.config.block_size
        self.contexts: dict[str, ContextCache] = {}
        self.last_confidences: dict[str, torch.Tensor] = {}  # request id -> [gamma] calibrated c_k

    @torch.inference_mode()
    def observe(self, request: Request) -> None:
        """Append the target features of the positions the last step kept for `request`."""
        if request.new_features is None or not len(request.new_features):
            return
        cache = self.contexts.setdefault(request.request_id, ContextCache(len(self.drafter.layers)))
        features = request.new_features
        positions = torch.arange(cache.length, cache.length + features.shape[0])
        context = self.drafter.fuse_features(features)[None]  # [1, n, d]
        cache.append(self.drafter.context_keys_values(context, positions[None]))
        request.new_features = None

    def release(self, request: Request) -> None:
        self.contexts.pop(request.request_id, None)
        self.last_confidences.pop(request.request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> list[Draft]:
        return [self._draft(request) for request in requests]

    def _draft(self, request: Request) -> Draft:
        drafter = self.drafter
        cache = self.contexts[request.request_id]
        anchor_position = cache.length  # the pending token's position: every earlier one is context
        positions = torch.arange(anchor_position, anchor_position + self.block_size)[None]
        block = drafter.block_inputs(torch.tensor([request.pending_token]), (1,))  # [1, gamma, d]
        hidden = drafter.backbone(block, positions, cache.views(), mask=None)[0]  # [gamma, d]
        backbone_logits = drafter.backbone_logits(hidden)  # [gamma, V_d]

        params = request.params
        previous = [int(drafter.to_draft[request.pending_token])]  # draft-vocab ids of x_0 .. x_{gamma-1}
        tokens, distributions, state = [], [], None
        for k in range(self.block_size):
            bias, state = drafter.sequential_bias(hidden[k], torch.tensor(previous[-1]), state)
            logits = backbone_logits[k] if bias is None else backbone_logits[k] + bias
            if params.greedy:
                choice = int(logits.argmax())
            else:
                probs = torch.softmax(logits.float() / params.temperature, dim=-1)
                choice = sample(probs, request.generator)
                distributions.append(probs)
            tokens.append(int(drafter.draft_vocab[choice]))
            previous.append(choice)
        # Confidences need only h_k and x_{k-1}: one batched call once the block is drafted.
        confidence = drafter.confidence_logits(hidden, torch.tensor(previous[:-1]))
        if confidence is not None:
            self.last_confidences[request.request_id] = drafter.calibrated_confidence(confidence)

        full_probs = None
        if distributions:  # over the whole target vocabulary: zero outside the draft vocabulary
            full_probs = torch.zeros(self.block_size, drafter.config.target_vocab_size)
            full_probs[:, drafter.draft_vocab] = torch.stack(distributions)
        return Draft(tokens, full_probs)
