/* check_gpu.c - the CUDA backend against the CPU engine, in-process: forward
 * and backward in both gradient modes, odd shapes, bitwise repeatability,
 * independence from the number of blocks, batch invariance and errors.
 * Runs without fork (CK_FORK=no): CUDA is initialised once for the runner.
 * Without a GPU it says so and exits 0.
 *
 * Tolerances against the CPU engine, per tensor, |gpu - cpu| <= tol |cpu| +
 * tol rms(cpu):
 *   out, d_topk_weights: tol = 2^-7. The GPU feeds its tensor cores the same
 *     bf16 values the CPU multiplies and sums in fp32 in another order; both
 *     round the result to bf16, which may land one ulp apart (2^-8 to 2^-7
 *     relative).
 *   d_x and the weight gradients: tol = 2^-5. On top of that, the GPU rounds
 *     d_g, d_u and w * d_out to bf16 to feed the tensor cores where the CPU
 *     keeps them fp32 (as bf16 autograd does): each term of a long sum then
 *     carries up to 2^-8 relative error, about 2^-9.3 rms; the worst element
 *     of a tensor of 10^4..10^6 sits 4-5 sigma out, about 2^-7 rms, and the
 *     final bf16 roundings add up to 2^-7 |x|. That is up to 2^-6 (|x| + rms)
 *     at the tail (measured: 1.07 x 2^-6 for d_w_gate of a 1000-row
 *     expert), so 2^-5 keeps the same factor of two as the forward.
  */
#include <fcntl.h>
#include <sys/mman.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cuda/cuda_backend.h"
#include "devices.h"
#include "gpu/gemm_core.h"
#include "gpuid.h"
#include "mok.h"
#include "ref.h"

static mokk_backend *gpu, *cpu;
/* the flags of gpu_run_ranks_on's backward (last_invariance) */
static unsigned bwd_flags;


static void *dev_copy(const void *h, size_t n)
{
  void *d = NULL;
  ck_assert_int_eq(cudaMalloc(&d, n ? n : 16), cudaSuccess);
  if (h != NULL)
    ck_assert_int_eq(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), cudaSuccess);
  else
    ck_assert_int_eq(cudaMemset(d, 0, n ? n : 16), cudaSuccess);
  return d;
}

static void host_copy(void *h, const void *d, size_t n)
{
  ck_assert_int_eq(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost), cudaSuccess);
}

static void *xcalloc(int64_t n, size_t size)
{
  void *p = calloc((size_t)(n > 0 ? n : 1), size);
  ck_assert_ptr_nonnull(p);
  return p;
}

/* The case on the GPU (P = 1); outputs come back into o like case_run's.
 * move != 0: between the forward and the backward the weights are copied
 * elsewhere and their old memory is set to NaN, as FSDP frees and gathers
 * them again; the backward is told where they are now. */
static int gpu_run_moved(const moe_case *c, int bwd, mokk_grad_mode mode, float seed_grad,
                         int move, moe_out *o, char *err)
{
  const mokk_shape *s = &c->s;
  int64_t T = c->T, H = s->H, K = s->K;
  mokk_fwd_rank fr = {0};
  mokk_bwd_rank br = {0};
  mokk_ctx *ctx = NULL;
  void *dev[32] = {0};
  int nd = 0, rc;

  memset(o, 0, sizeof *o);
  o->out = xcalloc(T * H, 2);
  o->d_x = xcalloc(T * H, 2);
  o->d_tw = xcalloc(T * K, 4);
  fr.x = dev[nd++] = dev_copy(c->x, T * H * 2);
  fr.topk_ids = dev[nd++] = dev_copy(c->ids, T * K * 4);
  fr.topk_weights = dev[nd++] = dev_copy(c->tw, T * K * 4);
  fr.out = dev[nd++] = dev_copy(NULL, T * H * 2);
  br.d_out = dev[nd++] = dev_copy(c->d_out, T * H * 2);
  br.d_x = dev[nd++] = dev_copy(NULL, T * H * 2);
  br.d_topk_weights = dev[nd++] = dev_copy(NULL, T * K * 4);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = case_weight_elems(c, w);
    if (w >= MOKK_S_GATE && s->I_s == 0)
      continue;
    o->g_bf16[w] = xcalloc(n, 2);
    o->g_f32[w] = xcalloc(n, 4);
    for (int64_t i = 0; i < n; i++)
      o->g_f32[w][i] = seed_grad;
    fr.w[w] = dev[nd++] = dev_copy(c->w[w], n * 2);
    br.g_bf16[w] = dev[nd++] = dev_copy(NULL, n * 2);
    br.g_f32[w] = dev[nd++] = dev_copy(o->g_f32[w], n * 4);
  }
  rc = mokk_forward(gpu, s, T, &fr, bwd ? &ctx : NULL, err);
  if (rc == 0 && bwd && move && (rc = mokk_cuda_sync(gpu, err)) == 0)
    for (int w = 0; w < MOKK_NWEIGHTS; w++) {
      size_t n = (size_t)case_weight_elems(c, w) * 2;
      if (fr.w[w] == NULL)
        continue;
      br.w[w] = dev[nd++] = dev_copy(NULL, n);
      ck_assert_int_eq(cudaMemcpy((void *)br.w[w], fr.w[w], n, cudaMemcpyDeviceToDevice),
                       cudaSuccess);
      ck_assert_int_eq(cudaMemset((void *)fr.w[w], 0xff, n), cudaSuccess); /* NaN */
    }
  if (rc == 0 && bwd)
    rc = mokk_backward(gpu, ctx, mode, &br, err);
  mokk_ctx_free(gpu, ctx);
  if (rc == 0)
    rc = mokk_cuda_sync(gpu, err);
  else
    mokk_cuda_sync(gpu, err + strlen(err)); /* drain, keep the first message */
  host_copy(o->out, fr.out, T * H * 2);
  host_copy(o->d_x, br.d_x, T * H * 2);
  host_copy(o->d_tw, br.d_topk_weights, T * K * 4);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    if (o->g_bf16[w] == NULL)
      continue;
    int64_t n = case_weight_elems(c, w);
    host_copy(o->g_bf16[w], br.g_bf16[w], n * 2);
    host_copy(o->g_f32[w], br.g_f32[w], n * 4);
  }
  for (int i = 0; i < nd; i++)
    cudaFree(dev[i]);
  return rc;
}

static int gpu_run(const moe_case *c, int bwd, mokk_grad_mode mode, float seed_grad,
                   moe_out *o, char *err)
{
  return gpu_run_moved(c, bwd, mode, seed_grad, 0, o, err);
}

#define TOL_FWD (1.0 / 128)
#define TOL_BWD (1.0 / 32)

static void expect_close_bf16(const uint16_t *cpu_v, const uint16_t *gpu_v, int64_t n,
                              double tol, const char *what)
{
  double *a = bf16_to_dvec(cpu_v, n), *b = bf16_to_dvec(gpu_v, n);
  double r = close_ratio(a, b, n, tol, tol);
  ck_assert_msg(r <= 1.0, "%s: error ratio %.3f (> 1)", what, r);
  free(a), free(b);
}

static void expect_close_f32(const float *cpu_v, const float *gpu_v, int64_t n,
                             double tol, const char *what)
{
  double *a = f32_to_dvec(cpu_v, n), *b = f32_to_dvec(gpu_v, n);
  double r = close_ratio(a, b, n, tol, tol);
  ck_assert_msg(r <= 1.0, "%s: error ratio %.3f (> 1)", what, r);
  free(a), free(b);
}

static const char *const wname[MOKK_NWEIGHTS] = {"d_w_gate", "d_w_up", "d_w_down",
                                                  "d_s_gate", "d_s_up", "d_s_down"};

static void matches_cpu(mokk_shape s, int64_t T, route_kind route, uint64_t seed,
                        mokk_grad_mode mode)
{
  moe_case c;
  moe_out og, oc;
  char err[2 * MOK_ERRLEN] = "";
  float seed_grad = mode == MOKK_GRAD_FP32_ACCUM ? 0.25f : 0.0f;

  s.P = 1;
  case_make(&c, &s, T, seed, route);
  ck_assert_msg(case_run(cpu, &c, 1, 1, mode, seed_grad, &oc, err) == 0, "cpu: %s", err);
  ck_assert_msg(gpu_run(&c, 1, mode, seed_grad, &og, err) == 0, "gpu: %s", err);
  expect_close_bf16(oc.out, og.out, T * s.H, TOL_FWD, "out");
  expect_close_bf16(oc.d_x, og.d_x, T * s.H, TOL_BWD, "d_x");
  expect_close_f32(oc.d_tw, og.d_tw, T * s.K, TOL_FWD, "d_topk_weights");
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    if (w >= MOKK_S_GATE && s.I_s == 0)
      continue;
    int64_t n = case_weight_elems(&c, w);
    if (mode == MOKK_GRAD_BF16)
      expect_close_bf16(oc.g_bf16[w], og.g_bf16[w], n, TOL_BWD, wname[w]);
    else
      expect_close_f32(oc.g_f32[w], og.g_f32[w], n, TOL_BWD, wname[w]);
  }
  out_free(&og), out_free(&oc), case_free(&c);
}

START_TEST(small_routed)
{
  mokk_shape s = {.H = 128, .I = 64, .E = 8, .K = 2};
  matches_cpu(s, 100, ROUTE_RANDOM, 1, MOKK_GRAD_BF16);
}
END_TEST

START_TEST(shared_and_clamp)
{
  mokk_shape s = {.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 192, .swiglu_limit = 0.6f};
  matches_cpu(s, 333, ROUTE_RANDOM, 2, MOKK_GRAD_BF16);
}
END_TEST

START_TEST(fp32_accumulate)
{
  mokk_shape s = {.H = 192, .I = 128, .E = 8, .K = 3, .I_s = 64};
  matches_cpu(s, 257, ROUTE_RANDOM, 3, MOKK_GRAD_FP32_ACCUM);
}
END_TEST

START_TEST(one_token)
{
  mokk_shape s = {.H = 64, .I = 64, .E = 4, .K = 4, .I_s = 64};
  matches_cpu(s, 1, ROUTE_RANDOM, 4, MOKK_GRAD_BF16);
}
END_TEST

START_TEST(empty_experts)
{
  mokk_shape s = {.H = 128, .I = 192, .E = 16, .K = 2, .I_s = 0};
  matches_cpu(s, 130, ROUTE_HALF, 5, MOKK_GRAD_BF16);
  matches_cpu(s, 130, ROUTE_HALF, 5, MOKK_GRAD_FP32_ACCUM);
}
END_TEST

START_TEST(all_on_one_expert)
{
  mokk_shape s = {.H = 128, .I = 64, .E = 8, .K = 1, .I_s = 64};
  matches_cpu(s, 1000, ROUTE_SAME, 6, MOKK_GRAD_BF16);
}
END_TEST

START_TEST(tokens_not_tile_multiple)
{
  mokk_shape s = {.H = 320, .I = 256, .E = 32, .K = 6, .I_s = 128, .swiglu_limit = 1.5f};
  matches_cpu(s, 65, ROUTE_RANDOM, 7, MOKK_GRAD_BF16);
  matches_cpu(s, 1031, ROUTE_RANDOM, 8, MOKK_GRAD_FP32_ACCUM);
}
END_TEST

/* Experts that end a few rows past a multiple of 128: their tails ride on
 * full m-tiles (sm90/mma.cuh, riding tails). 150 rows on every expert (a tail of 22),
 * 273 (a tail of 17 over two m-tiles), then about 150 an expert, with I and H of 192, whose last n-tile is
 * partly past N. */
START_TEST(riding_tails)
{
  mokk_shape s = {.H = 192, .I = 192, .E = 4, .K = 4, .I_s = 64, .swiglu_limit = 1.5f};
  matches_cpu(s, 150, ROUTE_SAME, 14, MOKK_GRAD_BF16);
  matches_cpu(s, 273, ROUTE_SAME, 21, MOKK_GRAD_BF16); /* split over two m-tiles */
  s.K = 2;
  matches_cpu(s, 300, ROUTE_RANDOM, 15, MOKK_GRAD_BF16);
  matches_cpu(s, 300, ROUTE_RANDOM, 16, MOKK_GRAD_FP32_ACCUM);
}
END_TEST

/* Experts of more than 1024 rows: the forward without riding tails, and
 * the weight gradients on ping-pong tiles. */
START_TEST(long_experts)
{
  mokk_shape s = {.H = 192, .I = 128, .E = 2, .K = 1, .I_s = 64, .swiglu_limit = 1.5f};
  matches_cpu(s, 2500, ROUTE_RANDOM, 18, MOKK_GRAD_BF16);
}
END_TEST

/* id -1 (no route): the pair is absent, as on the CPU; it sets no error. */
START_TEST(pairs_with_no_route)
{
  mokk_shape s = {.H = 192, .I = 128, .E = 8, .K = 3, .I_s = 64, .swiglu_limit = 1.5f};
  matches_cpu(s, 300, ROUTE_DROPS, 9, MOKK_GRAD_BF16);
  matches_cpu(s, 300, ROUTE_DROPS, 9, MOKK_GRAD_FP32_ACCUM);
}
END_TEST

/* More experts a token than the combines take in one go (route.cu,
 * COMBINE_KS): out and d_x sum a token's pairs over several rounds, some
 * pairs without a route among them. */
START_TEST(many_experts_a_token)
{
  mokk_shape s = {.H = 192, .I = 64, .E = 32, .K = 12, .I_s = 64};
  matches_cpu(s, 200, ROUTE_RANDOM, 51, MOKK_GRAD_BF16);
  matches_cpu(s, 200, ROUTE_DROPS, 52, MOKK_GRAD_FP32_ACCUM);
  s.K = 17;
  matches_cpu(s, 90, ROUTE_DROPS, 53, MOKK_GRAD_BF16);
}
END_TEST

/* On the GPU too, out and d_x with a dropped pair are the bits of the step
 * that routes it with weight 0, and its d_topk_weights is +0, as the CPU's. */
START_TEST(no_route_is_an_absent_pair)
{
  mokk_shape s = {.H = 128, .I = 64, .E = 8, .K = 4, .I_s = 64};
  moe_case c, z;
  moe_out od, oz, oc;
  char err[2 * MOK_ERRLEN] = "";
  int64_t T = 200, K = s.K;

  case_make(&c, &s, T, 10, ROUTE_DROPS);
  case_make(&z, &s, T, 10, ROUTE_DROPS);
  for (int64_t i = 0; i < T * K; i++)
    if (z.ids[i] == MOKK_NO_ROUTE)
      z.ids[i] = (int32_t)(i % s.E), z.tw[i] = 0.0f;
  ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &od, err) == 0, "%s", err);
  ck_assert_msg(gpu_run(&z, 1, MOKK_GRAD_BF16, 0, &oz, err) == 0, "%s", err);
  ck_assert_msg(case_run(cpu, &c, 1, 1, MOKK_GRAD_BF16, 0, &oc, err) == 0, "%s", err);
  ck_assert(memcmp(od.out, oz.out, T * s.H * 2) == 0);
  ck_assert(memcmp(od.d_x, oz.d_x, T * s.H * 2) == 0);
  for (int64_t i = 0; i < T * K; i++) {
    if (c.ids[i] != MOKK_NO_ROUTE) {
      ck_assert(memcmp(&od.d_tw[i], &oz.d_tw[i], 4) == 0);
      continue;
    }
    ck_assert(memcmp(&od.d_tw[i], &oc.d_tw[i], 4) == 0); /* +0 on both */
    ck_assert_uint_eq(*(const uint32_t *)&od.d_tw[i], 0);
  }
  out_free(&od), out_free(&oz), out_free(&oc), case_free(&c), case_free(&z);
}
END_TEST

/* every output bit for bit: out, d_x, d_topk_weights, and each weight
 * gradient in both modes' buffers (the mode a run did not use holds its
 * seed in both) */
static void expect_same(const moe_out *a, const moe_out *b, const moe_case *c, const char *why)
{
  const mokk_shape *s = &c->s;
  ck_assert_msg(memcmp(a->out, b->out, c->T * s->H * 2) == 0, "%s: out differs", why);
  ck_assert_msg(memcmp(a->d_x, b->d_x, c->T * s->H * 2) == 0, "%s: d_x differs", why);
  ck_assert_msg(memcmp(a->d_tw, b->d_tw, c->T * s->K * 4) == 0, "%s: d_tw differs", why);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = case_weight_elems(c, w);
    if (a->g_bf16[w] != NULL)
      ck_assert_msg(memcmp(a->g_bf16[w], b->g_bf16[w], n * 2) == 0, "%s: %s differs", why,
                    wname[w]);
    if (a->g_f32[w] != NULL) /* fp32-accumulate mode */
      ck_assert_msg(memcmp(a->g_f32[w], b->g_f32[w], n * 4) == 0, "%s: fp32 %s differs", why,
                    wname[w]);
  }
}

/* The Hopper GEMM core, layout by layout, against an fp32 reference: each
 * variant, on every SM and on three blocks (each walks many tiles), with
 * the grouped tiles in static order and from the tile counter. */
START_TEST(gemm_core_layouts)
{
  static const char *names[GEMM_VARIANTS] = {"coop128", "coop256", "pingpong", "tall",  "wide2",
                                                "tall2",   "wide2r",  "wide1r",   "wide1w"};
  static const int grids[] = {0, 3};
  char msg[2048];
  double worst = 0;

  if (!gemm_core_available()) {
    printf("gemm_core_layouts: not an sm_90 GPU; the Hopper core is not used here\n");
    return;
  }
  for (int v = 0; v < GEMM_VARIANTS; v++)
    for (size_t i = 0; i < sizeof grids / sizeof grids[0]; i++)
      for (int dyn = 0; dyn < 2; dyn++) {
        int f = gemm_core_check(v, grids[i], dyn, msg, sizeof msg, &worst);
        printf("gemm_core_layouts %s grid=%d %s: %s\n", names[v], grids[i],
               dyn ? "dynamic" : "static", msg);
        ck_assert_msg(f == 0, "%s grid=%d %s: %d case(s) failed: %s", names[v], grids[i],
                      dyn ? "dynamic" : "static", f, msg);
      }
}
END_TEST

int schedule_check(char *msg, size_t len);

/* The schedule (route.cu) against a stable counting sort on the host, entry
 * for entry, over shapes that take one chunk of pairs, the most chunks, and
 * more experts than the offsets' block has threads (schedule.cu). */
START_TEST(schedule_exact)
{
  char msg[512];
  int f = schedule_check(msg, sizeof msg);
  ck_assert_msg(f == 0, "%d schedule case(s) differ from the host's; first: %s", f, msg);
}
END_TEST

int dispatch_check(char *msg, size_t len);

/* The dispatch gathers (route.cu) against the host over one to three ranks'
 * rows: xr and dy bit for bit, and the d_topk_weights the backward's gather
 * computes bit for bit those of route_dtw, which a spread step's ranks run
 * instead (dispatch.cu). */
START_TEST(dispatch_exact)
{
  char msg[512];
  int f = dispatch_check(msg, sizeof msg);
  ck_assert_msg(f == 0, "%d dispatch case(s) failed; first: %s", f, msg);
}
END_TEST

START_TEST(repeat_20_bitwise)
{
  mokk_shape s = {.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 128, .swiglu_limit = 0.8f, .P = 1};
  moe_case c;
  moe_out first, again;
  char err[2 * MOK_ERRLEN] = "";

  case_make(&c, &s, 777, 9, ROUTE_RANDOM);
  ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &first, err) == 0, "%s", err);
  for (int i = 1; i < 20; i++) {
    ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &again, err) == 0, "%s", err);
    expect_same(&first, &again, &c, "repeat");
    out_free(&again);
  }
  out_free(&first), case_free(&c);
}
END_TEST

/* FSDP frees its gathered weights after the forward and gathers them again,
 * elsewhere, before the backward: a backward told where they are now gives
 * the bits of one that reads them where the forward did, while the forward's
 * memory holds NaN; in both gradient modes. */
START_TEST(backward_reads_moved_weights)
{
  mokk_shape s = {.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 128, .swiglu_limit = 0.8f, .P = 1};
  moe_case c;
  char err[2 * MOK_ERRLEN] = "";

  case_make(&c, &s, 333, 12, ROUTE_RANDOM);
  for (int mode = MOKK_GRAD_BF16; mode <= MOKK_GRAD_FP32_ACCUM; mode++) {
    moe_out want, got;
    ck_assert_msg(gpu_run(&c, 1, mode, 0.5f, &want, err) == 0, "%s", err);
    ck_assert_msg(gpu_run_moved(&c, 1, mode, 0.5f, 1, &got, err) == 0, "%s", err);
    expect_same(&want, &got, &c, "moved weights");
    out_free(&want), out_free(&got);
  }
  case_free(&c);
}
END_TEST

START_TEST(block_count_invariance)
{
  mokk_shape s = {.H = 192, .I = 128, .E = 8, .K = 2, .I_s = 64, .P = 1};
  static const int blocks[] = {1, 3, 17, 131};
  moe_case c;
  moe_out full, less;
  char err[2 * MOK_ERRLEN] = "";

  case_make(&c, &s, 500, 10, ROUTE_RANDOM);
  mokk_cuda_set_max_blocks(gpu, 0);
  ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &full, err) == 0, "%s", err);
  for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) {
    mokk_cuda_set_max_blocks(gpu, blocks[i]);
    ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &less, err) == 0, "%s", err);
    expect_same(&full, &less, &c, "fewer blocks");
    out_free(&less);
  }
  mokk_cuda_set_max_blocks(gpu, 0);
  out_free(&full), case_free(&c);
}
END_TEST

/* The forward's grouped GEMMs take tiles from a counter or every grid-th
 * one: the same bits either way, on a full grid and on three blocks (the
 * tile ring wraps several times). Experts of about 75 rows: single blocks,
 * the kernels that take the counter. */
START_TEST(tile_order_invariance)
{
  mokk_shape s = {.H = 256, .I = 128, .E = 32, .K = 4, .I_s = 64, .P = 1};
  static const int blocks[] = {0, 3};
  moe_case c;
  moe_out dyn, fixed;
  char err[2 * MOK_ERRLEN] = "";

  case_make(&c, &s, 600, 12, ROUTE_RANDOM);
  for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) {
    mokk_cuda_set_max_blocks(gpu, blocks[i]);
    mokk_cuda_set_dynamic_tiles(gpu, 1);
    ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &dyn, err) == 0, "%s", err);
    mokk_cuda_set_dynamic_tiles(gpu, 0);
    ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &fixed, err) == 0, "%s", err);
    expect_same(&dyn, &fixed, &c, "static tile order");
    out_free(&dyn), out_free(&fixed);
  }
  mokk_cuda_set_dynamic_tiles(gpu, 1);
  mokk_cuda_set_max_blocks(gpu, 0);
  case_free(&c);
}
END_TEST

/* A tail riding on its expert's m-tiles (swapped operands) gives the bits of
 * the same rows on an m-tile of their own, forward and backward, split over
 * the last two m-tiles and whole on the last one, on a full grid and on
 * three blocks. The routings must make riding tails: experts of 129 to 160
 * rows (one m-tile: the whole tail on it, in either mode), then every
 * expert with 273 rows and with 257 (two m-tiles: a tail of 17 split 9 and
 * 8, of 1 split 1 and 0). */
static void ride_invariance_on(mokk_shape s, int64_t T, route_kind route, uint64_t seed)
{
  static const int blocks[] = {0, 3};
  static const mokk_grad_mode modes[] = {MOKK_GRAD_BF16, MOKK_GRAD_FP32_ACCUM};
  int count[8] = {0}, riding = 0;
  moe_case c;
  moe_out on, whole, off;
  char err[2 * MOK_ERRLEN] = "";

  ck_assert_int_le(s.E, 8);
  case_make(&c, &s, T, seed, route);
  for (int64_t i = 0; i < c.T * s.K; i++)
    count[c.ids[i]]++;
  for (int e = 0; e < s.E; e++)
    riding += count[e] > 128 && count[e] % 128 != 0 && count[e] % 128 <= 32;
  ck_assert_msg(riding >= 2, "the case has %d experts with a riding tail (rows %d %d %d %d)",
                riding, count[0], count[1], count[2], count[3]);
  for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++)
    for (size_t m = 0; m < 2; m++) {
      mokk_cuda_set_max_blocks(gpu, blocks[i]);
      mokk_cuda_set_ride(gpu, MOKK_RIDE_SPLIT);
      ck_assert_msg(gpu_run(&c, 1, modes[m], 0.5f, &on, err) == 0, "%s", err);
      mokk_cuda_set_ride(gpu, MOKK_RIDE_WHOLE);
      ck_assert_msg(gpu_run(&c, 1, modes[m], 0.5f, &whole, err) == 0, "%s", err);
      mokk_cuda_set_ride(gpu, MOKK_RIDE_OFF);
      ck_assert_msg(gpu_run(&c, 1, modes[m], 0.5f, &off, err) == 0, "%s", err);
      expect_same(&on, &off, &c, "tails on m-tiles of their own");
      expect_same(&whole, &off, &c, "whole tails on the last m-tile");
      out_free(&on), out_free(&whole), out_free(&off);
    }
  mokk_cuda_set_ride(gpu, MOKK_RIDE_AUTO);
  mokk_cuda_set_max_blocks(gpu, 0);
  case_free(&c);
}

START_TEST(ride_invariance)
{
  ride_invariance_on((mokk_shape){.H = 256, .I = 192, .E = 4, .K = 2, .I_s = 64, .P = 1}, 290,
                     ROUTE_RANDOM, 17);
  ride_invariance_on((mokk_shape){.H = 256, .I = 192, .E = 4, .K = 4, .I_s = 64, .P = 1}, 273,
                     ROUTE_SAME, 19);
  ride_invariance_on((mokk_shape){.H = 192, .I = 128, .E = 2, .K = 2, .I_s = 64, .P = 1}, 257,
                     ROUTE_SAME, 20);
}
END_TEST

/* The gate/up GEMMs picking each pair's row out of x (gemm_args.gather;
 * the forward's and the weight gradient's, or the forward's alone) give
 * the bits of the same GEMMs reading the rows a gather pass copied,
 * forward and backward, in both gradient modes, on a full grid and on three
 * blocks: with riding tails (experts of 129-160 rows), weight gradients on
 * ping-pong tiles (experts of a few rows, and of more than 1024) and on
 * cooperative ones, and over two virtual ranks (x of both, copied into one).
 * The rows a gather pass copies cost the forward's context nothing: they
 * lie where y is written after them, so it holds as many bytes as the one
 * whose GEMMs pick rows out of x. */
static int gpu_run_ranks_on(const moe_case *c, int P, mokk_grad_mode mode, float seed_grad,
                            mokk_backend *const *on, moe_out *o, uint64_t *held, char *err);
static int gpu_run_ranks(const moe_case *c, int P, mokk_grad_mode mode, float seed_grad,
                         moe_out *o, char *err);

START_TEST(gather_invariance)
{
  static const struct {
    mokk_shape s;
    int64_t T;
    int P;
    uint64_t seed;
  } cases[] = {
      {{.H = 256, .I = 192, .E = 4, .K = 2, .I_s = 64, .P = 1}, 290, 1, 17},
      {{.H = 192, .I = 128, .E = 2, .K = 1, .I_s = 0, .P = 1}, 2500, 1, 18},
      {{.H = 128, .I = 64, .E = 64, .K = 3, .I_s = 64, .P = 1}, 100, 1, 19},
      {{.H = 192, .I = 128, .E = 8, .K = 4, .I_s = 64, .P = 1}, 150, 2, 20},
  };
  static const int blocks[] = {0, 3};
  static const mokk_grad_mode modes[] = {MOKK_GRAD_BF16, MOKK_GRAD_FP32_ACCUM};
  char err[2 * MOK_ERRLEN] = "";

  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    moe_case c;
    case_make(&c, &cases[k].s, cases[k].T, cases[k].seed, ROUTE_RANDOM);
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++)
      for (size_t m = 0; m < 4; m++) {
        moe_out on, off;
        uint64_t held_on = 0, held_off = 0;
        mokk_cuda_set_max_blocks(gpu, blocks[i]);
        /* 1: the forward and the weight gradient pick rows; 2: the forward alone */
        mokk_cuda_set_gather(gpu, 1 + (int)(m / 2));
        ck_assert_msg(gpu_run_ranks_on(&c, cases[k].P, modes[m % 2], 0.5f, NULL, &on, &held_on,
                                       err) == 0,
                      "%s", err);
        mokk_cuda_set_gather(gpu, 0);
        ck_assert_msg(gpu_run_ranks_on(&c, cases[k].P, modes[m % 2], 0.5f, NULL, &off, &held_off,
                                       err) == 0,
                      "%s", err);
        expect_same(&on, &off, &c, "rows from a gather pass");
        ck_assert_msg(held_on > 0 && held_off == held_on,
                      "case %zu: the context holds %llu bytes with a gather pass, %llu "
                      "without", k, (unsigned long long)held_off, (unsigned long long)held_on);
        out_free(&on), out_free(&off);
      }
    case_free(&c);
  }
  mokk_cuda_set_gather(gpu, MOKK_GATHER_AUTO);
  mokk_cuda_set_max_blocks(gpu, 0);
}
END_TEST

/* The default's choice between the two (MOKK_GATHER_AUTO): the forward's
 * gate/up gathers its rows on a step of MOKK_GATHER_AUTO_ROWS rows or more
 * (over every virtual rank) whose experts have H x I <= MOKK_GATHER_AUTO_HI,
 * and the dispatch runs beside it otherwise; a layer's dispatch choice
 * overrides it either way, and every choice gives the same bits. */
START_TEST(gather_auto_rule)
{
  static const struct {
    mokk_shape s;
    int64_t T; /* over all ranks */
    int P;
    int gathers;
  } cases[] = {
      {{.H = 128, .I = 128, .E = 8, .K = 2, .P = 1}, MOKK_GATHER_AUTO_ROWS / 2, 1, 1},
      {{.H = 3072, .I = 1024, .E = 4, .K = 2, .P = 1}, MOKK_GATHER_AUTO_ROWS / 2, 1, 1},
      {{.H = 128, .I = 128, .E = 8, .K = 2, .P = 1}, MOKK_GATHER_AUTO_ROWS / 2, 2, 1},
      {{.H = 3072, .I = 1088, .E = 4, .K = 2, .P = 1}, MOKK_GATHER_AUTO_ROWS / 2, 1, 0},
      {{.H = 128, .I = 128, .E = 8, .K = 2, .P = 1}, MOKK_GATHER_AUTO_ROWS / 2 - 1, 1, 0},
  };
  static const int dispatch[] = {MOKK_DISPATCH_BEFORE, MOKK_GATHER_AHEAD_DEFAULT,
                                 MOKK_DISPATCH_GATHER};
  char err[2 * MOK_ERRLEN] = "";

  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    moe_case c;
    moe_out ref;
    mokk_tuning got;
    case_make(&c, &cases[k].s, cases[k].T, 60 + k, ROUTE_RANDOM);
    ck_assert_msg(gpu_run_ranks(&c, cases[k].P, MOKK_GRAD_BF16, 0.5f, &ref, err) == 0, "%s",
                  err);
    mokk_cuda_step_tuning(gpu, &got);
    ck_assert_msg(got.dispatch_blocks == (cases[k].gathers ? MOKK_DISPATCH_GATHER
                                                           : MOKK_GATHER_AHEAD_DEFAULT),
                  "case %zu: the default chose dispatch %d", k, got.dispatch_blocks);
    for (size_t d = 0; d < sizeof dispatch / sizeof dispatch[0]; d++) {
      moe_out on;
      c.s.tune.dispatch_blocks = dispatch[d];
      ck_assert_msg(gpu_run_ranks(&c, cases[k].P, MOKK_GRAD_BF16, 0.5f, &on, err) == 0, "%s",
                    err);
      mokk_cuda_step_tuning(gpu, &got);
      ck_assert_int_eq(got.dispatch_blocks, dispatch[d]);
      expect_same(&on, &ref, &c, "a layer's dispatch over the default's");
      out_free(&on);
    }
    out_free(&ref);
    case_free(&c);
  }
}
END_TEST

/* The forward's dispatch running beside gate/up on a few blocks
 * (mokk_cuda_set_gather_ahead), the GEMM waiting for each expert's rows,
 * gives the bits of the dispatch run before it: on one dispatch block (the
 * GEMM mostly waits) and on five, with the GEMM on the full grid and on
 * three blocks; with experts of no rows, riding tails and dsv3-wide rows
 * (H 7168: four workers of three row slots a dispatch block). */
START_TEST(gather_ahead_invariance)
{
  static const struct {
    mokk_shape s;
    int64_t T;
    uint64_t seed;
    route_kind route;
  } cases[] = {
      {{.H = 256, .I = 192, .E = 4, .K = 2, .I_s = 64, .P = 1}, 290, 21, ROUTE_RANDOM},
      {{.H = 512, .I = 128, .E = 16, .K = 4, .I_s = 0, .P = 1}, 3000, 22, ROUTE_RANDOM},
      {{.H = 128, .I = 64, .E = 64, .K = 3, .I_s = 64, .P = 1}, 10, 23, ROUTE_RANDOM},
      {{.H = 7168, .I = 64, .E = 4, .K = 2, .I_s = 0, .P = 1}, 200, 25, ROUTE_SAME},
  };
  static const int blocks[] = {0, 3}, ahead[] = {1, 5};
  char err[2 * MOK_ERRLEN] = "";

  mokk_cuda_set_gather(gpu, 0); /* a dispatch, whatever the default's rule */
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    moe_case c;
    moe_out off;
    case_make(&c, &cases[k].s, cases[k].T, cases[k].seed, cases[k].route);
    mokk_cuda_set_gather_ahead(gpu, 0);
    ck_assert_msg(gpu_run_ranks(&c, 1, MOKK_GRAD_BF16, 0.5f, &off, err) == 0, "%s", err);
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++)
      for (size_t j = 0; j < sizeof ahead / sizeof ahead[0]; j++) {
        moe_out on;
        mokk_cuda_set_max_blocks(gpu, blocks[i]);
        mokk_cuda_set_gather_ahead(gpu, ahead[j]);
        ck_assert_msg(gpu_run_ranks(&c, 1, MOKK_GRAD_BF16, 0.5f, &on, err) == 0, "%s", err);
        expect_same(&on, &off, &c, "the dispatch beside gate/up");
        out_free(&on);
      }
    mokk_cuda_set_max_blocks(gpu, 0);
    out_free(&off);
    case_free(&c);
  }
  mokk_cuda_set_gather_ahead(gpu, MOKK_GATHER_AHEAD_DEFAULT);
  mokk_cuda_set_gather(gpu, MOKK_GATHER_AUTO);
}
END_TEST

/* The gather passes token by token (mokk_cuda_set_gather_tokens: a row of
 * x read once, stored to its K rows) give the bits of the passes that walk
 * the rows they write: the forward's dispatch before gate/up and the
 * backward's rows of x again, on the full grid and on three blocks, in both
 * gradient modes; with pairs and whole tokens routed nowhere (slot -1),
 * over two virtual ranks (the rows of both) and on the spread layout (each
 * rank's rows of the one schedule), and dsv3-wide rows (H 7168: a last
 * batch of chunks that ends early). */
START_TEST(gather_order_invariance)
{
  static const struct {
    mokk_shape s;
    int64_t T;
    int P, spread;
    uint64_t seed;
    route_kind route;
  } cases[] = {
      {{.H = 256, .I = 192, .E = 4, .K = 2, .I_s = 64, .P = 1}, 290, 1, 0, 61, ROUTE_RANDOM},
      {{.H = 512, .I = 128, .E = 16, .K = 4, .I_s = 0, .P = 1}, 700, 1, 0, 62, ROUTE_DROPS},
      {{.H = 192, .I = 128, .E = 8, .K = 4, .I_s = 64, .P = 1}, 150, 2, 0, 63, ROUTE_RANDOM},
      {{.H = 192, .I = 128, .E = 8, .K = 4, .I_s = 64, .P = 1}, 150, 2, 1, 64, ROUTE_DROPS},
      {{.H = 7168, .I = 64, .E = 4, .K = 2, .I_s = 0, .P = 1}, 200, 1, 0, 65, ROUTE_RANDOM},
  };
  static const int blocks[] = {0, 3};
  static const mokk_grad_mode modes[] = {MOKK_GRAD_BF16, MOKK_GRAD_FP32_ACCUM};
  char err[2 * MOK_ERRLEN] = "";

  mokk_cuda_set_gather(gpu, 0); /* gather passes, whatever the default's rule */
  mokk_cuda_set_gather_ahead(gpu, 0);
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    moe_case c;
    case_make(&c, &cases[k].s, cases[k].T, cases[k].seed, cases[k].route);
    mokk_cuda_set_spread(gpu, cases[k].spread);
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++)
      for (size_t m = 0; m < 2; m++) {
        moe_out rows, tokens;
        mokk_cuda_set_max_blocks(gpu, blocks[i]);
        /* token by token first: the spread layout keeps its rows of x in
         * memory the pool hands out again, where the other order's run
         * would have left the right bytes */
        mokk_cuda_set_gather_tokens(gpu, 1);
        ck_assert_msg(gpu_run_ranks(&c, cases[k].P, modes[m], 0.5f, &tokens, err) == 0, "%s",
                      err);
        mokk_cuda_set_gather_tokens(gpu, 0);
        ck_assert_msg(gpu_run_ranks(&c, cases[k].P, modes[m], 0.5f, &rows, err) == 0, "%s",
                      err);
        expect_same(&tokens, &rows, &c, "the gather passes token by token");
        out_free(&rows), out_free(&tokens);
      }
    case_free(&c);
  }
  mokk_cuda_set_gather_tokens(gpu, MOKK_GATHER_TOKENS_DEFAULT);
  mokk_cuda_set_spread(gpu, 0);
  mokk_cuda_set_max_blocks(gpu, 0);
  mokk_cuda_set_gather_ahead(gpu, MOKK_GATHER_AHEAD_DEFAULT);
  mokk_cuda_set_gather(gpu, MOKK_GATHER_AUTO);
}
END_TEST

/* The forward's and the weight gradients' epilogues through shared memory
 * (the default) against stores from registers, the weight gradients'
 * 128 x 256 tiles through a staging area, their last stage or their last
 * two, the forward on pairs of blocks against single blocks, and d_x in
 * column halves (the default) against whole rows: the same bits for every
 * output. Experts of 145, 750 and 50 rows on average:
 * riding tails, whole m-tiles, and 64-row blocks that end past their
 * expert's rows (stored from registers either way); H = 384 halves into
 * 256 and 128 columns. */
START_TEST(epilogue_invariance)
{
  static const struct {
    mokk_shape s;
    int64_t T;
    uint64_t seed;
  } cases[] = {
      {{.H = 256, .I = 192, .E = 4, .K = 2, .I_s = 64, .P = 1}, 290, 31},
      {{.H = 512, .I = 128, .E = 16, .K = 4, .I_s = 0, .P = 1}, 3000, 32},
      {{.H = 384, .I = 256, .E = 8, .K = 2, .I_s = 64, .P = 1}, 200, 33},
  };
  static const struct {
    int regs, clusters, halves, keep;
    const char *what;
  } runs[] = {
      {1, 1, 1, -1, "the stores from registers"},
      {0, 2, 1, -1, "the forward on pairs"},
      {1, 2, 1, -1, "the forward on pairs, the stores from registers"},
      {0, 1, 0, -1, "d_x in whole rows"},
      {0, 1, 1, 0, "the weight gradients' stores through a staging area"},
      {0, 1, 1, 1, "the weight gradients' stores through their last stage and half a staging area"},
      {0, 1, 1, 2, "the weight gradients' stores through their last two stages"},
  };
  char err[2 * MOK_ERRLEN] = "";

  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    moe_case c;
    moe_out ref;
    case_make(&c, &cases[k].s, cases[k].T, cases[k].seed, ROUTE_RANDOM);
    ck_assert_msg(gpu_run_ranks(&c, 1, MOKK_GRAD_BF16, 0.5f, &ref, err) == 0, "%s", err);
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
      moe_out on;
      mokk_cuda_set_store_regs(gpu, runs[i].regs);
      mokk_cuda_set_clusters(gpu, runs[i].clusters);
      mokk_cuda_set_dx_halves(gpu, runs[i].halves);
      mokk_cuda_set_wgrad_keep(gpu, runs[i].keep);
      ck_assert_msg(gpu_run_ranks(&c, 1, MOKK_GRAD_BF16, 0.5f, &on, err) == 0, "%s", err);
      expect_same(&on, &ref, &c, runs[i].what);
      out_free(&on);
    }
    mokk_cuda_set_store_regs(gpu, 0);
    mokk_cuda_set_clusters(gpu, 1);
    mokk_cuda_set_dx_halves(gpu, 1);
    mokk_cuda_set_wgrad_keep(gpu, -1);
    out_free(&ref);
    case_free(&c);
  }
}
END_TEST

/* A layer's kernel options (mokk_shape.tune) are its steps' choices over
 * the backend's defaults and change no bit: every tile shape (forward, data
 * and weight gradients), clusters none or everywhere, static order, tails
 * of their own, split or whole, the dispatch before gate/up, on three
 * blocks or none (gate/up gathering its rows; on tall tiles, which do not
 * gather, the default's dispatch), d_x in whole rows. Each step runs with
 * what its layer chose (mokk_cuda_step_tuning), and a layer that chooses
 * nothing runs on the defaults again. Experts of 145, 750 and 1500 rows on
 * average (the weight gradients' auto choice takes ping-pong tiles for the
 * last). */
START_TEST(layer_tuning_invariance)
{
  static const struct {
    mokk_shape s;
    int64_t T;
    uint64_t seed;
  } cases[] = {
      {{.H = 256, .I = 192, .E = 4, .K = 2, .I_s = 64, .P = 1}, 290, 41},
      {{.H = 384, .I = 256, .E = 8, .K = 2, .I_s = 0, .P = 1}, 3000, 42},
      {{.H = 128, .I = 128, .E = 2, .K = 1, .I_s = 64, .P = 1}, 3000, 43},
  };
  static const mokk_tuning tunes[] = {
      {.tiles = MOKK_TILES_TALL},
      {.tiles = MOKK_TILES_TALL, .clusters = MOKK_CLUSTERS_NONE},
      {.tiles = MOKK_TILES_PINGPONG, .wgrad_tiles = MOKK_TILES_WIDE},
      {.tiles = MOKK_TILES_WIDE, .wgrad_tiles = MOKK_TILES_PINGPONG},
      {.clusters = MOKK_CLUSTERS_NONE, .order = MOKK_ORDER_STATIC},
      {.clusters = MOKK_CLUSTERS_ALL, .order = MOKK_ORDER_DYNAMIC},
      {.tails = MOKK_TAILS_OWN},
      {.tails = MOKK_TAILS_SPLIT},
      {.tails = MOKK_TAILS_WHOLE, .clusters = MOKK_CLUSTERS_DGRAD},
      {.tails = MOKK_TAILS_RIDE, .dispatch_blocks = 3},
      {.dx = MOKK_DX_WHOLE, .dispatch_blocks = MOKK_DISPATCH_BEFORE},
      {.dx = MOKK_DX_HALVES, .order = MOKK_ORDER_STATIC, .dispatch_blocks = 1},
      {.dispatch_blocks = MOKK_DISPATCH_GATHER},
      {.tiles = MOKK_TILES_TALL, .dispatch_blocks = MOKK_DISPATCH_GATHER},
      {.tails = MOKK_TAILS_SPLIT, .dispatch_blocks = MOKK_DISPATCH_GATHER},
  };
  /* the backend's defaults, as a step reports them */
  const mokk_tuning dflt = {.tiles = MOKK_TILES_AUTO, .wgrad_tiles = MOKK_TILES_AUTO,
                            .clusters = MOKK_CLUSTERS_DGRAD, .order = MOKK_ORDER_DYNAMIC,
                            .tails = MOKK_TAILS_RIDE, .dx = MOKK_DX_HALVES,
                            .dispatch_blocks = MOKK_GATHER_AHEAD_DEFAULT};
  char err[2 * MOK_ERRLEN] = "";

  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    moe_case c;
    moe_out ref;
    mokk_tuning got;
    case_make(&c, &cases[k].s, cases[k].T, cases[k].seed, ROUTE_RANDOM);
    ck_assert_msg(gpu_run_ranks(&c, 1, MOKK_GRAD_BF16, 0.5f, &ref, err) == 0, "%s", err);
    mokk_cuda_step_tuning(gpu, &got);
    ck_assert_mem_eq(&got, &dflt, sizeof got);
    for (size_t i = 0; i < sizeof tunes / sizeof tunes[0]; i++) {
      const mokk_tuning *t = &tunes[i];
      moe_out on;
      c.s.tune = *t;
      ck_assert_msg(gpu_run_ranks(&c, 1, MOKK_GRAD_BF16, 0.5f, &on, err) == 0, "%s", err);
      expect_same(&on, &ref, &c, "a tuned layer");
      out_free(&on);
      mokk_cuda_step_tuning(gpu, &got);
      mokk_tuning want = dflt;
      if (t->tiles)
        want.tiles = t->tiles;
      if (t->wgrad_tiles)
        want.wgrad_tiles = t->wgrad_tiles;
      if (t->clusters)
        want.clusters = t->clusters;
      if (t->order)
        want.order = t->order;
      if (t->tails)
        want.tails = t->tails;
      if (t->dx)
        want.dx = t->dx;
      if (t->dispatch_blocks)
        want.dispatch_blocks = t->dispatch_blocks;
      ck_assert_msg(memcmp(&got, &want, sizeof got) == 0, "tuning %zu ran as asked", i);
    }
    /* an untuned layer after them: the defaults, not the last layer's */
    memset(&c.s.tune, 0, sizeof c.s.tune);
    moe_out again;
    ck_assert_msg(gpu_run_ranks(&c, 1, MOKK_GRAD_BF16, 0.5f, &again, err) == 0, "%s", err);
    expect_same(&again, &ref, &c, "an untuned layer again");
    mokk_cuda_step_tuning(gpu, &got);
    ck_assert_mem_eq(&got, &dflt, sizeof got);
    out_free(&again);
    out_free(&ref);
    case_free(&c);
  }
}
END_TEST

/* A context's last backward (MOKK_BWD_LAST) writes dy over y and d_x's
 * rows over g, u, h and y: the same bits as a backward that keeps them, in
 * whole rows (H <= 5 I) and in slices (H > 5 I), on virtual ranks, on the
 * spread layout (which keeps its buffers), in both gradient modes; on
 * Hopper where H <= 3 I with d_g | d_u written over g in pairs of 64-column
 * blocks (routed and shared, d_h tiles past its first n-tile too); and a
 * second backward of the context fails (gpu_run_ranks_on). */
START_TEST(last_invariance)
{
  static const struct {
    mokk_shape s;
    int64_t T;
    int P, spread;
    mokk_grad_mode mode;
    uint64_t seed;
  } cases[] = {
      {{.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 192, .swiglu_limit = 0.6f, .P = 1}, 333, 1,
       0, MOKK_GRAD_BF16, 41},
      {{.H = 512, .I = 64, .E = 8, .K = 2, .I_s = 64, .P = 1}, 290, 1, 0, MOKK_GRAD_BF16, 42},
      {{.H = 640, .I = 64, .E = 4, .K = 2, .I_s = 0, .P = 1}, 1000, 1, 0, MOKK_GRAD_FP32_ACCUM,
       43},
      {{.H = 256, .I = 128, .E = 8, .K = 2, .I_s = 64, .P = 1}, 300, 2, 0, MOKK_GRAD_BF16, 44},
      {{.H = 256, .I = 128, .E = 8, .K = 2, .I_s = 64, .P = 1}, 300, 2, 1, MOKK_GRAD_BF16, 45},
      /* in place with d_h tiles past the first 256 columns (I > BN) */
      {{.H = 512, .I = 384, .E = 4, .K = 2, .I_s = 320, .P = 1}, 200, 1, 0, MOKK_GRAD_FP32_ACCUM,
       46},
  };
  char err[2 * MOK_ERRLEN] = "";

  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    for (int halves = 0; halves < 2; halves++) {
      moe_case c;
      moe_out keep, last;
      case_make(&c, &cases[k].s, cases[k].T, cases[k].seed, ROUTE_RANDOM);
      mokk_cuda_set_spread(gpu, cases[k].spread);
      mokk_cuda_set_dx_halves(gpu, halves);
      bwd_flags = 0;
      ck_assert_msg(gpu_run_ranks(&c, cases[k].P, cases[k].mode, 0.5f, &keep, err) == 0, "%s",
                    err);
      bwd_flags = MOKK_BWD_LAST;
      int rc = gpu_run_ranks(&c, cases[k].P, cases[k].mode, 0.5f, &last, err);
      bwd_flags = 0;
      ck_assert_msg(rc == 0, "%s", err);
      /* on the Hopper core, where d_x's whole rows fit in y, u and h (H <= 3
       * I, the shared layout), d_h writes d_g | d_u over g */
      mokk_cuda_bwd_info bi;
      mokk_cuda_last_backward(gpu, &bi);
      int in_place = gemm_core_available() && !cases[k].spread && cases[k].s.H <= 3 * cases[k].s.I;
      ck_assert_msg(bi.dgu_in_place == in_place, "case %zu: d_g | d_u %s g", k,
                    bi.dgu_in_place ? "written over" : "not over");
      expect_same(&last, &keep, &c, "the context's last backward");
      out_free(&keep), out_free(&last), case_free(&c);
    }
  }
  mokk_cuda_set_spread(gpu, 0);
  mokk_cuda_set_dx_halves(gpu, 1);
}
END_TEST

START_TEST(batch_invariance)
{
  mokk_shape s = {.H = 128, .I = 64, .E = 8, .K = 2, .I_s = 64, .P = 1};
  moe_case c, head;
  moe_out all, part;
  char err[2 * MOK_ERRLEN] = "";
  int64_t n = 37;

  case_make(&c, &s, 300, 11, ROUTE_RANDOM);
  head = c; /* the first n tokens alone, same weights */
  head.T = n;
  ck_assert_msg(gpu_run(&c, 0, MOKK_GRAD_BF16, 0, &all, err) == 0, "%s", err);
  ck_assert_msg(gpu_run(&head, 0, MOKK_GRAD_BF16, 0, &part, err) == 0, "%s", err);
  ck_assert(memcmp(all.out, part.out, n * s.H * 2) == 0);
  out_free(&all), out_free(&part), case_free(&c);
}
END_TEST

START_TEST(errors)
{
  mokk_shape s = {.H = 96, .I = 64, .E = 4, .K = 2, .P = 1};
  moe_case c;
  moe_out o;
  char err[2 * MOK_ERRLEN] = "";

  case_make(&c, &s, 10, 12, ROUTE_RANDOM);
  ck_assert_int_eq(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &o, err), MOK_ESHAPE);
  ck_assert_msg(strstr(err, "multiples of 64") != NULL, "%s", err);
  out_free(&o), case_free(&c);

  s.H = 64;
  case_make(&c, &s, 10, 12, ROUTE_RANDOM);
  c.ids[3] = 4; /* E = 4: out of range */
  c.ids[7] = -2; /* -1 is no route, not an error */
  ck_assert_int_eq(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &o, err), MOK_EEXPERT);
  ck_assert_msg(strstr(err, "outside [0, E)") != NULL, "%s", err);
  out_free(&o);
  /* the flag does not stick: a clean step afterwards succeeds */
  c.ids[3] = 0, c.ids[7] = 1;
  ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &o, err) == 0, "%s", err);
  out_free(&o), case_free(&c);
}
END_TEST

/* The backend's measuring knobs (environment) take only the values they
 * name: any other fails mokk_cuda_create with MOK_EINVAL, no backend, and a
 * message naming the variable and what it takes; a valid value creates one. */
START_TEST(errors_env)
{
  static const struct {
    const char *name, *bad, *good, *says;
  } knobs[] = {
      {"MOKD_GEMM_WGRAD_KEEP", "3", "1", "is not auto, 0, 1 or 2"},
      {"MOKD_GEMM_WGRAD_TILES", "tall", "pingpong", "is not auto, wide or pingpong"},
      {"MOKD_GEMM_STORES", "reg", "regs", "is not async or regs"},
      {"MOKD_GATHER_AHEAD", "-1", "8", "is not a number of blocks"},
      {"MOKD_GATHER_AHEAD", "16x", "0", "is not a number of blocks"},
      {"MOKD_GATHER_ORDER", "token", "tokens", "is not rows or tokens"},
  };
  char err[2 * MOK_ERRLEN];

  for (size_t i = 0; i < sizeof knobs / sizeof knobs[0]; i++) {
    mokk_backend *b = (mokk_backend *)&err; /* anything but NULL */
    err[0] = '\0';
    ck_assert_int_eq(setenv(knobs[i].name, knobs[i].bad, 1), 0);
    int rc = mokk_cuda_create(0, &b, err);
    unsetenv(knobs[i].name); /* before any assertion: later cases read the environment */
    ck_assert_msg(rc == MOK_EINVAL, "%s=%s: rc %d (%s)", knobs[i].name, knobs[i].bad, rc, err);
    ck_assert_msg(b == NULL, "%s=%s: a backend came back", knobs[i].name, knobs[i].bad);
    ck_assert_msg(strstr(err, knobs[i].name) != NULL && strstr(err, knobs[i].says) != NULL,
                  "%s=%s: %s", knobs[i].name, knobs[i].bad, err);
    ck_assert_int_eq(setenv(knobs[i].name, knobs[i].good, 1), 0);
    rc = mokk_cuda_create(0, &b, err);
    unsetenv(knobs[i].name);
    ck_assert_msg(rc == 0 && b != NULL, "%s=%s: %s", knobs[i].name, knobs[i].good, err);
    mokk_backend_destroy(b);
  }
}
END_TEST

/* ---- through the daemon ------------------------------------------------- */

static mok_tensor place(uint64_t arena, size_t *at, mok_dtype dt, int ndim, int64_t a,
                        int64_t b, int64_t c)
{
  int64_t shape[3] = {a, b, c};
  mok_tensor t = mok_tensor_make(arena, *at, dt, ndim, shape);
  *at += (mok_tensor_bytes(&t) + 255) / 256 * 256;
  return t;
}

/* A layer's tensors for T tokens and E experts (all of them, or an EP rank's
 * E / P) one after the other in arena from offset 0; returns the bytes they
 * take, so a first call with arena 0 sizes the arena. */
static size_t layer_place(uint64_t arena, const mokk_shape *s, int64_t T, int64_t E,
                          mok_tensor *x, mok_tensor *dout, mok_tensor *ids, mok_tensor *tw,
                          mok_tensor w[MOK_NWEIGHTS])
{
  const int64_t H = s->H, K = s->K, Is = s->I_s;
  size_t at = 0;

  *x = place(arena, &at, MOK_DTYPE_BF16, 2, T, H, 0);
  *dout = place(arena, &at, MOK_DTYPE_BF16, 2, T, H, 0);
  *ids = place(arena, &at, MOK_DTYPE_I32, 2, T, K, 0);
  *tw = place(arena, &at, MOK_DTYPE_F32, 2, T, K, 0);
  w[MOK_W_GATE] = place(arena, &at, MOK_DTYPE_BF16, 3, E, s->I, H);
  w[MOK_W_UP] = place(arena, &at, MOK_DTYPE_BF16, 3, E, s->I, H);
  w[MOK_W_DOWN] = place(arena, &at, MOK_DTYPE_BF16, 3, E, H, s->I);
  w[MOK_S_GATE] = place(arena, &at, MOK_DTYPE_BF16, Is ? 2 : 0, Is, H, 0);
  w[MOK_S_UP] = place(arena, &at, MOK_DTYPE_BF16, Is ? 2 : 0, Is, H, 0);
  w[MOK_S_DOWN] = place(arena, &at, MOK_DTYPE_BF16, Is ? 2 : 0, H, Is, 0);
  return at;
}

/* A mokd --backend cuda of our own, on a private socket. */
typedef struct daemon_run {
  pid_t pid;
  char sock[108], log[128];
} daemon_run;

static mok_client *daemon_start(daemon_run *d, const char *extra_flag, const char *extra_val)
{
  const char *bin = getenv("MOKD_BIN") != NULL ? getenv("MOKD_BIN") : "build/mokd";
  static int seq;
  mok_client *c = NULL;
  int st, up = 0;

  seq++;
  snprintf(d->sock, sizeof d->sock, "/tmp/mokd-gpu-%d-%d.sock", (int)getpid(), seq);
  snprintf(d->log, sizeof d->log, "/tmp/mokd-gpu-%d-%d.log", (int)getpid(), seq);
  if ((d->pid = fork()) == 0) {
    int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(bin, "mokd", "--socket", d->sock, "--config", "/dev/null", "--backend", "cuda",
          extra_flag, extra_val, (char *)NULL);
    _exit(127);
  }
  ck_assert_int_gt(d->pid, 0);
  for (int i = 0; i < 500 && !up; i++) {
    up = mok_connect(d->sock, "gpu-check", &c) == 0;
    if (!up) {
      mok_close(c);
      c = NULL;
      ck_assert_msg(waitpid(d->pid, &st, WNOHANG) == 0, "mokd exited early; see %s", d->log);
      usleep(10000);
    }
  }
  ck_assert_msg(up, "mokd did not come up on %s", d->sock);
  ck_assert_str_eq(mok_server_info(c)->backend, "cuda");
  ck_assert_int_ge(mok_server_info(c)->ndevices, 1);
  ck_assert_int_ge(mok_server_info(c)->device, 0);
  return c;
}

/* Once the clients are gone: nothing held, and SIGTERM stops it cleanly. */
static void daemon_stop(daemon_run *d)
{
  mok_client *c = NULL;
  mok_stats sts;
  int st;

  ck_assert(mok_connect(d->sock, "gpu-check-last", &c) == 0);
  for (int i = 0; i < 200; i++) {
    ck_assert(mok_stats_get(c, &sts) == 0);
    if (sts.daemon.sessions == 1)
      break;
    usleep(10000);
  }
  ck_assert_int_eq(sts.daemon.sessions, 1);
  ck_assert_int_eq(sts.daemon.arenas, 0);
  ck_assert_int_eq(sts.daemon.arena_bytes, 0);
  ck_assert_int_eq(sts.daemon.contexts, 0);
  ck_assert_int_eq(sts.daemon.gpu_bytes, 0);
  mok_close(c);
  kill(d->pid, SIGTERM);
  ck_assert_int_eq(waitpid(d->pid, &st, 0), d->pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "mokd exit status %d; see %s", st,
                d->log);
  unlink(d->log);
}

/* What daemon_layer leaves for more requests. */
typedef struct daemon_step {
  uint64_t layer;
  mok_tensor x, ids, tw;
} daemon_step;

/* A layer forward and backward through libmok on c with every tensor in a
 * GPU arena (on device), the outputs read back into og. */
static void daemon_layer(mok_client *c, const moe_case *cs, int device, moe_out *og,
                         daemon_step *st)
{
  const mokk_shape s = cs->s;
  int64_t T = cs->T, H = s.H, K = s.K;
  mok_tensor x, ids, tw, dout, w[MOK_NWEIGHTS];
  mok_arena_info ar = {0};
  mok_forward_result fr;
  mok_backward_result br;
  uint64_t layer;
  size_t at = layer_place(0, &s, T, s.E, &x, &dout, &ids, &tw, w);

  ck_assert_msg(mok_arena_create(c, at, &ar) == 0, "%s", mok_last_error(c));
  layer_place(ar.id, &s, T, s.E, &x, &dout, &ids, &tw, w);
  ck_assert_int_eq(ar.device, device); /* a GPU arena on the session's device */
  ck_assert(mok_tensor_write(c, &x, cs->x) == 0);
  ck_assert(mok_tensor_write(c, &dout, cs->d_out) == 0);
  ck_assert(mok_tensor_write(c, &ids, cs->ids) == 0);
  ck_assert(mok_tensor_write(c, &tw, cs->tw) == 0);
  for (int i = 0; i < MOK_NWEIGHTS; i++)
    ck_assert(mok_tensor_write(c, &w[i], cs->w[i]) == 0);

  mok_layer_desc d = {.hidden = H, .intermediate = s.I, .experts = s.E, .top_k = K,
                      .shared_intermediate = s.I_s, .swiglu_limit = s.swiglu_limit,
                      .grad_mode = MOK_GRAD_BF16};
  ck_assert_msg(mok_layer_create(c, &d, &layer) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_layer_set_weights(c, layer, w) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_forward(c, layer, &x, &ids, &tw, 0, &fr) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_backward(c, fr.context, &dout, NULL, 0, &br) == 0, "%s",
                mok_last_error(c));

  memset(og, 0, sizeof *og);
  og->out = xcalloc(T * H, 2);
  og->d_x = xcalloc(T * H, 2);
  og->d_tw = xcalloc(T * K, 4);
  ck_assert(mok_tensor_read(c, &fr.out, og->out) == 0);
  ck_assert(mok_tensor_read(c, &br.d_x, og->d_x) == 0);
  ck_assert(mok_tensor_read(c, &br.d_topk_weights, og->d_tw) == 0);
  ck_assert_int_eq(br.ngrads, MOK_NWEIGHTS);
  for (int i = 0; i < MOK_NWEIGHTS; i++) {
    og->g_bf16[i] = xcalloc(case_weight_elems(cs, i), 2);
    ck_assert(mok_tensor_read(c, &br.grads[i], og->g_bf16[i]) == 0);
  }

  /* the context's last backward writes over its saved state: the same
   * bits, and no backward after it */
  mok_backward_result bl;
  ck_assert_msg(mok_backward_flags(c, fr.context, &dout, NULL, 0, NULL, MOK_BACKWARD_LAST,
                                   &bl) == 0,
                "%s", mok_last_error(c));
  uint16_t *again = xcalloc(T * H, 2);
  ck_assert(mok_tensor_read(c, &bl.d_x, again) == 0);
  ck_assert_msg(memcmp(again, og->d_x, T * H * 2) == 0, "last backward: d_x differs");
  for (int i = 0; i < MOK_NWEIGHTS; i++) {
    int64_t n = case_weight_elems(cs, i);
    uint16_t *g = xcalloc(n, 2);
    ck_assert(mok_tensor_read(c, &bl.grads[i], g) == 0);
    ck_assert_msg(memcmp(g, og->g_bf16[i], n * 2) == 0, "last backward: weight %d differs",
                  i);
    free(g);
  }
  free(again);
  ck_assert_msg(mok_release(c, &bl.result, 1) == 0, "%s", mok_last_error(c));
  ck_assert_int_eq(mok_backward(c, fr.context, &dout, NULL, 0, &bl), MOK_ECONTEXT);
  ck_assert_msg(strstr(mok_last_error(c), "used up") != NULL, "%s", mok_last_error(c));
  *st = (daemon_step){layer, x, ids, tw};
}

static const mokk_shape daemon_shape = {.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 128,
                                        .swiglu_limit = 0.8f, .P = 1};

/* The layer through the daemon against the CPU engine. */
START_TEST(through_daemon)
{
  mokk_shape s = daemon_shape;
  char err[2 * MOK_ERRLEN] = "";
  int64_t T = 300, H = s.H, K = s.K;
  mok_forward_result fr;
  daemon_run dr;
  mok_client *c = daemon_start(&dr, NULL, NULL);
  daemon_step st;
  moe_case cs;
  moe_out oc, og;

  case_make(&cs, &s, T, 21, ROUTE_RANDOM);
  daemon_layer(c, &cs, mok_server_info(c)->device, &og, &st);
  ck_assert_msg(case_run(cpu, &cs, 1, 1, MOKK_GRAD_BF16, 0, &oc, err) == 0, "%s", err);
  expect_close_bf16(oc.out, og.out, T * H, TOL_FWD, "daemon out");
  expect_close_bf16(oc.d_x, og.d_x, T * H, TOL_BWD, "daemon d_x");
  expect_close_f32(oc.d_tw, og.d_tw, T * K, TOL_FWD, "daemon d_topk_weights");
  for (int i = 0; i < MOK_NWEIGHTS; i++)
    expect_close_bf16(oc.g_bf16[i], og.g_bf16[i], case_weight_elems(&cs, i), TOL_BWD,
                      wname[i]);
  uint64_t layer = st.layer;
  mok_tensor x = st.x, ids = st.ids, tw = st.tw;

  /* a host tensor is refused with its reason */
  {
    int fd = memfd_create("host", MFD_ALLOW_SEALING);
    mok_arena_info ha;
    ck_assert(fd >= 0 && ftruncate(fd, 1 << 20) == 0);
    ck_assert(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    ck_assert_msg(mok_arena_import(c, fd, 1 << 20, &ha) == 0, "%s", mok_last_error(c));
    ck_assert_int_eq(ha.device, -1);
    mok_tensor hx = x;
    hx.arena = ha.id, hx.offset = 0;
    ck_assert_int_eq(mok_forward(c, layer, &hx, &ids, &tw, 1, &fr), MOK_EDEVICE);
    ck_assert_msg(strstr(mok_last_error(c), "host memory") != NULL, "%s", mok_last_error(c));
    close(fd);
  }
  mok_close(c);
  daemon_stop(&dr);
  out_free(&og), out_free(&oc), case_free(&cs);
}
END_TEST

/* ---- ordering by events, client memory, quotas ------------------------- */

int gate_launch(void *stream, int *open, int *state, double timeout_s);

static uint64_t now_ns(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A tensor of n dims at p, GPU memory of ours that the daemon imports. */
static mok_tensor import_dev(mok_client *c, const void *p, mok_dtype dt, int ndim, int64_t a,
                             int64_t b, int64_t cc)
{
  int64_t shape[3] = {a, b, cc};
  uint64_t arena = 0, off = 0;
  mok_tensor t = mok_tensor_make(0, 0, dt, ndim, shape);
  ck_assert_msg(mok_arena_import_cuda(c, p, mok_tensor_bytes(&t), &arena, &off) == 0, "%s",
                mok_last_error(c));
  t.arena = arena, t.offset = off;
  return t;
}

static void to_dev(void *d, const void *h, size_t n)
{
  ck_assert_int_eq(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), cudaSuccess);
}

/* PyTorch's expandable_segments by hand: three cuMem allocations with POSIX-fd
 * handles mapped back to back in one reservation. A range over all three is
 * one arena of three chunks (counted three); x placed across the boundary of
 * the first two is found in it, and a forward reading it there gives the bits
 * of the same x in a daemon arena. A chunk freed and made again evicts the
 * arena that maps the old one. Destroyed, the daemon lets go of every chunk:
 * once ours are released too, the device has the memory back. */
START_TEST(expandable_chunks)
{
  CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long);
  CUresult (*gran)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
  CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                  unsigned long long);
  CUresult (*access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*afree)(CUdeviceptr, size_t);
  struct { const char *name; void **fn; } fns[] = {
      {"cuMemCreate", (void **)&create}, {"cuMemGetAllocationGranularity", (void **)&gran},
      {"cuMemAddressReserve", (void **)&reserve}, {"cuMemMap", (void **)&map},
      {"cuMemSetAccess", (void **)&access}, {"cuMemUnmap", (void **)&unmap},
      {"cuMemRelease", (void **)&release}, {"cuMemAddressFree", (void **)&afree}};
  enum cudaDriverEntryPointQueryResult q;
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++)
    ck_assert_msg(cudaGetDriverEntryPointByVersion(fns[i].name, fns[i].fn, 12000,
                                                   cudaEnableDefault, &q) == cudaSuccess &&
                  q == cudaDriverEntryPointSuccess, "no %s", fns[i].name);

  mokk_shape s = daemon_shape;
  int64_t T = 300, H = s.H;
  size_t nx = (size_t)(T * H) * 2, g = 0, free0, free1, total;
  daemon_run dr;
  mok_client *c = daemon_start(&dr, NULL, NULL);
  int dev = mok_server_info(c)->device;
  daemon_step st;
  moe_case cs;
  moe_out og;
  case_make(&cs, &s, T, 21, ROUTE_RANDOM);
  daemon_layer(c, &cs, dev, &og, &st);

  CUmemAllocationProp prop;
  CUmemAccessDesc acc;
  CUmemGenericAllocationHandle h[3];
  CUdeviceptr va = 0;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  memset(&acc, 0, sizeof acc);
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ck_assert_int_eq(cudaSetDevice(dev), cudaSuccess);
  ck_assert_int_eq(gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), CUDA_SUCCESS);
  ck_assert_int_eq(reserve(&va, 3 * g, g, 0, 0), CUDA_SUCCESS);
  for (int i = 0; i < 3; i++) {
    ck_assert_int_eq(create(&h[i], g, &prop, 0), CUDA_SUCCESS);
    ck_assert_int_eq(map(va + (size_t)i * g, g, 0, h[i], 0), CUDA_SUCCESS);
  }
  ck_assert_int_eq(access(va, 3 * g, &acc, 1), CUDA_SUCCESS);
  size_t at = g - 4096; /* x runs from chunk 0 into chunk 1 */
  to_dev((void *)(va + at), cs.x, nx);

  mok_stats s0, s1;
  uint64_t arena, off, arena2, off2;
  ck_assert(mok_stats_get(c, &s0) == 0);
  ck_assert_msg(mok_arena_import_cuda(c, (void *)(va + 16), 3 * g - 32, &arena, &off) == 0,
                "%s", mok_last_error(c));
  ck_assert_uint_eq(off, 16);
  ck_assert(mok_stats_get(c, &s1) == 0);
  ck_assert_uint_eq(s1.session.arenas, s0.session.arenas + 3);
  ck_assert_uint_eq(s1.session.arena_bytes, s0.session.arena_bytes + 3 * g);
  ck_assert_msg(mok_arena_import_cuda(c, (void *)(va + at), nx, &arena2, &off2) == 0, "%s",
                mok_last_error(c));
  ck_assert_uint_eq(arena2, arena); /* found in the arena of all three */
  ck_assert_uint_eq(off2, at);
  mok_tensor x = st.x;
  x.arena = arena2, x.offset = off2;
  mok_forward_result fr;
  ck_assert_msg(mok_forward(c, st.layer, &x, &st.ids, &st.tw, 1, &fr) == 0, "%s",
                mok_last_error(c));
  uint16_t *out = xcalloc(T * H, 2);
  ck_assert(mok_tensor_read(c, &fr.out, out) == 0);
  ck_assert_msg(memcmp(out, og.out, nx) == 0, "out differs with x across two chunks");
  ck_assert(mok_release(c, &fr.context, 1) == 0);

  /* chunk 1 freed and made again at the same address: the arena that maps
   * the old one goes, and x is imported anew over chunks 0 and 1 */
  ck_assert_int_eq(unmap(va + g, g), CUDA_SUCCESS);
  ck_assert_int_eq(release(h[1]), CUDA_SUCCESS);
  ck_assert_int_eq(create(&h[1], g, &prop, 0), CUDA_SUCCESS);
  ck_assert_int_eq(map(va + g, g, 0, h[1], 0), CUDA_SUCCESS);
  ck_assert_int_eq(access(va + g, g, &acc, 1), CUDA_SUCCESS);
  ck_assert_msg(mok_arena_import_cuda(c, (void *)(va + at), nx, &arena2, &off2) == 0, "%s",
                mok_last_error(c));
  ck_assert_uint_ne(arena2, arena);
  ck_assert_uint_eq(off2, at);
  ck_assert(mok_stats_get(c, &s1) == 0);
  ck_assert_uint_eq(s1.session.arenas, s0.session.arenas + 2);
  ck_assert_msg(mok_arena_destroy(c, arena2) == 0, "%s", mok_last_error(c));

  /* tensors at shifting offsets of the segment, as activations are step
   * after step: one in chunk 0, one across chunks 0 and 1, then, a request
   * later, one across chunks 1 and 2. Each miss imports the union with the
   * arenas it overlaps, and those go once no call since the last request
   * names them: one arena over the segment stays, not one more a tensor. */
  uint64_t ax, ad, a3, ox, od, o3;
  ck_assert_msg(mok_arena_import_cuda(c, (void *)(va + 4096), 4096, &ax, &ox) == 0, "%s",
                mok_last_error(c));
  ck_assert_uint_eq(ox, 4096);
  ck_assert_msg(mok_arena_import_cuda(c, (void *)(va + g - 4096), 8192, &ad, &od) == 0, "%s",
                mok_last_error(c));
  ck_assert_uint_ne(ad, ax);
  ck_assert_uint_eq(od, g - 4096);
  ck_assert(mok_stats_get(c, &s1) == 0); /* ax is still named: it stays till now */
  ck_assert_uint_eq(s1.session.arenas, s0.session.arenas + 1 + 2);
  ck_assert_msg(mok_arena_import_cuda(c, (void *)(va + 2 * g - 4096), 8192, &a3, &o3) == 0,
                "%s", mok_last_error(c));
  ck_assert_uint_eq(o3, 2 * g - 4096);
  ck_assert(mok_stats_get(c, &s1) == 0);
  ck_assert_uint_eq(s1.session.arenas, s0.session.arenas + 3);
  ck_assert_msg(mok_arena_import_cuda(c, (void *)(va + 4096), 4096, &ax, &ox) == 0, "%s",
                mok_last_error(c));
  ck_assert_uint_eq(ax, a3);
  ck_assert_uint_eq(ox, 4096);
  ck_assert_msg(mok_arena_import_cuda(c, (void *)(va + g - 4096), 8192, &ad, &od) == 0, "%s",
                mok_last_error(c));
  ck_assert_uint_eq(ad, a3);
  ck_assert(mok_stats_get(c, &s1) == 0);
  ck_assert_uint_eq(s1.session.arenas, s0.session.arenas + 3);
  arena = a3;

  ck_assert_int_eq(cudaMemGetInfo(&free0, &total), cudaSuccess);
  ck_assert_msg(mok_arena_destroy(c, arena) == 0, "%s", mok_last_error(c));
  ck_assert(mok_stats_get(c, &s1) == 0);
  ck_assert_uint_eq(s1.session.arenas, s0.session.arenas);
  for (int i = 0; i < 3; i++) {
    ck_assert_int_eq(unmap(va + (size_t)i * g, g), CUDA_SUCCESS);
    ck_assert_int_eq(release(h[i]), CUDA_SUCCESS);
  }
  ck_assert_int_eq(afree(va, 3 * g), CUDA_SUCCESS);
  for (int i = 0; i < 200; i++) { /* the daemon lets go once its fence has passed */
    ck_assert_int_eq(cudaMemGetInfo(&free1, &total), cudaSuccess);
    if (free1 + g / 2 >= free0 + 3 * g)
      break;
    mok_ping(c, NULL);
    usleep(10000);
  }
  ck_assert_msg(free1 + g / 2 >= free0 + 3 * g, "%zu bytes free before, %zu after: the "
                "daemon still holds chunks", free0, free1);
  free(out);
  mok_close(c);
  daemon_stop(&dr);
  out_free(&og), case_free(&cs);
}
END_TEST

/* The inputs in one cudaMalloc block (as a caching allocator hands them out)
 * and the weights in a cuMem allocation with POSIX-fd handles: both imported,
 * read in place. Then stream ordering: a gate kernel holds our stream, the
 * inputs are copied in behind it, and forward and backward are asked for.
 * Their replies must come back while the gate is still shut (the daemon did
 * not wait for its GPU work), the daemon's step must wait for our ready
 * event (else it reads the previous step's x), and our stream must wait for
 * the done event (else the copies of the outputs read the previous step's). */
START_TEST(stream_ordering)
{
  mokk_shape s = {.H = 256, .I = 128, .E = 16, .K = 4, .P = 1};
  int64_t T = 300, H = s.H, K = s.K;
  size_t nx = (size_t)(T * H) * 2, nk = (size_t)(T * K) * 4, wat = 0;
  size_t woff[3];
  char err[2 * MOK_ERRLEN] = "";
  daemon_run dr;
  mok_client *c = daemon_start(&dr, NULL, NULL);
  mok_tensor x, ids, tw, dout, w[MOK_NWEIGHTS];
  mok_forward_result fr;
  mok_backward_result br;
  mokk_gpu_mem wmem;
  moe_case cs, cs2;
  moe_out oc, og;
  uint64_t layer, in_arena;
  char *in_blk, *out_blk;
  int *gate_open, *gate_state, wfd;
  cudaStream_t st;
  mok_stats sts;

  case_make(&cs, &s, T, 31, ROUTE_RANDOM);
  case_make(&cs2, &s, T, 32, ROUTE_RANDOM);
  ck_assert_int_eq(cudaMalloc((void **)&in_blk, 4 * nx + 2 * nk + 4096), cudaSuccess);
  ck_assert_int_eq(cudaMalloc((void **)&out_blk, 2 * nx + nk), cudaSuccess);
  x = import_dev(c, in_blk, MOK_DTYPE_BF16, 2, T, H, 0);
  dout = import_dev(c, in_blk + nx, MOK_DTYPE_BF16, 2, T, H, 0);
  ids = import_dev(c, in_blk + 2 * nx, MOK_DTYPE_I32, 2, T, K, 0);
  tw = import_dev(c, in_blk + 2 * nx + nk, MOK_DTYPE_F32, 2, T, K, 0);
  /* one allocation, one arena: the later imports were found in the cache */
  ck_assert(x.arena == dout.arena && x.arena == ids.arena && x.arena == tw.arena);
  ck_assert_int_eq(ids.offset, 2 * nx);
  in_arena = x.arena;
  for (int i = 0; i < 3; i++) {
    woff[i] = wat;
    wat += (size_t)case_weight_elems(&cs, i) * 2;
  }
  ck_assert_msg(mokk_gpu_mem_create(0, wat, &wmem, &wfd, err) == 0, "%s", err);
  close(wfd);
  memset(w, 0, sizeof w);
  w[MOK_W_GATE] = import_dev(c, (char *)wmem.ptr + woff[0], MOK_DTYPE_BF16, 3, s.E, s.I, H);
  w[MOK_W_UP] = import_dev(c, (char *)wmem.ptr + woff[1], MOK_DTYPE_BF16, 3, s.E, s.I, H);
  w[MOK_W_DOWN] = import_dev(c, (char *)wmem.ptr + woff[2], MOK_DTYPE_BF16, 3, s.E, H, s.I);
  ck_assert(w[MOK_W_GATE].arena == w[MOK_W_DOWN].arena && w[MOK_W_GATE].arena != in_arena);
  for (int i = 0; i < 3; i++)
    to_dev((char *)wmem.ptr + woff[i], cs.w[i], (size_t)case_weight_elems(&cs, i) * 2);
  to_dev(in_blk, cs2.x, nx); /* the first step sees cs2's tokens */
  to_dev(in_blk + nx, cs.d_out, nx);
  to_dev(in_blk + 2 * nx, cs.ids, nk);
  to_dev(in_blk + 2 * nx + nk, cs.tw, nk);
  mok_layer_desc d = {.hidden = H, .intermediate = s.I, .experts = s.E, .top_k = K,
                      .grad_mode = MOK_GRAD_BF16};
  ck_assert_msg(mok_layer_create(c, &d, &layer) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_layer_set_weights(c, layer, w) == 0, "%s", mok_last_error(c));

  /* 1. no stream: the call returns with the outputs complete */
  {
    moe_case c2 = cs;
    c2.x = cs2.x;
    ck_assert_msg(mok_forward(c, layer, &x, &ids, &tw, 1, &fr) == 0, "%s", mok_last_error(c));
    ck_assert_int_eq(fr.status.ndim, 1);
    memset(&og, 0, sizeof og);
    og.out = xcalloc(T * H, 2);
    ck_assert(mok_tensor_read(c, &fr.out, og.out) == 0);
    ck_assert_msg(case_run(cpu, &c2, 1, 0, MOKK_GRAD_BF16, 0, &oc, err) == 0, "%s", err);
    expect_close_bf16(oc.out, og.out, T * H, TOL_FWD, "blocking out");
    out_free(&og), out_free(&oc);
    ck_assert(mok_release(c, &fr.context, 1) == 0);
  }

  /* 2. on a stream held shut by the gate */
  ck_assert_int_eq(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  ck_assert_int_eq(cudaHostAlloc((void **)&gate_open, 64, cudaHostAllocMapped), cudaSuccess);
  ck_assert_int_eq(cudaHostAlloc((void **)&gate_state, 64, cudaHostAllocMapped), cudaSuccess);
  *(volatile int *)gate_open = 0, *(volatile int *)gate_state = 0;
  void *x_host;
  ck_assert_int_eq(cudaMallocHost(&x_host, nx), cudaSuccess);
  memcpy(x_host, cs.x, nx);
  mok_arena_info junk;
  ck_assert_msg(mok_arena_create(c, 4u << 20, &junk) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_set_stream(c, st) == 0, "%s", mok_last_error(c));
  ck_assert_int_eq(gate_launch(st, gate_open, gate_state, 20.0), 0);
  ck_assert_int_eq(cudaMemcpyAsync(in_blk, x_host, nx, cudaMemcpyHostToDevice, st), cudaSuccess);
  for (int i = 0; i < 2000 && *(volatile int *)gate_state == 0; i++)
    usleep(1000);
  ck_assert_int_eq(*(volatile int *)gate_state, 1);
  uint64_t t0 = now_ns();
  ck_assert_msg(mok_forward(c, layer, &x, &ids, &tw, 0, &fr) == 0, "%s", mok_last_error(c));
  ck_assert_int_eq(cudaMemcpyAsync(out_blk, fr.out_ptr, nx, cudaMemcpyDeviceToDevice, st),
                   cudaSuccess);
  ck_assert_msg(mok_backward(c, fr.context, &dout, NULL, 0, &br) == 0, "%s",
                mok_last_error(c));
  ck_assert_int_eq(cudaMemcpyAsync(out_blk + nx, br.d_x_ptr, nx, cudaMemcpyDeviceToDevice, st),
                   cudaSuccess);
  ck_assert_int_eq(cudaMemcpyAsync(out_blk + 2 * nx, br.d_topk_weights_ptr, nk,
                                   cudaMemcpyDeviceToDevice, st), cudaSuccess);
  /* freeing GPU memory does not wait for the queued work either */
  ck_assert_msg(mok_arena_destroy(c, junk.id) == 0, "%s", mok_last_error(c));
  uint64_t replies_ns = now_ns() - t0;
  /* the replies are here and the gate is still shut: no step has run */
  ck_assert_msg(*(volatile int *)gate_state == 1, "gate state %d after the replies (%.3f ms)",
                *(volatile int *)gate_state, replies_ns * 1e-6);
  printf("stream_ordering: forward, backward and an arena's destruction replied in %.3f ms "
         "with the GPU held\n",
         replies_ns * 1e-6);
  *(volatile int *)gate_open = 1;
  ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
  ck_assert_int_eq(*(volatile int *)gate_state, 2);
  ck_assert_int_eq(mok_step_status(c, &fr.status), 0);
  ck_assert_int_eq(mok_step_status(c, &br.status), 0);
  memset(&og, 0, sizeof og);
  og.out = xcalloc(T * H, 2);
  og.d_x = xcalloc(T * H, 2);
  og.d_tw = xcalloc(T * K, 4);
  host_copy(og.out, out_blk, nx);
  host_copy(og.d_x, out_blk + nx, nx);
  host_copy(og.d_tw, out_blk + 2 * nx, nk);
  ck_assert_msg(case_run(cpu, &cs, 1, 1, MOKK_GRAD_BF16, 0, &oc, err) == 0, "%s", err);
  expect_close_bf16(oc.out, og.out, T * H, TOL_FWD, "stream out");
  expect_close_bf16(oc.d_x, og.d_x, T * H, TOL_BWD, "stream d_x");
  expect_close_f32(oc.d_tw, og.d_tw, T * K, TOL_FWD, "stream d_topk_weights");
  for (int i = 0; i < 3; i++) {
    int64_t n = case_weight_elems(&cs, i);
    og.g_bf16[i] = xcalloc(n, 2);
    ck_assert(mok_tensor_read(c, &br.grads[i], og.g_bf16[i]) == 0);
    expect_close_bf16(oc.g_bf16[i], og.g_bf16[i], n, TOL_BWD, wname[i]);
  }
  out_free(&og), out_free(&oc);
  uint64_t rel[2] = {fr.context, br.result};
  ck_assert(mok_release(c, rel, 2) == 0);

  /* 3. weights changed in place are seen by the next step */
  {
    moe_case c3 = cs;
    c3.w[MOK_W_DOWN] = cs2.w[MOK_W_DOWN];
    ck_assert_int_eq(cudaMemcpyAsync((char *)wmem.ptr + woff[2], cs2.w[MOK_W_DOWN],
                                     (size_t)case_weight_elems(&cs, MOK_W_DOWN) * 2,
                                     cudaMemcpyHostToDevice, st), cudaSuccess);
    ck_assert_msg(mok_forward(c, layer, &x, &ids, &tw, 1, &fr) == 0, "%s", mok_last_error(c));
    ck_assert_int_eq(cudaMemcpyAsync(out_blk, fr.out_ptr, nx, cudaMemcpyDeviceToDevice, st),
                     cudaSuccess);
    ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess);
    memset(&og, 0, sizeof og);
    og.out = xcalloc(T * H, 2);
    host_copy(og.out, out_blk, nx);
    ck_assert_msg(case_run(cpu, &c3, 1, 0, MOKK_GRAD_BF16, 0, &oc, err) == 0, "%s", err);
    expect_close_bf16(oc.out, og.out, T * H, TOL_FWD, "out after the weight update");
    out_free(&og), out_free(&oc);
    ck_assert(mok_release(c, &fr.context, 1) == 0);
  }

  /* 4. an expert id out of range: found by the GPU, reported through the
   * status on a stream, as the call's error without one */
  {
    int32_t *bad = xcalloc(T * K, 4);
    memcpy(bad, cs.ids, nk);
    bad[5] = (int32_t)s.E;
    ck_assert_int_eq(cudaMemcpyAsync(in_blk + 2 * nx, bad, nk, cudaMemcpyHostToDevice, st),
                     cudaSuccess);
    ck_assert_int_eq(cudaStreamSynchronize(st), cudaSuccess); /* bad is pageable */
    ck_assert_msg(mok_forward(c, layer, &x, &ids, &tw, 1, &fr) == 0, "%s", mok_last_error(c));
    ck_assert_int_eq(mok_step_status(c, &fr.status), MOK_EEXPERT);
    ck_assert_msg(strstr(mok_last_error(c), "outside [0, E)") != NULL, "%s", mok_last_error(c));
    ck_assert(mok_release(c, &fr.context, 1) == 0);
    ck_assert(mok_set_stream(c, NULL) == 0);
    ck_assert_int_eq(mok_forward(c, layer, &x, &ids, &tw, 0, &fr), MOK_EEXPERT);
    ck_assert(mok_stats_get(c, &sts) == 0);
    ck_assert_int_eq(sts.session.contexts, 0); /* the failed step's context went back */
    to_dev(in_blk + 2 * nx, cs.ids, nk);
    free(bad);
  }

  /* 5. an allocation freed and made again is imported anew */
  {
    char *old = in_blk;
    ck_assert_int_eq(cudaFree(in_blk), cudaSuccess);
    ck_assert_int_eq(cudaMalloc((void **)&in_blk, 4 * nx + 2 * nk + 4096), cudaSuccess);
    mok_tensor x2 = import_dev(c, in_blk, MOK_DTYPE_BF16, 2, T, H, 0);
    ck_assert(x2.arena != in_arena);
    size_t blk = 4 * nx + 2 * nk + 4096;
    if (in_blk < old + blk && old < in_blk + blk) { /* overlapping: the stale arena is gone */
      mok_tensor gone = x;
      ck_assert_ptr_null(mok_tensor_ptr(c, &gone));
    }
    to_dev(in_blk, cs.x, nx);
    mok_tensor ids2 = import_dev(c, in_blk + 2 * nx, MOK_DTYPE_I32, 2, T, K, 0);
    mok_tensor tw2 = import_dev(c, in_blk + 2 * nx + nk, MOK_DTYPE_F32, 2, T, K, 0);
    to_dev(in_blk + 2 * nx, cs.ids, nk);
    to_dev(in_blk + 2 * nx + nk, cs.tw, nk);
    ck_assert_msg(mok_forward(c, layer, &x2, &ids2, &tw2, 1, &fr) == 0, "%s",
                  mok_last_error(c));
    ck_assert(mok_release(c, &fr.context, 1) == 0);
  }

  /* 6. what cannot be imported says why */
  {
    uint64_t a, o;
    char *hostp = malloc(4096);
    ck_assert_int_eq(mok_arena_import_cuda(c, hostp, 4096, &a, &o), MOK_EINVAL);
    ck_assert_msg(strstr(mok_last_error(c), "not GPU memory") != NULL, "%s", mok_last_error(c));
    ck_assert_int_eq(mok_arena_import_cuda(c, in_blk, 8 * nx + 2 * nk + 8192, &a, &o),
                     MOK_ERANGE);
    free(hostp);
  }
  mok_close(c);
  daemon_stop(&dr);
  cudaStreamDestroy(st);
  cudaFreeHost(gate_open), cudaFreeHost(gate_state), cudaFreeHost(x_host);
  cudaFree(in_blk), cudaFree(out_blk);
  mokk_gpu_mem_free(&wmem);
  case_free(&cs), case_free(&cs2);
}
END_TEST

/* --devices 0,1: a session runs on the GPU it asks for (or the least used),
 * its arenas live there, and the two GPUs give the same bits. Needs two
 * GPUs; with one it says so and checks nothing. */
START_TEST(two_gpus)
{
  char err[MOK_ERRLEN];
  if (mokk_cuda_devices(err) < 2) {
    printf("two_gpus: fewer than two GPUs visible; skipped\n");
    return;
  }
  mokk_shape s = daemon_shape;
  int64_t T = 300;
  daemon_run dr;
  mok_client *c0 = daemon_start(&dr, "--devices", "0,1"), *c1 = NULL, *c2 = NULL;
  daemon_step st;
  moe_case cs;
  moe_out o0, o1;

  mok_close(c0);
  ck_assert_msg(mok_connect_device(dr.sock, "gpu0", 0, &c0) == 0, "%s", mok_last_error(c0));
  ck_assert_msg(mok_connect_device(dr.sock, "gpu1", 1, &c1) == 0, "%s", mok_last_error(c1));
  ck_assert_int_eq(mok_server_info(c0)->ndevices, 2);
  ck_assert_int_eq(mok_server_info(c0)->device, 0);
  ck_assert_int_eq(mok_server_info(c1)->device, 1);
  ck_assert_int_eq(mok_connect_device(dr.sock, "gpu5", 5, &c2), MOK_EDEVICE);
  ck_assert_msg(strstr(mok_last_error(c2), "this process has no CUDA device 5") != NULL, "%s",
                mok_last_error(c2));
  mok_close(c2);
  case_make(&cs, &s, T, 23, ROUTE_RANDOM);
  daemon_layer(c0, &cs, 0, &o0, &st);
  daemon_layer(c1, &cs, 1, &o1, &st);
  ck_assert(memcmp(o0.out, o1.out, (size_t)(T * s.H) * 2) == 0);
  ck_assert(memcmp(o0.d_x, o1.d_x, (size_t)(T * s.H) * 2) == 0);
  ck_assert(memcmp(o0.d_tw, o1.d_tw, (size_t)(T * s.K) * 4) == 0);
  for (int i = 0; i < MOK_NWEIGHTS; i++)
    ck_assert(memcmp(o0.g_bf16[i], o1.g_bf16[i], (size_t)case_weight_elems(&cs, i) * 2) == 0);
  printf("two_gpus: devices 0 and 1 gave the same bits for forward and backward\n");
  mok_close(c0), mok_close(c1);
  daemon_stop(&dr);
  out_free(&o0), out_free(&o1), case_free(&cs);
}
END_TEST

/* session_gpu_quota_bytes bounds what the daemon allocates on the GPU for a
 * session; the client's own imported memory is not counted. */
START_TEST(gpu_quota)
{
  daemon_run dr;
  mok_client *c = daemon_start(&dr, "--session-gpu-quota-bytes", "64M");
  mok_arena_info a;
  mok_stats sts;
  uint64_t arena, off;
  void *mine;

  ck_assert_int_eq(mok_server_info(c)->session_gpu_quota_bytes, 64u << 20);
  ck_assert_int_eq(mok_arena_create(c, 96u << 20, &a), MOK_EDQUOT);
  ck_assert_msg(strstr(mok_last_error(c), "GPU") != NULL &&
                strstr(mok_last_error(c), "session_gpu_quota_bytes") != NULL, "%s",
                mok_last_error(c));
  ck_assert_msg(mok_arena_create(c, 32u << 20, &a) == 0, "%s", mok_last_error(c));
  ck_assert(mok_stats_get(c, &sts) == 0);
  ck_assert_int_eq(sts.session.gpu_bytes, a.bytes);
  ck_assert_int_eq(cudaMalloc(&mine, 128u << 20), cudaSuccess);
  ck_assert_msg(mok_arena_import_cuda(c, mine, 128u << 20, &arena, &off) == 0, "%s",
                mok_last_error(c));
  ck_assert(mok_stats_get(c, &sts) == 0);
  ck_assert_int_eq(sts.session.gpu_bytes, a.bytes);
  ck_assert_int_eq(mok_arena_create(c, 48u << 20, &a), MOK_EDQUOT);
  ck_assert(mok_arena_destroy(c, arena) == 0);
  mok_close(c);
  daemon_stop(&dr);
  cudaFree(mine);
}
END_TEST

/* ---- GPU identity -------------------------------------------------------- */

/* Run by remapped_visible_devices in a process of its own whose
 * CUDA_VISIBLE_DEVICES is one GPU's UUID, so that GPU is its device 0 while
 * the daemon (which sees them all) calls it MOKD_GPU_ID_DEVICE. Asking for its
 * device 0 must land on that GPU, not on the daemon's device 0: the arenas
 * map here, the layer matches the CPU engine, our own memory imports. */
START_TEST(remapped_client)
{
  const char *sock = getenv("MOKD_GPU_ID_SOCK"), *uuid = getenv("CUDA_VISIBLE_DEVICES");
  const char *theirs = getenv("MOKD_GPU_ID_DEVICE");
  char err[2 * MOK_ERRLEN] = "";
  mokk_shape s = daemon_shape;
  int64_t T = 200, H = s.H, K = s.K;
  mok_client *c = NULL;
  uint64_t arena, off;
  daemon_step st;
  moe_case cs;
  moe_out oc, og;
  void *mine;

  ck_assert(sock != NULL && uuid != NULL && theirs != NULL);
  ck_assert_msg(mok_connect_device(sock, "remapped", 0, &c) == 0, "%s", mok_last_error(c));
  ck_assert_int_eq(mok_server_info(c)->device, 0);
  ck_assert_int_eq(mok_server_info(c)->daemon_device, atoi(theirs));
  ck_assert_str_eq(mok_server_info(c)->device_uuid, uuid);
  case_make(&cs, &s, T, 31, ROUTE_RANDOM);
  daemon_layer(c, &cs, 0, &og, &st);
  ck_assert_msg(case_run(cpu, &cs, 1, 1, MOKK_GRAD_BF16, 0, &oc, err) == 0, "%s", err);
  expect_close_bf16(oc.out, og.out, T * H, TOL_FWD, "remapped out");
  expect_close_bf16(oc.d_x, og.d_x, T * H, TOL_BWD, "remapped d_x");
  expect_close_f32(oc.d_tw, og.d_tw, T * K, TOL_FWD, "remapped d_topk_weights");
  ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
  ck_assert_int_eq(cudaMalloc(&mine, 1 << 20), cudaSuccess);
  ck_assert_msg(mok_arena_import_cuda(c, mine, 1 << 20, &arena, &off) == 0, "%s",
                mok_last_error(c));
  ck_assert(mok_arena_destroy(c, arena) == 0);
  printf("remapped_client: CUDA_VISIBLE_DEVICES=%s, device 0 here ran on the daemon's "
         "device %s\n", uuid, theirs);
  mok_close(c);
  cudaFree(mine);
  out_free(&og), out_free(&oc), case_free(&cs);
}
END_TEST

/* A client whose CUDA_VISIBLE_DEVICES renumbers the GPUs (as Slurm and
 * Kubernetes do) is placed by UUID; a UUID the daemon does not run is
 * refused, naming the ones it does. The last GPU is the remapped one, so
 * with several GPUs the client's device 0 is not the daemon's. */
START_TEST(remapped_visible_devices)
{
  char err[MOK_ERRLEN], uuid[MOKW_UUID_STRLEN], theirs[16];
  const char *madeup = "GPU-12345678-9abc-def0-1234-56789abcdef0";
  int n = mokk_cuda_devices(err), target = n - 1, st;
  uint8_t u[MOKW_UUID_BYTES];
  daemon_run dr;
  mok_client *c = daemon_start(&dr, NULL, NULL), *bad = NULL;
  pid_t pid;

  ck_assert_msg(mokk_cuda_uuid(target, u, err) == 0, "%s", err);
  mokw_uuid_format(u, uuid);
  ck_assert_int_eq(mok_server_info(c)->ndevices, n);
  mok_close(c);
  snprintf(theirs, sizeof theirs, "%d", target);
  if ((pid = fork()) == 0) {
    setenv("CUDA_VISIBLE_DEVICES", uuid, 1);
    setenv("MOKD_GPU_ID_SOCK", dr.sock, 1);
    setenv("MOKD_GPU_ID_DEVICE", theirs, 1);
    execl("/proc/self/exe", "check_gpu", "--remapped-client", (char *)NULL);
    _exit(127);
  }
  ck_assert_int_gt(pid, 0);
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the client with "
                "CUDA_VISIBLE_DEVICES=%s failed (status %d); its output is above", uuid, st);

  ck_assert_int_eq(mok_connect_uuid(dr.sock, "made-up", madeup, &bad), MOK_EDEVICE);
  ck_assert_msg(strstr(mok_last_error(bad), "GPU GPU-12345678-9abc-def0-1234-56789abcdef0 is "
                       "not one this daemon runs (it runs GPU-") != NULL, "%s",
                mok_last_error(bad));
  printf("remapped_visible_devices: a made-up UUID: %s\n", mok_last_error(bad));
  mok_close(bad);
  ck_assert_msg(mok_connect_uuid(dr.sock, "by-uuid", uuid, &c) == 0, "%s", mok_last_error(c));
  ck_assert_int_eq(mok_server_info(c)->daemon_device, target);
  ck_assert_int_eq(mok_server_info(c)->device, target); /* this process sees them all */
  ck_assert_str_eq(mok_server_info(c)->device_uuid, uuid);
  mok_close(c);
  daemon_stop(&dr);
}
END_TEST

/* Memory of another GPU is refused with the two GPUs named: by libmok for a
 * cudaMalloc block, by the backend for a cuMem fd (a client that skips
 * libmok's check meets the daemon's). Needs two GPUs; with one it says so. */
START_TEST(import_on_another_gpu)
{
  char err[MOK_ERRLEN];
  if (mokk_cuda_devices(err) < 2) {
    printf("import_on_another_gpu: fewer than two GPUs visible; skipped\n");
    return;
  }
  daemon_run dr;
  mok_client *c0 = daemon_start(&dr, "--devices", "0,1"), *c1 = NULL;
  mokk_backend *b1 = NULL;
  mokk_buffer *buf = NULL;
  mokk_gpu_mem m0;
  uint64_t arena, off;
  void *mine;
  int fd = -1;

  mok_close(c0);
  ck_assert_msg(mok_connect_device(dr.sock, "gpu1", 1, &c1) == 0, "%s", mok_last_error(c1));
  ck_assert_int_eq(cudaSetDevice(0), cudaSuccess);
  ck_assert_int_eq(cudaMalloc(&mine, 1 << 20), cudaSuccess);
  ck_assert_int_eq(mok_arena_import_cuda(c1, mine, 1 << 20, &arena, &off), MOK_EDEVICE);
  ck_assert_msg(strstr(mok_last_error(c1), "the memory is on CUDA device 0 of this process "
                       "(GPU-") != NULL, "%s", mok_last_error(c1));
  mok_close(c1);
  daemon_stop(&dr);
  cudaFree(mine);

  ck_assert_msg(mokk_cuda_create(1, &b1, err) == 0, "%s", err);
  ck_assert_msg(mokk_gpu_mem_create(0, 2 << 20, &m0, &fd, err) == 0, "%s", err);
  mokk_import src = {MOKK_IMPORT_CUMEM_FD, fd, NULL, m0.bytes};
  ck_assert_int_eq(mokk_buffer_import(b1, &src, &buf, err), MOK_EDEVICE);
  ck_assert_msg(strstr(err, "(device 0 here), not on the session's GPU GPU-") != NULL, "%s", err);
  printf("import_on_another_gpu: %s\n", err);
  close(fd);
  mokk_gpu_mem_free(&m0);
  mokk_backend_destroy(b1);
}
END_TEST

/* ---- EP groups: virtual ranks of one GPU --------------------------------- */

/* The case over P ranks on the GPU, laid out as case_run lays it out: rank
 * r's tokens at r T, its experts' slices of the global weights and
 * gradients, and its own copy of the shared expert's gradients
 * (g_shared_copy, [P][n]). The backend's own entry, no daemon. on: each
 * rank's backend (its dev), or NULL for none; the tensors are on the GPU of
 * `gpu` in either case (other GPUs reach them through peer access). */
static int gpu_run_ranks_on(const moe_case *c, int P, mokk_grad_mode mode, float seed_grad,
                            mokk_backend *const *on, moe_out *o, uint64_t *held, char *err)
{
  mokk_shape s = c->s;
  int64_t T = c->T / P, H = s.H, K = s.K, El = s.E / P;
  mokk_fwd_rank fr[2 * MOKK_DEVICE_MAX_RANKS] = {0}; /* room to ask for too many */
  mokk_bwd_rank br[2 * MOKK_DEVICE_MAX_RANKS] = {0};
  void *dev[64] = {0}, *w[MOKK_NWEIGHTS] = {0}, *g16[MOKK_NWEIGHTS] = {0},
       *g32[MOKK_NWEIGHTS] = {0};
  mokk_ctx *ctx = NULL;
  int nd = 0, rc;

  s.P = P;
  memset(o, 0, sizeof *o);
  o->out = xcalloc(c->T * H, 2);
  o->d_x = xcalloc(c->T * H, 2);
  o->d_tw = xcalloc(c->T * K, 4);
  uint16_t *x = dev[nd++] = dev_copy(c->x, c->T * H * 2);
  int32_t *ids = dev[nd++] = dev_copy(c->ids, c->T * K * 4);
  float *tw = dev[nd++] = dev_copy(c->tw, c->T * K * 4);
  uint16_t *out = dev[nd++] = dev_copy(NULL, c->T * H * 2);
  uint16_t *dout = dev[nd++] = dev_copy(c->d_out, c->T * H * 2);
  uint16_t *dx = dev[nd++] = dev_copy(NULL, c->T * H * 2);
  float *dtw = dev[nd++] = dev_copy(NULL, c->T * K * 4);
  for (int i = 0; i < MOKK_NWEIGHTS; i++) {
    int64_t n = case_weight_elems(c, i), copies = i >= MOKK_S_GATE ? P : 1;
    if (i >= MOKK_S_GATE && s.I_s == 0)
      continue;
    o->g_bf16[i] = xcalloc(n, 2);
    o->g_f32[i] = xcalloc(n, 4);
    float *seed = xcalloc(n * copies, 4);
    for (int64_t j = 0; j < n * copies; j++)
      seed[j] = seed_grad;
    for (int64_t j = 0; j < n; j++)
      o->g_f32[i][j] = seed_grad;
    if (i >= MOKK_S_GATE) {
      o->g_shared_copy[i] = xcalloc(n * P, 2);
      o->g_shared_copy32[i] = xcalloc(n * P, 4);
    }
    w[i] = dev[nd++] = dev_copy(c->w[i], n * 2);
    g16[i] = dev[nd++] = dev_copy(NULL, n * copies * 2);
    g32[i] = dev[nd++] = dev_copy(seed, n * copies * 4);
    free(seed);
  }
  for (int r = 0; r < P; r++) {
    fr[r].x = x + r * T * H;
    fr[r].topk_ids = ids + r * T * K;
    fr[r].topk_weights = tw + r * T * K;
    fr[r].out = out + r * T * H;
    br[r].d_out = dout + r * T * H;
    br[r].d_x = dx + r * T * H;
    br[r].d_topk_weights = dtw + r * T * K;
    fr[r].dev = br[r].dev = on != NULL ? on[r] : NULL;
    for (int i = 0; i < MOKK_NWEIGHTS; i++) {
      if (w[i] == NULL)
        continue;
      /* routed: rank r's slice; shared: the same weights, a gradient each */
      int64_t at = i < MOKK_S_GATE ? r * El * s.I * H : 0;
      int64_t gat = i < MOKK_S_GATE ? at : r * case_weight_elems(c, i);
      fr[r].w[i] = (uint16_t *)w[i] + at;
      br[r].g_bf16[i] = (uint16_t *)g16[i] + gat;
      br[r].g_f32[i] = (float *)g32[i] + gat;
    }
  }
  rc = mokk_forward(gpu, &s, T, fr, &ctx, err);
  if (held != NULL)
    *held = ctx != NULL ? mokk_ctx_bytes(gpu, ctx) : 0;
  if (rc == 0)
    rc = mokk_backward_flags(gpu, ctx, mode, bwd_flags, br, err);
  if (rc == 0 && (bwd_flags & MOKK_BWD_LAST)) { /* its saved state is gone */
    char e2[MOK_ERRLEN] = "";
    ck_assert_int_eq(mokk_backward(gpu, ctx, mode, br, e2), MOK_ECONTEXT);
    ck_assert_msg(strstr(e2, "used up") != NULL, "%s", e2);
  }
  mokk_ctx_free(gpu, ctx);
  if (rc == 0)
    rc = mokk_cuda_sync(gpu, err);
  else
    mokk_cuda_sync(gpu, err + strlen(err));
  host_copy(o->out, out, c->T * H * 2);
  host_copy(o->d_x, dx, c->T * H * 2);
  host_copy(o->d_tw, dtw, c->T * K * 4);
  for (int i = 0; i < MOKK_NWEIGHTS; i++) {
    int64_t n = case_weight_elems(c, i);
    if (w[i] == NULL)
      continue;
    host_copy(o->g_bf16[i], g16[i], n * 2);
    host_copy(o->g_f32[i], g32[i], n * 4);
    if (i >= MOKK_S_GATE) {
      host_copy(o->g_shared_copy[i], g16[i], n * P * 2);
      host_copy(o->g_shared_copy32[i], g32[i], n * P * 4);
    }
  }
  for (int i = 0; i < nd; i++)
    cudaFree(dev[i]);
  return rc;
}

static int gpu_run_ranks(const moe_case *c, int P, mokk_grad_mode mode, float seed_grad,
                         moe_out *o, char *err)
{
  return gpu_run_ranks_on(c, P, mode, seed_grad, NULL, o, NULL, err);
}

/* P = 2, 4, 8 virtual ranks against P = 1, bit for bit (DESIGN §2.3), on
 * one buffer set for all ranks and on a buffer set and stream per rank (the
 * layout of ranks on several GPUs: mokk_cuda_set_spread). on: each rank's
 * backend (rank r runs on on[r]), or NULL. */
static void ranks_bitwise_on(mokk_shape s, int64_t T, route_kind route, mokk_grad_mode mode,
                             uint64_t seed, mokk_backend *const *on)
{
  char err[2 * MOK_ERRLEN] = "";
  int64_t H = s.H, K = s.K;
  moe_case cs;
  moe_out base, o;
  int fp32 = mode == MOKK_GRAD_FP32_ACCUM;
  size_t es = fp32 ? 4 : 2;

  case_make(&cs, &s, T, seed, route);
  ck_assert_msg(gpu_run_ranks(&cs, 1, mode, 0.25f, &base, err) == 0, "%s", err);
  /* P = 1 itself against the CPU engine: the ranks must match real results,
   * not two runs that wrote nothing */
  moe_out oc;
  ck_assert_msg(case_run(cpu, &cs, 1, 1, mode, 0.25f, &oc, err) == 0, "cpu: %s", err);
  expect_close_bf16(oc.out, base.out, T * H, TOL_FWD, "P=1: out");
  expect_close_bf16(oc.d_x, base.d_x, T * H, TOL_BWD, "P=1: d_x");
  expect_close_f32(oc.d_tw, base.d_tw, T * K, TOL_FWD, "P=1: d_topk_weights");
  for (int w = 0; w < (s.I_s > 0 ? MOKK_NWEIGHTS : MOKK_S_GATE); w++) {
    int64_t n = case_weight_elems(&cs, w);
    if (fp32)
      expect_close_f32(oc.g_f32[w], base.g_f32[w], n, TOL_BWD, wname[w]);
    else
      expect_close_bf16(oc.g_bf16[w], base.g_bf16[w], n, TOL_BWD, wname[w]);
  }
  out_free(&oc);
  for (int i = 0; i < 6; i++) {
    int P = 2 << (i % 3), spread = i / 3;
    mokk_shape sp = s;
    uint64_t held = 0, bound;
    int spans = 0;
    sp.P = P;
    for (int r = 0; on != NULL && r < P; r++)
      spans |= mokk_cuda_device(on[r]) != mokk_cuda_device(gpu);
    mokk_cuda_set_spread(gpu, spread);
    int rc = gpu_run_ranks_on(&cs, P, mode, 0.25f, on, &o, &held, err);
    bound = mokk_backend_ctx_bound(gpu, &sp, T / P, spans);
    mokk_cuda_set_spread(gpu, 0);
    ck_assert_msg(rc == 0, "P=%d spread=%d: %s", P, spread, err);
    /* what the daemon charges before the step covers what it holds */
    ck_assert_msg(held > 0 && held <= bound, "P=%d spread=%d: context %llu bytes, bound %llu",
                  P, spread, (unsigned long long)held, (unsigned long long)bound);
    ck_assert_msg(memcmp(o.out, base.out, (size_t)(T * H) * 2) == 0, "P=%d spread=%d: out", P,
                  spread);
    ck_assert_msg(memcmp(o.d_x, base.d_x, (size_t)(T * H) * 2) == 0, "P=%d spread=%d: d_x", P,
                  spread);
    ck_assert_msg(memcmp(o.d_tw, base.d_tw, (size_t)(T * K) * 4) == 0,
                  "P=%d spread=%d: d_topk_weights", P, spread);
    for (int w = 0; w < (s.I_s > 0 ? MOKK_NWEIGHTS : MOKK_S_GATE); w++) {
      size_t n = (size_t)case_weight_elems(&cs, w) * es;
      const void *want = fp32 ? (const void *)base.g_f32[w] : (const void *)base.g_bf16[w];
      if (w < MOKK_S_GATE) {
        const void *got = fp32 ? (const void *)o.g_f32[w] : (const void *)o.g_bf16[w];
        ck_assert_msg(memcmp(got, want, n) == 0, "P=%d spread=%d: gradient %s", P, spread,
                      wname[w]);
        continue;
      }
      for (int r = 0; r < P; r++) {
        const char *got = fp32 ? (const char *)o.g_shared_copy32[w]
                               : (const char *)o.g_shared_copy[w];
        ck_assert_msg(memcmp(got + r * n, want, n) == 0, "P=%d spread=%d: rank %d's "
                      "gradient %s", P, spread, r, wname[w]);
      }
    }
    out_free(&o);
  }
  printf("ranks_bitwise: T=%lld H=%lld I=%lld E=%lld K=%lld I_s=%lld: P = 2, 4, 8 give the "
         "bits of P = 1, on one buffer set and on a set per rank\n", (long long)T,
         (long long)H, (long long)s.I, (long long)s.E, (long long)K, (long long)s.I_s);
  out_free(&base);
  case_free(&cs);
}

static void ranks_bitwise(mokk_shape s, int64_t T, route_kind route, mokk_grad_mode mode,
                          uint64_t seed)
{
  ranks_bitwise_on(s, T, route, mode, seed, NULL);
}

/* The shapes of ep_ranks_bitwise, with each rank's backend named: the ranks
 * of the one GPU, or of two linked ones. */
static void ranks_bitwise_cases(mokk_backend *const *on)
{
  ranks_bitwise_on((mokk_shape){.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 128, .P = 1,
                                .swiglu_limit = 0.8f},
                   8 * 75, ROUTE_RANDOM, MOKK_GRAD_BF16, 61, on);
  ranks_bitwise_on((mokk_shape){.H = 128, .I = 192, .E = 8, .K = 8, .I_s = 64, .P = 1},
                   8 * 75, ROUTE_RANDOM, MOKK_GRAD_FP32_ACCUM, 62, on);
  ranks_bitwise_on((mokk_shape){.H = 128, .I = 64, .E = 8, .K = 3, .I_s = 64, .P = 1}, 8 * 7,
                   ROUTE_DROPS, MOKK_GRAD_FP32_ACCUM, 64, on);
  ranks_bitwise_on((mokk_shape){.H = 128, .I = 64, .E = 16, .K = 2, .I_s = 64, .P = 1}, 8 * 5,
                   ROUTE_SAME, MOKK_GRAD_BF16, 66, on);
}

/* Each rank's backend named explicitly. On one GPU: the GPU's own backend
 * for every rank, which must change nothing (a link of the backend with
 * itself is a no-op), and a backend of another kind is refused. On two: the
 * ranks alternate between GPUs 0 and 1, refused before mokk_cuda_link and
 * the bits of P = 1 after it, in both layouts (ranks elsewhere always take
 * the spread one). */
START_TEST(ep_rank_devices)
{
  char err[2 * MOK_ERRLEN] = "";
  mokk_backend *on[MOKK_DEVICE_MAX_RANKS], *pair[2] = {gpu, gpu}, *b1 = NULL;
  moe_case cs;
  moe_out o;

  ck_assert_msg(mokk_cuda_link(&gpu, 1, err) == 0, "%s", err);
  ck_assert_msg(mokk_cuda_link(pair, 2, err) == 0, "%s", err);
  ck_assert_int_eq(mokk_cuda_linked(gpu, mokk_cuda_device(gpu)), 1);
  for (int r = 0; r < MOKK_DEVICE_MAX_RANKS; r++)
    on[r] = gpu;
  ranks_bitwise_cases(on);
  printf("ep_rank_devices: every rank's dev set to the one GPU's backend: the bits of P = 1\n");

  case_make(&cs, &(mokk_shape){.H = 128, .I = 64, .E = 4, .K = 2, .P = 1}, 2 * 8,
            ROUTE_RANDOM, 67);
  on[1] = cpu;
  ck_assert_int_eq(gpu_run_ranks_on(&cs, 2, MOKK_GRAD_BF16, 0, on, &o, NULL, err), MOK_EINVAL);
  ck_assert_msg(strstr(err, "EP rank 1 names a cpu backend to run on") != NULL, "%s", err);
  out_free(&o);
  on[1] = gpu;
  ck_assert_int_eq(mokk_cuda_link(&cpu, 1, err), MOK_EINVAL);
  ck_assert_msg(strstr(err, "not a CUDA backend") != NULL, "%s", err);

  if (mokk_cuda_devices(err) < 2) {
    printf("ep_rank_devices: fewer than two GPUs visible; ranks on two GPUs skipped\n");
    case_free(&cs);
    return;
  }
  ck_assert_msg(mokk_cuda_create(1, &b1, err) == 0, "%s", err);
  /* the tensors stay on GPU 0 (making b1 made GPU 1 current): the ranks on
   * GPU 1 reach them through peer access */
  ck_assert_int_eq(cudaSetDevice(mokk_cuda_device(gpu)), cudaSuccess);
  for (int r = 0; r < MOKK_DEVICE_MAX_RANKS; r++)
    on[r] = r % 2 ? b1 : gpu;
  ck_assert_int_eq(gpu_run_ranks_on(&cs, 2, MOKK_GRAD_BF16, 0, on, &o, NULL, err),
                   MOK_ENOTSUP);
  ck_assert_msg(strstr(err, "not linked (mokk_cuda_link)") != NULL, "%s", err);
  printf("ep_rank_devices: before the link: %s\n", err);
  out_free(&o);
  pair[1] = b1;
  ck_assert_msg(mokk_cuda_link(pair, 2, err) == 0, "%s", err);
  ck_assert_msg(mokk_cuda_link(pair, 2, err) == 0, "a second link: %s", err);
  ranks_bitwise_cases(on);
  printf("ep_rank_devices: ranks on GPUs 0 and 1: the bits of P = 1\n");
  ck_assert_msg(mokk_cuda_sync(gpu, err) == 0, "%s", err);
  mokk_backend_destroy(b1);
  case_free(&cs);
}
END_TEST

START_TEST(ep_ranks_bitwise)
{
  ranks_bitwise((mokk_shape){.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 128, .P = 1,
                             .swiglu_limit = 0.8f},
                8 * 75, ROUTE_RANDOM, MOKK_GRAD_BF16, 61);
  /* 600 rows an expert: m-tiles that straddle ranks' tokens, several per expert */
  ranks_bitwise((mokk_shape){.H = 128, .I = 192, .E = 8, .K = 8, .I_s = 64, .P = 1},
                8 * 75, ROUTE_RANDOM, MOKK_GRAD_FP32_ACCUM, 62);
  ranks_bitwise((mokk_shape){.H = 128, .I = 64, .E = 16, .K = 2, .P = 1}, 8 * 9, ROUTE_HALF,
                MOKK_GRAD_BF16, 63);
  ranks_bitwise((mokk_shape){.H = 128, .I = 64, .E = 8, .K = 3, .I_s = 64, .P = 1}, 8 * 7,
                ROUTE_DROPS, MOKK_GRAD_FP32_ACCUM, 64);
  /* every token on experts 0 and 1: all ranks but rank 0 own no rows */
  ranks_bitwise((mokk_shape){.H = 128, .I = 64, .E = 16, .K = 2, .I_s = 64, .P = 1}, 8 * 5,
                ROUTE_SAME, MOKK_GRAD_BF16, 66);

  /* more virtual ranks than the backend runs on one GPU */
  char err[2 * MOK_ERRLEN] = "";
  moe_case cs;
  moe_out o;
  case_make(&cs, &(mokk_shape){.H = 128, .I = 64, .E = 18, .K = 2, .P = 1}, 9 * 4,
            ROUTE_RANDOM, 65);
  ck_assert_int_eq(gpu_run_ranks(&cs, 9, MOKK_GRAD_BF16, 0, &o, err), MOK_ENOTSUP);
  ck_assert_msg(strstr(err, "at most 8 EP ranks on one GPU; P = 9") != NULL, "%s", err);
  printf("ep_ranks_bitwise: P = 9: %s\n", err);
  out_free(&o);
  case_free(&cs);
}
END_TEST

/* An expert id out of range in the last rank's tokens fails the EP step
 * with MOK_EEXPERT in both layouts (in the spread one, one rank's schedule
 * raises the flag for all), and the flag does not stick: the same case
 * with the id put right runs. */
START_TEST(ep_bad_expert_id)
{
  char err[2 * MOK_ERRLEN] = "";
  const mokk_shape s = {.H = 128, .I = 64, .E = 8, .K = 2, .I_s = 64, .P = 1};
  moe_case c;
  moe_out o;

  case_make(&c, &s, 4 * 6, 81, ROUTE_RANDOM);
  for (int i = 0; i < 4; i++) {
    int P = i % 2 ? 4 : 2, spread = i / 2;
    const int64_t at = (c.T - 1) * s.K + 1; /* the last token: the last rank's */
    const int32_t good = c.ids[at];
    c.ids[at] = (int32_t)s.E;
    mokk_cuda_set_spread(gpu, spread);
    int rc = gpu_run_ranks(&c, P, MOKK_GRAD_BF16, 0, &o, err);
    out_free(&o);
    ck_assert_msg(rc == MOK_EEXPERT, "P=%d spread=%d: %d (%s)", P, spread, rc, err);
    ck_assert_msg(strstr(err, "outside [0, E)") != NULL, "P=%d spread=%d: %s", P, spread, err);
    c.ids[at] = good;
    rc = gpu_run_ranks(&c, P, MOKK_GRAD_BF16, 0, &o, err);
    mokk_cuda_set_spread(gpu, 0);
    ck_assert_msg(rc == 0, "P=%d spread=%d, ids put right: %s", P, spread, err);
    out_free(&o);
  }
  case_free(&c);
}
END_TEST

/* The cases the rank processes of ep_daemon_bitwise rebuild, by index. */
static const struct {
  mokk_shape s;
  int64_t T; /* global tokens */
  route_kind route;
  uint64_t seed;
} ep_cases[] = {
    {{.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 128, .P = 1, .swiglu_limit = 0.8f}, 4 * 60,
     ROUTE_RANDOM, 71},
    {{.H = 128, .I = 64, .E = 8, .K = 2, .I_s = 64, .P = 1}, 4 * 9, ROUTE_HALF, 72},
};

/* Case `which` of ep_cases, whole: P = 1, every token. */
static void ep_case_make(moe_case *c, int which)
{
  case_make(c, &ep_cases[which].s, ep_cases[which].T, ep_cases[which].seed,
            ep_cases[which].route);
}

/* What one rank's process writes to its file: out, d_x, d_topk_weights of
 * its tokens, then its gradients (bf16, its experts' and the shared ones). */
static size_t ep_rank_bytes(const moe_case *c, int P)
{
  int64_t T = c->T / P;
  size_t n = (size_t)(T * c->s.H) * 4 + (size_t)(T * c->s.K) * 4;
  for (int w = 0; w < MOK_NWEIGHTS; w++)
    n += (size_t)(case_weight_elems(c, w) / (w < MOK_S_GATE ? P : 1)) * 2;
  return n;
}

#define EP_TRY(call, cl)                                                                   \
  do {                                                                                     \
    int rc_ = (call);                                                                      \
    if (rc_ != 0) {                                                                        \
      fprintf(stderr, "ep rank: %s: %d %s\n", #call, rc_, mok_last_error(cl));              \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

/* A rank process of ep_daemon_bitwise (check_gpu --ep-rank, a fresh process:
 * CUDA was initialised in the parent before its fork). Its settings come
 * in MOKD_EP_* variables. */
static int ep_rank_main(void)
{
  const char *sock = getenv("MOKD_EP_SOCK"), *path = getenv("MOKD_EP_OUT");
  int which = atoi(getenv("MOKD_EP_CASE")), P = atoi(getenv("MOKD_EP_P")),
      r = atoi(getenv("MOKD_EP_RANK"));
  uint64_t group = strtoull(getenv("MOKD_EP_GROUP"), NULL, 10);
  moe_case c;
  mok_client *cl = NULL;
  mok_tensor x, ids, tw, dout, w[MOK_NWEIGHTS];
  mok_arena_info ar = {0};
  mok_forward_result fr;
  mok_backward_result br;
  uint64_t layer;

  ep_case_make(&c, which);
  const mokk_shape s = c.s;
  int64_t T = c.T / P, H = s.H, K = s.K, El = s.E / P;
  const char *on = getenv("MOKD_EP_DEVICE");
  if (on != NULL)
    EP_TRY(mok_connect_device(sock, "ep-rank", atoi(on), &cl), cl);
  else
    EP_TRY(mok_connect(sock, "ep-rank", &cl), cl);
  size_t at = layer_place(0, &s, T, El, &x, &dout, &ids, &tw, w);
  EP_TRY(mok_arena_create(cl, at, &ar), cl);
  layer_place(ar.id, &s, T, El, &x, &dout, &ids, &tw, w);
  EP_TRY(mok_tensor_write(cl, &x, c.x + r * T * H), cl);
  EP_TRY(mok_tensor_write(cl, &dout, c.d_out + r * T * H), cl);
  EP_TRY(mok_tensor_write(cl, &ids, c.ids + r * T * K), cl);
  EP_TRY(mok_tensor_write(cl, &tw, c.tw + r * T * K), cl);
  for (int i = 0; i < (s.I_s ? MOK_NWEIGHTS : MOK_S_GATE); i++)
    EP_TRY(mok_tensor_write(cl, &w[i], c.w[i] + (i < MOK_S_GATE ? r * El * s.I * H : 0)), cl);

  mok_layer_desc d = {.hidden = H, .intermediate = s.I, .experts = s.E, .top_k = K,
                      .shared_intermediate = s.I_s, .swiglu_limit = s.swiglu_limit,
                      .grad_mode = MOK_GRAD_BF16};
  EP_TRY(mok_layer_desc_ep(&d, group, (uint32_t)P, (uint32_t)r), cl);
  EP_TRY(mok_layer_create(cl, &d, &layer), cl);
  EP_TRY(mok_layer_set_weights(cl, layer, w), cl);
  EP_TRY(mok_forward(cl, layer, &x, &ids, &tw, 0, &fr), cl);
  EP_TRY(mok_backward(cl, fr.context, &dout, NULL, 0, &br), cl);

  /* no ck_assert here (xcalloc has one): outside a test, Check exits 2 */
  size_t bytes = ep_rank_bytes(&c, P), off = 0;
  char *buf = calloc(bytes, 1);
  if (buf == NULL) {
    fprintf(stderr, "ep rank %d: out of memory\n", r);
    return 1;
  }
  EP_TRY(mok_tensor_read(cl, &fr.out, buf), cl);
  off += (size_t)(T * H) * 2;
  EP_TRY(mok_tensor_read(cl, &br.d_x, buf + off), cl);
  off += (size_t)(T * H) * 2;
  EP_TRY(mok_tensor_read(cl, &br.d_topk_weights, buf + off), cl);
  off += (size_t)(T * K) * 4;
  for (int i = 0; i < (int)br.ngrads; i++) {
    EP_TRY(mok_tensor_read(cl, &br.grads[i], buf + off), cl);
    off += (size_t)(case_weight_elems(&c, i) / (i < MOK_S_GATE ? P : 1)) * 2;
  }
  mok_close(cl);
  FILE *f = fopen(path, "wb");
  if (f == NULL || fwrite(buf, 1, bytes, f) != bytes || fclose(f) != 0) {
    fprintf(stderr, "ep rank %d: cannot write %s\n", r, path);
    return 1;
  }
  free(buf);
  case_free(&c);
  return 0;
}

/* One EP group of P rank processes on the daemon of dr, case `which`, rank
 * r's client on CUDA device r % ndev (ndev 1: where the daemon places it):
 * each rank's results against og, the one session running the whole batch. */
static void ep_group_check(const daemon_run *dr, int which, int P, uint64_t group,
                           const moe_out *og, int ndev)
{
  moe_case cs;
  ep_case_make(&cs, which);
  const mokk_shape s = cs.s;
  int64_t T = cs.T / P, H = s.H, K = s.K;
  size_t bytes = ep_rank_bytes(&cs, P);
  char path[4][128], env[6][64];
  pid_t pid[4];
  for (int r = 0; r < P; r++) {
    snprintf(path[r], sizeof path[r], "/tmp/mokd-ep-%d-%d-%d.bin", (int)getpid(), P, r);
    if ((pid[r] = fork()) == 0) {
      snprintf(env[0], sizeof env[0], "%d", which);
      snprintf(env[1], sizeof env[1], "%d", P);
      snprintf(env[2], sizeof env[2], "%d", r);
      snprintf(env[3], sizeof env[3], "%llu", (unsigned long long)group);
      setenv("MOKD_EP_SOCK", dr->sock, 1);
      setenv("MOKD_EP_OUT", path[r], 1);
      setenv("MOKD_EP_CASE", env[0], 1);
      setenv("MOKD_EP_P", env[1], 1);
      setenv("MOKD_EP_RANK", env[2], 1);
      setenv("MOKD_EP_GROUP", env[3], 1);
      snprintf(env[4], sizeof env[4], "%d", r % ndev);
      if (ndev > 1)
        setenv("MOKD_EP_DEVICE", env[4], 1);
      execl("/proc/self/exe", "check_gpu", "--ep-rank", (char *)NULL);
      _exit(127);
    }
    ck_assert_int_gt(pid[r], 0);
  }
  for (int r = 0; r < P; r++) {
    int sts;
    ck_assert_int_eq(waitpid(pid[r], &sts, 0), pid[r]);
    ck_assert_msg(WIFEXITED(sts) && WEXITSTATUS(sts) == 0, "case %d P=%d: rank %d "
                  "failed (status %d); its output is above", which, P, r, sts);
  }
  for (int r = 0; r < P; r++) {
    char *got = xcalloc((int64_t)bytes, 1);
    FILE *f = fopen(path[r], "rb");
    ck_assert_msg(f != NULL && fread(got, 1, bytes, f) == bytes, "%s", path[r]);
    fclose(f);
    unlink(path[r]);
    size_t off = 0, n = (size_t)(T * H) * 2;
    ck_assert_msg(memcmp(got, og->out + r * T * H, n) == 0, "case %d P=%d rank %d: out",
                  which, P, r);
    off += n;
    ck_assert_msg(memcmp(got + off, og->d_x + r * T * H, n) == 0,
                  "case %d P=%d rank %d: d_x", which, P, r);
    off += n;
    n = (size_t)(T * K) * 4;
    ck_assert_msg(memcmp(got + off, og->d_tw + r * T * K, n) == 0,
                  "case %d P=%d rank %d: d_topk_weights", which, P, r);
    off += n;
    for (int w = 0; w < (s.I_s ? MOK_NWEIGHTS : MOK_S_GATE); w++) {
      int64_t e = case_weight_elems(&cs, w) / (w < MOK_S_GATE ? P : 1);
      ck_assert_msg(memcmp(got + off, og->g_bf16[w] + (w < MOK_S_GATE ? r * e : 0),
                           (size_t)e * 2) == 0, "case %d P=%d rank %d: gradient %s",
                    which, P, r, wname[w]);
      off += (size_t)e * 2;
    }
    free(got);
  }
  case_free(&cs);
}

/* P client processes, one a rank of an EP group on the cuda backend, get
 * the bits of one session running the whole batch with all experts: each
 * rank its tokens' out, d_x and d_topk_weights, its experts' gradients and
 * the shared expert's. A group of 9 is refused at CreateLayer. */
START_TEST(ep_daemon_bitwise)
{
  uint64_t group = 1;
  /* a mokd whose EP steps share one buffer set, then one whose steps take a
   * set and a stream per rank (MOKD_EP_SPREAD=1, the multi-GPU layout) */
  for (int spread = 0; spread < 2; spread++) {
    daemon_run dr;
    if (spread)
      setenv("MOKD_EP_SPREAD", "1", 1);
    mok_client *c = daemon_start(&dr, NULL, NULL);
    unsetenv("MOKD_EP_SPREAD");
    int dev = mok_server_info(c)->device;

    for (int which = 0; which < (int)(sizeof ep_cases / sizeof ep_cases[0]); which++) {
      moe_case cs;
      moe_out og;
      daemon_step st;
      ep_case_make(&cs, which);
      daemon_layer(c, &cs, dev, &og, &st); /* P = 1, every expert, every token */
      for (int P = 2; P <= 4; P *= 2) {
        ep_group_check(&dr, which, P, ++group, &og, 1);
        printf("ep_daemon_bitwise: case %d, P = %d rank processes%s: the bits of P = 1\n",
               which, P, spread ? ", a buffer set per rank" : "");
      }
      out_free(&og);
      case_free(&cs);
    }

    if (!spread) { /* more virtual ranks than one GPU runs */
      mok_layer_desc d = {.hidden = 256, .intermediate = 128, .experts = 18, .top_k = 2};
      uint64_t layer;
      ck_assert_int_eq(mok_layer_desc_ep(&d, ++group, 9, 0), 0);
      ck_assert_int_eq(mok_layer_create(c, &d, &layer), MOK_ENOTSUP);
      ck_assert_msg(strstr(mok_last_error(c), "at most 8 ranks") != NULL, "%s",
                    mok_last_error(c));
      printf("ep_daemon_bitwise: a group of 9: %s\n", mok_last_error(c));
    }
    mok_close(c);
    daemon_stop(&dr);
  }
}
END_TEST

/* An EP group whose rank processes sit on GPUs 0 and 1 (rank r on r % 2) of
 * a daemon running both: each rank gets the bits of one session on GPU 0
 * running the whole batch, its events and outputs on its own GPU. */
START_TEST(ep_daemon_two_gpus)
{
  char err[MOK_ERRLEN];
  uint64_t group = 1000;

  if (mokk_cuda_devices(err) < 2) {
    printf("ep_daemon_two_gpus: fewer than two GPUs visible; skipped\n");
    return;
  }
  daemon_run dr;
  mok_client *c = daemon_start(&dr, "--devices", "0,1");
  mok_close(c);
  ck_assert_msg(mok_connect_device(dr.sock, "gpu0", 0, &c) == 0, "%s", mok_last_error(c));
  for (int which = 0; which < (int)(sizeof ep_cases / sizeof ep_cases[0]); which++) {
    moe_case cs;
    moe_out og;
    daemon_step st;
    ep_case_make(&cs, which);
    daemon_layer(c, &cs, 0, &og, &st); /* P = 1 on GPU 0 */
    for (int P = 2; P <= 4; P *= 2) {
      ep_group_check(&dr, which, P, ++group, &og, 2);
      printf("ep_daemon_two_gpus: case %d, P = %d rank processes on GPUs 0 and 1: the bits "
             "of P = 1\n", which, P);
    }
    out_free(&og);
    case_free(&cs);
  }
  mok_close(c);
  daemon_stop(&dr);
}
END_TEST

static Suite *gpu_suite(void)
{
  Suite *su = suite_create("cuda");
  TCase *tc = tcase_create("gemm_core");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, gemm_core_layouts);
  suite_add_tcase(su, tc);
  tc = tcase_create("vs_cpu");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, schedule_exact);
  tcase_add_test(tc, dispatch_exact);
  tcase_add_test(tc, small_routed);
  tcase_add_test(tc, shared_and_clamp);
  tcase_add_test(tc, fp32_accumulate);
  tcase_add_test(tc, one_token);
  tcase_add_test(tc, empty_experts);
  tcase_add_test(tc, all_on_one_expert);
  tcase_add_test(tc, tokens_not_tile_multiple);
  tcase_add_test(tc, pairs_with_no_route);
  tcase_add_test(tc, many_experts_a_token);
  tcase_add_test(tc, riding_tails);
  tcase_add_test(tc, long_experts);
  tcase_add_test(tc, no_route_is_an_absent_pair);
  suite_add_tcase(su, tc);
  tc = tcase_create("determinism");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, repeat_20_bitwise);
  tcase_add_test(tc, backward_reads_moved_weights);
  tcase_add_test(tc, block_count_invariance);
  tcase_add_test(tc, tile_order_invariance);
  tcase_add_test(tc, ride_invariance);
  tcase_add_test(tc, gather_invariance);
  tcase_add_test(tc, gather_auto_rule);
  tcase_add_test(tc, gather_ahead_invariance);
  tcase_add_test(tc, gather_order_invariance);
  tcase_add_test(tc, layer_tuning_invariance);
  tcase_add_test(tc, epilogue_invariance);
  tcase_add_test(tc, last_invariance);
  tcase_add_test(tc, batch_invariance);
  suite_add_tcase(su, tc);
  tc = tcase_create("errors");
  tcase_add_test(tc, errors);
  tcase_add_test(tc, errors_env);
  suite_add_tcase(su, tc);
  tc = tcase_create("daemon");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, through_daemon);
  tcase_add_test(tc, stream_ordering);
  tcase_add_test(tc, expandable_chunks);
  tcase_add_test(tc, gpu_quota);
  tcase_add_test(tc, two_gpus);
  suite_add_tcase(su, tc);
  tc = tcase_create("ep_cuda");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, ep_ranks_bitwise);
  tcase_add_test(tc, ep_bad_expert_id);
  tcase_add_test(tc, ep_rank_devices);
  tcase_add_test(tc, ep_daemon_bitwise);
  tcase_add_test(tc, ep_daemon_two_gpus);
  suite_add_tcase(su, tc);
  tc = tcase_create("identity");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, remapped_visible_devices);
  tcase_add_test(tc, import_on_another_gpu);
  suite_add_tcase(su, tc);
  return su;
}

/* What a process started by remapped_visible_devices runs. */
static Suite *remapped_suite(void)
{
  Suite *su = suite_create("remapped");
  TCase *tc = tcase_create("remapped_client");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, remapped_client);
  suite_add_tcase(su, tc);
  return su;
}

int main(int argc, char **argv)
{
  char err[MOK_ERRLEN] = "";
  int n = mokk_gpu_count(err), failed;
  int remapped = argc == 2 && strcmp(argv[1], "--remapped-client") == 0;
  SRunner *sr;

  if (argc == 2 && strcmp(argv[1], "--ep-rank") == 0)
    return ep_rank_main() == 0 ? EXIT_SUCCESS : EXIT_FAILURE;

  if (n <= 0) {
    printf("gpu-check: no usable CUDA device (%s); GPU tests skipped\n",
           n < 0 ? err : "none visible");
    return remapped ? EXIT_FAILURE : EXIT_SUCCESS;
  }
  if (mokk_cuda_create(0, &gpu, err) || mokk_cpu_create(0, &cpu, err)) {
    fprintf(stderr, "gpu-check: %s\n", err);
    return EXIT_FAILURE;
  }
  /* the parent's CK_RUN_CASE names a case of its suite, not of this one */
  if (remapped)
    unsetenv("CK_RUN_CASE"), unsetenv("CK_RUN_SUITE");
  sr = srunner_create(remapped ? remapped_suite() : gpu_suite());
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr) + (remapped && srunner_ntests_run(sr) != 1);
  srunner_free(sr);
  mokk_backend_destroy(gpu);
  mokk_backend_destroy(cpu);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
