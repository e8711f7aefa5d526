#!/usr/bin/env bash
# Side-by-side runs of kvroute and the routers users would pick instead, on simulated vLLM
# fleets, over a matrix of workloads × presets × pool sizes × load levels.
#
#   bash bench/peers.sh                 # the whole matrix (4 × 3 × 2 × 2 cells, 6 routers)
#   bash bench/peers.sh --quick         # one cell per workload (qwen3-next, tight pool, high load), ~25 min
#   bash bench/peers.sh --workloads multi-turn --presets gemma3 --pools tight --loads high --repeat 3
#   bash bench/peers.sh --workloads agentic --sessions 200 --requests 2000 ...   # a longer run of a generator
#   bash bench/peers.sh --presets llama --pools 400 ...   # a pool of 400 blocks per worker
#   bash bench/peers.sh --replicas 3 --routers kvroute-hybrid,smg-cache,smg-mesh --workloads tenants \
#     --presets qwen3-next --pools tight --loads high --out bench/out-r3   # three replicas per router
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
#
# Replicas (--replicas N, default 1, at most 10): N processes of the router, each its own
# gateway in front of the same fleet (kvroute replicas each subscribe to every engine's events;
# vr-kv replicas too), all passed to `kvroute bench` as one target joined by + and balanced
# round robin per request (a multi-turn conversation is not pinned to a replica). Replica r
# (from 0) listens on 18080 + 2r (18080, 18082, 18084, …); kvroute's admin listener is the port
# above it (18081 + 2r); SMG's and vllm-router's Prometheus port is 18400 + r; smg-mesh's mesh
# port is 18500 + r. Simulated workers use 18100 + i (HTTP), 18200 + i (ZMQ events) and
# 18300 + i (replay). Every one of these ports must be free before the script starts and is free
# again after each run. `smg-mesh` is SMG's cache_aware policy with its mesh on
# (--enable-mesh, --mesh-port, --mesh-peer-urls listing every other replica), so the replicas
# share what they learn; `smg-cache` replicas run without it. kvroute-hybrid replicas share
# their bookings (--peer, every other replica's admin listener); kvroute-isolated replicas are
# hybrid-aware without it. kvroute's /admin/workers and
# /metrics are saved per replica (replica 0 as before, replica r as RUN.rR.workers.json and
# RUN.rR.metrics.prom). Runs with another replica count belong in their own --out (the JSON
# file names do not carry it; bench/matrix.py reads it from the JSON and marks the cell ×N).
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
REPLICAS=1
WORKLOADS="mooncake shared-prefix multi-turn agentic"
PRESETS="qwen3-next gemma3 llama"
POOLS="roomy tight"
LOADS="low high"
ROUTERS="kvroute-hybrid kvroute-blind smg-cache vr-cache vr-kv round-robin"
# (also: smg-mesh, SMG's cache_aware with its mesh; it needs --replicas 2 or more to matter)
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) WORKLOADS="mooncake shared-prefix multi-turn agentic"; PRESETS=qwen3-next; POOLS=tight; LOADS=high; shift ;;
    --out) OUT=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    --replicas) REPLICAS=$2; shift 2 ;;
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
case "$REPLICAS" in
  [1-9]|10) ;;
  *) echo "--replicas $REPLICAS: give 1 to 10" >&2; exit 2 ;;
esac
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
# (6.5 steps over a 3k-token system prompt), tenants ~3.3k (one request: a ~3k-token tenant
# system prompt and a 100–300-token user part; the generator's rate rises from 0.5× to 1.5× of
# this mean over the run, so `high` ends above the fleet's capacity).
rate() { # workload load
  case "$1/$2" in
    tenants/low) echo 7 ;;       tenants/high) echo 20 ;;
    mooncake/low) echo 3.5 ;;    mooncake/high) echo 10 ;;
    shared-prefix/low) echo 10 ;; shared-prefix/high) echo 30 ;;
    multi-turn/low) echo 2.8 ;;  multi-turn/high) echo 8 ;;
    agentic/low) echo 0.8 ;;     agentic/high) echo 2.3 ;;
  esac
}

PIDS=()
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# Every port a run listens on: each router replica's (front, admin, Prometheus, mesh) and each
# simulated worker's HTTP port.
ports() {
  local r
  for ((r = 0; r < REPLICAS; r++)); do
    echo $((18080 + 2 * r)) $((18081 + 2 * r)) $((18400 + r)) $((18500 + r))
  done
  seq 18100 $((18100 + WORKERS - 1))
}
cleanup() {
  local p i
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
  # Nothing may survive into the next run: every port must be free again.
  for port in $(ports); do
    for ((i = 0; i < 100; i++)); do port_free "$port" && break; sleep 0.1; done
    port_free "$port" || { echo "port $port still in use after a run" >&2; exit 1; }
  done
}
trap cleanup EXIT
for port in $(ports); do
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

# Replica $3 of router $1 in front of the fleet (preset $2), in the background.
start_replica() { # router preset replica
  local urls=() kvsrc=() kvw=() peers=() mesh=() i log
  local port=$((18080 + 2 * $3)) admin=$((18081 + 2 * $3)) prom=$((18400 + $3))
  for ((i = 0; i < WORKERS; i++)); do
    urls+=("http://127.0.0.1:$((18100 + i))")
    kvsrc+=(--kv-event-source "http://127.0.0.1:$((18100 + i))=tcp://127.0.0.1:$((18200 + i))")
    kvw+=(--worker "name=w$i,url=http://127.0.0.1:$((18100 + i)),model=$2,events=tcp://*:$((18200 + i)),replay=tcp://*:$((18300 + i))")
  done
  # smg-mesh: every replica lists every other one's mesh port.
  for ((i = 0; i < REPLICAS; i++)); do
    if [ "$i" -ne "$3" ]; then peers+=("127.0.0.1:$((18500 + i))"); fi
  done
  if [ ${#peers[@]} -gt 0 ]; then mesh=(--mesh-peer-urls "${peers[@]}"); fi
  # kvroute replicas share their bookings (--peer: every other replica's admin listener), as
  # a deployment's [peers] does; kvroute-isolated replicas do not.
  local kvpeers=()
  for ((i = 0; i < REPLICAS; i++)); do
    if [ "$i" -ne "$3" ]; then kvpeers+=(--peer "http://127.0.0.1:$((18081 + 2 * i))"); fi
  done
  log="$OUT/logs/router-$1.log"
  if [ "$3" -gt 0 ]; then log="$OUT/logs/router-$1.r$3.log"; fi
  case "$1" in
    kvroute-hybrid) exec "$KV" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" --policy hybrid-aware --replica-name "r$3" "${kvpeers[@]}" ${KVROUTE_ARGS:-} "${kvw[@]}" ;;
    kvroute-isolated) exec "$KV" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" --policy hybrid-aware ${KVROUTE_ARGS:-} "${kvw[@]}" ;;
    kvroute-blind) exec "$KV" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" --policy group-blind ${KVROUTE_ARGS:-} "${kvw[@]}" ;;
    round-robin) exec "$KV" serve --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" --policy round-robin "${kvw[@]}" ;;
    smg-cache) exec "$VENVS/smg/bin/smg" launch --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 \
      --prometheus-port "$prom" --worker-urls "${urls[@]}" --policy cache_aware --health-check-interval-secs 5 \
      --load-monitor-interval 5 --shutdown-grace-period-secs 1 ;;
    smg-mesh) exec "$VENVS/smg/bin/smg" launch --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 \
      --prometheus-port "$prom" --worker-urls "${urls[@]}" --policy cache_aware --health-check-interval-secs 5 \
      --load-monitor-interval 5 --shutdown-grace-period-secs 1 --enable-mesh --mesh-server-name "smg-$3" \
      --mesh-host 127.0.0.1 --mesh-port $((18500 + $3)) "${mesh[@]}" ;;
    vr-cache) exec "$VENVS/vr/bin/vllm-router" --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 \
      --prometheus-port "$prom" --worker-urls "${urls[@]}" --policy cache_aware --health-check-interval-secs 5 ;;
    vr-kv) exec "$VENVS/vr/bin/vllm-router" --host 127.0.0.1 --port "$port" --prometheus-host 127.0.0.1 \
      --prometheus-port "$prom" --worker-urls "${urls[@]}" --policy kv_aware "${kvsrc[@]}" \
      --kv-event-model "$2" --kv-event-block-size "$(align "$2")" --health-check-interval-secs 5 ;;
    *) echo "unknown router $1" >&2; return 1 ;;
  esac >"$log" 2>&1 &
  PIDS+=($!)
}

start_router() { # router preset
  local r
  for ((r = 0; r < REPLICAS; r++)); do start_replica "$1" "$2" "$r"; done
  for ((r = 0; r < REPLICAS; r++)); do wait_http "http://127.0.0.1:$((18080 + 2 * r))/v1/models" 60; done
  # Let registration, health checks, event subscriptions and meshes settle.
  sleep 3
}

# The bench target: every replica's URL, joined by + (one balanced target).
target() {
  local r t=""
  for ((r = 0; r < REPLICAS; r++)); do t+="${t:++}http://127.0.0.1:$((18080 + 2 * r))"; done
  echo "$t"
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
            # tenants: one request per session, so the run spans the generator's whole rising
            # rate unless --sessions says otherwise.
            sessions=$SESSIONS
            if [ -z "$sessions" ] && [ "$wl" = tenants ]; then sessions=$REQUESTS; fi
            # The table's row (and, with replicas, each replica's line).
            "$KV" bench --target "$(target)" --model "$preset" --workload "$wl" --engine-urls "$engines" \
              --tokens-per-block 256 --prompt-format text --speedup "$SPEEDUP" --time-scale "$SPEEDUP" \
              --rate "$(rate "$wl" "$load")" --max-requests "$REQUESTS" --block-size "$(align "$preset")" \
              ${sessions:+--sessions "$sessions"} --timeout 120 --quiet --json "$json" \
              --requests-log "${json%.json}.requests.jsonl" | sed -n '2,/^$/{/^$/!p}'
            # kvroute's learned models (GET /admin/workers) and its metrics (the TTFT prediction
            # error histograms: bench/prederr.py) at the end of the run, per replica.
            case "$router" in
              kvroute-*)
                for ((r = 0; r < REPLICAS; r++)); do
                  saved="${json%.json}"
                  if [ "$r" -gt 0 ]; then saved="$saved.r$r"; fi
                  curl -sf -o "$saved.workers.json" "http://127.0.0.1:$((18081 + 2 * r))/admin/workers" || true
                  curl -sf -o "$saved.metrics.prom" "http://127.0.0.1:$((18081 + 2 * r))/metrics" || true
                done ;;
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
