"""Autoregressive baselines from the same parts: EAGLE-3-style and MTP-1 drafters.

One decoder layer drafts token by token. The input at position t combines the embedding of
token x_t with a feature of position t-1: the fused target features when t-1 is committed,
otherwise the drafter's own output at t-1 (it has no target features for tokens it drafted).
Its output at t predicts x_{t+1} through the target's LM head (draft vocabulary).

- EAGLE-3-style: trained with *training-time test* over `block_size` (7) steps, so it learns to
  consume its own outputs as features; drafts `block_size` tokens per step.
- MTP-1: the same drafter with one step: one draft token, two tokens verified a step.

Training-time test in one picture, for an anchor a (the pending token's position):
    step 1   at a:        (x_a,   f_{a-1})   attends to positions 0..a (all teacher-forced)
    step j   at a + j-1:  (x_{a+j-1}, g_{a+j-2}) attends to 0..a plus this anchor's chain
"""

from __future__ import annotations

import torch

from dspark_trt.models.drafter import BlockVisibility, DraftLayer, DrafterBase, RMSNorm, rope_tables
from dspark_trt.models.linear import DraftLinear


class EagleDrafter(DrafterBase):
    def __init__(self, config, draft_vocab: torch.Tensor):
        super().__init__(config, draft_vocab)
        d = config.hidden_size
        self.token_norm = RMSNorm(d, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)  # own outputs re-enter as features
        self.combine = DraftLinear(2 * d, d, bias=False)
        self.layer = DraftLayer(config)

    def draft_layers(self):
        return [self.layer]

    def inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """tokens `[...]`, features `[..., d]` (already fused or normed) -> layer inputs `[..., d]`."""
        return self.combine(torch.cat([self.token_norm(self.embed[tokens]), features], dim=-1))

    def shifted_features(self, fused: torch.Tensor) -> torch.Tensor:
        """Fused features of positions 0..n-1 `[B, n, d]` -> the feature input of positions 0..n-1
        (position t gets f_{t-1}; position 0 gets zeros)."""
        return torch.cat([torch.zeros_like(fused[:, :1]), fused[:, :-1]], dim=1)

    def step(self, x: torch.Tensor, positions: torch.Tensor, context_keys: torch.Tensor, context_values: torch.Tensor,
             mask: torch.Tensor | BlockVisibility | None,
             block_prefix: tuple[torch.Tensor, torch.Tensor] | None = None):
        """One pass of the layer: returns (output `[B, q, d]` before the final norm, own keys/values)."""
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        return self.layer(x, cos, sin, context_keys, context_values, mask, return_kv=True, block_prefix=block_prefix)

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        if self.bf16_lm_head is not None:  # bf16 inference (`use_bf16_weights`)
            return self.lm_head_logits(self.final_norm(output))
        return self.final_norm(output) @ self.lm_head_t

    def next_feature(self, output: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(output)

    def empty_kv(self, batch: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, self.config.num_kv_heads, 0, self.config.head_dim)
        return torch.zeros(shape, device=device), torch.zeros(shape, device=device)

    def training_time_test(self, tokens: torch.Tensor, fused: torch.Tensor, anchors: torch.Tensor,
                           num_steps: int) -> torch.Tensor:
        """Teacher-forced unroll. tokens `[S, T]`, fused features `[S, T, d]` (of positions 0..T-1),
        anchors `[S, A]` -> logits `[S, A, num_steps, V_d]`; step j's logits predict x_{a+j}."""
        S, T = tokens.shape
        A = anchors.shape[1]
        device = tokens.device
        positions = torch.arange(T, device=device).expand(S, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(S, T, T)
        empty_k, empty_v = self.empty_kv(S, device)
        out, (keys, values) = self.step(self.inputs(tokens, self.shifted_features(fused)), positions,
                                        empty_k, empty_v, causal)  # step 1 everywhere: [S, T, d]
        gather = anchors[..., None].expand(S, A, out.shape[-1])
        previous = out.gather(1, gather)  # [S, A, d]: step-1 output at each anchor
        all_logits = [self.logits(previous)]
        # Later steps: one query per anchor, over the step-1 keys of positions <= anchor (shared
        # by a sequence's anchors, never copied per anchor) and this anchor's own chain so far.
        visibility = BlockVisibility(anchors + 1, 1)  # context positions < anchor + 1 are visible
        Hkv, hd = self.config.num_kv_heads, self.config.head_dim
        chain_k = chain_v = keys.new_zeros(S, Hkv, A, 0, hd)  # [S, Hkv, A, j-1, hd]
        for j in range(2, num_steps + 1):
            position = (anchors + j - 1).clamp(max=T - 1)  # [S, A]
            x = self.inputs(tokens.gather(1, position), self.next_feature(previous))  # teacher-forced x_{a+j-1}
            previous, (k, v) = self.step(x, position, keys, values, visibility,
                                         block_prefix=(chain_k, chain_v))  # [S, A, d]; k, v [S, Hkv, A, hd]
            chain_k, chain_v = torch.cat([chain_k, k.unsqueeze(3)], 3), torch.cat([chain_v, v.unsqueeze(3)], 3)
            all_logits.append(self.logits(previous))
        return torch.stack(all_logits, dim=2)
