#!/usr/bin/env bash
# On the GPU machine, in the checkout's root (the device tool runs it there, with .gpu carried: see docs/gpu.md):
# install the carried wheels, build random-weight models of the default model's shape and a 1.7B one, run the
# CUDA tests, the decode benchmark and the agent workload against transformers, and write report.md, the
# benchmarks' JSON and every log (logs.tgz) to $OUT. Each step has its own time limit, so the whole check ends
# within 10 minutes and a failed step still leaves the others' results. Work that needs only the CPU (the C++
# CPU ops, the 1.7B model's weights) runs in the background; the kernel tests come first, their workers building
# FlashInfer's modules at once, which every later step reuses. SKIP_BENCH=1 leaves the decode benchmark out.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-artifacts/gpu}
LOGS="$OUT/work"
mkdir -p "$LOGS" .gpu_cache
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-4}  # per FlashInfer module build; several build at once
# Kept between calls on a warm machine (ignored, not carried): FlashInfer's JIT builds, the CPU ops, the models.
export FLASHINFER_WORKSPACE_BASE="$PWD/.gpu_cache/flashinfer" SGL_LITE_CACHE="$PWD/.gpu_cache/sgl_lite"
MODELS=.gpu_cache/models
start=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - start )) s)"; }
finish() {
    step "report"
    python3 scripts/gpu/report.py "$OUT" > "$OUT/report.md" 2> "$LOGS/report.log"; cat "$OUT/report.md"
    tar czf "$OUT/logs.tgz" -C "$OUT" work && rm -rf "$LOGS"
    step "done"
}

step "install the carried wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl \
    > "$LOGS/install.log" 2>&1 || { echo "wheel install failed"; tail -20 "$LOGS/install.log"; finish; exit 1; }
export PYTHONPATH="/tmp/site:$PWD"

step "environment"
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  nvcc --version | tail -2; echo "cpus $(nproc)"
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

step "models and CPU ops (in the background: the CPU ops build and the 1.7B weights)"
timeout 240 python3 -m sgl_lite.runtime.kernels.loader > "$LOGS/cpu_ops.log" 2>&1 &
if [[ -z "${SKIP_BENCH:-}" ]]; then
    timeout 300 python3 -m sgl_lite.runtime.model_executor.model_shapes --shape 1.7b --tokenizer-dir .gpu/tokenizer \
        --out $MODELS/random-1.7b > "$LOGS/model_1.7b.log" 2>&1 &
    model_17b=$!
fi
model=$(timeout 120 python3 -m sgl_lite.runtime.model_executor.model_shapes --shape 135m --tokenizer-dir .gpu/tokenizer --out $MODELS/random-135m 2>"$LOGS/model_135m.log" | tail -1)
echo "model: $model"

# Each test's own limit is well inside its step's, so a hung test fails with its stack and the summary is written.
PYTEST=(python3 -m pytest -q -rA --tb=short -p no:cacheprovider -p no:benchmark -m cuda tests/test_cuda.py)
step "CUDA tests: FlashInfer against torch_native (parallel workers build FlashInfer's modules at once)"
timeout 170 "${PYTEST[@]}" -k flashinfer_matches -n 8 --timeout 140 --junitxml="$OUT/kernel_tests.xml" > "$LOGS/kernel_tests.log" 2>&1
echo "pytest rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOGS/kernel_tests.log" | tail -12

step "CUDA tests: the Engine and the graph runner"
SGL_LITE_CUDA_MODEL="$model" timeout 150 "${PYTEST[@]}" -k "not flashinfer_matches" --timeout 80 \
    --junitxml="$OUT/engine_tests.xml" > "$LOGS/engine_tests.log" 2>&1
echo "pytest rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$LOGS/engine_tests.log" | tail -8

if [[ -z "${SKIP_BENCH:-}" ]]; then
    step "decode benchmark"
    wait $model_17b; echo "1.7b model rc=$?"
    timeout "${BENCH_TIMEOUT_S:-140}" python3 scripts/gpu/bench_gpu.py --tokenizer-dir .gpu/tokenizer --models-dir $MODELS \
        --shapes "${BENCH_SHAPES:-135m,1.7b}" --out "$OUT/bench_gpu.json" > "$LOGS/bench_gpu.log" 2>&1
    echo "bench rc=$?"; grep -v "it/s\]" "$LOGS/bench_gpu.log" | tail -12
fi

step "the host's gap between forwards: a served decode step split into scheduler, runner prep, model and sampling"
timeout 60 python3 scripts/bench_step.py --device cuda --model "$model" --dtype bfloat16 --batch-sizes 1,8,64 --steps 32 \
    --profile-batch 1 --out "$LOGS/bench_step.json" > "$LOGS/bench_step.log" 2>&1
echo "bench_step rc=$?"; grep -E "^\| [0-9]" "$LOGS/bench_step.log" | head -3

step "agent workload: sgl_lite against transformers generate, both on the GPU"
timeout "${SERVING_TIMEOUT_S:-70}" python3 scripts/bench_serving.py --model-path "$model" --device cuda --dtype bfloat16 \
    --workload multiturn-agent --agent-num-sessions 8 --agent-num-turns 4 --systems sgl_lite,hf --no-plots \
    --output-dir "$LOGS/serving" > "$LOGS/serving.log" 2>&1
echo "serving rc=$?"; grep -v "it/s\]" "$LOGS/serving.log" | tail -12
cp "$LOGS"/serving/*.json "$OUT/serving.json" 2>/dev/null

finish
