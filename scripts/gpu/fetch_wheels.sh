#!/usr/bin/env bash
# Here (with network): gather into .gpu/ (git-ignored) what the device check carries to the GPU machine, which
# has no network: cp312 manylinux wheels of the packages its image lacks, pinned to the versions installed here
# (flashinfer-python to a release whose wheel fits the 64 MiB a call may carry), and the default model's config
# and tokenizer files (its weights are too big to carry; the check builds random weights of that shape there).
set -euo pipefail
cd "$(dirname "$0")/../.."
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.6.6}
PACKAGES=(msgspec pyzmq xgrammar apache-tvm-ffi fastapi starlette uvicorn pydantic pydantic-core typing-inspection
          annotated-types h11 gguf jsonschema jsonschema-specifications referencing rpds-py opentelemetry-api)
mkdir -p .gpu/wheels .gpu/tokenizer
rm -f .gpu/wheels/*.whl
pinned() {  # NAME==VERSION as installed here, or NAME when it is not
    python - "$1" <<'PY'
import importlib.metadata as m, sys
try:
    print(f"{sys.argv[1]}=={m.version(sys.argv[1])}")
except m.PackageNotFoundError:
    print(sys.argv[1])
PY
}
specs=("flashinfer-python==$FLASHINFER_VERSION")
for name in "${PACKAGES[@]}"; do specs+=("$(pinned "$name")"); done
echo "fetch_wheels: ${specs[*]}"
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .gpu/wheels "${specs[@]}"
model=$(python -c 'from sgl_lite.runtime.model_executor.loader import DEFAULT_MODEL, resolve_model_path; print(resolve_model_path(DEFAULT_MODEL))')
for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja generation_config.json; do
    if [[ -f "$model/$f" ]]; then cp "$model/$f" .gpu/tokenizer/; fi
done
du -sh .gpu/wheels .gpu/tokenizer
echo "fetch_wheels: ready; carry .gpu (scripts/gpu/device_check.sh runs there)"
