"""Dense bf16 matmul baseline for bench_gemm: C = A @ B^T with torch.matmul,
timed with CUDA events (median of --iters after --warmup).

usage: torch_matmul.py M,N,K [M,N,K ...] [--iters N] [--warmup N]
Prints one line per shape: "torch_matmul M=.. N=.. K=.. ms=.. tflops=..".
"""
import argparse
import statistics
import sys

import torch


def time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="+", help="M,N,K")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_matmul: CUDA is not available, skipping", file=sys.stderr)
        sys.exit(77)
    torch.manual_seed(0)
    for spec in a.shapes:
        try:
            M, N, K = (int(v) for v in spec.split(","))
        except ValueError:
            ap.error(f"bad shape {spec!r}: want M,N,K")
        A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        B = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: torch.matmul(A, B.t()), a.warmup, a.iters)
        print(f"torch_matmul M={M} N={N} K={K} ms={ms:.4f} "
              f"tflops={2.0 * M * N * K / ms / 1e9:.1f}", flush=True)
        del A, B
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
