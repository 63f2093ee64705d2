/* check_determinism.c - DESIGN §2.1, 2.2 and 2.4 on the CPU engine: the same
 * bits every run, for every thread count, and a token's output independent of
 * the rest of its batch. */
#include <stdlib.h>

#include "ref.h"

static char err[MOK_ERRLEN];

static const mokk_shape shape = {.H = 72, .I = 40, .E = 8, .K = 3, .I_s = 24, .P = 1,
                                 .swiglu_limit = 0.6f};

static void assert_same(const moe_case *c, const moe_out *a, const moe_out *b,
                        mokk_grad_mode mode, const char *what)
{
  int64_t TH = c->T * c->s.H;
  ck_assert_msg(memcmp(a->out, b->out, (size_t)TH * 2) == 0, "%s: out differs", what);
  ck_assert_msg(memcmp(a->d_x, b->d_x, (size_t)TH * 2) == 0, "%s: d_x differs", what);
  ck_assert_msg(memcmp(a->d_tw, b->d_tw, (size_t)(c->T * c->s.K) * 4) == 0,
                "%s: d_topk_weights differs", what);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = case_weight_elems(c, w);
    if (mode == MOKK_GRAD_BF16)
      ck_assert_msg(memcmp(a->g_bf16[w], b->g_bf16[w], (size_t)n * 2) == 0,
                    "%s: bf16 gradient %d differs", what, w);
    else
      ck_assert_msg(memcmp(a->g_f32[w], b->g_f32[w], (size_t)n * 4) == 0,
                    "%s: fp32 gradient %d differs", what, w);
  }
}

START_TEST(twenty_repeats_bitwise)
{
  mokk_backend *b;
  moe_case c;
  moe_out first, again;

  ck_assert_int_eq(mokk_cpu_create(0, &b, err), 0);
  case_make(&c, &shape, 150, 31, ROUTE_RANDOM);
  for (int mode = MOKK_GRAD_BF16; mode <= MOKK_GRAD_FP32_ACCUM; mode++) {
    ck_assert_int_eq(case_run(b, &c, 1, 1, mode, 0.5f, &first, err), 0);
    for (int rep = 0; rep < 20; rep++) {
      ck_assert_int_eq(case_run(b, &c, 1, 1, mode, 0.5f, &again, err), 0);
      assert_same(&c, &first, &again, mode, "repeat");
      out_free(&again);
    }
    out_free(&first);
  }
  case_free(&c);
  mokk_backend_destroy(b);
}
END_TEST

START_TEST(thread_counts_bitwise)
{
  static const int threads[] = {1, 2, 7};
  moe_case c;
  moe_out o[3];

  case_make(&c, &shape, 200, 32, ROUTE_RANDOM);
  for (int mode = MOKK_GRAD_BF16; mode <= MOKK_GRAD_FP32_ACCUM; mode++) {
    for (int i = 0; i < 3; i++) {
      mokk_backend *b;
      ck_assert_int_eq(mokk_cpu_create(threads[i], &b, err), 0);
      ck_assert_int_eq(mokk_cpu_threads(b), threads[i]);
      ck_assert_int_eq(case_run(b, &c, 1, 1, mode, 0, &o[i], err), 0);
      mokk_backend_destroy(b);
    }
    assert_same(&c, &o[0], &o[1], mode, "1 vs 2 threads");
    assert_same(&c, &o[0], &o[2], mode, "1 vs 7 threads");
    for (int i = 0; i < 3; i++)
      out_free(&o[i]);
  }
  case_free(&c);
}
END_TEST

START_TEST(forward_is_batch_invariant)
{
  /* each token alone, and the batch reversed, give the full batch's rows */
  const int64_t T = 40, H = shape.H, K = shape.K;
  mokk_backend *b;
  moe_case c, sub;
  moe_out full, part;

  ck_assert_int_eq(mokk_cpu_create(2, &b, err), 0);
  case_make(&c, &shape, T, 33, ROUTE_RANDOM);
  ck_assert_int_eq(case_run(b, &c, 1, 0, MOKK_GRAD_BF16, 0, &full, err), 0);

  sub = c;
  sub.x = malloc((size_t)(T * H) * 2);
  sub.ids = malloc((size_t)(T * K) * 4);
  sub.tw = malloc((size_t)(T * K) * 4);
  for (int64_t t = 0; t < T; t++) {
    memcpy(sub.x + t * H, c.x + (T - 1 - t) * H, (size_t)H * 2);
    memcpy(sub.ids + t * K, c.ids + (T - 1 - t) * K, (size_t)K * 4);
    memcpy(sub.tw + t * K, c.tw + (T - 1 - t) * K, (size_t)K * 4);
  }
  ck_assert_int_eq(case_run(b, &sub, 1, 0, MOKK_GRAD_BF16, 0, &part, err), 0);
  for (int64_t t = 0; t < T; t++)
    ck_assert_msg(memcmp(part.out + t * H, full.out + (T - 1 - t) * H, (size_t)H * 2) == 0,
                  "token %lld changed when the batch was reversed", (long long)(T - 1 - t));
  out_free(&part);

  sub.T = 1;
  for (int64_t t = 0; t < T; t += 7) {
    memcpy(sub.x, c.x + t * H, (size_t)H * 2);
    memcpy(sub.ids, c.ids + t * K, (size_t)K * 4);
    memcpy(sub.tw, c.tw + t * K, (size_t)K * 4);
    ck_assert_int_eq(case_run(b, &sub, 1, 0, MOKK_GRAD_BF16, 0, &part, err), 0);
    ck_assert_msg(memcmp(part.out, full.out + t * H, (size_t)H * 2) == 0,
                  "token %lld alone differs from the batch", (long long)t);
    out_free(&part);
  }
  free(sub.x), free(sub.ids), free(sub.tw);
  out_free(&full);
  case_free(&c);
  mokk_backend_destroy(b);
}
END_TEST

Suite *determinism_suite(void)
{
  Suite *s = suite_create("determinism");
  TCase *tc = tcase_create("bitwise");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, twenty_repeats_bitwise);
  tcase_add_test(tc, thread_counts_bitwise);
  tcase_add_test(tc, forward_is_batch_invariant);
  suite_add_tcase(s, tc);
  return s;
}
