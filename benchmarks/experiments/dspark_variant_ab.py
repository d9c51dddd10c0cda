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

  prefix-context  (a probe of the slots the target is sure of, at block size 7, with the prefix
                  layer) the prefix layer also attends to the target's context, as EAGLE-3-style's
                  layer does, through its own key/value projection of each layer's `attn_norm` of
                  the fused context (no new parameters). Why: DSpark loses to EAGLE-3-style where
                  the target is sure of its token (docs/drafters.md), typically a token repeated
                  from the context after the token just drafted (a number from the question, a
                  name from the code). Finding where x_{k-1} occurred in the context needs a query
                  that knows x_{k-1}: the backbone's does not (its slots read the mask embedding)
                  and the prefix layer's does but sees only its own block. Training only: the
                  proposer and exporters do not give the prefix layer the context.

  context-tokens  (a probe of context copies, at block size 7, with the prefix layer) each context
                  entry also carries the token that followed it: position t's fused state gets
                  + Z norm(E[x_{t+1}]) (Z zero at the start, so training starts as the base run;
                  x_{t+1} is known for every visible position t < p, up to the anchor). Why: held
                  out, DSpark loses to EAGLE-3-style only where the target's greedy token is a
                  context copy (the pair (x_{k-1}, token) occurred before the anchor), at slot 1
                  as well as later (`draft_vocab_reach.py`, `context_copy_acceptance.json`).
                  EAGLE-3-style's context entries hold the tokens themselves, E[x_t] beside
                  f_{t-1}; DSpark's hold the target's features only, in which a token first seen
                  in the prompt is not predicted at its own position. Training only.

context-norm won (0.415, MTP-1's level) and is now the drafter's `context_norm` (`dspark-trt train
--context-norm`, the default for new runs), which the runtime, the C kernels and the exporters
follow; the probes and `runs/dspark-context-norm` were run through a patch here that did the
same, and the variant now just passes `--context-norm`. no-confidence is for comparison only.
"""

import sys

from dspark_trt.training import losses

VARIANTS = ("no-confidence", "context-norm", "gated-markov", "block-causal", "prefix-forced", "layer-head",
            "prefix-context", "context-tokens")


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


def patch_prefix_context():
    """Training only: `PrefixLayer.teacher_forced` attends to the block's visible context too.
    The context's keys/values are made where the backbone's are (`context_keys_values_at`, with
    its RoPE rows) and handed to the prefix layer on the drafter; its checkpoints have the base
    prefix layer's parameters, so they load anywhere, but drafting elsewhere would not give it
    the context."""
    from dspark_trt.models import drafter as drafter_module

    original_context_keys_values_at = drafter_module.DSparkDrafter.context_keys_values_at

    def context_keys_values_at(self, context, cos, sin):
        per_layer = original_context_keys_values_at(self, context, cos, sin)
        if self.prefix is not None:
            layer = self.prefix.layer
            self.prefix.context_kv = layer.keys_values(layer.attn_norm(context), cos, sin)
        return per_layer

    def teacher_forced(self, hidden, previous_embedding, cos, sin, anchor_positions, block_size):
        u = self._inputs(hidden, previous_embedding)
        keys, values = self.__dict__.pop("context_kv")  # made for this batch; never reused
        visibility = drafter_module.BlockVisibility(anchor_positions, block_size, causal=True)
        return self.out(self.norm(self.layer(u, cos, sin, keys, values, visibility)))

    drafter_module.DSparkDrafter.context_keys_values_at = context_keys_values_at
    drafter_module.PrefixLayer.teacher_forced = teacher_forced


def patch_context_tokens():
    """Training only: `fuse_features` adds `Z rms(E[x_{t+1}])` to position t's fused state. The
    batch's tokens reach it through `draft_logits`, which sets them on the drafter for its call.
    Z and the norm are created without drawing random numbers, so the base run's weights and
    batches are unchanged; their checkpoints carry `context_token*`, which nothing else loads."""
    import torch
    from torch import nn

    from dspark_trt.models import drafter as drafter_module

    original_init = drafter_module.DSparkDrafter.__init__
    original_fuse = drafter_module.DSparkDrafter.fuse_features
    original_draft_logits = losses.draft_logits

    def __init__(self, config, draft_vocab):
        original_init(self, config, draft_vocab)
        d = config.hidden_size
        self.context_token_norm = drafter_module.RMSNorm(d, config.rms_norm_eps)
        self.context_token = nn.Parameter(torch.zeros(d, d))

    def fuse_features(self, features):
        fused = original_fuse(self, features)  # [S, C, d]
        next_tokens = self.__dict__.get("next_tokens")  # [S, C]: x_{t+1} for position t
        if next_tokens is None:
            return fused
        return fused + self.context_token_norm(self.embed[next_tokens].to(fused.dtype)) @ self.context_token.t()

    def draft_logits(drafter, batch):
        drafter.next_tokens = batch.tokens[:, 1 : batch.context_features.shape[1] + 1]
        try:
            return original_draft_logits(drafter, batch)
        finally:
            del drafter.next_tokens

    drafter_module.DSparkDrafter.__init__ = __init__
    drafter_module.DSparkDrafter.fuse_features = fuse_features
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
    if argv[1] == "prefix-context":
        patch_prefix_context()
    if argv[1] == "context-tokens":
        patch_context_tokens()
    from dspark_trt.cli import main as cli_main  # after the patch, which it must see

    # context-norm is built in now (`DrafterConfig.context_norm`): the variant is the flag
    flags = ["--context-norm"] if argv[1] != "no-confidence" else []
    with_prefix_layer = argv[1] in ("layer-head", "prefix-context", "context-tokens")
    cli_main(argv[2:] + flags + (["--prefix-layer"] if with_prefix_layer else []))


if __name__ == "__main__":
    main(sys.argv[1:])
