"""Python client of mokd, the MoE execution daemon.

A ctypes binding to libmok, in two flavours:

- `mokd.MoELayer`, a torch.nn.Module (in `mokd.nn`; needs PyTorch and a
  daemon on the cuda backend): CUDA tensors in, zero-copy CUDA tensors out,
  autograd included, ordered on the current stream; it runs as the custom
  ops mokd::moe_forward / mokd::moe_backward, so it compiles with
  torch.compile. `mokd.memory_stats()` says what the daemon holds for it.

- `mokd.Layer` with numpy: arenas are shared memory that both this process
  and the daemon map (cpu backend); arrays returned are zero-copy views of
  them. bf16 tensors are numpy uint16 arrays holding the bf16 bit patterns;
  `to_bf16` and `from_bf16` convert, and ml_dtypes.bfloat16 arrays are taken
  as they are.

    import mokd
    c = mokd.Client()                       # $MOKD_SOCKET or the default path
    layer = mokd.Layer(c, hidden=512, intermediate=1024, experts=16, top_k=4)
    layer.set_weights(w_gate, w_up, w_down) # bf16 arrays, copied once
    out, ctx = layer.forward(x, topk_ids, topk_weights)
    grads = layer.backward(ctx, d_out)

Every input is checked for dtype and shape before anything is sent: a wrong
one raises TypeError or ValueError naming the argument. Only lossless
conversions are made: ml_dtypes.bfloat16 arrays are read bit for bit, other
integer ids become int32 when every id fits, float16 and bfloat16 routing
weights are widened to float32.

Outputs live in daemon memory as long as any view of them does: once the
Context, the backward's dict and every array derived from them without a
copy are gone, the daemon is told (on this client's next call) and reuses the
memory. Views must not be used after Client.close().
"""

import ctypes
import errno
import os
import weakref

import numpy as np

__all__ = ["Client", "Arena", "Layer", "MoELayer", "MokError", "memory_stats", "to_bf16",
           "from_bf16"]

BF16, F32, I32 = 1, 2, 3
GRAD_BF16, GRAD_FP32_ACCUM = 0, 1
_MAX_DIMS = 4
_NW = 6
_DTYPES = {BF16: np.uint16, F32: np.float32, I32: np.int32}


class _Tensor(ctypes.Structure):
    _fields_ = [("arena", ctypes.c_uint64), ("offset", ctypes.c_uint64),
                ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_int64 * _MAX_DIMS)]


class _ArenaInfo(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("ptr", ctypes.c_void_p), ("bytes", ctypes.c_size_t),
                ("device", ctypes.c_int)]


class _LayerDesc(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("experts", ctypes.c_int64), ("top_k", ctypes.c_int64),
                ("shared_intermediate", ctypes.c_int64), ("swiglu_limit", ctypes.c_float),
                ("ep_group", ctypes.c_uint64), ("ep_size", ctypes.c_uint32),
                ("ep_rank", ctypes.c_uint32), ("grad_mode", ctypes.c_int)]


class _LayerTuning(ctypes.Structure):
    _fields_ = [("tiles", ctypes.c_int), ("wgrad_tiles", ctypes.c_int),
                ("clusters", ctypes.c_int), ("order", ctypes.c_int), ("tails", ctypes.c_int),
                ("dx", ctypes.c_int), ("dispatch_blocks", ctypes.c_int32)]


class _Timing(ctypes.Structure):
    _fields_ = [("queued_ns", ctypes.c_uint64), ("compute_ns", ctypes.c_uint64)]


class _FwdResult(ctypes.Structure):
    _fields_ = [("context", ctypes.c_uint64), ("out", _Tensor), ("out_ptr", ctypes.c_void_p),
                ("timing", _Timing), ("status", _Tensor)]


class _BwdResult(ctypes.Structure):
    _fields_ = [("result", ctypes.c_uint64), ("d_x", _Tensor), ("d_topk_weights", _Tensor),
                ("d_x_ptr", ctypes.c_void_p), ("d_topk_weights_ptr", ctypes.c_void_p),
                ("ngrads", ctypes.c_int), ("grads", _Tensor * _NW),
                ("grad_ptrs", ctypes.c_void_p * _NW), ("timing", _Timing), ("status", _Tensor)]


class _Welcome(ctypes.Structure):
    _fields_ = [("protocol_version", ctypes.c_uint32), ("daemon_version", ctypes.c_char * 32),
                ("backend", ctypes.c_char * 32), ("session_id", ctypes.c_uint64),
                ("max_frame_bytes", ctypes.c_uint32), ("max_arena_bytes", ctypes.c_uint64),
                ("session_quota_bytes", ctypes.c_uint64),
                ("session_gpu_quota_bytes", ctypes.c_uint64), ("ndevices", ctypes.c_int),
                ("device", ctypes.c_int), ("daemon_device", ctypes.c_int),
                ("device_uuid", ctypes.c_char * 41)]


class _Usage(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "sessions", "arenas", "arena_bytes", "layers", "contexts", "context_bytes",
        "results", "requests", "forwards", "backwards", "errors", "gpu_bytes")]


class _Stats(ctypes.Structure):
    _fields_ = [("daemon", _Usage), ("session", _Usage), ("uptime_ns", ctypes.c_uint64),
                ("backend", ctypes.c_char * 32)]


def _find_lib():
    env = os.environ.get("MOK_LIB")
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [env] if env else []
    candidates += [os.path.join(here, "libmok.so"),
                   os.path.join(here, "..", "..", "..", "build", "libmok.so"),
                   "libmok.so.0", "libmok.so"]
    errors = []
    for c in candidates:
        try:
            return ctypes.CDLL(c)
        except OSError as e:
            errors.append(str(e))
    raise OSError("libmok not found; build it with `make` or set MOK_LIB "
                  "(tried: %s)" % "; ".join(errors))


_lib = _find_lib()
_P = ctypes.POINTER
_lib.mok_connect.argtypes = [ctypes.c_char_p, ctypes.c_char_p, _P(ctypes.c_void_p)]
_lib.mok_connect_device.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                    _P(ctypes.c_void_p)]
_lib.mok_connect_uuid.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
                                  _P(ctypes.c_void_p)]
_lib.mok_close.argtypes = [ctypes.c_void_p]
_lib.mok_last_error.argtypes = [ctypes.c_void_p]
_lib.mok_last_error.restype = ctypes.c_char_p
_lib.mok_strerror.argtypes = [ctypes.c_int]
_lib.mok_strerror.restype = ctypes.c_char_p
_lib.mok_err_name.argtypes = [ctypes.c_int]
_lib.mok_err_name.restype = ctypes.c_char_p
_lib.mok_server_info.argtypes = [ctypes.c_void_p]
_lib.mok_server_info.restype = _P(_Welcome)
_lib.mok_ping.argtypes = [ctypes.c_void_p, _P(ctypes.c_uint64)]
_lib.mok_stats_get.argtypes = [ctypes.c_void_p, _P(_Stats)]
_lib.mok_arena_create.argtypes = [ctypes.c_void_p, ctypes.c_size_t, _P(_ArenaInfo)]
_lib.mok_arena_destroy.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
_lib.mok_tensor_ptr.argtypes = [ctypes.c_void_p, _P(_Tensor)]
_lib.mok_tensor_ptr.restype = ctypes.c_void_p
_lib.mok_layer_create.argtypes = [ctypes.c_void_p, _P(_LayerDesc), _P(ctypes.c_uint64)]
_lib.mok_layer_create_tuned.argtypes = [ctypes.c_void_p, _P(_LayerDesc), _P(_LayerTuning),
                                        _P(ctypes.c_uint64)]
_lib.mok_layer_tuning_parse.argtypes = [_P(_LayerTuning), ctypes.c_char_p, ctypes.c_char_p]
_lib.mok_layer_tuning_format.argtypes = [_P(_LayerTuning), ctypes.c_char_p, ctypes.c_size_t]
_lib.mok_layer_destroy.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
_lib.mok_layer_set_weights.argtypes = [ctypes.c_void_p, ctypes.c_uint64, _P(_Tensor)]
_lib.mok_forward.argtypes = [ctypes.c_void_p, ctypes.c_uint64, _P(_Tensor), _P(_Tensor),
                             _P(_Tensor), ctypes.c_int, _P(_FwdResult)]
_lib.mok_backward.argtypes = [ctypes.c_void_p, ctypes.c_uint64, _P(_Tensor), _P(_Tensor),
                              ctypes.c_int, _P(_BwdResult)]
_lib.mok_backward_weights.argtypes = [ctypes.c_void_p, ctypes.c_uint64, _P(_Tensor),
                                      _P(_Tensor), ctypes.c_int, _P(_Tensor), _P(_BwdResult)]
_lib.mok_backward_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint64, _P(_Tensor),
                                    _P(_Tensor), ctypes.c_int, _P(_Tensor), ctypes.c_uint,
                                    _P(_BwdResult)]
BACKWARD_LAST = 1  # MOK_BACKWARD_LAST
_lib.mok_release.argtypes = [ctypes.c_void_p, _P(ctypes.c_uint64), ctypes.c_int]
_lib.mok_arena_import_cuda.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                       _P(ctypes.c_uint64), _P(ctypes.c_uint64)]
_lib.mok_set_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_lib.mok_step_status.argtypes = [ctypes.c_void_p, _P(_Tensor)]


EPROTO, ENOTSUP, EEXPERT, EDEVICE, ECONTEXT = -errno.EPROTO, -errno.ENOTSUP, -4003, -4007, -4008


def _tuning(tuning):
    """A layer's kernel options (speed and memory, never results): None, a
    string "key=value,..." or a dict {key: value}, with the keys and values
    mokctl bench --tuning takes (tiles, wgrad_tiles, clusters, order, tails,
    dx, dispatch). Returns the C struct and its canonical text; ValueError
    naming the bad item."""
    t = _LayerTuning()
    if tuning is None:
        return t, ""
    if isinstance(tuning, dict):
        text = ",".join("%s=%s" % (k, v) for k, v in tuning.items())
    elif isinstance(tuning, str):
        text = tuning
    else:
        raise TypeError("tuning: expected None, a str 'key=value,...' or a dict, got %s"
                        % type(tuning).__name__)
    err = ctypes.create_string_buffer(256)
    if _lib.mok_layer_tuning_parse(ctypes.byref(t), text.encode(), err) != 0:
        raise ValueError(err.value.decode())
    buf = ctypes.create_string_buffer(256)
    _lib.mok_layer_tuning_format(ctypes.byref(t), buf, len(buf))
    return t, buf.value.decode()


class MokError(RuntimeError):
    """A mokd call failed: `code` is the negative mok code, `name` its name."""

    def __init__(self, code, message):
        self.code = code
        self.name = _lib.mok_err_name(code).decode()
        super().__init__("%s (%s): %s" % (self.name, code, message))


def to_bf16(a):
    """float array -> uint16 bf16 bit patterns, round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), r)


def from_bf16(b):
    """uint16 bf16 bit patterns -> float32."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


_INT32 = np.iinfo(np.int32)


def _is_bfloat16(dtype):
    # ml_dtypes (and the frameworks that use it) name their 2-byte type so
    return dtype.name == "bfloat16" and dtype.itemsize == 2


def _bf16(name, a):
    """a as uint16 bf16 bit patterns: uint16 as it is, bfloat16 viewed bit for bit."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        return a
    if _is_bfloat16(a.dtype):
        return a.view(np.uint16)
    raise TypeError("%s: expected bf16: a numpy uint16 array of bf16 bit patterns "
                    "(mokd.to_bf16) or an ml_dtypes.bfloat16 array; got %s (convert with "
                    "mokd.to_bf16)" % (name, a.dtype))


def _ids(name, a):
    """a as int32 expert ids: other integer types when every id fits."""
    a = np.asarray(a)
    if a.dtype == np.int32:
        return a
    if a.dtype.kind not in "iu":
        raise TypeError("%s: expected integer expert ids (int32; other integer types are "
                        "converted when every id fits), got %s" % (name, a.dtype))
    bad = (a < _INT32.min) | (a > _INT32.max)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        where = " (token %d, k %d)" % at if len(at) == 2 else " (at %s)" % (at,)
        raise ValueError("%s: id %d%s does not fit in int32" % (name, a[at], where))
    return a.astype(np.int32)


def _f32(name, a):
    """a as float32: float16 and bfloat16 widened, which is exact."""
    a = np.asarray(a)
    if a.dtype == np.float32:
        return a
    if a.dtype == np.float16 or _is_bfloat16(a.dtype):
        return a.astype(np.float32)
    hint = ("bf16 bit patterns? convert with mokd.from_bf16" if a.dtype == np.uint16
            else "convert with .astype(np.float32)")
    raise TypeError("%s: expected float32 (float16 and bfloat16 are widened exactly), got %s; "
                    "%s" % (name, a.dtype, hint))


def _shape(name, a, want, dims):
    if a.shape != tuple(want):
        raise ValueError("%s: expected shape %s = %s, got %s" % (name, tuple(want), dims,
                                                                  a.shape))


def _view(ptr, dtype, shape):
    n = int(np.prod(shape))
    ctype = np.ctypeslib.as_ctypes_type(np.dtype(dtype))
    buf = (ctype * n).from_address(ptr)
    return np.ctypeslib.as_array(buf).reshape(shape)


class Arena:
    """Shared memory mapped by this process and the daemon."""

    def __init__(self, client, info):
        self.client, self.id, self.ptr, self.bytes = client, info.id, info.ptr, info.bytes
        self._at = 0

    def view(self, offset, dtype, shape):
        """A zero-copy numpy array at `offset` of the arena."""
        size = np.dtype(dtype).itemsize * int(np.prod(shape))
        if offset < 0 or offset + size > self.bytes:
            raise ValueError("view [%d, %d) lies outside the arena's %d bytes"
                             % (offset, offset + size, self.bytes))
        return _view(self.ptr + offset, dtype, shape)

    def alloc(self, dtype, shape):
        """The next free, 256-byte aligned array of the arena (a bump allocator)."""
        size = np.dtype(dtype).itemsize * int(np.prod(shape))
        off = (self._at + 255) // 256 * 256
        if off + size > self.bytes:
            raise MemoryError("arena %d has %d bytes; %d more do not fit"
                              % (self.id, self.bytes, size))
        self._at = off + size
        return off, self.view(off, dtype, shape)


class Client:
    """One connection to mokd. Not thread-safe: use one per thread. device: the
    GPU to run on, as this process's CUDA numbers it (torch's device index),
    or gpu_uuid: its UUID ("GPU-..." as nvidia-smi -L prints it); libmok names
    it to the daemon by UUID, so CUDA_VISIBLE_DEVICES may differ between the
    two. Neither lets a cuda daemon pick. info()["device_uuid"] says which."""

    def __init__(self, socket=None, name="python", device=None, gpu_uuid=None):
        self._h = None
        h = ctypes.c_void_p()
        sock = socket.encode() if socket else None
        if gpu_uuid is not None and device is not None:
            raise ValueError("give device or gpu_uuid, not both")
        if gpu_uuid is not None:
            rc = _lib.mok_connect_uuid(sock, name.encode(), gpu_uuid.encode(), ctypes.byref(h))
        else:
            rc = _lib.mok_connect_device(sock, name.encode(),
                                         -1 if device is None else int(device), ctypes.byref(h))
        self._h = h
        self._arenas = {}
        self._owners = weakref.WeakValueDictionary()  # id -> _Owner, while viewed
        self._dead = []  # ids whose owner is gone, to release on the next call
        if rc != 0:
            msg = _lib.mok_last_error(h).decode() if h else _lib.mok_strerror(rc).decode()
            self.close()
            raise MokError(rc, msg)

    def close(self):
        if self._h:
            _lib.mok_close(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def _check(self, rc):
        if rc != 0:
            raise MokError(rc, _lib.mok_last_error(self._h).decode())

    def info(self):
        """What the daemon said in Welcome."""
        w = _lib.mok_server_info(self._h).contents
        return {n: (getattr(w, n).decode() if isinstance(getattr(w, n), bytes) else getattr(w, n))
                for n, _ in _Welcome._fields_}

    def ping(self):
        """Round trip in seconds."""
        ns = ctypes.c_uint64()
        self._check(_lib.mok_ping(self._h, ctypes.byref(ns)))
        return ns.value * 1e-9

    def stats(self):
        self._release_dead()
        st = _Stats()
        self._check(_lib.mok_stats_get(self._h, ctypes.byref(st)))
        usage = lambda u: {n: getattr(u, n) for n, _ in _Usage._fields_}
        return {"daemon": usage(st.daemon), "session": usage(st.session),
                "uptime_s": st.uptime_ns * 1e-9, "backend": st.backend.decode()}

    def arena(self, nbytes):
        info = _ArenaInfo()
        self._check(_lib.mok_arena_create(self._h, nbytes, ctypes.byref(info)))
        a = Arena(self, info)
        self._arenas[a.id] = a
        return a

    def destroy_arena(self, arena):
        self._check(_lib.mok_arena_destroy(self._h, arena.id))
        self._arenas.pop(arena.id, None)

    def _tensor_of(self, array):
        """The wire tensor of a numpy array that is a view of one of our arenas."""
        if not isinstance(array, np.ndarray) or not array.flags["C_CONTIGUOUS"]:
            raise TypeError("expected a C-contiguous numpy array inside a mokd arena")
        dtype = {np.dtype(np.uint16): BF16, np.dtype(np.float32): F32,
                 np.dtype(np.int32): I32}.get(array.dtype)
        if dtype is None:
            raise TypeError("dtype %s has no mokd equivalent (uint16 for bf16, float32, "
                            "int32)" % array.dtype)
        ptr = array.ctypes.data
        for a in self._arenas.values():
            if a.ptr <= ptr and ptr + array.nbytes <= a.ptr + a.bytes:
                t = _Tensor(a.id, ptr - a.ptr, dtype, array.ndim)
                for i, d in enumerate(array.shape):
                    t.shape[i] = d
                return t
        return None

    def release(self, *ids):
        """Gives back forward contexts and backward results. One whose outputs
        are still viewed is given back when its last view goes (its memory
        must not become a new output while it can be read); a released
        context can no longer start a backward."""
        now = []
        for rid in ids:
            owner = self._owners.get(rid)
            if owner is None:
                now.append(rid)
            else:
                owner.released = True
        self._release_dead(now)

    def _release_dead(self, ids=()):
        """Releases ids, and those whose owners died since the last call."""
        ids = list(ids)
        while self._dead:
            ids.append(self._dead.pop())
        if ids and self._h:
            arr = (ctypes.c_uint64 * len(ids))(*ids)
            self._check(_lib.mok_release(self._h, arr, len(ids)))


class _Owner:
    """A daemon context or backward result, alive while anything refers to it:
    its Context, and every view of its outputs (through _Memory). When the
    last goes, its id is queued and the client's next call releases it: the
    last reference may go in any thread, or in the garbage collector, while
    this client is inside libmok."""

    def __init__(self, client, rid):
        self.client, self.id, self.released = client, rid, False
        client._owners[rid] = self
        weakref.finalize(self, client._dead.append, rid).atexit = False


class _Memory:
    """What np.asarray reads for a daemon output: its address, and the owner
    that every array made from it keeps alive."""

    def __init__(self, ptr, dtype, shape, owner):
        self.owner = owner
        self.__array_interface__ = {"data": (ptr, False), "shape": shape,
                                    "typestr": np.dtype(dtype).str, "version": 3}


def _out_view(owner, tensor):
    client = owner.client
    ptr = _lib.mok_tensor_ptr(client._h, ctypes.byref(tensor))
    if not ptr:
        raise MokError(EPROTO, "the daemon's output lies outside the arenas mapped here")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    return np.asarray(_Memory(ptr, _DTYPES[tensor.dtype], shape, owner))


class Context:
    """A forward's saved state and its output `out`. The daemon keeps both
    until this object and every view of `out` are gone, or, after release(),
    until the views are gone."""

    def __init__(self, owner, out, T, inference):
        self.id, self._owner, self.out, self.T, self.inference = owner.id, owner, out, T, \
            inference
        self.used = False  # a backward with last=True ran on it

    @property
    def released(self):
        return self._owner is None or self._owner.released

    def release(self):
        """No backward will follow: give the context back once `out` has no
        view left (at once when there is none)."""
        if self._owner is None:
            return
        client = self._owner.client
        self._owner.released = True
        self._owner = self.out = None
        client._release_dead()


_WNAMES = ["w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"]
_WDIMS = ["[E, I, H]", "[E, I, H]", "[E, H, I]", "[I_s, H]", "[I_s, H]", "[H, I_s]"]


class Layer:
    """A routed SwiGLU MoE layer (plus an optional shared expert) run by mokd.

    Weights are registered once and read in place each step: write new values
    into the arrays returned by `weights` (or `set_weights` again) and the next
    forward sees them. Inputs that are not already arena views are copied into
    a per-layer staging arena."""

    def __init__(self, client, hidden, intermediate, experts, top_k,
                 shared_intermediate=0, swiglu_limit=0.0, grad_mode="bf16", tuning=None):
        self.client = client
        self.H, self.I, self.E, self.K, self.I_s = hidden, intermediate, experts, top_k, \
            shared_intermediate
        modes = {"bf16": GRAD_BF16, "fp32_accum": GRAD_FP32_ACCUM}
        if grad_mode not in modes:
            raise ValueError("grad_mode: expected 'bf16' or 'fp32_accum', got %r" % (grad_mode,))
        self.grad_mode = modes[grad_mode]
        t, self.tuning = _tuning(tuning)
        d = _LayerDesc(hidden, intermediate, experts, top_k, shared_intermediate,
                       swiglu_limit, 0, 1, 0, self.grad_mode)
        lid = ctypes.c_uint64()
        client._check(_lib.mok_layer_create_tuned(client._h, ctypes.byref(d), ctypes.byref(t),
                                                  ctypes.byref(lid)))
        self.id = lid.value
        self.weights = None
        self._stage = None

    def weight_shapes(self):
        H, I, E, Is = self.H, self.I, self.E, self.I_s
        shapes = [(E, I, H), (E, I, H), (E, H, I)]
        if Is:
            shapes += [(Is, H), (Is, H), (H, Is)]
        return shapes

    def set_weights(self, *weights):
        """bf16 arrays (uint16 bit patterns or ml_dtypes.bfloat16) in the order
        w_gate, w_up, w_down[, s_gate, s_up, s_down], each of exactly its
        shape (weight_shapes()); copied into a weight arena unless they
        already live in one."""
        shapes = self.weight_shapes()
        if len(weights) != len(shapes):
            raise ValueError("set_weights: expected %d arrays (%s), got %d" % (
                len(shapes), ", ".join(_WNAMES[:len(shapes)]), len(weights)))
        weights = [_bf16(n, w) for n, w in zip(_WNAMES, weights)]
        for n, w, s, dims in zip(_WNAMES, weights, shapes, _WDIMS):
            _shape(n, w, s, dims)
        tensors = (_Tensor * _NW)()
        views = []
        need = sum((int(np.prod(s)) * 2 + 255) // 256 * 256 for s in shapes)
        arena = None
        for i, (w, s) in enumerate(zip(weights, shapes)):
            t = self.client._tensor_of(w) if w.flags["C_CONTIGUOUS"] else None
            if t is None:
                if arena is None:
                    arena = self.client.arena(need)
                _, v = arena.alloc(np.uint16, s)
                v[...] = w
                t = self.client._tensor_of(v)
                w = v
            tensors[i] = t
            views.append(w)
        self.client._check(_lib.mok_layer_set_weights(self.client._h, self.id, tensors))
        self.weights = views

    def _stage_inputs(self, arrays):
        """(tensor, array) for each input, copying into the staging arena as needed."""
        out = []
        need = sum((a.nbytes + 255) // 256 * 256 for a in arrays)
        if self._stage is None or self._stage.bytes < need:
            if self._stage is not None:
                self.client.destroy_arena(self._stage)
            self._stage = self.client.arena(max(need, 1 << 20))
        self._stage._at = 0
        for a in arrays:
            t = self.client._tensor_of(a)
            if t is None:
                _, v = self._stage.alloc(a.dtype, a.shape)
                v[...] = a
                t = self.client._tensor_of(v)
            out.append(t)
        return out

    def forward(self, x, topk_ids, topk_weights, inference=False):
        """x: bf16 [T, H]; topk_ids: int32 [T, K]; topk_weights: float32
        [T, K]. Returns (out, ctx): out is a zero-copy bf16 view that the
        daemon keeps while it (or ctx) is alive."""
        x = _bf16("x", x)
        if x.ndim != 2 or x.shape[1] != self.H or x.shape[0] < 1:
            raise ValueError("x: expected shape [T, H] = [T, %d] with T >= 1, got %s"
                             % (self.H, x.shape))
        T = x.shape[0]
        ids = _ids("topk_ids", topk_ids)
        _shape("topk_ids", ids, (T, self.K), "[T, K]")
        tw = _f32("topk_weights", topk_weights)
        _shape("topk_weights", tw, (T, self.K), "[T, K]")
        self.client._release_dead()
        tx, ti, tw_ = self._stage_inputs([np.ascontiguousarray(a) for a in (x, ids, tw)])
        res = _FwdResult()
        self.client._check(_lib.mok_forward(self.client._h, self.id, ctypes.byref(tx),
                                            ctypes.byref(ti), ctypes.byref(tw_),
                                            1 if inference else 0, ctypes.byref(res)))
        owner = _Owner(self.client, res.context)
        out = _out_view(owner, res.out)
        return out, Context(owner, out, T, bool(inference))

    def _check_grads(self, grads):
        """The wire tensors of caller gradient buffers (None: none given)."""
        shapes = self.weight_shapes()
        names = ", ".join(_WNAMES[:len(shapes)])
        fp32 = self.grad_mode == GRAD_FP32_ACCUM
        if grads is None:
            if fp32:
                raise ValueError("grads: a grad_mode='fp32_accum' layer adds into caller "
                                 "buffers; pass %d float32 arena arrays (%s)"
                                 % (len(shapes), names))
            return None
        grads = list(grads)
        if len(grads) != len(shapes):
            raise ValueError("grads: expected %d arrays (%s), got %d"
                             % (len(shapes), names, len(grads)))
        want = np.dtype(np.float32 if fp32 else np.uint16)
        gt = (_Tensor * _NW)()
        for i, (g, s) in enumerate(zip(grads, shapes)):
            name = "grads[%d] (%s)" % (i, _WNAMES[i])
            if not isinstance(g, np.ndarray) or g.dtype != want:
                raise TypeError("%s: expected %s, got %s" % (
                    name, "float32" if fp32 else "uint16 (bf16)",
                    g.dtype if isinstance(g, np.ndarray) else type(g).__name__))
            _shape(name, g, s, _WDIMS[i])
            t = self.client._tensor_of(g) if g.flags["C_CONTIGUOUS"] else None
            if t is None:
                raise TypeError("%s: must be an array in a mokd arena (Client.arena(...).alloc), "
                                "since the daemon writes into it" % name)
            gt[i] = t
        return gt

    def backward(self, ctx, d_out, grads=None, last=False):
        """ctx: the Context of a training forward; d_out: bf16 [T, H]. grads:
        the buffers to add into (fp32 arena arrays, fp32_accum layers) or to
        write to (bf16 arena arrays, optional for bf16 layers). last: this is
        ctx's last backward (as autograd's without retain_graph): the daemon
        may write over the forward's saved state and needs less GPU memory,
        and a later backward of ctx raises. Returns a dict of zero-copy views:
        d_x, d_topk_weights and, for bf16 layers without grads, the weight
        gradients; plus `result`, the daemon id behind them, kept while any of
        them is alive."""
        if not isinstance(ctx, Context):
            raise TypeError("ctx: expected the Context that forward returned, got %s"
                            % type(ctx).__name__)
        if ctx.inference:
            raise ValueError("ctx: comes from an inference forward, which keeps nothing for a "
                             "backward")
        if ctx.released:
            raise ValueError("ctx: was released")
        if ctx.used:
            raise ValueError("ctx: an earlier backward with last=True used up its saved state; "
                             "run the forward again")
        if ctx._owner.client is not self.client:
            raise ValueError("ctx: belongs to another Client")
        d_out = _bf16("d_out", d_out)
        _shape("d_out", d_out, (ctx.T, self.H), "[T, H] of the forward")
        gt = self._check_grads(grads)
        self.client._release_dead()
        (td,) = self._stage_inputs([np.ascontiguousarray(d_out)])
        res = _BwdResult()
        if last:
            ctx.used = True  # whether or not the daemon's step succeeds
        self.client._check(_lib.mok_backward_flags(self.client._h, ctx.id, ctypes.byref(td), gt,
                                                   0 if gt is None else len(grads), None,
                                                   BACKWARD_LAST if last else 0,
                                                   ctypes.byref(res)))
        owner = _Owner(self.client, res.result)
        out = {"result": res.result, "d_x": _out_view(owner, res.d_x),
               "d_topk_weights": _out_view(owner, res.d_topk_weights)}
        for i in range(res.ngrads):
            out[_WNAMES[i]] = _out_view(owner, res.grads[i])
        return out


def __getattr__(name):
    # the torch front end loads PyTorch only when asked for
    if name in ("MoELayer", "memory_stats"):
        from . import nn
        return getattr(nn, name)
    raise AttributeError("module 'mokd' has no attribute %r" % name)
