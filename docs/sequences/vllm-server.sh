#!/usr/bin/env bash
# One vLLM OpenAI server with kvtier, and a kvtier hit seen on vLLM's /metrics.
# MODEL: a model directory (or a hub id where the machine can download it).
set -euo pipefail
: "${MODEL:?set MODEL=/path/to/model}"
PORT=${PORT:-8000}
KV_CACHE_BYTES=${KV_CACHE_BYTES:-4294967296}  # vLLM's own KV cache: 4 GiB
POOL_GB=${POOL_GB:-4}                          # kvtier's CPU pool (max_local_cpu_size), GiB
VLLM_ARGS=${VLLM_ARGS:-}                       # more vLLM flags, e.g. --enforce-eager
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT
wait_healthy() {  # URL PID: until URL/health answers (10 minutes at most)
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null && return
    kill -0 "$2" 2>/dev/null || { echo "FAIL: the process behind $1 exited"; exit 1; }
    sleep 1
  done
  echo "FAIL: $1 did not start"; exit 1
}
metric() {  # URL NAME: the sum of a Prometheus metric's samples
  curl -sf "$1/metrics" | awk -v n="$2" 'index($1, n) == 1 {s += $NF} END {printf "%d\n", s}'
}
PROMPT=$(for i in $(seq 80); do printf 'Sentence %d of a long shared prefix. ' "$i"; done)
complete() {  # URL: the prompt, 8 tokens
  curl -sf "$1/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"$PROMPT\", \"max_tokens\": 8}"; echo
}

# VLLM_SERVER_DEV_MODE=1 enables POST /reset_prefix_cache (used below).
VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --port "$PORT" --kv-cache-memory-bytes "$KV_CACHE_BYTES" $VLLM_ARGS \
  --kv-transfer-config '{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integration.vllm","kv_role":"kv_both","kv_connector_extra_config":{"chunk_size":256,"max_local_cpu_size":'"$POOL_GB"'}}' &
URL=http://127.0.0.1:$PORT
wait_healthy "$URL" $!

complete "$URL"                           # cold: vLLM computes the prompt, kvtier stores it
curl -sf -X POST "$URL/reset_prefix_cache"; echo   # empties vLLM's own cache, not kvtier's
complete "$URL"                           # the same prompt: its prefix comes from kvtier
HITS=$(metric "$URL" vllm:external_prefix_cache_hits_total)
if [ "$HITS" -gt 0 ]; then echo "ok: $HITS prompt tokens loaded from kvtier"
else echo "FAIL: no kvtier hit (vllm:external_prefix_cache_hits_total is 0)"; exit 1; fi
