"""PyTorch expert-parallel baseline for the EP benchmark: one process per GPU
(torchrun), each rank holding E/P experts and T tokens, the (token, k) pairs
sent to the rank of their expert with all_to_all_single, grouped GEMMs there
(torch._grouped_mm), and the expert outputs sent back and combined over k
with the routing weights. Forward and backward (autograd through both
exchanges) are timed with CUDA events; a step's time is the slowest rank's.
Also the exchange alone: one all_to_all_single of the dispatch's size, for
the NVLink bandwidth it reaches.

    torchrun --nproc-per-node P tests/bench/torch_ep.py --shape dsv3 [--csv F]

The shape names are torch_moe.py's, with T read as tokens per rank (dsv3:
8192 tokens a rank, E = 256 over P). Rank 0 prints one line and, with --csv,
appends `P,shape,T_per_rank,fwd_ms,bwd_ms,fwd_tflops_per_gpu,
bwd_tflops_per_gpu,a2a_ms,a2a_gbps`. Routing is uniform at random (seeded by
rank), so each rank sends about (P - 1) / P of its pairs away.
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

from torch_moe import SHAPES


def exchange(x, send, recv, group):
    """Rows of x to the ranks (send[r] rows to rank r, in order); returns the
    rows received (recv[r] from rank r), with autograd."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    return all_to_all_single(out, x, recv, send, group=group)


def ep_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared, E, group):
    """This rank's out [T, H]: x [T, H] bf16, topk_ids [T, K] global expert
    ids, topk_weights [T, K] fp32; w_* this rank's E / P experts."""
    P, T, K = dist.get_world_size(group), x.shape[0], topk_ids.shape[1]
    El = E // P
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)      # pairs by expert, so by rank
    dest = flat[order] // El
    send = torch.bincount(dest, minlength=P)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_l, recv_l = send.tolist(), recv.tolist()  # the host needs the splits
    xs = x.index_select(0, order // K)
    local = (flat[order] % El).to(torch.int32)
    xr = exchange(xs, send_l, recv_l, group)       # rows for this rank's experts
    lr = torch.empty(sum(recv_l), dtype=torch.int32, device=x.device)
    dist.all_to_all_single(lr, local, recv_l, send_l, group=group)  # their local experts
    lr = lr.long()
    # group the received rows by local expert (they come by source rank)
    by = torch.argsort(lr, stable=True)
    offs = torch.cumsum(torch.bincount(lr, minlength=El), 0).to(torch.int32)
    xg = xr.index_select(0, by)
    g = torch._grouped_mm(xg, w_gate.transpose(1, 2), offs=offs)
    u = torch._grouped_mm(xg, w_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(F.silu(g) * u, w_down.transpose(1, 2), offs=offs)
    inv = torch.empty_like(by)
    inv[by] = torch.arange(by.numel(), device=by.device)
    yb = exchange(y.index_select(0, inv), recv_l, send_l, group)  # back, in send order
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    yk = yb.index_select(0, back).view(T, K, -1)
    out = (yk.float() * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
    if shared is not None:
        s_gate, s_up, s_down = shared
        out = out + F.linear(F.silu(F.linear(x, s_gate)) * F.linear(x, s_up), s_down)
    return out


def time_ms(fn, warmup, iters):
    """Median ms of fn(start, end) over iters, after warmup calls."""
    for _ in range(warmup):
        fn(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn(s, e)
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def slowest(ms, group):
    t = torch.tensor([ms], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="dsv3", help="one of: " + ", ".join(SHAPES))
    ap.add_argument("--tokens", type=int, default=0, help="tokens per rank (default: the "
                    "shape's T)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", help="append a line to this file (rank 0)")
    a = ap.parse_args()
    if a.shape not in SHAPES:
        ap.error("unknown shape %s; known: %s" % (a.shape, ", ".join(SHAPES)))
    if a.iters < 1 or a.warmup < 0 or a.tokens < 0:
        ap.error("--iters must be >= 1, --warmup and --tokens >= 0")
    if "RANK" not in os.environ:
        ap.error("run it under torchrun (torchrun --nproc-per-node P %s ...)" % sys.argv[0])
    if not torch.cuda.is_available():
        print("torch_ep: CUDA is not available, skipping", file=sys.stderr)
        sys.exit(77)
    T0, H, I, E, K, shared = SHAPES[a.shape]
    T = a.tokens or T0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group, P, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    if E % P:
        ap.error("E = %d experts do not divide over %d ranks" % (E, P))
    El, bf16 = E // P, torch.bfloat16
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1000 + r)

    def param(*shape):
        t = torch.randn(*shape, generator=gen, device="cuda", dtype=bf16)
        return t.mul_(shape[-1] ** -0.5).requires_grad_()

    x = torch.randn(T, H, generator=gen, device="cuda", dtype=bf16).requires_grad_()
    ids = torch.rand(T, E, generator=gen, device="cuda").topk(K, dim=1).indices
    tw = torch.softmax(torch.randn(T, K, generator=gen, device="cuda"), -1).requires_grad_()
    w = [param(El, I, H), param(El, I, H), param(El, H, I)]
    sh = (param(I, H), param(I, H), param(H, I)) if shared else None
    d_out = torch.randn(T, H, generator=gen, device="cuda", dtype=bf16)
    leaves = [x, tw] + w + (list(sh) if sh else [])

    def run():
        return ep_moe(x, ids, tw, w[0], w[1], w[2], sh, E, group)

    def fwd(s, e):
        s.record()
        out = run()
        e.record()
        del out

    def bwd(s, e):
        for p in leaves:
            p.grad = None
        out = run()
        s.record()
        out.backward(d_out)
        e.record()

    fwd_ms = slowest(time_ms(fwd, a.warmup, a.iters), group)
    bwd_ms = slowest(time_ms(bwd, a.warmup, a.iters), group)
    # the exchange alone: every rank sends T K / P rows to each rank
    rows = T * K // P * P
    buf = torch.empty(rows, H, device="cuda", dtype=bf16)
    got = torch.empty_like(buf)

    def a2a(s, e):
        s.record()
        dist.all_to_all_single(got, buf, group=group)
        e.record()

    a2a_ms = slowest(time_ms(a2a, a.warmup, a.iters), group)
    away = rows * H * 2 * (P - 1) / P  # bytes a rank sends to other GPUs
    flops = 6 * T * K * H * I + (6 * T * H * I if shared else 0)  # a rank's forward
    if r == 0:
        line = "%d,%s,%d,%.3f,%.3f,%.1f,%.1f,%.3f,%.1f" % (
            P, a.shape, T, fwd_ms, bwd_ms, flops / fwd_ms / 1e9, 2 * flops / bwd_ms / 1e9,
            a2a_ms, away / a2a_ms / 1e6)
        print("torch_ep P=%d %s T/rank=%d E=%d (E/P=%d) K=%d: fwd %.3f ms, bwd %.3f ms, "
              "%.1f / %.1f TFLOP/s per GPU; all_to_all of %d rows: %.3f ms, %.1f GB/s away"
              % (P, a.shape, T, E, El, K, fwd_ms, bwd_ms, flops / fwd_ms / 1e9,
                 2 * flops / bwd_ms / 1e9, rows, a2a_ms, away / a2a_ms / 1e6), flush=True)
        if a.csv:
            with open(a.csv, "a") as f:
                f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
