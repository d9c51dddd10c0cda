"""`build --format trtllm`: the files TensorRT-LLM's DSpark drafter loader and planner read.

TensorRT-LLM itself is not installable here; the checks re-state its loader's and cost table's
rules (GQADSparkForCausalLM.load_weights, SpsCostTable.__post_init__, load_sts_temperatures_from_path)
and check the numbers: the Markov head and the folded projection against our drafter."""

import itertools
import json
from pathlib import Path
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dspark_trt.builder.tiny import tiny_drafter_folder, tiny_target_folder
from dspark_trt.builder.trtllm import write_trtllm_layout
from dspark_trt.models.drafter_io import load_drafter
from dspark_trt.models.loading import load_target
from dspark_trt.runtime.profile import LatencyProfile


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    target = load_target(tiny_target_folder())
    drafter = load_drafter(tiny_drafter_folder(), target)
    drafter.config.confidence_temperatures = [1.5, 1.0, 0.8, 2.0]
    folder = tmp_path_factory.mktemp("trtllm")
    profile = LatencyProfile("torch-cpu", "cpu:test", [1, 2, 4, 8, 16], [0.010, 0.011, 0.012, 0.016, 0.030],
                             [1, 2, 4], [0.002, 0.003, 0.005])
    profile.save(folder / "profile.json")
    entry = write_trtllm_layout(folder, target, drafter, folder / "profile.json")
    return folder / "trtllm", entry, target, drafter


def test_drafter_config_declares_the_dspark_heads(written):
    out, entry, _, _ = written
    config = json.loads((out / "drafter" / "config.json").read_text())
    flash = config["dflash_config"]
    assert config["block_size"] == 4 and config["num_hidden_layers"] == 1 and config["vocab_size"] == 49152
    assert flash["target_layer_ids"] == [1, 2] and flash["projector_type"] == "dspark" and flash["shift_label"]
    assert flash["markov_rank"] == 16 and flash["markov_head_type"] == "vanilla" and flash["use_confidence_head"]
    assert not flash["causal"] and 0 <= flash["mask_token_id"] < 49152
    assert entry["exact"] is False and any("mask" in d for d in entry["differences"])


def test_weights_have_the_names_and_shapes_the_loader_checks(written):
    out, _, _, drafter = written
    state = load_file(out / "drafter" / "model.safetensors")
    d, vocab, rank = 64, 49152, 16
    # GQADSparkForCausalLM.load_weights: markov_w1/markov_w2 must be [vocab, markov_rank]
    assert state["markov_head.markov_w1.weight"].shape == (vocab, rank)
    assert state["markov_head.markov_w2.weight"].shape == (vocab, rank)
    assert state["confidence_head.proj.weight"].shape == (1, d + rank)
    assert state["fc.weight"].shape == (d, 2 * d) and state["hidden_norm.weight"].shape == (d,)
    c = drafter.config
    assert state["layers.0.self_attn.q_proj.weight"].shape == (c.num_heads * c.head_dim, d)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (c.num_kv_heads * c.head_dim, d)
    assert state["layers.0.mlp.down_proj.weight"].shape == (d, c.intermediate_size)
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in state)  # shared with the target


def test_markov_head_is_exact_on_the_draft_vocabulary(written):
    out, _, _, drafter = written
    state = load_file(out / "drafter" / "model.safetensors")
    w1, w2 = state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"]
    previous = torch.tensor([0, 5, 2047, 30000])  # the last one is outside the draft vocabulary
    theirs = (w1[previous] @ w2.t())[:, drafter.draft_vocab]  # dspark_markov_chain_logits' bias
    ours, _ = drafter.sequential_bias(torch.zeros(4, 64), drafter.to_draft[previous])
    assert (theirs - ours).abs().max() < 1e-5


def test_projection_folds_the_feature_norm_weights(written):
    """On per-layer unit-RMS features (where the unfoldable 1/rms is 1) hidden_norm(fc(h)) is ours."""
    out, _, _, drafter = written
    state = load_file(out / "drafter" / "model.safetensors")
    parts = torch.randn(3, 2, 64)
    parts = parts / parts.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    features = parts.flatten(1)
    projected = features @ state["fc.weight"].t()
    theirs = state["hidden_norm.weight"] * projected * torch.rsqrt(projected.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert (theirs - drafter.fuse_features(features)).abs().max() < 1e-4


def test_cost_table_follows_sps_cost_table_rules(written):
    out, *_ = written
    table = json.loads((out / "sps_table.json").read_text())
    counts, theta = table["token_counts"], table["step_time_ms"]
    assert counts == [1, 2, 4, 8, 16] and len(theta) == len(counts)
    assert all(b > a for a, b in itertools.pairwise(counts))  # strictly increasing
    assert all(math.isfinite(t) and t > 0 for t in theta)
    assert table["fixed_overhead_ms"] >= 0 and table["_meta"]["lookup"] == "interp"
    assert len(set(theta)) > 1  # not the "unprofiled" flat table
    # bias + theta reproduces the measured step at every point (decomposed encoding)
    for _, t, measured in zip(counts, theta, [10, 11, 12, 16, 30]):
        assert abs(table["fixed_overhead_ms"] + t - measured) < 1e-3
    assert table["batch_sizes"] == [1, 2, 4] and table["batch_overhead_ms"] == [2.0, 3.0, 5.0]


def test_serving_options_and_sts(written):
    out, entry, *_ = written
    options = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())["speculative_config"]
    assert options["decoding_type"] == "DSpark" and options["max_draft_len"] == 4
    # Absolute: trtllm-serve resolves relative paths against the folder it is started from.
    assert Path(options["speculative_model"]).is_absolute() and Path(options["speculative_model"]).is_dir()
    assert json.loads(Path(options["confidence_sts_path"]).read_text())["sts_temperatures"] == [1.5, 1.0, 0.8, 2.0]
    # The fixture's profile is a CPU one: TensorRT-LLM's planner must not weigh drafts by it.
    assert "confidence_sps_table_path" not in options and "enable_confidence_scheduling" not in options
    assert entry["cost_table"] and not entry["cost_table_enabled"] and "CPU" in entry["cost_table_note"]


def test_a_gpu_profile_turns_confidence_scheduling_on(tmp_path, written):
    _, _, target, drafter = written
    profile = LatencyProfile("tensorrt", "cuda:NVIDIA H100", [1, 2, 4], [0.004, 0.0042, 0.0045], [1, 2], [0.001, 0.0012])
    profile.save(tmp_path / "profile.json")
    entry = write_trtllm_layout(tmp_path, target, drafter, tmp_path / "profile.json", final_dir=tmp_path / "moved")
    options = yaml.safe_load((tmp_path / "trtllm" / "extra_llm_api_options.yaml").read_text())["speculative_config"]
    assert entry["cost_table_enabled"] and options["enable_confidence_scheduling"] is True
    # the paths name where the directory will be installed, not where it was written
    assert options["confidence_sps_table_path"] == str((tmp_path / "moved" / "trtllm" / "sps_table.json").resolve())


@pytest.mark.gpu
def test_trtllm_serves_the_written_drafter(written):
    """The real path: TensorRT-LLM's LLM API with our drafter and cost table (GPU machines with tensorrt_llm)."""
    tensorrt_llm = pytest.importorskip("tensorrt_llm")
    from tensorrt_llm.llmapi.llm_args import DSparkDecodingConfig

    out, *_ = written
    spec = DSparkDecodingConfig(max_draft_len=4, speculative_model=str(out / "drafter"))
    llm = tensorrt_llm.LLM(model=str(tiny_target_folder()), speculative_config=spec)
    result = llm.generate(["The sea is"], tensorrt_llm.SamplingParams(max_tokens=8, temperature=0.0))
    assert len(result[0].outputs[0].token_ids) == 8
