"""numpy baseline for bench_cpu: the MoE layer's GEMM FLOPs through np.matmul
(fp32, OpenBLAS), expert by expert on a balanced routing, best of N runs.

usage: numpy_matmul.py T H I E K I_s iters
"""
import sys
import time

import numpy as np


def main():
    T, H, I, E, K, Is, iters = (int(a) for a in sys.argv[1:8])
    rng = np.random.default_rng(0)
    rows = T * K // E
    x = rng.standard_normal((rows, H), dtype=np.float32)
    wg = rng.standard_normal((E, I, H), dtype=np.float32)
    wu = rng.standard_normal((E, I, H), dtype=np.float32)
    wd = rng.standard_normal((E, H, I), dtype=np.float32)
    dy = rng.standard_normal((rows, H), dtype=np.float32)

    def fwd():
        for e in range(E):
            g = x @ wg[e].T
            u = x @ wu[e].T
            h = g * u
            _ = h @ wd[e].T

    def bwd():
        for e in range(E):
            h = x @ wg[e].T  # stands in for the saved activations
            dh = dy @ wd[e]
            _ = dh @ wg[e] + dh @ wu[e]
            _ = dh.T @ x
            _ = dh.T @ x
            _ = dy.T @ h

    flops = 6.0 * rows * E * H * I
    best_f = best_b = float("inf")
    for it in range(iters + 1):
        t0 = time.perf_counter()
        fwd()
        t1 = time.perf_counter()
        bwd()
        t2 = time.perf_counter()
        if it:
            best_f = min(best_f, t1 - t0)
            best_b = min(best_b, t2 - t1)
    # the backward baseline also recomputes one GEMM, which is not counted
    print("numpy fp32 forward  %8.2f ms  %7.2f GFLOP/s" % (best_f * 1e3, flops / best_f * 1e-9))
    print("numpy fp32 backward %8.2f ms  %7.2f GFLOP/s" % (best_b * 1e3, 2 * flops / best_b * 1e-9))
    if Is:
        print("(numpy baseline covers the routed experts only)")


if __name__ == "__main__":
    main()
