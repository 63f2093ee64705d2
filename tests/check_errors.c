/* check_errors.c - every invalid input gets its own negative code and a
 * message that names the problem; nothing is computed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"

static char err[MOK_ERRLEN];
static mokk_backend *be;
static moe_case c;
static mokk_fwd_rank fr[2];
static mokk_bwd_rank br[2];
static uint16_t *out, *dx, *g16[MOKK_NWEIGHTS];
static float *dtw;

static const mokk_shape good = {.H = 16, .I = 8, .E = 4, .K = 2, .I_s = 8, .P = 2};

static void setup(void)
{
  ck_assert_int_eq(mokk_cpu_create(1, &be, err), 0);
  case_make(&c, &good, 8, 51, ROUTE_RANDOM);
  out = calloc(8 * 16, 2), dx = calloc(8 * 16, 2), dtw = calloc(8 * 2, 4);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    g16[w] = calloc((size_t)case_weight_elems(&c, w), 2);
  for (int r = 0; r < 2; r++) {
    fr[r] = (mokk_fwd_rank){c.x + r * 4 * 16, c.ids + r * 8, c.tw + r * 8, {0},
                            out + r * 64, NULL};
    br[r] = (mokk_bwd_rank){c.d_out + r * 64, dx + r * 64, dtw + r * 8, {0}, {0}, {0}, NULL};
    for (int w = 0; w < MOKK_NWEIGHTS; w++) {
      int64_t per = w < MOKK_S_GATE ? case_weight_elems(&c, w) / 2 : 0;
      fr[r].w[w] = c.w[w] + r * per;
      br[r].g_bf16[w] = g16[w] + r * per;
    }
  }
  err[0] = 0;
}

static void teardown(void)
{
  case_free(&c);
  free(out), free(dx), free(dtw);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    free(g16[w]);
  mokk_backend_destroy(be);
}

static void expect_fwd(mokk_shape s, int64_t T, int code, const char *needle)
{
  int rc = mokk_forward(be, &s, T, fr, NULL, err);
  ck_assert_msg(rc == code, "got %d (%s), want %d (%s); message: %s", rc, mok_err_name(rc),
                code, mok_err_name(code), err);
  ck_assert_msg(strstr(err, needle) != NULL, "message \"%s\" lacks \"%s\"", err, needle);
}

START_TEST(good_input_runs)
{
  mokk_ctx *ctx;
  ck_assert_int_eq(mokk_forward(be, &good, 4, fr, &ctx, err), 0);
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_BF16, br, err), 0);
  ck_assert_uint_gt(mokk_ctx_bytes(be, ctx), 0);
  mokk_ctx_free(be, ctx);
}
END_TEST

START_TEST(rank_on_another_backend)
{
  mokk_backend *other;
  mokk_ctx *ctx;

  ck_assert_int_eq(mokk_cpu_create(1, &other, err), 0);
  fr[1].dev = be; /* the step's own backend: as NULL */
  ck_assert_int_eq(mokk_forward(be, &good, 4, fr, &ctx, err), 0);
  br[1].dev = other;
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_BF16, br, err), MOK_ENOTSUP);
  ck_assert_msg(strstr(err, "EP rank 1 names another backend") != NULL, "%s", err);
  mokk_ctx_free(be, ctx);
  fr[1].dev = other;
  expect_fwd(good, 4, MOK_ENOTSUP, "the cpu backend runs every rank of a step itself");
  fr[1].dev = NULL, br[1].dev = NULL;
  mokk_backend_destroy(other);
}
END_TEST

START_TEST(expert_id_out_of_range)
{
  c.ids[8 + 3] = 4;
  expect_fwd(good, 4, MOK_EEXPERT, "rank 1 token 1 k 1: expert id 4 is outside [0, 4) "
             "(-1: no route)");
  c.ids[8 + 3] = -2; /* -1 is a pair with no route; other negative ids are errors */
  expect_fwd(good, 4, MOK_EEXPERT, "expert id -2");
  c.ids[8 + 3] = INT32_MIN;
  expect_fwd(good, 4, MOK_EEXPERT, "expert id -2147483648");
}
END_TEST

START_TEST(experts_do_not_divide_over_ranks)
{
  mokk_shape s = good;
  s.E = 6, s.P = 4;
  expect_fwd(s, 4, MOK_EEPSIZE, "E = 6 experts do not divide over P = 4 EP ranks");
}
END_TEST

START_TEST(zero_sizes)
{
  static const char *const names[] = {"H", "I", "E", "K", "P"};
  for (int i = 0; i < 5; i++) {
    mokk_shape s = good;
    int64_t *f[] = {&s.H, &s.I, &s.E, &s.K, &s.P};
    char want[32];
    *f[i] = 0;
    snprintf(want, sizeof want, "%s is 0", names[i]);
    expect_fwd(s, 4, MOK_EZEROSIZE, want);
  }
  expect_fwd(good, 0, MOK_EZEROSIZE, "T is 0");
}
END_TEST

START_TEST(negative_and_bad_options)
{
  mokk_shape s = good;
  s.I_s = -1;
  expect_fwd(s, 4, MOK_EINVAL, "I_s is -1");
  s = good;
  s.K = 5;
  expect_fwd(s, 4, MOK_ESHAPE, "K = 5 is larger than E = 4");
  s = good;
  s.swiglu_limit = -1.0f;
  expect_fwd(s, 4, MOK_EINVAL, "swiglu_limit");
  s.swiglu_limit = NAN;
  expect_fwd(s, 4, MOK_EINVAL, "swiglu_limit");
}
END_TEST

/* Kernel options out of range are refused by name, on every backend (the
 * CPU backend runs every choice alike, but must not take a value a GPU
 * would refuse). */
START_TEST(bad_tuning)
{
  static const struct {
    mokk_tuning t;
    const char *msg;
  } bad[] = {
      {{.tiles = -1}, "tuning: tiles is -1; it must be 0 (the default) to 3"},
      {{.tiles = MOKK_TILES_COUNT}, "tuning: tiles is 4; it must be 0 (the default) to 3"},
      {{.wgrad_tiles = MOKK_TILES_TALL}, "tuning: wgrad_tiles cannot be tall (2)"},
      {{.clusters = 4}, "tuning: clusters is 4; it must be 0 (the default) to 3"},
      {{.order = 3}, "tuning: order is 3; it must be 0 (the default) to 2"},
      {{.tails = 5}, "tuning: tails is 5; it must be 0 (the default) to 4"},
      {{.dx = 3}, "tuning: dx is 3; it must be 0 (the default) to 2"},
      {{.dispatch_blocks = -3}, "tuning: dispatch_blocks is -3; it must be 0 (the default), "
                                "-1 (before gate/up), -2 (gate/up gathers its rows) or 1 to "
                                "1024 blocks beside it"},
      {{.dispatch_blocks = 1025}, "tuning: dispatch_blocks is 1025"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    mokk_shape s = good;
    s.tune = bad[i].t;
    expect_fwd(s, 4, MOK_EINVAL, bad[i].msg);
    ck_assert_int_eq(mokk_tuning_check(&bad[i].t, err), MOK_EINVAL);
  }
  ck_assert_int_eq(mokk_tuning_check(NULL, err), MOK_ENULL);
  /* the ends of each range pass */
  mokk_tuning ok = {.tiles = MOKK_TILES_PINGPONG, .wgrad_tiles = MOKK_TILES_PINGPONG,
                    .clusters = MOKK_CLUSTERS_ALL, .order = MOKK_ORDER_STATIC,
                    .tails = MOKK_TAILS_WHOLE, .dx = MOKK_DX_WHOLE,
                    .dispatch_blocks = MOKK_DISPATCH_BLOCKS_MAX};
  ck_assert_int_eq(mokk_tuning_check(&ok, err), 0);
  ok.dispatch_blocks = MOKK_DISPATCH_BEFORE;
  ck_assert_int_eq(mokk_tuning_check(&ok, err), 0);
  ok.dispatch_blocks = MOKK_DISPATCH_GATHER;
  ck_assert_int_eq(mokk_tuning_check(&ok, err), 0);
}
END_TEST

START_TEST(size_overflow)
{
  mokk_shape s = good;
  s.H = (int64_t)1 << 25;
  expect_fwd(s, 4, MOK_EOVERFLOW, "H is 33554432");
  s = good;
  s.E = s.K = (int64_t)1 << 24, s.P = 1;
  s.H = s.I = (int64_t)1 << 24;
  expect_fwd(s, 4, MOK_EOVERFLOW, "overflows");
  s = good; /* weights fit, activations P * T * K * H do not */
  s.E = s.K = s.H = (int64_t)1 << 24;
  expect_fwd(s, (int64_t)1 << 24, MOK_EOVERFLOW, "P * T * K * max(H, I)");
}
END_TEST

START_TEST(null_pointers)
{
  mokk_ctx *ctx = NULL;
  ck_assert_int_eq(mokk_forward(NULL, &good, 4, fr, NULL, err), MOK_ENULL);
  ck_assert_int_eq(mokk_forward(be, NULL, 4, fr, NULL, err), MOK_ENULL);
  ck_assert_int_eq(mokk_forward(be, &good, 4, NULL, NULL, err), MOK_ENULL);
  fr[1].x = NULL;
  expect_fwd(good, 4, MOK_ENULL, "rank 1: x, topk_ids");
  fr[1].x = c.x + 64;
  fr[0].w[MOKK_S_UP] = NULL;
  expect_fwd(good, 4, MOK_ENULL, "rank 0: weight s_up is NULL");
  fr[0].w[MOKK_S_UP] = c.w[MOKK_S_UP];

  ck_assert_int_eq(mokk_forward(be, &good, 4, fr, &ctx, err), 0);
  ck_assert_int_eq(mokk_backward(be, NULL, MOKK_GRAD_BF16, br, err), MOK_ENULL);
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_BF16, NULL, err), MOK_ENULL);
  br[1].d_out = NULL;
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_BF16, br, err), MOK_ENULL);
  ck_assert_ptr_nonnull(strstr(err, "rank 1: d_out"));
  br[1].d_out = c.d_out + 64;
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_FP32_ACCUM, br, err), MOK_ENULL);
  ck_assert_ptr_nonnull(strstr(err, "fp32 gradient of w_gate is NULL"));
  ck_assert_int_eq(mokk_backward(be, ctx, (mokk_grad_mode)7, br, err), MOK_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "gradient mode 7"));
  /* weights where they are now: all of them or none */
  br[1].w[MOKK_W_GATE] = fr[1].w[MOKK_W_GATE];
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_BF16, br, err), MOK_ENULL);
  ck_assert_msg(strstr(err, "rank 1: weight w_up is NULL but w_gate is not") != NULL, "%s",
                err);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    br[1].w[w] = fr[1].w[w];
  ck_assert_msg(mokk_backward(be, ctx, MOKK_GRAD_BF16, br, err) == 0, "%s", err);
  mokk_ctx_free(be, ctx);
  mokk_shape plain = good;
  plain.I_s = 0;
  ck_assert_int_eq(mokk_forward(be, &plain, 4, fr, &ctx, err), 0);
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_BF16, br, err), MOK_EINVAL);
  ck_assert_msg(strstr(err, "weight s_gate is set, but the layer has no shared expert") != NULL,
                "%s", err);
  memset(br[0].w, 0, sizeof br[0].w);
  memset(br[1].w, 0, sizeof br[1].w);
  mokk_ctx_free(be, ctx);
  ck_assert_int_eq(mokk_cpu_create(1, NULL, err), MOK_ENULL);
}
END_TEST

/* A context's last backward: the same bits as one that keeps the state
 * (the CPU engine keeps it either way), then no other backward of the
 * context; unknown flags are refused before anything runs. */
START_TEST(last_backward_uses_up_the_context)
{
  mokk_ctx *ctx;
  size_t n = 8 * 16 * 2;
  uint16_t *keep = malloc(n);

  ck_assert_int_eq(mokk_forward(be, &good, 4, fr, &ctx, err), 0);
  ck_assert_int_eq(mokk_backward_flags(be, ctx, MOKK_GRAD_BF16, 2, br, err), MOK_EINVAL);
  ck_assert_msg(strstr(err, "unknown backward flags 0x2") != NULL, "%s", err);
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_BF16, br, err), 0);
  memcpy(keep, dx, n);
  memset(dx, 0, n);
  ck_assert_int_eq(mokk_backward_flags(be, ctx, MOKK_GRAD_BF16, MOKK_BWD_LAST, br, err), 0);
  ck_assert(memcmp(keep, dx, n) == 0);
  ck_assert_int_eq(mokk_backward(be, ctx, MOKK_GRAD_BF16, br, err), MOK_ECONTEXT);
  ck_assert_msg(strstr(err, "used up by an earlier backward") != NULL, "%s", err);
  ck_assert_int_eq(mokk_backward_flags(be, ctx, MOKK_GRAD_BF16, MOKK_BWD_LAST, br, err),
                   MOK_ECONTEXT);
  mokk_ctx_free(be, ctx);
  free(keep);
}
END_TEST

START_TEST(error_table)
{
  static const int codes[] = {
#define XX(name, val, msg) MOK_##name,
      MOK_ERRNO_MAP(XX)
#undef XX
  };
  size_t n = sizeof codes / sizeof codes[0];
  for (size_t i = 0; i < n; i++) {
    ck_assert_int_lt(codes[i], 0);
    ck_assert_str_ne(mok_strerror(codes[i]), "unknown error");
    ck_assert_str_ne(mok_err_name(codes[i]), "MOK_EUNKNOWN");
    for (size_t j = 0; j < i; j++)
      ck_assert_int_ne(codes[i], codes[j]);
  }
  ck_assert_str_eq(mok_err_name(MOK_EEXPERT), "MOK_EEXPERT");
  ck_assert_str_eq(mok_strerror(MOK_EEPSIZE), "experts do not divide evenly over EP ranks");
  ck_assert_str_eq(mok_strerror(1), "unknown error");
}
END_TEST

Suite *errors_suite(void)
{
  Suite *s = suite_create("errors");
  TCase *tc = tcase_create("invalid_input");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, good_input_runs);
  tcase_add_test(tc, rank_on_another_backend);
  tcase_add_test(tc, expert_id_out_of_range);
  tcase_add_test(tc, experts_do_not_divide_over_ranks);
  tcase_add_test(tc, zero_sizes);
  tcase_add_test(tc, negative_and_bad_options);
  tcase_add_test(tc, bad_tuning);
  tcase_add_test(tc, size_overflow);
  tcase_add_test(tc, null_pointers);
  tcase_add_test(tc, last_backward_uses_up_the_context);
  tcase_add_test(tc, error_table);
  suite_add_tcase(s, tc);
  return s;
}
