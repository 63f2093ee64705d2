#!/usr/bin/env bash
# device_run.sh - one full pass on a GPU machine over an existing build:
# the GEMM core check, gpu-check (C suites and the PyTorch client), the dense
# GEMM benchmark, the layer benchmark next to PyTorch (in-process and through
# a mokd started here), and optionally an Nsight Compute profile of one shape.
# Logs and the CSV go to LOGDIR. Built elsewhere with
# `make BUILD=build/dev STATIC_DEPS=1`; the GPU machine lacks the packages.
#
# usage: tests/gpu/device_run.sh BUILD LOGDIR [--no-bench] [--no-checks] [--profile SHAPE]
#                                 [--archive FILE]
# (--no-checks: the GEMM core check and the benchmarks only, for a short lease;
# --archive: all of LOGDIR also as one .tgz, for a device tool that returns
# only a few files)
set -u -o pipefail
B=${1:?usage: device_run.sh BUILD LOGDIR [--no-bench] [--profile SHAPE]}
L=${2:?usage: device_run.sh BUILD LOGDIR [--no-bench] [--profile SHAPE]}
shift 2
bench=1 checks=1 profile='' archive=''
while [ $# -gt 0 ]; do
  case $1 in
    --no-bench) bench=0 ;;
    --no-checks) checks=0 ;;
    --profile) profile=${2:?--profile wants a shape}; shift ;;
    --archive) archive=${2:?--archive wants a file}; shift ;;
    *) echo "device_run.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$L"
export CK_FORK=no MOKD_BIN=$B/mokd PYTHONUNBUFFERED=1
status=0

step() { # name timeout command...
  local name=$1 t=$2; shift 2
  echo "== $name: $*"
  timeout "$t" "$@" > "$L/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$L/$name.log"
  [ $rc -eq 0 ] || { echo "== $name failed (rc $rc)"; status=1; }
  return $rc
}

nvidia-smi -L
step core 120 env CK_RUN_CASE=gemm_core "$B/tests/check_gpu"
if [ $checks -eq 1 ]; then
  # one test case at a time, so a hang costs one timeout and names its case
  for c in vs_cpu determinism errors daemon identity; do
    step "gpu_check_$c" 90 env CK_RUN_CASE=$c "$B/tests/check_gpu"
  done
  step gpu_check_ep_cuda 300 env CK_RUN_CASE=ep_cuda "$B/tests/check_gpu"
  # libmok.so needs libprotobuf-c.so.1, which the GPU machine lacks: put a copy
  # in the build folder (cp /usr/lib/x86_64-linux-gnu/libprotobuf-c.so.1 $B/)
  step pytest 420 env MOK_LIB="$B/libmok.so" LD_LIBRARY_PATH="$B" PYTHONPATH=client/python \
    python3 -m pytest -q -s tests/python/test_torch.py
fi
if [ $bench -eq 1 ]; then
  step bench_gemm 120 "$B/bench_gemm" --torch "python3 tests/bench/torch_matmul.py"
  sock=$(mktemp -u /tmp/mokd-bench-XXXXXX.sock)
  "$B/mokd" --backend cuda --socket "$sock" --config /dev/null > "$L/mokd.log" 2>&1 &
  mokd=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  step bench_gpu 300 "$B/bench_gpu" --iters 20 --verify --daemon "$sock" \
    --torch "python3 tests/bench/torch_moe.py --steps" \
    --ceiling "python3 tests/bench/torch_matmul.py" --csv "$L/bench_gpu.csv"
  kill -TERM $mokd; wait $mokd
  python3 tests/bench/plot_bench.py "$L/bench_gpu.csv" "$L/bench_gpu.png"
fi
if [ -n "$profile" ]; then
  # the second step of the shape (the first warms up), every kernel of it
  step ncu 150 ncu --clock-control none --launch-skip 20 --launch-count 20 \
    -k 'regex:k_gemm|k_gather|k_combine|k_dtw|k_count|k_slots|k_scan' \
    --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    --csv "$B/bench_gpu" --shapes "$profile" --iters 1
  python3 - "$L/ncu.log" <<'PY'
import csv, collections, sys
lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
k = collections.OrderedDict()
for r in csv.DictReader(lines):
    k.setdefault((r["ID"], r["Kernel Name"][:48]), {})[r["Metric Name"]] = r["Metric Value"]
    if r["Metric Name"] == "gpu__time_duration.sum":
        k[(r["ID"], r["Kernel Name"][:48])]["unit"] = r["Metric Unit"]
for (i, n), m in k.items():
    print(f"{i:>3} {n:<48} {m.get('gpu__time_duration.sum', ''):>10} {m.get('unit', '')}"
          f"  DRAM {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', ''):>6}%"
          f"  TC {m.get('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed', ''):>6}%")
PY
fi
if [ -n "$archive" ]; then
  tar czf "$archive" -C "$(dirname "$L")" "$(basename "$L")" || status=1
fi
exit $status
