"""Save and load drafter checkpoints: `config.json` + `model.safetensors` in one folder.

The checkpoint holds the drafter's own weights and its draft vocabulary; the embedding and LM
head are the target's and are re-attached at load time, which is also when the target's
identity is checked. `drafter="default"` is the bundled DSpark drafter (`DEFAULT_DRAFTER_DIR`,
found by `dspark_trt.resources`: the repository's checkpoints/ folder, or a wheel's package data).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from dspark_trt import resources
from dspark_trt.errors import ModelLoadError
from dspark_trt.models.drafter import DrafterBase, DSparkDrafter
from dspark_trt.models.drafter_config import DrafterConfig
from dspark_trt.models.eagle import EagleDrafter
from dspark_trt.models.loading import LoadedTarget

# Where `drafter="default"` points: the DSpark drafter trained for the embedded default target.
DEFAULT_DRAFTER_DIR = resources.locate("drafter")


def build_drafter(config: DrafterConfig, draft_vocab: torch.Tensor) -> DrafterBase:
    """A fresh drafter of the config's kind."""
    if config.kind in ("eagle3", "mtp1"):
        return EagleDrafter(config, draft_vocab)
    return DSparkDrafter(config, draft_vocab)


def save_drafter(drafter: DrafterBase, folder: Path, dtype: torch.dtype = torch.float32,
                 extra_files: dict[str, str] | None = None) -> None:
    """Write atomically: a crash mid-save leaves the previous checkpoint intact."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        drafter.config.save(staging)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
                 for k, v in drafter.state_dict().items()}
        save_file(state, staging / "model.safetensors")
        for name, text in (extra_files or {}).items():
            (staging / name).write_text(text)
        if folder.exists():
            old = folder.with_name(folder.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(folder, old)
            os.replace(staging, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resave_drafter(drafter: DrafterBase, folder: Path, extra_files: dict[str, str] | None = None) -> None:
    """Rewrite a checkpoint in place (e.g. after calibration), keeping its stored precision and
    the files beside it (model card, reports) unless `extra_files` replaces them."""
    from safetensors import safe_open

    folder = Path(folder)
    dtype = torch.float32
    with safe_open(folder / "model.safetensors", framework="pt") as stored:
        for key in stored.keys():
            tensor = stored.get_tensor(key)
            if tensor.is_floating_point():
                dtype = tensor.dtype
                break
    kept = {f.name: f.read_text() for f in folder.iterdir()
            if f.is_file() and f.name not in ("config.json", "model.safetensors") and f.suffix in (".md", ".json", ".txt")}
    save_drafter(drafter, folder, dtype=dtype, extra_files={**kept, **(extra_files or {})})


def read_drafter(spec: str | os.PathLike, target: LoadedTarget) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A checkpoint's config (checked against `target`) and its stored weights, as saved (fp16 or
    fp32), draft vocabulary included: what `load_drafter` builds from, and what a fine-tuning run
    (`dspark-trt train --init-from`) starts from."""
    from safetensors.torch import load_file

    folder = DEFAULT_DRAFTER_DIR if str(spec) == "default" else Path(spec)
    if not folder.is_dir():
        if str(spec) == "default":
            raise ModelLoadError(f"drafter 'default': {resources.missing_message('drafter', folder)}")
        raise ModelLoadError(f"drafter {str(spec)!r} not found: give a drafter checkpoint folder")
    config = DrafterConfig.load(folder)
    config.check_target(target.name, target.config)
    try:
        state = load_file(folder / "model.safetensors")
    except FileNotFoundError:
        raise ModelLoadError(f"{folder} has no model.safetensors") from None
    except Exception as exc:
        raise ModelLoadError(f"corrupt drafter weights in {folder}: {exc}") from None
    if "draft_vocab" not in state:
        raise ModelLoadError(f"{folder}/model.safetensors lacks the draft vocabulary")
    return config, state


def load_stored_weights(drafter: DrafterBase, state: dict[str, torch.Tensor], spec: str | os.PathLike) -> None:
    """`read_drafter`'s weights (fp16 or fp32 as stored) into `drafter`, in fp32; weights of another
    shape than the drafter's config are a `ModelLoadError` naming the checkpoint `spec`."""
    try:
        drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    except RuntimeError as exc:
        raise ModelLoadError(f"drafter {str(spec)!r}: its weights do not match its config.json: {exc}") from None


def load_drafter(spec: str | os.PathLike, target: LoadedTarget) -> DrafterBase:
    config, state = read_drafter(spec, target)
    drafter = build_drafter(config, state["draft_vocab"])
    load_stored_weights(drafter, state, spec)
    return drafter.attach_target(target.model).eval().requires_grad_(False)
