"""A/B experiments on DSpark's first slot: which part of the architecture holds it below MTP-1's?

At block size 1 DSpark drafts one token, like MTP-1; on the same data, seed and batches (300
steps of the committed recipe) its teacher-forced acceptance was 0.374 against MTP-1's 0.412,
the same as 7-slot DSpark's slot 1 (0.371): the parallel block's sharing is not what costs it.
Each variant changes one thing in this process only and trains with `dspark-trt train` as given,
so its train_log.jsonl compares step for step with the base run's
(`benchmarks/experiments/learning_curve.py --log base=... --log VARIANT=...`):

    python benchmarks/experiments/dspark_variant_ab.py --variant context-norm train --kind dspark \\
        --block-size 1 --data ... --features-dir ... --output runs/dspark-block1-context-norm --stop-at 300 ...

Variants:
  no-confidence   the confidence head's BCE term is dropped (with `--head none` as well, the
                  loss is MTP-1's: CE and L1 on the backbone's logits alone)
  context-norm    each layer's context keys/values read `attn_norm(context)`, as its block
                  tokens' do (the layers start as copies of target layers, whose k/v projections
                  expect that norm's scale; the fused context starts at unit scale)
  token-context   the context state of position t is `combine([norm(embed(x_t)); f_{t-1}])`, what
                  MTP-1 and EAGLE-3-style read at t, instead of the fused feature f_t, and the
                  anchor slot reads `combine([norm(embed(x_p)); f_{p-1}])` (MTP-1's inputs throughout)

The runtime and exporters do not know these variants: their drafters are for comparison only.
"""
import sys

import torch

from dspark_trt.models.drafter import DSparkDrafter, RMSNorm, rope_tables
from dspark_trt.models.linear import DraftLinear
from dspark_trt.training import losses

VARIANTS = ("no-confidence", "context-norm", "token-context")


def patch_no_confidence():
    original = losses.draft_logits

    def draft_logits(drafter, batch):
        logits, _ = original(drafter, batch)
        return logits, None

    losses.draft_logits = draft_logits


def patch_context_norm():
    def context_keys_values(self, context, positions):
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        return [layer.keys_values(layer.attn_norm(context), cos, sin) for layer in self.layers]

    DSparkDrafter.context_keys_values = context_keys_values


def patch_token_context():
    original_init = DSparkDrafter.__init__

    def init(self, config, draft_vocab):
        original_init(self, config, draft_vocab)
        d = config.hidden_size
        self.token_norm = RMSNorm(d, config.rms_norm_eps)
        self.combine = DraftLinear(2 * d, d, bias=False)

    DSparkDrafter.__init__ = init
    original_draft_logits = losses.draft_logits

    def draft_logits(drafter, batch):
        if not isinstance(drafter, DSparkDrafter):
            return original_draft_logits(drafter, batch)

        def fuse_features(features):  # [S, C, m*d] -> [S, C, d]: combine(x_t, f_{t-1})
            fused = type(drafter).fuse_features(drafter, features)
            shifted = torch.cat([torch.zeros_like(fused[:, :1]), fused[:, :-1]], dim=1)
            tokens = batch.tokens[:, : fused.shape[1]]
            return drafter.combine(torch.cat([drafter.token_norm(drafter.embed[tokens]), shifted], dim=-1))

        def block_inputs(anchors, num_blocks_shape):  # [S, A, G, d]: the anchor slot reads combine(x_p, f_{p-1})
            block = type(drafter).block_inputs(drafter, anchors, num_blocks_shape)
            G = block.shape[-2]
            previous = (batch.block_positions[:, ::G] - 1).clamp(min=0)  # [S, A]
            fused = type(drafter).fuse_features(drafter, batch.context_features)
            feature = fused.gather(1, previous[..., None].expand(-1, -1, fused.shape[-1]))
            block[..., 0, :] = drafter.combine(torch.cat([drafter.token_norm(drafter.embed[anchors]), feature], dim=-1))
            return block

        drafter.fuse_features, drafter.block_inputs = fuse_features, block_inputs  # this call only
        try:
            return original_draft_logits(drafter, batch)
        finally:
            del drafter.fuse_features, drafter.block_inputs

    losses.draft_logits = draft_logits


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--variant" or argv[1] not in VARIANTS:
        sys.exit(f"usage: dspark_variant_ab.py --variant {{{','.join(VARIANTS)}}} train [dspark-trt train options]")
    {"no-confidence": patch_no_confidence, "context-norm": patch_context_norm,
     "token-context": patch_token_context}[argv[1]]()
    from dspark_trt.cli import main as cli_main  # after the patch, which it must see

    cli_main(argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
