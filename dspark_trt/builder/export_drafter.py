"""The DSpark drafter as one export-friendly torch module: features in, a drafted block out.

One call drafts one block for each of B requests, statelessly:

    inputs   context_features [B, C, m*D]  raw target features of each request's context (padded)
             context_lengths  [B] int64    how many rows of context_features are real (L_b)
             anchor_tokens    [B] int64    the pending (anchor) token, a target id
             temperatures     [B]          0 = greedy
             uniforms         [B, G]       one uniform per block slot (sampling)
             context_tokens   [B, C] int64 only for a drafter with a copy bias (`copy_ngram > 0`;
                                           `ExportDrafter.input_names`): the target ids of the
                                           request's committed tokens before the anchor, i.e. the
                                           tokens at the positions of context_features' rows,
                                           left-aligned, L_b real per row (the rest any value);
                                           the anchor itself comes from anchor_tokens
    outputs  draft_tokens     [B, G] int64 target ids
             token_probs      [B, G]       p_k(x_k)
             confidences      [B, G]       calibrated c_k (confidence offsets included)
             distributions    [B, G, V_d]  p_k over the draft vocabulary (`draft_vocab` maps to target ids)

It computes what `DSparkProposer` computes: fusion, context keys/values, the backbone with the
block at positions `C_b .. C_b + G - 1`, the draft LM head and the sequential head, from the same
weights, written with plain torch ops that `torch.onnx` can trace (the runtime's modules route
matmuls through numpy and use SDPA's GQA flag). The sequential head is the
`dspark::sequential_draft` custom op (one `SequentialDraft` ONNX node, for TensorRT) or, with
`use_plugin=False`, its reference traced into standard ops (for ONNX Runtime on CPU).

The copy bias and the calibrated confidence offsets are in the graph too, as in the runtime:
slot k's logits get alpha[k, n] on the token that followed the last earlier occurrence of the
last n tokens (history = context_tokens then the anchor, then the block's tokens drawn so far;
`models/copy_bias.py`), and its confidence logit beta[k, n] per n-gram length with a candidate
(`copy_confidence`) and w_k logit(max p_k) (`confidence_top_prob`). The lookup depends on the
tokens drawn inside the loop, so it lives inside the sequential head: the `SequentialDraft` op
takes the right-aligned history, the vocabulary maps and alpha, beta, w as extra inputs (with
attributes `copy_ngram`, `copy_confidence`, `top_prob`), and its torch reference (which the
TensorRT plugin runs, and which traces into the unrolled graph) computes them with
`copy_bias.sequence_copy_candidates`, standard tensor ops. A graph without `context_tokens`
(a drafter without a copy bias) is the graph it was before; TorchScript would drop an unused
input, so the input is only declared where it is read.

A drafter with a prefix layer (`DrafterConfig.prefix_layer`) has no plugin form: the layer
corrects slot k's logits from x_{k-1}, which the head draws inside the loop, while the plugin
takes the block's logits whole. Its loop is written here slot by slot, the layer between
`sequential_draft.draft_slot` calls, all in standard ops (TensorRT builds such a graph as it is;
`plugin_supported` tells the builder).

Stateless on purpose: the graph holds every drafter weight, so an engine needs nothing else;
the cost is re-projecting the context each call, O(C) rather than O(new tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_trt.models.copy_bias import NO_CANDIDATE, right_aligned_history
from dspark_trt.models.drafter import DSparkDrafter, RNNHead
from dspark_trt.plugins import sequential_draft as sd

INPUT_NAMES = ["context_features", "context_lengths", "anchor_tokens", "temperatures", "uniforms"]
COPY_INPUT_NAMES = ["context_tokens"]  # appended for a drafter with a copy bias (`input_names`)
OUTPUT_NAMES = ["draft_tokens", "token_probs", "confidences", "distributions"]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def input_names(config) -> list[str]:
    """The drafter graph's inputs (module docstring): `context_tokens` too with a copy bias."""
    return INPUT_NAMES + (COPY_INPUT_NAMES if config.copy_ngram else [])


def plugin_supported(config) -> bool:
    """Whether the drafter's sequential head can be the one `SequentialDraft` node (module docstring):
    not with a prefix layer, nor with copy n-grams longer than the plugin's kernel takes."""
    from dspark_trt.plugins.sequential_draft_kernel import MAX_NGRAM

    return not config.prefix_layer and config.copy_ngram <= MAX_NGRAM


class ExportDrafter(nn.Module):
    def __init__(self, drafter: DSparkDrafter, use_plugin: bool = True):
        super().__init__()
        if drafter.embed is None:
            raise ValueError("attach the target (drafter.attach_target) before exporting the drafter")
        c = drafter.config
        self.config, self.drafter, self.use_plugin = c, drafter, use_plugin and plugin_supported(c)
        self.block_size, self.eps = c.block_size, c.rms_norm_eps
        self.head = sd.HEAD_CODES[c.head]
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32)
                                                                 / c.head_dim)), persistent=False)
        # A persistent buffer, so the graph holds the draft LM head once, as an initializer: a plain
        # tensor attribute (or a non-persistent buffer) is traced into a constant per use, and the
        # prefix layer's loop uses it once per slot (8 x 19 MB for SmolLM2's drafter).
        self.register_buffer("lm_head_t", drafter.lm_head_t)
        temps = c.confidence_temperatures or [1.0] * c.block_size
        self.register_buffer("conf_inv_temps", 1.0 / torch.tensor(temps[: c.block_size], dtype=torch.float32))
        # Placeholders for the op's unused weights (one element: TensorRT dislikes empty tensors).
        placeholder = torch.zeros(1)
        d = drafter
        self.w1 = d.previous_embedding.weight if d.previous_embedding is not None else placeholder.view(1, 1)
        self.w2 = d.sequential.w2.weight.t() if d.sequential is not None else placeholder.view(1, 1)
        if isinstance(d.sequential, RNNHead):
            cell = d.sequential.cell
            self.gru = (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
        else:
            self.gru = (placeholder,) * 4
        self.conf_w = d.confidence.weight[0] if d.confidence is not None else placeholder
        self.conf_b = d.confidence.bias if d.confidence is not None else placeholder
        # The copy bias and the confidence offsets (module docstring); placeholders where unused.
        self.input_names = input_names(c)
        self.copy_ngram = c.copy_ngram
        self.copy_confidence = int(bool(c.copy_confidence) and d.confidence is not None)
        self.top_prob = int(bool(c.confidence_top_prob) and d.confidence is not None)
        index_placeholder = torch.full((1,), NO_CANDIDATE, dtype=torch.long)
        self.copy_alpha = torch.tensor(c.copy_bias, dtype=torch.float32) if c.copy_ngram else placeholder.view(1, 1)
        self.copy_beta = (torch.tensor(c.copy_confidence, dtype=torch.float32) if self.copy_confidence
                          else placeholder.view(1, 1))
        self.top_prob_w = (torch.tensor(c.confidence_top_prob[: c.block_size], dtype=torch.float32) if self.top_prob
                           else placeholder)
        if c.copy_ngram:  # persistent: one initializer, though each of the G slots reads it (see lm_head_t)
            self.register_buffer("copy_to_draft", d.to_draft.clone())
            self.copy_vocab = (d.draft_vocab, self.copy_to_draft)
        else:
            self.copy_vocab = (index_placeholder, index_placeholder)
        self.history_placeholder = index_placeholder.view(1, 1)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[..., None] * self.inv_freq  # [..., head_dim/2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(-2)  # [..., 1, head_dim]
        return angles.cos(), angles.sin()

    def _attention(self, layer, x, cos, sin, context_k, context_v, visible):
        """One draft layer: x `[B, G, D]`; context k/v `[B, KVH, C, HD]` or None; visible
        `[B, 1, 1, C + G]` or None (all visible) -> `[B, G, D]` and x's own keys, values
        `[B, KVH, G, HD]` (the prefix layer caches them)."""
        c = self.config
        batch, block, _ = x.shape
        h = _rms(x, layer.attn_norm.weight, self.eps)
        q = _rope((h @ layer.q.weight.t()).view(batch, block, c.num_heads, c.head_dim), cos, sin)  # [B, G, H, HD]
        k, v = (h @ layer.kv.weight.t()).view(batch, block, 2, c.num_kv_heads, c.head_dim).unbind(2)
        k, v = _rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)  # [B, KVH, G, HD]
        keys = k if context_k is None else torch.cat([context_k, k], dim=2)  # [B, KVH, C + G, HD]
        values = v if context_v is None else torch.cat([context_v, v], dim=2)
        group = c.num_heads // c.num_kv_heads
        q = q.transpose(1, 2).reshape(batch, c.num_kv_heads, group * block, c.head_dim)  # heads of one kv head stacked
        scores = (q @ keys.transpose(-1, -2)) * (c.head_dim ** -0.5)  # [B, KVH, group*G, C+G]
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        out = (scores.softmax(-1) @ values).view(batch, c.num_heads, block, c.head_dim)
        x = x + out.transpose(1, 2).reshape(batch, block, -1) @ layer.o.weight.t()
        gate, up = (_rms(x, layer.mlp_norm.weight, self.eps) @ layer.gate_up.weight.t()).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ layer.down.weight.t(), (k, v)

    def head_weights(self) -> sd.HeadWeights:
        """What the sequential head reads besides the block (the op's weights and attributes)."""
        return sd.HeadWeights(self.w1, self.w2, self.gru, self.conf_w, self.conf_b, self.conf_inv_temps, self.head,
                              int(self.drafter.confidence is not None), *self.copy_vocab, self.copy_alpha,
                              self.copy_beta, self.top_prob_w, self.copy_ngram, self.copy_confidence, self.top_prob)

    def forward(self, context_features, context_lengths, anchor_tokens, temperatures, uniforms, context_tokens=None):
        d = self.drafter
        hidden, logits, cos, sin = self.backbone(context_features, context_lengths, anchor_tokens)
        anchor_ids = d.to_draft[anchor_tokens]  # draft-vocab ids, V_d = out of vocabulary
        if self.copy_ngram:  # the request's tokens up to the anchor, right-aligned for the lookup
            if context_tokens is None:
                raise ValueError("a drafter with a copy bias drafts from the request's tokens: pass context_tokens")
            history = right_aligned_history(context_tokens, context_lengths, anchor_tokens)  # [B, C + 1]
        else:
            history = self.history_placeholder
        if d.prefix is not None:
            ids, token_probs, confidences, distributions = self._draft_with_prefix(
                hidden, logits, anchor_tokens, anchor_ids, cos, sin, temperatures, uniforms, history)
        else:
            w = self.head_weights()
            op = sd.sequential_draft if self.use_plugin else sd.reference
            ids, token_probs, confidences, distributions = op(
                logits, hidden, anchor_ids, w.w1, w.w2, *w.gru, w.conf_w, w.conf_b, w.conf_inv_temps,
                temperatures, uniforms, history, w.draft_vocab, w.to_draft, w.copy_alpha, w.copy_beta, w.top_prob_w,
                w.head, w.has_confidence, w.copy_ngram, w.copy_confidence, w.top_prob)
        return d.draft_vocab[ids], token_probs, confidences, distributions

    def backbone(self, context_features, context_lengths, anchor_tokens):
        """The parallel pass: -> h_k `[B, G, D]`, U_k `[B, G, V_d]` and the block's RoPE rows
        cos, sin `[B, G, 1, HD]`."""
        d, c = self.drafter, self.config
        batch, context, _ = context_features.shape
        fusion = d.fusion
        parts = context_features.chunk(len(fusion.norms), dim=-1)
        fused = torch.cat([_rms(p, n.weight, self.eps) for p, n in zip(parts, fusion.norms)], dim=-1)
        states = _rms(fused @ fusion.project.weight.t(), fusion.norm.weight, self.eps)  # [B, C, D]

        context_positions = torch.arange(context, device=states.device)
        ccos, csin = self._cos_sin(context_positions)  # [C, 1, HD]
        block_positions = context_lengths[:, None] + torch.arange(self.block_size, device=states.device)  # [B, G]
        bcos, bsin = self._cos_sin(block_positions)  # [B, G, 1, HD]
        # A block sees the context rows before its anchor and its whole block.
        visible = torch.cat([context_positions[None] < context_lengths[:, None],
                             torch.ones(batch, self.block_size, dtype=torch.bool, device=states.device)], dim=1)
        visible = visible[:, None, None, :]  # [B, 1, 1, C + G]

        x = d.mask_embedding.expand(batch, self.block_size, -1)
        x = torch.cat([d.embed[anchor_tokens][:, None], x[:, 1:]], dim=1)  # [B, G, D]
        for layer in d.layers:
            # DSparkDrafter.context_keys_values_at: each layer's own norm of the context with `context_norm`
            layer_states = _rms(states, layer.attn_norm.weight, self.eps) if c.context_norm else states
            kv = layer_states @ layer.kv.weight.t()
            ck, cv = kv.view(batch, context, 2, c.num_kv_heads, c.head_dim).unbind(2)
            ck = _rope(ck, ccos, csin).transpose(1, 2)  # [B, KVH, C, HD]
            x, _ = self._attention(layer, x, bcos, bsin, ck, cv.transpose(1, 2), visible)
        hidden = _rms(x, d.final_norm.weight, self.eps)  # [B, G, D]
        return hidden, hidden @ self.lm_head_t, bcos, bsin

    def _draft_with_prefix(self, hidden, logits, anchor_tokens, anchor_ids, cos, sin, temperatures, uniforms, history):
        """The sequential head slot by slot, the prefix layer correcting each slot's logits first
        (what `DSparkProposer.propose` and `PrefixLayer.step` do). hidden `[B, G, D]`, logits
        `[B, G, V_d]`, the block's RoPE rows `[B, G, 1, HD]` -> the operator's four outputs."""
        d, prefix = self.drafter, self.drafter.prefix
        weights = self.head_weights()
        cache = {"keys": None, "values": None}  # the prefix layer's keys/values of slots 1..k-1, [B, KVH, k-1, HD]

        def correct(k, previous, logits_k):  # static k: the graph holds G copies of the layer
            previous_tokens = anchor_tokens if k == 0 else d.draft_vocab[previous]  # x_{k-1} as target ids
            embedding = _rms(d.embed[previous_tokens].to(hidden.dtype), prefix.embedding_norm.weight, self.eps)
            u = torch.cat([hidden[:, k], embedding], dim=-1) @ prefix.project.weight.t()  # [B, D]
            out, (own_keys, own_values) = self._attention(prefix.layer, u[:, None], cos[:, k : k + 1],
                                                          sin[:, k : k + 1], cache["keys"], cache["values"], None)
            for name, own in (("keys", own_keys), ("values", own_values)):
                cache[name] = own if cache[name] is None else torch.cat([cache[name], own], dim=2)
            correction = _rms(out[:, 0], prefix.norm.weight, self.eps) @ prefix.out.weight.t()  # [B, D]
            return logits_k + correction @ self.lm_head_t  # U(h_k + correction) = U_k + U(correction): U is linear

        return sd.draft_block(logits, hidden, anchor_ids, weights, temperatures, uniforms, correct, history)
