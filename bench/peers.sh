#!/usr/bin/env bash
# Side-by-side runs of kvroute and the routers users would pick instead, on simulated vLLM
# fleets, over a matrix of workloads × presets × pool sizes × load levels.
#
#   bash bench/peers.sh                 # the whole matrix (4 × 3 × 2 × 2 cells, 6 routers)
#   bash bench/peers.sh --quick         # one cell per workload (qwen3-next, tight pool, high load), ~25 min
#   bash bench/peers.sh --workloads multi-turn --presets gemma3 --pools tight --loads high --repeat 3
#   bash bench/peers.sh --workloads agentic --sessions 200 --requests 2000 ...   # a longer run of a generator
#   bash bench/peers.sh --presets llama --pools 400 ...   # a pool of 400 blocks per worker
#
# Installs SMG (smg==1.13.0) and vllm-router (vllm-router==0.1.17) from PyPI into venvs of
# their own under $PEERS_VENVS (default .peers/), builds kvroute, then for every cell and
# router: starts a fresh fleet of `kvroute sim-worker` processes, the router in front of it,
# and `kvroute bench` against the router; every router sees the same requests at the same
# times. Results: one JSON per run under $OUT (default bench/out/) with its requests log and,
# for kvroute, its GET /admin/workers and /metrics (bench/prederr.py), and a Markdown table of
# every cell (bench/matrix.py). KVROUTE_ARGS adds flags to kvroute's `serve` (an ablation, with
# its own --out); SIM_ARGS adds flags to every `kvroute sim-worker` (e.g. a CPU tier:
# SIM_ARGS="--kv-offloading-slots 4800"). Not part of the test command: it installs from PyPI
# and takes minutes to hours.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/out
VENVS=${PEERS_VENVS:-.peers}
WORKERS=4
# Engines run in real time by default: gateways that learn from their own clock (kvroute's TTFT
# model, SMG's load monitor) see what they would see in front of real engines.
SPEEDUP=1
REQUESTS=400
SESSIONS=
REPEAT=1
WORKLOADS="mooncake shared-prefix multi-turn agentic"
PRESETS="qwen3-next gemma3 llama"
POOLS="roomy tight"
LOADS="low high"
ROUTERS="kvroute-hybrid kvroute-blind smg-cache vr-cache vr-kv round-robin"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) WORKLOADS="mooncake shared-prefix multi-turn agentic"; PRESETS=qwen3-next; POOLS=tight; LOADS=high; shift ;;
    --out) OUT=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --sessions) SESSIONS=$2; shift 2 ;;
    --speedup) SPEEDUP=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --workloads) WORKLOADS=${2//,/ }; shift 2 ;;
    --presets) PRESETS=${2//,/ }; shift 2 ;;
    --pools) POOLS=${2//,/ }; shift 2 ;;
    --loads) LOADS=${2//,/ }; shift 2 ;;
    --routers) ROUTERS=${2//,/ }; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT" "$OUT/logs"

# --- install -------------------------------------------------------------------------------
if [ ! -x "$VENVS/smg/bin/smg" ]; then
  python3 -m venv "$VENVS/smg" && "$VENVS/smg/bin/pip" install --quiet --disable-pip-version-check smg==1.13.0
fi
if [ ! -x "$VENVS/vr/bin/vllm-router" ]; then
  python3 -m venv "$VENVS/vr" && "$VENVS/vr/bin/pip" install --quiet --disable-pip-version-check vllm-router==0.1.17
fi
# KVROUTE_BIN: a kvroute binary built already (else this tree is built).
if [ -z "${KVROUTE_BIN:-}" ]; then cargo build --release --locked -p kvroute; fi
KV=${KVROUTE_BIN:-target/release/kvroute}

# --- the matrix's axes ---------------------------------------------------------------------
# Pool sizes in blocks per worker: roomy holds a workload's working set, tight forces eviction;
# a number is that many blocks (a pool outside the matrix).
blocks() { # preset pool
  case "$1/$2" in
    qwen3-next/roomy) echo 2048 ;; qwen3-next/tight) echo 120 ;;
    gemma3/roomy) echo 16384 ;;    gemma3/tight) echo 6000 ;;
    llama/roomy) echo 8192 ;;      llama/tight) echo 1200 ;;
    */*[!0-9]*|*/) echo "unknown pool $2 (roomy, tight or a block count)" >&2; exit 2 ;;
    *) echo "$2" ;;
  esac
}
# The hit unit (vLLM's alignment) per preset: the oracle's block and vllm-router's event block.
align() { case "$1" in qwen3-next) echo 544 ;; *) echo 16 ;; esac; }
# Sessions per second. Load levels are set by one rule, not per result: the prompt tokens offered
# per second against the no-reuse prefill capacity of WORKERS simulated workers at the default
# time model (60 µs a token: ~16,700 tokens/s each) — low ≈ 0.35×, high ≈ 1× (only a router
# that reuses keeps up). Mean prompt tokens per session: mooncake 6.5k (one request, 256 tokens
# per block id), shared-prefix 2.2k (one request), multi-turn ~8.3k (5.5 turns), agentic ~29k
# (6.5 steps over a 3k-token system prompt).
rate() { # workload load
  case "$1/$2" in
    mooncake/low) echo 3.5 ;;    mooncake/high) echo 10 ;;
    shared-prefix/low) echo 10 ;; shared-prefix/high) echo 30 ;;
    multi-turn/low) echo 2.8 ;;  multi-turn/high) echo 8 ;;
    agentic/low) echo 0.8 ;;     agentic/high) echo 2.3 ;;
  esac
}

PIDS=()
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
cleanup() {
  local p i
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
  # Nothing may survive into the next run: every port must be free again.
  for port in 18080 $(seq 18100 $((18100 + WORKERS - 1))); do
    for ((i = 0; i < 100; i++)); do port_free "$port" && break; sleep 0.1; done
    port_free "$port" || { echo "port $port still in use after a run" >&2; exit 1; }
  done
}
trap cleanup EXIT
for port in 18080 18081 18090 $(seq 18100 $((18100 + WORKERS - 1))); do
  port_free "$port" || { echo "port $port is in use: stop what listens there first" >&2; exit 1; }
done

wait_http() { # url seconds
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    curl -sf -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "timed out waiting for $1" >&2
  return 1
}

start_fleet() { # preset blocks
  local i
  for ((i = 0; i < WORKERS; i++)); do
    # shellcheck disable=SC2086 # SIM_ARGS: extra sim-worker flags, word-split on purpose
    "$KV" sim-worker --preset "$1" --blocks "$2" --speedup "$SPEEDUP" --http "127.0.0.1:$((18100 + i))" \
      --zmq "tcp://*:$((18200 + i))" --replay "tcp://*:$((18300 + i))" ${SIM_ARGS:-} >"$OUT/logs/sim-$i.log" 2>&1 &
    PIDS+=($!)
  done
  for ((i = 0; i < WORKERS; i++)); do wait_http "http://127.0.0.1:$((18100 + i))/health" 20; done
}

start_router() { # router preset
  local urls=() kvsrc=() kvw=() i
  for ((i = 0; i < WORKERS; i++)); do
    urls+=("http://127.0.0.1:$((18100 + i))")
    kvsrc+=(--kv-event-source "http://127.0.0.1:$((18100 + i))=tcp://127.0.0.1:$((18200 + i))")
    kvw+=(--worker "name=w$i,url=http://127.0.0.1:$((18100 + i)),model=$2,events=tcp://*:$((18200 + i)),replay=tcp://*:$((18300 + i))")
  done
  case "$1" in
    kvroute-hybrid) exec "$KV" serve --listen 127.0.0.1:18080 --admin-listen 127.0.0.1:18081 --policy hybrid-aware ${KVROUTE_ARGS:-} "${kvw[@]}" ;;
    kvroute-blind) exec "$KV" serve --listen 127.0.0.1:18080 --admin-listen 127.0.0.1:18081 --policy group-blind ${KVROUTE_ARGS:-} "${kvw[@]}" ;;
    round-robin) exec "$KV" serve --listen 127.0.0.1:18080 --admin-listen 127.0.0.1:18081 --policy round-robin "${kvw[@]}" ;;
    smg-cache) exec "$VENVS/smg/bin/smg" launch --host 127.0.0.1 --port 18080 --prometheus-host 127.0.0.1 \
      --prometheus-port 18090 --worker-urls "${urls[@]}" --policy cache_aware --health-check-interval-secs 5 \
      --load-monitor-interval 5 --shutdown-grace-period-secs 1 ;;
    vr-cache) exec "$VENVS/vr/bin/vllm-router" --host 127.0.0.1 --port 18080 --prometheus-host 127.0.0.1 \
      --prometheus-port 18090 --worker-urls "${urls[@]}" --policy cache_aware --health-check-interval-secs 5 ;;
    vr-kv) exec "$VENVS/vr/bin/vllm-router" --host 127.0.0.1 --port 18080 --prometheus-host 127.0.0.1 \
      --prometheus-port 18090 --worker-urls "${urls[@]}" --policy kv_aware "${kvsrc[@]}" \
      --kv-event-model "$2" --kv-event-block-size "$(align "$2")" --health-check-interval-secs 5 ;;
    *) echo "unknown router $1" >&2; return 1 ;;
  esac >"$OUT/logs/router-$1.log" 2>&1 &
  PIDS+=($!)
  wait_http "http://127.0.0.1:18080/v1/models" 60
  # Let registration, health checks and event subscriptions settle.
  sleep 3
}

for rep in $(seq 1 "$REPEAT"); do
  for wl in $WORKLOADS; do
    for preset in $PRESETS; do
      for pool in $POOLS; do
        for load in $LOADS; do
          for router in $ROUTERS; do
            cell="$wl.$preset.$pool.$load"
            json="$OUT/$cell.$router.$rep.json"
            echo "== $cell $router (run $rep)"
            start_fleet "$preset" "$(blocks "$preset" "$pool")"
            start_router "$router" "$preset"
            engines=$(seq -s, -f "http://127.0.0.1:%g" 18100 $((18100 + WORKERS - 1)))
            "$KV" bench --target http://127.0.0.1:18080 --model "$preset" --workload "$wl" --engine-urls "$engines" \
              --tokens-per-block 256 --prompt-format text --speedup "$SPEEDUP" --time-scale "$SPEEDUP" \
              --rate "$(rate "$wl" "$load")" --max-requests "$REQUESTS" --block-size "$(align "$preset")" \
              ${SESSIONS:+--sessions "$SESSIONS"} --timeout 120 --quiet --json "$json" --requests-log "${json%.json}.requests.jsonl" | sed -n 2p
            # kvroute's learned models (GET /admin/workers) and its metrics (the TTFT prediction
            # error histograms: bench/prederr.py) at the end of the run.
            case "$router" in
              kvroute-*)
                curl -sf -o "${json%.json}.workers.json" http://127.0.0.1:18081/admin/workers || true
                curl -sf -o "${json%.json}.metrics.prom" http://127.0.0.1:18081/metrics || true ;;
            esac
            cleanup
            sleep 1
          done
        done
      done
    done
  done
done
python3 bench/matrix.py "$OUT"
