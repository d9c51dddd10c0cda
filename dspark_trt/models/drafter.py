"""The DSpark drafter: a parallel backbone that drafts a block in one pass, plus a sequential
head that fixes the block's tail, plus a confidence head for the verification scheduler.

Backbone (DFlash-style). The block `[anchor, MASK x (gamma-1)]` sits at positions
`p .. p+gamma-1`; slot k (1-based) predicts the token at `p + k`. Target features (outputs of
a few target layers, each RMS-normalised, concatenated, projected to the hidden size and
normalised again; with `context_norm`, then through each layer's own input norm) are injected
as extra keys/values in every layer: a block query sees the context features of positions
`< p` and its own block in both directions, never other blocks.
Embedding and LM head are the target's (frozen, not stored in the checkpoint); the LM head is
restricted to the draft vocabulary (the most frequent target tokens).

Sequential head. `p_k = softmax(U_k + B_k)` with `U_k` the backbone logits and
`B_k = W1[x_{k-1}] @ W2` (Markov, rank r) or `B_k = s_k @ W2` with a GRU state
`s_k = GRU([W1[x_{k-1}]; h_k], s_{k-1})` (RNN). `x_0` is the anchor. Every `p_k` is an exact
softmax, so rejection sampling against it stays exact.

Prefix layer (optional, `prefix_layer`). A causal layer over the drafted prefix that corrects
`h_k` before the LM head, slot by slot as the sequential head runs: `PrefixLayer`.

Confidence head. `c_k = sigmoid(w . [h_k; W1[x_{k-1}]])`: the probability that draft token k
survives verification given that tokens 1..k-1 did. It never looks at `x_k` itself, which is
what lets the scheduler use it without breaking losslessness.

This module is torch only: shapes and math. Sampling a block lives in `runtime/dspark_proposer.py`,
losses in `training/losses.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.models.copy_bias import confidence_offset
from dspark_trt.models.drafter_config import DrafterConfig
from dspark_trt.models.linear import (
    DerivedFromWeights,
    DraftLinear,
    PackedCache,
    bf16_matmul,
    matmul,
    use_bf16_weights,
)
from dspark_trt.models.rope import apply_rope, inverse_frequencies, rope_cos_sin
from dspark_trt.models.target import rms_norm


# logit(1 - 1e-6): the ceiling, so that a distribution with all its mass on one token stays finite
TOP_PROBABILITY_LOGIT_CAP = 13.815509557963773


def top_probability_logit(logits: torch.Tensor) -> torch.Tensor:
    """Logits `[..., V]` -> logit(max softmax probability) `[...]` in fp32, at most the cap.

    logit(p_top) = log p_top - log(1 - p_top) = -logsumexp(others - top), computed that way: the
    form `log_top - log1p(-exp(log_top))` with `log_top = max - logsumexp` cancels catastrophically
    when p_top is within ~1e-4 of 1 (a strong copy bias does that), and two correct
    implementations (PyTorch, ONNX Runtime) then disagreed by ~1e-3 in the confidence. The sum
    of the others' exp(x - top) is written out (no logsumexp: the top term is the shift itself, so
    nothing overflows; and PyTorch's CPU logsumexp cost ~4x this here)."""
    logits = logits.float()
    top = logits.max(-1, keepdim=True)
    others = (logits - top.values).exp().scatter(-1, top.indices, 0.0)  # exp(x - top), the top itself left out
    return (-others.sum(-1).log()).clamp(max=TOP_PROBABILITY_LOGIT_CAP)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[..., 1, head_dim]` for integer positions `[...]` (rotate-half convention)."""
    cos, sin = rope_cos_sin(positions, inverse_frequencies(head_dim, theta))
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


class FeatureFusion(nn.Module):
    """Target features `[..., m * d]` (m layers) -> context states `[..., d]`: each layer's
    output RMS-normalised (target layers differ in scale by orders of magnitude), concatenated,
    projected, normalised again."""

    def __init__(self, num_layers: int, hidden_size: int, eps: float):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(hidden_size, eps) for _ in range(num_layers))
        self.project = DraftLinear(num_layers * hidden_size, hidden_size, bias=False)
        self.norm = RMSNorm(hidden_size, eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        parts = features.float().chunk(len(self.norms), dim=-1)
        return self.norm(self.project(torch.cat([norm(part) for norm, part in zip(self.norms, parts)], dim=-1)))


@dataclass
class BlockVisibility:
    """Training's attention pattern without a dense mask: the queries are A blocks of gamma slots
    per sequence; each block sees the context positions before its anchor and its whole own block
    (what `make_batch`'s dense mask says, minus the ~Q x Q zeros between blocks)."""

    anchor_positions: torch.Tensor  # [S, A]: context positions < p are visible to the block anchored at p
    block_size: int
    causal: bool = False  # slot i sees only slots <= i of its block (a probe: dspark_variant_ab.py block-causal)


def block_attention(q: torch.Tensor, context_keys: torch.Tensor, context_values: torch.Tensor,
                    block_keys: torch.Tensor, block_values: torch.Tensor, visibility: BlockVisibility) -> torch.Tensor:
    """Grouped-query attention of blocks over their context and themselves.

    q `[S, H, A * G, hd]`; context keys/values `[S, Hkv, C, hd]`; the blocks' own keys/values
    `[S, Hkv, A * J, hd]` -> `[S, H, A * G, hd]`: every query of block a sees the J own keys of
    block a (J = G for DSpark's blocks; EAGLE's training-time test has one query per anchor and
    J = its chain so far plus itself). Scores against the context (`[S, H, A*G, C]`)
    and within each block (`[S, H, A, G, J]`) share one softmax. It never forms the cross-block
    scores that the dense mask zeroes, and runs as batched matmuls: on a 16 x 64-anchor bf16
    training step here the attention went from 2.8 s (PyTorch's fused CPU attention with the
    mask, forward + backward) to ~0.8 s, the whole step from 11.5 to 8.3 s (measured with
    torch.profiler beside a datagen run, both times)."""
    S, H, Q, hd = q.shape
    Hkv, C, G = context_keys.shape[1], context_keys.shape[2], visibility.block_size
    A = Q // G
    J = block_keys.shape[2] // A
    q = q.reshape(S, Hkv, H // Hkv, A, G, hd) * hd**-0.5
    own_keys, own_values = block_keys.reshape(S, Hkv, A, J, hd), block_values.reshape(S, Hkv, A, J, hd)
    context_scores = torch.einsum("skgaid,skcd->skgaic", q, context_keys)  # [S, Hkv, g, A, G, C]
    hidden = torch.arange(C, device=q.device) >= visibility.anchor_positions[:, None, None, :, None, None]
    context_scores = context_scores.float().masked_fill(hidden, float("-inf"))
    own_scores = torch.einsum("skgaid,skajd->skgaij", q, own_keys).float()  # [S, Hkv, g, A, G, J]
    if visibility.causal:  # J == G here: no prefix
        later = torch.ones(G, J, dtype=torch.bool, device=q.device).triu(1)
        own_scores = own_scores.masked_fill(later, float("-inf"))
    probs = torch.softmax(torch.cat([context_scores, own_scores], dim=-1), dim=-1)
    context_probs, own_probs = probs.to(context_values.dtype).split([C, J], dim=-1)
    out = (torch.einsum("skgaic,skcd->skgaid", context_probs, context_values)
           + torch.einsum("skgaij,skajd->skgaid", own_probs.to(own_values.dtype), own_values))
    return out.reshape(S, H, Q, hd)


def prefix_with(prefix: torch.Tensor, own: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-block prefix `[S, Hkv, A, P, hd]` and blocks' own keys (or values) `[S, Hkv, A * G, hd]`
    -> `[S, Hkv, A * (P + G), hd]`: block a's P prefix entries, then its G own."""
    S, Hkv, A, P, hd = prefix.shape
    own = own.reshape(S, Hkv, A, block_size, hd)
    return torch.cat([prefix, own], dim=3).reshape(S, Hkv, A * (P + block_size), hd)


class DraftLayer(nn.Module):
    """One backbone layer: block queries attend to injected context keys/values and the block."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.mlp_norm = RMSNorm(d, config.rms_norm_eps)
        self.q = DraftLinear(d, config.num_heads * hd, bias=False)
        self.kv = DraftLinear(d, 2 * config.num_kv_heads * hd, bias=False)
        self.o = DraftLinear(config.num_heads * hd, d, bias=False)
        self.gate_up = DraftLinear(d, 2 * config.intermediate_size, bias=False)
        self.down = DraftLinear(config.intermediate_size, d, bias=False)

    def keys_values(self, states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`states` `[..., n, d]` -> keys, values `[..., kv_heads, n, head_dim]` (keys rotated)."""
        k, v = self.kv(states).unflatten(-1, (2, self.num_kv_heads, self.head_dim)).unbind(-3)
        return apply_rope(k, cos, sin).transpose(-2, -3), v.transpose(-2, -3)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_keys: torch.Tensor,
                context_values: torch.Tensor, mask: torch.Tensor | BlockVisibility | None, return_kv: bool = False,
                block_prefix: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x: block states `[batch, queries, d]`; context keys/values `[batch, kv_heads, ctx, head_dim]`;
        mask: `[batch, queries, ctx + queries]` (True = visible), a `BlockVisibility` (training's
        blocks, without the dense mask), or None for all-visible.
        block_prefix (with a `BlockVisibility` only): keys/values `[batch, kv_heads, A, P, head_dim]`
        that each block's queries also see before the block's own (EAGLE's chain of earlier steps).
        With `return_kv`, also returns the block's own keys/values (autoregressive drafters cache them)."""
        h = self.attn_norm(x)
        q = apply_rope(self.q(h).unflatten(-1, (self.num_heads, self.head_dim)), cos, sin).transpose(1, 2)
        block_keys, block_values = self.keys_values(h, cos, sin)
        if isinstance(mask, BlockVisibility):
            own_keys, own_values = block_keys, block_values
            if block_prefix is not None:
                own_keys, own_values = (prefix_with(prefix, own, mask.block_size)
                                        for prefix, own in zip(block_prefix, (block_keys, block_values)))
            attn = block_attention(q, context_keys, context_values, own_keys, own_values, mask)
        else:
            keys = torch.cat([context_keys, block_keys], dim=2)
            values = torch.cat([context_values, block_values], dim=2)
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=None if mask is None else mask[:, None],
                                                  enable_gqa=True)  # [batch, heads, queries, head_dim]
        x = x + self.o(attn.transpose(1, 2).flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        out = x + self.down(F.silu(gate) * up)
        return (out, (block_keys, block_values)) if return_kv else out


class MarkovHead(nn.Module):
    """B(x_prev) = W1[x_prev] @ W2 (rank r); W2 starts at zero, so training starts from the backbone."""

    def __init__(self, config: DrafterConfig, vocab: int):
        super().__init__()
        self.w2 = nn.Linear(config.markov_rank, vocab, bias=False)
        nn.init.zeros_(self.w2.weight)
        self.bf16_w2: PackedCache | None = None  # set by `DrafterBase.use_bf16_weights`

    def forward(self, previous_embedding: torch.Tensor, hidden: torch.Tensor, state=None):
        # W2 is [V_d, r]: its transpose as a view is the [r, V_d] GEMV operand, no copy.
        if self.bf16_w2 is not None and not torch.is_grad_enabled():
            return bf16_matmul(previous_embedding, self.w2.weight.t(), self.bf16_w2), None
        return matmul(previous_embedding, self.w2.weight.t()), None


class RNNHead(nn.Module):
    """B_k = s_k @ W2 with s_k = GRU([W1[x_{k-1}]; h_k], s_{k-1})."""

    def __init__(self, config: DrafterConfig, vocab: int):
        super().__init__()
        self.cell = nn.GRUCell(config.markov_rank + config.hidden_size, config.markov_rank)
        self.w2 = nn.Linear(config.markov_rank, vocab, bias=False)
        nn.init.zeros_(self.w2.weight)

    def forward(self, previous_embedding: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        shape = previous_embedding.shape[:-1]
        inputs = torch.cat([previous_embedding, hidden], dim=-1).reshape(-1, self.cell.input_size)
        state = self.cell(inputs, None if state is None else state.reshape(-1, self.cell.hidden_size))
        state = state.reshape(*shape, -1)
        return self.w2(state), state


class PrefixLayer(nn.Module):
    """A causal layer over the block's drafted prefix (`DrafterConfig.prefix_layer`).

    Slot k reads u_k = P [h_k; norm(E[x_{k-1}])] (its backbone state and the target embedding of
    the token before it) and attends to u_1..u_k of its own block only, never the context, which
    h_k already carries. Its output corrects the slot's state before the LM head:
        h'_k = h_k + O norm(layer(u)_k),    p_k = softmax(U(h'_k) + B_k)
    O starts at zero, so training starts as the drafter without it. Every `p_k` is still an exact
    softmax over the draft vocabulary, so verification stays lossless.

    Why: the parallel backbone drafts slot k from mask inputs, knowing none of the tokens drafted
    before it; the Markov head adds only the previous token's bias. Slot k only matters when
    slots 1..k-1 were accepted, i.e. when the drafted prefix is the true one, and with the true
    prefix as the backbone's input (`benchmarks/experiments/dspark_variant_ab.py --variant
    prefix-forced`) its acceptance stayed flat along the block like EAGLE-3-style's, where
    DSpark's fell from slot 1 to 7 (docs/training.md). This layer brings the prefix in after the
    one parallel pass, slot by slot as the Markov head runs, at one small layer per slot.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        d = config.hidden_size
        # (registration order is the parameters' order in a run's optimizer state: keep it)
        self.embedding_norm = RMSNorm(d, config.rms_norm_eps)
        self.project = DraftLinear(2 * d, d, bias=False)
        self.layer = DraftLayer(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.out = DraftLinear(d, d, bias=False)
        nn.init.zeros_(self.out.weight)

    def _inputs(self, hidden: torch.Tensor, previous_embedding: torch.Tensor) -> torch.Tensor:
        return self.project(torch.cat([hidden, self.embedding_norm(previous_embedding.to(hidden.dtype))], dim=-1))

    def _no_context(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(like.shape[0], self.layer.num_kv_heads, 0, self.layer.head_dim)

    def teacher_forced(self, hidden: torch.Tensor, previous_embedding: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, anchor_positions: torch.Tensor, block_size: int) -> torch.Tensor:
        """Training, whole blocks at once: hidden and the true previous tokens' embeddings
        `[S, A * gamma, d]`, RoPE rows of the block positions, anchors `[S, A]` -> corrections
        `[S, A * gamma, d]` (slot k sees slots 1..k of its block)."""
        u = self._inputs(hidden, previous_embedding)
        none = self._no_context(u)
        states = self.layer(u, cos, sin, none, none, BlockVisibility(anchor_positions, block_size, causal=True))
        return self.out(self.norm(states))

    def step(self, hidden: torch.Tensor, previous_embedding: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             cache: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Drafting, slot k of N blocks: hidden and x_{k-1}'s embedding `[N, d]`, RoPE rows
        `[N, 1, 1, head_dim]`, the keys/values of slots 1..k-1 (None at k = 1) -> correction
        `[N, d]` and the keys/values of slots 1..k (what `teacher_forced` computes, slot by slot)."""
        u = self._inputs(hidden, previous_embedding)[:, None]  # [N, 1, d]
        empty = self._no_context(u)
        keys, values = cache if cache is not None else (empty, empty)
        states, (own_keys, own_values) = self.layer(u, cos, sin, keys, values, None, return_kv=True)
        cache = (torch.cat([keys, own_keys], dim=2), torch.cat([values, own_values], dim=2))
        return self.out(self.norm(states[:, 0])), cache


class DrafterBase(nn.Module):
    """What every drafter has: the draft vocabulary, feature fusion, a final norm, and the
    target's embedding and LM head (borrowed, frozen, never saved)."""

    def __init__(self, config: DrafterConfig, draft_vocab: torch.Tensor):
        super().__init__()
        self.config = config
        d = config.hidden_size
        vocab_size = draft_vocab.numel()
        self.register_buffer("draft_vocab", draft_vocab.long().clone())
        # target id -> draft id, or `vocab_size` for tokens outside the draft vocabulary
        to_draft = torch.full((config.target_vocab_size,), vocab_size, dtype=torch.long)
        to_draft[draft_vocab.long()] = torch.arange(vocab_size)
        self.register_buffer("to_draft", to_draft, persistent=False)
        self.fusion = FeatureFusion(len(config.feature_layers), d, config.rms_norm_eps)
        self.final_norm = RMSNorm(d, config.rms_norm_eps)
        self.embed: torch.Tensor | None = None  # [target_vocab, d]
        self.lm_head_t: torch.Tensor | None = None  # [d, draft_vocab]
        self.bf16_lm_head: PackedCache | None = None  # set by `use_bf16_weights`

    def use_bf16_weights(self) -> "DrafterBase":
        """Inference with bf16 weights and fp32 activations (`models/linear.py`), LM head included."""
        use_bf16_weights(self)
        self.bf16_lm_head = PackedCache()
        if isinstance(getattr(self, "sequential", None), MarkovHead):
            # its bias rows (`MarkovRows` in the proposer) then come from our kernel too, not from
            # numpy's BLAS, whose threads would contend with the kernels' spinning ones
            self.sequential.bf16_w2 = PackedCache()
        return self

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., d]` -> logits over the draft vocabulary `[..., V_d]`."""
        if self.bf16_lm_head is not None and not torch.is_grad_enabled():
            return bf16_matmul(hidden, self.lm_head_t, self.bf16_lm_head)
        return matmul(hidden, self.lm_head_t)

    def attach_target(self, target_model) -> "DrafterBase":
        """Borrow the target's embedding and the draft-vocabulary rows of its LM head."""
        self.embed = target_model.embed.detach()
        # fp32 whatever the target's weights are: training and export read it as such.
        self.lm_head_t = target_model.lm_head.weight_t.detach()[:, self.draft_vocab].float().contiguous()
        if self.final_norm.weight.data.eq(1).all():  # fresh drafter: start from the target's final norm
            self.final_norm.weight.data.copy_(target_model.final_norm.detach())
        return self

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features `[..., m * d]` (m layers) -> context states `[..., d]`."""
        return self.fusion(features)

    def draft_layers(self) -> list["DraftLayer"]:
        return []

    @torch.no_grad()
    def init_layers_from_target(self, target_model) -> "DrafterBase":
        """Start each draft layer as a copy of one of the target's last layers (training only).

        A draft layer has the shapes of a target layer, and the target's top layers already map
        hidden states to next-token predictions; starting there instead of from noise is what
        makes a few hundred CPU steps enough. Skipped for targets with biases or q/k norms,
        which draft layers do not have.
        """
        layers = self.draft_layers()
        sources = list(target_model.layers)[-len(layers):] if layers else []
        if any(s.qkv.bias is not None or s.o.bias is not None or s.q_norm is not None for s in sources):
            return self
        for layer, source in zip(layers, sources):
            q_width = layer.num_heads * layer.head_dim
            qkv = source.qkv.weight_t.t()  # [out, in]
            layer.q.weight.copy_(qkv[:q_width])
            layer.kv.weight.copy_(qkv[q_width:])
            layer.o.weight.copy_(source.o.weight_t.t())
            layer.gate_up.weight.copy_(source.gate_up.weight_t.t())
            layer.down.weight.copy_(source.down.weight_t.t())
            layer.attn_norm.weight.copy_(source.attn_norm)
            layer.mlp_norm.weight.copy_(source.mlp_norm)
        return self


class DSparkDrafter(DrafterBase):
    def __init__(self, config: DrafterConfig, draft_vocab: torch.Tensor):
        """draft_vocab: `[draft_vocab_size]` target token ids the drafter can propose."""
        super().__init__(config, draft_vocab)
        d, vocab_size = config.hidden_size, draft_vocab.numel()
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_layers))

        self.previous_embedding = None  # W1 over the draft vocabulary plus one out-of-vocabulary row
        self.sequential = None
        self.confidence = None
        if config.head != "none" or config.confidence:
            self.previous_embedding = nn.Embedding(vocab_size + 1, config.markov_rank)
            nn.init.normal_(self.previous_embedding.weight, std=0.02)
        if config.head == "markov":
            self.sequential = MarkovHead(config, vocab_size)
        elif config.head == "rnn":
            self.sequential = RNNHead(config, vocab_size)
        if config.confidence:
            self.confidence = nn.Linear(d + config.markov_rank, 1)
        self.prefix = PrefixLayer(config) if config.prefix_layer else None
        self._fused_backbone = DerivedFromWeights()  # cpu_kernels.FusedDecoder (`kernel_backbone`)
        self._fused_context = DerivedFromWeights()  # cpu_kernels.FusedContext (`kernel_context`)
        self._rope = (torch.empty(0), torch.empty(0))

    def draft_layers(self) -> list[DraftLayer]:
        return list(self.layers)

    def _kernels_run(self) -> bool:
        """Inference with bf16 weights on a CPU where our kernels run (not training: gradients)."""
        if self.bf16_lm_head is None or torch.is_grad_enabled() or not self.mask_embedding.is_cpu:
            return False
        from dspark_trt.kernels import cpu_kernels

        return cpu_kernels.available()

    def kernel_backbone(self):
        """The backbone, final norm and draft LM head as one C pass (`cpu_kernels.FusedDecoder`:
        the same layers as `DraftLayer` computes, with bf16 weights), or None where it does not
        run: fp32 weights, a GPU, no kernels, or with gradients (training)."""
        if not self._kernels_run():
            return None
        return self._fused_backbone.get(self, self._describe_backbone, self.lm_head_t)

    def kernel_context(self):
        """The context step (feature fusion, then each layer's keys/values) as one C call
        (`cpu_kernels.FusedContext`), or None where `kernel_backbone` is None."""
        if not self._kernels_run():
            return None
        return self._fused_context.get(self, self._describe_context)

    def _describe_backbone(self):
        from dspark_trt.kernels import cpu_kernels

        c = self.config
        shape = cpu_kernels.DecoderShape(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                         c.intermediate_size, self.draft_vocab.numel(), c.rms_norm_eps)
        layers = [cpu_kernels.DecoderLayerWeights(
            attn_norm=layer.attn_norm.weight, mlp_norm=layer.mlp_norm.weight,
            qkv=cpu_kernels.PackedWeight(torch.cat([layer.q.weight, layer.kv.weight]).t()),
            o=cpu_kernels.PackedWeight(layer.o.weight.t()), gate_up=cpu_kernels.PackedWeight(layer.gate_up.weight.t()),
            down=cpu_kernels.PackedWeight(layer.down.weight.t())) for layer in self.layers]
        return cpu_kernels.FusedDecoder(shape, layers, self.final_norm.weight, cpu_kernels.PackedWeight(self.lm_head_t))

    def _describe_context(self):
        from dspark_trt.kernels import cpu_kernels

        c = self.config
        return cpu_kernels.FusedContext(
            c.hidden_size, c.num_kv_heads, c.head_dim, c.rms_norm_eps, [n.weight for n in self.fusion.norms],
            cpu_kernels.PackedWeight(self.fusion.project.weight.t()), self.fusion.norm.weight,
            [cpu_kernels.PackedWeight(layer.kv.weight.t()) for layer in self.layers],
            [layer.attn_norm.weight for layer in self.layers] if c.context_norm else None)

    def rope_table(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[>= size, head_dim]` by position (the rows `rope_tables` gives), kept between calls."""
        if self._rope[0].shape[0] < size:
            cos, sin = rope_tables(torch.arange(max(2 * size, 1024)), self.config.head_dim, self.config.rope_theta)
            self._rope = (cos[:, 0].contiguous(), sin[:, 0].contiguous())
        return self._rope

    # ---- the backbone ------------------------------------------------------------------------

    def context_keys_values(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer keys/values `[batch, kv_heads, n, head_dim]` of context states `[batch, n, d]`."""
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        return self.context_keys_values_at(context, cos, sin)

    def context_keys_values_at(self, context: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`context_keys_values` with the RoPE rows given (`[..., n, 1, head_dim]`).

        With `config.context_norm` each layer reads its own `attn_norm` of the context. Why: the
        layers start as copies of the target's last layers, whose k/v projections were trained on
        that norm's per-channel scale, while the fused context starts at unit scale; one shared
        fusion norm cannot match two layers' scales. At block size 1, on the same batches for 300
        steps, this alone lifted DSpark's first-slot acceptance from 0.374 to 0.415, MTP-1's level
        (`benchmarks/experiments/dspark_variant_ab.py`, docs/training.md)."""
        return [layer.keys_values(layer.attn_norm(context) if self.config.context_norm else context, cos, sin)
                for layer in self.layers]

    def block_inputs(self, anchors: torch.Tensor, num_blocks_shape: tuple) -> torch.Tensor:
        """`[*shape, gamma, d]`: the anchor's embedding, then the mask embedding."""
        gamma = self.config.block_size
        x = self.mask_embedding.expand(*num_blocks_shape, gamma, -1).clone()
        x[..., 0, :] = self.embed[anchors]
        return x

    def backbone(self, block_states: torch.Tensor, block_positions: torch.Tensor,
                 context_kv: list[tuple[torch.Tensor, torch.Tensor]],
                 mask: torch.Tensor | BlockVisibility | None) -> torch.Tensor:
        """block_states `[batch, queries, d]` at `block_positions` `[batch, queries]` -> hidden `[batch, queries, d]`."""
        cos, sin = rope_tables(block_positions, self.config.head_dim, self.config.rope_theta)
        x = block_states
        for layer, (keys, values) in zip(self.layers, context_kv):
            x = layer(x, cos, sin, keys, values, mask)
        return self.final_norm(x)

    def backbone_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """U: `[..., d]` -> `[..., draft_vocab]`."""
        return self.lm_head_logits(hidden)

    # ---- the heads ---------------------------------------------------------------------------

    def sequential_bias(self, hidden: torch.Tensor, previous_draft_ids: torch.Tensor, state=None):
        """B_k for slots whose previous token is known: hidden `[..., d]`, previous_draft_ids `[...]`
        (draft-vocab ids, OOV = vocab size) -> (bias `[..., draft_vocab]` or None, new RNN state)."""
        if self.sequential is None:
            return None, state
        return self.sequential(self.previous_embedding(previous_draft_ids), hidden, state)

    def confidence_logits(self, hidden: torch.Tensor, previous_draft_ids: torch.Tensor) -> torch.Tensor | None:
        """Confidence logits `[...]` of slots given h_k and x_{k-1}; never looks at x_k itself."""
        if self.confidence is None:
            return None
        previous = self.previous_embedding(previous_draft_ids)
        return self.confidence(torch.cat([hidden, previous], dim=-1)).squeeze(-1)

    def teacher_forced_heads(self, hidden: torch.Tensor, previous_draft_ids: torch.Tensor):
        """Training: heads over whole blocks with the true previous tokens.

        hidden `[..., gamma, d]`, previous_draft_ids `[..., gamma]` -> bias `[..., gamma, V_d]`, conf `[..., gamma]`.
        """
        confidence = self.confidence_logits(hidden, previous_draft_ids)
        if isinstance(self.sequential, RNNHead):  # recurrent: slot by slot
            biases, state = [], None
            for k in range(self.config.block_size):
                bias, state = self.sequential_bias(hidden[..., k, :], previous_draft_ids[..., k], state)
                biases.append(bias)
            return torch.stack(biases, -2), confidence
        bias, _ = self.sequential_bias(hidden, previous_draft_ids)
        return bias, confidence

    def confidence_offsets(self, confidence: torch.Tensor, top_prob_logits: torch.Tensor | None,
                           copy_candidates: torch.Tensor | None) -> torch.Tensor:
        """Confidence logits `[..., gamma]` plus what calibration learned the head cannot see: beta
        for each n-gram length with a copy candidate (`copy_confidence`; candidates `[..., gamma, N]`)
        and w times the logit of the draft distribution's top probability (`confidence_top_prob`;
        `top_probability_logit` of each slot's logits, every bias added: `[..., gamma]`). Both are
        known before x_k is drawn."""
        config = self.config
        if config.copy_confidence and copy_candidates is not None:
            beta = torch.tensor(config.copy_confidence, dtype=confidence.dtype, device=confidence.device)
            confidence = confidence + confidence_offset(beta, copy_candidates)
        if config.confidence_top_prob:
            weights = torch.tensor(config.confidence_top_prob, dtype=confidence.dtype, device=confidence.device)
            confidence = confidence + weights[: confidence.shape[-1]] * top_prob_logits
        return confidence

    def calibrated_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """Confidence logits `[..., gamma]` -> probabilities, with STS temperatures when calibrated."""
        temperatures = self.config.confidence_temperatures
        if temperatures:
            logits = logits / torch.tensor(temperatures[: logits.shape[-1]], dtype=logits.dtype, device=logits.device)
        return torch.sigmoid(logits)
