"""PyTorch baseline for the MoE benchmark: a BF16 MoE layer built from
torch._grouped_mm, forward and backward timed separately with CUDA events,
and the peak memory of one training step (torch.cuda.max_memory_allocated).

Routing: the (token, k) pairs are sorted by expert id (argsort), gathered,
run through grouped gate/up GEMMs, SwiGLU, a grouped down GEMM, then
unpermuted and combined over k with the routing weights. Shapes marked
shared add a dense SwiGLU expert with I_s = I.

usage: torch_moe.py [--shapes dsv3,mid,...] [--iters N] [--warmup N] [--steps]
                    [--fwd-only]
"""
import argparse
import gc
import statistics
import sys

import torch
import torch.nn.functional as F

# name: (T, H, I, E, K, shared)
SHAPES = {
    "dsv3": (8192, 7168, 2048, 256, 8, True),
    "mid": (16384, 4096, 1536, 64, 8, False),
    "qwen3_4k": (4096, 2048, 768, 128, 8, False),
    "qwen3_32k": (32768, 2048, 768, 128, 8, False),
    "mok": (2048, 7168, 3072, 384, 6, True),
}

SEED = 0


def reference_moe(x, topk_ids, topk_weights, w_gate, w_up, w_down, shared=None):
    """MoE layer forward.

    x: [T, H] bf16; topk_ids: [T, K] int; topk_weights: [T, K] fp32;
    w_gate, w_up: [E, I, H] bf16; w_down: [E, H, I] bf16;
    shared: None or (s_gate [I_s, H], s_up [I_s, H], s_down [H, I_s]).
    Returns out: [T, H] bf16.
    """
    T, H = x.shape
    K = topk_ids.shape[1]
    E = w_gate.shape[0]

    # Permute: sort the T*K (token, k) pairs by expert id.
    flat_ids = topk_ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)  # row end of each expert
    xp = x.index_select(0, order // K)  # [T*K, H], grouped by expert

    # Grouped GEMMs. b operands are [E, k, n] views of the nn.Linear weights.
    g = torch._grouped_mm(xp, w_gate.transpose(1, 2), offs=offs)  # [T*K, I]
    u = torch._grouped_mm(xp, w_up.transpose(1, 2), offs=offs)
    h = F.silu(g) * u
    y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)  # [T*K, H]

    # Unpermute back to (token, k) order and combine over k in fp32.
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    y = y.index_select(0, inv).view(T, K, H)
    out = (y * topk_weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)

    if shared is not None:
        s_gate, s_up, s_down = shared
        hs = F.silu(F.linear(x, s_gate)) * F.linear(x, s_up)
        out = out + F.linear(hs, s_down)
    return out


def make_inputs(T, H, I, E, K, shared, device):
    """Random inputs with a fixed seed; every float tensor requires grad."""
    gen = torch.Generator(device=device)
    gen.manual_seed(SEED)
    bf16 = torch.bfloat16

    def param(*shape):
        # Scaled by 1/sqrt(fan_in) to keep activations O(1).
        t = torch.randn(*shape, generator=gen, device=device, dtype=bf16)
        t.mul_(shape[-1] ** -0.5)
        return t.requires_grad_()

    x = torch.randn(T, H, generator=gen, device=device, dtype=bf16).requires_grad_()
    # K distinct experts per token.
    topk_ids = torch.rand(T, E, generator=gen, device=device).topk(K, dim=1).indices
    topk_ids = topk_ids.to(torch.int32)
    topk_weights = torch.softmax(
        torch.randn(T, K, generator=gen, device=device), dim=-1
    ).requires_grad_()
    w_gate = param(E, I, H)
    w_up = param(E, I, H)
    w_down = param(E, H, I)
    sh = (param(I, H), param(I, H), param(H, I)) if shared else None
    d_out = torch.randn(T, H, generator=gen, device=device, dtype=bf16)
    leaves = [x, topk_weights, w_gate, w_up, w_down] + (list(sh) if sh else [])
    args = (x, topk_ids, topk_weights, w_gate, w_up, w_down, sh)
    return args, d_out, leaves


def time_ms(fn, warmup, iters, marks=2):
    """Medians in ms of the spans between the events fn records, in order:
    fn(e_0, ..., e_{marks-1}) gives marks - 1 of them (a list)."""
    def events():
        return [torch.cuda.Event(enable_timing=True) for _ in range(marks)]

    for _ in range(warmup):
        fn(*events())
    torch.cuda.synchronize()
    spans = [[] for _ in range(marks - 1)]
    for _ in range(iters):
        ev = events()
        fn(*ev)
        ev[-1].synchronize()
        for i, span in enumerate(spans):
            span.append(ev[i].elapsed_time(ev[i + 1]))
    return [statistics.median(span) for span in spans]


def run_shape(name, warmup, iters, steps=False, fwd_only=False):
    T, H, I, E, K, shared = SHAPES[name]
    args, d_out, leaves = make_inputs(T, H, I, E, K, shared, "cuda")

    def clear_grads():
        for p in leaves:
            p.grad = None

    def fwd(s, e):
        # Training forward (autograd graph is built, then dropped).
        s.record()
        out = reference_moe(*args)
        e.record()
        del out

    def bwd(s, e):
        # Forward runs outside the timed region; only backward is timed.
        clear_grads()
        out = reference_moe(*args)
        s.record()
        out.backward(d_out)
        e.record()

    def step(s, m, e):
        # A training step: the forward, timed behind the last step's
        # backward, then its backward.
        clear_grads()
        s.record()
        out = reference_moe(*args)
        m.record()
        out.backward(d_out)
        e.record()
        del out

    if fwd_only:
        # A card that holds the weights but not their gradients as well.
        (fwd_ms,) = time_ms(fwd, warmup, iters)
        bwd_ms = None
    elif steps:
        fwd_ms, bwd_ms = time_ms(step, warmup, iters, marks=3)
    else:
        (fwd_ms,) = time_ms(fwd, warmup, iters)
        (bwd_ms,) = time_ms(bwd, warmup, iters)
    clear_grads()

    # Peak memory of one training step: inputs, weights, their gradients and
    # everything autograd keeps in between (of one forward with fwd_only).
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    out = reference_moe(*args)
    if not fwd_only:
        out.backward(d_out)
    del out
    torch.cuda.synchronize()
    peak_gb = torch.cuda.max_memory_allocated() / 1e9
    clear_grads()

    fwd_flops = 6 * T * K * H * I + (6 * T * H * I if shared else 0)
    bwd_flops = 2 * fwd_flops
    bwd = (f"bwd_ms={bwd_ms:.3f} bwd_tflops={bwd_flops / bwd_ms / 1e9:.1f}"
           if bwd_ms is not None else "bwd_ms=- bwd_tflops=-")
    print(
        f"torch {name} T={T} H={H} I={I} E={E} K={K} shared={int(shared)} "
        f"fwd_ms={fwd_ms:.3f} fwd_tflops={fwd_flops / fwd_ms / 1e9:.1f} "
        f"{bwd} peak_gb={peak_gb:.3f}" + (" (forward only)" if fwd_only else ""),
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES),
                    help="comma-separated shape names (default: all)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", action="store_true",
                    help="time each forward with its backward in one step, the "
                    "forward behind the last step's backward (bench_gpu's "
                    "default); without it the forwards run in a loop of their "
                    "own, then the backwards")
    ap.add_argument("--fwd-only", action="store_true",
                    help="time the forwards alone (no backward, no gradients "
                    "held): for a shape whose step does not fit the card")
    a = ap.parse_args()

    names = [n.strip() for n in a.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s): {', '.join(unknown)}; "
                 f"known: {', '.join(SHAPES)}")
    if a.iters < 1 or a.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")

    if not torch.cuda.is_available():
        print("torch_moe: CUDA is not available, skipping", file=sys.stderr)
        sys.exit(77)

    for name in names:
        try:
            run_shape(name, a.warmup, a.iters, a.steps, a.fwd_only)
        except torch.cuda.OutOfMemoryError:
            print(f"torch {name} skipped: out of memory", flush=True)
        # Release this shape's tensors before the next one.
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
