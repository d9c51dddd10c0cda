"""Read and check an engine directory written by `dspark-trt build` (the runtime's side of it).

    DIR/manifest.json     format version, backend, device, target and drafter identity and shapes,
                          block size, feature layers, vocabulary, dtype, files, engines, validation
    DIR/profile.json      the latency profile measured at build time (runtime/profile.py)
    DIR/drafter/          the drafter checkpoint (config.json + model.safetensors), copied in
    DIR/onnx/             target.onnx, drafter.onnx (SequentialDraft node), drafter_unrolled.onnx
                          (with a prefix layer: drafter.onnx alone, all standard ops)
    DIR/engines/          TensorRT engines, when they were built
    DIR/validation/       validation report and polygraphy golden inputs/outputs

`build` writes the manifest last into a staging folder and renames the folder into place, so a
folder without a valid manifest is never an engine directory. This module checks what a reader
must know before loading anything (format version, device, files present) and, once the
target is loaded, that it is the target the directory was built for. It never imports the
builder: the two sides meet only through these files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dspark_trt.errors import DsparkError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PROFILE = "profile.json"
REQUIRED_KEYS = ("format_version", "backend", "device", "target", "drafter", "files")
TARGET_IDENTITY = ("architecture", "hidden_size", "vocab_size", "num_layers")


class EngineDirError(DsparkError):
    """An engine directory is missing, incomplete, too new, or built for another device or target."""


def current_device(backend: str) -> str:
    """The name this machine's device has in manifests and profiles of `backend`."""
    import torch

    from dspark_trt.runtime.device import device_name

    if backend == "tensorrt":
        if not torch.cuda.is_available():
            return "cpu (no CUDA GPU)"
        return device_name(torch.device("cuda"))
    return device_name(torch.device("cpu"))


@dataclass
class EngineDir:
    path: Path
    manifest: dict

    @property
    def backend(self) -> str:
        return self.manifest["backend"]

    @property
    def target_spec(self) -> str:
        """What to pass to `load_target`: 'default' or an absolute path."""
        return self.manifest["target"]["spec"]

    @property
    def drafter_path(self) -> Path | None:
        rel = self.manifest["drafter"].get("path") if self.manifest["drafter"] else None
        return self.path / rel if rel else None

    @property
    def profile_path(self) -> Path | None:
        rel = self.manifest["files"].get("profile")
        return self.path / rel if rel else None

    def file(self, key: str) -> Path | None:
        rel = self.manifest["files"].get(key)
        return self.path / rel if rel else None

    def load_profile(self):
        from dspark_trt.runtime.profile import LatencyProfile

        return LatencyProfile.load(self.profile_path) if self.profile_path else None

    def check_target(self, name: str, config) -> None:
        """Raise naming the first field in which the loaded target differs from the one built for."""
        built = self.manifest["target"]
        for key in TARGET_IDENTITY:
            ours = getattr(config, key)
            if key in built and built[key] != ours:
                raise EngineDirError(f"{self.path} was built for a target with {key} {built[key]}, "
                                     f"but {name} has {key} {ours}")


def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    if not path.is_dir():
        raise EngineDirError(f"engine directory {path} does not exist (write one with `dspark-trt build`)")
    if not file.is_file():
        raise EngineDirError(f"{path} is not an engine directory: it has no {MANIFEST} "
                             "(an interrupted build never leaves one; rebuild with `dspark-trt build`)")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineDirError(f"{file} is not valid JSON ({exc}); rebuild the engine directory") from None
    if not isinstance(manifest, dict):
        raise EngineDirError(f"{file}: expected a JSON object")
    return manifest


def open_engine_dir(path: str | os.PathLike, check_device: bool = True) -> EngineDir:
    """Read `DIR/manifest.json` and check format version, device and files."""
    path = Path(path).expanduser().resolve()
    manifest = _read_manifest(path)
    version = manifest.get("format_version")
    if not isinstance(version, int):
        raise EngineDirError(f"{path / MANIFEST}: format_version is missing or not an integer")
    if version > FORMAT_VERSION:
        raise EngineDirError(f"{path} was written by a newer dspark-trt (format_version {version}; this version "
                             f"reads up to {FORMAT_VERSION}): upgrade dspark-trt or rebuild")
    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        raise EngineDirError(f"{path / MANIFEST} lacks the field {missing[0]!r}; rebuild the engine directory")
    if check_device:
        here = current_device(manifest["backend"])
        if manifest["device"] != here:
            raise EngineDirError(f"{path} was built for device {manifest['device']!r} ({manifest['backend']} backend), "
                                 f"but this machine is {here!r}: its engines and latency profile do not apply here; "
                                 "rebuild it on this machine with `dspark-trt build`")
    for key, rel in manifest["files"].items():
        if rel and not (path / rel).exists():
            raise EngineDirError(f"{path} is incomplete: files.{key} ({rel}) is missing; rebuild it")
    engine = EngineDir(path, manifest)
    if engine.drafter_path is not None and not engine.drafter_path.is_dir():
        raise EngineDirError(f"{path} is incomplete: drafter.path ({manifest['drafter']['path']}) is missing")
    return engine
