#!/usr/bin/env bash
# Cache-aware routing on one machine: two vLLM engines with kvtier, each publishing KV
# events (with a replay socket), and kvtier proxy --policy cache_aware in front of them.
# MODEL: a model directory (or a hub id where the machine can download it).
set -euo pipefail
: "${MODEL:?set MODEL=/path/to/model}"
A_PORT=${A_PORT:-8101} B_PORT=${B_PORT:-8102} PROXY_PORT=${PROXY_PORT:-8000}
A_EVENTS_PORT=${A_EVENTS_PORT:-5551} A_REPLAY_PORT=${A_REPLAY_PORT:-5561}
B_EVENTS_PORT=${B_EVENTS_PORT:-5552} B_REPLAY_PORT=${B_REPLAY_PORT:-5562}
KV_CACHE_BYTES=${KV_CACHE_BYTES:-2147483648}  # each engine's own KV cache: 2 GiB
POOL_GB=${POOL_GB:-1}                          # each engine's kvtier CPU pool, GiB
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
SYSTEM=$(for i in $(seq 80); do printf 'Sentence %d of a long shared system prompt. ' "$i"; done)
ask() {  # URL QUESTION: the shared system prompt and a question, 8 tokens
  curl -sf "$1/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"$SYSTEM $2\", \"max_tokens\": 8}" >/dev/null
}

KV='"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integration.vllm"'
EXTRA='"kv_connector_extra_config":{"local_cpu":true,"max_local_cpu_size":'"$POOL_GB"'}'
EVENTS='"enable_kv_cache_events":true,"publisher":"zmq"'
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$A_PORT" \
  --kv-cache-memory-bytes "$KV_CACHE_BYTES" --enable-prompt-tokens-details $VLLM_ARGS \
  --kv-transfer-config "{$KV,\"kv_role\":\"kv_both\",$EXTRA}" \
  --kv-events-config "{$EVENTS,\"endpoint\":\"tcp://*:$A_EVENTS_PORT\",\"replay_endpoint\":\"tcp://*:$A_REPLAY_PORT\"}" &
PID_A=$!
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$B_PORT" \
  --kv-cache-memory-bytes "$KV_CACHE_BYTES" --enable-prompt-tokens-details $VLLM_ARGS \
  --kv-transfer-config "{$KV,\"kv_role\":\"kv_both\",$EXTRA}" \
  --kv-events-config "{$EVENTS,\"endpoint\":\"tcp://*:$B_EVENTS_PORT\",\"replay_endpoint\":\"tcp://*:$B_REPLAY_PORT\"}" &
wait_healthy "http://127.0.0.1:$B_PORT" $!
wait_healthy "http://127.0.0.1:$A_PORT" $PID_A

A=http://127.0.0.1:$A_PORT B=http://127.0.0.1:$B_PORT PROXY=http://127.0.0.1:$PROXY_PORT
kvtier proxy --port "$PROXY_PORT" --policy cache_aware --decode "$A" --decode "$B" \
  --kv-events "$A=tcp://127.0.0.1:$A_EVENTS_PORT;replay=tcp://127.0.0.1:$A_REPLAY_PORT" \
  --kv-events "$B=tcp://127.0.0.1:$B_EVENTS_PORT;replay=tcp://127.0.0.1:$B_REPLAY_PORT" &
wait_healthy "$PROXY" $!

for question in "What is a KV cache?" "Why route by prefix?" "What is a block?" "Who holds it?"; do
  ask "$PROXY" "$question"
  sleep 1  # the engine's events reach the proxy
done
curl -sf "$PROXY/health" | python -m json.tool
DECISIONS=$(curl -sf "$PROXY/metrics" | grep '^kvtier_proxy_route_decisions_total' || true)
echo "$DECISIONS"
MOST=$(echo "$DECISIONS" | awk '{if ($NF > m) m = $NF} END {printf "%d\n", m}')
if [ "$MOST" -ge 4 ]; then echo "ok: every request with the shared prompt went to one engine"
else echo "FAIL: the requests were spread over the engines ($MOST of 4 on the busiest)"; exit 1; fi
