/* gemm_core.h - the Hopper GEMM core's checks and timings (gemm_core.cu),
 * for check_gpu and bench_gemm. */
#ifndef MOKK_TESTS_GEMM_CORE_H
#define MOKK_TESTS_GEMM_CORE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* the core's variants: tiles shared by both consumer warpgroups, 128 x 128,
 * 128 x 256 or (grouped NT and NN only) 256 x 128, or 128 x 128 tiles the
 * two take in turns; the last two: 128 x 256 and 256 x 128 tiles on
 * clusters of two blocks, which share operands in NN and run neighbouring
 * tiles side by side in NT (sm90/scheduler.cuh, pairs; their TN cases run
 * without clusters); then 128 x 256 tiles on clusters with riding tails (a
 * group's last few rows multiplied on its full m-tiles, split over the last
 * two; grouped NT and NN, the rest as wide2); then on single blocks with
 * riding tails split (as the forward runs them) and whole on the last m-tile
 * (the rest as coop256) */
enum {
  GEMM_COOP128,
  GEMM_COOP256,
  GEMM_PINGPONG,
  GEMM_TALL,
  GEMM_WIDE2,
  GEMM_TALL2,
  GEMM_WIDE2R,
  GEMM_WIDE1R,
  GEMM_WIDE1W,
  GEMM_VARIANTS
};

/* 1 when the current device runs the Hopper core (sm_90). */
int gemm_core_available(void);
/* dynamic: grouped NT and NN GEMMs take their tiles from a counter */
int gemm_core_check(int variant, int grid, int dynamic, char *msg, size_t msglen, double *worst);
double gemm_core_time(int M, int N, int K, int variant, int iters, double *worst);
double gemm_core_time_wgrad(int groups, int rows, int M, int N, int variant, int iters);
double gemm_core_time_grouped(int groups, int rows, int N, int K, int variant, int iters);
/* The median of ms[0..n) (sorted in place; 0 for none): the timings' */
double gemm_core_median(double *ms, int n);

#ifdef __cplusplus
}
#endif

#endif
