#!/usr/bin/env bash
# Disaggregated prefill/decode against aggregated serving, on simulated vLLM workers behind
# kvroute, same number of workers, same workload, engines in real time.
#
#   bash bench/pd.sh                       # layouts agg4, pd22, pd13 × multi-turn, shared-prefix
#   bash bench/pd.sh --layouts agg4,pd22 --workloads multi-turn --repeat 3
#
# Layouts: agg4 (four workers serving requests whole), pd22 (two prefill workers, KV
# producers, and two decode workers, KV consumers), pd13 (one prefill, three decode). For
# every layout and workload: a fresh fleet of `kvroute sim-worker` processes (real ZMQ events,
# real HTTP; decode workers pull the prefill workers' KV over the simulator's side channel,
# `kv_transfer_token_s` a token), `kvroute serve` with the workers' roles, and `kvroute bench`
# against it. Every figure is the client's wall time (an engine's own clock would miss one of
# the two legs). `kvroute bench --fleet P,4,B --target kvroute:POLICY/2p2d` runs the same
# comparison in one process. Results: one JSON per run under $OUT (default bench/out/pd/) and a table on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/out/pd
PRESET=qwen3-next
BLOCKS=2048
REQUESTS=300
REPEAT=1
LAYOUTS="agg4 pd22 pd13"
WORKLOADS="multi-turn shared-prefix"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --preset) PRESET=$2; shift 2 ;;
    --blocks) BLOCKS=$2; shift 2 ;;
    --layouts) LAYOUTS=${2//,/ }; shift 2 ;;
    --workloads) WORKLOADS=${2//,/ }; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT/logs"
cargo build --release --locked -p kvroute
KV=target/release/kvroute

# Sessions per second: the peer matrix's low load (docs/routing.md), where neither layout
# saturates, so what differs is the path a request takes.
rate() { case "$1" in multi-turn) echo 2.8 ;; shared-prefix) echo 10 ;; agentic) echo 0.8 ;; *) echo 3 ;; esac; }
# The hit unit (vLLM's alignment) of the preset: the oracle's block.
align() { case "$1" in qwen3-next) echo 544 ;; *) echo 16 ;; esac; }
# The roles of the four workers of a layout.
roles() {
  case "$1" in
    agg4) echo "both both both both" ;;
    pd22) echo "prefill prefill decode decode" ;;
    pd13) echo "prefill decode decode decode" ;;
    *) echo "unknown layout $1" >&2; return 1 ;;
  esac
}

PIDS=()
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
cleanup() {
  local p i port
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  PIDS=()
  for port in 18080 18100 18101 18102 18103; do
    for ((i = 0; i < 100; i++)); do port_free "$port" && break; sleep 0.1; done
  done
}
trap cleanup EXIT
wait_http() {
  local i
  for ((i = 0; i < $2 * 10; i++)); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "timed out waiting for $1" >&2
  return 1
}

for rep in $(seq 1 "$REPEAT"); do
  for wl in $WORKLOADS; do
    for layout in $LAYOUTS; do
      json="$OUT/$wl.$layout.$rep.json"
      echo "== $wl $layout (run $rep)"
      i=0
      specs=()
      for role in $(roles "$layout"); do
        kvt=()
        case "$role" in
          prefill) kvt=(--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}') ;;
          decode) kvt=(--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}') ;;
        esac
        "$KV" sim-worker --preset "$PRESET" --blocks "$BLOCKS" --speedup 1 --http "127.0.0.1:$((18100 + i))" \
          --zmq "tcp://*:$((18200 + i))" --replay "tcp://*:$((18300 + i))" "${kvt[@]}" \
          >"$OUT/logs/sim-$i.log" 2>&1 &
        PIDS+=($!)
        specs+=(--worker "name=w$i,url=http://127.0.0.1:$((18100 + i)),model=$PRESET,events=tcp://*:$((18200 + i)),replay=tcp://*:$((18300 + i)),role=$role")
        i=$((i + 1))
      done
      for ((j = 0; j < i; j++)); do wait_http "http://127.0.0.1:$((18100 + j))/health" 20; done
      "$KV" serve --listen 127.0.0.1:18080 --admin-listen 127.0.0.1:18081 "${specs[@]}" \
        >"$OUT/logs/kvroute-$layout.log" 2>&1 &
      PIDS+=($!)
      wait_http "http://127.0.0.1:18080/v1/models" 60
      sleep 2
      "$KV" bench --target http://127.0.0.1:18080 --model "$PRESET" --workload "$wl" \
        --rate "$(rate "$wl")" --max-requests "$REQUESTS" --speedup 1 --timeout 120 --quiet --client-clock --block-size "$(align "$PRESET")" \
        --json "$json" | sed -n 2p
      cleanup
      sleep 1
    done
  done
done

python3 - "$OUT" <<'EOF'
import collections, json, pathlib, statistics, sys
runs = collections.defaultdict(list)
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    wl, layout = p.name.split(".")[:2]
    runs[(wl, layout)].append(json.loads(p.read_text())["targets"][0])
print("| workload | layout | runs | reuse % | client TTFT p50 ms | p99 ms | ITL p50 ms | e2e p50 ms | req/s | failed |")
print("|---|---|---|---|---|---|---|---|---|---|")
m = lambda rs, f: statistics.fmean(f(r) for r in rs)
for (wl, layout), rs in sorted(runs.items()):
    print(f"| {wl} | {layout} | {len(rs)} | {100 * m(rs, lambda r: r['reuse']):.1f} | "
          f"{m(rs, lambda r: r['client_ttft_ms']['p50']):.0f} | {m(rs, lambda r: r['client_ttft_ms']['p99']):.0f} | "
          f"{m(rs, lambda r: r['itl_ms']['p50']):.1f} | {m(rs, lambda r: r['e2e_ms']['p50']):.0f} | "
          f"{m(rs, lambda r: r['throughput_rps']):.1f} | {sum(r['failed'] for r in rs)} |")
EOF
