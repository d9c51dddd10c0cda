#!/usr/bin/env bash
# Fine-tune the gpu-data prefix-layer DSpark (5.4M blocks on an H200) on this CPU with data it never
# saw, the second responses (`bf16-resample`), in two stages (issue #19; results: docs/drafters.md,
# "Fine-tuned on the second responses"; the result is runs/resample-ft/dspark-prefix-layer):
#   chat: the every-5th subset of the three files it was trained on (3,212 rows, what
#         copy_fine_tune.sh trains on, so the other domains stay in view) plus the 3,219 chat
#         second responses (mostly greedy first-turn chat: 356k tokens where it had 46k);
#   all:  from the chat stage's export, those 6,431 rows plus every 2nd code and math second
#         response of a training prompt (5,380 rows).
# Each stage: 320 steps of 16 rows x 64 anchors at lr 2e-4, its copy bias kept in the config so the
# loss drafts with it (`train --init-from` keeps it), then `calibrate` refits the copy bias and the
# confidence. Rows whose target features are not cached are computed as training first meets them.
#
#   bash benchmarks/experiments/resample_fine_tune.sh [WORK_DIR]     # default /tmp/resample-ft
#
# Alone, ~80 min: two stages of ~32 min of training, ~5 min of calibration and ~4 min of held-out
# chat and offline benchmark each. Outputs in WORK_DIR/{chat,all}: the run (run/), its export
# (export/), heldout_chat.json and offline.json. Resumable: a stage whose export exists is skipped,
# and `train` continues a run that stopped.
set -euo pipefail
WORK=${1:-/tmp/resample-ft}
DRAFTER=checkpoints/smollm2-135m-instruct/runs/gpu-data/dspark-prefix-layer
FEATURES=~/.cache/dspark-trt/features-bf16
mkdir -p "$WORK/chat" "$WORK/all"

for STAGE in chat all; do  # the rows: benchmarks/experiments/fine_tune_rows.py
    [ -f "$WORK/$STAGE/subset.jsonl.gz" ] ||
        python benchmarks/experiments/fine_tune_rows.py "resample-$STAGE" "$WORK/$STAGE/subset.jsonl.gz"
done

START=$DRAFTER
for STAGE in chat all; do
    OUT=$WORK/$STAGE
    if [ ! -f "$OUT/export/config.json" ]; then
        dspark-trt train --init-from "$START" --data "$OUT/subset.jsonl.gz" --features-dir "$FEATURES" --steps 320 \
            --batch-size 16 --anchors 64 --lr 2e-4 --checkpoint-every 40 --output "$OUT/run" --export "$OUT/export"
        dspark-trt calibrate --drafter "$OUT/export" --data data/train/smollm2-135m-instruct.bf16.jsonl.gz \
            --features-dir "$FEATURES"
        python benchmarks/experiments/heldout_tau.py --data data/train/smollm2-135m-instruct.bf16.jsonl.gz \
            --domain chat --max-prompts 48 --max-tokens 96 --temperature 0 --drafter "resample-ft-$STAGE=$OUT/export" \
            --output "$OUT/heldout_chat.json"
        python benchmarks/offline.py --drafter "resample-ft-$STAGE=$OUT/export" --temperature 0 --temperature 1 \
            --max-tokens 32 --batch-size 32 --output "$OUT/offline.json"
    fi
    START=$OUT/export
done
