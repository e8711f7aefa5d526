#!/usr/bin/env bash
# Runs the README's test command (CI=true bash .ci/run) N times in a row and prints one line a
# run (start, seconds, exit code, tests passed and failed); with --busy, two busy loops (one per
# core on a 2-core machine) run beside it. Each run's whole log goes to DIR (default
# target/suite-runs). docs/reliability.md ("The whole suite, run after run") records its results.
#
#   bash tools/suite-runs.sh 10
#   bash tools/suite-runs.sh 3 --busy
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-10}
busy=false
[ "${2:-}" = "--busy" ] && busy=true
dir=${DIR:-target/suite-runs}
mkdir -p "$dir"
loops=()
if $busy; then
  for _ in 1 2; do ( while :; do :; done ) & loops+=($!); done
  trap 'kill "${loops[@]}" 2>/dev/null' EXIT
fi
for i in $(seq 1 "$n"); do
  start=$(date -u +%H:%M:%S)
  s=$(date +%s)
  log="$dir/run-$i.log"
  CI=true bash .ci/run >"$log" 2>&1
  rc=$?
  sum() { grep -o "[0-9]* $1" "$log" | awk '{s+=$1} END {print s+0}'; }
  echo "run $i: start $start UTC, $(($(date +%s) - s)) s, rc $rc, passed $(sum passed), failed $(sum failed), commit $(git rev-parse --short HEAD)"
done
