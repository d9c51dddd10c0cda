"""A/B experiment: DSpark with the target's fused feature of position p-1 added to the anchor
slot's input (as the EAGLE-3-style and MTP-1 drafters take it), everything else as the committed
DSpark run: same data, seed (so the same initialisation and batches) and 800-step schedule, stopped
at step 200. Compare its train_log.jsonl with benchmarks/results/train_logs/dspark.jsonl.

    python benchmarks/experiments/anchor_feature_ab.py RUN_DIR     # needs the feature cache in runs/features

The change lives only here (it replaces the training loss's draft_logits for this process); the
runtime and exporters do not know it, so its drafter is for the comparison only.
"""
import sys

import torch

from dspark_trt.models.eagle import EagleDrafter
from dspark_trt.training import losses

original = losses.draft_logits

def draft_logits(drafter, batch):
    if isinstance(drafter, EagleDrafter):
        return original(drafter, batch)
    S, A, G = batch.labels.shape
    context = drafter.fuse_features(batch.context_features)  # [S, C, d]
    C = context.shape[1]
    context_kv = drafter.context_keys_values(context, torch.arange(C).expand(S, C))
    block = drafter.block_inputs(batch.anchor_tokens, (S, A))  # [S, A, G, d]
    anchor_positions = batch.block_positions[:, ::G]  # [S, A]
    previous = (anchor_positions - 1).clamp(min=0)
    feature = context.gather(1, previous[..., None].expand(-1, -1, context.shape[-1]))  # [S, A, d]
    block = block.clone()
    block[:, :, 0] = block[:, :, 0] + feature
    block = block.reshape(S, A * G, -1)
    hidden = drafter.backbone(block, batch.block_positions, context_kv, batch.mask).view(S, A, G, -1)
    logits = drafter.backbone_logits(hidden)
    bias, confidence = drafter.teacher_forced_heads(hidden, drafter.to_draft[batch.previous_tokens])
    return (logits if bias is None else logits + bias), confidence

losses.draft_logits = draft_logits
from dspark_trt.cli import main  # noqa: E402 (after the patch above, which it must see)

main(["train", "--kind", "dspark", "--data", "data/train/smollm2-135m-instruct.jsonl", "--features-dir", "runs/features",
      "--output", sys.argv[1], "--steps", "800", "--stop-at", "200", "--batch-size", "4", "--anchors", "32", "--lr", "1e-3"],
     standalone_mode=False)
