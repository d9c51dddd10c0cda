#!/usr/bin/env bash
# Fine-tune passes for held-out chat (issue #19; results: docs/drafters.md, "A chat-heavy
# third stage"): from the committed resample-ft DSpark, 240 steps of 16 rows x 64 anchors at lr 2e-4
# on the `chat-heavy` rows (benchmarks/experiments/fine_tune_rows.py: every chat training row of the
# four files, first and second responses and follow-ups, plus every 4th code and math row; 13,898
# rows, 61% chat), copy bias kept in the loss, then recalibrated and measured: held-out chat on all
# 187 held-out chat rows and offline tau on MT-Bench, HumanEval and GSM8K at T=0 and T=1.
#
#   bash benchmarks/experiments/chat_heavy_fine_tune.sh [WORK_DIR] [GREEDY_WEIGHT] [START]
#
# START (default the committed resample-ft DSpark): the drafter to fine-tune, e.g. the export of an
# earlier run of this script, for another pass over the same rows (the committed drafter is the
# third pass: its model card gives the three commands).
# GREEDY_WEIGHT (default 0): `train --greedy-weight`, a CE term toward the target's argmax, what T=0
# acceptance asks of each slot. Alone, ~30 min: ~18 of training once the rows' target features are
# cached (~28 the first time, when most are computed as training first meets them, ~4 rows/s), ~3 of
# calibration and ~6 of measuring. Outputs in
# WORK_DIR (default /tmp/chat-heavy-wGREEDY_WEIGHT): the run (run/), its export (export/),
# heldout_chat_all.json and offline.json. Resumable: `train` continues a run that stopped, and a
# finished export is not trained again.
set -euo pipefail
GREEDY_WEIGHT=${2:-0}
WORK=${1:-/tmp/chat-heavy-w$GREEDY_WEIGHT}
START=${3:-checkpoints/smollm2-135m-instruct/runs/resample-ft/dspark-prefix-layer}
FEATURES=~/.cache/dspark-trt/features-bf16
DATA=data/train/smollm2-135m-instruct.bf16.jsonl.gz
mkdir -p "$WORK"

[ -f "$WORK/subset.jsonl.gz" ] || python benchmarks/experiments/fine_tune_rows.py chat-heavy "$WORK/subset.jsonl.gz"
[ -f "$WORK/export/config.json" ] ||
    dspark-trt train --init-from "$START" --data "$WORK/subset.jsonl.gz" --features-dir "$FEATURES" --steps 240 \
        --batch-size 16 --anchors 64 --lr 2e-4 --greedy-weight "$GREEDY_WEIGHT" --checkpoint-every 40 \
        --output "$WORK/run" --export "$WORK/export"
[ -f "$WORK/export/calibration.json" ] ||
    dspark-trt calibrate --drafter "$WORK/export" --data "$DATA" --features-dir "$FEATURES"
[ -f "$WORK/heldout_chat_all.json" ] ||
    python benchmarks/experiments/heldout_tau.py --data "$DATA" --domain chat --max-tokens 96 --temperature 0 \
        --drafter "chat-heavy-w$GREEDY_WEIGHT=$WORK/export" --output "$WORK/heldout_chat_all.json"
[ -f "$WORK/offline.json" ] ||
    python benchmarks/offline.py --drafter "chat-heavy-w$GREEDY_WEIGHT=$WORK/export" --temperature 0 --temperature 1 \
        --max-tokens 32 --batch-size 32 --output "$WORK/offline.json"
