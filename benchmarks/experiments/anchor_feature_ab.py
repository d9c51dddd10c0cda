"""A/B experiment: DSpark with the target's fused feature of position p-1 added to the anchor
slot's input (as the EAGLE-3-style and MTP-1 drafters take it: their step at the pending token p
reads fc(f_{p-1}) + embed(x_p)). Everything else is `dspark-trt train` as given, so with the same
options, seed and data as a finished run it draws the same batches from the same initialisation,
and its train_log.jsonl compares with that run's step for step
(`benchmarks/experiments/learning_curve.py --log base=... --log anchor-feature=...`).

    python benchmarks/experiments/anchor_feature_ab.py train --kind dspark --data ... \\
        --features-dir ... --output runs/dspark-anchor-feature --steps 1900 --stop-at 400 ...

The change lives only in this process (the DSpark drafter's block inputs are widened while the
training loss runs); the runtime and exporters do not know it, so its drafter is for the
comparison only. First tried at 4 x 32 anchors on 2k rows (200 steps, no gain); rerun on the bf16
set at 16 x 64 anchors to see whether the first-slot gap to EAGLE-3-style is this input.
"""
import sys

from dspark_trt.models.eagle import EagleDrafter
from dspark_trt.training import losses

original_draft_logits = losses.draft_logits


def draft_logits_with_anchor_feature(drafter, batch):
    """`losses.draft_logits`, with the anchor slot's input plus the fused feature of position p-1."""
    if isinstance(drafter, EagleDrafter):
        return original_draft_logits(drafter, batch)
    G = batch.labels.shape[-1]
    fused = {}

    def fuse_features(features):  # the context states the loss computes anyway: [S, C, d]
        fused["context"] = type(drafter).fuse_features(drafter, features)
        return fused["context"]

    def block_inputs(anchors, num_blocks_shape):  # [S, A, G, d]
        block = type(drafter).block_inputs(drafter, anchors, num_blocks_shape)
        context = fused["context"]
        previous = (batch.block_positions[:, ::G] - 1).clamp(min=0)  # [S, A]
        block[..., 0, :] = block[..., 0, :] + context.gather(1, previous[..., None].expand(-1, -1, context.shape[-1]))
        return block

    drafter.fuse_features, drafter.block_inputs = fuse_features, block_inputs  # this call only
    try:
        return original_draft_logits(drafter, batch)
    finally:
        del drafter.fuse_features, drafter.block_inputs


losses.draft_logits = draft_logits_with_anchor_feature
from dspark_trt.cli import main  # noqa: E402 (after the patch above, which it must see)

if __name__ == "__main__":
    main(sys.argv[1:])
