#!/usr/bin/env bash
# The fuzz campaign: every cargo-fuzz target of kvroute for SECONDS each (default 600), one
# after another on one core, seeded from the committed corpora (fuzz/corpora: the minimized
# corpora of earlier campaigns; recorded frames, seeds), then a summary line per target:
# CPU seconds the fuzzer used (it may share the core), executions, coverage (libFuzzer's `cov`
# and `ft`) and findings (crash files). FUZZ_NICE=N runs it at that niceness. FUZZ_CLOCK=cpu
# makes SECONDS the fuzzer's own CPU seconds instead of wall seconds (for runs beside other work:
# the fuzzer is interrupted, and prints its final stats, once it has used that much CPU).
# FUZZ_TIMEOUT=S is libFuzzer's per-input limit in wall seconds (default 10); a fuzzer at a low
# priority beside busy work needs more, or a starved input is reported as a timeout.
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`). See docs/reliability.md.
#   bench/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
shift || true
wire=(decode_batch decode_frames)
root=(index_vs_reference request_parse snapshot_parse config_toml chat_template)
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${wire[@]}" "${root[@]}")
out=${FUZZ_OUT:-target/fuzz-campaign}
mkdir -p "$out"

dir_of() { case " ${wire[*]} " in *" $1 "*) echo crates/kvroute-wire/fuzz ;; *) echo fuzz ;; esac; }

seed() {
  local t=$1 d=$2
  mkdir -p "$d/corpus/$t"
  # The committed minimized corpus of earlier campaigns (fuzz/corpora/TARGET), then the seeds.
  if [ -d "fuzz/corpora/$t" ]; then cp -n fuzz/corpora/"$t"/* "$d/corpus/$t/" 2>/dev/null || true; fi
  case $t in
    decode_batch)
      # The msgpack payloads of every committed frame capture (third frame, base64).
      python3 - "$d/corpus/$t" <<'PY'
import base64, glob, hashlib, json, os, sys
out = sys.argv[1]
for f in glob.glob("crates/kvroute-wire/tests/data/*/frames.jsonl") + glob.glob("conformance/corpus/*/frames.jsonl"):
    for line in open(f):
        try:
            fr = json.loads(line).get("frames") or []
            raw = base64.b64decode(fr[2]) if len(fr) > 2 else None
        except Exception:
            continue
        if raw:
            open(os.path.join(out, hashlib.sha1(raw).hexdigest()), "wb").write(raw)
PY
      ;;
    request_parse)
      for b in '{"model":"m","prompt":[1,2,3],"max_tokens":4}' \
               '{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}' \
               '{"model":"lora-a","prompt":"text","n":1,"temperature":0.5,"stop":["x"]}'; do
        printf '%s' "$b" > "$d/corpus/$t/$(printf '%s' "$b" | sha1sum | cut -c1-16)"
      done ;;
    config_toml)
      printf 'listen = "127.0.0.1:8080"\n[[workers]]\nname = "w0"\nurl = "http://127.0.0.1:8000"\nmodel = "m"\n[workers.kv_events]\nendpoint = "tcp://*:5557"\n' > "$d/corpus/$t/basic.toml" ;;
    snapshot_parse)
      cp fuzz/seeds/snapshot.toml "$d/corpus/$t/" ;;
    chat_template)
      cp fuzz/seeds/chat_template/* "$d/corpus/$t/" ;;
  esac
}

# Interrupt target T's fuzzer (SIGINT: libFuzzer prints its final stats) once its process has
# used SECS CPU seconds, or return when the run under PID ends first.
stop_at_cpu() {
  local t=$1 secs=$2 run=$3 pid used
  while kill -0 "$run" 2>/dev/null; do
    sleep 5
    pid=$(pgrep -f "release/$t .*-max_total_time" | head -1 || true)
    [ -n "$pid" ] || continue
    used=$(ps -o cputimes= -p "$pid" 2>/dev/null | tr -d ' ' || true)
    if [ -n "$used" ] && [ "$used" -ge "$secs" ]; then kill -INT "$pid" 2>/dev/null || true; fi
  done
}

printf '%-20s %8s %8s %12s %8s %8s %8s %8s\n' target seconds cpu_s execs exec/s cov ft findings
for t in "${targets[@]}"; do
  d=$(dir_of "$t")
  seed "$t" "$d"
  log="$out/$t.log"
  if ! (cd "$d" && nice -n "${FUZZ_NICE:-0}" cargo +nightly fuzz build "$t") >"$log.build" 2>&1; then
    printf '%-20s build failed: %s\n' "$t" "$log.build"
    continue
  fi
  TIMEFORMAT='%U %S'
  # CPU seconds (user + system) of the fuzzer and its children. libFuzzer's clocks are wall
  # clocks: never pause a run (SIGSTOP) — its per-input timeout would fire on resume.
  wall=$secs
  [ "${FUZZ_CLOCK:-wall}" = cpu ] && wall=$((secs * 50))
  cpu=$( { time ( (cd "$d" && nice -n "${FUZZ_NICE:-0}" cargo +nightly fuzz run "$t" -- \
      -max_total_time="$wall" -max_len=65536 -timeout="${FUZZ_TIMEOUT:-10}" -print_final_stats=1) >"$log" 2>&1 &
      [ "${FUZZ_CLOCK:-wall}" = cpu ] && stop_at_cpu "$t" "$secs" "$!"
      wait || true ); } 2>&1 | awk '{printf "%d", $1 + $2}')
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || true)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || true)
  found=$(ls "$d/artifacts/$t" 2>/dev/null | grep -c -E '^(crash|oom|timeout|leak)-' || true)
  printf '%-20s %8s %8s %12s %8s %8s %8s %8s\n' "$t" "$secs" "${cpu:-?}" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "${found:-0}"
done
