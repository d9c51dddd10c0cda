"""Can a bias toward context copies close DSpark's deficit on them, without training the drafter?

    python benchmarks/experiments/copy_bias_fit.py --data data/train/smollm2-135m-instruct.bf16.jsonl.gz \
        --features-dir ~/.cache/dspark-trt/features-bf16 \
        --drafter dspark=checkpoints/smollm2-135m-instruct/runs/gpu-data/dspark-prefix-layer \
        --output benchmarks/results/experiments/copy_bias_fit.json

`draft_vocab_reach.py` found that the slots DSpark loses to EAGLE-3-style are context copies:
the target's greedy token follows its previous token somewhere earlier in the row. This probe
adds to slot k's draft logits `sum_n alpha[k, n] * [y == c_n]`, where c_n is the token that
followed the most recent earlier occurrence of the last n tokens (the history the drafter has
at slot k: the row up to the anchor and the block's tokens before k, teacher-forced), for
n = 1..`--max-ngram`. The draft distribution stays an exact softmax, so verification stays exact.

alpha `[gamma, N]` is fitted on `--fit-rows` training rows (never the held-out ones) against
two objectives, each reported on the held-out rows per domain with the same anchors:
- `l1`: the training loss's total variation to the target (T=1 acceptance is 1 - L1 / 2);
- `ce`: cross-entropy to the target's greedy token (a smooth stand-in for T=0 acceptance).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from generalization_gap import named_drafters
from learning_curve import implied_block_tau

DOMAINS = ("chat", "code", "math")


def collect(drafter, sequences, anchors, rows_per_batch, final_norm, eps, max_ngram, seed=0):
    """Per batch: draft logits (fp16), target probs on the draft vocab (fp16), greedy target in
    draft ids (V_d: outside), candidates, valid."""
    import torch
    from tqdm import tqdm

    from dspark_trt.models.target import rms_norm
    from dspark_trt.training.data import make_batch
    from dspark_trt.training.losses import copy_candidates_of, draft_logits, target_probs

    c = drafter.config
    generator = torch.Generator().manual_seed(seed)
    for start in tqdm(range(0, len(sequences), rows_per_batch), leave=False, unit="batch"):
        batch = make_batch(sequences[start : start + rows_per_batch], anchors, c.block_size, len(c.feature_layers),
                           c.hidden_size, generator)
        with torch.no_grad():
            logits, _ = draft_logits(drafter, batch)
            hidden = rms_norm(batch.target_hidden, final_norm, eps)
            p_target = target_probs(hidden @ drafter.lm_head_t, batch.target_logsumexp)
            full = hidden @ drafter.full_head_t
            greedy = drafter.to_draft[full.argmax(-1)]
        yield (logits.half(), p_target.half(), greedy, copy_candidates_of(drafter, batch, max_ngram), batch.valid)


def scores(logits, p_target, greedy, valid, bias=None) -> dict:
    """Per slot sums: t0 acceptances, t1 acceptances, slots."""
    import torch

    from dspark_trt.training.losses import l1_to_target

    z = logits.float() if bias is None else logits.float() + bias
    t0 = (z.argmax(-1) == greedy).double() * valid
    t1 = (1 - 0.5 * l1_to_target(torch.log_softmax(z, -1), p_target.float())).clamp(0, 1).double() * valid
    return {"t0": t0.sum((0, 1)), "t1": t1.sum((0, 1)), "slots": valid.double().sum((0, 1))}


def fit(batches, gamma: int, max_ngram: int, vocab_size: int, objective: str, epochs: int):
    import torch

    from dspark_trt.models.copy_bias import dense_copy_bias as copy_bias
    from dspark_trt.training.losses import l1_to_target

    alpha = torch.zeros(gamma, max_ngram, requires_grad=True)
    optimizer = torch.optim.Adam([alpha], lr=0.3)
    for epoch in range(epochs):
        total = 0.0
        for logits, p_target, greedy, candidates, valid in batches:
            z = torch.log_softmax(logits.float() + copy_bias(alpha, candidates, vocab_size), -1)
            if objective == "l1":
                per_slot = l1_to_target(z, p_target.float())
            else:  # ce to the greedy token; slots whose greedy token is outside the vocabulary carry nothing
                inside = greedy < vocab_size
                per_slot = -z.gather(-1, greedy.clamp(max=vocab_size - 1)[..., None])[..., 0] * inside
            loss = (per_slot * valid).sum() / valid.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        rounded = alpha.detach().numpy().round(2).tolist()
        print(f"  {objective} epoch {epoch}: loss {total / len(batches):.4f}  alpha {rounded}", flush=True)
    return alpha.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--features-dir", type=Path, required=True)
    parser.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER (repeatable)")
    parser.add_argument("--fit-rows", type=int, default=240, help="training rows alpha is fitted on (a third per domain)")
    parser.add_argument("--eval-rows", type=int, default=200, help="held-out rows measured per domain")
    parser.add_argument("--max-ngram", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=32)
    parser.add_argument("--rows-per-batch", type=int, default=8)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    import dspark_trt  # noqa: F401  (first: it sets torch's thread policy)

    # isort: split
    import random

    import torch

    from dspark_trt.models.copy_bias import dense_copy_bias as copy_bias
    from dspark_trt.models.drafter_io import load_drafter
    from dspark_trt.models.features import default_feature_layers
    from dspark_trt.models.loading import load_target
    from dspark_trt.training.data import ensure_features, features_target, load_sequences, read_rows
    from dspark_trt.training.trainer import is_held_out

    rows = read_rows(args.data)
    held_out = [r for r in rows if is_held_out(r["id"])]
    training = [r for r in rows if not is_held_out(r["id"])]
    random.Random(0).shuffle(training)
    fit_rows = [r for d in DOMAINS for r in [t for t in training if t["domain"] == d][: args.fit_rows // len(DOMAINS)]]
    target = load_target("default")
    held_out = [r for d in DOMAINS for r in [h for h in held_out if h["domain"] == d][: args.eval_rows]]
    ensure_features(features_target(target, "default", "auto"), held_out + fit_rows, args.features_dir,
                    default_feature_layers(target.config.num_layers))
    final_norm, eps = target.model.final_norm.detach(), target.config.rms_norm_eps
    full_head_t = target.model.lm_head.weight_t.detach().float()
    fit_sequences = load_sequences(fit_rows, args.features_dir)
    by_domain = {d: load_sequences([r for r in held_out if r["domain"] == d], args.features_dir) for d in DOMAINS}

    result = {"data": str(args.data), "fit_rows": len(fit_rows), "max_ngram": args.max_ngram, "drafters": {}}
    for name, folder in named_drafters(args.drafter, Path()).items():
        drafter = load_drafter(folder, target).float()
        drafter.full_head_t = full_head_t
        vocab_size, gamma = drafter.draft_vocab.numel(), drafter.config.block_size
        batches = list(collect(drafter, fit_sequences, args.anchors, args.rows_per_batch, final_norm, eps,
                               args.max_ngram, seed=1))
        alphas = {"none": torch.zeros(gamma, args.max_ngram)}
        for objective in ("l1", "ce"):
            alphas[objective] = fit(batches, gamma, args.max_ngram, vocab_size, objective, args.epochs)
        del batches
        entry = result["drafters"][name] = {"folder": str(folder),
                                            "alpha": {k: v.tolist() for k, v in alphas.items()}, "domains": {}}
        for domain, sequences in by_domain.items():
            totals = {k: None for k in alphas}
            for logits, p_target, greedy, candidates, valid in collect(drafter, sequences, args.anchors,
                                                                        args.rows_per_batch, final_norm, eps,
                                                                        args.max_ngram):
                for key, alpha in alphas.items():
                    s = scores(logits, p_target, greedy, valid, copy_bias(alpha, candidates, vocab_size))
                    totals[key] = s if totals[key] is None else {n: totals[key][n] + s[n] for n in s}
            figures = {}
            for key, t in totals.items():
                t0, t1 = (t["t0"] / t["slots"]).tolist(), (t["t1"] / t["slots"]).tolist()
                figures[key] = {"t0": t0, "t1": t1, "tau_t0": implied_block_tau(t0), "tau_t1": implied_block_tau(t1)}
                print(f"{name} {domain} alpha={key:4s}: implied tau T=0 {figures[key]['tau_t0']:.3f}  "
                      f"T=1 {figures[key]['tau_t1']:.3f}  slot1 t0 {t0[0]:.3f}", flush=True)
            entry["domains"][domain] = figures
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
