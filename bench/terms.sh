#!/usr/bin/env bash
# The cost-term A/B: every term of the hybrid-aware cost switched alone from its default (a
# default-on term off, a default-off one on), against the defaults, on simulated fleets in real
# time, same hour, runs alternating, repeated.
#
#   bash bench/terms.sh                                  # every term, the default cells, 3 repeats
#   bash bench/terms.sh --terms later-turns,junction --repeat 5
#   bash bench/terms.sh --cells multi-turn:qwen3-next:120:8 --replicas 3
#
# A cell is WORKLOAD:PRESET:BLOCKS:RATE (blocks per worker, sessions per second; 4 workers). Each
# repeat runs every cell's settings (the defaults, then each term switched) in an order rotated by
# the repeat, each on a fresh in-process fleet (`kvroute bench --target kvroute:hybrid-aware`).
# Results: one JSON per run under $OUT (default bench/out/terms-DATE), and bench/terms.py's
# table (term → cells → effect with its noise). Not part of the test command: it takes about a
# minute per run.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=bench/out/terms-$(date +%Y%m%d-%H%M)
REPEAT=3
REQUESTS=300
REPLICAS=1
# Default on: later-turns prefill-stall queue-drain in-flight-forecast.
# Default off: decode-interference delay-to-others junction.
TERMS="later-turns decode-interference prefill-stall queue-drain in-flight-forecast delay-to-others junction"
# Three built-in workloads and the tenants one on the hybrid preset's tight pool at the high
# load of bench/peers.sh, and llama's eviction-heavy pool on multi-turn. Mooncake at that load
# overloads the in-process fleet (docs/routing.md, "The default-on cost terms, A/B").
CELLS="shared-prefix:qwen3-next:120:30 multi-turn:qwen3-next:120:8 agentic:qwen3-next:120:2.3 tenants:qwen3-next:120:4 multi-turn:llama:1200:8"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --repeat) REPEAT=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --replicas) REPLICAS=$2; shift 2 ;;
    --terms) TERMS=${2//,/ }; shift 2 ;;
    --cells) CELLS=${2//,/ }; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
if [ -z "${KVROUTE_BIN:-}" ]; then cargo build --release --locked -p kvroute; fi
KV=${KVROUTE_BIN:-target/release/kvroute}

# The setting that switches one term from its default, and the flag for it: a default-on
# term's setting is its name (the term off), a default-off term's is NAME-on (bench/terms.py
# reads the direction from the name).
setting_of() {
  case "$1" in
    later-turns | prefill-stall | queue-drain | in-flight-forecast) echo "$1" ;;
    decode-interference | delay-to-others | junction) echo "$1-on" ;;
    *) echo "unknown term $1" >&2; exit 2 ;;
  esac
}
flag_of() {
  case "$1" in
    later-turns) echo "--later-turns false" ;;
    decode-interference-on) echo "--decode-interference true" ;;
    prefill-stall) echo "--prefill-stall off" ;;
    queue-drain) echo "--queue-drain false" ;;
    in-flight-forecast) echo "--in-flight-forecast false" ;;
    delay-to-others-on) echo "--delay-to-others true" ;;
    junction-on) echo "--junction-weight 1" ;;
  esac
}
align() { case "$1" in qwen3-next) echo 544 ;; *) echo 16 ;; esac; }

settings=(defaults)
for t in $TERMS; do settings+=("$(setting_of "$t")"); done
n=${#settings[@]}
for rep in $(seq 1 "$REPEAT"); do
  for cell in $CELLS; do
    IFS=: read -r wl preset blocks rate <<<"$cell"
    for ((i = 0; i < n; i++)); do
      s=${settings[$(((i + rep - 1) % n))]}
      flags=""
      [ "$s" = defaults ] || flags=$(flag_of "$s")
      json="$OUT/$wl.$preset.$blocks.$rate.r$REPLICAS.$s.$rep.json"
      echo "== $cell $s (run $rep)"
      # shellcheck disable=SC2086 # flags: one term's switch, word-split on purpose
      "$KV" bench --target kvroute:hybrid-aware --fleet "$preset,4,$blocks" --workload "$wl" \
        --rate "$rate" --max-requests "$REQUESTS" --block-size "$(align "$preset")" \
        --replicas "$REPLICAS" --quiet --json "$json" $flags | sed -n 2p
    done
  done
done
python3 bench/terms.py "$OUT"
