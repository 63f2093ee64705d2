/* bench_gpu.c - the CUDA backend on the shapes of DESIGN §6, next to the
 * PyTorch torch._grouped_mm baseline run in the same session (--torch), and a
 * check of the full DeepSeek-V3 shape against the CPU engine on samples
 * (--verify). A benchmark: it measures and prints; only --verify can fail.
 *
 * The sample check uses two facts of the math: a token's out, d_x and
 * d_topk_weights depend only on that token, its routing, d_out and the
 * weights; and expert e's weight gradients depend only on the rows routed to
 * e. So the CPU engine runs (a) a few tokens with only the experts they use,
 * and (b) the tokens of one expert, each routed to it alone with its weight,
 * and both are compared with the GPU's full-batch results.
 *
 * With --daemon SOCK the same steps go through a running mokd on the CUDA
 * backend, every tensor in one of its GPU arenas, timed per request. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include "backend.h"
#include "bf16.h"
#include "cuda/cuda_backend.h"
#include "devices.h"
#include "mok.h"
#include "trace.h"

int bench_fill_bf16(void *p, int64_t n, uint64_t seed, float scale);

typedef struct shape_def {
  char name[32];
  int64_t T, H, I, E, K, Is;
} shape_def;

#define MAX_SHAPES 16
static shape_def shapes[MAX_SHAPES] = {
    {"dsv3", 8192, 7168, 2048, 256, 8, 2048},
    {"mid", 16384, 4096, 1536, 64, 8, 0},
    {"qwen3_4k", 4096, 2048, 768, 128, 8, 0},
    {"qwen3_32k", 32768, 2048, 768, 128, 8, 0},
    {"mok", 2048, 7168, 3072, 384, 6, 3072},
};
static size_t nshapes = 5;

/* --shape NAME=T,H,I,E,K,I_s: one more shape, run when --shapes names it
 * (the torch baseline knows only DESIGN §6's); 0 or a message */
static const char *shape_add(const char *arg)
{
  shape_def d;
  const char *eq = strchr(arg, '=');
  size_t n = eq != NULL ? (size_t)(eq - arg) : 0;
  long long v[6];
  int used = 0;

  if (nshapes == MAX_SHAPES)
    return "too many shapes";
  if (n == 0 || n >= sizeof d.name || strspn(arg, "abcdefghijklmnopqrstuvwxyz0123456789_") != n)
    return "NAME (1-31 of a-z, 0-9 and _) must come before '='";
  memset(&d, 0, sizeof d);
  memcpy(d.name, arg, n);
  for (size_t i = 0; i < nshapes; i++)
    if (strcmp(shapes[i].name, d.name) == 0)
      return "a shape of that name exists";
  if (sscanf(eq + 1, "%lld,%lld,%lld,%lld,%lld,%lld%n", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
             &used) != 6 || eq[1 + used] != '\0' || v[0] < 1 || v[1] < 1 || v[2] < 1 ||
      v[3] < 1 || v[4] < 1 || v[4] > v[3] || v[5] < 0)
    return "want T,H,I,E,K,I_s: positive, K <= E, I_s >= 0";
  d.T = v[0], d.H = v[1], d.I = v[2], d.E = v[3], d.K = v[4], d.Is = v[5];
  shapes[nshapes++] = d;
  return NULL;
}

#define CUDA_OK(call)                                                           \
  do {                                                                          \
    cudaError_t e_ = (call);                                                    \
    if (e_ != cudaSuccess) {                                                    \
      fprintf(stderr, "bench_gpu: %s: %s\n", #call, cudaGetErrorString(e_));    \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

static uint64_t rng(uint64_t *s)
{
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 33;
}

static void *dmalloc(size_t n)
{
  void *p;
  CUDA_OK(cudaMalloc(&p, n));
  return p;
}

static void *xmalloc(size_t n)
{
  void *p = calloc(1, n ? n : 1);
  if (p == NULL) {
    fprintf(stderr, "bench_gpu: out of host memory (%zu bytes)\n", n);
    exit(1);
  }
  return p;
}

static int cmp_float(const void *a, const void *b)
{
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

typedef struct problem {
  mokk_shape s;
  int64_t T;
  int32_t *ids;   /* host copies */
  float *tw;
  mokk_fwd_rank fr; /* device */
  mokk_bwd_rank br;
  double bytes;     /* device memory of the tensors above */
} problem;

/* --tuning: the layer's kernel options, in process and through the daemon */
static mok_layer_tuning tuning;

/* Shape and routing (on the host): K distinct experts per token. */
static void problem_route(problem *p, const shape_def *d)
{
  uint64_t seed = 12345;
  int64_t T = d->T, K = d->K, E = d->E;
  int *perm = xmalloc(E * sizeof *perm);

  memset(p, 0, sizeof *p);
  p->s = (mokk_shape){.H = d->H, .I = d->I, .E = E, .K = K, .I_s = d->Is, .P = 1};
  p->s.tune = (mokk_tuning){.tiles = tuning.tiles, .wgrad_tiles = tuning.wgrad_tiles,
                            .clusters = tuning.clusters, .order = tuning.order,
                            .tails = tuning.tails, .dx = tuning.dx,
                            .dispatch_blocks = tuning.dispatch_blocks};
  p->T = T;
  p->ids = xmalloc(T * K * 4);
  p->tw = xmalloc(T * K * 4);
  for (int64_t e = 0; e < E; e++)
    perm[e] = (int)e;
  for (int64_t t = 0; t < T; t++) { /* partial shuffle */
    float sum = 0;
    for (int64_t k = 0; k < K; k++) {
      int64_t j = k + (int64_t)(rng(&seed) % (uint64_t)(E - k));
      int tmp = perm[k];
      perm[k] = perm[j], perm[j] = tmp;
      p->ids[t * K + k] = perm[k];
      p->tw[t * K + k] = 0.1f + (float)(rng(&seed) % 1000) / 1000.0f;
      sum += p->tw[t * K + k];
    }
    for (int64_t k = 0; k < K; k++)
      p->tw[t * K + k] /= sum;
  }
  free(perm);
}

/* Fills the inputs at the device pointers already set in p. */
static void problem_fill(problem *p)
{
  int64_t T = p->T, H = p->s.H, K = p->s.K;
  bench_fill_bf16((void *)p->fr.x, T * H, 1, 2.0f);
  CUDA_OK(cudaMemcpy((void *)p->fr.topk_ids, p->ids, T * K * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy((void *)p->fr.topk_weights, p->tw, T * K * 4, cudaMemcpyHostToDevice));
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = mokk_weight_elems(&p->s, w);
    /* about 1/sqrt(fan-in), so activations stay O(1) */
    float scale = (w == MOKK_W_DOWN || w == MOKK_S_DOWN) ? 2.0f / 45 : 2.0f / 85;
    if (n > 0)
      bench_fill_bf16((void *)p->fr.w[w], n, 100 + w, scale);
  }
  if (p->br.d_out != NULL)
    bench_fill_bf16((void *)p->br.d_out, T * H, 7, 0.02f);
  CUDA_OK(cudaDeviceSynchronize());
}

/* --fp32-accum: the in-process backward adds the weight gradients into fp32
 * buffers (Megatron's gradient accumulation fusion) instead of writing bf16 */
static int fp32_accum;

/* Each step's backward is its forward's last (MOKK_BWD_LAST, as autograd's
 * without retain_graph, which the torch baseline runs), unless --retain. */
static int retain;

/* How steps are timed. By default each timed step is a forward and its
 * backward, as in training: a forward starts behind the last step's
 * backward. --loops times them as torch_moe.py does by default: the
 * forwards in a loop of their own (each forward's state freed unused), then
 * the backwards, each behind an untimed forward. torch_moe.py --steps times
 * the baseline the default way. */
static int loops;
enum { PH_STEP, PH_FWD, PH_BWD };

/* Device memory of a shape's tensors: x, out, d_out, d_x; ids, weights,
 * d_topk_weights; weights (bf16) and gradients (bf16, or fp32 with
 * --fp32-accum). The step's own memory comes on top. fwd_only: x, out,
 * ids, router weights and the layer's weights alone. */
static double problem_bytes(const shape_def *d, int fwd_only)
{
  mokk_shape s = {.H = d->H, .I = d->I, .E = d->E, .K = d->K, .I_s = d->Is, .P = 1};
  double bytes = (fwd_only ? 2.0 : 4.0) * d->T * d->H * 2 +
                 (fwd_only ? 2.0 : 3.0) * d->T * d->K * 4;
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    bytes += (fwd_only ? 2.0 : 2.0 + (fp32_accum ? 4.0 : 2.0)) * mokk_weight_elems(&s, w);
  return bytes;
}

/* The tensors of a shape; with fwd_only those of its forward alone (no
 * gradient, d_out or d_x buffers: the backward cannot run). */
static void problem_make(problem *p, const shape_def *d, int fwd_only)
{
  int64_t T = d->T, K = d->K;

  problem_route(p, d);
  p->bytes = problem_bytes(d, fwd_only);
  p->fr.x = dmalloc(T * d->H * 2);
  p->fr.topk_ids = dmalloc(T * K * 4);
  p->fr.topk_weights = dmalloc(T * K * 4);
  p->fr.out = dmalloc(T * d->H * 2);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = mokk_weight_elems(&p->s, w);
    if (n == 0)
      continue;
    p->fr.w[w] = dmalloc(n * 2);
    if (fwd_only)
      continue;
    if (fp32_accum) {
      p->br.g_f32[w] = dmalloc(n * 4);
      CUDA_OK(cudaMemset(p->br.g_f32[w], 0, n * 4));
    } else {
      p->br.g_bf16[w] = dmalloc(n * 2);
    }
  }
  if (!fwd_only) {
    p->br.d_out = dmalloc(T * d->H * 2);
    p->br.d_x = dmalloc(T * d->H * 2);
    p->br.d_topk_weights = dmalloc(T * K * 4);
  }
  problem_fill(p);
}

static void problem_free(problem *p)
{
  cudaFree((void *)p->fr.x), cudaFree((void *)p->fr.topk_ids);
  cudaFree((void *)p->fr.topk_weights), cudaFree(p->fr.out);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    cudaFree((void *)p->fr.w[w]), cudaFree(p->br.g_bf16[w]), cudaFree(p->br.g_f32[w]);
  cudaFree((void *)p->br.d_out), cudaFree(p->br.d_x), cudaFree(p->br.d_topk_weights);
  free(p->ids), free(p->tw);
}

/* max |a - b| / (tol |a| + tol rms(a)); the tolerances of tests/gpu/check_gpu.c:
 * 2^-7 for out and d_topk_weights, 2^-5 for d_x and weight gradients */
static double ratio_bf16(const uint16_t *ref, const uint16_t *got, int64_t n, double tol)
{
  double ss = 0, worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double v = mokk_bf16_to_f32(ref[i]);
    ss += v * v;
  }
  double rms = n ? sqrt(ss / (double)n) : 0;
  for (int64_t i = 0; i < n; i++) {
    double a = mokk_bf16_to_f32(ref[i]), b = mokk_bf16_to_f32(got[i]);
    double r = fabs(a - b) / (tol * fabs(a) + tol * rms + 1e-30);
    if (r > worst)
      worst = r;
  }
  return worst;
}

static double ratio_f32(const float *ref, const float *got, int64_t n, double tol)
{
  uint16_t *a = xmalloc(n * 2), *b = xmalloc(n * 2);
  for (int64_t i = 0; i < n; i++)
    a[i] = mokk_f32_to_bf16(ref[i]), b[i] = mokk_f32_to_bf16(got[i]);
  double r = ratio_bf16(a, b, n, tol); /* fp32 compared at bf16 resolution */
  free(a), free(b);
  return r;
}

static void d2h(void *h, const void *d, size_t n)
{
  CUDA_OK(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost));
}

/* Forward and backward (bf16 gradients) on the CPU engine; 1 on failure. */
static int cpu_step(mokk_backend *cpu, const mokk_shape *s, int64_t T, const mokk_fwd_rank *fr,
                    const mokk_bwd_rank *br)
{
  char err[MOK_ERRLEN];
  mokk_ctx *ctx = NULL;
  if (mokk_forward(cpu, s, T, fr, &ctx, err) || mokk_backward(cpu, ctx, MOKK_GRAD_BF16, br, err)) {
    fprintf(stderr, "verify: cpu engine: %s\n", err);
    mokk_ctx_free(cpu, ctx);
    return 1;
  }
  mokk_ctx_free(cpu, ctx);
  return 0;
}

/* The CPU engine on a small problem built from rows of the big one. */
static int verify(problem *p, mokk_backend *cpu)
{
  const mokk_shape *s = &p->s;
  int64_t H = s->H, I = s->I, K = s->K, T = p->T, nt = 8;
  int bad = 0;

  /* (a) nt tokens with the experts they use, renumbered */
  {
    int *map = xmalloc(s->E * sizeof *map), *used = xmalloc(nt * K * sizeof *used);
    int64_t Eu = 0;
    for (int64_t e = 0; e < s->E; e++)
      map[e] = -1;
    mokk_shape ss = *s;
    int32_t *ids = xmalloc(nt * K * 4);
    float *tw = xmalloc(nt * K * 4);
    uint16_t *x = xmalloc(nt * H * 2), *dout = xmalloc(nt * H * 2);
    uint16_t *out_g = xmalloc(nt * H * 2), *dx_g = xmalloc(nt * H * 2);
    float *dtw_g = xmalloc(nt * K * 4);
    for (int64_t j = 0; j < nt; j++) {
      int64_t t = j * (T / nt) + j; /* spread over the batch */
      d2h(x + j * H, p->fr.x + t * H, H * 2);
      d2h(dout + j * H, p->br.d_out + t * H, H * 2);
      d2h(out_g + j * H, p->fr.out + t * H, H * 2);
      d2h(dx_g + j * H, p->br.d_x + t * H, H * 2);
      d2h(dtw_g + j * K, p->br.d_topk_weights + t * K, K * 4);
      for (int64_t k = 0; k < K; k++) {
        int e = p->ids[t * K + k];
        if (map[e] < 0)
          used[Eu] = e, map[e] = (int)Eu++;
        ids[j * K + k] = map[e];
        tw[j * K + k] = p->tw[t * K + k];
      }
    }
    ss.E = Eu;
    mokk_fwd_rank fr = {.x = x, .topk_ids = ids, .topk_weights = tw};
    mokk_bwd_rank br = {.d_out = dout};
    fr.out = xmalloc(nt * H * 2);
    br.d_x = xmalloc(nt * H * 2);
    br.d_topk_weights = xmalloc(nt * K * 4);
    for (int w = 0; w < MOKK_NWEIGHTS; w++) {
      int64_t n = mokk_weight_elems(&ss, w);
      if (n == 0)
        continue;
      uint16_t *hw = xmalloc(n * 2);
      if (w < MOKK_S_GATE) {
        int64_t per = n / Eu;
        for (int64_t e = 0; e < Eu; e++)
          d2h(hw + e * per, p->fr.w[w] + used[e] * per, per * 2);
      } else {
        d2h(hw, p->fr.w[w], n * 2);
      }
      fr.w[w] = hw;
      br.g_bf16[w] = xmalloc(n * 2);
    }
    if (cpu_step(cpu, &ss, nt, &fr, &br))
      return 1;
    double r_out = ratio_bf16(fr.out, out_g, nt * H, 1.0 / 128);
    double r_dx = ratio_bf16(br.d_x, dx_g, nt * H, 1.0 / 32);
    double r_dtw = ratio_f32(br.d_topk_weights, dtw_g, nt * K, 1.0 / 128);
    printf("verify dsv3: %lld sampled tokens (%lld experts): out %.3f  d_x %.3f  "
           "d_topk_weights %.3f  (error / tolerance, <= 1 passes)\n",
           (long long)nt, (long long)Eu, r_out, r_dx, r_dtw);
    bad |= r_out > 1 || r_dx > 1 || r_dtw > 1;
    for (int w = 0; w < MOKK_NWEIGHTS; w++)
      free((void *)fr.w[w]), free(br.g_bf16[w]);
    free(map), free(used), free(ids), free(tw), free(x), free(dout), free(out_g), free(dx_g);
    free(dtw_g), free(fr.out), free(br.d_x), free(br.d_topk_weights);
  }
  /* (b) the rows of one expert, each routed to it alone */
  {
    int e0 = p->ids[0];
    int64_t n = 0;
    for (int64_t q = 0; q < T * K; q++)
      n += p->ids[q] == e0;
    mokk_shape ss = {.H = H, .I = I, .E = 1, .K = 1, .I_s = 0, .P = 1,
                     .swiglu_limit = s->swiglu_limit};
    int32_t *ids = xmalloc(n * 4);
    float *tw = xmalloc(n * 4);
    uint16_t *x = xmalloc(n * H * 2), *dout = xmalloc(n * H * 2);
    int64_t j = 0;
    for (int64_t q = 0; q < T * K; q++)
      if (p->ids[q] == e0) {
        int64_t t = q / K;
        d2h(x + j * H, p->fr.x + t * H, H * 2);
        d2h(dout + j * H, p->br.d_out + t * H, H * 2);
        ids[j] = 0;
        tw[j] = p->tw[q];
        j++;
      }
    mokk_fwd_rank fr = {.x = x, .topk_ids = ids, .topk_weights = tw};
    mokk_bwd_rank br = {.d_out = dout};
    fr.out = xmalloc(n * H * 2);
    br.d_x = xmalloc(n * H * 2);
    br.d_topk_weights = xmalloc(n * 4);
    double r[3];
    for (int w = 0; w < 3; w++) {
      int64_t m = I * H;
      uint16_t *hw = xmalloc(m * 2);
      d2h(hw, p->fr.w[w] + e0 * m, m * 2);
      fr.w[w] = hw;
      br.g_bf16[w] = xmalloc(m * 2);
    }
    if (cpu_step(cpu, &ss, n, &fr, &br))
      return 1;
    for (int w = 0; w < 3; w++) {
      int64_t m = I * H;
      uint16_t *g = xmalloc(m * 2);
      d2h(g, p->br.g_bf16[w] + e0 * m, m * 2);
      r[w] = ratio_bf16(br.g_bf16[w], g, m, 1.0 / 32);
      bad |= r[w] > 1;
      free(g), free((void *)fr.w[w]), free(br.g_bf16[w]);
    }
    printf("verify dsv3: expert %d (%lld rows): d_w_gate %.3f  d_w_up %.3f  d_w_down %.3f\n",
           e0, (long long)n, r[0], r[1], r[2]);
    free(ids), free(tw), free(x), free(dout), free(fr.out), free(br.d_x);
    free(br.d_topk_weights);
  }
  return bad;
}

static double now_ms(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static mok_tensor place(uint64_t arena, size_t *at, mok_dtype dt, int ndim, int64_t a,
                        int64_t b, int64_t c)
{
  int64_t shape[3] = {a, b, c};
  mok_tensor t = mok_tensor_make(arena, *at, dt, ndim, shape);
  *at += (mok_tensor_bytes(&t) + 255) / 256 * 256;
  return t;
}

#define MOK_OK(c, call)                                                         \
  do {                                                                          \
    if ((call) != 0) {                                                          \
      fprintf(stderr, "bench_gpu: %s: %s\n", #call, mok_last_error(c));         \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

/* BENCH_GPU_MEM=1: free device memory at each stage of the daemon runs. */
static void mem_note(const char *what)
{
  size_t avail = 0, total = 0;
  if (getenv("BENCH_GPU_MEM") == NULL)
    return;
  cudaMemGetInfo(&avail, &total);
  fprintf(stderr, "bench_gpu: memory %s: %.3f of %.3f GB free\n", what, avail / 1e9,
          total / 1e9);
}

/* The shape through mokd: medians of the request round trips (without a
 * stream libmok returns once the step's done event has fired), then the
 * sample check on its outputs. */
static int run_daemon(const char *sock, const shape_def *d, int iters, int do_verify,
                      mokk_backend *cpu, double *fwd, double *bwd)
{
  int64_t T = d->T, H = d->H, K = d->K, E = d->E, I = d->I, Is = d->Is;
  mok_tensor x, ids, tw, dout, w[MOK_NWEIGHTS];
  mok_arena_info ar = {0};
  mok_client *c = NULL;
  mok_forward_result fr;
  mok_backward_result br;
  uint64_t layer;
  problem p;
  float *fms = xmalloc(iters * 4), *bms = xmalloc(iters * 4);
  float *fq = xmalloc(iters * 4), *fc = xmalloc(iters * 4);
  float *bq = xmalloc(iters * 4), *bc = xmalloc(iters * 4);
  int bad = 0;

  if (mok_connect(sock, "bench_gpu", &c) != 0) {
    fprintf(stderr, "bench_gpu: cannot reach mokd at %s: %s\n", sock, mok_last_error(c));
    exit(1);
  }
  if (strcmp(mok_server_info(c)->backend, "cuda") != 0) {
    fprintf(stderr, "bench_gpu: mokd at %s runs the %s backend, not cuda\n", sock,
            mok_server_info(c)->backend);
    exit(1);
  }
  mem_note("before the daemon run");
  problem_route(&p, d);
  for (int pass = 0; pass < 2; pass++) {
    size_t at = 0;
    x = place(ar.id, &at, MOK_DTYPE_BF16, 2, T, H, 0);
    dout = place(ar.id, &at, MOK_DTYPE_BF16, 2, T, H, 0);
    ids = place(ar.id, &at, MOK_DTYPE_I32, 2, T, K, 0);
    tw = place(ar.id, &at, MOK_DTYPE_F32, 2, T, K, 0);
    w[MOK_W_GATE] = place(ar.id, &at, MOK_DTYPE_BF16, 3, E, I, H);
    w[MOK_W_UP] = place(ar.id, &at, MOK_DTYPE_BF16, 3, E, I, H);
    w[MOK_W_DOWN] = place(ar.id, &at, MOK_DTYPE_BF16, 3, E, H, I);
    w[MOK_S_GATE] = place(ar.id, &at, MOK_DTYPE_BF16, 2, Is, H, 0);
    w[MOK_S_UP] = place(ar.id, &at, MOK_DTYPE_BF16, 2, Is, H, 0);
    w[MOK_S_DOWN] = place(ar.id, &at, MOK_DTYPE_BF16, 2, H, Is, 0);
    if (Is == 0) /* no shared expert: no shared weights either */
      memset(&w[MOK_S_GATE], 0, 3 * sizeof w[0]);
    if (pass == 0)
      MOK_OK(c, mok_arena_create(c, at, &ar));
  }
  p.fr.x = mok_tensor_ptr(c, &x);
  p.fr.topk_ids = mok_tensor_ptr(c, &ids);
  p.fr.topk_weights = mok_tensor_ptr(c, &tw);
  p.br.d_out = mok_tensor_ptr(c, &dout);
  for (int i = 0; i < (Is ? MOK_NWEIGHTS : MOK_S_GATE); i++)
    p.fr.w[i] = mok_tensor_ptr(c, &w[i]);
  mem_note("with the input arena");
  problem_fill(&p); /* the arena is mapped here: fill it in place */
  mem_note("after filling it");

  mok_layer_desc ld = {.hidden = H, .intermediate = I, .experts = E, .top_k = K,
                       .shared_intermediate = Is, .grad_mode = MOK_GRAD_BF16};
  MOK_OK(c, mok_layer_create_tuned(c, &ld, &tuning, &layer));
  MOK_OK(c, mok_layer_set_weights(c, layer, w));
  for (int ph = loops ? PH_FWD : PH_STEP; ph <= (loops ? PH_BWD : PH_STEP); ph++)
    for (int it = -2; it < iters; it++) {
      double t0 = now_ms(), t1, t2;
      MOK_OK(c, mok_forward(c, layer, &x, &ids, &tw, 0, &fr));
      t1 = now_ms();
      if (it == -2 && ph != PH_BWD)
        mem_note("after the first forward");
      if (it >= 0 && ph != PH_BWD) {
        fms[it] = (float)(t1 - t0);
        fq[it] = fr.timing.queued_ns / 1e6f, fc[it] = fr.timing.compute_ns / 1e6f;
      }
      if (ph == PH_FWD) { /* --loops: forwards alone */
        MOK_OK(c, mok_release(c, &fr.context, 1));
        continue;
      }
      MOK_OK(c, mok_backward_flags(c, fr.context, &dout, NULL, 0, NULL,
                                   retain ? 0 : MOK_BACKWARD_LAST, &br));
      t2 = now_ms();
      if (it >= 0) {
        bms[it] = (float)(t2 - t1);
        bq[it] = br.timing.queued_ns / 1e6f, bc[it] = br.timing.compute_ns / 1e6f;
      }
      if (it + 1 < iters) { /* the last step's outputs stay for the check */
        uint64_t rel[2] = {fr.context, br.result};
        MOK_OK(c, mok_release(c, rel, 2));
      }
    }
  qsort(fms, iters, 4, cmp_float);
  qsort(bms, iters, 4, cmp_float);
  *fwd = fms[iters / 2], *bwd = bms[iters / 2];
  qsort(fq, iters, 4, cmp_float);
  qsort(fc, iters, 4, cmp_float);
  qsort(bq, iters, 4, cmp_float);
  qsort(bc, iters, 4, cmp_float);
  /* the daemon's side of a round trip: queued before an executor took the
   * step, and the executor's time to enqueue it (the device runs after) */
  printf("mokd-daemon %s host ms (median): fwd queued %.3f enqueue %.3f, bwd queued %.3f "
         "enqueue %.3f\n", d->name, fq[iters / 2], fc[iters / 2], bq[iters / 2], bc[iters / 2]);
  free(fq), free(fc), free(bq), free(bc);
  double flop = 6.0 * (double)T * H * ((double)K * I + Is);
  printf("mokd-daemon %s fwd_ms=%.3f fwd_tflops=%.1f bwd_ms=%.3f bwd_tflops=%.1f "
         "(request round trips through %s)\n", d->name, *fwd, flop / *fwd / 1e9, *bwd,
         2 * flop / *bwd / 1e9, sock);
  fflush(stdout);
  if (do_verify) {
    p.fr.out = fr.out_ptr;
    p.br.d_x = br.d_x_ptr;
    p.br.d_topk_weights = br.d_topk_weights_ptr;
    for (int i = 0; i < br.ngrads; i++)
      p.br.g_bf16[i] = br.grad_ptrs[i];
    printf("verify (through mokd):\n");
    bad = verify(&p, cpu);
  }
  mok_close(c);
  free(p.ids), free(p.tw), free(fms), free(bms);
  return bad;
}

static int torch_baseline(const char *cmd, const char *name, int iters, int fwd_only,
                          double *fwd, double *bwd, double *peak_gb)
{
  char line[1024], buf[1200];
  FILE *f;
  int found = 0;

  if (snprintf(buf, sizeof buf, "%s --shapes %.31s --iters %d%s", cmd, name, iters,
               fwd_only ? " --fwd-only" : "") >= (int)sizeof buf)
    return 0; /* a command that long is not run cut short */
  if ((f = popen(buf, "r")) == NULL)
    return 0;
  while (fgets(line, sizeof line, f) != NULL) {
    char *a = strstr(line, "fwd_ms="), *b = strstr(line, "bwd_ms=");
    char *m = strstr(line, "peak_gb=");
    fputs(line, stdout);
    if (strncmp(line, "torch ", 6) == 0 && a && b) {
      *fwd = atof(a + 7), *bwd = atof(b + 7);
      *peak_gb = m != NULL ? atof(m + 8) : 0;
      found = 1;
    }
  }
  pclose(f);
  return found;
}

/* TFLOP/s of torch.matmul on 8192^3 bf16, from CMD (torch_matmul.py); 0 if none */
static double dense_ceiling(const char *cmd, int iters)
{
  char buf[1024], line[512];
  double tf = 0;
  FILE *f;

  snprintf(buf, sizeof buf, "%s --iters %d 8192,8192,8192", cmd, iters);
  if ((f = popen(buf, "r")) == NULL)
    return 0;
  while (fgets(line, sizeof line, f) != NULL) {
    char *t = strstr(line, "tflops=");
    fputs(line, stdout);
    if (t != NULL)
      tf = atof(t + 7);
  }
  pclose(f);
  return tf;
}

typedef struct result {
  const shape_def *d;
  double f, b, peak;          /* in-process medians (ms), peak GB */
  double df, db;              /* through mokd, 0 when not run */
  double tf, tb, tpeak;       /* torch, 0 when not run */
} result;

static double flops_fwd(const shape_def *d)
{
  return 6.0 * (double)d->T * d->H * ((double)d->K * d->I + d->Is);
}

/* The table the issue asks for, and the same figures as CSV. */
static void report(const result *r, int n, double ceil_tf, const char *csv)
{
  FILE *f = csv != NULL ? fopen(csv, "w") : NULL;

  if (csv != NULL && f == NULL)
    fprintf(stderr, "bench_gpu: cannot write %s\n", csv);
  if (ceil_tf > 0)
    printf("\ndense ceiling (torch.matmul 8192^3 bf16, same run): %.1f TFLOP/s\n", ceil_tf);
  else
    printf("\ndense ceiling: not measured (--ceiling CMD), so no %% of it below\n");
  printf("%-10s %-24s %-24s %-17s %-17s %-15s %-13s\n", "shape", "mokd fwd ms (TF/s, %ceil)",
         "mokd bwd ms (TF/s, %ceil)", "via mokd fwd/bwd", "torch fwd/bwd", "ratio fwd/bwd",
         "peak GB m/t");
  if (f != NULL)
    fprintf(f, "shape,T,H,I,E,K,shared,fwd_ms,bwd_ms,fwd_tflops,bwd_tflops,fwd_pct_ceiling,"
               "bwd_pct_ceiling,daemon_fwd_ms,daemon_bwd_ms,torch_fwd_ms,torch_bwd_ms,"
               "ratio_fwd,ratio_bwd,peak_gb,torch_peak_gb,ceiling_tflops\n");
  for (int i = 0; i < n; i++) {
    const shape_def *d = r[i].d;
    /* a shape timed forward only has no backward figures: 0 in the CSV */
    double ff = flops_fwd(d) / r[i].f / 1e9;
    double fb = r[i].b > 0 ? 2 * flops_fwd(d) / r[i].b / 1e9 : 0;
    double pf = ceil_tf > 0 ? 100 * ff / ceil_tf : 0, pb = ceil_tf > 0 ? 100 * fb / ceil_tf : 0;
    double rf = r[i].tf > 0 ? r[i].tf / r[i].f : 0, rb = r[i].tb > 0 ? r[i].tb / r[i].b : 0;
    char c1[32], c2[32], c3[32], c4[32], c5[32], c6[32];
    if (ceil_tf > 0) {
      snprintf(c1, sizeof c1, "%.3f (%.0f, %.0f%%)", r[i].f, ff, pf);
      snprintf(c2, sizeof c2, "%.3f (%.0f, %.0f%%)", r[i].b, fb, pb);
    } else {
      snprintf(c1, sizeof c1, "%.3f (%.0f, -)", r[i].f, ff);
      snprintf(c2, sizeof c2, "%.3f (%.0f, -)", r[i].b, fb);
    }
    snprintf(c3, sizeof c3, "%.3f/%.3f", r[i].df, r[i].db);
    snprintf(c4, sizeof c4, "%.3f/%.3f", r[i].tf, r[i].tb);
    snprintf(c5, sizeof c5, "%.3fx/%.3fx", rf, rb);
    if (r[i].b <= 0) { /* forward only */
      snprintf(c2, sizeof c2, "-");
      snprintf(c4, sizeof c4, "%.3f/-", r[i].tf);
      snprintf(c5, sizeof c5, "%.3fx/-", rf);
    }
    if (r[i].tpeak > 0)
      snprintf(c6, sizeof c6, "%.1f/%.1f", r[i].peak, r[i].tpeak);
    else
      snprintf(c6, sizeof c6, "%.1f/-", r[i].peak);
    printf("%-10s %-24s %-24s %-17s %-17s %-15s %-13s\n", d->name, c1, c2,
           r[i].df > 0 ? c3 : "-", r[i].tf > 0 ? c4 : "-", r[i].tf > 0 ? c5 : "-", c6);
    if (f != NULL)
      fprintf(f, "%s,%lld,%lld,%lld,%lld,%lld,%d,%.4f,%.4f,%.1f,%.1f,%.1f,%.1f,%.4f,%.4f,%.4f,"
                 "%.4f,%.4f,%.4f,%.3f,%.3f,%.1f\n",
              d->name, (long long)d->T, (long long)d->H, (long long)d->I, (long long)d->E,
              (long long)d->K, d->Is > 0, r[i].f, r[i].b, ff, fb, pf, pb, r[i].df, r[i].db,
              r[i].tf, r[i].tb, rf, rb, r[i].peak, r[i].tpeak, ceil_tf);
  }
  if (f != NULL)
    fclose(f);
}

/* One more forward and backward, each traced from an idle GPU, as a timed
 * step's forward starts. A step before them is recorded and dropped: right
 * after recording starts, the gap after the first kernel took 1.8 ms (mid's
 * forward, H100). The traced stretches still show a gap of 0.1-0.3 ms after
 * their first kernel that the timed steps do not pay (a traced forward's
 * span exceeds the timed one by about as much): the profiler's, not the
 * step's. */
static int trace_step(mokk_backend *gpu, problem *p, const char *name)
{
  char err[MOK_ERRLEN], label[64];
  mokk_grad_mode mode = fp32_accum ? MOKK_GRAD_FP32_ACCUM : MOKK_GRAD_BF16;
  mokk_ctx *ctx = NULL;
  int rc = 1;

  CUDA_OK(cudaDeviceSynchronize());
  if (trace_begin(err, sizeof err))
    goto out;
  for (int pass = 0; pass < 2; pass++) {
    if (mokk_forward(gpu, &p->s, p->T, &p->fr, &ctx, err) || mokk_cuda_sync(gpu, err))
      goto out;
    snprintf(label, sizeof label, "%.31s fwd", name);
    trace_cut(stdout, pass ? label : NULL);
    if (mokk_backward_flags(gpu, ctx, mode, retain ? 0 : MOKK_BWD_LAST, &p->br, err) ||
        mokk_cuda_sync(gpu, err))
      goto out;
    snprintf(label, sizeof label, "%.31s bwd", name);
    trace_cut(stdout, pass ? label : NULL);
    mokk_ctx_free(gpu, ctx);
    ctx = NULL;
  }
  rc = 0;
out:
  if (rc)
    fprintf(stderr, "bench_gpu: %s: traced step: %s\n", name, err);
  if (ctx != NULL)
    mokk_ctx_free(gpu, ctx);
  trace_stop();
  return rc;
}

int main(int argc, char **argv)
{
  const char *want = "dsv3,mid,qwen3_4k,qwen3_32k,mok", *torch = NULL, *sock = NULL;
  const char *csv = NULL, *ceil_cmd = NULL;
  int iters = 20, do_verify = 0, bad = 0, nres = 0, trace = 0;
  char err[MOK_ERRLEN];
  mokk_backend *gpu = NULL, *cpu = NULL;
  result res[MAX_SHAPES];
  double ceil_tf = 0;

  setvbuf(stdout, NULL, _IOLBF, 0); /* lines reach a log even if a run dies */
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--shapes") && i + 1 < argc)
      want = argv[++i];
    else if (!strcmp(argv[i], "--iters") && i + 1 < argc)
      iters = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--torch") && i + 1 < argc)
      torch = argv[++i];
    else if (!strcmp(argv[i], "--ceiling") && i + 1 < argc)
      ceil_cmd = argv[++i];
    else if (!strcmp(argv[i], "--csv") && i + 1 < argc)
      csv = argv[++i];
    else if (!strcmp(argv[i], "--verify"))
      do_verify = 1;
    else if (!strcmp(argv[i], "--fp32-accum"))
      fp32_accum = 1;
    else if (!strcmp(argv[i], "--trace"))
      trace = 1;
    else if (!strcmp(argv[i], "--retain"))
      retain = 1;
    else if (!strcmp(argv[i], "--loops"))
      loops = 1;
    else if (!strcmp(argv[i], "--daemon") && i + 1 < argc)
      sock = argv[++i];
    else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
      const char *why = shape_add(argv[++i]);
      if (why != NULL) {
        fprintf(stderr, "bench_gpu: --shape %s: %s\n", argv[i], why);
        return 2;
      }
    } else if (!strcmp(argv[i], "--tuning") && i + 1 < argc) {
      if (mok_layer_tuning_parse(&tuning, argv[++i], err)) {
        fprintf(stderr, "bench_gpu: --tuning: %s\n", err);
        return 2;
      }
    } else {
      fprintf(stderr, "usage: bench_gpu [--shapes a,b] [--iters n] [--torch CMD] [--verify]\n"
                      "                 [--daemon SOCK] [--ceiling CMD] [--csv FILE] [--fp32-accum]\n"
                      "                 [--trace] [--retain] [--loops] [--tuning S]\n"
                      "                 [--shape NAME=T,H,I,E,K,I_s]\n"
                      "  shapes: dsv3 mid qwen3_4k qwen3_32k mok (DESIGN §6), and --shape's\n"
                      "  --shape NAME=T,H,I,E,K,I_s  one more shape for --shapes to name (no\n"
                      "               torch baseline); repeatable\n"
                      "  a shape whose step's tensors do not fit the GPU (mok on 80 GB) is\n"
                      "  timed forward only, the baseline too ('CMD ... --fwd-only'), and not\n"
                      "  through the daemon\n"
                      "  --iters N    timed iterations after 2 warm-ups; medians (default 20)\n"
                      "  --torch CMD  run 'CMD --shapes NAME --iters N' for the baseline\n"
                      "  --verify     check dsv3 against the CPU engine on samples\n"
                      "  --daemon SOCK  also run each shape through mokd (cuda) at SOCK\n"
                      "  --ceiling CMD  run 'CMD --iters N 8192,8192,8192' (torch_matmul.py)\n"
                      "               for the dense ceiling in the same run\n"
                      "  --csv FILE   write the summary table as CSV\n"
                      "  --fp32-accum the in-process backward adds its weight gradients into\n"
                      "               fp32 buffers (the daemon path and torch stay bf16)\n"
                      "  --trace      after the timed steps, one more forward and backward\n"
                      "               with every kernel's start, duration and the idle time\n"
                      "               before it (CUPTI; lines 'trace SHAPE fwd|bwd:')\n"
                      "  --retain     backwards that keep their forward's saved state (by\n"
                      "               default each is its forward's last, as autograd's\n"
                      "               without retain_graph, which the torch baseline runs)\n"
                      "  --tuning S   the layers' kernel options, key=value,... as mokctl bench\n"
                      "               --tuning takes them (default: the backend's)\n"
                      "  --loops      time the forwards in a loop of their own, then the\n"
                      "               backwards (each behind an untimed forward), as\n"
                      "               torch_moe.py does without --steps; by default each\n"
                      "               timed step is a forward and its backward\n");
      return 2;
    }
  }
  if (fp32_accum && do_verify) {
    fprintf(stderr, "bench_gpu: --verify checks bf16 gradients; leave out --fp32-accum\n");
    return 2;
  }
  if (iters < 1) {
    fprintf(stderr, "bench_gpu: --iters wants a positive count\n");
    return 2;
  }
  if (mokk_gpu_count(err) <= 0) {
    printf("bench_gpu: no CUDA device; nothing to measure\n");
    return 0;
  }
  if (mokk_cuda_create(0, &gpu, err) || mokk_cpu_create(0, &cpu, err)) {
    fprintf(stderr, "bench_gpu: %s\n", err);
    return 1;
  }
  if (trace && trace_open(err, sizeof err)) {
    fprintf(stderr, "bench_gpu: --trace: %s\n", err);
    return 1;
  }
  if (ceil_cmd != NULL)
    ceil_tf = dense_ceiling(ceil_cmd, iters);
  cudaStream_t st = (cudaStream_t)mokk_cuda_stream(gpu);
  cudaEvent_t e0, e1, e2;
  cudaMemPool_t pool;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  CUDA_OK(cudaEventCreate(&e2));
  CUDA_OK(cudaDeviceGetDefaultMemPool(&pool, mokk_cuda_device(gpu)));

  for (size_t si = 0; si < nshapes; si++) {
    const shape_def *d = &shapes[si];
    char pat[64];
    snprintf(pat, sizeof pat, ",%.31s,", d->name);
    char list[512];
    snprintf(list, sizeof list, ",%s,", want);
    if (strstr(list, pat) == NULL)
      continue;
    size_t avail = 0, total = 0;
    CUDA_OK(cudaMemGetInfo(&avail, &total));
    /* mok's step (103 GB) on an 80 GB card: its forward alone (51 GB) */
    int fo = problem_bytes(d, 0) > (double)avail;
    if (fo && problem_bytes(d, 1) > (double)avail) {
      printf("skip %s: its forward's tensors take %.1f GB, the GPU has %.1f GB free\n",
             d->name, problem_bytes(d, 1) / 1e9, avail / 1e9);
      fflush(stdout);
      continue;
    }
    if (fo)
      printf("forward only %s: a step's tensors take %.1f GB, the GPU has %.1f GB free; "
             "the forwards alone (%.1f GB) are timed in a loop of their own, here, and "
             "for torch\n", d->name, problem_bytes(d, 0) / 1e9, avail / 1e9,
             problem_bytes(d, 1) / 1e9);
    result *r = &res[nres++];
    memset(r, 0, sizeof *r);
    r->d = d;
    problem p;
    problem_make(&p, d, fo);
    uint64_t zero = 0, high = 0;
    CUDA_OK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    float *fms = xmalloc(iters * 4), *bms = xmalloc(iters * 4);
    float *fhost = xmalloc(iters * 4), *bhost = xmalloc(iters * 4);
    int ph0 = loops || fo ? PH_FWD : PH_STEP, ph1 = fo ? PH_FWD : loops ? PH_BWD : PH_STEP;
    for (int ph = ph0; ph <= ph1; ph++)
      for (int it = -2; it < iters; it++) {
        mokk_ctx *ctx = NULL;
        double h0, h1, h2;
        CUDA_OK(cudaEventRecord(e0, st));
        h0 = now_ms();
        if (mokk_forward(gpu, &p.s, p.T, &p.fr, &ctx, err)) {
          fprintf(stderr, "bench_gpu: %s: forward: %s\n", d->name, err);
          return 1;
        }
        h1 = now_ms();
        CUDA_OK(cudaEventRecord(e1, st));
        if (ph != PH_FWD && mokk_backward_flags(gpu, ctx, fp32_accum ? MOKK_GRAD_FP32_ACCUM
                                                                     : MOKK_GRAD_BF16,
                                                retain ? 0 : MOKK_BWD_LAST, &p.br, err)) {
          fprintf(stderr, "bench_gpu: %s: backward: %s\n", d->name, err);
          return 1;
        }
        h2 = now_ms();
        CUDA_OK(cudaEventRecord(e2, st));
        mokk_ctx_free(gpu, ctx);
        if (mokk_cuda_sync(gpu, err)) {
          fprintf(stderr, "bench_gpu: %s: %s\n", d->name, err);
          return 1;
        }
        if (it >= 0 && ph != PH_BWD) {
          CUDA_OK(cudaEventElapsedTime(&fms[it], e0, e1));
          fhost[it] = (float)(h1 - h0);
        }
        if (it >= 0 && ph != PH_FWD) {
          CUDA_OK(cudaEventElapsedTime(&bms[it], e1, e2));
          bhost[it] = (float)(h2 - h1);
        }
      }
    CUDA_OK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    if (trace && trace_step(gpu, &p, d->name))
      return 1;
    r->peak = (p.bytes + (double)high) / 1e9;
    qsort(fms, iters, 4, cmp_float);
    qsort(fhost, iters, 4, cmp_float);
    double f = fms[iters / 2], b = 0, flop = flops_fwd(d);
    /* the backward's figures, where one was timed */
    char bwd[64] = "bwd_ms=- bwd_tflops=-", bspread[48] = "", bhost_ms[16] = "";
    if (!fo) {
      qsort(bms, iters, 4, cmp_float);
      qsort(bhost, iters, 4, cmp_float);
      b = bms[iters / 2];
      snprintf(bwd, sizeof bwd, "bwd_ms=%.3f bwd_tflops=%.1f", b, 2 * flop / b / 1e9);
      snprintf(bspread, sizeof bspread, ", bwd_ms min %.3f max %.3f", bms[0], bms[iters - 1]);
      snprintf(bhost_ms, sizeof bhost_ms, " bwd %.3f", bhost[iters / 2]);
    }
    r->f = f, r->b = b;
    printf("mokd %s spread: fwd_ms min %.3f max %.3f%s; host ms to enqueue (median) fwd %.3f%s\n",
           d->name, fms[0], fms[iters - 1], bspread, fhost[iters / 2], bhost_ms);
    printf("mokd %s T=%lld H=%lld I=%lld E=%lld K=%lld shared=%d fwd_ms=%.3f fwd_tflops=%.1f "
           "%s peak_gb=%.3f\n",
           d->name, (long long)d->T, (long long)d->H, (long long)d->I, (long long)d->E,
           (long long)d->K, d->Is > 0, f, flop / f / 1e9, bwd, r->peak);
    fflush(stdout);
    if (do_verify && !fo && !strcmp(d->name, "dsv3"))
      bad |= verify(&p, cpu);
    problem_free(&p);
    free(fms), free(bms), free(fhost), free(bhost);
    /* give the step memory cached in this process back before the next run */
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemPoolTrimTo(pool, 0));
    if (sock != NULL && fo)
      printf("mokd-daemon %s: not run (forward only)\n", d->name);
    else if (sock != NULL)
      bad |= run_daemon(sock, d, iters, do_verify && !strcmp(d->name, "dsv3"), cpu, &r->df,
                        &r->db);
    if (torch != NULL) {
      if (torch_baseline(torch, d->name, iters, fo, &r->tf, &r->tb, &r->tpeak)) {
        if (fo)
          printf("ratio %s: fwd %.3fx of torch._grouped_mm (>1 = mokd faster), forward "
                 "only\n", d->name, r->tf / f);
        else
          printf("ratio %s: fwd %.3fx bwd %.3fx of torch._grouped_mm (>1 = mokd faster)\n",
                 d->name, r->tf / f, r->tb / b);
      } else
        printf("ratio %s: no torch baseline\n", d->name);
      fflush(stdout);
    }
  }
  report(res, nres, ceil_tf, csv);
  mokk_backend_destroy(gpu);
  mokk_backend_destroy(cpu);
  return bad;
}
