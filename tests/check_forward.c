/* check_forward.c - the CPU forward against the double-precision reference.
 *
 * Tolerance, per element: 2^-8 * |ref| + 2^-8 * rms(ref). The reference rounds
 * h, y and the shared expert's h and ys to bf16 where the engine does, so the
 * two differ only by (a) fp32 against double accumulation, ~1e-6 relative;
 * (b) the final bf16 rounding of out, at most half a bf16 ulp, 2^-9 * |ref|;
 * (c) an intermediate that lies next to a bf16 rounding boundary rounding the
 * other way, which moves out by one ulp of one term: 2^-8 of a typical term,
 * bounded by 2^-8 * rms(out). */
#include <stdlib.h>

#include "bf16.h"
#include "ref.h"

#define TOL_REL 0x1p-8
#define TOL_RMS 0x1p-8

static char err[MOK_ERRLEN];

static void forward_matches(mokk_shape s, int64_t T, route_kind route, uint64_t seed)
{
  mokk_backend *b;
  moe_case c;
  moe_out o;
  ref_moe m;
  double *ref, *got, ratio;

  ck_assert_int_eq(mokk_cpu_create(2, &b, err), 0);
  case_make(&c, &s, T, seed, route);
  ck_assert_msg(case_run(b, &c, 1, 0, MOKK_GRAD_BF16, 0, &o, err) == 0, "%s", err);
  case_ref(&c, 1, &m);
  ref = dvec(T * s.H);
  ref_forward(&m, ref);
  got = bf16_to_dvec(o.out, T * s.H);
  ratio = close_ratio(ref, got, T * s.H, TOL_REL, TOL_RMS);
  ck_assert_msg(ratio <= 1.0, "out differs from the reference: worst element at %.3f x "
                "tolerance", ratio);
  free(ref), free(got);
  ref_free(&m);
  out_free(&o);
  case_free(&c);
  mokk_backend_destroy(b);
}

START_TEST(routed_only)
{
  forward_matches((mokk_shape){.H = 64, .I = 32, .E = 8, .K = 2, .P = 1}, 96,
                  ROUTE_RANDOM, 1);
}
END_TEST

START_TEST(with_shared_expert)
{
  forward_matches((mokk_shape){.H = 64, .I = 48, .E = 8, .K = 2, .I_s = 80, .P = 1},
                  70, ROUTE_RANDOM, 2);
}
END_TEST

START_TEST(clamped_swiglu)
{
  forward_matches((mokk_shape){.H = 48, .I = 40, .E = 6, .K = 3, .I_s = 24, .P = 1,
                               .swiglu_limit = 0.5f},
                  50, ROUTE_RANDOM, 3);
}
END_TEST

START_TEST(odd_sizes)
{
  /* H and I not multiples of the 8 lanes or of any tile */
  forward_matches((mokk_shape){.H = 37, .I = 19, .E = 5, .K = 3, .I_s = 11, .P = 1,
                               .swiglu_limit = 0.7f},
                  33, ROUTE_RANDOM, 4);
}
END_TEST

START_TEST(empty_experts_and_one_expert)
{
  forward_matches((mokk_shape){.H = 32, .I = 16, .E = 8, .K = 2, .P = 1}, 40, ROUTE_HALF,
                  5);
  forward_matches((mokk_shape){.H = 32, .I = 16, .E = 4, .K = 1, .I_s = 8, .P = 1}, 75,
                  ROUTE_SAME, 6);
}
END_TEST

START_TEST(single_token_k_equals_e)
{
  forward_matches((mokk_shape){.H = 16, .I = 8, .E = 4, .K = 4, .I_s = 8, .P = 1}, 1,
                  ROUTE_RANDOM, 7);
}
END_TEST

START_TEST(clamp_changes_the_result)
{
  /* the limit is really applied: with it, out differs from the unclamped run */
  mokk_backend *b;
  moe_case c;
  moe_out o1, o2;
  mokk_shape s = {.H = 32, .I = 16, .E = 4, .K = 2, .P = 1};
  int64_t diff = 0;

  ck_assert_int_eq(mokk_cpu_create(1, &b, err), 0);
  case_make(&c, &s, 16, 8, ROUTE_RANDOM);
  ck_assert_int_eq(case_run(b, &c, 1, 0, MOKK_GRAD_BF16, 0, &o1, err), 0);
  c.s.swiglu_limit = 0.25f;
  ck_assert_int_eq(case_run(b, &c, 1, 0, MOKK_GRAD_BF16, 0, &o2, err), 0);
  for (int64_t i = 0; i < 16 * 32; i++)
    diff += o1.out[i] != o2.out[i];
  ck_assert_int_gt(diff, 16 * 32 / 4);
  out_free(&o1), out_free(&o2);
  case_free(&c);
  mokk_backend_destroy(b);
}
END_TEST

/* What a context holds stays within the bound a quota charges before the
 * step, and the bound is not wildly above it. */
START_TEST(context_fits_its_bound)
{
  static const mokk_shape shapes[] = {
      {.H = 64, .I = 32, .E = 8, .K = 2, .P = 1},
      {.H = 24, .I = 40, .E = 5, .K = 5, .I_s = 16, .P = 1},
      {.H = 8, .I = 8, .E = 64, .K = 1, .P = 1},
  };
  static const int64_t Ts[] = {1, 37, 300};
  mokk_backend *b;
  ck_assert_int_eq(mokk_cpu_create(2, &b, err), 0);
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
    for (size_t t = 0; t < 3; t++) {
      mokk_shape sh = shapes[i];
      moe_case c;
      mokk_ctx *ctx;
      uint16_t *out = malloc((size_t)(Ts[t] * sh.H) * 2);
      case_make(&c, &sh, Ts[t], 9, ROUTE_RANDOM);
      mokk_fwd_rank fr = {.x = c.x, .topk_ids = c.ids, .topk_weights = c.tw, .out = out};
      for (int w = 0; w < MOKK_NWEIGHTS; w++)
        fr.w[w] = c.w[w];
      ck_assert_int_eq(mokk_forward(b, &sh, Ts[t], &fr, &ctx, err), 0);
      uint64_t held = mokk_ctx_bytes(b, ctx), bound = mokk_ctx_bytes_bound(&sh, Ts[t]);
      ck_assert_msg(held <= bound && bound <= 2 * held + 8192,
                    "shape %zu T %lld: context %llu bytes, bound %llu", i, (long long)Ts[t],
                    (unsigned long long)held, (unsigned long long)bound);
      /* the cpu engine has one layout, wherever the ranks say they are */
      ck_assert_uint_eq(mokk_backend_ctx_bound(b, &sh, Ts[t], 1), bound);
      mokk_shape ep = sh;
      ep.P = 4;
      ep.E = sh.E * 4;
      ck_assert_uint_ge(mokk_ctx_bytes_bound_spread(&ep, Ts[t]),
                        4 * mokk_ctx_bytes_bound(&ep, Ts[t]));
      mokk_ctx_free(b, ctx);
      case_free(&c);
      free(out);
    }
  mokk_shape huge = {.H = 1 << 24, .I = 1 << 24, .E = 1 << 24, .K = 1 << 24, .P = 1};
  ck_assert_uint_eq(mokk_ctx_bytes_bound(&huge, 1 << 24), UINT64_MAX);
  ck_assert_uint_eq(mokk_ctx_bytes_bound_spread(&huge, 1 << 24), UINT64_MAX);
  mokk_backend_destroy(b);
}
END_TEST

Suite *forward_suite(void)
{
  Suite *s = suite_create("forward");
  TCase *tc = tcase_create("reference");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, routed_only);
  tcase_add_test(tc, with_shared_expert);
  tcase_add_test(tc, clamped_swiglu);
  tcase_add_test(tc, odd_sizes);
  tcase_add_test(tc, empty_experts_and_one_expert);
  tcase_add_test(tc, single_token_k_equals_e);
  tcase_add_test(tc, clamp_changes_the_result);
  tcase_add_test(tc, context_fits_its_bound);
  suite_add_tcase(s, tc);
  return s;
}
