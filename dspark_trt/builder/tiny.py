"""Tiny random models for the `tiny` build config and the builder's tests.

`tiny-random` as a target or drafter in a build config means: a 4-layer, 64-wide random Llama
with the real SmolLM2 tokenizer (written by transformers, so it is an ordinary Hugging Face
folder), and a 1-layer random DSpark drafter for it with a non-zero Markov head. Both are made
once per seed under `$DSPARK_TRT_CACHE/tiny/` (written to a staging folder and renamed, so an
interrupted write leaves nothing) and reused. They exist to exercise the whole pipeline in
seconds; their drafts are noise.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from dspark_trt.cache import cache_root
from dspark_trt.models.loading import resolve_target

TINY_SPEC = "tiny-random"
TINY_SHAPES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
               "tie_word_embeddings": True}
TINY_FEATURE_LAYERS = (1, 2)


def _staged(folder: Path, write) -> Path:
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        write(staging)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def tiny_target_folder(seed: int = 0) -> Path:
    """A tiny random Llama target folder (made once per seed)."""

    def write(staging: Path) -> None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_target("default")[1])
        config = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=2,
                                          **TINY_SHAPES)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).float()
        with torch.no_grad():  # sharpen the near-uniform random next-token distributions
            for param in model.parameters():
                if param.dim() == 2:
                    param.mul_(3.0)
            model.get_input_embeddings().weight.normal_(std=0.5)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return _staged(cache_root() / "tiny" / f"target-seed{seed}", write)


def tiny_drafter_folder(seed: int = 0, head: str = "markov", block_size: int = 4, vocab_size: int = 2048,
                        prefix_layer: bool = False) -> Path:
    """A tiny random DSpark drafter checkpoint for `tiny_target_folder(seed)` (with `prefix_layer`,
    one whose prefix layer's output projection is non-zero too)."""
    target_folder = tiny_target_folder(seed)

    def write(staging: Path) -> None:
        from dspark_trt.models.drafter_config import DrafterConfig
        from dspark_trt.models.drafter_io import build_drafter, save_drafter
        from dspark_trt.models.loading import load_target

        target = load_target(target_folder)
        config = DrafterConfig.for_target(target.name, target.config, TINY_FEATURE_LAYERS, kind="dspark", head=head,
                                          confidence=True, num_layers=1, markov_rank=16, block_size=block_size,
                                          draft_vocab_size=vocab_size, prefix_layer=prefix_layer)
        torch.manual_seed(seed)
        drafter = build_drafter(config, torch.arange(vocab_size)).attach_target(target.model)
        with torch.no_grad():  # a non-zero head and mask embedding, so that they matter
            drafter.sequential.w2.weight.normal_(std=0.5)
            drafter.mask_embedding.normal_(std=0.5)
            drafter.confidence.weight.normal_(std=0.5)
            if drafter.prefix is not None:  # it starts at zero, i.e. as the drafter without it
                drafter.prefix.out.weight.normal_(std=0.5)
        save_drafter(drafter, staging / "drafter")
        (staging / "drafter").rename(staging / "ckpt")

    name = f"drafter-seed{seed}-{head}-g{block_size}-v{vocab_size}" + ("-prefix" if prefix_layer else "")
    folder = _staged(cache_root() / "tiny" / name, write)
    return folder / "ckpt"
