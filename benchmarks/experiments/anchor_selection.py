"""Why the training log's acceptance is higher than decoding's: where blocks start.

    python benchmarks/experiments/anchor_selection.py --drafter NAME=FOLDER [--drafter ...] \
        [--num-prompts 30] [--max-tokens 32] [--output FILE.json]

Greedy speculative decoding (batch 1, whole block verified) of held-out training prompts,
logging where each block was anchored and whether its first draft token was accepted. Then
the training forward (`losses.draft_logits`, teacher-forced) runs over the decoded sequences
and predicts the first slot at *every* response position. Two questions, one answer each:

- Does the training forward predict what decoding drafted? At the anchors decoding used, its
  greedy first-slot token is accepted exactly where decoding's was (`agreement`, 1.0 when the
  two paths match; `tests/test_drafter.py` checks every slot on tiny models, to 1e-5).
- Are decoding's anchors typical positions? No: a block starts right after the token that
  rejected the last one, so first-slot accuracy at the anchors decoding used is lower than at
  all positions (the average the training log and model cards report).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER (repeatable)")
    parser.add_argument("--data", type=Path, default=Path("data/train/smollm2-135m-instruct.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    from dspark_trt import LLM, SamplingParams  # before torch: it sets torch's thread policy (runtime/threads.py)

    import torch

    from dspark_trt.training.data import ensure_features, load_sequences, make_batch, read_rows
    from dspark_trt.training.losses import draft_logits
    from dspark_trt.training.trainer import is_held_out

    rows = [row for row in read_rows(args.data) if is_held_out(row["id"])][: args.num_prompts]
    step_log = StepLog()
    results = []
    for spec in args.drafter:
        name, _, folder = spec.partition("=")
        llm = LLM(target="default", drafter=folder, max_batch_size=1, policy="all")
        decoded, first_slot_accepted = [], []  # per prompt: the row decoded, and per step: slot 1 accepted?
        for row in rows:
            step_log.steps.clear()
            out = llm.generate([row["prompt_ids"]], SamplingParams(max_tokens=args.max_tokens, temperature=0.0))[0]
            decoded.append({"id": row["id"], "prompt_ids": row["prompt_ids"], "response_ids": list(out.token_ids)})
            first_slot_accepted.append(step_log.first_slot(len(row["prompt_ids"])))
        drafter = llm.engine.proposer.drafter
        config = drafter.config
        with tempfile.TemporaryDirectory() as features_dir:
            ensure_features(llm.target, decoded, Path(features_dir), tuple(config.feature_layers))
            sequences = load_sequences(decoded, Path(features_dir))
        num_anchors = at_anchors = agreement = num_all = at_all = 0
        for sequence, log in zip(sequences, first_slot_accepted):
            candidates = sequence.token_ids.numel() - sequence.prompt_length  # anchors P-1 .. T-2, in order
            batch = make_batch([sequence], candidates, config.block_size, len(config.feature_layers),
                               config.hidden_size, torch.Generator())
            with torch.no_grad():
                logits, _ = draft_logits(drafter, batch)
            hit = (drafter.draft_vocab[logits[0, :, 0].argmax(-1)] == batch.labels[0, :, 0]).tolist()
            at_all += sum(hit[1:])  # index 0 is the prompt's last token: decoding never anchors there
            num_all += len(hit) - 1
            for position, accepted in log:
                index = position - (sequence.prompt_length - 1)
                if index < len(hit):
                    num_anchors += 1
                    at_anchors += accepted
                    agreement += hit[index] == accepted
        result = {"drafter": name, "folder": folder, "num_prompts": len(rows), "max_tokens": args.max_tokens,
                  "num_anchors_decoding_used": num_anchors,
                  "first_slot_accuracy_at_decoding_anchors": at_anchors / num_anchors,
                  "agreement": agreement / num_anchors,
                  "num_positions": num_all, "first_slot_accuracy_at_all_positions": at_all / num_all}
        results.append(result)
        print(f"{name}: first-slot greedy accuracy {result['first_slot_accuracy_at_decoding_anchors']:.3f} at the "
              f"{num_anchors} anchors decoding used (training forward agrees at {result['agreement']:.1%}), "
              f"{result['first_slot_accuracy_at_all_positions']:.3f} at all {num_all} positions", flush=True)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


class StepLog:
    """Records (draft tokens verified, accepted) per verification step of the one running request.

    `RequestStats.record` is wrapped for this process only: the engine keeps totals per request,
    and this experiment needs the steps in order.
    """

    def __init__(self):
        from dspark_trt.runtime.request import RequestStats

        self.steps: list[tuple[int, int]] = []
        record = RequestStats.record

        def logged(stats, num_drafted, num_accepted):
            self.steps.append((num_drafted, num_accepted))
            record(stats, num_drafted, num_accepted)

        RequestStats.record = logged

    def first_slot(self, prompt_length: int) -> list[tuple[int, bool]]:
        """(anchor position, first draft token accepted) per step that verified drafts. Greedy,
        batch 1: the first block is anchored at the first generated token (position P), and each
        step moves the anchor past its accepted tokens and the bonus token."""
        position, log = prompt_length, []
        for num_drafted, num_accepted in self.steps:
            if num_drafted:
                log.append((position, num_accepted > 0))
            position += num_accepted + 1
        return log


if __name__ == "__main__":
    sys.exit(main())
