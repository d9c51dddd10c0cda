"""The target's step as one export-friendly torch module: a ragged batch through the KV pool.

    inputs   input_ids      [T] int64   new tokens of every request, packed
             positions      [T] int64   each token's position in its request
             token_slots    [T] int64   each token's KV slot (request)
             logits_indices [N] int64   packed rows to compute logits at
             past_keys      [L, S, KVH, C, HD]   the KV pool (`runtime/kv_cache.KVPool` layout)
             past_values    [L, S, KVH, C, HD]
    outputs  logits         [N, V]
             features       [T, m*D]    outputs of the feature layers, concatenated (the drafter's input)
             present_keys   [L, S, KVH, C, HD]   the pool with the new tokens' keys/values written
             present_values [L, S, KVH, C, HD]

`dtype` is the precision the graph carries (TensorRT builds strongly typed networks, so the
graph's types are the engine's): float32, or float16 / bfloat16 for the weights, activations
and the KV pool, with RMSNorm, RoPE, the attention scores and their softmax computed in float32
(as transformers does) and logits and features returned in float32.

Token t attends to the keys of its slot at positions <= positions[t] (after this step's keys
are written), which is exactly `models/target.TargetModel.forward` for any mix of prefill
chunks, decode tokens and verification blocks. The runtime forward routes matmuls through
numpy (untraceable); this module computes the same thing from the same weights with plain
torch ops. Attention gathers each token's slot (`[T, KVH, C, HD]`): fine at the builder's
shapes, a paged-attention kernel is the way past them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.models.target import TargetModel

INPUT_NAMES = ["input_ids", "positions", "token_slots", "logits_indices", "past_keys", "past_values"]
OUTPUT_NAMES = ["logits", "features", "present_keys", "present_values"]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 whatever x's dtype (its squares overflow float16), returned in x's dtype
    (no casts at all in a float32 graph: `.float()` of a float32 tensor is itself)."""
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    return (xf * cos + torch.cat((-xf[..., half:], xf[..., :half]), dim=-1) * sin).to(x.dtype)


class ExportTarget(nn.Module):
    def __init__(self, model: TargetModel, feature_layers: tuple[int, ...], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.model = model
        self.config = model.config
        self.feature_layers = tuple(feature_layers)
        self.dtype = dtype

    def _weight(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.dtype)

    def forward(self, input_ids, positions, token_slots, logits_indices, past_keys, past_values):
        c, m, w = self.config, self.model, self._weight
        eps, hd, heads, kv_heads = c.rms_norm_eps, c.head_dim, c.num_heads, c.num_kv_heads
        group = heads // kv_heads
        angles = positions.float()[:, None] * m.inv_freq  # [T, HD/2], as TargetModel's rope table
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [T, 1, HD]
        cos, sin = angles.cos(), angles.sin()
        key_positions = torch.arange(past_keys.shape[3], device=input_ids.device)
        visible = key_positions[None] <= positions[:, None]  # [T, C]
        visible = visible[:, None, None, :]  # [T, 1, 1, C]

        x = w(m.embed)[input_ids]  # [T, D]; the table itself in dtype (folded into the initializer)
        tokens = x.shape[0]
        features, present_k, present_v = {}, [], []
        for index, layer in enumerate(m.layers):
            h = _rms(x, layer.attn_norm, eps)
            qkv = h @ w(layer.qkv.weight_t)
            if layer.qkv.bias is not None:
                qkv = qkv + w(layer.qkv.bias)
            q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
            q, k, v = q.view(tokens, heads, hd), k.view(tokens, kv_heads, hd), v.view(tokens, kv_heads, hd)
            if layer.q_norm is not None:
                q, k = _rms(q, layer.q_norm, eps), _rms(k, layer.k_norm, eps)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            # Write this step's keys/values at (slot, position): [S, C, KVH, HD] view for index_put.
            keys = past_keys[index].transpose(1, 2).index_put((token_slots, positions), k).transpose(1, 2)
            values = past_values[index].transpose(1, 2).index_put((token_slots, positions), v).transpose(1, 2)
            present_k.append(keys)
            present_v.append(values)
            own_k, own_v = keys[token_slots], values[token_slots]  # [T, KVH, C, HD]
            # q.k in float32: in float16 it overflows past |q.k| = 65504 before any scaling
            scores = (q.view(tokens, kv_heads, group, hd).float() @ own_k.float().transpose(-1, -2)) * (hd ** -0.5)
            scores = scores.masked_fill(~visible, float("-inf"))  # [T, KVH, g, C], float32
            attn = (scores.softmax(-1).to(self.dtype) @ own_v).reshape(tokens, heads * hd)
            o = attn @ w(layer.o.weight_t)
            x = x + (o if layer.o.bias is None else o + w(layer.o.bias))
            gate, up = (_rms(x, layer.mlp_norm, eps) @ w(layer.gate_up.weight_t)).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w(layer.down.weight_t)
            if index in self.feature_layers:
                features[index] = x
        # No feature layers (a build without a drafter): an empty [T, 0] output keeps the graph's interface.
        feature_tensor = (torch.cat([features[i] for i in self.feature_layers], dim=-1).float() if self.feature_layers
                          else x.new_zeros(tokens, 0, dtype=torch.float32))
        logits = (_rms(x[logits_indices], m.final_norm, eps) @ w(m.lm_head.weight_t)).float()  # [N, V]
        return logits, feature_tensor, torch.stack(present_k), torch.stack(present_v)
