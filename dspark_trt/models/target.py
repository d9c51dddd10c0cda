"""Our own forward pass of a Llama-family target (Llama, SmolLM2, Mistral, Qwen2, Qwen3).

One call runs a *ragged* batch: request r brings `num_new_tokens[r]` tokens (a prefill chunk,
one decode token, or an anchor plus draft tokens) that are appended to its own `KVCache`.
All new tokens are packed into one `[total_tokens, hidden]` matrix so every linear layer is a
single matmul for the whole batch; only attention loops over requests, because each request
attends to its own cache of its own length.

It returns logits only at the packed positions asked for (computing the 49k-wide LM head at
every prefill position would dominate prefill), and the hidden states of the requested layers
(the drafter's features). It does not sample, schedule or own caches: see `runtime/`.

Linear layers are `FrozenLinear`: fp32 through the fastest CPU BLAS, or bf16 weights through
our packed kernel (see `linear.py`). Everything else (norms, attention, the KV cache) is fp32.
With bf16 weights on a CPU where our kernels run, `forward` is one C call for the whole pass
(`cpu_kernels.FusedDecoder`: the same computation, without ~1,000 PyTorch ops a step);
`layerwise_forward` is the PyTorch path (fp32, GPUs, and the fused pass's test reference).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark_trt.models.rope import apply_rope, inverse_frequencies, rope_cos_sin
from dspark_trt.models.linear import DerivedFromWeights, FrozenLinear, in_row_by_row_mode, one_row_at_a_time
from dspark_trt.models.target_config import TargetConfig
from dspark_trt.models.kv_cache import KVCache, KVPool


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [num_logits, vocab] at the requested packed positions
    features: torch.Tensor | None  # [total_tokens, len(feature_layers) * hidden] or None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, written as transformers' Llama does it (and ~4x faster
    than `F.rms_norm` for one row on CPU, measured)."""
    if x.is_cuda and x.shape[0] > 1 and in_row_by_row_mode():
        # A GPU reduction lays out its threads (so its rounding) by how many rows it reduces;
        # the CPU's reduces each row alike whatever the count.
        return torch.cat([rms_norm(x[i : i + 1], weight, eps) for i in range(x.shape[0])])
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int) -> torch.Tensor:
    """Causal grouped-query attention of one request's new tokens.

    q: `[heads, n, head_dim]` for the tokens at positions `past .. past + n - 1`;
    keys/values: `[kv_heads, past + n, head_dim]`. Returns `[n, heads * head_dim]`.
    Written out with matmuls because, for the small shapes of decoding, this is ~3x faster on
    CPU than `scaled_dot_product_attention(enable_gqa=True)` (measured).
    """
    kv_heads, total, head_dim = keys.shape
    heads, n, _ = q.shape
    group = heads // kv_heads
    q = q.reshape(kv_heads, group * n, head_dim)  # heads sharing a kv head are stacked
    scores = (q @ keys.transpose(1, 2)) * (head_dim ** -0.5)  # [kv_heads, group * n, total]
    if n > 1:  # new token i (position past + i) sees keys 0 .. past + i
        visible = torch.arange(total, device=q.device) <= (past + torch.arange(n, device=q.device))[:, None]  # [n, total]
        scores = scores.view(kv_heads, group, n, total).masked_fill(~visible, float("-inf")).view_as(scores)
    out = scores.softmax(-1) @ values  # [kv_heads, group * n, head_dim]
    return out.view(heads, n, head_dim).transpose(0, 1).reshape(n, heads * head_dim)


# Feeds longer than this (prefill chunks) attend one request at a time; shorter ones (a decode
# token, an anchor plus a draft block) attend together in one batched matmul.
MAX_BATCHED_FEED = 32
# With fewer short feeds than this, attending one by one is faster than padding (measured).
MIN_BATCHED_FEEDS = 3


class AttentionPlan:
    """Where a forward pass's new tokens go in the KV pool and who attends to what.

    Built once per forward and shared by every layer. Short feeds are batched over the pool's
    slot range `[slot_start, slot_end)` (a view, no copy), queries padded to the longest feed;
    long feeds (prefill chunks), and short ones when there are only one or two, use
    `grouped_attention` one by one, so one long prompt does not pad every other request's queries.
    """

    def __init__(self, caches: list[KVCache], num_new_tokens: list[int], per_token: bool = False,
                 use_kernel: bool = False):
        """`per_token`: every query attends on its own (batch-invariant mode: a token's result
        then depends only on its keys, not on how many tokens or requests share the pass).
        `use_kernel`: every token attends through our CPU kernel (`kernels/cpu_kernels.c`): on
        its own too, by construction, and at full speed (the bf16 target's path)."""
        if len({id(c.pool) for c in caches}) > 1:
            raise ValueError("all caches of one forward pass must come from the same KVPool")
        for cache, count in zip(caches, num_new_tokens):
            if cache.length + count > cache.capacity:
                raise ValueError(f"KV slot overflow: {cache.length} + {count} > capacity {cache.capacity}")
        self.pool = caches[0].pool
        self.num_tokens = sum(num_new_tokens)
        starts = [0]
        for count in num_new_tokens[:-1]:
            starts.append(starts[-1] + count)
        self.positions = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, num_new_tokens)])
        self.slot_index = torch.cat([torch.full((n,), c.slot) for c, n in zip(caches, num_new_tokens)])
        self.max_position = max(c.length + n for c, n in zip(caches, num_new_tokens)) - 1

        self.use_kernel = use_kernel
        if use_kernel:  # one call for every token: no batching, padding or masks to plan
            if self.pool.keys.dtype != torch.float32 or not self.pool.keys.is_contiguous():
                raise ValueError("the attention kernel needs a contiguous fp32 KV pool")
            self.slot_index, self.positions = self.slot_index.contiguous(), self.positions.contiguous()
            return
        feeds = list(zip(starts, num_new_tokens, caches))
        short = [(start, count, cache) for start, count, cache in feeds if count <= MAX_BATCHED_FEED]
        # Per-token mode attends query by query; otherwise a few short feeds cost more to pad and
        # gather than they save.
        if per_token or len(short) < MIN_BATCHED_FEEDS:
            short = []
        self.per_token = per_token
        self.single_feeds = [feed for feed in feeds if feed not in short]
        self.short_rows = None
        if short:
            self.slot_start = min(c.slot for _, _, c in short)
            self.slot_end = max(c.slot for _, _, c in short) + 1
            self.max_feed = max(n for _, n, _ in short)
            self.max_keys = max(c.length + n for _, n, c in short)
            self.short_rows = torch.cat([torch.arange(s, s + n) for s, n, _ in short])  # packed rows
            self.query_slot = torch.cat([torch.full((n,), c.slot - self.slot_start) for _, n, c in short])
            self.query_step = torch.cat([torch.arange(n) for _, n, _ in short])
            past = torch.zeros(self.slot_end - self.slot_start, dtype=torch.long)
            for _, _, c in short:
                past[c.slot - self.slot_start] = c.length
            # Query i of a slot sits at position past + i and sees keys 0 .. past + i. Padding
            # queries and idle slots see at least key 0, so no softmax row is empty.
            keys = torch.arange(self.max_keys)
            self.visible = keys <= (past[:, None] + torch.arange(self.max_feed))[:, :, None]  # [slots, feed, keys]
        self._to_device(self.pool.keys.device)

    def _to_device(self, device: torch.device) -> None:
        """The plan is built on the CPU (small index tensors); a GPU pool needs them beside it."""
        if device.type == "cpu":
            return
        for name in ("positions", "slot_index", "short_rows", "query_slot", "query_step", "visible"):
            value = getattr(self, name, None)
            if value is not None:
                setattr(self, name, value.to(device, non_blocking=True))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k/v `[tokens, kv_heads, head_dim]` and attend q `[tokens, heads, head_dim]`."""
        pool = self.pool
        pool.keys[layer][self.slot_index, :, self.positions] = k
        pool.values[layer][self.slot_index, :, self.positions] = v
        if self.use_kernel:
            from dspark_trt.kernels import cpu_kernels

            return cpu_kernels.attention(q, pool.keys[layer], pool.values[layer], self.slot_index, self.positions)
        tokens, heads, head_dim = q.shape
        out = q.new_empty(tokens, heads * head_dim)
        if self.short_rows is not None:
            num_slots = self.slot_end - self.slot_start
            kv_heads = k.shape[1]
            group = heads // kv_heads
            padded = q.new_zeros(num_slots, self.max_feed, heads, head_dim)
            padded[self.query_slot, self.query_step] = q[self.short_rows]
            # [slots, kv_heads, group * feed, head_dim]: heads sharing a kv head stacked together
            queries = padded.permute(0, 2, 1, 3).reshape(num_slots, kv_heads, group * self.max_feed, head_dim)
            keys = pool.keys[layer, self.slot_start : self.slot_end, :, : self.max_keys]  # view
            values = pool.values[layer, self.slot_start : self.slot_end, :, : self.max_keys]
            scores = (queries @ keys.transpose(-1, -2)) * (head_dim ** -0.5)  # [slots, kv, group*feed, keys]
            scores = scores.view(num_slots, kv_heads, group, self.max_feed, self.max_keys)
            scores = scores.masked_fill(~self.visible[:, None, None], float("-inf"))
            attn = scores.view(num_slots, kv_heads, group * self.max_feed, self.max_keys).softmax(-1) @ values
            attn = attn.view(num_slots, heads, self.max_feed, head_dim).transpose(1, 2)  # [slots, feed, heads, hd]
            out[self.short_rows] = attn[self.query_slot, self.query_step].reshape(-1, heads * head_dim)
        for start, count, cache in self.single_feeds:
            if self.per_token:  # token i at position length + i sees keys 0 .. length + i, alone
                for i in range(count):
                    keys, values = cache.layer_view(layer, cache.length + i + 1)
                    out[start + i] = grouped_attention(q[start + i, :, None], keys, values, cache.length + i)[0]
                continue
            keys, values = cache.layer_view(layer, cache.length + count)
            out[start : start + count] = grouped_attention(q[start : start + count].transpose(0, 1), keys, values,
                                                           cache.length)
        return out


class TargetLayer(nn.Module):
    def __init__(self, config: TargetConfig):
        super().__init__()
        d, heads, kv_heads, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, hd
        self.eps = config.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.mlp_norm = nn.Parameter(torch.ones(d))
        # q, k and v fused into one matmul; gate and up likewise.
        self.qkv = FrozenLinear(d, (heads + 2 * kv_heads) * hd, bias=config.qkv_bias)
        self.o = FrozenLinear(heads * hd, d, bias=config.o_bias)
        self.q_norm = nn.Parameter(torch.ones(hd)) if config.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd)) if config.qk_norm else None
        self.gate_up = FrozenLinear(d, 2 * config.intermediate_size)
        self.down = FrozenLinear(config.intermediate_size, d)

    def forward(self, x: torch.Tensor, layer_index: int, cos: torch.Tensor, sin: torch.Tensor,
                plan: "AttentionPlan") -> torch.Tensor:
        # x: [total_tokens, hidden]
        h = rms_norm(x, self.attn_norm, self.eps)
        qkv = self.qkv(h)
        hd = self.head_dim
        q, k, v = qkv.split([self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1)
        q = q.view(-1, self.num_heads, hd)  # [tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, hd)
        v = v.view(-1, self.num_kv_heads, hd)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        attn_out = plan.attend(layer_index, q, k, v)  # [tokens, heads * head_dim]
        x = x + self.o(attn_out)

        h = rms_norm(x, self.mlp_norm, self.eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


LAYER_MATRICES = ("qkv", "o", "gate_up", "down")  # a layer's FrozenLinear matrices


class TargetModel(nn.Module):
    """A frozen Llama-family decoder with a ragged-batch, KV-cached forward pass."""

    def __init__(self, config: TargetConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Parameter(torch.zeros(config.vocab_size, config.hidden_size))  # [vocab, hidden]
        self.layers = nn.ModuleList(TargetLayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = FrozenLinear(config.hidden_size, config.vocab_size)
        self.register_buffer("inv_freq", inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling),
                             persistent=False)
        self._rope_cos = torch.empty(0)
        self._rope_sin = torch.empty(0)
        self._fused = DerivedFromWeights()  # cpu_kernels.FusedDecoder of these weights (`_fused_decoder`)
        self._int4: list[dict] | None = None  # per layer, its matrices' 4-bit copies (`use_int4_weights`)
        self._int8_head = None  # the LM head's 8-bit copy (`use_int4_weights`)

    def new_pool(self, num_slots: int, slot_capacity: int) -> KVPool:
        """KV memory for `num_slots` concurrent requests of up to `slot_capacity` tokens each."""
        c = self.config
        return KVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_slots, slot_capacity, dtype=self.embed.dtype,
                      device=self.embed.device)

    def _rope_tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cos.shape[0] <= max_position or self._rope_cos.device != self.inv_freq.device:
            size = max(2 * max_position, 1024)
            cos, sin = rope_cos_sin(torch.arange(size, device=self.inv_freq.device), self.inv_freq)  # [size, head_dim]
            self._rope_cos, self._rope_sin = cos.to(self.embed.dtype), sin.to(self.embed.dtype)
        return self._rope_cos, self._rope_sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: `[n, hidden]` -> `[n, vocab]`."""
        return self.lm_head(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps))

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, num_new_tokens: list[int], caches: list[KVCache],
                logits_indices: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                batch_invariant: bool = False) -> TargetOutput:
        """Run `token_ids` `[total_tokens]` (request r's `num_new_tokens[r]` tokens, packed in order).

        `logits_indices` `[num_logits]` picks packed positions to compute logits at (default: every
        position). `feature_layers` are 0-based decoder-layer indices whose *outputs* are returned
        (transformers' `hidden_states[i + 1]`). Every cache is advanced by its request's count.
        `batch_invariant`: each token's logits and features depend on its own sequence only, not
        on the other tokens of the pass (row-by-row matmuls, per-token attention; slow).
        """
        if len(num_new_tokens) != len(caches) or sum(num_new_tokens) != token_ids.shape[0]:
            raise ValueError("num_new_tokens must give one count per cache and sum to len(token_ids)")
        if self._runs_cpu_kernels():  # bf16 on a CPU with our kernels: one C call for the whole pass
            return self._fused_forward(token_ids, num_new_tokens, caches, logits_indices, feature_layers)
        return self.layerwise_forward(token_ids, num_new_tokens, caches, logits_indices, feature_layers,
                                      batch_invariant)

    def _fused_forward(self, token_ids: torch.Tensor, num_new_tokens: list[int], caches: list[KVCache],
                       logits_indices: torch.Tensor | None, feature_layers: tuple[int, ...]) -> TargetOutput:
        """`forward` through `cpu_kernels.FusedDecoder`: the same computation as
        `layerwise_forward` with bf16 weights (norms, RoPE, attention and SiLU in C, fp32), batch
        invariant by construction, without ~1,000 PyTorch ops per step."""
        plan = AttentionPlan(caches, num_new_tokens, use_kernel=True)  # checks slots, places tokens
        cos_table, sin_table = self._rope_tables(plan.max_position + 1)
        x = self.embed[token_ids]  # [total_tokens, hidden], a fresh fp32 copy the pass overwrites
        logits, features = self._fused_decoder().forward(
            x, plan.pool.keys, plan.pool.values, plan.slot_index, plan.positions, cos_table, sin_table,
            tuple(feature_layers), logits_indices)
        for cache, count in zip(caches, num_new_tokens):
            cache.advance(count)
        return TargetOutput(logits=logits, features=features)

    def _fused_decoder(self):
        """The C pass's description of the weights, rebuilt only when a weight changed."""
        return self._fused.get(self, self._describe_weights)

    def _describe_weights(self):
        from dspark_trt.kernels import cpu_kernels

        c = self.config
        shape = cpu_kernels.DecoderShape(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                         c.intermediate_size, c.vocab_size, c.rms_norm_eps)
        matrices = self._int4 or [{name: getattr(layer, name).packed() for name in LAYER_MATRICES} for layer in self.layers]
        layers = [cpu_kernels.DecoderLayerWeights(
            attn_norm=layer.attn_norm, mlp_norm=layer.mlp_norm, **packed, qkv_bias=layer.qkv.bias,
            o_bias=layer.o.bias, q_norm=layer.q_norm, k_norm=layer.k_norm) for layer, packed in zip(self.layers, matrices)]
        return cpu_kernels.FusedDecoder(shape, layers, self.final_norm, self._int8_head or self.lm_head.packed())

    @torch.inference_mode()
    def layerwise_forward(self, token_ids: torch.Tensor, num_new_tokens: list[int], caches: list[KVCache],
                          logits_indices: torch.Tensor | None = None, feature_layers: tuple[int, ...] = (),
                          batch_invariant: bool = False) -> TargetOutput:
        """`forward` layer by layer through PyTorch ops: fp32 (the reference checked against
        transformers), GPUs, bf16 without our kernels, and the reference the fused pass is
        tested against."""
        plan = AttentionPlan(caches, num_new_tokens, per_token=batch_invariant, use_kernel=self._runs_cpu_kernels())
        positions = plan.positions
        cos_table, sin_table = self._rope_tables(plan.max_position + 1)
        cos, sin = cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)  # [tokens, 1, head_dim]

        device = self.embed.device
        x = self.embed[token_ids.to(device)]  # [total_tokens, hidden]
        if logits_indices is not None:
            logits_indices = logits_indices.to(device)
        features = []
        wanted = set(feature_layers)
        with one_row_at_a_time() if batch_invariant else nullcontext():
            for index, layer in enumerate(self.layers):
                x = layer(x, index, cos, sin, plan)
                if index in wanted:
                    features.append(x)
            logits = self.compute_logits(x if logits_indices is None else x[logits_indices])
        for cache, count in zip(caches, num_new_tokens):
            cache.advance(count)

        feature_tensor = None
        if feature_layers:
            by_layer = dict(zip(sorted(wanted), features))
            feature_tensor = torch.cat([by_layer[i] for i in feature_layers], dim=-1)
        return TargetOutput(logits=logits, features=feature_tensor)

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
            self.lm_head.weight_t.copy_(head.to(self.embed.dtype).t())
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                layer.attn_norm.copy_(take(p + "input_layernorm.weight"))
                layer.mlp_norm.copy_(take(p + "post_attention_layernorm.weight"))
                qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])  # [out, in]
                layer.qkv.weight_t.copy_(qkv.t())
                if layer.qkv.bias is not None:
                    layer.qkv.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.o.weight_t.copy_(take(p + "self_attn.o_proj.weight").t())
                if layer.o.bias is not None:
                    layer.o.bias.copy_(take(p + "self_attn.o_proj.bias"))
                if layer.q_norm is not None:
                    layer.q_norm.copy_(take(p + "self_attn.q_norm.weight"))
                    layer.k_norm.copy_(take(p + "self_attn.k_norm.weight"))
                gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                layer.gate_up.weight_t.copy_(gate_up.t())
                layer.down.weight_t.copy_(take(p + "mlp.down_proj.weight").t())

    def prepare(self) -> None:
        """Pack the weights for our CPU kernels now (~0.25 s for SmolLM2-135M), where they run,
        rather than in the first request's step. Weights that change later are packed again."""
        if self._runs_cpu_kernels():
            self._fused_decoder()

    def _runs_cpu_kernels(self) -> bool:
        """The bf16 and int4 CPU targets run through our kernels (batch invariant at full speed);
        fp32 keeps PyTorch's ops, the reference checked against transformers."""
        if self.weight_dtype not in (torch.bfloat16, torch.int4) or not self.embed.is_cpu:
            return False
        from dspark_trt.kernels import cpu_kernels

        return cpu_kernels.available()

    def use_int4_weights(self) -> None:
        """`--dtype int4`: the layers' matrices in 4 bits (`cpu_kernels.Q4Weight`: Q4_1 blocks, the
        GGUF's own format) and the LM head in 8 (`Q8Weight`: Q8_0, the GGUF's format for it), each
        matmul's input quantized to int8 per block of 32 in the kernel. The fp32 weights are
        replaced by what the blocks hold, so the PyTorch path computes with the same weights (not
        with int8 inputs: it is a reference; the embedding table, read by token, stays as it is).
        Needs our kernels' AMX-INT8 build (RuntimeError saying why not)."""
        from dspark_trt.kernels import cpu_kernels

        if not cpu_kernels.q4_available():
            raise RuntimeError(f"dtype int4: {cpu_kernels.q4_unavailable_reason()}")
        self._int4 = []
        for layer in self.layers:
            packed = {}
            for name in LAYER_MATRICES:
                linear = getattr(layer, name)
                packed[name] = cpu_kernels.Q4Weight(linear.weight_t)
                linear.weight_t.data = packed[name].dequantize().contiguous()
            self._int4.append(packed)
        self._int8_head = cpu_kernels.Q8Weight(self.lm_head.weight_t)
        self.lm_head.weight_t.data = self._int8_head.dequantize().contiguous()

    @property
    def weight_dtype(self) -> torch.dtype:
        """float32; bfloat16 when the weight matrices are bf16 (`linear.use_bf16_weights`); int4
        when the layers' are 4-bit (`use_int4_weights`)."""
        return torch.int4 if self._int4 is not None else self.lm_head.weight_t.dtype

    def weight_bytes(self) -> int:
        """Bytes read per decode step (every weight once; the tied embedding table is not read)."""
        if self._int4 is not None:
            matrices = {id(getattr(layer, name).weight_t) for layer in self.layers for name in LAYER_MATRICES}
            matrices.add(id(self.lm_head.weight_t))
            rest = sum(p.numel() * p.element_size() for n, p in self.named_parameters()
                       if n != "embed" and id(p) not in matrices)
            return (rest + self._int8_head.num_bytes()
                    + sum(w.num_bytes() for packed in self._int4 for w in packed.values()))
        return sum(p.numel() * p.element_size() for n, p in self.named_parameters() if n != "embed")
