/* bench_cpu.c - CPU engine throughput on one mid-size layer, next to the same
 * FLOPs through numpy's matmul (OpenBLAS, fp32) measured in the same run.
 * A benchmark: it measures and prints, it asserts nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "bf16.h"

static double now(void)
{
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint16_t *random_bf16(int64_t n, float scale, uint64_t *s)
{
  uint16_t *p = malloc((size_t)n * sizeof *p);
  for (int64_t i = 0; i < n; i++) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = mokk_f32_to_bf16(scale * ((float)(*s >> 40) / (float)(1u << 24) - 0.5f));
  }
  return p;
}

static void usage(void)
{
  fprintf(stderr,
          "usage: bench_cpu [--T n] [--H n] [--I n] [--E n] [--K n] [--shared n]\n"
          "                 [--threads n] [--iters n] [--numpy CMD]\n"
          "  --numpy CMD   run CMD T H I E K I_s iters for the numpy baseline\n");
}

int main(int argc, char **argv)
{
  int64_t T = 1024, H = 1024, I = 512, E = 16, K = 2, Is = 0;
  int threads = 0, iters = 5;
  const char *numpy = NULL;
  char err[MOK_ERRLEN];
  uint64_t seed = 1;

  for (int i = 1; i < argc; i++) {
    int64_t *dst = NULL;
    if (!strcmp(argv[i], "--T")) dst = &T;
    else if (!strcmp(argv[i], "--H")) dst = &H;
    else if (!strcmp(argv[i], "--I")) dst = &I;
    else if (!strcmp(argv[i], "--E")) dst = &E;
    else if (!strcmp(argv[i], "--K")) dst = &K;
    else if (!strcmp(argv[i], "--shared")) dst = &Is;
    else if (!strcmp(argv[i], "--threads") && i + 1 < argc) { threads = atoi(argv[++i]); continue; }
    else if (!strcmp(argv[i], "--iters") && i + 1 < argc) { iters = atoi(argv[++i]); continue; }
    else if (!strcmp(argv[i], "--numpy") && i + 1 < argc) { numpy = argv[++i]; continue; }
    else { usage(); return 2; }
    if (i + 1 >= argc) { usage(); return 2; }
    *dst = atoll(argv[++i]);
  }

  mokk_shape s = {.H = H, .I = I, .E = E, .K = K, .I_s = Is, .P = 1};
  mokk_backend *b;
  if (mokk_cpu_create(threads, &b, err) != 0) {
    fprintf(stderr, "bench_cpu: %s\n", err);
    return 1;
  }
  uint16_t *x = random_bf16(T * H, 2.0f, &seed), *dout = random_bf16(T * H, 2.0f, &seed);
  uint16_t *out = malloc((size_t)(T * H) * 2), *dx = malloc((size_t)(T * H) * 2);
  int32_t *ids = malloc((size_t)(T * K) * 4);
  float *tw = malloc((size_t)(T * K) * 4), *dtw = malloc((size_t)(T * K) * 4);
  mokk_fwd_rank fr = {.x = x, .topk_ids = ids, .topk_weights = tw, .out = out};
  mokk_bwd_rank br = {.d_out = dout, .d_x = dx, .d_topk_weights = dtw};
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k < K; k++) {
      ids[t * K + k] = (int32_t)((t * 7 + k * (E / K + 1)) % E); /* balanced, distinct */
      tw[t * K + k] = 1.0f / (float)K;
    }
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = mokk_weight_elems(&s, w);
    if (n == 0)
      continue;
    fr.w[w] = random_bf16(n, 0.05f, &seed);
    br.g_bf16[w] = malloc((size_t)n * 2);
  }

  double flops_fwd = 6.0 * (double)(T * K + (Is > 0 ? T : 0)) * (double)H *
                     (double)(Is > 0 && Is != I ? I : I);
  if (Is > 0)
    flops_fwd = 6.0 * (double)T * (double)K * (double)H * (double)I +
                6.0 * (double)T * (double)H * (double)Is;
  double tf = 1e30, tb = 1e30;
  for (int it = 0; it < iters + 1; it++) { /* the first run warms up */
    mokk_ctx *ctx;
    double t0 = now();
    if (mokk_forward(b, &s, T, &fr, &ctx, err) != 0) {
      fprintf(stderr, "bench_cpu: forward: %s\n", err);
      return 1;
    }
    double t1 = now();
    if (mokk_backward(b, ctx, MOKK_GRAD_BF16, &br, err) != 0) {
      fprintf(stderr, "bench_cpu: backward: %s\n", err);
      return 1;
    }
    double t2 = now();
    mokk_ctx_free(b, ctx);
    if (it > 0) {
      tf = t1 - t0 < tf ? t1 - t0 : tf;
      tb = t2 - t1 < tb ? t2 - t1 : tb;
    }
  }
  printf("shape T=%lld H=%lld I=%lld E=%lld K=%lld I_s=%lld, %d threads, best of %d\n",
         (long long)T, (long long)H, (long long)I, (long long)E, (long long)K,
         (long long)Is, mokk_cpu_threads(b), iters);
  printf("mokd cpu   forward  %8.2f ms  %7.2f GFLOP/s\n", tf * 1e3, flops_fwd / tf * 1e-9);
  printf("mokd cpu   backward %8.2f ms  %7.2f GFLOP/s\n", tb * 1e3,
         2 * flops_fwd / tb * 1e-9);
  fflush(stdout);
  if (numpy != NULL) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %lld %lld %lld %lld %lld %lld %d", numpy, (long long)T,
             (long long)H, (long long)I, (long long)E, (long long)K, (long long)Is, iters);
    if (system(cmd) != 0) {
      fprintf(stderr, "bench_cpu: numpy baseline failed: %s\n", cmd);
      return 1;
    }
  }
  mokk_backend_destroy(b);
  return 0;
}
