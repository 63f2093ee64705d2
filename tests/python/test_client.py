"""The Python client against a real mokd: numpy in, zero-copy numpy out,
checked against a float64 numpy reference of the layer's math."""

import time
import unittest

import numpy as np

import mokd
from mokd_daemon import Daemon

TOL = 2.0 ** -8  # one bf16 ulp of the element + one of a typical term (see check_forward.c)


def rb(a):
    return mokd.from_bf16(mokd.to_bf16(a)).astype(np.float64)


def silu(g):
    return g / (1.0 + np.exp(-g))


def reference(x, ids, tw, w, d_out, limit=0.0):
    """float64 forward and backward, rounding to bf16 where the engine does."""
    T, H = x.shape
    K = ids.shape[1]
    out = np.zeros((T, H))
    dx = np.zeros((T, H))
    dtw = np.zeros((T, K))
    grads = [np.zeros_like(a) for a in w]

    def expert(xr, dy, wg, wu, wd, gg, gu, gd):
        g, u = xr @ wg.T, xr @ wu.T
        gc, uc = g, u
        if limit > 0:
            gc, uc = np.minimum(g, limit), np.clip(u, -limit, limit)
        h = rb(silu(gc) * uc)
        y = rb(h @ wd.T)
        if dy is None:
            return y
        dh = dy @ wd
        s = 1.0 / (1.0 + np.exp(-gc))
        dg = dh * uc * s * (1 + gc * (1 - s))
        du = dh * silu(gc)
        if limit > 0:
            dg = np.where(g > limit, 0.0, dg)
            du = np.where(np.abs(u) > limit, 0.0, du)
        gg += np.outer(dg, xr)
        gu += np.outer(du, xr)
        gd += np.outer(dy, h)
        return y, dg @ wg + du @ wu

    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            if e == -1:  # no route: the pair is absent
                continue
            y = expert(x[t], None, w[0][e], w[1][e], w[2][e], None, None, None)
            out[t] += tw[t, k] * y
            dtw[t, k] = d_out[t] @ y
            _, dxp = expert(x[t], tw[t, k] * d_out[t], w[0][e], w[1][e], w[2][e],
                            grads[0][e], grads[1][e], grads[2][e])
            dx[t] += dxp
        if len(w) == 6:
            out[t] += expert(x[t], None, w[3], w[4], w[5], None, None, None)
            _, dxs = expert(x[t], d_out[t], w[3], w[4], w[5], grads[3], grads[4], grads[5])
            dx[t] += dxs
    return out, dx, dtw, grads


def assert_close(test, ref, got, what):
    ref = np.asarray(ref, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    rms = np.sqrt(np.mean(ref ** 2))
    tol = TOL * np.abs(ref) + TOL * rms
    worst = np.max(np.abs(got - ref) / tol)
    test.assertLessEqual(worst, 1.0, "%s: worst element at %.3f x tolerance" % (what, worst))


def problem(rng, T, H, I, E, K, Is):
    x = mokd.to_bf16(rng.uniform(-1, 1, (T, H)))
    d_out = mokd.to_bf16(rng.uniform(-1, 1, (T, H)))
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
    tw = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    shapes = [(E, I, H), (E, I, H), (E, H, I)] + ([(Is, H), (Is, H), (H, Is)] if Is else [])
    w = [mokd.to_bf16(rng.uniform(-1, 1, s) * 2 / np.sqrt(s[-1])) for s in shapes]
    return x, ids, tw, w, d_out


class ClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon("mokd-py-")
        cls.sock = cls.daemon.sock

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.c = mokd.Client(self.sock, name="test")

    def tearDown(self):
        self.c.close()

    def run_layer(self, Is, limit, grad_mode="bf16", seed=0):
        T, H, I, E, K = 24, 32, 16, 6, 2
        rng = np.random.default_rng(seed)
        x, ids, tw, w, d_out = problem(rng, T, H, I, E, K, Is)
        layer = mokd.Layer(self.c, H, I, E, K, shared_intermediate=Is, swiglu_limit=limit,
                              grad_mode=grad_mode)
        layer.set_weights(*w)
        out, ctx = layer.forward(x, ids, tw)
        wf = [mokd.from_bf16(a).astype(np.float64) for a in w]
        ref = reference(mokd.from_bf16(x).astype(np.float64), ids, tw.astype(np.float64), wf,
                        mokd.from_bf16(d_out).astype(np.float64), limit)
        return layer, (x, ids, tw, w, d_out), out, ctx, ref

    def test_forward_backward_match_reference(self):
        layer, (x, ids, tw, w, d_out), out, ctx, ref = self.run_layer(Is=8, limit=0.6)
        ref_out, ref_dx, ref_dtw, ref_g = ref
        self.assertEqual(out.dtype, np.uint16)
        self.assertEqual(out.shape, (24, 32))
        assert_close(self, ref_out, mokd.from_bf16(out), "out")
        g = layer.backward(ctx, d_out)
        assert_close(self, ref_dx, mokd.from_bf16(g["d_x"]), "d_x")
        assert_close(self, ref_dtw, g["d_topk_weights"], "d_topk_weights")
        for i, name in enumerate(["w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"]):
            assert_close(self, ref_g[i], mokd.from_bf16(g[name]), name)
        self.c.release(ctx.id, g["result"])

    def test_tuned_layer_same_bits(self):
        """A layer's kernel options, as text or a dict, change no bit; a bad
        option is refused before anything is sent, naming the item."""
        T, H, I, E, K, Is = 24, 32, 16, 6, 2, 8
        x, ids, tw, w, d_out = problem(np.random.default_rng(3), T, H, I, E, K, Is)
        got = []
        for tuning in (None, "tiles=tall, order=static dispatch=before", "dispatch=gather",
                       {"wgrad_tiles": "pingpong", "tails": "own", "dispatch": 8}):
            layer = mokd.Layer(self.c, H, I, E, K, shared_intermediate=Is, tuning=tuning)
            layer.set_weights(*w)
            out, ctx = layer.forward(x, ids, tw)
            g = layer.backward(ctx, d_out)
            got.append([out.copy()] + [np.array(g[n]).copy() for n in
                                       ("d_x", "d_topk_weights", "w_gate", "w_up", "w_down",
                                        "s_gate", "s_up", "s_down")])
            self.c.release(ctx.id, g["result"])
        self.assertEqual(layer.tuning, "wgrad_tiles=pingpong,tails=own,dispatch=8")
        for other in got[1:]:
            for a, b in zip(got[0], other):
                self.assertEqual(a.tobytes(), b.tobytes())
        for bad, msg in (("tiles=huge", "tuning: tiles=huge is not one of "
                                        "auto|wide|tall|pingpong"),
                         ({"colour": "red"}, "\"colour\" is not an option"),
                         ({"dispatch": 0}, "dispatch=0 is not auto, before, gather or a number")):
            with self.assertRaises(ValueError) as cm:
                mokd.Layer(self.c, H, I, E, K, tuning=bad)
            self.assertIn(msg, str(cm.exception))
        with self.assertRaises(TypeError):
            mokd.Layer(self.c, H, I, E, K, tuning=3)

    def test_last_backward_uses_up_the_context(self):
        """last=True: the same gradients as a backward that keeps the state;
        then no other backward of the context, from the client (ValueError)
        or the daemon (a Context naming the same id: MOK_ECONTEXT)."""
        layer, (x, ids, tw, w, d_out), out, ctx, ref = self.run_layer(Is=8, limit=0.0, seed=5)
        keep = layer.backward(ctx, d_out)
        last = layer.backward(ctx, d_out, last=True)
        for name in ("d_x", "d_topk_weights", "w_gate", "w_up", "w_down", "s_gate", "s_up",
                     "s_down"):
            np.testing.assert_array_equal(keep[name], last[name], name)
        with self.assertRaises(ValueError) as cm:
            layer.backward(ctx, d_out)
        self.assertIn("used up its saved state", str(cm.exception))
        twin = mokd.Context(ctx._owner, ctx.out, ctx.T, False)  # the daemon's own check
        with self.assertRaises(mokd.MokError) as cm:
            layer.backward(twin, d_out, last=True)
        self.assertEqual(cm.exception.name, "MOK_ECONTEXT")
        self.assertIn("used up by an earlier Backward with last set", str(cm.exception))
        np.testing.assert_array_equal(mokd.from_bf16(ctx.out), mokd.from_bf16(out))

    def test_fp32_accumulate_into_arena_buffers(self):
        layer, (x, ids, tw, w, d_out), out, ctx, ref = self.run_layer(
            Is=0, limit=0.0, grad_mode="fp32_accum", seed=1)
        arena = self.c.arena(sum(a.size * 4 + 256 for a in w))
        bufs = []
        for a in w:
            _, v = arena.alloc(np.float32, a.shape)
            v[...] = 1.0
            bufs.append(v)
        layer.backward(ctx, d_out, grads=bufs)
        for i in range(3):
            assert_close(self, ref[3][i], bufs[i] - 1.0, "fp32 grad %d" % i)

    def test_weights_are_read_in_place(self):
        layer, (x, ids, tw, w, d_out), out, ctx, ref = self.run_layer(Is=0, limit=0.0, seed=2)
        first = out.copy()
        layer.weights[2][...] = mokd.to_bf16(2 * mokd.from_bf16(layer.weights[2]))
        out2, ctx2 = layer.forward(x, ids, tw)
        # doubling w_down doubles y, and so out, exactly (powers of two are exact)
        np.testing.assert_array_equal(mokd.from_bf16(out2), 2 * mokd.from_bf16(first))

    def test_outputs_are_zero_copy_views(self):
        layer, (x, ids, tw, w, d_out), out, ctx, ref = self.run_layer(Is=0, limit=0.0, seed=3)
        self.assertFalse(out.flags["OWNDATA"])
        _, ctx2 = layer.forward(x, ids, tw, inference=True)
        self.assertFalse(np.shares_memory(out, ctx2.out))  # each context owns its output
        np.testing.assert_array_equal(out, ctx2.out)        # and the bits repeat

    def test_no_route_through_the_daemon(self):
        """-1 (no route, as DeepEP and Megatron mark a pair) is an absent pair:
        out and the gradients match the reference without it, its
        d_topk_weights is 0; int64 ids with -1 are taken too."""
        T, H, I, E, K = 24, 32, 16, 6, 2
        x, ids, tw, w, d_out = problem(np.random.default_rng(7), T, H, I, E, K, 8)
        ids[3, 1] = ids[5, 0] = -1
        ids[9] = -1  # a token routed nowhere: the shared expert only
        layer = mokd.Layer(self.c, H, I, E, K, shared_intermediate=8)
        layer.set_weights(*w)
        wf = [mokd.from_bf16(a).astype(np.float64) for a in w]
        ref = reference(mokd.from_bf16(x).astype(np.float64), ids, tw.astype(np.float64), wf,
                        mokd.from_bf16(d_out).astype(np.float64))
        for i in (ids, ids.astype(np.int64)):
            out, ctx = layer.forward(x, i, tw)
            assert_close(self, ref[0], mokd.from_bf16(out), "out")
            g = layer.backward(ctx, d_out)
            assert_close(self, ref[1], mokd.from_bf16(g["d_x"]), "d_x")
            assert_close(self, ref[2], g["d_topk_weights"], "d_topk_weights")
            self.assertTrue(np.all(g["d_topk_weights"][ids == -1] == 0))
            for n, name in enumerate(["w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"]):
                assert_close(self, ref[3][n], mokd.from_bf16(g[name]), name)
        bad = ids.copy()
        bad[2, 0] = -2
        with self.assertRaises(mokd.MokError) as cm:
            layer.forward(x, bad, tw)
        self.assertIn("token 2 k 0: expert id -2 is outside [0, 6) (-1: no route)",
                      str(cm.exception))

    def test_errors_carry_code_and_message(self):
        layer, (x, ids, tw, w, d_out), out, ctx, ref = self.run_layer(Is=0, limit=0.0, seed=4)
        bad = ids.copy()
        bad[3, 1] = 6
        with self.assertRaises(mokd.MokError) as cm:
            layer.forward(x, bad, tw)
        self.assertEqual(cm.exception.code, -4003)
        self.assertEqual(cm.exception.name, "MOK_EEXPERT")
        self.assertIn("token 3 k 1: expert id 6", str(cm.exception))
        with self.assertRaises(mokd.MokError) as cm:
            mokd.Layer(self.c, 32, 16, 6, 7)
        self.assertEqual(cm.exception.name, "MOK_ESHAPE")

    def test_gpu_named_by_uuid(self):
        """GPUs are named by UUID, as nvidia-smi -L prints them; the cpu
        backend has none, and a text that is no UUID is refused before
        anything is sent."""
        with self.assertRaises(mokd.MokError) as cm:
            mokd.Client(self.sock, gpu_uuid="GPU-00000000-1111-2222-3333-444444444444")
        self.assertEqual(cm.exception.code, mokd.EDEVICE)
        self.assertIn("this daemon runs the cpu backend; it has no GPU "
                      "GPU-00000000-1111-2222-3333-444444444444", str(cm.exception))
        with self.assertRaises(mokd.MokError) as cm:
            mokd.Client(self.sock, gpu_uuid="1")
        self.assertEqual(cm.exception.name, "MOK_EINVAL")
        self.assertIn('"1" is not a GPU UUID', str(cm.exception))
        with self.assertRaises(ValueError):
            mokd.Client(self.sock, device=0, gpu_uuid="GPU-00000000-1111-2222-3333-444444444444")
        info = self.c.info()
        self.assertEqual((info["device"], info["daemon_device"], info["device_uuid"]),
                         (-1, -1, ""))

    def test_stats_return_to_zero_after_close(self):
        other = mokd.Client(self.sock, name="short-lived")
        layer = mokd.Layer(other, 32, 16, 4, 2)
        rng = np.random.default_rng(5)
        x, ids, tw, w, d_out = problem(rng, 8, 32, 16, 4, 2, 0)
        layer.set_weights(*w)
        layer.forward(x, ids, tw)
        self.assertGreater(self.c.stats()["daemon"]["arenas"], 0)
        other.close()
        for _ in range(200):
            st = self.c.stats()["daemon"]
            if st["arenas"] == 0:
                break
            time.sleep(0.01)
        self.assertEqual(st["arenas"], 0)
        self.assertEqual(st["arena_bytes"], 0)
        self.assertEqual(st["contexts"], 0)


if __name__ == "__main__":
    unittest.main()
