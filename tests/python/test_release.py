"""Outputs of the numpy client are given back to the daemon when nothing
refers to them any more, and never while a view of them can still be read:
the README's training loop holds the daemon's usage flat, a view (even a
slice) keeps its output's memory from being handed to a new output, and an
explicit release waits for the views."""

import gc
import unittest

import numpy as np

import mokd
from mokd_daemon import Daemon
from test_client import problem

T, H, I, E, K = 24, 32, 16, 6, 2


class ReleaseTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon("mokd-release-")

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.c = mokd.Client(self.daemon.sock, name="release")
        self.rng = np.random.default_rng(7)
        self.x, self.ids, self.tw, self.w, self.d_out = problem(self.rng, T, H, I, E, K, 0)
        self.layer = mokd.Layer(self.c, H, I, E, K)
        self.layer.set_weights(*self.w)

    def tearDown(self):
        self.c.close()

    def held(self):
        st = self.c.stats()["session"]
        return st["contexts"], st["results"]

    def other_x(self):
        return mokd.to_bf16(self.rng.uniform(-1, 1, (T, H)))

    def test_readme_training_loop_holds_usage_flat(self):
        for step in range(6):
            out, ctx = self.layer.forward(self.x, self.ids, self.tw)
            grads = self.layer.backward(ctx, self.d_out)
            if step == 1:
                after_two = self.c.stats()["session"]["context_bytes"]
        # this step's context and result are alive; the five before were dropped
        self.assertEqual(self.held(), (1, 1))
        self.assertEqual(self.c.stats()["session"]["context_bytes"], after_two)
        del out, ctx, grads
        self.assertEqual(self.held(), (0, 0))

    def test_a_view_keeps_its_output(self):
        out = self.layer.forward(self.x, self.ids, self.tw)[0]  # the context is dropped at once
        want = out.copy()
        row = out[3]
        del out
        gc.collect()
        self.assertEqual(self.held(), (1, 0))  # the slice holds it
        for _ in range(4):  # new outputs must not land in its memory
            o, c = self.layer.forward(self.other_x(), self.ids, self.tw)
            del o, c
        np.testing.assert_array_equal(row, want[3])
        del row
        self.assertEqual(self.held(), (0, 0))

    def test_backward_views_keep_their_result(self):
        _, ctx = self.layer.forward(self.x, self.ids, self.tw)
        g = self.layer.backward(ctx, self.d_out)
        d_x, w_down = g["d_x"], g["w_down"][1:]
        want = d_x.copy(), w_down.copy()
        del g, ctx, _
        self.assertEqual(self.held(), (0, 1))
        for _ in range(3):
            o, c = self.layer.forward(self.other_x(), self.ids, self.tw)
            self.layer.backward(c, self.d_out)
        np.testing.assert_array_equal(d_x, want[0])
        np.testing.assert_array_equal(w_down, want[1])
        del d_x
        self.assertEqual(self.held(), (1, 1))  # w_down's slice, and c
        del w_down, o, c
        self.assertEqual(self.held(), (0, 0))

    def test_explicit_release_waits_for_the_views(self):
        out, ctx = self.layer.forward(self.x, self.ids, self.tw)
        want = out.copy()
        ctx.release()
        self.assertTrue(ctx.released)
        self.assertEqual(self.held(), (1, 0))  # out is still readable
        o, c = self.layer.forward(self.other_x(), self.ids, self.tw)
        np.testing.assert_array_equal(out, want)
        del out, o, c
        self.assertEqual(self.held(), (0, 0))
        ctx.release()  # twice is harmless

    def test_client_release_of_ids_waits_for_the_views(self):
        out, ctx = self.layer.forward(self.x, self.ids, self.tw)
        g = self.layer.backward(ctx, self.d_out)
        self.c.release(ctx.id, g["result"])
        self.assertEqual(self.held(), (1, 1))
        with self.assertRaises(ValueError):
            self.layer.backward(ctx, self.d_out)
        del out, ctx, g
        self.assertEqual(self.held(), (0, 0))
        with self.assertRaises(mokd.MokError):  # an id the daemon does not know
            self.c.release(123456789)

    def test_inference_outputs_are_released_too(self):
        for _ in range(3):
            out, ctx = self.layer.forward(self.x, self.ids, self.tw, inference=True)
        self.assertEqual(self.held(), (1, 0))
        del out, ctx
        self.assertEqual(self.held(), (0, 0))


if __name__ == "__main__":
    unittest.main()
