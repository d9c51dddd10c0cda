#!/usr/bin/env bash
# Does DSpark gain from training *beside* its copy bias, beyond what the same extra training gives
# without it? (issue #19; results: docs/drafters.md, "Training beside the copy bias")
#
# Both arms start from the gpu-data prefix-layer DSpark (5.4M blocks on an H200) and fine-tune on the
# same rows with the same schedule on this CPU:
#   copy:    its copy bias kept in the config, so the training loss drafts with it (`train --init-from`
#            keeps it), then `calibrate` refits the bias and the confidence;
#   control: the copy bias removed first, so the fine-tune is plain extra training; `calibrate` then
#            fits a copy bias afterwards, as for any drafter.
# Rows: every 5th training (not held-out) row of the three files that drafter was trained on (3,212 rows),
# so calibration's held-out rows stay unseen. Alone, ~75 min: features of the rows (~13 min), two
# fine-tunes (~11 min each at 160 steps), two calibrations, the offline benchmark.
#
#   bash benchmarks/experiments/copy_fine_tune.sh [WORK_DIR] [STEPS]     # defaults: /tmp/copy-ft 160
#
# Rerun with a larger STEPS to extend the copy arm (the run resumes where it stopped; the cosine
# re-warms where it stands). Outputs in WORK_DIR: the runs (copy/, control/), their exports
# (copy-export/, control-export/) and offline_STEPS.json.
set -euo pipefail
WORK=${1:-/tmp/copy-ft}
STEPS=${2:-160}
DRAFTER=checkpoints/smollm2-135m-instruct/runs/gpu-data/dspark-prefix-layer
FEATURES=~/.cache/dspark-trt/features-bf16
mkdir -p "$WORK"

[ -f "$WORK/subset.jsonl.gz" ] || python benchmarks/experiments/fine_tune_rows.py copy "$WORK/subset.jsonl.gz"

COMMON=(--data "$WORK/subset.jsonl.gz" --features-dir "$FEATURES" --steps "$STEPS" --batch-size 16 --anchors 64
        --lr 2e-4 --checkpoint-every 40)
CALIBRATE=(--data data/train/smollm2-135m-instruct.bf16.jsonl.gz --features-dir "$FEATURES")

dspark-trt train --init-from "$DRAFTER" "${COMMON[@]}" --output "$WORK/copy" --export "$WORK/copy-export"
dspark-trt calibrate --drafter "$WORK/copy-export" "${CALIBRATE[@]}"
LABEL=copy-ft; [ "$STEPS" = 160 ] || LABEL=copy-ft-$STEPS
OFFLINE=(--drafter "$LABEL=$WORK/copy-export")
if [ "$STEPS" = 160 ]; then  # the control arm runs once, at the first length
    rm -rf "$WORK/no-copy" && cp -r "$DRAFTER" "$WORK/no-copy"
    python - "$WORK/no-copy/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config.update(copy_bias=[], copy_confidence=[], confidence_top_prob=[])
json.dump(config, open(sys.argv[1], "w"), indent=2)
PY
    dspark-trt train --init-from "$WORK/no-copy" "${COMMON[@]}" --output "$WORK/control" --export "$WORK/control-export"
    dspark-trt calibrate --drafter "$WORK/control-export" "${CALIBRATE[@]}"
    OFFLINE+=(--drafter "control-ft=$WORK/control-export")
fi
python benchmarks/offline.py "${OFFLINE[@]}" --temperature 0 --temperature 1 --max-tokens 32 --batch-size 32 \
    --output "$WORK/offline_$STEPS.json"
