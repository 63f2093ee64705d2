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
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "cuda/cuda_backend.h"
#include "mok.h"
#include "ref.h"

static mokk_backend *gpu, *cpu;

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

/* The case on the GPU (P = 1); outputs come back into o like case_run's. */
static int gpu_run(const moe_case *c, int bwd, mokk_grad_mode mode, float seed_grad,
                   moe_out *o, char *err)
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

static void expect_same(const moe_out *a, const moe_out *b, const moe_case *c, const char *why)
{
  const mokk_shape *s = &c->s;
  ck_assert_msg(memcmp(a->out, b->out, c->T * s->H * 2) == 0, "%s: out differs", why);
  ck_assert_msg(memcmp(a->d_x, b->d_x, c->T * s->H * 2) == 0, "%s: d_x differs", why);
  ck_assert_msg(memcmp(a->d_tw, b->d_tw, c->T * s->K * 4) == 0, "%s: d_tw differs", why);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    if (a->g_bf16[w] == NULL)
      continue;
    int64_t n = case_weight_elems(c, w);
    ck_assert_msg(memcmp(a->g_bf16[w], b->g_bf16[w], n * 2) == 0, "%s: %s differs", why,
                  wname[w]);
  }
}

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
  c.ids[7] = -1;
  ck_assert_int_eq(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &o, err), MOK_EEXPERT);
  ck_assert_msg(strstr(err, "outside [0, E)") != NULL, "%s", err);
  out_free(&o);
  /* the flag does not stick: a clean step afterwards succeeds */
  c.ids[3] = 0, c.ids[7] = 1;
  ck_assert_msg(gpu_run(&c, 1, MOKK_GRAD_BF16, 0, &o, err) == 0, "%s", err);
  out_free(&o), case_free(&c);

  s.P = 2;
  s.E = 4;
  {
    mokk_fwd_rank fr[2] = {0};
    for (int r = 0; r < 2; r++) {
      fr[r].x = fr[r].out = (void *)16;
      fr[r].topk_ids = (void *)16;
      fr[r].topk_weights = (void *)16;
      fr[r].w[0] = fr[r].w[1] = fr[r].w[2] = (void *)16;
    }
    ck_assert_int_eq(mokk_forward(gpu, &s, 4, fr, NULL, err), MOK_ENOTSUP);
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

/* mokd --backend cuda on a private socket; a layer forward and backward
 * through libmok with every tensor in a GPU arena, against the CPU engine. */
START_TEST(through_daemon)
{
  const char *bin = getenv("MOKD_BIN") != NULL ? getenv("MOKD_BIN") : "build/mokd";
  mokk_shape s = {.H = 256, .I = 128, .E = 16, .K = 4, .I_s = 128, .swiglu_limit = 0.8f, .P = 1};
  char sock[108], logp[128], err[2 * MOK_ERRLEN] = "";
  int64_t T = 300, H = s.H, K = s.K;
  mok_tensor x, ids, tw, dout, w[MOK_NWEIGHTS];
  mok_arena_info ar;
  mok_forward_result fr;
  mok_backward_result br;
  mok_client *c = NULL;
  moe_case cs;
  moe_out oc, og;
  uint64_t layer;
  size_t at = 0;
  pid_t pid;
  int st, up = 0;

  snprintf(sock, sizeof sock, "/tmp/mokd-gpu-%d.sock", (int)getpid());
  snprintf(logp, sizeof logp, "/tmp/mokd-gpu-%d.log", (int)getpid());
  if ((pid = fork()) == 0) {
    int fd = open(logp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(bin, "mokd", "--socket", sock, "--config", "/dev/null", "--backend", "cuda",
          (char *)NULL);
    _exit(127);
  }
  ck_assert_int_gt(pid, 0);
  for (int i = 0; i < 500 && !up; i++) {
    up = mok_connect(sock, "gpu-check", &c) == 0;
    if (!up) {
      mok_close(c);
      c = NULL;
      ck_assert_msg(waitpid(pid, &st, WNOHANG) == 0, "mokd exited early; see %s", logp);
      usleep(10000);
    }
  }
  ck_assert_msg(up, "mokd did not come up on %s", sock);
  ck_assert_str_eq(mok_server_info(c)->backend, "cuda");
  ck_assert_int_eq(mok_server_info(c)->ndevices, 1);

  case_make(&cs, &s, T, 21, ROUTE_RANDOM);
  for (int pass = 0; pass < 2; pass++) {
    uint64_t id = pass ? ar.id : 0;
    at = 0;
    x = place(id, &at, MOK_DTYPE_BF16, 2, T, H, 0);
    dout = place(id, &at, MOK_DTYPE_BF16, 2, T, H, 0);
    ids = place(id, &at, MOK_DTYPE_I32, 2, T, K, 0);
    tw = place(id, &at, MOK_DTYPE_F32, 2, T, K, 0);
    w[MOK_W_GATE] = place(id, &at, MOK_DTYPE_BF16, 3, s.E, s.I, H);
    w[MOK_W_UP] = place(id, &at, MOK_DTYPE_BF16, 3, s.E, s.I, H);
    w[MOK_W_DOWN] = place(id, &at, MOK_DTYPE_BF16, 3, s.E, H, s.I);
    w[MOK_S_GATE] = place(id, &at, MOK_DTYPE_BF16, 2, s.I_s, H, 0);
    w[MOK_S_UP] = place(id, &at, MOK_DTYPE_BF16, 2, s.I_s, H, 0);
    w[MOK_S_DOWN] = place(id, &at, MOK_DTYPE_BF16, 2, H, s.I_s, 0);
    if (pass == 0)
      ck_assert_msg(mok_arena_create(c, at, &ar) == 0, "%s", mok_last_error(c));
  }
  ck_assert_int_eq(ar.device, 0); /* a GPU arena on device 0 */
  ck_assert(mok_tensor_write(c, &x, cs.x) == 0);
  ck_assert(mok_tensor_write(c, &dout, cs.d_out) == 0);
  ck_assert(mok_tensor_write(c, &ids, cs.ids) == 0);
  ck_assert(mok_tensor_write(c, &tw, cs.tw) == 0);
  for (int i = 0; i < MOK_NWEIGHTS; i++)
    ck_assert(mok_tensor_write(c, &w[i], cs.w[i]) == 0);

  mok_layer_desc d = {.hidden = H, .intermediate = s.I, .experts = s.E, .top_k = K,
                      .shared_intermediate = s.I_s, .swiglu_limit = s.swiglu_limit,
                      .grad_mode = MOK_GRAD_BF16};
  ck_assert_msg(mok_layer_create(c, &d, &layer) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_layer_set_weights(c, layer, w) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_forward(c, layer, &x, &ids, &tw, 0, &fr) == 0, "%s", mok_last_error(c));
  ck_assert_msg(mok_backward(c, fr.context, &dout, NULL, 0, &br) == 0, "%s",
                mok_last_error(c));

  memset(&og, 0, sizeof og);
  og.out = xcalloc(T * H, 2);
  og.d_x = xcalloc(T * H, 2);
  og.d_tw = xcalloc(T * K, 4);
  ck_assert(mok_tensor_read(c, &fr.out, og.out) == 0);
  ck_assert(mok_tensor_read(c, &br.d_x, og.d_x) == 0);
  ck_assert(mok_tensor_read(c, &br.d_topk_weights, og.d_tw) == 0);
  ck_assert_int_eq(br.ngrads, MOK_NWEIGHTS);
  ck_assert_msg(case_run(cpu, &cs, 1, 1, MOKK_GRAD_BF16, 0, &oc, err) == 0, "%s", err);
  expect_close_bf16(oc.out, og.out, T * H, TOL_FWD, "daemon out");
  expect_close_bf16(oc.d_x, og.d_x, T * H, TOL_BWD, "daemon d_x");
  expect_close_f32(oc.d_tw, og.d_tw, T * K, TOL_FWD, "daemon d_topk_weights");
  for (int i = 0; i < MOK_NWEIGHTS; i++) {
    int64_t n = case_weight_elems(&cs, i);
    og.g_bf16[i] = xcalloc(n, 2);
    ck_assert(mok_tensor_read(c, &br.grads[i], og.g_bf16[i]) == 0);
    expect_close_bf16(oc.g_bf16[i], og.g_bf16[i], n, TOL_BWD, wname[i]);
  }

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

  /* the session's GPU memory is gone once it closes */
  ck_assert(mok_connect(sock, "gpu-check-2", &c) == 0);
  mok_stats sts;
  for (int i = 0; i < 200; i++) {
    ck_assert(mok_stats_get(c, &sts) == 0);
    if (sts.daemon.sessions == 1)
      break;
    usleep(10000);
  }
  ck_assert_int_eq(sts.daemon.arenas, 0);
  ck_assert_int_eq(sts.daemon.arena_bytes, 0);
  ck_assert_int_eq(sts.daemon.contexts, 0);
  mok_close(c);
  kill(pid, SIGTERM);
  ck_assert_int_eq(waitpid(pid, &st, 0), pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "mokd exit status %d; see %s", st, logp);
  unlink(logp);
  out_free(&og), out_free(&oc), case_free(&cs);
}
END_TEST

static Suite *gpu_suite(void)
{
  Suite *su = suite_create("cuda");
  TCase *tc = tcase_create("vs_cpu");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, small_routed);
  tcase_add_test(tc, shared_and_clamp);
  tcase_add_test(tc, fp32_accumulate);
  tcase_add_test(tc, one_token);
  tcase_add_test(tc, empty_experts);
  tcase_add_test(tc, all_on_one_expert);
  tcase_add_test(tc, tokens_not_tile_multiple);
  suite_add_tcase(su, tc);
  tc = tcase_create("determinism");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, repeat_20_bitwise);
  tcase_add_test(tc, block_count_invariance);
  tcase_add_test(tc, batch_invariance);
  suite_add_tcase(su, tc);
  tc = tcase_create("errors");
  tcase_add_test(tc, errors);
  suite_add_tcase(su, tc);
  tc = tcase_create("daemon");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, through_daemon);
  suite_add_tcase(su, tc);
  return su;
}

int main(void)
{
  char err[MOK_ERRLEN] = "";
  int n = mokk_cuda_devices(err), failed;
  SRunner *sr;

  if (n <= 0) {
    printf("gpu-check: no usable CUDA device (%s); GPU tests skipped\n",
           n < 0 ? err : "none visible");
    return EXIT_SUCCESS;
  }
  if (mokk_cuda_create(0, &gpu, err) || mokk_cpu_create(0, &cpu, err)) {
    fprintf(stderr, "gpu-check: %s\n", err);
    return EXIT_FAILURE;
  }
  sr = srunner_create(gpu_suite());
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  mokk_backend_destroy(gpu);
  mokk_backend_destroy(cpu);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
