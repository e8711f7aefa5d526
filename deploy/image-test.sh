#!/usr/bin/env bash
# Builds a kvroute container image from `scratch` with buildah and serves a real request
# through the gateway running from it, in front of a simulated worker on loopback.
#
#   deploy/image-test.sh PATH/TO/kvroute
#
# Why not Containerfile: it starts from the official Rust image and distroless/cc, which need a
# registry; this script needs none. It builds the same layout by hand: the given binary at
# /usr/local/bin/kvroute (debug info stripped when `strip` is present), the shared libraries it
# links (as ldd lists them, at the same paths), /etc/passwd and /etc/group naming the non-root
# user 65532, /etc/kvroute for the mounted configuration and /var/lib/kvroute for the
# snapshot; then the Containerfile's user, ports, entrypoint and command. No CA certificates:
# the engine here speaks plain HTTP (an image for HTTPS engines mounts the `engine_ca_file`, or
# uses the Containerfile's runtime, whose CA store the engines' client trusts too).
#
# Then it starts `kvroute sim-worker` on the host, writes a configuration naming it, mounts
# that at /etc/kvroute, runs the image's own entrypoint and command (read back from the image)
# with `buildah run --isolation chroot`, waits for /health/live and /health/ready, and sends two
# completions with the same prompt: both must answer 200, and the second must be predicted to
# reuse the first's cache (the gateway in the image receives the worker's KV events).
#
# Everything lives in a temporary directory (buildah's storage too, with the vfs driver) that
# is removed at exit, with the processes this script started. Needs buildah, curl, python3.
# Must not: pull anything, or touch buildah's default storage.
set -euo pipefail

bin=${1:?usage: deploy/image-test.sh PATH/TO/kvroute}
bin=$(readlink -f "$bin")
[ -x "$bin" ] || { echo "image-test: $bin is not an executable" >&2; exit 2; }
for tool in buildah curl python3 ldd; do
  command -v "$tool" >/dev/null || { echo "image-test: $tool not found" >&2; exit 2; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/kvroute-image-test.XXXXXX")
bah() { buildah --storage-driver vfs --root "$work/storage" --runroot "$work/run" "$@"; }
sim_pid=""
run_pid=""
# PID and every process below it, deepest first.
tree() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$child"; done
  echo "$1"
}
# Stops a process this script started, with everything below it: `buildah run` does not pass
# SIGTERM on to the container's process, so the processes are signalled themselves (SIGTERM:
# the gateway shuts down gracefully), then killed if still there after 10 s.
stop() {
  local pids i
  pids=$(tree "$1")
  kill -TERM $pids 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
cleanup() {
  # Only the processes started here, by their ids.
  if [ -n "$run_pid" ]; then stop "$run_pid"; fi
  if [ -n "$sim_pid" ]; then stop "$sim_pid"; fi
  bah rm --all >/dev/null 2>&1 || true
  bah rmi --all --force >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT
step() { echo "image-test: $*"; }

# 1. The image's files, staged in a directory.
root="$work/rootfs"
mkdir -p "$root/usr/local/bin" "$root/etc/kvroute" "$root/var/lib/kvroute" "$root/tmp"
if command -v strip >/dev/null; then
  strip --strip-debug -o "$root/usr/local/bin/kvroute" "$bin"
else
  cp "$bin" "$root/usr/local/bin/kvroute"
fi
chmod 0755 "$root/usr/local/bin/kvroute"
# ldd lines: `libm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x…)` or `/lib64/ld-linux-x86-64.so.2 (0x…)`.
libs=$(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u)
for lib in $libs; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
printf 'root:x:0:0:root:/root:/sbin/nologin\nkvroute:x:65532:65532:kvroute:/nonexistent:/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nkvroute:x:65532:\n' >"$root/etc/group"
chown 65532:65532 "$root/var/lib/kvroute"
chmod 1777 "$root/tmp"
step "staged $(echo "$libs" | wc -w) libraries: $(echo $libs)"

# 2. The image, from scratch.
ctr=$(bah from scratch)
mnt=$(bah mount "$ctr")
cp -a "$root/." "$mnt/"
bah umount "$ctr" >/dev/null
bah config --user 65532:65532 --port 8080 --port 8081 \
  --entrypoint '["/usr/local/bin/kvroute"]' \
  --cmd 'serve --config /etc/kvroute/kvroute.toml' \
  --env RUST_LOG=info --workingdir / "$ctr"
bah commit --quiet "$ctr" localhost/kvroute-image-test >/dev/null
bah rm "$ctr" >/dev/null
bah inspect --type image localhost/kvroute-image-test >"$work/image.json"
oci() { python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["OCIv1"]["config"].get(sys.argv[2])))' "$work/image.json" "$1"; }
entrypoint=$(oci Entrypoint)
cmd=$(oci Cmd)
user=$(oci User | tr -d '"')
step "image built: user $user, entrypoint $entrypoint, cmd $cmd"
[ "$user" = "65532:65532" ] || { echo "image-test: the image runs as $user, not 65532" >&2; exit 1; }

# 3. A simulated worker on the host, on ephemeral loopback ports.
"$bin" sim-worker --preset tiny-gemma3 --http 127.0.0.1:0 \
  --zmq 'tcp://127.0.0.1:0' --replay 'tcp://127.0.0.1:0' >"$work/sim.out" 2>"$work/sim.log" &
sim_pid=$!
# `kvroute sim-worker tiny-gemma3: http http://127.0.0.1:P zmq ["tcp://127.0.0.1:E"] replay ["tcp://127.0.0.1:R"]`
wait_line() { # FILE PATTERN SECONDS
  local i
  for ((i = 0; i < $3 * 10; i++)); do
    grep -m1 "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "image-test: no line matching '$2' in $1 after $3 s:" >&2
  cat "$1" >&2
  return 1
}
sim_line=$(wait_line "$work/sim.log" 'kvroute sim-worker' 20)
sim_url=$(sed -E 's/.* http (http:[^ ]+) zmq.*/\1/' <<<"$sim_line")
ports=($(grep -oE 'tcp://127\.0\.0\.1:[0-9]+' <<<"$sim_line" | sed 's/.*://'))
[ "${#ports[@]}" -eq 2 ] || { echo "image-test: unexpected sim-worker line: $sim_line" >&2; exit 1; }
step "simulated worker at $sim_url, events on ${ports[0]}, replay on ${ports[1]}"

# 4. The configuration the image reads from its mounted /etc/kvroute.
mkdir -p "$work/config"
cat >"$work/config/kvroute.toml" <<EOF
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
explain_always = true
snapshot_path = "/var/lib/kvroute/index.snapshot"

[[workers]]
name = "sim-0"
url = "$sim_url"
model = "tiny-gemma3"
[workers.kv_events]
endpoint = "tcp://*:${ports[0]}"
replay_endpoint = "tcp://*:${ports[1]}"
EOF
chmod 0644 "$work/config/kvroute.toml"

# 5. The gateway, from the image, with its own entrypoint and command.
run_ctr=$(bah from --pull=never localhost/kvroute-image-test)
mapfile -t argv < <(python3 -c 'import json,sys; [print(a) for a in json.loads(sys.argv[1]) + json.loads(sys.argv[2])]' "$entrypoint" "$cmd")
bah run --isolation chroot --volume "$work/config:/etc/kvroute:ro" "$run_ctr" -- "${argv[@]}" \
  >"$work/gateway.out" 2>"$work/gateway.log" &
run_pid=$!
gw_line=$(wait_line "$work/gateway.log" 'kvroute listening on http://' 30)
front=$(sed -E 's/.*listening on http:\/\/([^ ]+) .*/\1/' <<<"$gw_line")
step "gateway from the image listening on $front"
# The process serving the port runs as the image's user.
if command -v ss >/dev/null; then
  gw_pid=$(ss -ltnpH "sport = :${front##*:}" | grep -oE 'pid=[0-9]+' | head -1 | cut -d= -f2)
  if [ -n "$gw_pid" ]; then
    uid=$(awk '/^Uid:/ { print $2 }' "/proc/$gw_pid/status")
    [ "$uid" = 65532 ] || { echo "image-test: the gateway runs as uid $uid" >&2; exit 1; }
    step "gateway process $gw_pid runs as uid $uid"
  fi
fi

status() { curl -s -o /dev/null -w '%{http_code}' "$@" || true; }
for probe in live ready; do
  for ((i = 0; i < 150; i++)); do
    [ "$(status "http://$front/health/$probe")" = 200 ] && break
    sleep 0.1
  done
  [ "$(status "http://$front/health/$probe")" = 200 ] || {
    echo "image-test: /health/$probe never answered 200" >&2; cat "$work/gateway.log" >&2; exit 1; }
  step "/health/$probe answers 200"
done

# 6. Two completions with the same prompt: the second is predicted to reuse the first's blocks.
prompt=$(python3 -c 'print(list(range(3, 131)))')
complete() { # N
  curl -s -D "$work/headers.$1" -o "$work/body.$1" -w '%{http_code}' \
    -H 'content-type: application/json' \
    -d "{\"model\": \"tiny-gemma3\", \"prompt\": $prompt, \"max_tokens\": 4}" \
    "http://$front/v1/completions"
}
code=$(complete 1)
[ "$code" = 200 ] || { echo "image-test: completion answered $code" >&2; cat "$work/body.1" >&2; exit 1; }
python3 - "$work/body.1" <<'PY'
import json, sys
body = json.load(open(sys.argv[1]))
assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
print("image-test: completion 1 answered 200 with", body["usage"]["completion_tokens"], "tokens")
PY
predicted=0
for ((i = 0; i < 50; i++)); do
  code=$(complete 2)
  [ "$code" = 200 ] || { echo "image-test: completion answered $code" >&2; cat "$work/body.2" >&2; exit 1; }
  predicted=$(python3 - "$work/headers.2" <<'PY'
import json, sys
for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
    name, _, value = line.partition(":")
    if name.strip().lower() == "x-kvroute-decision":
        print(json.loads(value.strip()).get("predicted_cached", 0))
        break
else:
    print(0)
PY
)
  [ "$predicted" -gt 0 ] && break
  sleep 0.1
done
[ "$predicted" -gt 0 ] || { echo "image-test: the repeated prompt was never predicted cached" >&2; cat "$work/gateway.log" >&2; exit 1; }
step "completion 2 answered 200, predicted to reuse $predicted cached tokens"
echo "image-test: passed"
