#!/usr/bin/env bash
# One kvtier serve shared by two vLLM engines: engine B loads what engine A stored.
# MODEL: a model directory (or a hub id where the machine can download it).
set -euo pipefail
: "${MODEL:?set MODEL=/path/to/model}"
SERVER_PORT=${SERVER_PORT:-65432} ADMIN_PORT=${ADMIN_PORT:-8900}
PORT_A=${PORT_A:-8100} PORT_B=${PORT_B:-8200}
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
ADMIN=http://127.0.0.1:$ADMIN_PORT
wait_healthy "$ADMIN" $!

KV_TRANSFER='{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integration.vllm","kv_role":"kv_both","kv_connector_extra_config":{"chunk_size":256,"max_local_cpu_size":'"$POOL_GB"',"remote_url":"kvtier://127.0.0.1:'"$SERVER_PORT"'"}}'
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT_A" \
  --kv-cache-memory-bytes "$KV_CACHE_BYTES" $VLLM_ARGS --kv-transfer-config "$KV_TRANSFER" &
PID_A=$!
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT_B" \
  --kv-cache-memory-bytes "$KV_CACHE_BYTES" $VLLM_ARGS --kv-transfer-config "$KV_TRANSFER" &
A=http://127.0.0.1:$PORT_A B=http://127.0.0.1:$PORT_B
wait_healthy "$B" $!
wait_healthy "$A" $PID_A

ANSWER=$(complete "$A"); echo "$ANSWER"     # engine A computes the prompt and stores it
TOKENS=$(echo "$ANSWER" | python -c 'import json, sys; print(json.load(sys.stdin)["usage"]["prompt_tokens"])')
for _ in $(seq 60); do  # stores to a remote tier are written in the background
  [ "$(metric "$ADMIN" kvtier_server_puts_total)" -ge $((TOKENS / 256)) ] && break; sleep 1
done
complete "$B"                                # engine B never saw it: loaded from the server
HITS=$(metric "$B" vllm:external_prefix_cache_hits_total)
kvtier status --server "127.0.0.1:$SERVER_PORT"
if [ "$HITS" -gt 0 ]; then echo "ok: engine B loaded $HITS prompt tokens that engine A stored"
else echo "FAIL: engine B loaded nothing (vllm:external_prefix_cache_hits_total is 0)"; exit 1; fi
