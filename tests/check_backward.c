/* check_backward.c - the CPU backward against the double-precision reference
 * (same tolerance and reasoning as check_forward.c: every gradient is a sum of
 * products whose bf16 inputs the reference shares, so the two differ by fp32
 * accumulation, the final rounding and a rare one-ulp flip of an intermediate),
 * and against central finite differences of the smooth (unrounded) function. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "ref.h"

#define TOL_REL 0x1p-8
#define TOL_RMS 0x1p-8

static char err[MOK_ERRLEN];
static const char *const wname[] = {"w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"};

static void backward_matches(mokk_shape s, int64_t T, route_kind route, uint64_t seed,
                             mokk_grad_mode mode)
{
  const float base = 0.25f; /* fp32 mode adds into buffers that start here */
  mokk_backend *b;
  moe_case c;
  moe_out o;
  ref_moe m;
  double *d_x, *d_tw, *g[MOKK_NWEIGHTS] = {0}, *got, ratio;

  ck_assert_int_eq(mokk_cpu_create(3, &b, err), 0);
  case_make(&c, &s, T, seed, route);
  ck_assert_msg(case_run(b, &c, 1, 1, mode, base, &o, err) == 0, "%s", err);
  case_ref(&c, 1, &m);
  d_x = dvec(T * s.H), d_tw = dvec(T * s.K);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    g[w] = dvec(case_weight_elems(&c, w));
  double *d_out = bf16_to_dvec(c.d_out, T * s.H);
  ref_backward(&m, d_out, d_x, d_tw, g);

  got = bf16_to_dvec(o.d_x, T * s.H);
  ratio = close_ratio(d_x, got, T * s.H, TOL_REL, TOL_RMS);
  ck_assert_msg(ratio <= 1.0, "d_x off: %.3f x tolerance", ratio);
  free(got);
  got = f32_to_dvec(o.d_tw, T * s.K);
  ratio = close_ratio(d_tw, got, T * s.K, TOL_REL, TOL_RMS);
  ck_assert_msg(ratio <= 1.0, "d_topk_weights off: %.3f x tolerance", ratio);
  free(got);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = case_weight_elems(&c, w);
    if (n == 0)
      continue;
    if (mode == MOKK_GRAD_BF16) {
      got = bf16_to_dvec(o.g_bf16[w], n);
    } else {
      got = dvec(n);
      for (int64_t i = 0; i < n; i++)
        got[i] = (double)o.g_f32[w][i] - base;
    }
    ratio = close_ratio(g[w], got, n, TOL_REL, TOL_RMS);
    ck_assert_msg(ratio <= 1.0, "grad of %s off: %.3f x tolerance", wname[w], ratio);
    free(got);
  }
  free(d_out), free(d_x), free(d_tw);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    free(g[w]);
  ref_free(&m);
  out_free(&o);
  case_free(&c);
  mokk_backend_destroy(b);
}

START_TEST(bf16_grads_with_shared)
{
  backward_matches((mokk_shape){.H = 64, .I = 48, .E = 8, .K = 2, .I_s = 40, .P = 1},
                   80, ROUTE_RANDOM, 11, MOKK_GRAD_BF16);
}
END_TEST

START_TEST(fp32_accumulate_clamped)
{
  backward_matches((mokk_shape){.H = 40, .I = 24, .E = 6, .K = 3, .I_s = 16, .P = 1,
                                .swiglu_limit = 0.5f},
                   70, ROUTE_RANDOM, 12, MOKK_GRAD_FP32_ACCUM);
}
END_TEST

START_TEST(odd_sizes_empty_experts)
{
  backward_matches((mokk_shape){.H = 37, .I = 19, .E = 8, .K = 2, .I_s = 0, .P = 1},
                   150, ROUTE_HALF, 13, MOKK_GRAD_BF16);
  backward_matches((mokk_shape){.H = 24, .I = 17, .E = 4, .K = 1, .I_s = 9, .P = 1},
                   130, ROUTE_SAME, 14, MOKK_GRAD_FP32_ACCUM);
}
END_TEST

START_TEST(bf16_mode_is_rounded_fp32_mode)
{
  /* the two gradient modes share one reduction: bf16 = round(fp32 from 0), and
   * accumulate-into adds that same fp32 value to what was there */
  mokk_shape s = {.H = 32, .I = 24, .E = 4, .K = 2, .I_s = 16, .P = 1};
  mokk_backend *b;
  moe_case c;
  moe_out ob, o0, o1;
  ck_assert_int_eq(mokk_cpu_create(2, &b, err), 0);
  case_make(&c, &s, 100, 15, ROUTE_RANDOM);
  ck_assert_int_eq(case_run(b, &c, 1, 1, MOKK_GRAD_BF16, 0, &ob, err), 0);
  ck_assert_int_eq(case_run(b, &c, 1, 1, MOKK_GRAD_FP32_ACCUM, 0.0f, &o0, err), 0);
  ck_assert_int_eq(case_run(b, &c, 1, 1, MOKK_GRAD_FP32_ACCUM, 3.0f, &o1, err), 0);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    for (int64_t i = 0; i < case_weight_elems(&c, w); i++) {
      ck_assert_uint_eq(ob.g_bf16[w][i], mokk_f32_to_bf16(o0.g_f32[w][i]));
      ck_assert(o1.g_f32[w][i] == 3.0f + o0.g_f32[w][i]);
    }
  out_free(&ob), out_free(&o0), out_free(&o1);
  case_free(&c);
  mokk_backend_destroy(b);
}
END_TEST

static void same_bits(const void *a, const void *b, int64_t n, size_t size, const char *what)
{
  ck_assert_msg(memcmp(a, b, (size_t)n * size) == 0, "%s differs", what);
}

START_TEST(pairs_with_no_route_match_the_reference)
{
  backward_matches((mokk_shape){.H = 40, .I = 24, .E = 6, .K = 3, .I_s = 16, .P = 1},
                   90, ROUTE_DROPS, 16, MOKK_GRAD_BF16);
  backward_matches((mokk_shape){.H = 37, .I = 19, .E = 8, .K = 2, .I_s = 0, .P = 1,
                                .swiglu_limit = 0.5f},
                   120, ROUTE_DROPS, 17, MOKK_GRAD_FP32_ACCUM);
}
END_TEST

/* id -1 (no route) means the pair is absent. out and d_x are then the bits
 * of the step that routes the pair to an expert with weight 0 (whose terms
 * are exact zeros), d_topk_weights is the same at every routed pair and +0
 * at the dropped ones; a token with no route at all gets out = its shared
 * expert (0 without one). Bitwise the same over 1, 2 and 4 EP ranks and any
 * thread count, weight gradients included. */
START_TEST(no_route_is_an_absent_pair)
{
  mokk_shape s = {.H = 32, .I = 24, .E = 8, .K = 3, .I_s = 16, .P = 1};
  mokk_backend *b, *b1;
  moe_case c, z;
  moe_out od, oz, op;
  const float zero = 0.0f;
  int64_t T = 88, H = s.H, K = s.K;

  ck_assert_int_eq(mokk_cpu_create(3, &b, err), 0);
  ck_assert_int_eq(mokk_cpu_create(1, &b1, err), 0);
  for (int shared = 0; shared < 2; shared++) {
    s.I_s = shared ? 16 : 0;
    case_make(&c, &s, T, 18, ROUTE_DROPS);
    case_make(&z, &s, T, 18, ROUTE_DROPS);
    for (int64_t i = 0; i < T * K; i++)
      if (z.ids[i] == MOKK_NO_ROUTE) {
        z.ids[i] = (int32_t)(i % s.E);
        z.tw[i] = 0.0f;
      }
    ck_assert_msg(case_run(b, &c, 1, 1, MOKK_GRAD_BF16, 0, &od, err) == 0, "%s", err);
    ck_assert_msg(case_run(b, &z, 1, 1, MOKK_GRAD_BF16, 0, &oz, err) == 0, "%s", err);
    same_bits(od.out, oz.out, T * H, 2, "out");
    same_bits(od.d_x, oz.d_x, T * H, 2, "d_x");
    for (int64_t i = 0; i < T * K; i++) {
      if (c.ids[i] == MOKK_NO_ROUTE)
        same_bits(&od.d_tw[i], &zero, 1, sizeof(float), "d_topk_weights of a dropped pair");
      else
        same_bits(&od.d_tw[i], &oz.d_tw[i], 1, sizeof(float), "d_topk_weights");
    }
    for (int64_t t = 3; t < T; t += 11) /* every pair of these tokens is dropped */
      for (int64_t j = 0; j < H; j++)
        if (!shared)
          ck_assert_uint_eq(od.out[t * H + j], 0);
    for (int64_t P = 1; P <= 4; P *= 2) {
      ck_assert_msg(case_run(P == 1 ? b1 : b, &c, P, 1, MOKK_GRAD_BF16, 0, &op, err) == 0,
                    "%s", err);
      same_bits(od.out, op.out, T * H, 2, "out over P ranks");
      same_bits(od.d_x, op.d_x, T * H, 2, "d_x over P ranks");
      same_bits(od.d_tw, op.d_tw, T * K, sizeof(float), "d_topk_weights over P ranks");
      for (int w = 0; w < MOKK_NWEIGHTS; w++)
        same_bits(od.g_bf16[w], op.g_bf16[w], case_weight_elems(&c, w), 2,
                  wname[w]);
      out_free(&op);
    }
    out_free(&od), out_free(&oz);
    case_free(&c), case_free(&z);
  }
  /* every pair dropped: no rows at all */
  s.I_s = 0;
  case_make(&c, &s, 8, 19, ROUTE_RANDOM);
  for (int64_t i = 0; i < 8 * K; i++)
    c.ids[i] = MOKK_NO_ROUTE;
  ck_assert_msg(case_run(b, &c, 1, 1, MOKK_GRAD_BF16, 0, &od, err) == 0, "%s", err);
  for (int64_t i = 0; i < 8 * H; i++) {
    ck_assert_uint_eq(od.out[i], 0);
    ck_assert_uint_eq(od.d_x[i], 0);
  }
  for (int64_t i = 0; i < 8 * K; i++)
    same_bits(&od.d_tw[i], &zero, 1, sizeof(float), "d_topk_weights");
  for (int w = 0; w < MOKK_S_GATE; w++)
    for (int64_t i = 0; i < case_weight_elems(&c, w); i++)
      ck_assert_uint_eq(od.g_bf16[w][i], 0);
  out_free(&od), case_free(&c);
  mokk_backend_destroy(b);
  mokk_backend_destroy(b1);
}
END_TEST

/* FSDP frees its gathered weights after the forward and gathers them again,
 * elsewhere, before the backward: a backward told where they are now gives
 * the bits of one that reads them where the forward did (while the forward's
 * memory holds NaN), over 1 and 2 EP ranks, in both gradient modes. */
START_TEST(backward_reads_moved_weights)
{
  mokk_shape s = {.H = 40, .I = 24, .E = 8, .K = 2, .I_s = 16, .P = 1, .swiglu_limit = 0.5f};
  mokk_backend *b;
  moe_case c;
  ck_assert_int_eq(mokk_cpu_create(3, &b, err), 0);
  case_make(&c, &s, 60, 16, ROUTE_RANDOM);
  for (int64_t P = 1; P <= 2; P++)
    for (int mode = MOKK_GRAD_BF16; mode <= MOKK_GRAD_FP32_ACCUM; mode++) {
      moe_out want, got;
      ck_assert_msg(case_run(b, &c, P, 1, mode, 0.5f, &want, err) == 0, "%s", err);
      ck_assert_msg(case_run_moved(b, &c, P, 1, mode, 0.5f, 1, &got, err) == 0, "%s", err);
      same_bits(want.d_x, got.d_x, c.T * s.H, 2, "d_x");
      same_bits(want.d_tw, got.d_tw, c.T * s.K, 4, "d_topk_weights");
      for (int w = 0; w < MOKK_NWEIGHTS; w++) {
        if (mode == MOKK_GRAD_BF16)
          same_bits(want.g_bf16[w], got.g_bf16[w], case_weight_elems(&c, w), 2, wname[w]);
        else
          same_bits(want.g_f32[w], got.g_f32[w], case_weight_elems(&c, w), 4, wname[w]);
      }
      out_free(&want), out_free(&got);
    }
  case_free(&c);
  mokk_backend_destroy(b);
}
END_TEST

/* loss(params) = sum d_out * out, of the smooth reference */
static double loss(const ref_moe *m, const double *d_out, double *scratch)
{
  double l = 0;
  ref_forward(m, scratch);
  for (int64_t i = 0; i < m->T * m->H; i++)
    l += d_out[i] * scratch[i];
  return l;
}

static void fd_check(const char *what, double *param, int64_t n, const double *engine,
                     const ref_moe *m, const double *d_out, double *scratch)
{
  const double eps = 1e-4;
  double *fd = dvec(n);
  for (int64_t i = 0; i < n; i++) {
    double keep = param[i];
    param[i] = keep + eps;
    double lp = loss(m, d_out, scratch);
    param[i] = keep - eps;
    double lm = loss(m, d_out, scratch);
    param[i] = keep;
    fd[i] = (lp - lm) / (2 * eps);
  }
  /* the engine rounds h, y and its outputs to bf16 where the smooth function
   * does not: a few 2^-9 relative steps along each path */
  double ratio = close_ratio(fd, engine, n, 0x1p-6, 0x1p-6);
  ck_assert_msg(ratio <= 1.0, "%s: engine gradient vs finite differences %.3f x "
                "tolerance", what, ratio);
  free(fd);
}

static void finite_differences(float limit, uint64_t seed)
{
  mokk_shape s = {.H = 8, .I = 4, .E = 4, .K = 2, .I_s = 4, .P = 1, .swiglu_limit = limit};
  int64_t T = 5;
  mokk_backend *b;
  moe_case c;
  moe_out o;
  ref_moe m;

  ck_assert_int_eq(mokk_cpu_create(1, &b, err), 0);
  case_make(&c, &s, T, seed, ROUTE_RANDOM);
  ck_assert_int_eq(case_run(b, &c, 1, 1, MOKK_GRAD_FP32_ACCUM, 0, &o, err), 0);
  case_ref(&c, 0, &m);
  double *d_out = bf16_to_dvec(c.d_out, T * s.H), *scratch = dvec(T * s.H);
  double *eng = bf16_to_dvec(o.d_x, T * s.H);
  fd_check("d_x", (double *)m.x, T * s.H, eng, &m, d_out, scratch);
  free(eng);
  eng = f32_to_dvec(o.d_tw, T * s.K);
  fd_check("d_topk_weights", (double *)m.tw, T * s.K, eng, &m, d_out, scratch);
  free(eng);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = case_weight_elems(&c, w);
    eng = f32_to_dvec(o.g_f32[w], n);
    fd_check(wname[w], (double *)m.w[w], n, eng, &m, d_out, scratch);
    free(eng);
  }
  free(d_out), free(scratch);
  ref_free(&m);
  out_free(&o);
  case_free(&c);
  mokk_backend_destroy(b);
}

START_TEST(finite_differences_plain)
{
  finite_differences(0.0f, 21);
}
END_TEST

START_TEST(finite_differences_clamped)
{
  finite_differences(0.4f, 22);
}
END_TEST

Suite *backward_suite(void)
{
  Suite *s = suite_create("backward");
  TCase *tc = tcase_create("reference");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, bf16_grads_with_shared);
  tcase_add_test(tc, fp32_accumulate_clamped);
  tcase_add_test(tc, odd_sizes_empty_experts);
  tcase_add_test(tc, bf16_mode_is_rounded_fp32_mode);
  tcase_add_test(tc, backward_reads_moved_weights);
  tcase_add_test(tc, pairs_with_no_route_match_the_reference);
  tcase_add_test(tc, no_route_is_an_absent_pair);
  suite_add_tcase(s, tc);
  tc = tcase_create("finite_differences");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, finite_differences_plain);
  tcase_add_test(tc, finite_differences_clamped);
  suite_add_tcase(s, tc);
  return s;
}
