#!/usr/bin/env bash
# experiments.sh BUILD [SPLIT] - the branch's kernel experiments in one device
# call: the GEMM core check (the ping-pong variant now runs NT/NN MMAs
# unserialised), bench_gemm, and the layer on dsv3 and mid with d_h on 128 x
# 256 tiles, on ping-pong tiles, and with its g and u prefetched, then Nsight
# Compute's d_h time for each; with SPLIT (a folder holding bench_gemm and
# bench_gpu built with -DMOKK_TS_SPLIT=1: weight-gradient tiles staged in
# pieces, four stages), those two as well. Prints what to compare; decides
# nothing, but exits 1 if a step failed (the failures are named at the end).
# Building SPLIT here:
#   make -j2 BUILD=build/split STATIC_DEPS=1 'NVFLAGS=-std=c++17 -O3 -lineinfo \
#     --fmad=false -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC,-Wall \
#     -Ikernels -Iclient/include -Iproto -Ikernels/cuda -DMOKK_TS_SPLIT=1' \
#     build/split/bench_gemm build/split/bench_gpu
# and carry BUILD without its obj/ plus SPLIT's two binaries (64 MiB in all).
set -u -o pipefail
B=${1:?usage: experiments.sh BUILD [SPLIT]}
S=${2:-}
export CK_FORK=no
failed=
env CK_RUN_CASE=gemm_core timeout 150 "$B/tests/check_gpu" 2>&1 | tail -8 | cut -c1-300 ||
  failed+=" gemm_core"
for c in vs_cpu determinism; do
  env CK_RUN_CASE=$c timeout 90 "$B/tests/check_gpu" 2>&1 | tail -1 || failed+=" $c"
done
timeout 150 "$B/bench_gemm" 2>&1 | tail -24 || failed+=" bench_gemm"
for v in "" MOKD_GEMM_DH_PINGPONG=1 MOKD_GEMM_DH_PREFETCH=1; do
  echo "== d_h: ${v:-128x256}"
  env $v timeout 120 "$B/bench_gpu" --iters 10 --shapes dsv3,mid 2>&1 | tail -2 ||
    failed+=" bench_gpu${v:+($v)}"
  env $v timeout 120 ncu --clock-control none --kernel-name-base demangled \
    -k 'regex:k_gemm90<.int.1, .int.3' --launch-skip 2 --launch-count 1 \
    --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed \
    "$B/bench_gpu" --iters 1 --shapes dsv3 2>&1 | grep -E "k_gemm90|duration|hmma" ||
    failed+=" ncu${v:+($v)}"
done
if [ -n "$S" ]; then
  echo "== weight gradients staged in pieces (4 stages)"
  # all of these lines: the checks come first, and they are the only check
  # of the split build
  timeout 150 "$S/bench_gemm" 2>&1 | grep -E "^check|^wgrad|^256,256|^384,32|^128,2048" ||
    failed+=" split_bench_gemm"
  timeout 120 "$S/bench_gpu" --iters 10 --shapes dsv3,mok 2>&1 | tail -2 || failed+=" split_bench_gpu"
fi
[ -z "$failed" ] || { echo "== failed:$failed"; exit 1; }
