"""The builder's TensorRT calls against TensorRT 11's API, on CPU. TensorRT cannot be installed on
these machines (its library wheels fetch from an index they cannot reach), so a stand-in
`tensorrt` module offers exactly the builder API TensorRT 11.0 has, without what 11.0 removed
(`BuilderFlag.FP16`, `BuilderFlag.BF16`, weakly typed precision), and records the calls. The
engine build itself runs in tests/test_builder_gpu.py on a GPU machine (ci/gpu.sh)."""

from __future__ import annotations

import enum
import sys
import types

import pytest

from dspark_trt.builder import trt_engines
from dspark_trt.config import load_build_config


class BuilderFlag(enum.IntEnum):  # TensorRT 11: no FP16 / BF16 (removed), TF32 on by default
    TF32 = 7
    SPARSE_WEIGHTS = 8


class NetworkDefinitionCreationFlag(enum.IntEnum):
    STRONGLY_TYPED = 1
    PREFER_AOT_PYTHON_PLUGINS = 2
    PREFER_JIT_PYTHON_PLUGINS = 3


class Calls(list):
    pass


def stand_in_tensorrt(calls: Calls) -> types.ModuleType:
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "11.0.0"
    trt.BuilderFlag, trt.NetworkDefinitionCreationFlag = BuilderFlag, NetworkDefinitionCreationFlag
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="workspace")

    class Logger:
        WARNING = 2

        def __init__(self, severity):
            pass

    class Cache:
        def serialize(self):
            return b"timing"

    class Config:
        def set_memory_pool_limit(self, pool, size):
            calls.append(("pool", pool, size))

        def set_flag(self, flag):
            calls.append(("set_flag", BuilderFlag(flag)))

        def clear_flag(self, flag):
            calls.append(("clear_flag", BuilderFlag(flag)))

        def create_timing_cache(self, data):
            return Cache()

        def set_timing_cache(self, cache, ignore_mismatch):
            pass

        def get_timing_cache(self):
            return Cache()

        def add_optimization_profile(self, profile):
            calls.append(("profile", dict(profile.shapes)))

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, low, opt, high):
            self.shapes[name] = (low, opt, high)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            calls.append(("create_network", flags))
            return object()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            return b"plan"

    class OnnxParser:
        num_errors = 0

        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            calls.append(("parse", path.rsplit("/", 1)[-1]))
            return True

    trt.Logger, trt.Builder, trt.OnnxParser = Logger, Builder, OnnxParser
    plugin = types.ModuleType("tensorrt.plugin")  # registration is checked in test_plugin_registration.py
    plugin.TensorDesc, plugin.Tensor = type("TensorDesc", (), {}), type("Tensor", (), {})
    plugin.register = plugin.impl = lambda plugin_id: (lambda function: function)
    trt.plugin, trt.int64 = plugin, "int64"
    return trt


@pytest.fixture
def calls(monkeypatch):
    recorded = Calls()
    trt = stand_in_tensorrt(recorded)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trt.plugin)
    import dspark_trt.plugins.sequential_draft_trt as registration

    monkeypatch.setattr(registration, "_registered", None)
    return recorded


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_engines_are_strongly_typed_without_removed_flags(calls, tmp_path, precision, monkeypatch):
    monkeypatch.setenv("DSPARK_TRT_CACHE", str(tmp_path / "cache"))
    config = load_build_config("tiny", [f"engines.precision={precision}", f"engines.timing_cache={tmp_path / 'tc'}"])
    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    target = types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    built = trt_engines.build_engines(onnx_dir, tmp_path / "engines", config, target, None, progress=lambda line: None)
    assert ("create_network", 1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED) in calls
    assert ("clear_flag", BuilderFlag.TF32) in calls  # float32 layers stay float32 (TF32 is on by default)
    assert not [call for call in calls if call[0] == "set_flag"]  # no precision flags: the graph's types rule
    graph = "target.onnx" if precision == "fp32" else f"target.{precision}.onnx"
    assert ("parse", graph) in calls  # the graph exported in the engine's precision
    assert (tmp_path / "engines" / "target.plan").read_bytes() == b"plan"
    assert built["precision"] == precision and built["tensorrt_version"] == "11.0.0"


def test_an_ahead_of_time_plugin_is_preferred_and_recorded(calls, tmp_path, monkeypatch):
    """With the AOT kernel registered beside the JIT one, the network asks for AOT plugins, and the
    manifest says the drafter engine loads without Python."""
    import dspark_trt.plugins.sequential_draft_trt as registration

    monkeypatch.setattr(registration, "register_tensorrt_plugin", lambda: "aot")
    config = load_build_config("tiny", ["engines.precision=fp32", f"engines.timing_cache={tmp_path / 'tc'}"])
    (tmp_path / "onnx").mkdir()
    target = types.SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    drafter = types.SimpleNamespace(feature_layers=(1, 2), hidden_size=64, block_size=4, copy_ngram=0)
    built = trt_engines.build_engines(tmp_path / "onnx", tmp_path / "engines", config, target, drafter,
                                      progress=lambda line: None)
    flag = NetworkDefinitionCreationFlag
    flags = (1 << flag.STRONGLY_TYPED) | (1 << flag.PREFER_AOT_PYTHON_PLUGINS)
    assert ("create_network", flags) in calls and ("parse", "drafter.onnx") in calls
    assert built["drafter"]["sequential_draft_plugin"] == "aot"
    assert "no Python" in built["sequential_draft_plugin"]


def test_trt_check_feeds_a_reduced_precision_engine_its_kv_type():
    import numpy as np
    import torch

    from dspark_trt.builder.trt_check import typed_feeds

    feed = {"input_ids": np.arange(3), "past_keys": np.ones((1, 2, 1, 4, 8), np.float32),
            "past_values": np.zeros((1, 2, 1, 4, 8), np.float32)}
    assert typed_feeds(feed, "fp32") is feed
    fp16 = typed_feeds(feed, "fp16")
    assert fp16["past_keys"].dtype == np.float16 and fp16["input_ids"] is feed["input_ids"]
    assert typed_feeds(feed, "bf16")["past_values"].dtype == torch.bfloat16
