"""The drafter served from its exported graph (`runtime/graph_proposer.py`): what a TensorRT
engine directory does on the GPU with `drafter.plan`, run here with the same graph in ONNX
Runtime on the CPU, against the PyTorch drafter it was exported from, copy bias included."""

from __future__ import annotations

import json
import shutil

import pytest

from dspark_trt import LLM, InvalidRequestError, SamplingParams
from dspark_trt.builder.build import build
from dspark_trt.builder.tiny import tiny_drafter_folder
from dspark_trt.config import load_build_config
from dspark_trt.runtime.graph_proposer import GraphProposer

PROMPTS = ["1 2 3 1 2 3 1 2", "The capital of France is", "def add(a, b):\n    return"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """A tiny build whose drafter has a copy bias (so `context_tokens` is a graph input)."""
    folder = tmp_path_factory.mktemp("graph-proposer")
    drafter = folder / "drafter"
    shutil.copytree(tiny_drafter_folder(), drafter)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "copy_bias": [[3.0, 5.0]] * config["block_size"]}))
    output = folder / "engines"
    build(load_build_config("tiny", [f"drafter={drafter}", "profile.measure=false", "dtype=float32"]), output,
          progress=lambda line: None)
    return output


def run(llm: LLM, params: SamplingParams):
    outputs = llm.generate(PROMPTS, params)
    return [o.token_ids for o in outputs], sum(o.metrics["num_accepted_tokens"] for o in outputs)


def test_the_graph_drafts_what_the_pytorch_drafter_drafts(engine_dir):
    graph = LLM(engine_dir=engine_dir, dtype="float32", drafter_graph=True, policy="all", max_batch_size=4)
    torch_drafter = LLM(engine_dir=engine_dir, dtype="float32", policy="all", max_batch_size=4)
    assert isinstance(graph.engine.proposer, GraphProposer)
    assert not isinstance(torch_drafter.engine.proposer, GraphProposer)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    tokens, accepted = run(graph, greedy)
    assert (tokens, accepted) == run(torch_drafter, greedy)  # the same drafts: the same acceptances
    assert accepted > 0  # drafts were accepted, so their tokens were compared
    plain = LLM(engine_dir=engine_dir, dtype="float32", policy="none", max_batch_size=4)
    assert tokens == run(plain, greedy)[0]  # lossless
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=4)  # same text whatever drafts
    assert run(graph, seeded)[0] == run(plain, seeded)[0]
    sampled = graph.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.8))  # the rejection rule reads q
    assert all(len(o.token_ids) > 0 for o in sampled)


def test_drafter_graph_needs_an_engine_directory():
    with pytest.raises(InvalidRequestError) as raised:
        LLM(target="tiny-random", drafter_graph=True)
    assert raised.value.param == "drafter_graph"


def test_the_latency_profile_can_time_the_graph_drafter(engine_dir):
    """What `build` does for a TensorRT directory (the drafter engine is what serves), here with ONNX Runtime."""
    from dspark_trt.runtime.profile import measure_drafter_curve

    llm = LLM(engine_dir=engine_dir, dtype="float32", drafter_graph=True, policy="all")
    seconds = measure_drafter_curve(llm.target, llm.engine.proposer, [1, 2], context_length=16, repeats=1)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert llm.engine.proposer.contexts == {}  # the profile's requests were released
