#!/usr/bin/env bash
# kvroute at one replica against three, with and without the booking channel between them
# ([peers]), on simulated fleets in real time, runs alternating, repeated.
#
#   bash bench/replicas.sh                       # the default cells, 2 repeats
#   bash bench/replicas.sh --cells tenants:qwen3-next:120:4 --repeat 3
#   bash bench/replicas.sh --settings defaults,peers,bookings   # a subset of the settings
#
# A cell is WORKLOAD:PRESET:BLOCKS:RATE (4 workers). Settings: one replica (r1.defaults), three
# peered replicas sharing bookings and what they learn (r3.peers, the default `[peers]`), three
# sharing only their bookings (r3.bookings, `learning = false`), three isolated ones
# (r3.isolated), and, as a control, one replica again (r1.again: what the noise rule calls
# ahead or behind when nothing differs), each on a fresh in-process
# fleet (`kvroute bench --target kvroute:hybrid-aware --replicas N`, round robin per request).
# Results: one JSON per run under $OUT and `bench/terms.py --summary`'s table (mean and range of
# reuse and TTFT mean, p50, p99 per setting). Not part of the test command.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/out/replicas-$(date +%Y%m%d-%H%M)
REPEAT=2
REQUESTS=300
ONLY=",defaults,peers,bookings,isolated,"
CELLS="multi-turn:qwen3-next:120:8 agentic:qwen3-next:120:2.3 tenants:qwen3-next:120:4"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --cells) CELLS=${2//,/ }; shift 2 ;;
    --settings) ONLY=",$2,"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
if [ -z "${KVROUTE_BIN:-}" ]; then cargo build --release --locked -p kvroute; fi
KV=${KVROUTE_BIN:-target/release/kvroute}
align() { case "$1" in qwen3-next) echo 544 ;; *) echo 16 ;; esac; }

settings=()
for s in "1 defaults true true" "3 peers true true" "3 bookings true false" "3 isolated false false" \
  "1 again true true"; do
  read -r _ name _ _ <<<"$s"
  case "$ONLY" in *",$name,"*) settings+=("$s") ;; esac
done
n_settings=${#settings[@]}
for rep in $(seq 1 "$REPEAT"); do
  for cell in $CELLS; do
    IFS=: read -r wl preset blocks rate <<<"$cell"
    for ((i = 0; i < n_settings; i++)); do
      read -r n name peers learning <<<"${settings[$(((i + rep - 1) % n_settings))]}"
      json="$OUT/$wl.$preset.$blocks.$rate.r$n.$name.$rep.json"
      echo "== $cell ×$n $name (run $rep)"
      "$KV" bench --target kvroute:hybrid-aware --fleet "$preset,4,$blocks" --workload "$wl" \
        --rate "$rate" --max-requests "$REQUESTS" --block-size "$(align "$preset")" \
        --replicas "$n" --replica-peers "$peers" --replica-learning "$learning" --quiet --json "$json" | sed -n 2p
    done
  done
done
python3 bench/terms.py --summary "$OUT"
