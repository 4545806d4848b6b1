#!/usr/bin/env bash
# Disaggregated prefill on one machine: kvtier serve, a prefill engine (kv_producer), a
# decode engine (kv_consumer) and kvtier proxy in front of them.
# MODEL: a model directory (or a hub id where the machine can download it).
set -euo pipefail
: "${MODEL:?set MODEL=/path/to/model}"
SERVER_PORT=${SERVER_PORT:-65432} ADMIN_PORT=${ADMIN_PORT:-8900}
PREFILL_PORT=${PREFILL_PORT:-8100} DECODE_PORT=${DECODE_PORT:-8200} PROXY_PORT=${PROXY_PORT:-8000}
KV_CACHE_BYTES=${KV_CACHE_BYTES:-2147483648}  # each engine's own KV cache: 2 GiB
POOL_GB=${POOL_GB:-1}                          # each engine's CPU pool, GiB
SERVER_POOL_GB=${SERVER_POOL_GB:-4}            # kvtier serve's memory tier, GiB
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

kvtier serve --port "$SERVER_PORT" --max-local-cpu-size "$SERVER_POOL_GB" \
  --admin-port "$ADMIN_PORT" &
wait_healthy "http://127.0.0.1:$ADMIN_PORT" $!

KV='"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integration.vllm"'
EXTRA='"kv_connector_extra_config":{"remote_url":"kvtier://127.0.0.1:'"$SERVER_PORT"'","local_cpu":false,"max_local_cpu_size":'"$POOL_GB"'}'
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PREFILL_PORT" \
  --kv-cache-memory-bytes "$KV_CACHE_BYTES" $VLLM_ARGS \
  --kv-transfer-config "{$KV,\"kv_role\":\"kv_producer\",$EXTRA}" &
PID_PREFILL=$!
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$DECODE_PORT" \
  --kv-cache-memory-bytes "$KV_CACHE_BYTES" $VLLM_ARGS \
  --kv-transfer-config "{$KV,\"kv_role\":\"kv_consumer\",$EXTRA}" &
DECODE=http://127.0.0.1:$DECODE_PORT
wait_healthy "$DECODE" $!
wait_healthy "http://127.0.0.1:$PREFILL_PORT" $PID_PREFILL

kvtier proxy --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "$DECODE" \
  --port "$PROXY_PORT" &
wait_healthy "http://127.0.0.1:$PROXY_PORT" $!

complete "http://127.0.0.1:$PROXY_PORT"   # prefill stores the prompt, decode loads it
HITS=$(metric "$DECODE" vllm:external_prefix_cache_hits_total)
kvtier status --server "127.0.0.1:$SERVER_PORT"
if [ "$HITS" -gt 0 ]; then echo "ok: the decode engine loaded $HITS prompt tokens"
else echo "FAIL: the decode engine loaded nothing (vllm:external_prefix_cache_hits_total is 0)"; exit 1; fi
