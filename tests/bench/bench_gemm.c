/* bench_gemm.c - the Hopper GEMM core alone, on dense bf16 GEMMs next to
 * torch.matmul in the same run (--torch CMD), after its layout-by-layout
 * check against an fp32 reference. A benchmark: it measures and prints; it
 * fails only when the check or a sampled result is wrong. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/read_pattern.h"
#include "gpu/gemm_core.h"

static const char *VNAME[GEMM_VARIANTS] = {"coop128", "coop256", "pingpong", "tall",  "wide2",
                                            "tall2",   "wide2r",  "wide1r",   "wide1w"};

static const int SHAPES[][3] = {{8192, 4096, 7168}, {8192, 7168, 2048}, {8192, 8192, 8192}};
#define NSHAPES (int)(sizeof SHAPES / sizeof SHAPES[0])

/* ms of torch.matmul per shape, from CMD's lines; 0 where it gave none */
static void torch_times(const char *cmd, int iters, double *ms)
{
  char buf[1024], line[512];
  size_t n = (size_t)snprintf(buf, sizeof buf, "%s --iters %d", cmd, iters);
  FILE *f;

  for (int i = 0; i < NSHAPES; i++) {
    ms[i] = 0;
    n += (size_t)snprintf(buf + n, sizeof buf - n, " %d,%d,%d", SHAPES[i][0], SHAPES[i][1],
                          SHAPES[i][2]);
  }
  if ((f = popen(buf, "r")) == NULL)
    return;
  while (fgets(line, sizeof line, f) != NULL) {
    int M, N, K;
    double t;
    fputs(line, stdout);
    if (sscanf(line, "torch_matmul M=%d N=%d K=%d ms=%lf", &M, &N, &K, &t) == 4)
      for (int i = 0; i < NSHAPES; i++)
        if (SHAPES[i][0] == M && SHAPES[i][1] == N && SHAPES[i][2] == K)
          ms[i] = t;
  }
  pclose(f);
}

/* --reads: dsv3's gate/up weights (256 experts, N 4096, K 7168: 15 GB) read
 * as the GEMMs read them, with nothing computed */
static int read_table(int iters)
{
  static const int RINGS[][2] = {{256, 2}, {256, 3}, {256, 4}, {256, 6}, {128, 4}, {128, 8}};
  const int E = 256, N = 4096, K = 7168;
  const double gb = (double)E * N * K * 2 / 1e9;
  char err[256];
  int bad = 0;

  printf("%-8s %5s %7s %9s %9s\n", "reads", "rows", "stages", "ms", "GB/s");
  for (int m = READS_BOXES; m <= READS_BULK; m++)
    for (size_t i = 0; i < sizeof RINGS / sizeof RINGS[0]; i++) {
      double ms = read_pattern_time(m, E, N, K, RINGS[i][0], RINGS[i][1], iters, err,
                                    sizeof err);
      const char *what = m == READS_BOXES ? "boxes" : "bulk";
      if (ms <= 0) {
        printf("%-8s %5d %7d  failed: %s\n", what, RINGS[i][0], RINGS[i][1], err);
        bad++;
        continue;
      }
      printf("%-8s %5d %7d %9.3f %9.1f\n", what, RINGS[i][0], RINGS[i][1], ms, gb / ms * 1e3);
    }
  return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
  const char *torch = NULL;
  int iters = 20, bad = 0, reads = 0;
  double tms[NSHAPES];
  char msg[2048];

  setvbuf(stdout, NULL, _IOLBF, 0); /* lines reach a log even if a run dies */
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--torch") && i + 1 < argc) {
      torch = argv[++i];
    } else if (!strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = atoi(argv[++i]);
      if (iters < 1) {
        fprintf(stderr, "bench_gemm: --iters wants a positive count, not '%s'\n", argv[i]);
        return 2;
      }
    } else if (!strcmp(argv[i], "--reads")) {
      reads = 1;
    } else {
      fprintf(stderr, "usage: bench_gemm [--iters N] [--torch CMD] [--reads]\n"
                      "  the Hopper GEMM core checked against an fp32 reference, then timed on\n"
                      "  dense bf16 GEMMs; --torch CMD runs 'CMD --iters N M,N,K...' for the\n"
                      "  torch.matmul baseline in the same run; --reads: only what the memory\n"
                      "  gives dsv3's gate/up weight reads with nothing computed (the copy\n"
                      "  engine's boxes against contiguous bulk copies, rings of 2-6 stages)\n");
      return 2;
    }
  }
  if (!gemm_core_available()) {
    printf("bench_gemm: no sm_90 GPU; the Hopper core does not run here\n");
    return 0;
  }
  if (reads)
    return read_table(iters);
  for (int v = 0; v < GEMM_VARIANTS; v++) {
    double worst = 0;
    int f = gemm_core_check(v, 0, 1, msg, sizeof msg, &worst);
    printf("check %s: %s(%d failing, worst %.3f of tolerance)\n", VNAME[v], msg, f, worst);
    bad += f != 0;
  }
  for (int i = 0; i < NSHAPES; i++)
    tms[i] = 0;
  if (torch != NULL)
    torch_times(torch, iters, tms);
  printf("\n%-18s %9s %9s %9s %9s %9s\n", "M,N,K", "variant", "ms", "TFLOP/s", "torch ms",
         "ratio");
  for (int i = 0; i < NSHAPES; i++) {
    int M = SHAPES[i][0], N = SHAPES[i][1], K = SHAPES[i][2];
    double flops = 2.0 * M * N * K;
    for (int v = 0; v < GEMM_VARIANTS; v++) {
      double worst = 0, ms = gemm_core_time(M, N, K, v, iters, &worst);
      char shape[32];
      snprintf(shape, sizeof shape, "%d,%d,%d", M, N, K);
      if (ms <= 0 || !(worst <= 1.0)) {
        printf("%-18s %9s  failed (sample error %.3f of tolerance)\n", shape, VNAME[v], worst);
        bad++;
        continue;
      }
      printf("%-18s %9s %9.3f %9.1f", shape, VNAME[v], ms, flops / ms / 1e9);
      if (tms[i] > 0)
        printf(" %9.3f %8.3fx\n", tms[i], tms[i] / ms);
      else
        printf(" %9s %9s\n", "-", "-");
    }
  }
  /* grouped forward GEMMs as the layer computes them: 256 and 2048 rows an
   * expert; then what a ragged tail costs: 264, 272 and 288 rows (two full
   * 128-row m-tiles and a tail of 8, 16 or 32 rows, which rides in the
   * riding variants), 320 (a tail of one warpgroup's 64 rows) and 192 (one
   * full m-tile, one half) */
  static const int GR[][4] = {{256, 256, 4096, 7168}, {64, 2048, 3072, 4096},
                              {256, 264, 4096, 7168}, {256, 272, 4096, 7168},
                              {256, 288, 4096, 7168}, {256, 320, 4096, 7168},
                              {256, 192, 4096, 7168}};
  printf("\n%-28s %9s %9s %9s\n", "grouped groups,rows,N,K", "variant", "ms", "TFLOP/s");
  for (size_t i = 0; i < sizeof GR / sizeof GR[0]; i++) {
    double flops = 2.0 * GR[i][0] * GR[i][1] * GR[i][2] * GR[i][3];
    char shape[48];
    snprintf(shape, sizeof shape, "%d,%d,%d,%d", GR[i][0], GR[i][1], GR[i][2], GR[i][3]);
    for (int v = 0; v < GEMM_VARIANTS; v++) {
      double ms = gemm_core_time_grouped(GR[i][0], GR[i][1], GR[i][2], GR[i][3], v, iters);
      if (ms <= 0) {
        printf("%-28s %9s  failed\n", shape, VNAME[v]);
        bad++;
        continue;
      }
      printf("%-28s %9s %9.3f %9.1f\n", shape, VNAME[v], ms, flops / ms / 1e9);
    }
  }
  /* weight gradients as the layer computes them: many groups, short k */
  static const int WG[][4] = {{256, 256, 4096, 7168}, {384, 32, 6144, 7168},
                              {256, 64, 4096, 7168},   {256, 128, 4096, 7168},
                              {256, 200, 4096, 7168},  {128, 2048, 1536, 2048}};
  printf("\n%-28s %9s %9s %9s %9s\n", "wgrad groups,rows,M,N", "variant", "ms", "TFLOP/s",
         "GB/s out");
  for (size_t i = 0; i < sizeof WG / sizeof WG[0]; i++) {
    double flops = 2.0 * WG[i][0] * WG[i][1] * WG[i][2] * WG[i][3];
    double out = 2.0 * WG[i][0] * WG[i][2] * WG[i][3];
    char shape[48];
    snprintf(shape, sizeof shape, "%d,%d,%d,%d", WG[i][0], WG[i][1], WG[i][2], WG[i][3]);
    for (int v = 0; v < GEMM_VARIANTS; v++) {
      if (v == GEMM_TALL || v >= GEMM_WIDE2) /* tall tiles and clusters: NT and NN */
        continue;
      double ms = gemm_core_time_wgrad(WG[i][0], WG[i][1], WG[i][2], WG[i][3], v, iters);
      if (ms <= 0) {
        printf("%-28s %9s  failed\n", shape, VNAME[v]);
        bad++;
        continue;
      }
      printf("%-28s %9s %9.3f %9.1f %9.0f\n", shape, VNAME[v], ms, flops / ms / 1e9,
             out / ms / 1e6);
    }
  }
  return bad ? 1 : 0;
}
