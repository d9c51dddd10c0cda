"""Typed, strict build configs: one YAML file per deployment (`configs/*.yaml` in the repository,
bundled in a wheel; `dspark_trt.resources` finds them).

Unknown keys are errors (a typo must not silently fall back to a default), and every error
names the dotted path of the bad field. `--set key=value` overrides one field by dotted path
(`--set target_shapes.batch_tokens.max=128`); the value is parsed as YAML, so numbers, booleans
and lists work. `load_build_config("default")` reads the embedded default config.

This module only parses and checks; `builder/build.py` acts on the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dspark_trt import resources
from dspark_trt.errors import DsparkError

CONFIG_DIR = resources.locate("configs")  # the named configs ('default', 'tiny')


class ConfigError(DsparkError):
    """A build config is missing, malformed, or has a bad or unknown field."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ShapeRange(Strict):
    """One dynamic dimension: TensorRT optimization-profile min/opt/max (also ONNX export bounds)."""

    min: int = Field(ge=1)
    opt: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self):
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"needs min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class TargetShapes(Strict):
    batch_tokens: ShapeRange = ShapeRange(min=1, opt=16, max=256)  # T: new tokens per step (ragged)
    num_logits: ShapeRange = ShapeRange(min=1, opt=16, max=256)  # N: rows that need logits
    num_slots: ShapeRange = ShapeRange(min=1, opt=4, max=32)  # S: KV slots (concurrent requests)
    slot_capacity: ShapeRange = ShapeRange(min=16, opt=512, max=2048)  # C: positions per KV slot


class DrafterShapes(Strict):
    num_requests: ShapeRange = ShapeRange(min=1, opt=4, max=32)  # B: requests drafted per call
    context: ShapeRange = ShapeRange(min=1, opt=512, max=2048)  # context rows per request


class EnginesConfig(Strict):
    build: Literal["auto", "never", "require"] = "auto"  # auto: when tensorrt imports and a GPU is present
    precision: Literal["fp32", "fp16", "bf16"] = "fp16"  # the target engine's: carried by its exported graph
    workspace_gib: float = Field(default=4.0, gt=0)
    timing_cache: str | None = None  # default: $DSPARK_TRT_CACHE/tensorrt-timing.cache (shared across builds)


class ValidationConfig(Strict):
    seed: int = 0
    num_requests: int = Field(default=3, ge=1)  # requests in the sample ragged batch / drafted block batch
    context_tokens: int = Field(default=24, ge=2)  # prompt length of each sample request
    logits_atol: float = Field(default=1e-4, gt=0)  # fp32 ONNX Runtime vs torch
    features_atol: float = Field(default=1e-4, gt=0)
    features_rtol: float = Field(default=1e-5, ge=0)  # features and KV: |diff| <= atol + rtol * max|torch|
    probs_atol: float = Field(default=1e-4, gt=0)


class ProfileConfig(Strict):
    measure: bool = True
    quick: bool = False  # fewer points, one repeat
    max_batch_tokens: int = Field(default=64, ge=1)
    max_requests: int = Field(default=8, ge=1)


class BuildConfig(Strict):
    name: str = Field(min_length=1)
    target: str = "default"  # 'default', a Hugging Face folder, a .gguf file, or 'tiny-random'
    drafter: str | None = "default"  # a drafter checkpoint folder, 'default', 'tiny-random', or null
    block_size: int | None = Field(default=None, ge=1)  # when set, the drafter's block size must equal it
    # Weights of the PyTorch CPU backend (what serves when no TensorRT engine is built; its latency
    # profile is measured in it): auto = bfloat16 where our bf16 kernel runs, else float32. The
    # ONNX graphs are exported in fp32 either way and validated against torch; engines.precision
    # fp16/bf16 adds onnx/target.{fp16,bf16}.onnx, the graph TensorRT builds (strongly typed).
    # int4: the layers' matrices in their 4-bit Q4_1 blocks (CPUs with AMX-INT8; refused elsewhere).
    dtype: Literal["auto", "float32", "bfloat16", "int4"] = "auto"
    opset: int = Field(default=20, ge=17)
    exporter: Literal["dynamo", "torchscript"] = "dynamo"  # torch.export, or the legacy (faster, deprecated) tracer
    target_shapes: TargetShapes = TargetShapes()
    drafter_shapes: DrafterShapes = DrafterShapes()
    engines: EnginesConfig = EnginesConfig()
    validation: ValidationConfig = ValidationConfig()
    profile: ProfileConfig = ProfileConfig()


def _field_path(error: dict) -> str:
    return ".".join(str(p) for p in error["loc"]) or "(top level)"


def _describe(exc: ValidationError, source: str) -> ConfigError:
    first = exc.errors()[0]
    path = _field_path(first)
    if first["type"] == "extra_forbidden":
        return ConfigError(f"{source}: unknown config key {path!r}")
    message = first["msg"].removeprefix("Value error, ")
    return ConfigError(f"{source}: {path}: {message}")


def _apply_override(data: dict, assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def resolve_config_path(spec: str | Path) -> Path:
    """A config file path, or the name of one in `configs/` ('default', 'tiny')."""
    path = Path(spec)
    if path.is_file():
        return path
    if not CONFIG_DIR.is_dir():
        raise ConfigError(f"build config {str(spec)!r} is not a file, and "
                          f"{resources.missing_message('configs', CONFIG_DIR)}")
    named = CONFIG_DIR / f"{spec}.yaml"
    if named.is_file():
        return named
    known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"build config {str(spec)!r} not found: give a YAML file or one of: {known}")


def load_build_config(spec: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> BuildConfig:
    path = resolve_config_path(spec)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    for assignment in overrides:
        _apply_override(data, assignment)
    try:
        return BuildConfig.model_validate(data)
    except ValidationError as exc:
        raise _describe(exc, str(path)) from None
