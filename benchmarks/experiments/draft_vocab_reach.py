"""How much does the draft vocabulary cost, and can a trained drafter be given a wider one?

    python benchmarks/experiments/draft_vocab_reach.py --data data/train/smollm2-135m-instruct.bf16.jsonl.gz \
        --features-dir ~/.cache/dspark-trt/features-bf16 \
        --drafter dspark=checkpoints/smollm2-135m-instruct/runs/gpu-data/dspark-prefix-layer --widen 16384 \
        --vocab-data data/train/smollm2-135m-instruct.bf16-code-extra.jsonl.gz \
        --vocab-data data/train/smollm2-135m-instruct.bf16-followup.jsonl.gz \
        --output benchmarks/results/experiments/draft_vocab_reach.json

A drafter proposes only tokens of its draft vocabulary (the 8,192 most frequent of its training
responses); a block ends at the first slot whose target token lies outside it. On the held-out
rows of `--data` (5%, by id: never trained on), teacher-forced with 32 anchors a row, per domain
and slot, this measures:
- `oov`: the share of slots whose greedy target token is outside the draft vocabulary (a slot no
  drafter of that vocabulary can win at T=0);
- `t0`: greedy acceptance (the drafter's argmax is the target's argmax, over the whole target
  vocabulary) and `t1`: 1 - 0.5 * L1 to the target distribution, the chance rejection sampling
  accepts the slot at T=1 (the target's mass outside the draft vocabulary counts as lost), each
  with its implied block tau (1 + sum_k prod_{j<=k} a_j).
- `by_target_top1`: the same slots grouped by how sure the target is of its greedy token (its
  top-1 probability, bins `TOP1_BINS`): each bin's share of the slots and the drafter's greedy
  acceptance within it. It separates a domain whose target is less predictable (more slots in
  the low bins) from a drafter that predicts that domain worse (lower acceptance in the same bin).
  Within each bin, slot 1 and slots 2+ apart, the slots are split by whether the target's greedy
  token is a *context copy*: the pair (previous token, greedy token) already occurs in the
  block's visible context (`context_copies`), which an attention layer can complete by finding
  the previous token's earlier occurrence (an induction match). DSpark's backbone knows the
  previous token at slot 1 only (the anchor); at slots 2+ only its prefix layer does, and that
  layer does not attend to the context.
`--widen N` also measures the same drafter with its vocabulary widened to N tokens at inference,
without training: the next most frequent tokens of `--data` and `--vocab-data` are appended, their
LM-head rows are the target's, the Markov head's bias for them is zero and, as the previous token,
they read the out-of-vocabulary row (what the drafter saw for them in training). It answers
whether the vocabulary or the drafter's hidden state is what loses those slots.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from generalization_gap import named_drafters
from learning_curve import implied_block_tau

DOMAINS = ("chat", "code", "math")
TOP1_BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)  # the target's top-1 probability: bin edges


def widened(drafter, target_model, extra_tokens: list[int], size: int):
    """The drafter with the first `size - V` of `extra_tokens` (target ids, most frequent first) not
    already in its vocabulary appended to it; nothing trained."""
    import dataclasses

    import torch

    from dspark_trt.models.drafter_io import build_drafter

    old = drafter.draft_vocab
    known = set(old.tolist())
    vocab = torch.cat([old, torch.tensor([t for t in extra_tokens if t not in known][: size - old.numel()])])
    if vocab.numel() != size:
        raise SystemExit(f"--widen {size}: only {vocab.numel()} distinct tokens to draw from")
    state = drafter.state_dict()
    state["draft_vocab"] = vocab
    new = size - old.numel()
    if "previous_embedding.weight" in state:  # [V + 1, r]: the new tokens read the OOV row (the last)
        rows = state["previous_embedding.weight"]
        state["previous_embedding.weight"] = torch.cat([rows[:-1], rows[-1:].expand(new + 1, -1)])
    if "sequential.w2.weight" in state:  # [V, r]: no Markov bias for the new tokens
        w2 = state["sequential.w2.weight"]
        state["sequential.w2.weight"] = torch.cat([w2, w2.new_zeros(new, w2.shape[1])])
    wide = build_drafter(dataclasses.replace(drafter.config, draft_vocab_size=size), vocab)
    wide.load_state_dict(state)
    return wide.attach_target(target_model).eval().requires_grad_(False)  # the LM-head rows of the new tokens


def context_copies(batch, greedy_target):
    """`[S, A, gamma]` bool: whether slot k's greedy target token follows its previous token
    (x_{k-1}, the true one: teacher-forced) at some earlier position j of the row with j < p, the
    block's anchor position, i.e. where the drafter sees the target's features (context < p)."""
    import torch

    S, A, G = greedy_target.shape
    anchor_positions = batch.block_positions[:, ::G].tolist()  # [S][A]
    previous, greedy = batch.previous_tokens.tolist(), greedy_target.tolist()
    copies = torch.zeros(S, A, G, dtype=torch.bool)
    for s in range(S):
        tokens = batch.tokens[s].tolist()
        first_seen: dict[tuple[int, int], int] = {}  # (token j, token j + 1) -> the first such j
        for j in range(len(tokens) - 1):
            first_seen.setdefault((tokens[j], tokens[j + 1]), j)
        for a in range(A):
            for k in range(G):
                j = first_seen.get((previous[s][a][k], greedy[s][a][k]))
                copies[s, a, k] = j is not None and j < anchor_positions[s][a]
    return copies


def measure(drafter, sequences, anchors: int, rows_per_batch: int, target_final_norm, eps: float, full_head,
            top1_bins: tuple[float, ...] = TOP1_BINS) -> dict:
    """Per-slot oov / t0 / t1 over the sequences, with the same seeded anchors for every drafter,
    and greedy acceptance by the target's top-1 probability (bins [a, b) with edges `top1_bins`),
    each bin split into slot 1 / slots 2+ and, within those, context copies / the other slots."""
    import torch
    from tqdm import tqdm

    from dspark_trt.models.target import rms_norm
    from dspark_trt.training.data import make_batch
    from dspark_trt.training.losses import draft_logits, l1_to_target, target_probs

    c = drafter.config
    generator = torch.Generator().manual_seed(0)
    sums = {name: torch.zeros(c.block_size, dtype=torch.float64) for name in ("oov", "t0", "t1", "blocks")}
    num_bins = len(top1_bins) - 1
    # [bin, slot group (1, 2+), copy (no, yes)]: slots and greedy acceptances (a bin's are their sums)
    cell_slots, cell_accepted = (torch.zeros(num_bins, 2, 2, dtype=torch.float64) for _ in range(2))
    for start in tqdm(range(0, len(sequences), rows_per_batch), leave=False, unit="batch"):
        batch = make_batch(sequences[start : start + rows_per_batch], anchors, c.block_size, len(c.feature_layers),
                           c.hidden_size, generator)
        with torch.no_grad():
            logits, _ = draft_logits(drafter, batch)  # [S, A, gamma, V_d]
            hidden = rms_norm(batch.target_hidden, target_final_norm, eps)
            p_target = target_probs(hidden @ drafter.lm_head_t, batch.target_logsumexp)
            l1 = l1_to_target(torch.log_softmax(logits.float(), -1), p_target)
            target_logits = hidden @ full_head  # over the whole target vocabulary
            greedy_target = target_logits.argmax(-1)
            top1 = (target_logits.max(-1).values - target_logits.logsumexp(-1)).exp()  # the target's p(greedy token)
            greedy_draft = drafter.draft_vocab[logits.argmax(-1)]
        valid, accepted = batch.valid.double(), greedy_draft == greedy_target
        outside = drafter.to_draft[greedy_target] == drafter.draft_vocab.numel()
        for name, value in (("oov", outside), ("t0", accepted), ("t1", (1 - 0.5 * l1).clamp(0, 1))):
            sums[name] += (value.double() * valid).sum((0, 1))
        sums["blocks"] += valid.sum((0, 1))
        bins = torch.bucketize(top1, torch.tensor(top1_bins[1:-1]), right=True)[batch.valid]  # [slots]: bin [a, b)
        later = (torch.arange(c.block_size) > 0).expand_as(batch.valid)[batch.valid].long()
        copy = context_copies(batch, greedy_target)[batch.valid].long()
        cells = (bins * 2 + later) * 2 + copy
        cell_slots += torch.bincount(cells, minlength=num_bins * 4).double().view(num_bins, 2, 2)
        cell_accepted += torch.bincount(cells, weights=accepted[batch.valid].double(),
                                        minlength=num_bins * 4).view(num_bins, 2, 2)
    per_slot = {name: (sums[name] / sums["blocks"].clamp(min=1)).tolist() for name in ("oov", "t0", "t1")}

    bin_slots, bin_accepted = cell_slots.sum((1, 2)), cell_accepted.sum((1, 2))

    def rate(accepted, slots):
        return float(accepted / slots) if slots else None

    def copy_split(i: int, group: int) -> dict:
        slots, accepted = cell_slots[i, group], cell_accepted[i, group]
        return {"slots": int(slots.sum()), "copy_share": rate(slots[1], slots.sum()),
                "t0_copy": rate(accepted[1], slots[1]), "t0_other": rate(accepted[0], slots[0])}

    by_top1 = [{"top1": [top1_bins[i], top1_bins[i + 1]], "share": float(bin_slots[i] / bin_slots.sum()),
                "t0": rate(bin_accepted[i], bin_slots[i]),
                "slot1": copy_split(i, 0), "slots2plus": copy_split(i, 1)} for i in range(num_bins)]
    return {**per_slot, "tau_t0": implied_block_tau(per_slot["t0"]), "tau_t1": implied_block_tau(per_slot["t1"]),
            "blocks": int(sums["blocks"][0]), "by_target_top1": by_top1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="datagen file whose held-out rows are measured")
    parser.add_argument("--vocab-data", type=Path, action="append", default=[],
                        help="more datagen files the drafters trained on (repeatable): token frequencies for --widen")
    parser.add_argument("--features-dir", type=Path, required=True)
    parser.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER (repeatable)")
    parser.add_argument("--widen", type=int, action="append", default=[],
                        help="also measure each drafter widened to this many tokens (repeatable)")
    parser.add_argument("--anchors", type=int, default=32, help="blocks per row")
    parser.add_argument("--rows-per-batch", type=int, default=8)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    import dspark_trt  # noqa: F401  (first: it sets torch's thread policy)

    # isort: split
    from collections import Counter

    from dspark_trt.models.drafter_io import load_drafter
    from dspark_trt.models.features import default_feature_layers
    from dspark_trt.models.loading import load_target
    from dspark_trt.training.data import ensure_features, features_target, load_sequences, read_datasets, read_rows
    from dspark_trt.training.trainer import is_held_out

    held_out = [r for r in read_rows(args.data) if is_held_out(r["id"])]
    training = [r for r in read_datasets([args.data, *args.vocab_data]) if not is_held_out(r["id"])]
    extra_tokens = [token for token, _ in Counter(t for r in training for t in r["response_ids"]).most_common()]
    target = load_target("default")
    ensure_features(features_target(target, "default", "auto"), held_out, args.features_dir,
                    default_feature_layers(target.config.num_layers))
    by_domain = {domain: load_sequences([r for r in held_out if r["domain"] == domain], args.features_dir)
                 for domain in DOMAINS}
    final_norm, eps = target.model.final_norm.detach(), target.config.rms_norm_eps
    full_head = target.model.lm_head.weight_t.detach().float()

    result = {"data": str(args.data), "held_out_rows": {d: len(s) for d, s in by_domain.items()},
              "anchors_per_row": args.anchors, "drafters": {}}
    for name, folder in named_drafters(args.drafter, Path()).items():
        drafter = load_drafter(folder, target).float()
        for size in [drafter.draft_vocab.numel(), *args.widen]:
            variant = drafter if size == drafter.draft_vocab.numel() else widened(drafter, target.model, extra_tokens, size)
            label = f"{name}@{size}"
            result["drafters"][label] = {"folder": str(folder), "draft_vocab": size, "widened": variant is not drafter,
                                         "domains": {}}
            for domain, sequences in by_domain.items():
                figures = measure(variant, sequences, args.anchors, args.rows_per_batch, final_norm, eps, full_head)
                result["drafters"][label]["domains"][domain] = figures
                print(f"{label:24s} {domain}: oov(slot 1) {figures['oov'][0]:.3f}  t0 {figures['t0'][0]:.3f}  "
                      f"t1 {figures['t1'][0]:.3f}  implied tau T=0 {figures['tau_t0']:.3f}  T=1 {figures['tau_t1']:.3f}",
                      flush=True)
                print("    target top-1 bin: share / t0  " + "  ".join(
                    f"[{b['top1'][0]:.1f},{b['top1'][1]:.1f}) {b['share']:.2f}/{b['t0'] or 0:.2f}"
                    for b in figures["by_target_top1"]), flush=True)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(result, indent=2) + "\n")  # after each variant: a stop keeps what ran


if __name__ == "__main__":
    main()
