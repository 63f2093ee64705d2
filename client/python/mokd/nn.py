"""PyTorch front end of mokd: an MoE layer whose forward and backward run in
the daemon, on its GPU (cuda backend), with autograd.

    import torch, mokd
    moe = mokd.MoELayer(hidden=1024, intermediate=512, experts=32, top_k=4)
    out = moe(x, topk_ids, topk_weights)     # x: bf16 [T, H] on the GPU
    out.float().pow(2).mean().backward()     # fills x.grad, topk_weights.grad, moe.*.grad

The layer runs as a pair of torch.library custom ops, mokd::moe_forward and
mokd::moe_backward, with fake (meta) kernels and an autograd formula, so a
model holding it compiles with torch.compile(fullgraph=True): the ops are
opaque to the compiler. The module is named to the ops by an int id
(MoELayer.op_id) in a registry of this process; the forward returns out and
an int64 context tensor (CPU, one element), which autograd saves for the
backward and whose storage holds the daemon context alive.

Routing as the frameworks produce it: topk_ids int32 or int64 (int64 is
converted to int32 on the GPU, an id that int32 cannot hold becoming an
invalid one rather than wrapping), -1 meaning "no route" (DeepEP, Megatron:
the pair adds nothing to out and gets d_topk_weights 0); topk_weights float32,
or bf16 / float16 (widened to float32 exactly; its gradient comes back in
its own dtype).

How the tensors travel:
- The parameters (bf16) are registered with the daemon once and read in place
  every step, so optimizer updates made in place are seen without a request;
  a parameter whose storage is replaced is registered again.
- Inputs are passed in place too: their allocations (from PyTorch's caching
  allocator) are imported once and found again on later steps. A training
  forward gives the daemon a copy of x, which its saved state reads at the
  backward: the memory of x itself may be handed out again once the op
  returns (Inductor reuses the buffers of a compiled graph so).
- Outputs (out, d_x, d_topk_weights and the weight gradients) are zero-copy
  views of daemon arenas, exposed through __cuda_array_interface__; the
  daemon result behind them is released when the last view is gone.
- A forward's saved state in the daemon reads the weights in place at the
  backward. The autograd context keeps the forward's weight storage alive, so
  a module that drops or replaces its parameters in between (`p.data = ...`)
  still gets the gradients of the forward it ran. Storage freed after the
  forward and allocated again before the backward, as FSDP2's reshard after
  forward and its gather before the backward do, is followed: the backward
  names the weights where they are now. A weight still freed (0 bytes) at
  the backward raises a RuntimeError naming it, and one written in place in
  between raises the RuntimeError PyTorch gives for a tensor saved for
  backward and modified in place (its version counter tells, as PyTorch's).
- Ordering is on the current CUDA stream: the daemon waits for an event
  recorded there before it starts, and the stream waits for the daemon's done
  event before anything queued after the call. Nothing waits on the host.

Errors only the GPU can see (an expert id outside [0, E) other than -1,
whose pairs are dropped) are reported by `MoELayer.check()` as a MokError
(EEXPERT); with `check=True` (one host wait per step) the ids are checked on
the host before the step and a bad one raises ValueError naming it.

`mokd.memory_stats()` says what the daemon holds for this process's session
on a GPU, next to `torch.cuda.memory_stats()`.

Expert parallelism: MoELayer(..., ep_group=pg) makes the layer one rank of an
EP group, with pg a torch.distributed process group (its size P and this
process's rank r come from it; one process per rank, as torchrun starts
them). The rank holds the weights of its experts only, E / P of them from
r E / P on (w_gate, w_up [E / P, I, H], w_down [E / P, H, I]), and the shared
expert whole. Each rank passes its own T tokens (the same T on every rank)
with global expert ids; a step of the group runs when every rank has asked
for it, and gives each rank its tokens' out, d_x and d_topk_weights, and the
gradients of its experts. The shared expert's gradients cover the tokens of
every rank and are the same on each: do not all-reduce them again. Every
result has the bits of one layer holding all experts run over all ranks'
tokens. The daemon runs the ranks' sessions as virtual ranks of one GPU
(each rank's session on the same GPU; up to 8) on the cuda backend.

Gradient-accumulation fusion (Megatron's): with grad_mode="fp32_accum" each
backward adds the weight gradients, in fp32, into each parameter's
`main_grad` (an fp32 tensor of its shape on the layer's GPU, which the caller
attaches, as Megatron's DDP does), in place, with one fp32 addition per
element: micro-batches add up to exactly the sum of each one's gradients, in
order. A parameter that has a `grad_added_to_main_grad` attribute gets it set
to True and an unfilled gradient of its shape (torch.zeros with
`zero_out_wgrad`), so that Megatron's hooks fire and add nothing again; the
others get no .grad. It runs eagerly: under torch.compile the forward falls
back to eager (fullgraph=True raises), since the attribute is set per step.
"""

import ctypes
import itertools
import os
import threading
import weakref
from typing import List, Tuple

import numpy as np
import torch

from . import (BACKWARD_LAST, BF16, ECONTEXT, EPROTO, ENOTSUP, F32, I32, GRAD_BF16,
               GRAD_FP32_ACCUM, _BwdResult,
               _FwdResult, _LayerDesc, _tuning,
               _NW, _Tensor, _lib, Client, MokError)

__all__ = ["MoELayer", "Session", "moe", "memory_stats"]

_DT = {torch.bfloat16: BF16, torch.float32: F32, torch.int32: I32}
_TYPESTR = {BF16: "<i2", F32: "<f4", I32: "<i4"}
_CU_STREAM_LEGACY = 1  # the driver's handle of the legacy default stream


class _Owner:
    """A daemon context or result, released once nothing refers to it."""

    def __init__(self, session, rid, status):
        self.session, self.id, self.status = session, rid, status

    def __del__(self):
        # runs wherever the last reference goes (any thread, during GC):
        # only queue the id; the next call releases it under the lock
        self.session._dead.append(self.id)


class _View:
    """What torch.as_tensor reads: a daemon output, kept alive by its owner."""

    def __init__(self, ptr, shape, typestr, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "data": (ptr, False), "shape": shape, "typestr": typestr, "version": 2}


class Session:
    """One connection to mokd shared by the layers on one GPU of a process,
    computing on that GPU (default: the current one). Calls are serialized by a
    lock, since autograd runs backward on its own thread."""

    def __init__(self, socket=None, name="torch", device=None):
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device if isinstance(device, int)
                                   else torch.device(device).index or 0)
        self.client = Client(socket, name, self.device.index)
        info = self.client.info()
        if info["backend"] != "cuda":
            self.client.close()
            raise MokError(ENOTSUP, "mokd runs the %s backend; mokd.MoELayer needs the cuda "
                           "backend (start it with --backend cuda)" % info["backend"])
        self.lock = threading.RLock()
        self._dead = []
        self._stream = None

    def _h(self):
        return self.client._h

    def _check(self, rc):
        self.client._check(rc)

    def _begin(self):
        """Under the lock: release what died, follow the current stream."""
        while self._dead:
            ids = []
            while self._dead:
                ids.append(self._dead.pop())
            self.client.release(*ids)
        s = torch.cuda.current_stream().cuda_stream or _CU_STREAM_LEGACY
        if s != self._stream:
            self._check(_lib.mok_set_stream(self._h(), ctypes.c_void_p(s)))
            self._stream = s

    def tensor(self, t):
        """The wire tensor of a contiguous CUDA tensor, imported in place."""
        if not t.is_cuda or not t.is_contiguous() or t.dtype not in _DT:
            raise TypeError("expected a contiguous CUDA tensor of bf16, float32 or int32, "
                            "got %s %s on %s" % (t.dtype, tuple(t.shape), t.device))
        arena, off = ctypes.c_uint64(), ctypes.c_uint64()
        nbytes = max(t.numel() * t.element_size(), 1)
        self._check(_lib.mok_arena_import_cuda(self._h(), ctypes.c_void_p(t.data_ptr()), nbytes,
                                               ctypes.byref(arena), ctypes.byref(off)))
        m = _Tensor(arena.value, off.value, _DT[t.dtype], t.dim())
        for i, d in enumerate(t.shape):
            m.shape[i] = d
        return m

    def view(self, m, owner):
        """A torch tensor viewing an output of the daemon, zero-copy."""
        ptr = _lib.mok_tensor_ptr(self._h(), ctypes.byref(m))
        if not ptr:
            raise MokError(EPROTO, "the daemon's output lies outside the arenas mapped here")
        shape = tuple(m.shape[i] for i in range(m.ndim))
        t = torch.as_tensor(_View(ptr, shape, _TYPESTR[m.dtype], owner), device=self.device)
        return t.view(torch.bfloat16) if m.dtype == BF16 else t

    def status(self, owner):
        """Waits for the step of owner; raises what the GPU found."""
        with self.lock:
            self._check(_lib.mok_step_status(self._h(), ctypes.byref(owner.status)))


_default = {}
_default_lock = threading.Lock()


def _session(socket, device):
    with _default_lock:
        s = _default.get((socket, device.index))
        if s is None:
            s = _default[(socket, device.index)] = Session(socket, device=device.index)
        return s


def _check_inputs(hidden, top_k, x, topk_ids, topk_weights):
    """Dtype classes and shapes, from host metadata only (no wait on the GPU).
    Float ids would be truncated and integer activations make no sense; the
    float conversions that follow (to bf16 and float32) are by value."""
    def kind(name, t, want_float):
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: expected a torch.Tensor, got %s" % (name, type(t).__name__))
        dt = t.dtype
        if want_float and not dt.is_floating_point:
            raise TypeError("%s: expected a floating-point tensor, got %s" % (name, dt))
        if not want_float and (dt.is_floating_point or dt.is_complex or dt == torch.bool):
            raise TypeError("%s: expected integer expert ids, got %s" % (name, dt))

    kind("x", x, True)
    kind("topk_ids", topk_ids, False)
    kind("topk_weights", topk_weights, True)
    if x.dim() != 2 or x.shape[1] != hidden or x.shape[0] < 1:
        raise ValueError("x: expected shape [T, H] = [T, %d] with T >= 1, got %s"
                         % (hidden, tuple(x.shape)))
    want = (x.shape[0], top_k)
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tuple(t.shape) != want:
            raise ValueError("%s: expected shape %s = [T, K], got %s" % (name, want,
                                                                        tuple(t.shape)))


class _SavedWeights:
    """The weights a forward's saved state in the daemon reads at the backward.
    Aliases share each weight's storage and version counter: they keep the
    storage alive when the module lets go of the tensor, and follow it when
    it is freed and allocated again (FSDP2 frees its gathered parameters with
    `untyped_storage().resize_(0)` after the forward and gathers them into the
    same storage, wherever it lands now, before the backward)."""

    def __init__(self, names, weights):
        self.names = names
        self.alias = [w.detach() for w in weights]
        self.ptrs = [w.data_ptr() for w in self.alias]
        self.versions = [w._version for w in self.alias]

    def now(self):
        """The weights where they are now, when any moved since the forward
        (None: where the forward read them). Raises for a weight freed, or
        written in place, since the forward."""
        for name, w, version in zip(self.names, self.alias, self.versions):
            have = w.untyped_storage().nbytes()
            need = (w.storage_offset() + w.numel()) * w.element_size()
            if have == 0:
                raise RuntimeError(
                    "mokd.MoELayer: %s was freed after the forward (its storage has 0 bytes) "
                    "and the backward reads it: gather it again before the backward (FSDP2 "
                    "does so in its pre-backward hook), or keep it "
                    "(reshard_after_forward=False)" % name)
            if have < need:
                raise RuntimeError(
                    "mokd.MoELayer: the storage of %s holds %d bytes now, and the weight "
                    "%s needs %d: it was resized since the forward"
                    % (name, have, tuple(w.shape), need))
            if w._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified "
                    "by an inplace operation: [%s [%s]] (mokd.MoELayer's %s) is at version "
                    "%d; expected version %d instead. Hint: the backward reads the weights "
                    "of the forward; change them after the backward (as an optimizer step "
                    "does)." % (w.type(), ", ".join(str(d) for d in w.shape), name,
                                w._version, version))
        if all(w.data_ptr() == p for w, p in zip(self.alias, self.ptrs)):
            return None
        return self.alias


class _Saved:
    """What a training forward keeps for its backward: the daemon context (its
    owner), the inputs the daemon's saved state reads (x is a private copy)
    and the weights. Held by the storage of the context tensor that
    mokd::moe_forward returns, so it lives as long as autograd, eager or
    compiled, keeps that tensor, whose value is its key in _contexts (unique in
    the process: daemon context ids are unique per session only)."""

    def __init__(self, owner, inputs, weights):
        self.owner, self.inputs, self.weights = owner, inputs, weights
        self.key = next(_context_keys)
        self.cell = (ctypes.c_int64 * 1)(self.key)
        self.__array_interface__ = {"data": (ctypes.addressof(self.cell), False),
                                    "shape": (1,), "typestr": "<i8", "version": 3}

    def tensor(self):
        # numpy keeps self alive as the array's base; torch keeps the array
        return torch.from_numpy(np.asarray(self))


_contexts = weakref.WeakValueDictionary()  # _Saved.key -> _Saved, while its tensor lives
_context_keys = itertools.count(1)
_layers = weakref.WeakValueDictionary()    # MoELayer.op_id -> MoELayer
_op_ids = itertools.count(1)


def _layer_of(op_id):
    m = _layers.get(int(op_id))
    if m is None:
        raise RuntimeError("mokd: no mokd.MoELayer with op_id %d lives in this process (the op "
                           "names its layer by MoELayer.op_id)" % op_id)
    return m


@torch.library.custom_op("mokd::moe_forward", mutates_args=())
def moe_forward(layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, weights: List[torch.Tensor],
                keep: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The MoE forward of MoELayer `layer` (its op_id): x bf16 [T, H], topk_ids
    int32 or int64 [T, K] (-1: no route), topk_weights float32 [T, K], the
    layer's weights. Returns out bf16 [T, H] and the context: int64 [1] on
    the CPU, which names the forward's saved state to moe_backward (0 when
    keep is False: an inference forward, which keeps nothing)."""
    return _layer_of(layer)._run_forward(x, topk_ids, topk_weights, weights, keep)


@moe_forward.register_fake
def _moe_forward_fake(layer, x, topk_ids, topk_weights, weights, keep):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty(1, dtype=torch.int64, device="cpu")


def _saved_of(context):
    if context.dtype != torch.int64 or context.numel() != 1 or context.device.type != "cpu":
        raise TypeError("context: expected the int64 [1] CPU tensor that mokd::moe_forward "
                        "returned, got %s %s on %s" % (context.dtype, tuple(context.shape),
                                                       context.device))
    saved = _contexts.get(int(context[0]))
    if saved is None:
        raise RuntimeError("context: the forward kept no state for a backward (it ran without "
                           "anything requiring grad), or that state was released")
    return saved


@torch.library.custom_op("mokd::moe_backward", mutates_args=())
def moe_backward(layer: int, context: torch.Tensor, d_out: torch.Tensor,
                 last: bool = False) -> List[torch.Tensor]:
    """The backward of a moe_forward: context is its context tensor, d_out
    bf16 [T, H]. Returns [d_x bf16 [T, H], d_topk_weights float32 [T, K],
    then the weight gradients, bf16, in the order of the weights]. last:
    the context's last backward, which may write over its daemon state (less
    GPU memory); another backward of it then raises. The autograd formula
    passes it unless the layer has retain_context=True."""
    m = _layer_of(layer)
    if m.grad_mode != GRAD_BF16:
        raise RuntimeError("mokd::moe_backward: layer %d adds its gradients into main_grad "
                           "(grad_mode='fp32_accum'): use mokd::moe_backward_accum" % layer)
    saved = _saved_of(context)
    d_x, d_tw, grads = m._run_backward(saved.owner, d_out, saved.weights.now(), last=last)
    return [d_x, d_tw] + grads


@torch.library.custom_op("mokd::moe_backward_accum", mutates_args=("main_grads",))
def moe_backward_accum(layer: int, context: torch.Tensor, d_out: torch.Tensor,
                       main_grads: List[torch.Tensor], last: bool = False) -> List[torch.Tensor]:
    """The backward of a moe_forward of a grad_mode="fp32_accum" layer: adds
    the weight gradients into main_grads (fp32, the weights' shapes and
    order) in place, and returns [d_x bf16 [T, H], d_topk_weights float32
    [T, K]]. last: as in mokd::moe_backward."""
    m = _layer_of(layer)
    if m.grad_mode != GRAD_FP32_ACCUM:
        raise RuntimeError("mokd::moe_backward_accum: layer %d writes bf16 gradients "
                           "(grad_mode='bf16'): use mokd::moe_backward" % layer)
    if len(main_grads) != len(m._names):
        raise ValueError("main_grads: expected %d fp32 tensors (%s), got %d"
                         % (len(m._names), ", ".join(m._names), len(main_grads)))
    for name, g, shp in zip(m._names, main_grads, m.weight_shapes()):
        if g.dtype != torch.float32 or tuple(g.shape) != shp or not g.is_contiguous() or \
                g.device != m.session.device:
            raise ValueError("main_grads: %s: expected a contiguous float32 tensor of shape %s "
                             "on %s, got %s %s on %s" % (name, shp, m.session.device, g.dtype,
                                                         tuple(g.shape), g.device))
    saved = _saved_of(context)
    d_x, d_tw, _ = m._run_backward(saved.owner, d_out, saved.weights.now(), main_grads,
                                   last=last)
    return [d_x, d_tw]


@moe_backward_accum.register_fake
def _moe_backward_accum_fake(layer, context, d_out, main_grads, last=False):
    m = _layer_of(layer)
    T = d_out.shape[0]
    return [d_out.new_empty((T, m.hidden), dtype=torch.bfloat16),
            d_out.new_empty((T, m.top_k), dtype=torch.float32)]


@moe_backward.register_fake
def _moe_backward_fake(layer, context, d_out, last=False):
    m = _layer_of(layer)
    T = d_out.shape[0]
    return [d_out.new_empty((T, m.hidden), dtype=torch.bfloat16),
            d_out.new_empty((T, m.top_k), dtype=torch.float32)] + \
        [d_out.new_empty(shp, dtype=torch.bfloat16) for shp in m.weight_shapes()]


def _moe_setup_context(ctx, inputs, output):
    ctx.layer = inputs[0]
    ctx.save_for_backward(output[1])


def _moe_backward_formula(ctx, d_out, d_context):
    (context,) = ctx.saved_tensors
    d_out = d_out.to(torch.bfloat16).contiguous()
    m = _layer_of(ctx.layer)
    last = not m.retain_context  # autograd's backward, once unless retain_graph
    if m.grad_mode == GRAD_BF16:
        g = torch.ops.mokd.moe_backward(ctx.layer, context, d_out, last)
        return None, g[0], None, g[1], list(g[2:]), None
    weights = m.weights()
    g = torch.ops.mokd.moe_backward_accum(ctx.layer, context, d_out, m._main_grads(weights),
                                          last)
    return None, g[0], None, g[1], _added_to_main_grad(weights), None


def _added_to_main_grad(weights):
    """Megatron's convention after a fused accumulation into main_grad: the
    flag set, and a gradient of the right shape that its hooks will not add
    (unfilled, or zeros with zero_out_wgrad); None for other parameters."""
    out = []
    for w in weights:
        if not hasattr(w, "grad_added_to_main_grad"):
            out.append(None)
            continue
        w.grad_added_to_main_grad = True
        make = torch.zeros if getattr(w, "zero_out_wgrad", False) else torch.empty
        out.append(make(w.shape, dtype=w.dtype, device=w.device))
    return out


torch.library.register_autograd("mokd::moe_forward", _moe_backward_formula,
                                setup_context=_moe_setup_context)


_ep_layers = {}  # the ranks of a group -> EP layers this process built with it


def _ep_membership(group, experts):
    """(P, r, group id) of this process in an EP process group: the id is
    drawn at random by the group's rank 0 and handed to the others through
    the default store, under a key of the group's ranks and the count of EP
    layers this process built with those ranks before: each rank of a group
    must build its layers of that group in the same order (as a model's
    constructor does)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ep_group: torch.distributed is not initialized "
                         "(init_process_group first)")
    try:
        P, r = dist.get_world_size(group), dist.get_rank(group)
    except (RuntimeError, ValueError, AttributeError) as e:
        raise ValueError("ep_group: not a torch.distributed process group this process "
                         "is in: %s" % e) from e
    if r < 0:
        raise ValueError("ep_group: this process is not a member of the group")
    if experts % P != 0:
        raise ValueError("experts (%d) must divide evenly over the %d ranks of ep_group"
                         % (experts, P))
    gid = int.from_bytes(os.urandom(8), "little") | 1
    if P > 1:
        # through the job's store, not a collective of the group: the ranks'
        # sessions share one GPU, where an NCCL group cannot form
        store = dist.distributed_c10d._get_default_store()
        ranks = ",".join(str(g) for g in dist.get_process_group_ranks(group))
        n = _ep_layers.get(ranks, 0)
        _ep_layers[ranks] = n + 1
        key = "mokd/ep/%s/%d" % (ranks, n)
        if r == 0:
            store.set(key, str(gid))
        else:
            gid = int(store.get(key))
    return P, r, gid


class MoELayer(torch.nn.Module):
    """A routed SwiGLU MoE layer, plus an optional shared expert, run by mokd.

    Parameters (bf16, on the daemon's GPU): w_gate, w_up [E, I, H], w_down
    [E, H, I]; with shared_intermediate > 0 also s_gate, s_up [I_s, H] and
    s_down [H, I_s]. forward(x [T, H] bf16, topk_ids [T, K] integer,
    topk_weights [T, K] float) returns out [T, H] bf16. H, I and I_s must be
    multiples of 64 on the cuda backend. Float ids, integer activations and
    shapes that are not the layer's raise TypeError or ValueError naming the
    argument. Ids may be int32 or int64 (converted on the GPU), -1 meaning no
    route; topk_weights float32, bf16 or float16. op_id names the layer to
    the mokd::moe_forward / moe_backward ops. ep_group (a torch.distributed
    process group) makes it one rank of an EP group, and grad_mode
    "fp32_accum" adds the weight gradients into each parameter's main_grad:
    see the module's text. Each forward's daemon state serves one backward,
    as autograd frees saved tensors without retain_graph, and the daemon
    writes over it (less GPU memory at the backward's peak; the same bits);
    a second backward through the same graph raises RuntimeError unless
    retain_context=True.
    """

    def __init__(self, hidden, intermediate, experts, top_k, shared_intermediate=0,
                 swiglu_limit=0.0, socket=None, device=None, check=False, session=None,
                 ep_group=None, grad_mode="bf16", retain_context=False, tuning=None):
        super().__init__()
        # False: each forward's daemon state serves one backward, which may
        # write over it (less GPU memory at the backward's peak), as autograd
        # frees saved tensors without retain_graph; True: several backwards
        self.retain_context = bool(retain_context)
        modes = {"bf16": GRAD_BF16, "fp32_accum": GRAD_FP32_ACCUM}
        if grad_mode not in modes:
            raise ValueError("grad_mode: expected 'bf16' or 'fp32_accum', got %r" % (grad_mode,))
        self.grad_mode = modes[grad_mode]
        tune, self.tuning = _tuning(tuning)
        self.hidden, self.intermediate, self.experts, self.top_k = \
            hidden, intermediate, experts, top_k
        self.ep_size, self.ep_rank, ep_id = 1, 0, 0
        if ep_group is not None:
            self.ep_size, self.ep_rank, ep_id = _ep_membership(ep_group, experts)
        self.shared_intermediate, self.swiglu_limit, self.check_each_step = \
            shared_intermediate, swiglu_limit, check
        dev = torch.device(device) if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.session = session if session is not None else _session(socket, dev)
        dev = self.session.device
        shapes = self.weight_shapes()
        names = ["w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"][:len(shapes)]
        for n, shp in zip(names, shapes):
            p = torch.empty(*shp, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                p.normal_(0.0, shp[-1] ** -0.5)
            self.register_parameter(n, torch.nn.Parameter(p))
        self._names = names
        d = _LayerDesc(hidden, intermediate, experts, top_k, shared_intermediate,
                       swiglu_limit, ep_id, self.ep_size, self.ep_rank, self.grad_mode)
        lid = ctypes.c_uint64()
        with self.session.lock:
            self.session._check(_lib.mok_layer_create_tuned(self.session._h(), ctypes.byref(d),
                                                            ctypes.byref(tune),
                                                            ctypes.byref(lid)))
        self.layer_id = lid.value
        self._registered = None
        self._last = None
        self.op_id = next(_op_ids)
        _layers[self.op_id] = self

    def weight_shapes(self):
        H, I, Is = self.hidden, self.intermediate, self.shared_intermediate
        E = self.experts // self.ep_size  # this rank's experts
        shapes = [(E, I, H), (E, I, H), (E, H, I)]
        if Is:
            shapes += [(Is, H), (Is, H), (H, Is)]
        return shapes

    def weights(self):
        return [getattr(self, n) for n in self._names]

    def extra_repr(self):
        ep = ", ep_size=%d, ep_rank=%d" % (self.ep_size, self.ep_rank) if self.ep_size > 1 else ""
        if self.tuning:
            ep += ", tuning=%r" % self.tuning
        return ("hidden=%d, intermediate=%d, experts=%d, top_k=%d, shared_intermediate=%d, "
                "swiglu_limit=%g%s" % (self.hidden, self.intermediate, self.experts, self.top_k,
                                       self.shared_intermediate, self.swiglu_limit, ep))

    def forward(self, x, topk_ids, topk_weights):
        if self.grad_mode == GRAD_FP32_ACCUM and torch.compiler.is_compiling():
            raise RuntimeError("mokd.MoELayer: grad_mode='fp32_accum' runs eagerly (its "
                               "backward sets grad_added_to_main_grad each step)")
        _check_inputs(self.hidden, self.top_k, x, topk_ids, topk_weights)
        weights = self.weights()
        keep = torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad)
        for w in weights:
            keep = keep or (torch.is_grad_enabled() and w.requires_grad)
        # casts by value, in autograd: the gradients come back in the caller's dtypes
        x = x.to(torch.bfloat16).contiguous()
        topk_weights = topk_weights.to(torch.float32).contiguous()
        out, _ = torch.ops.mokd.moe_forward(self.op_id, x, topk_ids.contiguous(), topk_weights,
                                            weights, keep)
        return out

    def check(self):
        """Waits for the latest step whose outputs are still alive and raises
        what the GPU found in it."""
        owner = self._last() if self._last is not None else None
        if owner is not None:
            self.session.status(owner)

    # -- the daemon side, under the session lock ------------------------------

    def _register(self, weights):
        key = tuple((w.data_ptr(), w.dtype, tuple(w.shape)) for w in weights)
        if key == self._registered:
            return
        for w, shp in zip(weights, self.weight_shapes()):
            if w.dtype != torch.bfloat16 or tuple(w.shape) != shp or not w.is_contiguous():
                raise TypeError("weights must be contiguous bf16 of shapes %s" %
                                self.weight_shapes())
        ts = (_Tensor * _NW)()
        for i, w in enumerate(weights):
            ts[i] = self.session.tensor(w.detach())
        self.session._check(_lib.mok_layer_set_weights(self.session._h(), self.layer_id, ts))
        self._registered = key

    def _ids(self, topk_ids):
        """int32 ids for the daemon, on the GPU. Another integer type is
        widened to int64 and an id outside [-1, E) becomes E, which the daemon
        flags, instead of wrapping into range. With check=True a bad id
        raises ValueError here (a host wait)."""
        ids = topk_ids.detach()
        if self.check_each_step:
            bad = (ids < -1) | (ids >= self.experts)
            if bool(bad.any()):
                t, k = (int(i) for i in bad.nonzero()[0])
                raise ValueError("topk_ids: id %d (token %d, k %d) is outside [0, %d) "
                                 "(-1: no route)" % (int(ids[t, k]), t, k, self.experts))
        if ids.dtype == torch.int32:
            return ids.contiguous()
        ids = ids.to(torch.int64)
        ok = (ids >= -1) & (ids < self.experts)
        return ids.masked_fill(~ok, self.experts).to(torch.int32).contiguous()

    def _run_forward(self, x, topk_ids, topk_weights, weights, want_ctx):
        """The daemon's forward: (out, context tensor)."""
        s = self.session
        for name, t, dt in (("x", x, torch.bfloat16), ("topk_weights", topk_weights,
                                                       torch.float32)):
            if t.dtype != dt:
                raise TypeError("%s: mokd::moe_forward takes %s, got %s (MoELayer converts)"
                                % (name, dt, t.dtype))
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise TypeError("topk_ids: expected integer expert ids, got %s" % topk_ids.dtype)
        x = x.detach().contiguous()
        if want_ctx:
            x = x.clone()  # the daemon's saved state reads it at the backward
        ids = self._ids(topk_ids)
        tw = topk_weights.detach().contiguous()
        with s.lock:
            s._begin()
            self._register(weights)
            res = _FwdResult()
            tx, ti, tt = s.tensor(x), s.tensor(ids), s.tensor(tw)
            s._check(_lib.mok_forward(s._h(), self.layer_id, ctypes.byref(tx), ctypes.byref(ti),
                                      ctypes.byref(tt), 0 if want_ctx else 1,
                                      ctypes.byref(res)))
            owner = _Owner(s, res.context, res.status)
            out = s.view(res.out, owner)
        self._last = weakref.ref(owner)  # check() must not keep outputs alive
        if self.check_each_step:
            s.status(owner)
        if not want_ctx:
            return out, torch.zeros(1, dtype=torch.int64)
        # the daemon's saved state points into x (and reads the routing); keep
        # them alive until the backward
        saved = _Saved(owner, (x, ids, tw), _SavedWeights(self._names, weights))
        _contexts[saved.key] = saved
        return out, saved.tensor()

    def _main_grads(self, weights):
        """Each weight's main_grad, checked: fp32, its shape, contiguous, on
        the layer's GPU."""
        out = []
        for name, w in zip(self._names, weights):
            g = getattr(w, "main_grad", None)
            if g is None:
                frozen = "" if w.requires_grad else (
                    " (it has requires_grad=False, and Megatron's DDP attaches main_grad only "
                    "to trained parameters: mokd computes every weight's gradient, so "
                    "attach one anyway, or use grad_mode='bf16')")
                raise RuntimeError("mokd.MoELayer: grad_mode='fp32_accum' adds the gradient of "
                                   "%s into %s.main_grad, which it lacks: attach an fp32 "
                                   "tensor of shape %s (Megatron's DDP does)%s"
                                   % (name, name, tuple(w.shape), frozen))
            if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or \
                    tuple(g.shape) != tuple(w.shape) or not g.is_contiguous() or \
                    g.device != self.session.device:
                raise ValueError("%s.main_grad: expected a contiguous float32 tensor of shape %s "
                                 "on %s, got %s" % (name, tuple(w.shape), self.session.device,
                                                    "%s %s on %s" % (g.dtype, tuple(g.shape),
                                                                     g.device)
                                                    if isinstance(g, torch.Tensor)
                                                    else type(g).__name__))
            out.append(g)
        return out

    def _run_backward(self, owner, d_out, weights=None, main_grads=None, last=False):
        """weights: where the weights are now, when they moved since the
        forward; None: where the forward read them. main_grads (fp32_accum):
        the fp32 tensors the weight gradients are added into. last: the
        context's last backward (MOK_BACKWARD_LAST)."""
        s = self.session
        if d_out.dim() != 2 or d_out.shape[1] != self.hidden:
            raise ValueError("d_out: expected shape [T, H] = [T, %d], got %s"
                             % (self.hidden, tuple(d_out.shape)))
        d_out = d_out.detach().to(torch.bfloat16).contiguous()
        with s.lock:
            s._begin()
            res = _BwdResult()
            td = s.tensor(d_out)
            tw = tg = None
            if weights is not None:
                tw = (_Tensor * _NW)()
                for i, w in enumerate(weights):
                    tw[i] = s.tensor(w)
            if main_grads is not None:
                tg = (_Tensor * _NW)()
                for i, g in enumerate(main_grads):
                    tg[i] = s.tensor(g)
            rc = _lib.mok_backward_flags(s._h(), owner.id, ctypes.byref(td), tg,
                                         len(main_grads) if tg is not None else 0, tw,
                                         BACKWARD_LAST if last else 0, ctypes.byref(res))
            if rc == ECONTEXT and not self.retain_context:
                raise RuntimeError(
                    "mokd: this forward's saved state was used up by an earlier backward "
                    "(%s); a layer whose graph is backwarded more than once (retain_graph="
                    "True) needs MoELayer(..., retain_context=True)"
                    % _lib.mok_last_error(s._h()).decode(errors="replace"))
            s._check(rc)
            result = _Owner(s, res.result, res.status)
            d_x = s.view(res.d_x, result)
            d_tw = s.view(res.d_topk_weights, result)
            grads = [s.view(res.grads[i], result) for i in range(res.ngrads)]
        self._last = weakref.ref(result)
        if self.check_each_step:
            s.status(result)
        return d_x, d_tw, grads


def moe(layer, x, topk_ids, topk_weights):
    """Functional form: layer(x, topk_ids, topk_weights)."""
    return layer(x, topk_ids, topk_weights)


_STATS_KEYS = (
    # key, what it counts; the daemon's Stats for this session
    ("gpu_bytes", "GPU memory the daemon allocated for this session (output arenas, saved "
     "contexts); not in torch.cuda.memory_allocated()"),
    ("context_bytes", "bytes of saved forward state awaiting a backward or a release"),
    ("contexts", "forward contexts held"),
    ("results", "backward results held (their outputs still viewed)"),
    ("arena_bytes", "bytes of the session's arenas, PyTorch allocations it imported included"),
    ("arenas", "arenas of the session (imported ones included)"),
    ("layers", "layers created"),
)


def memory_stats(device=None, session=None):
    """What mokd holds for this process on a GPU, as a dict next to
    torch.cuda.memory_stats(device): the keys of _STATS_KEYS for the session
    (the one MoELayer uses by default for that device, or `session`), plus
    "gpu_quota_bytes" and "host_quota_bytes" (0: none) and, for the whole
    daemon, "daemon.gpu_bytes", "daemon.context_bytes" and "daemon.sessions".
    Counts released outputs first, as the next layer call would."""
    if session is None:
        if device is None:
            device = torch.cuda.current_device()
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise ValueError("device: mokd runs on CUDA devices, got %s" % dev)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        session = _session(None, dev)
    elif not isinstance(session, Session):
        raise TypeError("session: expected a mokd.nn.Session, got %s" % type(session).__name__)
    with session.lock:
        session._begin()
        st = session.client.stats()
        info = session.client.info()
    out = {k: st["session"][k] for k, _ in _STATS_KEYS}
    out["gpu_quota_bytes"] = info["session_gpu_quota_bytes"]
    out["host_quota_bytes"] = info["session_quota_bytes"]
    for k in ("gpu_bytes", "context_bytes", "sessions"):
        out["daemon." + k] = st["daemon"][k]
    return out
