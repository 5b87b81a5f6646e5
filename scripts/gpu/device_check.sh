#!/usr/bin/env bash
# On the GPU machine, in the checkout's root (the device tool runs it there, with .gpu carried: see docs/gpu.md):
# install the carried wheels, build a random-weight model of the default model's shape, run the CUDA tests and
# the GPU benchmark, and write report.md + JSON and logs to $OUT. Each step has its own time limit so the
# whole check ends within 8 minutes and a failed step still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-artifacts/gpu}
mkdir -p "$OUT" .gpu_cache
export PYTHONUNBUFFERED=1
# Kept between calls on a warm machine (ignored, not carried): FlashInfer's JIT builds and the random models.
export FLASHINFER_WORKSPACE_BASE="$PWD/.gpu_cache/flashinfer" SGL_LITE_CACHE="$PWD/.gpu_cache/sgl_lite"
start=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - start )) s)"; }

step "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl \
    > "$OUT/install.log" 2>&1 || { echo "wheel install failed: $OUT/install.log"; tail -20 "$OUT/install.log"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD"

step "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 - <<'PY'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for name in ("flashinfer", "xgrammar", "transformers", "msgspec", "zmq", "fastapi"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - the report says what is missing
        print(name, "FAILED:", type(e).__name__, e)
PY
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step "random-weight model of the default model's shape"
model=$(timeout 120 python3 -m sgl_lite.runtime.model_executor.model_shapes --shape 135m --tokenizer-dir .gpu/tokenizer --out .gpu_cache/models/random-135m 2>"$OUT/model.log" | tail -1)
echo "model: $model"

step "CUDA tests"
SGL_LITE_CUDA_MODEL="$model" timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py -x --timeout 200 \
    --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
echo "pytest rc=$?"; tail -15 "$OUT/cuda_tests.log"

step "decode benchmark"
timeout ${BENCH_TIMEOUT_S:-200} python3 scripts/gpu/bench_gpu.py --tokenizer-dir .gpu/tokenizer --models-dir .gpu_cache/models \
    --shapes "${BENCH_SHAPES:-135m,1.7b}" --out "$OUT/bench_gpu.json" > "$OUT/bench_gpu.log" 2>&1
echo "bench rc=$?"; grep -v "it/s\]" "$OUT/bench_gpu.log" | tail -20

step "report"
python3 scripts/gpu/report.py "$OUT" > "$OUT/report.md" && cat "$OUT/report.md"
step "done"
