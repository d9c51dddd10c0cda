"""Tiny random drafters for tests (shared by several test files; not a test module)."""

import torch

from dspark_trt.models.drafter_config import DrafterConfig
from dspark_trt.models.drafter_io import build_drafter

FEATURE_LAYERS = (1, 2)


def make_drafter(target, kind="dspark", head="markov", block_size=4, vocab_size=2048, shuffled_vocab=False, **options):
    """A tiny drafter with non-zero heads. `shuffled_vocab`: draft ids differ from target ids (the
    default vocabulary is target ids 0..vocab_size-1, where mixing the two up goes unnoticed)."""
    if kind == "mtp1":
        block_size = 1
    config = DrafterConfig.for_target("tiny", target.config, FEATURE_LAYERS, kind=kind, head=head,
                                      confidence=kind == "dspark", num_layers=options.pop("num_layers", 1), markov_rank=16,
                                      block_size=block_size, draft_vocab_size=vocab_size, **options)
    torch.manual_seed(0)
    vocab = (torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(1))[:vocab_size]
             if shuffled_vocab else torch.arange(vocab_size))
    drafter = build_drafter(config, vocab).attach_target(target.model)
    with torch.no_grad():  # non-zero sequential head so that it matters in the tests
        if getattr(drafter, "sequential", None) is not None:
            drafter.sequential.w2.weight.normal_(std=0.5)
        if getattr(drafter, "prefix", None) is not None:  # its output projection starts at zero
            drafter.prefix.out.weight.normal_(std=0.5)
    return drafter


def make_dataset(target, folder, num_prompts: int = 8):
    """Self-distilled rows of the tiny target and their cached features: (rows, features folder)."""
    from dspark_trt.training.data import read_rows
    from dspark_trt.training.datagen import DatagenConfig, generate_dataset
    from dspark_trt.training.prompts import load_prompts

    generate_dataset(target, load_prompts("gsm8k-train", num_prompts), folder / "rows.jsonl",
                     DatagenConfig(max_tokens=24, batch_size=num_prompts, feature_layers=FEATURE_LAYERS),
                     folder / "features")
    return read_rows(folder / "rows.jsonl"), folder / "features"
