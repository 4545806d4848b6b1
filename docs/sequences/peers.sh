#!/usr/bin/env bash
# Two nodes with no shared store: kvtier serve a and b, each the other's peer, an engine
# on each. Engine B loads what only engine A computed: server b pulls it from server a.
# On one machine the servers need two ports; on two nodes both use 65432 and each
# --peer names the other node's address.
# MODEL: a model directory (or a hub id where the machine can download it).
set -euo pipefail
: "${MODEL:?set MODEL=/path/to/model}"
SERVER_A_PORT=${SERVER_A_PORT:-65432} SERVER_B_PORT=${SERVER_B_PORT:-65433}
ADMIN_A_PORT=${ADMIN_A_PORT:-8900} ADMIN_B_PORT=${ADMIN_B_PORT:-8901}
PORT_A=${PORT_A:-8100} PORT_B=${PORT_B:-8200}
KV_CACHE_BYTES=${KV_CACHE_BYTES:-2147483648}  # each engine's own KV cache: 2 GiB
POOL_GB=${POOL_GB:-1}                          # each engine's CPU pool, GiB
SERVER_POOL_GB=${SERVER_POOL_GB:-4}            # each kvtier serve's memory tier, GiB
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
kv_transfer() {  # SERVER_PORT: the engine's connector, its node's server as its remote
  echo '{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integration.vllm","kv_role":"kv_both","kv_connector_extra_config":{"chunk_size":256,"max_local_cpu_size":'"$POOL_GB"',"remote_url":"kvtier://127.0.0.1:'"$1"'"}}'
}

kvtier serve --port "$SERVER_A_PORT" --max-local-cpu-size "$SERVER_POOL_GB" \
  --admin-port "$ADMIN_A_PORT" --peer "kvtier://127.0.0.1:$SERVER_B_PORT" &
PID_SERVER_A=$!
kvtier serve --port "$SERVER_B_PORT" --max-local-cpu-size "$SERVER_POOL_GB" \
  --admin-port "$ADMIN_B_PORT" --peer "kvtier://127.0.0.1:$SERVER_A_PORT" &
ADMIN_A=http://127.0.0.1:$ADMIN_A_PORT ADMIN_B=http://127.0.0.1:$ADMIN_B_PORT
wait_healthy "$ADMIN_B" $!
wait_healthy "$ADMIN_A" $PID_SERVER_A

python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT_A" \
  --kv-cache-memory-bytes "$KV_CACHE_BYTES" $VLLM_ARGS \
  --kv-transfer-config "$(kv_transfer "$SERVER_A_PORT")" &
PID_A=$!
python -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT_B" \
  --kv-cache-memory-bytes "$KV_CACHE_BYTES" $VLLM_ARGS \
  --kv-transfer-config "$(kv_transfer "$SERVER_B_PORT")" &
A=http://127.0.0.1:$PORT_A B=http://127.0.0.1:$PORT_B
wait_healthy "$B" $!
wait_healthy "$A" $PID_A

ANSWER=$(complete "$A"); echo "$ANSWER"     # engine A computes the prompt, stores it on a
TOKENS=$(echo "$ANSWER" | python -c 'import json, sys; print(json.load(sys.stdin)["usage"]["prompt_tokens"])')
for _ in $(seq 60); do  # stores to a remote tier are written in the background
  [ "$(metric "$ADMIN_A" kvtier_server_puts_total)" -ge $((TOKENS / 256)) ] && break; sleep 1
done
complete "$B"                                # engine B asks server b, which pulls from a
HITS=$(metric "$B" vllm:external_prefix_cache_hits_total)
PULLED=$(metric "$ADMIN_B" kvtier_server_peer_hits_total)
kvtier status --server "127.0.0.1:$SERVER_B_PORT"
if [ "$HITS" -gt 0 ] && [ "$PULLED" -gt 0 ]; then
  echo "ok: engine B loaded $HITS prompt tokens that only engine A computed ($PULLED chunks pulled by server b from server a)"
else echo "FAIL: engine B loaded $HITS tokens, server b pulled $PULLED chunks from its peer"; exit 1; fi
