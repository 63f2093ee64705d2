"""PyTorch front end of mokd: an MoE layer whose forward and backward run in
the daemon, on its GPU (cuda backend), with autograd.

    import torch, mokd
    moe = mokd.MoELayer(hidden=1024, intermediate=512, experts=32, top_k=4)
    out = moe(x, topk_ids, topk_weights)     # x: bf16 [T, H] on the GPU
    out.float().pow(2).mean().backward()     # fills x.grad, topk_weights.grad, moe.*.grad

How the tensors travel:
- The parameters (bf16) are registered with the daemon once and read in place
  every step, so optimizer updates made in place are seen without a request;
  a parameter whose storage is replaced is registered again.
- Inputs are passed in place too: their allocations (from PyTorch's caching
  allocator) are imported once and found again on later steps.
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

Errors only the GPU can see (an expert id out of range, whose pairs are
dropped) are reported when `check=True` (one host wait per step), or by
`MoELayer.check()`.
"""

import ctypes
import threading
import weakref

import torch

from . import (BF16, EPROTO, ENOTSUP, F32, I32, GRAD_BF16, _BwdResult, _FwdResult, _LayerDesc,
               _NW, _Tensor, _lib, Client, MokError)

__all__ = ["MoELayer", "Session", "moe"]

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


class _MoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, x, topk_ids, topk_weights, *weights):
        want_ctx = any(ctx.needs_input_grad)
        out, owner, keep = layer._run_forward(x, topk_ids, topk_weights, weights, want_ctx)
        ctx.layer, ctx.owner, ctx.keep = layer, owner, keep
        ctx.weights = _SavedWeights(layer._names, weights) if want_ctx else None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        weights = ctx.weights.now()
        d_x, d_tw, grads = ctx.layer._run_backward(ctx.owner, d_out, weights)
        ctx.owner = ctx.keep = ctx.weights = None
        return (None, d_x, None, d_tw) + tuple(grads)


class MoELayer(torch.nn.Module):
    """A routed SwiGLU MoE layer, plus an optional shared expert, run by mokd.

    Parameters (bf16, on the daemon's GPU): w_gate, w_up [E, I, H], w_down
    [E, H, I]; with shared_intermediate > 0 also s_gate, s_up [I_s, H] and
    s_down [H, I_s]. forward(x [T, H] bf16, topk_ids [T, K] integer,
    topk_weights [T, K] float) returns out [T, H] bf16. H, I and I_s must be
    multiples of 64 on the cuda backend. Float ids, integer activations and
    shapes that are not the layer's raise TypeError or ValueError naming the
    argument; int64 ids must fit int32 (they are converted on the GPU).
    """

    def __init__(self, hidden, intermediate, experts, top_k, shared_intermediate=0,
                 swiglu_limit=0.0, socket=None, device=None, check=False, session=None):
        super().__init__()
        self.hidden, self.intermediate, self.experts, self.top_k = \
            hidden, intermediate, experts, top_k
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
                       swiglu_limit, 0, 1, 0, GRAD_BF16)
        lid = ctypes.c_uint64()
        with self.session.lock:
            self.session._check(_lib.mok_layer_create(self.session._h(), ctypes.byref(d),
                                                      ctypes.byref(lid)))
        self.layer_id = lid.value
        self._registered = None
        self._last = None

    def weight_shapes(self):
        H, I, E, Is = self.hidden, self.intermediate, self.experts, self.shared_intermediate
        shapes = [(E, I, H), (E, I, H), (E, H, I)]
        if Is:
            shapes += [(Is, H), (Is, H), (H, Is)]
        return shapes

    def weights(self):
        return [getattr(self, n) for n in self._names]

    def extra_repr(self):
        return ("hidden=%d, intermediate=%d, experts=%d, top_k=%d, shared_intermediate=%d, "
                "swiglu_limit=%g" % (self.hidden, self.intermediate, self.experts, self.top_k,
                                     self.shared_intermediate, self.swiglu_limit))

    def forward(self, x, topk_ids, topk_weights):
        _check_inputs(self.hidden, self.top_k, x, topk_ids, topk_weights)
        return _MoEFunction.apply(self, x, topk_ids, topk_weights, *self.weights())

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

    def _run_forward(self, x, topk_ids, topk_weights, weights, want_ctx):
        s = self.session
        x = x.detach().to(torch.bfloat16).contiguous()
        ids = topk_ids.detach().to(torch.int32).contiguous()
        tw = topk_weights.detach().to(torch.float32).contiguous()
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
        # the daemon's saved state points into x (and reads the routing); keep
        # them alive until the backward
        return out, owner, (x, ids, tw) if want_ctx else None

    def _run_backward(self, owner, d_out, weights=None):
        """weights: where the weights are now, when they moved since the
        forward; None: where the forward read them."""
        s = self.session
        d_out = d_out.to(torch.bfloat16).contiguous()
        with s.lock:
            s._begin()
            res = _BwdResult()
            td = s.tensor(d_out)
            tw = None
            if weights is not None:
                tw = (_Tensor * _NW)()
                for i, w in enumerate(weights):
                    tw[i] = s.tensor(w)
            s._check(_lib.mok_backward_weights(s._h(), owner.id, ctypes.byref(td), None, 0, tw,
                                               ctypes.byref(res)))
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
