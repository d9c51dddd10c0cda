"""`dspark-trt build` on the tiny config: ONNX graphs, ONNX Runtime parity, manifest and profile,
serving from the engine directory, atomic output, and every bad input's error."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

from dspark_trt import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from dspark_trt.builder.build import BuildError, build
from dspark_trt.builder.export_drafter import OUTPUT_NAMES, ExportDrafter
from dspark_trt.builder.onnx_export import sample_drafter_inputs, sample_target_inputs
from dspark_trt.builder.tiny import tiny_drafter_folder, tiny_target_folder
from dspark_trt.cli import main
from dspark_trt.config import ConfigError, load_build_config
from dspark_trt.kernels import cpu_kernels
from dspark_trt.models.drafter_io import load_drafter
from dspark_trt.models.linear import dtype_name, resolve_dtype
from dspark_trt.models.loading import load_target
from dspark_trt.runtime.engine_dir import (
    FORMAT_VERSION,
    EngineDirError,
    open_engine_dir,
)
from dspark_trt.runtime.profile import LatencyProfile


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One real build of configs/tiny.yaml, shared by the tests that read it."""
    output = tmp_path_factory.mktemp("engines") / "tiny"
    lines = []
    report = build(load_build_config("tiny"), output, progress=lines.append)
    return output, report, lines


@pytest.fixture(scope="module")
def tiny_models():
    target = load_target(tiny_target_folder())
    return target, load_drafter(tiny_drafter_folder(), target)


def copy_dir(built_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(built_dir, copy)
    return copy


def edit_manifest(folder: Path, **changes) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(changes)
    (folder / "manifest.json").write_text(json.dumps(manifest))


# ---- configs ---------------------------------------------------------------------------------------


def test_configs_are_strict_and_overridable():
    config = load_build_config("default")
    assert config.target == "default" and config.block_size == 7
    tiny = load_build_config("tiny", ["profile.max_requests=2", "engines.build=never", "validation.logits_atol=1e-5"])
    assert tiny.profile.max_requests == 2 and tiny.engines.build == "never" and tiny.validation.logits_atol == 1e-5
    with pytest.raises(ConfigError, match="unknown config key 'profile.speed'"):
        load_build_config("tiny", ["profile.speed=3"])
    with pytest.raises(ConfigError, match="target_shapes.num_slots: needs min <= opt <= max"):
        load_build_config("tiny", ["target_shapes.num_slots.min=9"])
    with pytest.raises(ConfigError, match="engines.precision"):
        load_build_config("tiny", ["engines.precision=fp12"])
    with pytest.raises(ConfigError, match="not found"):
        load_build_config("no-such-config")


def test_unknown_key_in_a_file_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ntarget: default\ndrafter_shape: {}\n")
    result = CliRunner().invoke(main, ["build", str(path), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "unknown config key 'drafter_shape'" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# ---- the built directory ---------------------------------------------------------------------------


def test_build_writes_a_complete_engine_directory(built):
    output, _, lines = built
    for step in ("[1/6] load", "[2/6] export", "[3/6] validate", "[4/6] engines", "[5/6] profile", "[6/6] package"):
        assert any(line.startswith(step) for line in lines)
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION and manifest["backend"] == "torch-cpu"
    assert manifest["block_size"] == 4 and manifest["feature_layers"] == [1, 2]
    assert manifest["target"]["hidden_size"] == 64 and manifest["vocab_size"] == 49152
    assert set(manifest["build"]["seconds"]) == {"load", "export", "validate", "engines", "profile", "package"}
    assert manifest["engines"]["built"] is False and manifest["engines"]["reason"]
    assert manifest["drafter"]["sequential_head"] == "SequentialDraft plugin" and not manifest["drafter"]["prefix_layer"]
    assert all(manifest["validation"].values())
    for rel in manifest["files"].values():
        assert (output / rel).exists()
    assert not [p for p in output.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_drafter_graph_has_one_sequential_draft_node_for_tensorrt(built):
    model = onnx.load(str(built[0] / "onnx" / "drafter.onnx"))
    nodes = [n for n in model.graph.node if n.domain == "dspark"]
    assert [n.op_type for n in nodes] == ["SequentialDraft"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["plugin_namespace"] == b"dspark" and attrs["plugin_version"] == b"1" and attrs["head"] == 1
    assert any(o.domain == "dspark" for o in model.opset_import)
    unrolled = onnx.load(str(built[0] / "onnx" / "drafter_unrolled.onnx"))
    assert all(n.domain in ("", "ai.onnx") for n in unrolled.graph.node)


@pytest.mark.parametrize("graph", ["target", "drafter", "drafter_unrolled"])
def test_polygraphy_inspect_reads_the_graphs(built, graph):
    script = Path(sys.executable).with_name("polygraphy")
    done = subprocess.run([sys.executable, str(script), "inspect", "model", str(built[0] / "onnx" / f"{graph}.onnx")],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "Graph Input" in done.stdout


def test_validation_report_records_tolerances_and_lint(built):
    report = json.loads((built[0] / "validation" / "report.json").read_text())
    assert report["target"]["onnxruntime_vs_torch_max_abs"]["logits"] <= 1e-4
    assert report["drafter"]["greedy_tokens_identical_onnxruntime"]
    assert report["drafter"]["greedy_tokens_identical_runtime_proposer"]
    assert report["plugin_node"]["ok"]
    assert report["polygraphy"]["target.onnx"]["lint_ok"] and report["polygraphy"]["drafter_unrolled.onnx"]["lint_ok"]


def test_onnxruntime_matches_torch_on_fresh_inputs(built, tiny_models):
    """Independent of the build's own check: new seeds, longer contexts, fresh ORT sessions."""
    target, drafter = tiny_models
    config = load_build_config("tiny", ["validation.seed=7", "validation.num_requests=4",
                                        "validation.context_tokens=20"])
    feeds, golden = sample_target_inputs(target, config, (1, 2))
    session = ort.InferenceSession(str(built[0] / "onnx" / "target.onnx"), providers=["CPUExecutionProvider"])
    logits, features, keys, _ = session.run(None, {k: v.numpy() for k, v in feeds.items()})
    assert np.abs(logits - golden["logits"].numpy()).max() <= 1e-4
    assert np.abs(features - golden["features"].numpy()).max() <= 1e-4
    assert np.abs(keys - golden["present_keys"].numpy()).max() <= 1e-4

    feeds = sample_drafter_inputs(target, drafter, config)
    feeds["temperatures"] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    session = ort.InferenceSession(str(built[0] / "onnx" / "drafter_unrolled.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip(OUTPUT_NAMES, session.run(None, {k: v.numpy() for k, v in feeds.items()})))
    with torch.inference_mode():
        want = dict(zip(OUTPUT_NAMES, (t.numpy() for t in ExportDrafter(drafter)(*feeds.values()))))
    greedy = feeds["temperatures"].numpy() == 0
    assert np.array_equal(got["draft_tokens"][greedy], want["draft_tokens"][greedy])
    assert np.abs(got["confidences"] - want["confidences"]).max() <= 1e-4
    assert np.abs(got["distributions"] - want["distributions"]).max() <= 1e-4


def test_manifest_and_profile_round_trip(built, tmp_path):
    engine = open_engine_dir(built[0])
    profile = engine.load_profile()
    # The CPU backend's profile names the dtype it was measured in, which the manifest records.
    dtype = engine.manifest["dtype"]
    assert dtype == dtype_name(resolve_dtype(load_build_config("tiny").dtype))
    assert profile.backend == ("torch-cpu" if dtype == "float32" else f"torch-cpu-{dtype}")
    assert profile.device == engine.manifest["device"]
    assert profile.drafter_num_requests and all(s > 0 for s in profile.target_step_seconds)
    # The manifest names the build of our CPU kernels the profile was measured with (or why none ran).
    kernels = engine.manifest["cpu_kernels"]
    if dtype == "bfloat16":
        assert kernels["isa"] == cpu_kernels.isa() and kernels["isa"] in kernels["supported"]
    else:
        assert kernels["isa"] is None and kernels["why_not"]
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    with pytest.raises(InvalidRequestError, match=f"built and profiled for dtype {dtype}") as error:
        LLM(engine_dir=built[0], dtype=other)
    assert error.value.param == "dtype"
    profile.save(tmp_path / "p.json")
    again = LatencyProfile.load(tmp_path / "p.json")
    assert again == profile
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads((built[0] / "profile.json").read_text())


def test_llm_serves_the_engine_directory_like_its_parts(built):
    params = SamplingParams(max_tokens=10, temperature=0.0)
    from_dir = LLM(engine_dir=built[0], max_batch_size=2, policy="all")
    assert from_dir.engine.proposer is not None
    direct = LLM(target=tiny_target_folder(), drafter=str(tiny_drafter_folder()), max_batch_size=2, policy="all")
    prompts = ["The sea is", "def f(x):"]
    a, b = from_dir.generate(prompts, params), direct.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].metrics["num_draft_tokens"] > 0



# ---- a drafter with a prefix layer: no plugin, its loop in standard ops -----------------------------


@pytest.fixture(scope="module")
def built_prefix(tmp_path_factory):
    """`dspark-trt build tiny` with a tiny DSpark drafter that has a prefix layer (through the CLI)."""
    output = tmp_path_factory.mktemp("engines") / "prefix"
    drafter = tiny_drafter_folder(prefix_layer=True)
    result = CliRunner().invoke(main, ["build", "tiny", "--output", str(output), "--set", f"drafter={drafter}",
                                       "--set", "profile.measure=false"])
    assert result.exit_code == 0, result.output
    return output, drafter


def test_prefix_layer_drafter_builds_one_standard_ops_graph(built_prefix):
    """drafter.onnx has no plugin node (TensorRT builds its loop as it is), and the build's own
    checks ran on it: ONNX Runtime against torch, greedy tokens against the runtime proposer, lint."""
    output, _ = built_prefix
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["drafter"]["prefix_layer"] and manifest["drafter"]["sequential_head"] == "standard ops"
    assert "drafter_unrolled_onnx" not in manifest["files"] and not (output / "onnx" / "drafter_unrolled.onnx").exists()
    assert all(manifest["validation"].values())
    model = onnx.load(str(output / "onnx" / "drafter.onnx"))
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    # the draft LM head (hidden x draft vocabulary) is stored once, though every slot uses it
    shapes = [list(t.dims) for t in model.graph.initializer]
    shapes += [list(a.t.dims) for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    assert shapes.count([64, 2048]) == 1
    report = json.loads((output / "validation" / "report.json").read_text())
    assert report["plugin_node"] == {"count": 0, "expected": 0, "attributes": {}, "ok": True}
    assert report["drafter"]["greedy_tokens_identical_onnxruntime"]
    assert report["drafter"]["greedy_tokens_identical_runtime_proposer"]
    assert report["polygraphy"]["drafter.onnx"]["lint_ok"]


def test_prefix_layer_graph_matches_torch_on_fresh_inputs(built_prefix, tiny_models):
    """New seeds and longer contexts in a fresh ONNX Runtime session, sampled rows included."""
    output, drafter_folder = built_prefix
    target = tiny_models[0]
    drafter = load_drafter(drafter_folder, target)
    config = load_build_config("tiny", ["validation.seed=11", "validation.num_requests=4",
                                        "validation.context_tokens=20"])
    feeds = sample_drafter_inputs(target, drafter, config)
    session = ort.InferenceSession(str(output / "onnx" / "drafter.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip(OUTPUT_NAMES, session.run(None, {k: v.numpy() for k, v in feeds.items()})))
    with torch.inference_mode():
        want = dict(zip(OUTPUT_NAMES, (t.numpy() for t in ExportDrafter(drafter)(*feeds.values()))))
    assert (feeds["temperatures"] > 0).any() and (feeds["temperatures"] == 0).any()
    assert np.array_equal(got["draft_tokens"], want["draft_tokens"])
    assert np.abs(got["confidences"] - want["confidences"]).max() <= 1e-4
    assert np.abs(got["distributions"] - want["distributions"]).max() <= 1e-4


def test_llm_serves_a_prefix_layer_engine_directory_losslessly(built_prefix):
    output, _ = built_prefix
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prompts = ["The sea is", "def f(x):"]
    served = LLM(engine_dir=output, max_batch_size=2, policy="all").generate(prompts, params)
    plain = LLM(target=tiny_target_folder(), max_batch_size=2).generate(prompts, params)
    assert [o.token_ids for o in served] == [o.token_ids for o in plain]
    assert served[0].metrics["num_draft_tokens"] > 0

# ---- engine directory errors -----------------------------------------------------------------------


def test_engine_dir_errors_name_the_problem(built, tmp_path):
    with pytest.raises(EngineDirError, match="does not exist"):
        open_engine_dir(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineDirError, match="no manifest.json"):
        LLM(engine_dir=tmp_path / "empty")
    copy = copy_dir(built[0], tmp_path)
    edit_manifest(copy, format_version=FORMAT_VERSION + 1)
    with pytest.raises(EngineDirError, match="newer dspark-trt"):
        open_engine_dir(copy)
    edit_manifest(copy, format_version=FORMAT_VERSION, device="cuda:NVIDIA H100 sm_90")
    with pytest.raises(EngineDirError, match="built for device 'cuda:NVIDIA H100 sm_90'"):
        LLM(engine_dir=copy)
    manifest = json.loads((built[0] / "manifest.json").read_text())
    edit_manifest(copy, device=manifest["device"], target={**manifest["target"], "hidden_size": 576})
    with pytest.raises(EngineDirError, match="hidden_size 576"):
        LLM(engine_dir=copy)
    edit_manifest(copy, target=manifest["target"])
    (copy / "onnx" / "target.onnx").unlink()
    with pytest.raises(EngineDirError, match="files.target_onnx"):
        open_engine_dir(copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(EngineDirError, match="not valid JSON"):
        open_engine_dir(copy)


def test_interrupted_build_leaves_nothing_servable(tmp_path):
    output = tmp_path / "out"

    def interrupt_at_export(line):
        if line.startswith("[2/6]"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(load_build_config("tiny"), output, progress=interrupt_at_export)
    assert not output.exists()
    assert list(tmp_path.iterdir()) == []  # the staging folder went too
    with pytest.raises(EngineDirError):
        open_engine_dir(output)


def test_a_staging_folder_killed_mid_build_is_not_servable(tmp_path):
    """What a SIGKILL leaves (a staging folder, no manifest) is rejected by serve, and the next
    build into the same output removes it."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # a pid that no longer runs
    staging = tmp_path / f".out.partial-{dead}"
    (staging / "onnx").mkdir(parents=True)
    with pytest.raises(EngineDirError, match="no manifest.json"):
        open_engine_dir(staging)
    with pytest.raises(ModelLoadError):  # fails at load, after the stale folder was cleared
        build(load_build_config("tiny", [f"drafter={tmp_path / 'missing'}"]), tmp_path / "out",
              progress=lambda line: None)
    assert not staging.exists()


def test_existing_output_needs_force(built):
    with pytest.raises(BuildError, match="--force"):
        build(load_build_config("tiny"), built[0], progress=lambda line: None)


# ---- bad checkpoints and mismatches: caught at the load step, before any export ----------------------


def run_build(tmp_path, *overrides):
    output = tmp_path / "out"
    try:
        build(load_build_config("tiny", list(overrides)), output, progress=lambda line: None)
    finally:
        assert not output.exists()
        assert list(tmp_path.glob(".out.*")) == []


def test_missing_drafter_checkpoint(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        run_build(tmp_path, f"drafter={tmp_path / 'missing'}", "target=tiny-random")


def test_corrupt_drafter_checkpoint(tmp_path, corrupt_copy):
    broken = corrupt_copy(tiny_drafter_folder())
    (broken / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="corrupt drafter weights"):
        run_build(tmp_path, f"drafter={broken}")


def test_corrupt_target_checkpoint(tmp_path, corrupt_copy):
    broken = corrupt_copy(tiny_target_folder())
    (broken / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="corrupt weights"):
        run_build(tmp_path, f"target={broken}", f"drafter={tiny_drafter_folder()}")


@pytest.mark.parametrize("shape, field", [({"hidden_size": 32, "num_attention_heads": 2}, "hidden size"),
                                          ({"num_hidden_layers": 3}, "number of layers")])
def test_drafter_for_another_target(tmp_path, tiny_factory, shape, field):
    other = tiny_factory("llama", seed=3, **shape)
    with pytest.raises(ModelLoadError, match=field):
        run_build(tmp_path, f"target={other}", f"drafter={tiny_drafter_folder()}")


def test_drafter_with_a_different_vocabulary(tmp_path, corrupt_copy):
    drafter = corrupt_copy(tiny_drafter_folder())
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "target_vocab_size": 32000}))
    with pytest.raises(ModelLoadError, match="vocabulary size 32000"):
        run_build(tmp_path, f"drafter={drafter}", "target=tiny-random")


def test_drafter_feature_layers_outside_the_target(tmp_path, corrupt_copy):
    drafter = corrupt_copy(tiny_drafter_folder())
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "feature_layers": [1, 9]}))
    with pytest.raises(ModelLoadError, match="feature layers"):
        run_build(tmp_path, f"drafter={drafter}", "target=tiny-random")


def test_block_size_mismatch(tmp_path):
    with pytest.raises(ModelLoadError, match="block_size: the config asks for 6"):
        run_build(tmp_path, "block_size=6", f"drafter={tiny_drafter_folder()}")


def test_default_config_resolves_to_the_committed_drafter_folder():
    from dspark_trt.builder.build import resolve_specs
    from dspark_trt.models.drafter_io import DEFAULT_DRAFTER_DIR

    target, drafter = resolve_specs(load_build_config("default"))
    assert target == "default" and drafter == str(DEFAULT_DRAFTER_DIR) and Path(drafter).is_dir()


def test_a_drafter_with_a_copy_bias_builds_with_it_in_the_graphs(tmp_path):
    """The copy bias is part of the exported drafter (input `context_tokens`, the op's copy
    attributes), validated against the runtime proposer that adds it, on sample prompts that
    copy; the manifest says so, and the copied checkpoint keeps it."""
    drafter = tmp_path / "drafter"
    shutil.copytree(tiny_drafter_folder(), drafter)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "copy_bias": [[3.0, 5.0]] * config["block_size"]}))
    output = tmp_path / "engines"
    result = CliRunner().invoke(main, ["build", "tiny", "--output", str(output), "--set", f"drafter={drafter}",
                                       "--set", "profile.measure=false"])
    assert result.exit_code == 0, result.output
    assert "left out" not in result.output and "copy candidates in the sample" in result.output
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["drafter"]["copy_ngram"] == 2 and "copy_ngram_outside_graphs" not in manifest["drafter"]
    assert manifest["drafter"]["graph_inputs"][-1] == "context_tokens" and all(manifest["validation"].values())
    report = json.loads((output / "validation" / "report.json").read_text())
    assert report["drafter"]["copy_candidates"]["in_greedy_rows"] > 0
    assert report["drafter"]["greedy_tokens_identical_runtime_proposer"]
    for graph in ("drafter", "drafter_unrolled"):
        model = onnx.load(str(output / "onnx" / f"{graph}.onnx"))
        assert [i.name for i in model.graph.input][-1] == "context_tokens"
    nodes = [n for n in onnx.load(str(output / "onnx" / "drafter.onnx")).graph.node if n.domain == "dspark"]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}["copy_ngram"] == 2
    assert json.loads((output / "drafter" / "config.json").read_text())["copy_bias"] == [[3.0, 5.0]] * config["block_size"]


def test_a_config_without_a_drafter_builds_a_servable_target(tmp_path):
    """`drafter: null`: the target graph alone (no feature layers: an empty features output), served plainly."""
    output = tmp_path / "plain"
    report = build(load_build_config("tiny", ["drafter=null"]), output, progress=lambda line: None)
    assert (output / "onnx" / "target.onnx").is_file() and not (output / "onnx" / "drafter.onnx").exists()
    assert report.manifest["validation"] == {"target": True}
    llm = LLM(engine_dir=output, max_batch_size=1)
    assert llm.engine.proposer is None
    direct = LLM(target=tiny_target_folder(), drafter=None, max_batch_size=1)
    params = SamplingParams(max_tokens=8, temperature=0)
    assert llm.generate("Hello", params)[0].token_ids == direct.generate("Hello", params)[0].token_ids


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_builds_export_the_graph_tensorrt_builds(tmp_path, precision):
    """TensorRT builds strongly typed networks: engines.precision fp16/bf16 is carried by a target graph
    in that type (KV pool too; logits and features float32), checked on CPU where ONNX Runtime can run it."""
    output = tmp_path / precision
    report = build(load_build_config("tiny", [f"engines.precision={precision}"]), output, progress=lambda line: None)
    graph = onnx.load(str(output / "onnx" / f"target.{precision}.onnx"))
    types = {t.name: t.type.tensor_type.elem_type for t in [*graph.graph.input, *graph.graph.output]}
    reduced = onnx.TensorProto.FLOAT16 if precision == "fp16" else onnx.TensorProto.BFLOAT16
    assert types["past_keys"] == types["present_values"] == reduced
    assert types["logits"] == types["features"] == onnx.TensorProto.FLOAT
    # the weights themselves are stored in that type (the engine and the file at half the size)
    weights = [t for t in graph.graph.initializer if len(t.dims) == 2]
    assert weights and all(t.data_type == reduced for t in weights), [(t.name, t.data_type) for t in weights]
    check = json.loads((output / "validation" / "report.json").read_text())[f"target_{precision}"]
    assert report.manifest["validation"][f"target_{precision}"] is True
    if precision == "fp16":  # ONNX Runtime runs float16 on CPU: compared with torch in float16
        assert all(check["onnxruntime_vs_torch_max_abs"][k] <= check["tolerances"][k] for k in check["tolerances"])
    else:
        assert check["onnxruntime"].startswith("skipped")
    assert 0 < check["module_vs_float32_runtime_max_abs"]["logits"] < 1.0  # what the precision costs, reported
    manifest = json.loads((output / "manifest.json").read_text())
    assert manifest["files"][f"target_{precision}_onnx"] == f"onnx/target.{precision}.onnx"


# ---- dtype int4 ------------------------------------------------------------------------------------


@pytest.mark.skipif(not cpu_kernels.q4_available(), reason=f"int4 kernel: {cpu_kernels.q4_unavailable_reason()}")
def test_a_dtype_int4_build_is_served_in_int4(tmp_path):
    """`dtype: int4` builds, profiles and names the int4 CPU engine, and the directory loads as it."""
    output = tmp_path / "int4"
    report = build(load_build_config("tiny", ["dtype=int4", "engines.build=never", "profile.quick=true"]), output,
                   progress=lambda line: None)
    assert report.manifest["dtype"] == "int4" and report.manifest["cpu_kernels"]["isa"] == "amx"
    assert LatencyProfile.load(output / "profile.json").backend == "torch-cpu-int4"
    llm = LLM(engine_dir=output)
    assert llm.dtype == "int4" and llm.target.model.weight_dtype == torch.int4
    assert len(llm.generate("hi", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids) == 4


def test_a_dtype_int4_build_is_refused_up_front_where_it_cannot_run(tmp_path):
    """Without AMX-INT8 (here: the AVX2 build forced) the build stops before it exports anything,
    with the reason, rather than after minutes of work or with other numerics."""
    code = f"""
import dspark_trt
from dspark_trt.builder.build import BuildError, build
from dspark_trt.config import load_build_config
try:
    build(load_build_config("tiny", ["dtype=int4"]), {str(tmp_path / "int4")!r}, progress=print)
except BuildError as exc:
    print("REFUSED", exc)
"""
    env = {**os.environ, "DSPARK_TRT_KERNEL_ISA": "avx2"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED dtype:" in result.stdout and "AMX-INT8" in result.stdout, result.stdout
    assert "[2/6] export" not in result.stdout and not (tmp_path / "int4").exists()
