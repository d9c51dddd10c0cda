"""Build TensorRT engines from the exported ONNX graphs (only where TensorRT and a GPU exist).

- one optimization profile per engine over the ragged dimensions, min/opt/max from the config
  (`target_shapes`, `drafter_shapes`);
- a persistent timing cache (`engines.timing_cache`, default `$DSPARK_TRT_CACHE/tensorrt-timing.cache`),
  loaded before and saved after every build, so rebuilds skip kernel timing;
- the `dspark::SequentialDraft` plugin registered before parsing `drafter.onnx`, so the ONNX
  parser resolves the custom node to it: its ahead-of-time CUDA kernel where nvcc can build it
  (the network then prefers AOT plugins; the manifest records which one the engine holds and
  what loading it needs), else its JIT (Python) implementation;
- strongly typed networks: the precision is the graph's own (`engines.precision` fp16/bf16 builds
  the target from `onnx/target.{fp16,bf16}.onnx`, exported in that type; the drafter stays
  fp32). The weak precision flags (`BuilderFlag.FP16`/`BF16`, deprecated in TensorRT 10.12 and
  removed in 11.0) are never set, and TF32 is cleared, so float32 layers compute in float32
  (TF32 is on by default and would miss the 1e-4 logit checks). Checked against TensorRT 10.7
  to 11.0 (the `trt` extra pins that range);
- engines serialised to `DIR/engines/{target,drafter}.plan`.

`why_no_engines()` says why engines cannot be built here (recorded in the manifest); `tensorrt`
is imported only inside functions, so this module imports on any machine.
"""

from __future__ import annotations

import time
from pathlib import Path

from dspark_trt.config import BuildConfig
from dspark_trt.errors import DsparkError
from dspark_trt.cache import cache_root


class EngineBuildError(DsparkError):
    """TensorRT could not parse a graph or build an engine."""


def why_no_engines() -> str | None:
    """None when TensorRT engines can be built here, else the reason."""
    try:
        import tensorrt
    except ImportError:
        return "tensorrt is not installed (pip install 'dspark-trt[trt]' on a machine with an NVIDIA GPU)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    try:
        import tensorrt.plugin  # noqa: F401
    except ImportError:
        return "tensorrt.plugin is missing (TensorRT >= 10.7 is needed for the SequentialDraft plugin)"
    return None


def timing_cache_path(config: BuildConfig) -> Path:
    return Path(config.engines.timing_cache) if config.engines.timing_cache else cache_root() / "tensorrt-timing.cache"


def _profiles(config: BuildConfig, which: str, hidden: tuple[int, ...]) -> dict[str, tuple[tuple, tuple, tuple]]:
    """{input name: (min, opt, max) shape} for one engine."""
    def triple(*dims):  # each dim: an int or a ShapeRange
        return tuple(tuple(d if isinstance(d, int) else getattr(d, k) for d in dims) for k in ("min", "opt", "max"))

    if which == "target":
        s = config.target_shapes
        layers, kv_heads, head_dim = hidden
        kv = triple(layers, s.num_slots, kv_heads, s.slot_capacity, head_dim)
        return {"input_ids": triple(s.batch_tokens), "positions": triple(s.batch_tokens),
                "token_slots": triple(s.batch_tokens), "logits_indices": triple(s.num_logits),
                "past_keys": kv, "past_values": kv}
    s = config.drafter_shapes
    (feature_width, block, copy_bias) = hidden
    shapes = {"context_features": triple(s.num_requests, s.context, feature_width),
              "context_lengths": triple(s.num_requests), "anchor_tokens": triple(s.num_requests),
              "temperatures": triple(s.num_requests), "uniforms": triple(s.num_requests, block)}
    if copy_bias:  # the committed tokens the copy bias looks up (export_drafter.input_names)
        shapes["context_tokens"] = triple(s.num_requests, s.context)
    return shapes


def build_engine(onnx_path: Path, plan_path: Path, profile: dict, config: BuildConfig, progress=print) -> dict:
    """Parse `onnx_path`, build with one optimization profile, serialise to `plan_path`."""
    import tensorrt as trt

    from dspark_trt.plugins.sequential_draft_trt import register_tensorrt_plugin

    plugin = register_tensorrt_plugin()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Strongly typed: every tensor keeps the type the graph gives it (explicit batch is the only mode).
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    if plugin == "aot":  # both implementations are registered: TensorRT asks which one to embed
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    build_config = builder.create_builder_config()
    build_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(config.engines.workspace_gib * (1 << 30)))
    build_config.clear_flag(trt.BuilderFlag.TF32)  # float32 layers in float32 (norms and softmax too)
    cache_file = timing_cache_path(config)
    cache = build_config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
    build_config.set_timing_cache(cache, ignore_mismatch=False)
    optimization = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profile.items():
        optimization.set_shape(name, lo, opt, hi)
    build_config.add_optimization_profile(optimization)
    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, build_config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT failed to build an engine from {onnx_path.name} (see the log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_bytes(bytes(build_config.get_timing_cache().serialize()))
    seconds = time.perf_counter() - start
    progress(f"  engine {plan_path.name}: {plan_path.stat().st_size / 1e6:.1f} MB in {seconds:.1f} s")
    return {"path": plan_path.name, "seconds": round(seconds, 2), "profile": {k: list(v) for k, v in profile.items()},
            "sequential_draft_plugin": plugin}


def build_engines(onnx_dir: Path, engine_dir: Path, config: BuildConfig, target_config, drafter_config,
                  progress=print) -> dict:
    """Engines for target.onnx and (if present) drafter.onnx; returns the manifest's `engines` entry."""
    import tensorrt as trt

    built = {"built": True, "tensorrt_version": trt.__version__, "precision": config.engines.precision,
             "timing_cache": str(timing_cache_path(config))}
    t = target_config
    precision = config.engines.precision
    target_graph = onnx_dir / ("target.onnx" if precision == "fp32" else f"target.{precision}.onnx")
    built["target"] = build_engine(target_graph, engine_dir / "target.plan",
                                   _profiles(config, "target", (t.num_layers, t.num_kv_heads, t.head_dim)),
                                   config, progress)
    if drafter_config is not None:
        width = len(drafter_config.feature_layers) * drafter_config.hidden_size
        built["drafter"] = build_engine(onnx_dir / "drafter.onnx", engine_dir / "drafter.plan",
                                        _profiles(config, "drafter", (width, drafter_config.block_size,
                                                                  bool(drafter_config.copy_ngram))),
                                        config, progress)
        built["sequential_draft_plugin"] = PLUGIN_NEEDS[built["drafter"]["sequential_draft_plugin"]]
    return built


# What loading an engine that holds the SequentialDraft plugin needs (the manifest records it).
PLUGIN_NEEDS = {
    "aot": "ahead of time: the PTX of dspark_trt/plugins/sequential_draft_kernel.cu is embedded in drafter.plan; "
           "loading needs no Python and no plugin library (trtexec, Triton's TensorRT backend)",
    "jit": "just in time (@trtp.impl, no nvcc or TensorRT < 10.9 at build time): loading needs Python and "
           "dspark_trt.plugins.sequential_draft_trt.register_tensorrt_plugin() first",
}
