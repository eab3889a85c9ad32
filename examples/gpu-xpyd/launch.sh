#!/usr/bin/env bash
# 2 prefill + 2 decode vLLM instances on four GPUs of one host, and `kvdisagg proxy` with the
# slo_aware policy in front of them.
#
#   bash examples/gpu-xpyd/launch.sh nccl|mooncake|lmcache [MODEL]
#
# GPUs 0,1 prefill (ports 8100, 8101), GPUs 2,3 decode (ports 8200, 8201), proxy on PROXY_PORT
# (8000). HOST_ADDR (default 127.0.0.1) is the address prefill advertises to decode: set the
# fabric address when decode runs on other hosts (README.md has the per-host commands).
# NICS: one RDMA device per GPU 0-3 (`nvidia-smi topo -m` shows which NIC is next to which GPU),
# e.g. NICS=mlx5_0,mlx5_1,mlx5_2,mlx5_3: mooncake's mooncake_device, nccl's NCCL_IB_HCA, per
# instance. Unset: RDMA_DEVICE for every GPU (mooncake) and NCCL's own choice (nccl).
# Fixed ports, so a firewall can be written (docs/operations.md#fabric); GPU g's instance uses
# SIDE_CHANNEL_PORT + g, NCCL_STORE_PORT + g, MOONCAKE_PORT + 2g and + 2g + 1 (0: free ports).
# Ctrl-C stops everything.
set -euo pipefail

TRANSPORT=${1:?usage: launch.sh nccl|mooncake|lmcache [MODEL]}
MODEL=${2:-meta-llama/Llama-3.1-8B-Instruct}
HOST_ADDR=${HOST_ADDR:-127.0.0.1}
LISTEN=${LISTEN:-127.0.0.1}          # where vLLM and the proxy listen; 0.0.0.0 for other hosts
PROXY_PORT=${PROXY_PORT:-8000}
RDMA_DEVICE=${RDMA_DEVICE:-mlx5_0}
NICS=${NICS:-}                       # one RDMA device per GPU 0-3, comma-separated
SOCKET_IFNAME=${SOCKET_IFNAME:-}     # NCCL_SOCKET_IFNAME for every instance (nccl), e.g. ens1f0
SIDE_CHANNEL_PORT=${SIDE_CHANNEL_PORT:-7100}
NCCL_STORE_PORT=${NCCL_STORE_PORT:-7200}
MOONCAKE_PORT=${MOONCAKE_PORT:-7300}  # Mooncake takes ports 1024-32767 only
LMCACHE_PORT=${LMCACHE_PORT:-65432}
SLO_TTFT=${SLO_TTFT:-0.5}
SLO_TPOT=${SLO_TPOT:-0.05}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-900}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/kvdisagg-xpyd.XXXXXX)}
VLLM=${VLLM:-vllm}
KVDISAGG=${KVDISAGG:-kvdisagg}

# One --kv-transfer-config per side and transport; the @NAME@ placeholders are filled in per
# instance (fill, below).
case "$TRANSPORT" in
  nccl)
    P_CFG='{"kv_connector":"DisaggConnector","kv_role":"kv_producer","kv_connector_extra_config":{"transport":"nccl","side_channel_host":"@HOST@","side_channel_port":@SIDE_PORT@,"nccl_store_port":@STORE_PORT@,"lease_seconds":30}}'
    D_CFG='{"kv_connector":"DisaggConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"transport":"nccl","transfer_timeout_seconds":30}}'
    ;;
  mooncake)
    P_CFG='{"kv_connector":"DisaggConnector","kv_role":"kv_producer","kv_connector_extra_config":{"transport":"mooncake","mooncake_protocol":"rdma","mooncake_device":"@RDMA@","mooncake_port":@MOONCAKE_PORT@,"side_channel_host":"@HOST@","side_channel_port":@SIDE_PORT@}}'
    # Mooncake's engine listens on side_channel_host on both sides: decode's own address.
    D_CFG='{"kv_connector":"DisaggConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"transport":"mooncake","mooncake_protocol":"rdma","mooncake_device":"@RDMA@","mooncake_port":@MOONCAKE_PORT@,"side_channel_host":"@HOST@"}}'
    ;;
  lmcache)
    P_CFG='{"kv_connector":"DisaggConnector","kv_role":"kv_producer","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"transport":"lmcache","lmcache_url":"lm://@HOST@:@LMCACHE_PORT@","side_channel_host":"@HOST@"}}'
    D_CFG='{"kv_connector":"DisaggConnector","kv_role":"kv_consumer","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"transport":"lmcache","lmcache_url":"lm://@HOST@:@LMCACHE_PORT@"}}'
    ;;
  *) echo "transport must be nccl, mooncake or lmcache, got '$TRANSPORT'" >&2; exit 2 ;;
esac

# Each GPU's RDMA device: NICS, one per GPU, or RDMA_DEVICE for all.
IFS=, read -r -a NIC <<< "${NICS:-$RDMA_DEVICE,$RDMA_DEVICE,$RDMA_DEVICE,$RDMA_DEVICE}"
if [ "${#NIC[@]}" -ne 4 ]; then
  echo "NICS lists ${#NIC[@]} devices ('$NICS'); give one per GPU 0-3, comma-separated" >&2; exit 2
fi
plus() { if [ "$1" -eq 0 ]; then echo 0; else echo $(($1 + $2)); fi; }   # a base of 0 stays 0
fill() {  # fill CONFIG GPU: the config of the instance on GPU
  local s=${1//@HOST@/$HOST_ADDR} g=$2
  s=${s//@RDMA@/${NIC[$g]}}
  s=${s//@SIDE_PORT@/$(plus "$SIDE_CHANNEL_PORT" "$g")}
  s=${s//@STORE_PORT@/$(plus "$NCCL_STORE_PORT" "$g")}
  s=${s//@MOONCAKE_PORT@/$(plus "$MOONCAKE_PORT" $((2 * g)))}
  echo "${s//@LMCACHE_PORT@/$LMCACHE_PORT}"
}

set -m   # every background job gets its own process group: cleanup reaches vLLM's children
PGIDS=()
cleanup() {
  trap - EXIT INT TERM
  for pg in "${PGIDS[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
  sleep 5
  for pg in "${PGIDS[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
  echo "stopped; logs in $LOG_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
start() {  # start NAME CMD...
  local name=$1; shift
  echo "+ $*" | tee "$LOG_DIR/$name.cmd"
  "$@" >"$LOG_DIR/$name.log" 2>&1 </dev/null &
  PGIDS+=("$!")
}
wait_health() {  # wait_health NAME PORT: bounded
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  until curl -sf "http://127.0.0.1:$2/health" >/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "$1 not healthy after ${READY_TIMEOUT_S}s" >&2; tail -n 40 "$LOG_DIR/$1.log" >&2; exit 1; }
    sleep 3
  done
  echo "$1 healthy"
}

if [ "$TRANSPORT" = lmcache ]; then
  start lmcache lmcache_server "$HOST_ADDR" "$LMCACHE_PORT" cpu
fi

COMMON=(--host "$LISTEN" --block-size 16 --max-model-len 8192)   # same on every instance
serve() {  # serve NAME GPU PORT CONFIG: one instance on one GPU, with that GPU's NIC
  local env=(CUDA_VISIBLE_DEVICES="$2")
  if [ "$TRANSPORT" = nccl ]; then
    # NCCL reads these once per process: they go in the instance's environment.
    if [ -n "$NICS" ]; then env+=(NCCL_IB_HCA="=${NIC[$2]}"); fi
    if [ -n "$SOCKET_IFNAME" ]; then env+=(NCCL_SOCKET_IFNAME="$SOCKET_IFNAME"); fi
  fi
  start "$1" env "${env[@]}" "$VLLM" serve "$MODEL" "${COMMON[@]}" --port "$3" \
    --kv-transfer-config "$(fill "$4" "$2")"
}
serve prefill0 0 8100 "$P_CFG"
serve prefill1 1 8101 "$P_CFG"
serve decode0 2 8200 "$D_CFG"
serve decode1 3 8201 "$D_CFG"
for i in prefill0:8100 prefill1:8101 decode0:8200 decode1:8201; do wait_health "${i%%:*}" "${i##*:}"; done

start proxy "$KVDISAGG" proxy \
  --prefill http://127.0.0.1:8100 http://127.0.0.1:8101 \
  --decode http://127.0.0.1:8200 http://127.0.0.1:8201 \
  --policy slo_aware --slo-ttft "$SLO_TTFT" --slo-tpot "$SLO_TPOT" --admission queue \
  --host "$LISTEN" --port "$PROXY_PORT"
wait_health proxy "$PROXY_PORT"

echo "serving on http://$LISTEN:$PROXY_PORT (metrics: /metrics); logs in $LOG_DIR; Ctrl-C stops"
wait
