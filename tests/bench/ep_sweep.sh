#!/usr/bin/env bash
# ep_sweep.sh BUILD [BACKEND] [-- mokctl bench options] - EP step time against
# the group's size: starts a mokd on BACKEND (cpu by default), runs `mokctl
# bench --ep P` for P = 1, 2, 4, 8 (those that divide E) with the same
# per-rank shape, and prints one CSV line a P: ranks, forward and backward
# p50 ms of the group's steps, and GFLOP/s of all ranks.
set -euo pipefail
B=${1:?usage: ep_sweep.sh BUILD [BACKEND] [-- bench options]}
backend=${2:-cpu}
shift $(( $# >= 2 ? 2 : 1 ))
[ "${1:-}" = "--" ] && shift
opts=("$@")
[ ${#opts[@]} -gt 0 ] || opts=(--T 256 --H 512 --I 256 --E 16 --K 4 --shared 256 --iters 10)
sock=$(mktemp -u /tmp/mokd-ep-XXXXXX.sock)
"$B/mokd" --backend "$backend" --socket "$sock" --config /dev/null > "$sock.log" 2>&1 &
mokd=$!
trap 'kill -TERM $mokd 2>/dev/null; wait $mokd 2>/dev/null; rm -f "$sock.log"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
echo "ranks,fwd_p50_ms,bwd_p50_ms,fwd_gflops,bwd_gflops"
for P in 1 2 4 8; do
  out=$("$B/mokctl" --socket "$sock" bench "${opts[@]}" --ep "$P" 2>&1) || {
    echo "ep_sweep: P = $P: $out" >&2
    continue
  }
  awk -v P="$P" '/^forward/ {f = $4; fg = $(NF - 3)} /^backward/ {b = $4; bg = $(NF - 3)}
    END {print P "," f "," b "," fg "," bg}' <<< "$out"
done
