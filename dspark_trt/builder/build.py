"""`dspark-trt build`: one config in, one engine directory out (layout: runtime/engine_dir.py).

Steps, each reported with its wall time:

    1. load      target and drafter (identity checks name the mismatched field), block size check
    2. export    target.onnx, drafter.onnx (SequentialDraft node), drafter_unrolled.onnx (a drafter
                 with a prefix layer: drafter.onnx alone, its loop in standard ops); the drafter
                 graphs are the whole drafter the runtime proposer runs, copy bias and confidence
                 offsets included (input `context_tokens` with a copy bias: export_drafter.py)
    3. validate  ONNX Runtime vs torch with polygraphy; polygraphy inspect + lint
    4. engines   TensorRT engines when tensorrt imports and a GPU is present, else the reason
    5. profile   latency profile of the serving backend on this machine (runtime/profile.py)
    6. package   drafter checkpoint copy, optional TensorRT-LLM layout, manifest.json (last)

Everything is written into a hidden staging folder beside the output and renamed into place
only when every step succeeded, so an interrupted or failed build never leaves a directory
that `serve` accepts (a directory is servable only with its manifest, written last).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from dspark_trt import __version__
from dspark_trt.config import BuildConfig
from dspark_trt.errors import DsparkError, ModelLoadError
from dspark_trt.runtime.engine_dir import (
    FORMAT_VERSION,
    MANIFEST,
    PROFILE,
    current_device,
)

STEPS = ("load", "export", "validate", "engines", "profile", "package")


class BuildError(DsparkError):
    """The build cannot proceed (output exists, engines required but unavailable, ...)."""


@dataclass
class BuildReport:
    output: Path
    seconds: dict[str, float] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


class _Steps:
    """Numbered progress lines with the wall time of each step."""

    def __init__(self, progress, seconds: dict):
        self.progress, self.seconds, self.index = progress, seconds, 0

    def __call__(self, name: str, what: str):
        self.index += 1
        self.progress(f"[{self.index}/{len(STEPS)}] {name}: {what}")
        return _Timer(self, name)


class _Timer:
    def __init__(self, steps: _Steps, name: str):
        self.steps, self.name = steps, name

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, kind, *_):
        elapsed = time.perf_counter() - self.start
        self.steps.seconds[self.name] = round(elapsed, 2)
        if kind is None:
            self.steps.progress(f"      {self.name} done in {elapsed:.1f} s")


def resolve_specs(config: BuildConfig) -> tuple[str, str | None]:
    """Target and drafter specs with `tiny-random` made concrete (created once, cached)."""
    from dspark_trt.builder.tiny import (
        TINY_SPEC,
        tiny_drafter_folder,
        tiny_target_folder,
    )

    target = str(tiny_target_folder()) if config.target == TINY_SPEC else config.target
    drafter = config.drafter
    if drafter == TINY_SPEC:
        if config.target != TINY_SPEC:
            raise BuildError("drafter 'tiny-random' only fits target 'tiny-random'")
        drafter = str(tiny_drafter_folder(block_size=config.block_size or 4))
    if target != "default":
        target = str(Path(target).expanduser().resolve())
    if drafter == "default":  # the committed drafter: the package step copies its folder
        from dspark_trt.models.drafter_io import DEFAULT_DRAFTER_DIR

        drafter = str(DEFAULT_DRAFTER_DIR)
    elif drafter is not None:
        drafter = str(Path(drafter).expanduser().resolve())
    return target, drafter


def load_models(config: BuildConfig, target_spec: str, drafter_spec: str | None):
    from dspark_trt.models.drafter import DSparkDrafter
    from dspark_trt.models.drafter_io import load_drafter
    from dspark_trt.models.loading import load_target

    target = load_target(target_spec)
    if drafter_spec is None:
        return target, None
    drafter = load_drafter(drafter_spec, target)
    if not isinstance(drafter, DSparkDrafter):
        raise ModelLoadError(f"drafter {drafter_spec}: kind {drafter.config.kind!r} cannot be built; the builder "
                             "exports DSpark and DFlash drafters")
    if config.block_size is not None and drafter.config.block_size != config.block_size:
        raise ModelLoadError(f"block_size: the config asks for {config.block_size} but drafter {drafter_spec} was "
                             f"trained with block size {drafter.config.block_size}")
    return target, drafter


def _staging_dir(output: Path) -> Path:
    return output.parent / f".{output.name}.partial-{os.getpid()}"


def _remove_stale_staging(output: Path) -> None:
    """Staging folders of builds that were killed (their process is gone) are removed."""
    for folder in output.parent.glob(f".{output.name}.partial-*"):
        pid = folder.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


def _install(staging: Path, output: Path) -> None:
    """Move the finished staging folder into place (replacing an old output in two renames)."""
    if output.exists():
        old = output.parent / f".{output.name}.old-{os.getpid()}"
        os.replace(output, old)
        os.replace(staging, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, output)


def build(config: BuildConfig, output: str | os.PathLike, fmt: str = "dspark", force: bool = False,
          progress=print) -> BuildReport:
    output = Path(output).expanduser().resolve()
    if output.exists() and not force:
        raise BuildError(f"{output} already exists; pass --force to replace it")
    if config.engines.build == "require":
        from dspark_trt.builder.trt_engines import why_no_engines

        reason = why_no_engines()
        if reason:
            raise BuildError(f"engines.build is 'require' but {reason}")
    if config.dtype == "int4":  # refused here, before minutes of export, where it cannot run
        from dspark_trt.models.linear import resolve_dtype

        try:
            resolve_dtype("int4", "cpu")
        except ValueError as exc:
            raise BuildError(f"dtype: {exc}") from None
    output.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(output)
    staging = _staging_dir(output)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    report = BuildReport(output)
    try:
        report.manifest = _run_steps(config, staging, fmt, _Steps(progress, report.seconds), progress, output)
        report.manifest["build"]["seconds"] = dict(report.seconds)
        report.manifest["build"]["total_seconds"] = round(report.total_seconds, 2)
        (staging / MANIFEST).write_text(json.dumps(report.manifest, indent=2) + "\n")  # last: makes it servable
        _install(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"engine directory {output} ready in {report.total_seconds:.1f} s")
    return report


def _run_steps(config: BuildConfig, staging: Path, fmt: str, step: _Steps, progress, output: Path) -> dict:
    """The build's steps into `staging`; `output` is where it will be installed."""
    from dspark_trt.builder import onnx_export, validate
    from dspark_trt.builder.export_drafter import input_names, plugin_supported
    from dspark_trt.builder.trt_engines import build_engines, why_no_engines

    with step("load", f"target {config.target!r}, drafter {config.drafter!r}"):
        target_spec, drafter_spec = resolve_specs(config)
        target, drafter = load_models(config, target_spec, drafter_spec)
        feature_layers = tuple(drafter.config.feature_layers) if drafter is not None else ()

    onnx_dir, report_dir = staging / "onnx", staging / "validation"
    onnx_dir.mkdir()
    report_dir.mkdir()
    files = {"target_onnx": "onnx/target.onnx"}
    with step("export", f"ONNX graphs (torch.onnx, {config.exporter} exporter)"):
        target_feeds, target_golden = onnx_export.sample_target_inputs(target, config, feature_layers)
        onnx_export.export_target(target, feature_layers, config, target_feeds, onnx_dir / "target.onnx")
        if drafter is not None:
            drafter_feeds = onnx_export.sample_drafter_inputs(target, drafter, config)
            plugin = plugin_supported(drafter.config)  # else drafter.onnx is all standard ops already
            onnx_export.export_drafter(drafter, config, drafter_feeds, onnx_dir / "drafter.onnx", use_plugin=plugin)
            files["drafter_onnx"] = "onnx/drafter.onnx"
            if plugin:
                onnx_export.export_drafter(drafter, config, drafter_feeds, onnx_dir / "drafter_unrolled.onnx",
                                           use_plugin=False)
                files["drafter_unrolled_onnx"] = "onnx/drafter_unrolled.onnx"

    with step("validate", "ONNX Runtime vs torch (polygraphy), inspect, lint"):
        checks = {"target": validate.validate_target(target, feature_layers, config, target_feeds, target_golden,
                                                     onnx_dir / "target.onnx", report_dir)}
        if drafter is not None:
            runnable = onnx_dir / ("drafter_unrolled.onnx" if plugin else "drafter.onnx")  # by ONNX Runtime
            checks["drafter"] = validate.validate_drafter(drafter, config, drafter_feeds, runnable, report_dir)
            checks["plugin_node"] = validate.check_plugin_node(onnx_dir / "drafter.onnx", expected=int(plugin))
        precision = config.engines.precision
        if precision != "fp32":  # the graph TensorRT builds from: its types are the engine's (strongly typed)
            reduced = onnx_dir / f"target.{precision}.onnx"
            onnx_export.export_target(target, feature_layers, config, target_feeds, reduced,
                                      onnx_export.PRECISION_DTYPES[precision])
            files[f"target_{precision}_onnx"] = f"onnx/{reduced.name}"
            checks[f"target_{precision}"] = validate.validate_reduced_precision_target(
                target, feature_layers, precision, target_feeds, target_golden, reduced)
        # Not linted: the plugin graph (ONNX Runtime cannot run it) and the reduced-precision target
        # (its own check above; lint's golden inputs are float32).
        not_linted = {"drafter.onnx"} if drafter is not None and plugin else set()
        not_linted |= {f"target.{precision}.onnx"} if precision != "fp32" else set()
        checks["polygraphy"] = validate.inspect_and_lint(onnx_dir, report_dir, frozenset(not_linted))
        (report_dir / "report.json").write_text(json.dumps(checks, indent=2) + "\n")
        files["validation"] = "validation/report.json"
        _summarise_validation(checks, progress)

    engines: dict = {"built": False}
    with step("engines", "TensorRT"):
        reason = why_no_engines() if config.engines.build != "never" else "engines.build is 'never'"
        if reason:
            engines["reason"] = reason
            progress(f"      skipped: {reason}; the CPU backend serves")
        else:
            engines = build_engines(onnx_dir, staging / "engines", config, target.config,
                                    drafter.config if drafter is not None else None, progress)
            files["target_engine"] = "engines/target.plan"
            if drafter is not None:
                files["drafter_engine"] = "engines/drafter.plan"
    backend = "tensorrt" if engines.get("built") else "torch-cpu"
    runtime_dtype = "float32"
    if backend == "torch-cpu":  # from here on the models are the CPU backend: its weights' dtype
        runtime_dtype = use_runtime_dtype(config, target, drafter)

    with step("profile", f"latency of the {backend} backend"):
        if config.profile.measure:
            profile = measure_profile(config, target, drafter, staging, backend, progress)
            profile.save(staging / PROFILE)
            files["profile"] = PROFILE
        else:
            progress("      skipped (profile.measure is false): the server measures a quick profile at start-up")

    with step("package", "drafter checkpoint, manifest" + (", TensorRT-LLM layout" if fmt == "trtllm" else "")):
        drafter_entry = None
        if drafter is not None:
            shutil.copytree(drafter_spec, staging / "drafter",
                            ignore=shutil.ignore_patterns(".*", "*.old"))
            c = drafter.config
            drafter_entry = {"path": "drafter", "source": str(drafter_spec), "kind": c.kind, "head": c.head,
                             "block_size": c.block_size, "feature_layers": list(c.feature_layers),
                             "draft_vocab_size": int(drafter.draft_vocab.numel()), "confidence": c.confidence,
                             "calibrated": bool(c.confidence_temperatures), "num_layers": c.num_layers,
                             "prefix_layer": c.prefix_layer, "copy_ngram": c.copy_ngram,
                             "graph_inputs": input_names(c),
                             "sequential_head": "SequentialDraft plugin" if plugin else "standard ops"}
        trtllm = None
        if fmt == "trtllm":
            from dspark_trt.builder.trtllm import write_trtllm_layout

            trtllm = write_trtllm_layout(staging, target, drafter, staging / PROFILE if "profile" in files else None,
                                         final_dir=output)
            files["trtllm"] = "trtllm"
        return _manifest(config, target, target_spec, drafter_entry, backend, runtime_dtype, engines, files, checks,
                         trtllm)


def use_runtime_dtype(config: BuildConfig, target, drafter) -> str:
    """Switch the exported (fp32) models to the CPU backend's dtype; return its name."""
    import torch

    from dspark_trt.models.linear import dtype_name, resolve_dtype, use_bf16_weights

    dtype = resolve_dtype(config.dtype, "cpu")
    if dtype == torch.bfloat16:
        use_bf16_weights(target.model)
    elif dtype == torch.int4:  # the layers' matrices in 4 bits; the drafter in bf16
        target.model.use_int4_weights()
    if drafter is not None and dtype in (torch.bfloat16, torch.int4):
        drafter.use_bf16_weights()
    return dtype_name(dtype)


def measure_profile(config: BuildConfig, target, drafter, staging: Path, backend: str, progress):
    from dspark_trt.runtime.profile import measure_latency_profile

    proposer = None
    if backend == "tensorrt":
        from dspark_trt.runtime.trt_backend import tensorrt_target

        layers = tuple(drafter.config.feature_layers) if drafter is not None else ()
        target = tensorrt_target(target, staging / "engines" / "target.plan", layers)
    if drafter is not None and backend == "tensorrt":  # what serves it: the drafter engine, beside the target's
        from dspark_trt.runtime.graph_proposer import GraphProposer, TensorRTDrafter

        proposer = GraphProposer(TensorRTDrafter(staging / "engines" / "drafter.plan"), drafter.config,
                                 drafter.draft_vocab)
    elif drafter is not None:
        from dspark_trt.runtime.dspark_proposer import DSparkProposer

        proposer = DSparkProposer(drafter)
    p = config.profile
    profile = measure_latency_profile(target, proposer, max_batch_tokens=p.max_batch_tokens,
                                      max_requests=p.max_requests, quick=p.quick,
                                      progress=lambda line: progress(f"      {line}"))
    if backend == "tensorrt":
        profile.backend, profile.device = backend, current_device(backend)
    else:  # the PyTorch backend names its dtype: a profile only holds for the dtype it was measured in
        profile.device = current_device(backend)
    return profile


def _summarise_validation(checks: dict, progress) -> None:
    from dspark_trt.builder.validate import ValidationFailed

    t = checks["target"]["onnxruntime_vs_torch_max_abs"]
    progress(f"      target: ONNX Runtime vs torch max |diff| logits {t['logits']:.2e}, features {t['features']:.2e}")
    if "drafter" in checks:
        d = checks["drafter"]
        progress(f"      drafter: greedy tokens identical {d['greedy_tokens_identical_onnxruntime']} (ONNX Runtime), "
                 f"{d['greedy_tokens_identical_runtime_proposer']} (runtime proposer); max |diff| probs "
                 f"{d['onnxruntime_vs_torch_max_abs']['distributions']:.2e}, confidences "
                 f"{d['onnxruntime_vs_torch_max_abs']['confidences']:.2e} (runtime proposer "
                 f"{d['runtime_proposer_confidence_max_abs']:.2e})")
        copy = d["copy_candidates"]
        if copy["copy_ngram"]:
            progress(f"      copy bias (n-grams up to {copy['copy_ngram']}) in the graphs: {copy['total']} copy candidates "
                     f"in the sample ({copy['in_greedy_rows']} in greedy rows, {copy['from_block_pairs']} from the "
                     f"block's own tokens), at {copy['slots_with_one']} slots")
    reduced = [name for name in checks if name.startswith("target_")]  # target_fp16 / target_bf16
    for name in reduced:
        r = checks[name]
        detail = (f"ONNX Runtime vs torch max |diff| logits {r['onnxruntime_vs_torch_max_abs']['logits']:.2e}"
                  if "onnxruntime_vs_torch_max_abs" in r else r.get("onnxruntime", ""))
        progress(f"      {name} (the graph TensorRT builds): {detail}; vs the float32 runtime, logits "
                 f"{r['module_vs_float32_runtime_max_abs']['logits']:.2e}")
    failed = [name for name in ("target", "drafter", "plugin_node", *reduced) if name in checks and not checks[name]["ok"]]
    failed += [f"polygraphy inspect {n}" for n, e in checks["polygraphy"].items() if not e["inspect_ok"]]
    failed += [f"polygraphy lint {n}" for n, e in checks["polygraphy"].items() if e.get("lint_ok") is False]
    if failed:
        raise ValidationFailed(f"validation failed ({', '.join(failed)}): "
                               + json.dumps({k: checks[k] for k in ("target", "drafter") if k in checks})[:1500])


def _cpu_kernels_entry(backend: str, runtime_dtype: str) -> dict | None:
    """Which build of our CPU kernels the CPU backend ran when it was validated and profiled (the
    profile holds for that build: `DSPARK_TRT_KERNEL_ISA` can force another), or why none ran."""
    if backend != "torch-cpu":
        return None
    from dspark_trt.kernels import cpu_kernels

    if runtime_dtype not in ("bfloat16", "int4") or not cpu_kernels.available():
        return {"isa": None, "why_not": cpu_kernels.unavailable_reason() or f"the backend runs in {runtime_dtype}"}
    return {"isa": cpu_kernels.isa(), "supported": cpu_kernels.supported_isas()}


def _manifest(config, target, target_spec, drafter_entry, backend, runtime_dtype, engines, files, checks,
              trtllm) -> dict:
    c = target.config
    return {
        "format_version": FORMAT_VERSION,
        "dspark_trt_version": __version__,
        "name": config.name,
        "backend": backend,
        "device": current_device(backend),
        "dtype": runtime_dtype,  # the PyTorch CPU backend's weights (TensorRT: engines.precision)
        "cpu_kernels": _cpu_kernels_entry(backend, runtime_dtype),
        "target": {"spec": target_spec, "name": target.name, "architecture": c.architecture,
                   "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_layers": c.num_layers,
                   "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim},
        "drafter": drafter_entry,
        "block_size": drafter_entry["block_size"] if drafter_entry else None,
        "feature_layers": drafter_entry["feature_layers"] if drafter_entry else [],
        "vocab_size": c.vocab_size,
        "shapes": {"target": config.target_shapes.model_dump(), "drafter": config.drafter_shapes.model_dump()},
        "engines": engines,
        "files": files,
        "validation": {k: v["ok"] for k, v in checks.items() if isinstance(v, dict) and "ok" in v},
        "trtllm": trtllm,
        "config": config.model_dump(),
        "build": {"created_unix": int(time.time())},
    }
