"""The DSpark drafter as one export-friendly torch module: features in, a drafted block out.

One call drafts one block for each of B requests, statelessly:

    inputs   context_features [B, C, m*D]  raw target features of each request's context (padded)
             context_lengths  [B] int64    how many rows of context_features are real
             anchor_tokens    [B] int64    the pending (anchor) token, a target id
             temperatures     [B]          0 = greedy
             uniforms         [B, G]       one uniform per block slot (sampling)
    outputs  draft_tokens     [B, G] int64 target ids
             token_probs      [B, G]       p_k(x_k)
             confidences      [B, G]       calibrated c_k
             distributions    [B, G, V_d]  p_k over the draft vocabulary (`draft_vocab` maps to target ids)

It computes what `DSparkProposer` computes, for drafters without a prefix layer (refused here):
fusion, context keys/values, the backbone with the block at positions `C_b .. C_b + G - 1`, the
draft LM head and the sequential head, from the same weights, written with plain torch ops that
`torch.onnx` can trace (the runtime's modules route matmuls through numpy and use SDPA's GQA flag).
The sequential head is the
`dspark::sequential_draft` custom op (one `SequentialDraft` ONNX node, for TensorRT) or, with
`use_plugin=False`, its reference traced into standard ops (for ONNX Runtime on CPU).

Stateless on purpose: the graph holds every drafter weight, so an engine needs nothing else;
the cost is re-projecting the context each call, O(C) rather than O(new tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark_trt.errors import ModelLoadError
from dspark_trt.models.drafter import DSparkDrafter, RNNHead
from dspark_trt.plugins import sequential_draft as sd

INPUT_NAMES = ["context_features", "context_lengths", "anchor_tokens", "temperatures", "uniforms"]
OUTPUT_NAMES = ["draft_tokens", "token_probs", "confidences", "distributions"]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def check_exportable(config, name: str = "drafter") -> None:
    """Refuse a drafter this export cannot compute (the builder calls it before exporting anything)."""
    if config.prefix_layer:
        raise ModelLoadError(f"{name}: prefix_layer = true, which the ONNX/TensorRT drafter (and its SequentialDraft "
                             "plugin) does not have yet; serve this drafter with the PyTorch engine")


class ExportDrafter(nn.Module):
    def __init__(self, drafter: DSparkDrafter, use_plugin: bool = True):
        super().__init__()
        if drafter.embed is None:
            raise ValueError("attach the target (drafter.attach_target) before exporting the drafter")
        c = drafter.config
        check_exportable(c)
        self.config, self.drafter, self.use_plugin = c, drafter, use_plugin
        self.block_size, self.eps = c.block_size, c.rms_norm_eps
        self.head = sd.HEAD_CODES[c.head]
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32)
                                                                 / c.head_dim)), persistent=False)
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

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[..., None] * self.inv_freq  # [..., head_dim/2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(-2)  # [..., 1, head_dim]
        return angles.cos(), angles.sin()

    def _attention(self, layer, x, cos, sin, context_k, context_v, visible):
        """x `[B, G, D]`; context k/v `[B, KVH, C, HD]`; visible `[B, 1, 1, C + G]` -> `[B, G, D]`."""
        c = self.config
        batch, block, _ = x.shape
        h = _rms(x, layer.attn_norm.weight, self.eps)
        q = _rope((h @ layer.q.weight.t()).view(batch, block, c.num_heads, c.head_dim), cos, sin)  # [B, G, H, HD]
        k, v = (h @ layer.kv.weight.t()).view(batch, block, 2, c.num_kv_heads, c.head_dim).unbind(2)
        k = _rope(k, cos, sin).transpose(1, 2)  # [B, KVH, G, HD]
        keys = torch.cat([context_k, k], dim=2)  # [B, KVH, C + G, HD]
        values = torch.cat([context_v, v.transpose(1, 2)], dim=2)
        group = c.num_heads // c.num_kv_heads
        q = q.transpose(1, 2).reshape(batch, c.num_kv_heads, group * block, c.head_dim)  # heads of one kv head stacked
        scores = (q @ keys.transpose(-1, -2)) * (c.head_dim ** -0.5)  # [B, KVH, group*G, C+G]
        scores = scores.masked_fill(~visible, float("-inf"))
        out = (scores.softmax(-1) @ values).view(batch, c.num_heads, block, c.head_dim)
        x = x + out.transpose(1, 2).reshape(batch, block, -1) @ layer.o.weight.t()
        gate, up = (_rms(x, layer.mlp_norm.weight, self.eps) @ layer.gate_up.weight.t()).chunk(2, dim=-1)
        return x + (torch.nn.functional.silu(gate) * up) @ layer.down.weight.t()

    def forward(self, context_features, context_lengths, anchor_tokens, temperatures, uniforms):
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
            x = self._attention(layer, x, bcos, bsin, ck, cv.transpose(1, 2), visible)
        hidden = _rms(x, d.final_norm.weight, self.eps)  # [B, G, D]
        logits = hidden @ d.lm_head_t  # [B, G, V_d]

        anchor_ids = d.to_draft[anchor_tokens]  # draft-vocab ids, V_d = out of vocabulary
        op = sd.sequential_draft if self.use_plugin else sd.reference
        ids, token_probs, confidences, distributions = op(
            logits, hidden, anchor_ids, self.w1, self.w2, *self.gru, self.conf_w, self.conf_b, self.conf_inv_temps,
            temperatures, uniforms, self.head, int(d.confidence is not None))
        return d.draft_vocab[ids], token_probs, confidences, distributions
