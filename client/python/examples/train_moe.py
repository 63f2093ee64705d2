"""Trains a tiny MoE language model twice from the same initial weights: once
with its MoE layer run by mokd (mokd.MoELayer, daemon on the cuda backend),
once with the same layer written in plain PyTorch, and prints both loss
curves side by side.

    mokd --backend cuda &        # or point MOKD_SOCKET at a running one
    python3 client/python/examples/train_moe.py --steps 200

The task: map each token t to (7 t + 3) mod V through embedding -> router ->
MoE (with a residual) -> head, with a quarter of the targets replaced by
random tokens, so that the loss falls to a floor instead of to zero. Exit
status 1 if the curves part by more than --tol (relative) at any step or the
loss does not fall to half its start.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mokd  # noqa: E402


def torch_moe(x, ids, tw, w_gate, w_up, w_down):
    """The routed SwiGLU MoE in plain PyTorch: one expert at a time, bf16
    GEMMs, the k terms summed in fp32 in k order."""
    T, H = x.shape
    K = ids.shape[1]
    acc = torch.zeros(T, K, H, device=x.device, dtype=torch.float32)
    for e in range(w_gate.shape[0]):
        t, k = torch.nonzero(ids == e, as_tuple=True)
        if t.numel() == 0:
            continue
        xe = x[t]
        h = F.silu(xe @ w_gate[e].t()) * (xe @ w_up[e].t())
        y = h @ w_down[e].t()
        acc = acc.index_put((t, k), y.float() * tw[t, k].unsqueeze(-1))
    return acc.sum(dim=1).to(x.dtype)


class TorchMoE(torch.nn.Module):
    def __init__(self, hidden, intermediate, experts, device):
        super().__init__()
        E, I, H = experts, intermediate, hidden
        bf = dict(device=device, dtype=torch.bfloat16)
        self.w_gate = torch.nn.Parameter(torch.empty(E, I, H, **bf))
        self.w_up = torch.nn.Parameter(torch.empty(E, I, H, **bf))
        self.w_down = torch.nn.Parameter(torch.empty(E, H, I, **bf))

    def forward(self, x, ids, tw):
        return torch_moe(x, ids, tw, self.w_gate, self.w_up, self.w_down)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, hidden, intermediate, experts, top_k, use_mokd, device,
                 session=None):
        super().__init__()
        self.top_k = top_k
        self.emb = torch.nn.Embedding(vocab, hidden, device=device, dtype=torch.bfloat16)
        self.router = torch.nn.Linear(hidden, experts, bias=False, device=device)
        if use_mokd:
            self.moe = mokd.MoELayer(hidden, intermediate, experts, top_k, device=device,
                                     session=session)
        else:
            self.moe = TorchMoE(hidden, intermediate, experts, device)
        self.head = torch.nn.Linear(hidden, vocab, bias=False, device=device,
                                    dtype=torch.bfloat16)

    def forward(self, tokens):
        x = self.emb(tokens)
        probs = torch.softmax(self.router(x.float()), dim=-1)
        tw, ids = probs.topk(self.top_k, dim=-1)
        tw = tw / tw.sum(dim=-1, keepdim=True)
        h = x + self.moe(x, ids.to(torch.int32), tw)
        return self.head(h).float()


def train(steps=200, vocab=256, hidden=128, intermediate=128, experts=8, top_k=2,
          batch=1024, lr=1e-3, seed=0, device="cuda", log=None, session=None):
    """Both models from one initialisation; returns (mokd losses, torch losses).
    session: a mokd.nn.Session, else the process's default one."""
    torch.manual_seed(seed)
    m = TinyLM(vocab, hidden, intermediate, experts, top_k, True, device, session)
    with torch.no_grad():
        for p in m.moe.weights():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    t = TinyLM(vocab, hidden, intermediate, experts, top_k, False, device)
    t.load_state_dict(m.state_dict())
    opts = [torch.optim.Adam(model.parameters(), lr=lr) for model in (m, t)]
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + 1)
    curves = ([], [])
    for step in range(steps):
        tokens = torch.randint(0, vocab, (batch,), device=device, generator=gen)
        target = (7 * tokens + 3) % vocab
        noise = torch.rand(batch, device=device, generator=gen) < 0.25
        target = torch.where(noise, torch.randint(0, vocab, (batch,), device=device,
                                                  generator=gen), target)
        for model, opt, curve in zip((m, t), opts, curves):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(tokens), target)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        if log is not None and (step % 20 == 0 or step == steps - 1):
            a, b = curves[0][-1], curves[1][-1]
            log("step %4d  loss mokd %.4f  torch %.4f  rel diff %.2e"
                % (step, a, b, abs(a - b) / b))
    m.moe.check()
    return curves


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tol", type=float, default=0.05,
                    help="largest relative difference of the two losses at any step")
    args = ap.parse_args()
    ours, ref = train(args.steps, log=print)
    worst = max(abs(a - b) / b for a, b in zip(ours, ref))
    print("loss mokd %.4f -> %.4f, torch %.4f -> %.4f; largest relative difference %.3e"
          % (ours[0], ours[-1], ref[0], ref[-1], worst))
    ok = worst <= args.tol and ours[-1] <= 0.5 * ours[0]
    print("curves match" if ok else "curves do NOT match")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
