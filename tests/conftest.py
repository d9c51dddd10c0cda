"""Shared fixtures: tiny random Llama-family targets with the real SmolLM2 tokenizer.

Each tiny target is a real Hugging Face folder (config.json + safetensors + tokenizer) written
by transformers itself, so our loader and forward pass are checked against transformers on
the same files a user would give us. The tokenizer comes from the embedded default target
(converted once and cached), so tests exercise a real tokenizer and chat template.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import dspark_trt  # noqa: F401  (first: it sets the CPU threading policy before torch loads)
import pytest
import torch

TINY_SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def default_folder() -> Path:
    """The converted embedded default target (SmolLM2-135M-Instruct) folder."""
    from dspark_trt.models.loading import resolve_target

    return resolve_target("default")[1]


def make_tiny_target(folder: Path, tokenizer_folder: Path, architecture: str = "llama", seed: int = 0,
                     **overrides) -> Path:
    import transformers

    configs = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
    shapes = {**TINY_SHAPES, **overrides}
    if architecture == "qwen3":
        shapes.setdefault("head_dim", 16)
    config = configs[architecture](vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=2, **shapes)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # random init gives near-uniform next-token distributions; sharpen them
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(3.0)
        model.get_input_embeddings().weight.normal_(std=0.5)  # tied: logits get a std of ~4
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory, default_folder):
    """Make (and cache per session) a tiny target folder: tiny_factory("qwen3", seed=1)."""
    made: dict[tuple, Path] = {}

    def factory(architecture: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (architecture, seed, repr(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{architecture}")
            made[key] = make_tiny_target(folder, default_folder, architecture, seed, **overrides)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_factory) -> Path:
    return tiny_factory("llama")


@pytest.fixture
def corrupt_copy(tmp_path):
    """Copy a model folder so a test can damage it."""

    def copy(folder: Path) -> Path:
        target = tmp_path / "model"
        shutil.copytree(folder, target)
        return target

    return copy


def _gpu_and_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need an NVIDIA GPU and TensorRT, tests marked `cuda` a GPU that PyTorch
    sees; skip them (with the reason) elsewhere."""
    no_tensorrt = pytest.mark.skip(reason="needs an NVIDIA GPU and TensorRT (run ci/gpu.sh on a GPU machine)")
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU visible to PyTorch")
    gpu_and_tensorrt, cuda = _gpu_and_tensorrt(), torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not gpu_and_tensorrt:
            item.add_marker(no_tensorrt)
        if "cuda" in item.keywords and not cuda:
            item.add_marker(no_cuda)


def pytest_report_header(config):
    """Which engine the CPU tests ran on: the greedy-equality and batch-invariance tests hold for our
    kernels' build named here (AVX-512 and AVX2 builds give bit-identical results, `test_bf16.py`),
    and for the fp32 PyTorch path where the kernels do not run."""
    from dspark_trt.kernels import cpu_kernels

    if cpu_kernels.available():
        return (f"dspark-trt CPU kernels: {cpu_kernels.isa()} build (this CPU runs: "
                f"{', '.join(cpu_kernels.supported_isas())}; DSPARK_TRT_KERNEL_ISA picks one)")
    return f"dspark-trt CPU kernels: not running ({cpu_kernels.unavailable_reason()}); bf16 tests use PyTorch"
