#!/usr/bin/env bash
# make demo: start mokd on a temporary socket with the default backend, run the
# demo client through it, stop the daemon with SIGTERM and require exit 0.
set -euo pipefail
build=${1:-build}
dir=$(mktemp -d)
sock=$dir/mokd.sock
"$build/mokd" --socket "$sock" --config /dev/null 2>"$dir/mokd.log" &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
for _ in $(seq 100); do
  [ -S "$sock" ] && break
  kill -0 "$pid" 2>/dev/null || { cat "$dir/mokd.log" >&2; exit 1; }
  sleep 0.05
done
"$build/mokctl" --socket "$sock" ping
status=0
"$build/mok_demo" "$sock" || status=$?
kill -TERM "$pid"
wait "$pid" || { echo "demo: mokd exited with $?" >&2; cat "$dir/mokd.log" >&2; exit 1; }
echo "demo: mokd stopped cleanly"
exit "$status"
