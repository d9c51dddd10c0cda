"""The TensorRT path (marked gpu: skipped without TensorRT and a GPU; ci/gpu.sh runs it).

Uses the engine directory ci/gpu.sh built (`$DSPARK_TRT_GPU_ENGINE_DIR`), or builds the tiny
config with engines required."""

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    given = os.environ.get("DSPARK_TRT_GPU_ENGINE_DIR")
    if given:
        return Path(given)
    from dspark_trt.builder.build import build
    from dspark_trt.config import load_build_config

    output = tmp_path_factory.mktemp("gpu") / "tiny"
    build(load_build_config("tiny", ["engines.build=require", "engines.precision=fp32"]), output,
          progress=lambda line: None)
    return output


def test_build_made_engines_with_the_plugin(engine_dir):
    manifest = json.loads((engine_dir / "manifest.json").read_text())
    assert manifest["backend"] == "tensorrt" and manifest["engines"]["built"]
    assert (engine_dir / "engines" / "target.plan").stat().st_size > 0
    assert (engine_dir / "engines" / "drafter.plan").stat().st_size > 0
    assert manifest["device"].startswith("cuda:")
    from dspark_trt.builder.trt_engines import timing_cache_path
    from dspark_trt.config import BuildConfig

    assert timing_cache_path(BuildConfig(**manifest["config"])).is_file()  # persistent timing cache


def test_tensorrt_engines_match_torch_golden_outputs(engine_dir):
    from dspark_trt.builder.trt_check import compare

    results = compare(engine_dir)
    assert results["target"]["ok"], results
    assert results["drafter"]["ok"], results
    assert results["target"]["max_abs"]["logits"] <= 1e-4


def test_tensorrt_target_step_equals_torch(engine_dir):
    from dspark_trt.models.loading import load_target
    from dspark_trt.runtime.engine_dir import open_engine_dir
    from dspark_trt.runtime.trt_backend import tensorrt_target

    built = open_engine_dir(engine_dir)
    torch_target = load_target(built.target_spec)
    trt_target = tensorrt_target(torch_target, built.file("target_engine"), tuple(built.manifest["feature_layers"]))
    generator = torch.Generator().manual_seed(0)
    pools = [m.new_pool(2, 64) for m in (torch_target.model, trt_target.model)]
    caches = [[p.allocate() for _ in range(2)] for p in pools]
    layers = tuple(built.manifest["feature_layers"])
    for counts in ([7, 3], [1, 4], [2, 1]):  # prefill, then verify-like steps
        ids = torch.randint(0, torch_target.config.vocab_size, (sum(counts),), generator=generator)
        a = torch_target.model(ids, counts, caches[0], None, layers)
        b = trt_target.model(ids, counts, caches[1], None, layers)
        assert (a.logits - b.logits).abs().max() <= 1e-4
        assert (a.features - b.features).abs().max() <= 1e-3


def test_llm_serves_the_tensorrt_engine_directory(engine_dir):
    from dspark_trt import LLM, SamplingParams
    from dspark_trt.runtime.engine_dir import open_engine_dir
    from dspark_trt.runtime.trt_backend import TensorRTTargetModel

    llm = LLM(engine_dir=engine_dir, max_batch_size=2)
    assert isinstance(llm.target.model, TensorRTTargetModel)
    built = open_engine_dir(engine_dir)
    reference = LLM(target=built.target_spec, drafter=str(built.drafter_path), max_batch_size=2)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = ["The sea is", "def f(x):"]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in reference.generate(prompts, params)]
