"""`build --format trtllm`: our drafter and cost table in the layout TensorRT-LLM's PyTorch
backend reads for a standalone DSpark drafter (`decoding_type: DSpark`).

What TensorRT-LLM reads (from its source: `_torch/models/modeling_dspark.py` GQADSparkForCausalLM
on top of `_torch/speculative/dflash.py` DFlashForCausalLM, `dspark_planner.py` SpsCostTable /
`load_sps_cost_table`, `dspark_sts.py` `load_sts_temperatures_from_path`):

    DIR/trtllm/drafter/config.json        HF config of the backbone (model_type llama, the draft
                                          layer count), `block_size`, and `dflash_config` with
                                          target_layer_ids, mask_token_id and the DSpark switches
                                          (projector_type dspark, shift_label, markov_rank,
                                          markov_head_type vanilla, use_confidence_head)
    DIR/trtllm/drafter/model.safetensors  fc, hidden_norm, layers.N.{self_attn,mlp}.*, norm,
                                          markov_head.markov_w{1,2}.weight [vocab, rank],
                                          confidence_head.proj.{weight,bias}
    DIR/trtllm/sps_table.json             token_counts, step_time_ms (theta(M), the trimmable
                                          part), fixed_overhead_ms (bias), batch_sizes /
                                          batch_overhead_ms (alpha(bs): our drafter step),
                                          _meta.lookup = "interp"
    DIR/trtllm/sts.json                   {"sts_temperatures": [...]} when the drafter is calibrated
    DIR/trtllm/extra_llm_api_options.yaml the speculative_config for `trtllm-serve --extra_llm_api_options`,
                                          with absolute paths (relative ones would resolve against the
                                          directory trtllm-serve is started from)

The cost table is our latency profile. TensorRT-LLM's planner weighs a draft against *its own*
engine's step times, so the options turn confidence scheduling on only when the profile was
measured on a GPU by our TensorRT backend (the same GPU and kernels of the same kind); a CPU
profile's table is written for reference and left off (the entry's `cost_table_enabled` and
`cost_table_note` say so): measure the deployment's own steps with TensorRT-LLM for it.

Exactness. Four parts of our drafter have no counterpart in TensorRT-LLM's generic DSpark
drafter, and are converted as closely as the format allows; `differences` in the returned entry
(and the manifest) says which apply:
- our feature fusion RMS-normalises each target layer's hidden state before the projection;
  TensorRT-LLM applies `hidden_norm(fc(h))` only. The per-layer norm *weights* are folded into
  `fc`; the per-layer 1/rms scaling cannot be (it is data dependent);
- our block uses a learned mask embedding; TensorRT-LLM embeds `mask_token_id` with the
  target's table. We pick the target token whose embedding is nearest (cosine) to ours;
- our draft LM head is restricted to the draft vocabulary; TensorRT-LLM scores the full
  vocabulary. Markov rows outside our draft vocabulary are zero (W2) / the out-of-vocabulary
  row (W1), so the head is exact on the draft vocabulary;
- with `context_norm`, each layer norms the context before its keys/values; TensorRT-LLM's
  layers read the context as it is, so this is dropped.
A drafter with a prefix layer is refused before this step (`build.load_models`).
Verification stays exact either way; these change acceptance, not outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_trt.models.drafter import DSparkDrafter

MIN_THETA_MS = 1e-4  # TensorRT-LLM's SpsCostTable rejects non-positive step times


def convert_state(drafter: DSparkDrafter, target_embed: torch.Tensor) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    """(TensorRT-LLM tensors, mask_token_id, differences) for a DSpark drafter."""
    c = drafter.config
    vocab = c.target_vocab_size
    differences = ["per-layer feature RMS normalisation (only its weights are folded into fc)"]
    if c.context_norm:
        differences.append("each layer's own RMS norm of the context before its keys/values (context_norm) is "
                           "dropped: TensorRT-LLM's layers read the context states as they are, so drafts accept less")
    fusion = drafter.fusion
    # fc(concat(w_i * x_i)) == (fc * concat(w_i)) (concat(x_i)): fold the per-layer norm weights.
    scale = torch.cat([norm.weight.detach() for norm in fusion.norms])  # [m*d]
    state = {"fc.weight": fusion.project.weight.detach() * scale[None, :], "hidden_norm.weight": fusion.norm.weight.detach(),
             "norm.weight": drafter.final_norm.weight.detach()}
    for i, layer in enumerate(drafter.layers):
        p = f"layers.{i}."
        k, v = layer.kv.weight.detach().chunk(2, dim=0)  # kv: [2 * KVH * HD, d], keys first
        gate, up = layer.gate_up.weight.detach().chunk(2, dim=0)
        state.update({p + "input_layernorm.weight": layer.attn_norm.weight.detach(),
                      p + "post_attention_layernorm.weight": layer.mlp_norm.weight.detach(),
                      p + "self_attn.q_proj.weight": layer.q.weight.detach(), p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.o.weight.detach(),
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": layer.down.weight.detach()})
    # The mask embedding: the target token nearest to it.
    mask = drafter.mask_embedding.detach()
    similarity = torch.nn.functional.cosine_similarity(target_embed, mask[None], dim=-1)
    mask_token_id = int(similarity.argmax())
    differences.append(f"learned mask embedding replaced by target token {mask_token_id} "
                       f"(cosine similarity {float(similarity[mask_token_id]):.3f})")
    if drafter.draft_vocab.numel() < vocab:
        differences.append(f"draft vocabulary of {drafter.draft_vocab.numel()} tokens becomes the full {vocab}")
    to_draft = drafter.to_draft  # [vocab] -> draft id (OOV = V_d)
    if drafter.previous_embedding is not None and c.head == "markov":
        w1 = drafter.previous_embedding.weight.detach()[to_draft]  # [vocab, r]: OOV tokens share the OOV row
        w2 = torch.zeros(vocab, c.markov_rank)
        w2[drafter.draft_vocab] = drafter.sequential.w2.weight.detach()
        state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"] = w1, w2
    elif c.head == "rnn":
        differences.append("RNN head dropped: TensorRT-LLM supports markov_head_type 'vanilla' only")
    if drafter.confidence is not None:
        state["confidence_head.proj.weight"] = drafter.confidence.weight.detach()
        state["confidence_head.proj.bias"] = drafter.confidence.bias.detach()
    return {k: v.contiguous().float() for k, v in state.items()}, mask_token_id, differences


def drafter_config(drafter: DSparkDrafter, target, mask_token_id: int) -> dict:
    c, t = drafter.config, target.config
    has_markov = c.head == "markov"
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "vocab_size": t.vocab_size,
        "max_position_embeddings": t.max_position_embeddings, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "float32", "block_size": c.block_size,
        "dflash_config": {"target_layer_ids": list(c.feature_layers), "mask_token_id": mask_token_id,
                          "projector_type": "dspark", "shift_label": True, "causal": False,
                          "markov_rank": c.markov_rank if has_markov else 0, "markov_head_type": "vanilla",
                          "use_confidence_head": bool(c.confidence)},
    }


def cost_table(profile_path: Path) -> dict:
    """Our measured profile in TensorRT-LLM's additive encoding T(bs, M) = bias + alpha(bs) + theta(M).

    theta(M) is the target step at M verified tokens minus bias, where bias is the step time
    extrapolated linearly to M = 0 from the first two points (clamped to [0, first point]);
    alpha(bs) is our drafter's measured step for bs requests (paid whatever is verified)."""
    from dspark_trt.runtime.profile import LatencyProfile

    profile = LatencyProfile.load(profile_path)
    xs, ys = profile.target_batch_tokens, [s * 1e3 for s in profile.target_step_seconds]
    bias = ys[0]
    if len(xs) > 1:
        slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
        bias = min(max(ys[0] - slope * xs[0], 0.0), ys[0])
    table = {"token_counts": list(xs), "step_time_ms": [round(max(y - bias, MIN_THETA_MS), 6) for y in ys],
             "fixed_overhead_ms": round(bias, 6), "minimum_predicted_gain": 0.01,
             "_meta": {"lookup": "interp", "encoding": "decomposed", "source": "dspark-trt build",
                       "backend": profile.backend, "device": profile.device}}
    if profile.drafter_num_requests:
        table["batch_sizes"] = list(profile.drafter_num_requests)
        table["batch_overhead_ms"] = [round(s * 1e3, 6) for s in profile.drafter_step_seconds]
    return table


def serve_options(folder: Path, block_size: int, use_table: bool, has_sts: bool) -> str:
    """`speculative_config` for the files in `folder` (where they will be: absolute paths)."""
    lines = ["# trtllm-serve TARGET --extra_llm_api_options extra_llm_api_options.yaml",
             "speculative_config:", "  decoding_type: DSpark", f"  max_draft_len: {block_size}",
             f"  speculative_model: {json.dumps(str(folder / 'drafter'))}"]
    if use_table:
        lines += ["  enable_confidence_scheduling: true", "  enable_ragged_verify: true",
                  f"  confidence_sps_table_path: {json.dumps(str(folder / 'sps_table.json'))}"]
    if has_sts:
        lines.append(f"  confidence_sts_path: {json.dumps(str(folder / 'sts.json'))}")
    return "\n".join(lines) + "\n"


def write_trtllm_layout(engine_dir: Path, target, drafter, profile_path: Path | None,
                        final_dir: Path | None = None) -> dict:
    """Write `engine_dir/trtllm/`; returns the manifest's `trtllm` entry. `final_dir`: where the
    engine directory will be once built (the options name files there)."""
    from safetensors.torch import save_file

    from dspark_trt.errors import DsparkError

    if drafter is None:
        raise DsparkError("--format trtllm needs a drafter (the config's drafter is null)")
    out = engine_dir / "trtllm"
    (out / "drafter").mkdir(parents=True)
    state, mask_token_id, differences = convert_state(drafter, target.model.embed.detach())
    save_file(state, str(out / "drafter" / "model.safetensors"))
    (out / "drafter" / "config.json").write_text(json.dumps(drafter_config(drafter, target, mask_token_id), indent=2) + "\n")
    has_table = profile_path is not None and profile_path.is_file()
    entry = {"path": "trtllm", "exact": False, "differences": differences, "cost_table": has_table}
    use_table = False
    if has_table:
        table = cost_table(profile_path)
        (out / "sps_table.json").write_text(json.dumps(table, indent=2) + "\n")
        use_table = table["_meta"]["backend"] == "tensorrt"
        entry["cost_table_measured_on"] = f"{table['_meta']['backend']} ({table['_meta']['device']})"
        if not use_table:
            entry["cost_table_note"] = ("measured on our CPU backend, not on TensorRT-LLM's GPU engine: written for "
                                        "reference, confidence scheduling left off in extra_llm_api_options.yaml")
    entry["cost_table_enabled"] = use_table
    temperatures = drafter.config.confidence_temperatures
    if temperatures:
        (out / "sts.json").write_text(json.dumps({"sts_temperatures": list(temperatures)}) + "\n")
    folder = Path(final_dir or engine_dir).expanduser().resolve() / "trtllm"
    (out / "extra_llm_api_options.yaml").write_text(serve_options(folder, drafter.config.block_size, use_table,
                                                                  bool(temperatures)))
    return {**entry, "sts": bool(temperatures)}
