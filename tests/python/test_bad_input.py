"""What the numpy client says about each wrong input, before anything reaches
the daemon: dtypes that used to be cast bit for bit or truncated, shapes that
used to be reshaped into the wrong layout, and misuse of contexts and
gradient buffers. Lossless conversions (other integer ids that fit int32,
float16 and bfloat16 weights of the routing, ml_dtypes.bfloat16 tensors)
must give the same bits as the canonical dtypes."""

import unittest

import numpy as np

import mokd
from mokd_daemon import Daemon
from test_client import problem

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

T, H, I, E, K = 24, 32, 16, 6, 2
BF16_HINT = ("expected bf16: a numpy uint16 array of bf16 bit patterns (mokd.to_bf16) or an "
             "ml_dtypes.bfloat16 array")


class BadInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon("mokd-bad-")

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.c = mokd.Client(self.daemon.sock, name="bad-input")
        self.x, self.ids, self.tw, self.w, self.d_out = problem(
            np.random.default_rng(0), T, H, I, E, K, 0)
        self.layer = mokd.Layer(self.c, H, I, E, K)
        self.layer.set_weights(*self.w)

    def tearDown(self):
        self.c.close()

    def refused(self, exc, message, fn, *args, **kw):
        with self.assertRaises(exc) as cm:
            fn(*args, **kw)
        self.assertEqual(str(cm.exception), message)

    def forward(self, x=None, ids=None, tw=None):
        return self.layer.forward(self.x if x is None else x, self.ids if ids is None else ids,
                                  self.tw if tw is None else tw)

    def count_forwards(self):
        return self.c.stats()["session"]["forwards"]

    # -- x --------------------------------------------------------------------

    def test_float_x_is_not_cast_to_bit_patterns(self):
        before = self.count_forwards()
        xf = mokd.from_bf16(self.x)  # float32: used to become all-NaN bit patterns
        self.refused(TypeError, "x: %s; got float32 (convert with mokd.to_bf16)" % BF16_HINT,
                     self.forward, x=xf)
        self.refused(TypeError, "x: %s; got float64 (convert with mokd.to_bf16)" % BF16_HINT,
                     self.forward, x=xf.astype(np.float64).tolist())
        self.refused(TypeError, "x: %s; got int16 (convert with mokd.to_bf16)" % BF16_HINT,
                     self.forward, x=self.x.view(np.int16))
        self.assertEqual(self.count_forwards(), before)  # nothing reached the daemon

    def test_x_shape(self):
        self.refused(ValueError, "x: expected shape [T, H] = [T, 32] with T >= 1, got (24, 33)",
                     self.forward, x=np.zeros((T, H + 1), np.uint16))
        self.refused(ValueError, "x: expected shape [T, H] = [T, 32] with T >= 1, got (768,)",
                     self.forward, x=self.x.reshape(-1))
        self.refused(ValueError, "x: expected shape [T, H] = [T, 32] with T >= 1, got (0, 32)",
                     self.forward, x=np.zeros((0, H), np.uint16))

    # -- topk_ids -------------------------------------------------------------

    def test_float_ids_are_not_truncated(self):
        self.refused(TypeError, "topk_ids: expected integer expert ids (int32; other integer "
                     "types are converted when every id fits), got float64",
                     self.forward, ids=self.ids + 0.7)
        self.refused(TypeError, "topk_ids: expected integer expert ids (int32; other integer "
                     "types are converted when every id fits), got bool",
                     self.forward, ids=self.ids > 2)

    def test_int64_ids_that_fit_are_converted(self):
        out32, _ = self.forward()
        out64, _ = self.forward(ids=self.ids.astype(np.int64))
        outu8, _ = self.forward(ids=self.ids.astype(np.uint8))
        np.testing.assert_array_equal(out64, out32)
        np.testing.assert_array_equal(outu8, out32)

    def test_int64_ids_that_do_not_fit_are_refused(self):
        ids = self.ids.astype(np.int64)
        ids[5, 1] = 2 ** 32 + 1  # used to wrap to expert 1
        self.refused(ValueError, "topk_ids: id 4294967297 (token 5, k 1) does not fit in int32",
                     self.forward, ids=ids)
        ids[5, 1] = -2 ** 31 - 1
        self.refused(ValueError, "topk_ids: id -2147483649 (token 5, k 1) does not fit in int32",
                     self.forward, ids=ids)

    def test_ids_shape(self):
        self.refused(ValueError, "topk_ids: expected shape (24, 2) = [T, K], got (24, 3)",
                     self.forward, ids=np.zeros((T, K + 1), np.int32))
        self.refused(ValueError, "topk_ids: expected shape (24, 2) = [T, K], got (23, 2)",
                     self.forward, ids=self.ids[1:])

    # -- topk_weights ---------------------------------------------------------

    def test_bf16_bit_patterns_are_not_read_as_floats(self):
        self.refused(TypeError, "topk_weights: expected float32 (float16 and bfloat16 are "
                     "widened exactly), got uint16; bf16 bit patterns? convert with "
                     "mokd.from_bf16", self.forward, tw=mokd.to_bf16(self.tw))

    def test_float64_weights_are_refused(self):
        self.refused(TypeError, "topk_weights: expected float32 (float16 and bfloat16 are "
                     "widened exactly), got float64; convert with .astype(np.float32)",
                     self.forward, tw=self.tw.astype(np.float64))
        self.refused(TypeError, "topk_weights: expected float32 (float16 and bfloat16 are "
                     "widened exactly), got int32; convert with .astype(np.float32)",
                     self.forward, tw=np.ones((T, K), np.int32))

    def test_float16_weights_are_widened_exactly(self):
        tw16 = self.tw.astype(np.float16)
        a, _ = self.forward(tw=tw16)
        b, _ = self.forward(tw=tw16.astype(np.float32))
        np.testing.assert_array_equal(a, b)

    def test_weights_shape(self):
        self.refused(ValueError, "topk_weights: expected shape (24, 2) = [T, K], got (2, 24)",
                     self.forward, tw=self.tw.T.copy())

    @unittest.skipIf(ml_dtypes is None, "ml_dtypes is not installed")
    def test_ml_dtypes_bfloat16_is_taken_bit_for_bit(self):
        xb = self.x.view(ml_dtypes.bfloat16)
        twb = self.tw.astype(ml_dtypes.bfloat16)
        a, _ = self.forward(x=xb, tw=twb)
        b, _ = self.forward(tw=twb.astype(np.float32))
        np.testing.assert_array_equal(a, b)
        layer = mokd.Layer(self.c, H, I, E, K)
        layer.set_weights(*[w.view(ml_dtypes.bfloat16) for w in self.w])
        out, ctx = layer.forward(self.x, self.ids, self.tw)
        ref, rctx = self.forward()
        np.testing.assert_array_equal(out, ref)
        g = layer.backward(ctx, self.d_out.view(ml_dtypes.bfloat16))
        rg = self.layer.backward(rctx, self.d_out)
        np.testing.assert_array_equal(g["d_x"], rg["d_x"])

    # -- set_weights ----------------------------------------------------------

    def test_float_weights_are_refused(self):
        w = [mokd.from_bf16(a) for a in self.w]
        self.refused(TypeError, "w_gate: %s; got float32 (convert with mokd.to_bf16)" % BF16_HINT,
                     self.layer.set_weights, *w)

    def test_weights_are_not_reshaped_into_another_layout(self):
        w_gate, w_up, w_down = self.w
        # the same number of elements, the wrong layout: used to be reshaped
        self.refused(ValueError, "w_gate: expected shape (6, 16, 32) = [E, I, H], got (6, 32, 16)",
                     self.layer.set_weights, w_down, w_up, w_down)
        self.refused(ValueError, "w_down: expected shape (6, 32, 16) = [E, H, I], got (6, 16, 32)",
                     self.layer.set_weights, w_gate, w_up, w_up)
        self.refused(ValueError, "w_up: expected shape (6, 16, 32) = [E, I, H], got (3072,)",
                     self.layer.set_weights, w_gate, w_up.reshape(-1), w_down)

    def test_weight_count(self):
        self.refused(ValueError, "set_weights: expected 3 arrays (w_gate, w_up, w_down), got 2",
                     self.layer.set_weights, *self.w[:2])
        shared = mokd.Layer(self.c, H, I, E, K, shared_intermediate=8)
        self.refused(ValueError, "set_weights: expected 6 arrays (w_gate, w_up, w_down, s_gate, "
                     "s_up, s_down), got 3", shared.set_weights, *self.w)

    def test_grad_mode(self):
        self.refused(ValueError, "grad_mode: expected 'bf16' or 'fp32_accum', got 'fp16'",
                     mokd.Layer, self.c, H, I, E, K, grad_mode="fp16")

    # -- backward -------------------------------------------------------------

    def test_float_d_out_is_refused(self):
        _, ctx = self.forward()
        self.refused(TypeError, "d_out: %s; got float32 (convert with mokd.to_bf16)" % BF16_HINT,
                     self.layer.backward, ctx, mokd.from_bf16(self.d_out))

    def test_d_out_shape(self):
        _, ctx = self.forward()
        self.refused(ValueError, "d_out: expected shape (24, 32) = [T, H] of the forward, "
                     "got (23, 32)", self.layer.backward, ctx, self.d_out[1:])

    def test_ctx_must_be_a_live_training_context(self):
        out, ctx = self.forward()
        self.refused(TypeError, "ctx: expected the Context that forward returned, got int",
                     self.layer.backward, ctx.id, self.d_out)
        _, inf = self.layer.forward(self.x, self.ids, self.tw, inference=True)
        self.refused(ValueError, "ctx: comes from an inference forward, which keeps nothing "
                     "for a backward", self.layer.backward, inf, self.d_out)
        ctx.release()
        self.refused(ValueError, "ctx: was released", self.layer.backward, ctx, self.d_out)
        other = mokd.Client(self.daemon.sock, name="other")
        try:
            layer2 = mokd.Layer(other, H, I, E, K)
            layer2.set_weights(*self.w)
            _, ctx2 = layer2.forward(self.x, self.ids, self.tw)
            self.refused(ValueError, "ctx: belongs to another Client", self.layer.backward, ctx2,
                         self.d_out)
        finally:
            del ctx2
            other.close()

    def test_gradient_buffers(self):
        acc = mokd.Layer(self.c, H, I, E, K, grad_mode="fp32_accum")
        acc.set_weights(*self.w)
        arena = self.c.arena(1 << 20)
        bufs = [arena.alloc(np.float32, s)[1] for s in acc.weight_shapes()]
        _, ctx = acc.forward(self.x, self.ids, self.tw)
        self.refused(ValueError, "grads: a grad_mode='fp32_accum' layer adds into caller "
                     "buffers; pass 3 float32 arena arrays (w_gate, w_up, w_down)",
                     acc.backward, ctx, self.d_out)
        self.refused(ValueError, "grads: expected 3 arrays (w_gate, w_up, w_down), got 2",
                     acc.backward, ctx, self.d_out, grads=bufs[:2])
        half = [arena.alloc(np.uint16, s)[1] for s in acc.weight_shapes()]
        self.refused(TypeError, "grads[1] (w_up): expected float32, got uint16",
                     acc.backward, ctx, self.d_out, grads=[bufs[0], half[1], bufs[2]])
        self.refused(ValueError, "grads[2] (w_down): expected shape (6, 32, 16) = [E, H, I], "
                     "got (6, 16, 32)", acc.backward, ctx, self.d_out,
                     grads=[bufs[0], bufs[1], bufs[0]])
        self.refused(TypeError, "grads[0] (w_gate): must be an array in a mokd arena "
                     "(Client.arena(...).alloc), since the daemon writes into it",
                     acc.backward, ctx, self.d_out,
                     grads=[np.zeros(bufs[0].shape, np.float32), bufs[1], bufs[2]])
        # a bf16 layer takes bf16 buffers, or none
        _, ctx16 = self.forward()
        self.refused(TypeError, "grads[0] (w_gate): expected uint16 (bf16), got float32",
                     self.layer.backward, ctx16, self.d_out, grads=bufs)
        g = self.layer.backward(ctx16, self.d_out, grads=half)
        self.assertNotIn("w_gate", g)
        self.assertTrue(np.any(half[0] != 0))


if __name__ == "__main__":
    unittest.main()
