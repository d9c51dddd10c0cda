"""Our own forward pass of a Llama-family target (Llama, SmolLM2, Mistral, Qwen2, Qwen3).

One call runs a *ragged* batch: request r brings `num_new_tokens[r]` tokens (a prefill chunk,
one decode token, or an anchor plus draft tokens) that are appended to its own `KVCache`.
All new tokens are packed into one `[total_tokens, hidden]` matrix so every linear layer is a
single matmul for the whole batch; only attention loops over requests, because each request
attends to its own cache of its own length.

It returns logits only at the packed positions asked for (computing the 49k-wide LM head at
every prefill position would dominate prefill), and the hidden states of the requested layers
(the drafter's features). It does not sample, schedule or own caches: see `runtime/`.

Weights are stored transposed (`[in, out]`) because `x @ W_t` is the fastest CPU GEMV form
in PyTorch for one token (measured: ~25% faster than `F.linear` at batch 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.models.target_config import TargetConfig
from dspark_trt.runtime.kv_cache import KVCache


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [num_logits, vocab] at the requested packed positions
    features: torch.Tensor | None  # [total_tokens, len(feature_layers) * hidden] or None


def rope_inverse_frequencies(config: TargetConfig) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]`, with Llama-3 frequency scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling:  # llama3: long wavelengths are slowed down, short ones kept, a smooth ramp between
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[tokens, heads, head_dim]` by per-token angles (`cos`/`sin`: `[tokens, 1, head_dim]`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TargetLayer(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        d, heads, kv_heads, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, hd
        self.eps = config.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.mlp_norm = nn.Parameter(torch.ones(d))
        # q, k and v fused into one matmul; gate and up likewise.
        self.wqkv_t = nn.Parameter(torch.zeros(d, (heads + 2 * kv_heads) * hd))
        self.bqkv = nn.Parameter(torch.zeros((heads + 2 * kv_heads) * hd)) if config.qkv_bias else None
        self.wo_t = nn.Parameter(torch.zeros(heads * hd, d))
        self.bo = nn.Parameter(torch.zeros(d)) if config.o_bias else None
        self.q_norm = nn.Parameter(torch.ones(hd)) if config.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd)) if config.qk_norm else None
        self.w_gate_up_t = nn.Parameter(torch.zeros(d, 2 * config.intermediate_size))
        self.w_down_t = nn.Parameter(torch.zeros(config.intermediate_size, d))

    def forward(self, x: torch.Tensor, layer_index: int, cos: torch.Tensor, sin: torch.Tensor,
                num_new_tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
        # x: [total_tokens, hidden]
        h = F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.eps)
        qkv = h @ self.wqkv_t
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        hd = self.head_dim
        q, k, v = qkv.split([self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1)
        q = q.view(-1, self.num_heads, hd)  # [tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, hd)
        v = v.view(-1, self.num_kv_heads, hd)
        if self.q_norm is not None:
            q = F.rms_norm(q, (hd,), self.q_norm, self.eps)
            k = F.rms_norm(k, (hd,), self.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        outputs = []
        start = 0
        for cache, count in zip(caches, num_new_tokens):
            q_r = q[start : start + count].transpose(0, 1)  # [heads, count, head_dim]
            keys, values = cache.write(layer_index, k[start : start + count].transpose(0, 1),
                                       v[start : start + count].transpose(0, 1))
            mask = None
            if count > 1:  # new token i sits at position cache.length + i and sees keys up to it
                total = keys.shape[1]
                mask = torch.arange(total) <= (cache.length + torch.arange(count))[:, None]
            attn = F.scaled_dot_product_attention(q_r, keys, values, attn_mask=mask, enable_gqa=True)
            outputs.append(attn.transpose(0, 1).reshape(count, -1))
            start += count
        attn_out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        attn_out = attn_out @ self.wo_t
        if self.bo is not None:
            attn_out = attn_out + self.bo
        x = x + attn_out

        h = F.rms_norm(x, (x.shape[-1],), self.mlp_norm, self.eps)
        gate, up = (h @ self.w_gate_up_t).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.w_down_t


class TargetModel(nn.Module):
    """A frozen Llama-family decoder with a ragged-batch, KV-cached forward pass."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(torch.zeros(config.vocab_size, config.hidden_size))  # [vocab, hidden]
        self.layers = nn.ModuleList(TargetLayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head_t = nn.Parameter(torch.zeros(config.hidden_size, config.vocab_size))  # [hidden, vocab]
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self._rope_cos = torch.empty(0)
        self._rope_sin = torch.empty(0)

    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, dtype=self.embed.dtype)

    def _rope_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cos.shape[0] <= max_position:
            size = max(2 * max_position, 1024)
            angles = torch.outer(torch.arange(size, dtype=torch.float32), self.inv_freq)  # [size, head_dim/2]
            angles = torch.cat((angles, angles), dim=-1)
            self._rope_cos = angles.cos().to(self.embed.dtype)
            self._rope_sin = angles.sin().to(self.embed.dtype)
        return self._rope_cos, self._rope_sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: `[n, hidden]` -> `[n, vocab]`."""
        return F.rms_norm(hidden, (hidden.shape[-1],), self.final_norm, self.config.rms_norm_eps) @ self.lm_head_t

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, num_new_tokens: list[int], caches: list[KVCache],
                logits_indices: torch.Tensor | None = None,
                feature_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Run `token_ids` `[total_tokens]` (request r's `num_new_tokens[r]` tokens, packed in order).

        `logits_indices` `[num_logits]` picks packed positions to compute logits at (default: every
        position). `feature_layers` are 0-based decoder-layer indices whose *outputs* are returned
        (transformers' `hidden_states[i + 1]`). Every cache is advanced by its request's count.
        """
        if len(num_new_tokens) != len(caches) or sum(num_new_tokens) != token_ids.shape[0]:
            raise ValueError("num_new_tokens must give one count per cache and sum to len(token_ids)")
        for cache, count in zip(caches, num_new_tokens):
            cache.reserve(count)
        positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, num_new_tokens)])
        cos_table, sin_table = self._rope_tables(int(positions.max()) + 1)
        cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)  # [tokens, 1, head_dim]

        x = self.embed[token_ids]  # [total_tokens, hidden]
        features = []
        wanted = set(feature_layers)
        for index, layer in enumerate(self.layers):
            x = layer(x, index, cos, sin, num_new_tokens, caches)
            if index in wanted:
                features.append(x)
        for cache, count in zip(caches, num_new_tokens):
            cache.advance(count)

        if logits_indices is not None:
            x = x[logits_indices]
        feature_tensor = None
        if feature_layers:
            by_layer = dict(zip(sorted(wanted), features))
            feature_tensor = torch.cat([by_layer[i] for i in feature_layers], dim=-1)
        return TargetOutput(logits=self.compute_logits(x), features=feature_tensor)

    # ---- weights -------------------------------------------------------------------------

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Fill the parameters from a transformers-named state dict (`model.layers.0.self_attn...`)."""
        c = self.config

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise KeyError(name)
            return state[name].to(self.embed.dtype)

        with torch.no_grad():
            self.embed.copy_(take("model.embed_tokens.weight"))
            self.final_norm.copy_(take("model.norm.weight"))
            head = state.get("lm_head.weight")
            if head is None or c.tie_word_embeddings:
                head = state["model.embed_tokens.weight"]
            self.lm_head_t.copy_(head.to(self.embed.dtype).t())
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.attn_norm.copy_(take(p + "input_layernorm.weight"))
                layer.mlp_norm.copy_(take(p + "post_attention_layernorm.weight"))
                qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])  # [out, in]
                layer.wqkv_t.copy_(qkv.t())
                if layer.bqkv is not None:
                    layer.bqkv.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.wo_t.copy_(take(p + "self_attn.o_proj.weight").t())
                if layer.bo is not None:
                    layer.bo.copy_(take(p + "self_attn.o_proj.bias"))
                if layer.q_norm is not None:
                    layer.q_norm.copy_(take(p + "self_attn.q_norm.weight"))
                    layer.k_norm.copy_(take(p + "self_attn.k_norm.weight"))
                gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                layer.w_gate_up_t.copy_(gate_up.t())
                layer.w_down_t.copy_(take(p + "mlp.down_proj.weight").t())
        # The transposed copies must be contiguous for the fast GEMV path.
        for param in self.parameters():
            if not param.is_contiguous():
                param.data = param.data.contiguous()

    def weight_bytes(self) -> int:
        """Bytes read per decode step (every weight once; the tied embedding table is not read)."""
        return sum(p.numel() * p.element_size() for n, p in self.named_parameters() if n != "embed")
