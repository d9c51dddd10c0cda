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

  gated-markov    (a probe of the later slots, at block size 7) the Markov head's bias reads the
                  context as well: B_k = (W1[x_{k-1}] * (1 + tanh(G h_k))) @ W2, G zero at the
                  start, so training starts as the Markov head; a transition that depends on both
                  the previous drafted token and the backbone's state (its bias can no longer be
                  a cached row per token, so it would cost a W2 product per slot at decode time)

  block-causal    (a probe of the first slot's sharing cost, at block size 7) slot k of a block
                  attends to slots 1..k of it, not to all seven: slot 1 then computes what a
                  one-token drafter would, from the context and the pending token alone (block
                  size 1 reached slot-1 acceptance 0.415 against 7-slot DSpark's 0.396 on the
                  same batches). A training-only patch of the loss's attention pattern.

  prefix-forced   (a reference point for reading the drafted block, at block size 7) block-causal,
                  and slot k's input is the embedding of the true token before it (the anchor for
                  slot 1) instead of the mask embedding: the backbone then predicts each slot's
                  token from the true prefix, as EAGLE-3-style's teacher-forced steps do. Slot k
                  only counts when slots 1..k-1 were accepted, that is equal to the true prefix,
                  so its acceptance here is what a pass over pass 1's drafts would aim at (and what
                  the backbone would reach drafting autoregressively, seven passes).
                  Training only: its drafts need the true tokens.

  layer-head      (a head that reads the whole drafted prefix, at block size 7) a causal layer over
                  the drafted prefix after the backbone, as the `prefix-forced` probe asked for:
                  now the drafter's `prefix_layer` (`dspark-trt train --prefix-layer`, `PrefixLayer`
                  in models/drafter.py), which the variant passes. The 300-step probe ran through a
                  patch here (replaced by the option before it was committed; its loss was what
                  `losses.draft_logits` now computes) with the same parameters under other names
                  (`head_in`, `head_layer`, ...); `runs/dspark-prefix-layer` continues it.

context-norm won (0.415, MTP-1's level) and is now the drafter's `context_norm` (`dspark-trt train
--context-norm`, the default for new runs), which the runtime, the C kernels and the exporters
follow; the probes and `runs/dspark-context-norm` were run through a patch here that did the
same, and the variant now just passes `--context-norm`. no-confidence is for comparison only.
"""

import sys

from dspark_trt.training import losses

VARIANTS = ("no-confidence", "context-norm", "gated-markov", "block-causal", "prefix-forced", "layer-head")


def patch_no_confidence():
    original = losses.draft_logits

    def draft_logits(drafter, batch):
        logits, _ = original(drafter, batch)
        return logits, None

    losses.draft_logits = draft_logits


def patch_gated_markov():
    """Training only: the patched drafter's checkpoints carry `sequential.gate`, which nothing
    else loads; the probe is judged by its train_log.jsonl."""
    import torch
    from torch import nn

    from dspark_trt.models import drafter as drafter_module
    from dspark_trt.models.linear import matmul

    original_init = drafter_module.MarkovHead.__init__

    def __init__(self, config, vocab):
        original_init(self, config, vocab)
        self.gate = nn.Linear(config.hidden_size, config.markov_rank, bias=False)
        nn.init.zeros_(self.gate.weight)

    def forward(self, previous_embedding, hidden, state=None):
        gated = previous_embedding * (1 + torch.tanh(self.gate(hidden)))
        return matmul(gated, self.w2.weight.t()), None

    drafter_module.MarkovHead.__init__ = __init__
    drafter_module.MarkovHead.forward = forward


def patch_block_causal():
    """Training only: the loss's block attention hides each slot's later slots (its checkpoints
    would draft wrongly anywhere else, which attends within the block both ways)."""
    import functools

    losses.BlockVisibility = functools.partial(losses.BlockVisibility, causal=True)


def patch_prefix_forced():
    """Training only, on top of block-causal: each slot reads the true previous token's embedding
    (`batch.previous_tokens`, the tokens the Markov head is teacher-forced with) in the loss."""
    patch_block_causal()
    original = losses.draft_logits

    def draft_logits(drafter, batch):
        drafter.block_inputs = lambda anchors, shape: drafter.embed[batch.previous_tokens]  # [S, A, gamma, d]
        try:
            return original(drafter, batch)
        finally:
            del drafter.block_inputs  # back to the class's method

    losses.draft_logits = draft_logits


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--variant" or argv[1] not in VARIANTS:
        sys.exit(f"usage: dspark_variant_ab.py --variant {{{','.join(VARIANTS)}}} train [dspark-trt train options]")
    if argv[1] == "no-confidence":
        patch_no_confidence()
    if argv[1] == "gated-markov":
        patch_gated_markov()
    if argv[1] == "block-causal":
        patch_block_causal()
    if argv[1] == "prefix-forced":
        patch_prefix_forced()
    from dspark_trt.cli import main as cli_main  # after the patch, which it must see

    # context-norm is built in now (`DrafterConfig.context_norm`): the variant is the flag
    flags = ["--context-norm"] if argv[1] != "no-confidence" else []
    cli_main(argv[2:] + flags + (["--prefix-layer"] if argv[1] == "layer-head" else []))


if __name__ == "__main__":
    main(sys.argv[1:])
