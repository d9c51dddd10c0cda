#!/usr/bin/env bash
# The GPU path in one script, for a machine with an NVIDIA GPU and TensorRT >= 10.7:
#   1. build the tiny config with engines required (ONNX -> TensorRT, SequentialDraft plugin)
#   2. run the tests marked gpu (TensorRT backend, engine vs torch, serving)
#   3. compare TensorRT to the torch golden outputs saved at build time, with polygraphy
#   4. the same for an fp16 build (strongly typed: the target engine from onnx/target.fp16.onnx)
# Usage: ci/gpu.sh [OUTPUT_DIR]     (needs: pip install -e ".[dev,trt]": tensorrt>=10.7,<11.1)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${TMPDIR:-/tmp}/dspark-trt-gpu}"
rm -rf "$OUT"
python -c "import tensorrt, torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print('TensorRT', tensorrt.__version__, torch.cuda.get_device_name())"

echo "== 1. build configs/tiny.yaml with TensorRT engines"
time dspark-trt build configs/tiny.yaml --output "$OUT/tiny" --set engines.build=require --set engines.precision=fp32

echo "== 2. gpu tests"
DSPARK_TRT_GPU_ENGINE_DIR="$OUT/tiny" python -m pytest -q -m gpu tests/

echo "== 3. TensorRT vs torch (polygraphy TrtRunner on the golden inputs/outputs saved by the build)"
python -m dspark_trt.builder.trt_check "$OUT/tiny"

echo "== 4. an fp16 build, checked the same way (relative bounds for the fp16 target)"
dspark-trt build configs/tiny.yaml --output "$OUT/tiny-fp16" --set engines.build=require --set engines.precision=fp16
python -m dspark_trt.builder.trt_check "$OUT/tiny-fp16"
echo "gpu path OK"
