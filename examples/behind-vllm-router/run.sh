#!/usr/bin/env bash
# A DisaggConnector prefill/decode pair behind vllm-router (instead of `kvdisagg proxy`) on one
# CPU host, one completion through the router, then everything stopped.
#
#   pip install vllm-router            # its own venv is fine: point VLLM_ROUTER at its binary
#   bash examples/behind-vllm-router/run.sh [MODEL]
#
# vllm-router's P/D mode speaks vLLM's NixlConnector protocol (its default --kv-connector
# nixl): prefill with do_remote_decode, then decode with prefill's kv_transfer_params.
# DisaggConnector uses the same protocol, so the router needs nothing else.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
VLLM_ROUTER=${VLLM_ROUTER:-vllm-router}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
ROUTER_PORT=${ROUTER_PORT:-8300}
ROUTER_METRICS_PORT=${ROUTER_METRICS_PORT:-29000}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-600}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/kvdisagg-vllm-router.XXXXXX)}
command -v "$VLLM_ROUTER" >/dev/null || { echo "$VLLM_ROUTER not found: pip install vllm-router" >&2; exit 1; }

MODEL=${1:-$("$PY" -c 'from kvdisagg.local.tiny_model import ensure_tiny_model; print(ensure_tiny_model())')}

set -m   # one process group per server, so cleanup reaches vLLM's children
PGIDS=()
cleanup() {
  trap - EXIT INT TERM
  for pg in "${PGIDS[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
  sleep 3
  for pg in "${PGIDS[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
  echo "stopped; logs in $LOG_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
start() { local name=$1; shift; "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null & PGIDS+=("$!"); }
wait_health() {  # wait_health NAME PORT: bounded
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  until curl -sf "http://127.0.0.1:$2/health" >/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "$1 not healthy after ${READY_TIMEOUT_S}s" >&2; tail -n 40 "$LOG_DIR/$1.log" >&2; exit 1; }
    sleep 2
  done
  echo "$1 healthy on 127.0.0.1:$2"
}

VLLM_ARGS=(--model "$MODEL" --host 127.0.0.1 --dtype float32 --max-model-len 2048
           --enforce-eager --block-size 128)
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 start prefill \
  "$PY" -m vllm.entrypoints.openai.api_server "${VLLM_ARGS[@]}" --port "$PREFILL_PORT" \
  --kv-transfer-config '{"kv_connector":"DisaggConnector","kv_role":"kv_producer","kv_connector_extra_config":{"transport":"tcp","side_channel_host":"127.0.0.1"}}'
VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=1 start decode \
  "$PY" -m vllm.entrypoints.openai.api_server "${VLLM_ARGS[@]}" --port "$DECODE_PORT" \
  --kv-transfer-config '{"kv_connector":"DisaggConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"transport":"tcp"}}'
wait_health prefill "$PREFILL_PORT"
wait_health decode "$DECODE_PORT"

start router "$VLLM_ROUTER" --vllm-pd-disaggregation --policy round_robin \
  --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
  --host 127.0.0.1 --port "$ROUTER_PORT" \
  --prometheus-host 127.0.0.1 --prometheus-port "$ROUTER_METRICS_PORT"
wait_health router "$ROUTER_PORT"

echo "one completion through vllm-router:"
curl -sf "http://127.0.0.1:$ROUTER_PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"$MODEL\",\"prompt\":\"The quick brown fox\",\"max_tokens\":16,\"temperature\":0}"
echo
echo "KV pulled by decode (vllm:kvdisagg_pulls_total):"
curl -sf "http://127.0.0.1:$DECODE_PORT/metrics" | grep '^vllm:kvdisagg_pulls_total' || true
