#!/usr/bin/env bash
# Install sgl_lite (editable) with its test extras. Idempotent: when this checkout is already installed
# for this python with the same pyproject.toml (a stamp in the cache folder records it), it only checks.
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore  # CI runs as root; the warning is noise there
cd "$(dirname "$0")/.."
repo="$(pwd)"
cache="${SGL_LITE_CACHE:-$HOME/.cache/sgl_lite}"
key="$( (cat pyproject.toml scripts/install.sh; python -c 'import sys; print(sys.executable)'; echo "$repo") | sha256sum | cut -c1-16)"
stamp="$cache/install-stamps/$key"

installed_here() {
    # torch is the pinned CPU build, and `import sgl_lite` (from elsewhere) finds this checkout.
    (cd / && python - "$repo" <<'EOF'
import importlib.metadata, importlib.util, pathlib, sys
# Metadata only: importing torch would cost seconds.
ok = importlib.metadata.version("torch").split("+")[0] == "2.13.0"
spec = importlib.util.find_spec("sgl_lite")
ok = ok and spec is not None and pathlib.Path(spec.origin).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve())
sys.exit(0 if ok else 1)
EOF
    ) >/dev/null 2>&1
}

prebuild_kernel() {
    # The C++ CPU ops (decode attention, RMSNorm): built once per machine into $cache/kernels (a cache hit
    # takes a second). A failed build is not an error: the runtime then uses the torch path and says so.
    (cd / && python -m sgl_lite.runtime.kernels.loader) \
        || echo "install.sh: the C++ CPU ops did not build; the model uses the torch path" >&2
}

if [[ -f "$stamp" ]] && installed_here; then
    prebuild_kernel
    exit 0
fi
# torch first and pinned: it resolves to the local CPU wheel, while an unpinned torch from PyPI
# would pull the multi-GB CUDA build as a dependency of the next line.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e '.[test]'
# SGLang's own frontend, for tests/test_sglang_frontend.py: without its dependencies (its GPU runtime's: CUDA
# torch, kernels), which an extra cannot say; it imports with sgl_lite's plus pybase64.
python -m pip install --quiet --no-deps sglang==0.5.23 pybase64
mkdir -p "$(dirname "$stamp")"
touch "$stamp"
prebuild_kernel
