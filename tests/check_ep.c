/* check_ep.c - DESIGN §2.3: the same global batch and experts over P = 1, 2,
 * 4, 8 virtual EP ranks give bit-identical outputs, d_x, d_topk_weights and
 * weight gradients; every rank holds the same shared-expert gradient. */
#include <stdlib.h>

#include "ref.h"

static char err[MOK_ERRLEN];

static void ep_invariant(mokk_shape s, int64_t T, route_kind route, mokk_grad_mode mode,
                         uint64_t seed)
{
  mokk_backend *b;
  moe_case c;
  moe_out base, o;
  int64_t TH = T * s.H;

  ck_assert_int_eq(mokk_cpu_create(2, &b, err), 0);
  case_make(&c, &s, T, seed, route);
  ck_assert_int_eq(case_run(b, &c, 1, 1, mode, 1.0f, &base, err), 0);
  for (int64_t P = 2; P <= 8; P *= 2) {
    ck_assert_msg(case_run(b, &c, P, 1, mode, 1.0f, &o, err) == 0, "P=%lld: %s",
                  (long long)P, err);
    ck_assert_msg(memcmp(o.out, base.out, (size_t)TH * 2) == 0, "P=%lld: out", (long long)P);
    ck_assert_msg(memcmp(o.d_x, base.d_x, (size_t)TH * 2) == 0, "P=%lld: d_x", (long long)P);
    ck_assert_msg(memcmp(o.d_tw, base.d_tw, (size_t)(T * s.K) * 4) == 0,
                  "P=%lld: d_topk_weights", (long long)P);
    for (int w = 0; w < MOKK_NWEIGHTS; w++) {
      int64_t n = case_weight_elems(&c, w);
      size_t es = mode == MOKK_GRAD_BF16 ? 2 : 4;
      const void *got = mode == MOKK_GRAD_BF16 ? (void *)o.g_bf16[w] : (void *)o.g_f32[w];
      const void *want =
          mode == MOKK_GRAD_BF16 ? (void *)base.g_bf16[w] : (void *)base.g_f32[w];
      ck_assert_msg(memcmp(got, want, (size_t)n * es) == 0, "P=%lld: gradient %d",
                    (long long)P, w);
      if (w >= MOKK_S_GATE)
        for (int64_t r = 1; r < P; r++) {
          const void *copy = mode == MOKK_GRAD_BF16
                                 ? (void *)(o.g_shared_copy[w] + r * n)
                                 : (void *)(o.g_shared_copy32[w] + r * n);
          ck_assert_msg(memcmp(copy, want, (size_t)n * es) == 0,
                        "P=%lld: rank %lld's shared gradient %d", (long long)P,
                        (long long)r, w);
        }
    }
    out_free(&o);
  }
  out_free(&base);
  case_free(&c);
  mokk_backend_destroy(b);
}

START_TEST(ep_bf16_grads)
{
  ep_invariant((mokk_shape){.H = 48, .I = 32, .E = 16, .K = 4, .I_s = 24, .P = 1,
                            .swiglu_limit = 0.7f},
               64, ROUTE_RANDOM, MOKK_GRAD_BF16, 41);
}
END_TEST

START_TEST(ep_fp32_grads_odd_tokens)
{
  /* 13 tokens a rank: chunks of the weight-gradient reduction straddle ranks */
  ep_invariant((mokk_shape){.H = 40, .I = 24, .E = 8, .K = 2, .I_s = 16, .P = 1},
               8 * 13, ROUTE_RANDOM, MOKK_GRAD_FP32_ACCUM, 42);
}
END_TEST

START_TEST(ep_empty_experts_and_hot_expert)
{
  ep_invariant((mokk_shape){.H = 32, .I = 16, .E = 16, .K = 2, .P = 1}, 8 * 20,
               ROUTE_HALF, MOKK_GRAD_BF16, 43);
  ep_invariant((mokk_shape){.H = 32, .I = 16, .E = 8, .K = 1, .I_s = 8, .P = 1}, 8 * 9,
               ROUTE_SAME, MOKK_GRAD_FP32_ACCUM, 44);
}
END_TEST

Suite *ep_suite(void)
{
  Suite *s = suite_create("ep");
  TCase *tc = tcase_create("invariance");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, ep_bf16_grads);
  tcase_add_test(tc, ep_fp32_grads_odd_tokens);
  tcase_add_test(tc, ep_empty_experts_and_hot_expert);
  suite_add_tcase(s, tc);
  return s;
}
