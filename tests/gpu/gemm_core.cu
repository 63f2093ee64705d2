/* gemm_core.cu - the Hopper GEMM core (kernels/cuda/gemm_sm90.cuh) checked
 * layout by layout against a plain fp32 reference on the device, and timed on
 * dense problems. Used by check_gpu (which asserts) and bench_gemm (which
 * measures). Each case is a small grouped problem shaped like one GEMM of the
 * layer, with groups of 0, 1, 130, 300 and 64 rows, so tiles are partial in
 * every direction and the weight-gradient sums end inside a k-block.
 *
 * Two more run k loops many times round the stage ring (2048 columns, 1100
 * rows), where a consumer that loses count of stage phases reads a stage
 * before its data lands.
 *
 * Tolerance, |got - ref| <= tol (|ref| + rms(ref)): fp32 outputs differ from
 * the reference only by the order of the fp32 sums (tol 2^-12); bf16 outputs
 * add one rounding of the result (tol 2^-7). */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gemm_core.h"
#include "gemm_sm90.cuh"

#define CORE_OK(call)                                                       \
  do {                                                                      \
    cudaError_t e_ = (call);                                                \
    if (e_ != cudaSuccess) {                                                \
      snprintf(msg, msglen, "%s: %s", #call, cudaGetErrorString(e_));       \
      return -1;                                                            \
    }                                                                       \
  } while (0)

static __global__ void k_hash_fill(bf16 *p, int64_t n, uint64_t seed)
{
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    uint64_t z = seed + (uint64_t)i * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    p[i] = __float2bfloat16_rn(2.0f * ((float)(z >> 40) / 16777216.0f - 0.5f));
  }
}

/* out = d_g | d_u ([rows, 2 split], plain) in pairs of 64-column blocks
 * (gemm_args.gu_chunks): block b of d_g at 128 b, of d_u at 128 b + 64 */
static __global__ void k_gu_chunks(const bf16 *in, bf16 *out, int64_t rows, int split)
{
  int64_t n = rows * 2 * split;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / (2 * split);
    int c = (int)(i % (2 * split)), h = c >= split, k = h ? c - split : c;
    out[r * 2 * split + 128 * (k / 64) + 64 * h + k % 64] = in[i];
  }
}

/* C[i, j] (+)= sum_k A[i sai + k sak] B[j sbj + k sbk], fp32, k ascending */
static __global__ void k_ref(const bf16 *A, int64_t sai, int64_t sak, const bf16 *B, int64_t sbj,
                             int64_t sbk, int rows, int cols, int klen, float *C, int64_t ldc,
                             int add)
{
  int64_t idx = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (idx >= (int64_t)rows * cols)
    return;
  int i = (int)(idx / cols), j = (int)(idx % cols);
  float s = add ? C[i * ldc + j] : 0.0f;
  for (int k = 0; k < klen; k++)
    s += __bfloat162float(A[i * sai + k * sak]) * __bfloat162float(B[j * sbj + k * sbk]);
  C[i * ldc + j] = s;
}

/* g[i] = swiglu(g[i], u[i]) as swiglu.h has it (expf, IEEE division) */
static __global__ void k_swiglu_ref(float *g, const float *u, int64_t n, float limit)
{
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n)
    g[i] = mokk_swiglu(g[i], u[i], limit);
}

static void ref(const bf16 *A, int64_t sai, int64_t sak, const bf16 *B, int64_t sbj, int64_t sbk,
                int rows, int cols, int klen, float *C, int64_t ldc, int add)
{
  int64_t n = (int64_t)rows * cols;
  if (n > 0)
    k_ref<<<(unsigned)((n + 255) / 256), 256>>>(A, sai, sak, B, sbj, sbk, rows, cols, klen, C,
                                                 ldc, add);
}

static bf16 *rand_bf16(int64_t n, uint64_t seed)
{
  bf16 *p = NULL;
  if (cudaMalloc(&p, (n > 0 ? n : 1) * 2) != cudaSuccess)
    return NULL;
  k_hash_fill<<<256, 256>>>(p, n, seed);
  return p;
}

static void *zeros(int64_t bytes)
{
  void *p = NULL;
  if (cudaMalloc(&p, bytes > 0 ? bytes : 16) != cudaSuccess)
    return NULL;
  cudaMemset(p, 0, bytes > 0 ? bytes : 16);
  return p;
}

/* the weight gradients' last k-blocks: 1, 2 (90 rows), 3 and 4 k16 steps;
 * riding tails: on the one m-tile of its group, 2 rows (130) and 22 (150);
 * split over the last two m-tiles, 32 rows (288: 16 and 16), 17 (273: 9
 * and 8) and 1 (257: 1 and none); none on 300 */
static const int GROUP_ROWS[] = {0, 1, 130, 300, 64, 90, 288, 273, 257, 150};
#define NG (int)(sizeof GROUP_ROWS / sizeof GROUP_ROWS[0])

typedef struct grouping {
  int groups, rows;
  int count[NG], row_start[NG];
  int tile_off[3 * (NG + 1)]; /* m-tiles of 128 rows, of 256, of 128 riding */
  int *d_count, *d_row_start, *d_tile_off;
  void *d_maps; /* the grouped weight gradients' tensor maps */
  int *d_sched; /* the tile counter of grouped NT and NN GEMMs; NULL: static order */
  bool whole;   /* riding tails whole on a group's last m-tile (gemm_args.ride_whole) */
} grouping;

static void grouping_make(grouping *gp, bool dynamic, bool whole)
{
  memset(gp, 0, sizeof *gp);
  gp->whole = whole;
  gp->groups = NG;
  for (int g = 0; g < gp->groups; g++) {
    gp->count[g] = GROUP_ROWS[g];
    gp->row_start[g] = gp->rows;
    gp->tile_off[g + 1] = gp->tile_off[g] + (GROUP_ROWS[g] + G_BM - 1) / G_BM;
    gp->tile_off[NG + 2 + g] =
        gp->tile_off[NG + 1 + g] + (GROUP_ROWS[g] + 2 * G_BM - 1) / (2 * G_BM);
    gp->tile_off[2 * NG + 3 + g] = gp->tile_off[2 * NG + 2 + g] + mokk_ride_mtiles(GROUP_ROWS[g]);
    gp->rows += GROUP_ROWS[g];
  }
  cudaMalloc(&gp->d_count, sizeof gp->count);
  cudaMalloc(&gp->d_row_start, sizeof gp->row_start);
  cudaMalloc(&gp->d_tile_off, sizeof gp->tile_off);
  cudaMemcpy(gp->d_count, gp->count, sizeof gp->count, cudaMemcpyHostToDevice);
  cudaMemcpy(gp->d_row_start, gp->row_start, sizeof gp->row_start, cudaMemcpyHostToDevice);
  cudaMemcpy(gp->d_tile_off, gp->tile_off, sizeof gp->tile_off, cudaMemcpyHostToDevice);
  cudaMalloc(&gp->d_maps, (size_t)gp->groups * GEMM_TN_MAP_BYTES);
  if (dynamic) { /* zero, as gemm_args.sched wants it */
    cudaMalloc(&gp->d_sched, sizeof(int));
    cudaMemset(gp->d_sched, 0, sizeof(int));
  }
}

static void grouping_free(grouping *gp)
{
  cudaFree(gp->d_count), cudaFree(gp->d_row_start), cudaFree(gp->d_tile_off);
  cudaFree(gp->d_maps), cudaFree(gp->d_sched);
}

static gemm_args grouped_args(const grouping *gp)
{
  gemm_args a;
  memset(&a, 0, sizeof a);
  a.groups = gp->groups;
  a.count = gp->d_count;
  a.row_start = gp->d_row_start;
  a.tile_off = gp->d_tile_off;
  a.tile_off_tall = gp->d_tile_off + gp->groups + 1;
  a.tile_off_ride = gp->d_tile_off + 2 * (gp->groups + 1);
  a.maps = gp->d_maps;
  a.sched = gp->d_sched;
  a.ride_whole = gp->whole;
  return a;
}

/* Worst error / tolerance over n values; the reference is fp32. */
static double compare(const void *got_d, int got_bf16, const float *ref_d, int64_t n, double tol)
{
  if (n <= 0)
    return 0;
  float *ref_h = (float *)malloc(n * 4), *got_h = (float *)malloc(n * 4);
  unsigned short *b = got_bf16 ? (unsigned short *)malloc(n * 2) : NULL;
  double rms = 0, worst = 0;

  cudaMemcpy(ref_h, ref_d, n * 4, cudaMemcpyDeviceToHost);
  if (got_bf16) {
    cudaMemcpy(b, got_d, n * 2, cudaMemcpyDeviceToHost);
    for (int64_t i = 0; i < n; i++) {
      unsigned int u = (unsigned int)b[i] << 16;
      memcpy(&got_h[i], &u, 4);
    }
  } else {
    cudaMemcpy(got_h, got_d, n * 4, cudaMemcpyDeviceToHost);
  }
  for (int64_t i = 0; i < n; i++)
    rms += (double)ref_h[i] * ref_h[i];
  rms = sqrt(rms / (n > 0 ? n : 1));
  for (int64_t i = 0; i < n; i++) {
    double d = fabs((double)got_h[i] - ref_h[i]) / (tol * (fabs(ref_h[i]) + rms) + 1e-30);
    if (!(d <= worst)) /* NaN counts as the worst */
      worst = isnan(d) ? INFINITY : d;
  }
  free(ref_h), free(got_h), free(b);
  return worst;
}

/* Bytes that differ between two device buffers of n bytes. */
static int64_t differ(const void *a_d, const void *b_d, int64_t n)
{
  unsigned char *a = (unsigned char *)malloc(n), *b = (unsigned char *)malloc(n);
  int64_t d = 0;
  cudaMemcpy(a, a_d, n, cudaMemcpyDeviceToHost);
  cudaMemcpy(b, b_d, n, cudaMemcpyDeviceToHost);
  for (int64_t i = 0; i < n; i++)
    d += a[i] != b[i];
  free(a), free(b);
  return d;
}

#define TOL_F32 (1.0 / 4096)
#define TOL_BF16 (1.0 / 128)

static int sms(void)
{
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, 0);
  return n;
}

/* NT, plain and gate/up, grouped and dense; NN with and without the k split;
 * TN bf16 and fp32-accumulate with the C/C2 split, grouped and dense. Each
 * line of the report names a case and its error / tolerance. */
template <int BN, bool PP, int BM, int CL = 1, bool RIDE = false>
static int run_cases(int grid, bool dynamic, bool whole, char *msg, size_t msglen,
                     double *worst_out)
{
  grouping gp;
  char err[256];
  int rc, fails = 0;
  double worst_all = 0;
  size_t used = 0;
  const int K = 192, N = 320, IE = 192, R = 1553; /* R = sum of GROUP_ROWS */

  constexpr int TN_BM = BM == 256 ? 128 : BM; /* tall tiles are for NT and NN */
  /* the weight-gradient tiles that can also store through kept stages */
  constexpr bool TN_KEPT = BN == 256 && !PP && TN_BM == 128;
  grouping_make(&gp, dynamic, whole);
  if (gp.rows != R) {
    snprintf(msg, msglen, "grouping has %d rows", gp.rows);
    return -1;
  }
#define REPORT(name, w)                                                              \
  do {                                                                               \
    double w_ = (w);                                                                 \
    used += snprintf(msg + used, used < msglen ? msglen - used : 0, "%s %.3f; ",     \
                     name, w_);                                                      \
    if (!(w_ <= 1.0))                                                                \
      fails++;                                                                       \
    if (!(w_ <= worst_all))                                                          \
      worst_all = w_;                                                                \
  } while (0)
  /* the epilogues through shared memory (async_out) against the same
   * epilogues from registers: the same bits */
#define SAME(name, x, y, n)                                                          \
  do {                                                                               \
    int64_t d_ = differ((x), (y), (n));                                              \
    used += snprintf(msg + used, used < msglen ? msglen - used : 0,                  \
                     "%s %lld bytes differ; ", name, (long long)d_);                 \
    if (d_ != 0)                                                                     \
      fails++;                                                                       \
  } while (0)
#define RUN(call)                                                                    \
  do {                                                                               \
    if ((rc = (call)) != 0) {                                                        \
      snprintf(msg, msglen, "%s: %s", #call, err);                                   \
      return -1;                                                                     \
    }                                                                                \
  } while (0)

  bf16 *A = rand_bf16((int64_t)R * 2 * IE, 1), *B = rand_bf16((int64_t)NG * N * 2 * IE, 2),
       *B2 = rand_bf16((int64_t)NG * N * 2 * IE, 3), *Bt = rand_bf16((int64_t)R * N, 4);
  float *refc = (float *)zeros((int64_t)R * 2 * IE * 4 * NG);
  float *ref2 = (float *)zeros((int64_t)R * 2 * IE * 4 * NG);
  void *C = zeros((int64_t)R * 2 * IE * 4 * NG), *C2 = zeros((int64_t)R * 2 * IE * 4 * NG);
  float *sg = (float *)zeros((int64_t)R * IE * 4), *su = (float *)zeros((int64_t)R * IE * 4);
  float *sg2 = (float *)zeros((int64_t)R * IE * 4), *su2 = (float *)zeros((int64_t)R * IE * 4);
  bf16 *Ac = (bf16 *)zeros((int64_t)R * 2 * IE * 2);
  void *Cc = zeros((int64_t)NG * IE * N * 2), *Cc2 = zeros((int64_t)NG * IE * N * 2);
  constexpr bool ASYNC = sm90::async_out<L_NT, E_BF16, BN, BM, CL, false>() && !PP;

  /* NT bf16, grouped: C[r, n] = A[r, :K] . B[g][n, :K] */
  {
    gemm_args a = grouped_args(&gp);
    a.A = A, a.lda = K, a.B = B, a.ldb = K, a.b_stride = (int64_t)N * K;
    a.N = N, a.K = K, a.C = C, a.ldc = N;
    RUN((sm90::gemm<L_NT, E_BF16, BN, PP, BM, CL, RIDE>(&a, R, grid, 0, err)));
    for (int g = 0; g < gp.groups; g++)
      ref(A + (int64_t)gp.row_start[g] * K, K, 1, B + (int64_t)g * N * K, K, 1, gp.count[g], N,
          K, refc + (int64_t)gp.row_start[g] * N, N, 0);
    CORE_OK(cudaDeviceSynchronize());
    REPORT("nt_bf16", compare(C, 1, refc, (int64_t)R * N, TOL_BF16));
    if (ASYNC) {
      a.C = C2, a.store_regs = 1;
      RUN((sm90::gemm<L_NT, E_BF16, BN, PP, BM, CL, RIDE>(&a, R, grid, 0, err)));
      CORE_OK(cudaDeviceSynchronize());
      SAME("nt_bf16_regs", C, C2, (int64_t)R * N * 2);
    }
  }
  /* NT gate/up: g = A . Bg^T, u = A . Bu^T saved, h = swiglu(g, u): h
   * (the special-function unit's, bf16) against swiglu.h's of the reference
   * g and u, with a limit that clamps some of them (|g|, |u| run to ~10) */
  {
    gemm_args a = grouped_args(&gp);
    a.A = A, a.lda = K, a.B = B, a.B2 = B2, a.ldb = K, a.b_stride = (int64_t)IE * K;
    a.N = 2 * IE, a.K = K, a.C = C, a.ldc = IE, a.sg = sg, a.su = su, a.lds = IE;
    a.limit = 4.0f;
    RUN((sm90::gemm<L_NT, E_GATEUP, BN, PP, BM, CL, RIDE>(&a, R, grid, 0, err)));
    for (int g = 0; g < gp.groups; g++) {
      int64_t rs = gp.row_start[g];
      ref(A + rs * K, K, 1, B + (int64_t)g * IE * K, K, 1, gp.count[g], IE, K, refc + rs * IE,
          IE, 0);
      ref(A + rs * K, K, 1, B2 + (int64_t)g * IE * K, K, 1, gp.count[g], IE, K, ref2 + rs * IE,
          IE, 0);
    }
    CORE_OK(cudaDeviceSynchronize());
    REPORT("nt_gate", compare(sg, 0, refc, (int64_t)R * IE, TOL_F32));
    REPORT("nt_up", compare(su, 0, ref2, (int64_t)R * IE, TOL_F32));
    k_swiglu_ref<<<(unsigned)(((int64_t)R * IE + 255) / 256), 256>>>(refc, ref2, (int64_t)R * IE,
                                                                    a.limit);
    CORE_OK(cudaDeviceSynchronize());
    REPORT("nt_h", compare(C, 1, refc, (int64_t)R * IE, TOL_BF16));
    if (ASYNC) {
      a.C = C2, a.sg = sg2, a.su = su2, a.store_regs = 1;
      RUN((sm90::gemm<L_NT, E_GATEUP, BN, PP, BM, CL, RIDE>(&a, R, grid, 0, err)));
      CORE_OK(cudaDeviceSynchronize());
      SAME("nt_h_regs", C, C2, (int64_t)R * IE * 2);
      SAME("nt_gate_regs", sg, sg2, (int64_t)R * IE * 4);
      SAME("nt_up_regs", su, su2, (int64_t)R * IE * 4);
      /* and without saving g and u (inference): h alone */
      a.C = C2, a.sg = a.su = NULL, a.store_regs = 0;
      CORE_OK(cudaMemset(C2, 0, (size_t)R * IE * 2));
      RUN((sm90::gemm<L_NT, E_GATEUP, BN, PP, BM, CL, RIDE>(&a, R, grid, 0, err)));
      CORE_OK(cudaDeviceSynchronize());
      SAME("nt_h_only", C, C2, (int64_t)R * IE * 2);
    }
  }
  /* NT bf16, dense (the shared expert): 300 rows */
  {
    gemm_args a;
    memset(&a, 0, sizeof a);
    a.groups = 1, a.M = 300;
    a.A = A, a.lda = K, a.B = B, a.ldb = K, a.N = N, a.K = K, a.C = C, a.ldc = N;
    RUN((sm90::gemm<L_NT, E_BF16, BN, PP, BM, CL>(&a, 300, grid, 0, err)));
    ref(A, K, 1, B, K, 1, 300, N, K, refc, N, 0);
    CORE_OK(cudaDeviceSynchronize());
    REPORT("nt_dense", compare(C, 1, refc, 300LL * N, TOL_BF16));
    if (ASYNC) {
      a.C = C2, a.store_regs = 1;
      RUN((sm90::gemm<L_NT, E_BF16, BN, PP, BM, CL>(&a, 300, grid, 0, err)));
      CORE_OK(cudaDeviceSynchronize());
      SAME("nt_dense_regs", C, C2, 300LL * N * 2);
    }
  }
  /* NN fp32 with the k split: C[r, n] = A[r, :IE] . Bg[g][:, n] + A[r, IE:] . Bu[g][:, n] */
  {
    gemm_args a = grouped_args(&gp);
    a.A = A, a.lda = 2 * IE, a.B = B, a.B2 = B2, a.split = IE, a.ldb = N;
    a.b_stride = (int64_t)IE * N, a.N = N, a.K = 2 * IE, a.C = C, a.ldc = N;
    RUN((sm90::gemm<L_NN, E_F32, BN, PP, BM, CL, RIDE>(&a, R, grid, 0, err)));
    for (int g = 0; g < gp.groups; g++) {
      int64_t rs = gp.row_start[g];
      ref(A + rs * 2 * IE, 2 * IE, 1, B + (int64_t)g * IE * N, 1, N, gp.count[g], N, IE,
          refc + rs * N, N, 0);
      ref(A + rs * 2 * IE + IE, 2 * IE, 1, B2 + (int64_t)g * IE * N, 1, N, gp.count[g], N, IE,
          refc + rs * N, N, 1);
    }
    CORE_OK(cudaDeviceSynchronize());
    REPORT("nn_split", compare(C, 0, refc, (int64_t)R * N, TOL_F32));
    /* A as d_h writes d_g | d_u in pairs of 64-column blocks: the same bits */
    k_gu_chunks<<<256, 256>>>(A, Ac, R, IE);
    a.A = Ac, a.gu_chunks = 1, a.C = C2;
    RUN((sm90::gemm<L_NN, E_F32, BN, PP, BM, CL, RIDE>(&a, R, grid, 0, err)));
    CORE_OK(cudaDeviceSynchronize());
    SAME("nn_split_gu_chunks", C, C2, (int64_t)R * N * 4);
  }
  /* NN fp32 without split: C[r, n] = A[r, :K] . B[g][:, n] */
  {
    gemm_args a = grouped_args(&gp);
    a.A = A, a.lda = K, a.B = B, a.ldb = N, a.b_stride = (int64_t)K * N;
    a.N = N, a.K = K, a.C = C, a.ldc = N;
    RUN((sm90::gemm<L_NN, E_F32, BN, PP, BM, CL, RIDE>(&a, R, grid, 0, err)));
    for (int g = 0; g < gp.groups; g++) {
      int64_t rs = gp.row_start[g];
      ref(A + rs * K, K, 1, B + (int64_t)g * K * N, 1, N, gp.count[g], N, K, refc + rs * N, N,
          0);
    }
    CORE_OK(cudaDeviceSynchronize());
    REPORT("nn", compare(C, 0, refc, (int64_t)R * N, TOL_F32));
  }
  /* TN: C[g][m, n] = sum over the group's rows of A[r, m] Bt[r, n]; rows
   * m >= IE go to C2 (bf16), then the fp32-accumulate mode on top of a seed */
  for (int accum = 0; accum < 2; accum++) {
    gemm_args a = grouped_args(&gp);
    int64_t per = (int64_t)IE * N;
    a.A = A, a.lda = 2 * IE, a.B = Bt, a.ldb = N, a.M = 2 * IE, a.N = N;
    a.C = C, a.C2 = C2, a.split = IE, a.ldc = N, a.c_stride = per, a.accum = accum;
    if (accum) { /* seed the fp32 gradients with the reference of the bf16 pass */
      CORE_OK(cudaMemcpy(C, refc, gp.groups * per * 4, cudaMemcpyDeviceToDevice));
      CORE_OK(cudaMemcpy(C2, ref2, gp.groups * per * 4, cudaMemcpyDeviceToDevice));
    }
    RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM>(&a, R, grid, 0, err)));
    for (int g = 0; g < gp.groups; g++) {
      int64_t rs = gp.row_start[g];
      ref(A + rs * 2 * IE, 1, 2 * IE, Bt + rs * N, 1, N, IE, N, gp.count[g], refc + g * per, N,
          accum);
      ref(A + rs * 2 * IE + IE, 1, 2 * IE, Bt + rs * N, 1, N, IE, N, gp.count[g],
          ref2 + g * per, N, accum);
    }
    CORE_OK(cudaDeviceSynchronize());
    REPORT(accum ? "tn_accum_gate" : "tn_gate",
           compare(C, !accum, refc, gp.groups * per, accum ? TOL_F32 : TOL_BF16));
    REPORT(accum ? "tn_accum_up" : "tn_up",
           compare(C2, !accum, ref2, gp.groups * per, accum ? TOL_F32 : TOL_BF16));
    if (!accum) { /* A's columns in pairs of 64-column blocks: the same bits */
      a.A = Ac, a.gu_chunks = 1, a.C = Cc, a.C2 = Cc2;
      RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM>(&a, R, grid, 0, err)));
      CORE_OK(cudaDeviceSynchronize());
      SAME("tn_gate_gu_chunks", C, Cc, gp.groups * per * 2);
      SAME("tn_up_gu_chunks", C2, Cc2, gp.groups * per * 2);
      /* the tiles stored from registers rather than through shared memory
       * and the copy engine: the same bits */
      a.gu_chunks = 1, a.store_regs = 1;
      RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM>(&a, R, grid, 0, err)));
      CORE_OK(cudaDeviceSynchronize());
      SAME("tn_gate_regs", C, Cc, gp.groups * per * 2);
      SAME("tn_up_regs", C2, Cc2, gp.groups * per * 2);
      if constexpr (TN_KEPT) { /* and through kept stages */
        a.store_regs = 0;
        RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM, 1, false, false, 2>(&a, R, grid, 0,
                                                                          err)));
        CORE_OK(cudaDeviceSynchronize());
        SAME("tn_gate_kept", C, Cc, gp.groups * per * 2);
        SAME("tn_up_kept", C2, Cc2, gp.groups * per * 2);
        /* the last stage kept, warpgroup 1 through half a staging area */
        RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM, 1, false, false, 1>(&a, R, grid, 0,
                                                                          err)));
        CORE_OK(cudaDeviceSynchronize());
        SAME("tn_gate_kept1", C, Cc, gp.groups * per * 2);
        SAME("tn_up_kept1", C2, Cc2, gp.groups * per * 2);
      }
    }
  }
  /* TN once more through the same room for tensor maps, now over other
   * operands (Bt's columns as M and as N): the maps are rewritten at the
   * addresses the GEMMs above read, as the layer's gate/up and down weight
   * gradients do, and a stale copy in the tensor-map cache would show */
  {
    gemm_args a = grouped_args(&gp);
    int64_t per = (int64_t)N * N;
    a.A = Bt, a.lda = N, a.B = Bt, a.ldb = N, a.M = N, a.N = N;
    a.C = C, a.ldc = N, a.c_stride = per;
    RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM>(&a, R, grid, 0, err)));
    for (int g = 0; g < gp.groups; g++) {
      int64_t rs = gp.row_start[g];
      ref(Bt + rs * N, 1, N, Bt + rs * N, 1, N, N, N, gp.count[g], refc + g * per, N, 0);
    }
    CORE_OK(cudaDeviceSynchronize());
    REPORT("tn_remapped", compare(C, 1, refc, gp.groups * per, TOL_BF16));
  }
  /* TN dense (the shared expert's weight gradients): 77 rows */
  {
    gemm_args a;
    memset(&a, 0, sizeof a);
    a.groups = 1, a.K = 77;
    a.A = A, a.lda = K, a.B = Bt, a.ldb = N, a.M = K, a.N = N, a.C = C, a.ldc = N;
    RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM>(&a, 77, grid, 0, err)));
    ref(A, 1, K, Bt, 1, N, K, N, 77, refc, N, 0);
    CORE_OK(cudaDeviceSynchronize());
    REPORT("tn_dense", compare(C, 1, refc, (int64_t)K * N, TOL_BF16));
  }
  /* long k loops, many laps of the stage ring: NT dense with K = 2048, TN
   * dense over 1100 rows */
  {
    const int LK = 2048, LR = 1100;
    bf16 *LA = rand_bf16(300LL * LK, 31), *LB = rand_bf16((int64_t)N * LK, 32);
    bf16 *TA_ = rand_bf16((int64_t)LR * K, 33), *TB_ = rand_bf16((int64_t)LR * N, 34);
    gemm_args a;
    memset(&a, 0, sizeof a);
    a.groups = 1, a.M = 300;
    a.A = LA, a.lda = LK, a.B = LB, a.ldb = LK, a.N = N, a.K = LK, a.C = C, a.ldc = N;
    RUN((sm90::gemm<L_NT, E_BF16, BN, PP, BM, CL>(&a, 300, grid, 0, err)));
    ref(LA, LK, 1, LB, LK, 1, 300, N, LK, refc, N, 0);
    CORE_OK(cudaDeviceSynchronize());
    REPORT("nt_longk", compare(C, 1, refc, 300LL * N, TOL_BF16));
    memset(&a, 0, sizeof a);
    a.groups = 1, a.K = LR;
    a.A = TA_, a.lda = K, a.B = TB_, a.ldb = N, a.M = K, a.N = N, a.C = C, a.ldc = N;
    RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM>(&a, LR, grid, 0, err)));
    ref(TA_, 1, K, TB_, 1, N, K, N, LR, refc, N, 0);
    CORE_OK(cudaDeviceSynchronize());
    REPORT("tn_longk", compare(C, 1, refc, (int64_t)K * N, TOL_BF16));
    if constexpr (TN_KEPT) { /* through kept stages: the same bits */
      a.C = C2;
      RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM, 1, false, false, 2>(&a, LR, grid, 0,
                                                                        err)));
      CORE_OK(cudaDeviceSynchronize());
      SAME("tn_longk_kept", C, C2, (int64_t)K * N * 2);
      RUN((sm90::gemm<L_TN, E_WGRAD, BN, PP, TN_BM, 1, false, false, 1>(&a, LR, grid, 0,
                                                                        err)));
      CORE_OK(cudaDeviceSynchronize());
      SAME("tn_longk_kept1", C, C2, (int64_t)K * N * 2);
    }
    cudaFree(LA), cudaFree(LB), cudaFree(TA_), cudaFree(TB_);
  }
#undef RUN
#undef REPORT
#undef SAME
  cudaFree(A), cudaFree(B), cudaFree(B2), cudaFree(Bt), cudaFree(refc), cudaFree(ref2);
  cudaFree(C), cudaFree(C2), cudaFree(sg), cudaFree(su), cudaFree(sg2), cudaFree(su2);
  cudaFree(Ac), cudaFree(Cc), cudaFree(Cc2);
  grouping_free(&gp);
  CORE_OK(cudaGetLastError());
  *worst_out = worst_all;
  return fails;
}

/* 1 when the current device runs the Hopper core. */
extern "C" int gemm_core_available(void)
{
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess)
    return 0;
  return major == 9 && minor == 0;
}

/* Every case for one variant of the core (GEMM_COOP128, GEMM_COOP256,
 * GEMM_PINGPONG) on `grid` blocks (0: one per SM). Returns the number of
 * failing cases (the report names them), or -1 when a case could not run. */
extern "C" int gemm_core_check(int variant, int grid, int dynamic, char *msg, size_t msglen,
                                double *worst)
{
  if (grid <= 0)
    grid = sms();
  msg[0] = 0;
  switch (variant) {
  case GEMM_COOP256:
    return run_cases<256, false, 128>(grid, dynamic != 0, false, msg, msglen, worst);
  case GEMM_PINGPONG:
    return run_cases<128, true, 128>(grid, dynamic != 0, false, msg, msglen, worst);
  case GEMM_TALL:
    return run_cases<128, false, 256>(grid, dynamic != 0, false, msg, msglen, worst);
  case GEMM_WIDE2:
    return run_cases<256, false, 128, 2>(grid, dynamic != 0, false, msg, msglen, worst);
  case GEMM_TALL2:
    return run_cases<128, false, 256, 2>(grid, dynamic != 0, false, msg, msglen, worst);
  case GEMM_WIDE2R:
    return run_cases<256, false, 128, 2, true>(grid, dynamic != 0, false, msg, msglen, worst);
  case GEMM_WIDE1R:
  case GEMM_WIDE1W:
    return run_cases<256, false, 128, 1, true>(grid, dynamic != 0, variant == GEMM_WIDE1W, msg,
                                               msglen, worst);
  default:
    return run_cases<128, false, 128>(grid, dynamic != 0, false, msg, msglen, worst);
  }
}

/* An NT bf16 GEMM on one variant of the core. */
static int nt_variant(const gemm_args *a, int64_t rows, int variant, char *err)
{
  switch (variant) {
  case GEMM_COOP256:
    return sm90::gemm<L_NT, E_BF16, 256>(a, rows, sms(), 0, err);
  case GEMM_PINGPONG:
    return sm90::gemm<L_NT, E_BF16, 128, true>(a, rows, sms(), 0, err);
  case GEMM_TALL:
    return sm90::gemm<L_NT, E_BF16, 128, false, 256>(a, rows, sms(), 0, err);
  case GEMM_WIDE2:
    return sm90::gemm<L_NT, E_BF16, 256, false, 128, 2>(a, rows, sms(), 0, err);
  case GEMM_TALL2:
    return sm90::gemm<L_NT, E_BF16, 128, false, 256, 2>(a, rows, sms(), 0, err);
  case GEMM_WIDE2R:
    if (a->count != NULL)
      return sm90::gemm<L_NT, E_BF16, 256, false, 128, 2, true>(a, rows, sms(), 0, err);
    return sm90::gemm<L_NT, E_BF16, 256, false, 128, 2>(a, rows, sms(), 0, err);
  case GEMM_WIDE1R:
  case GEMM_WIDE1W:
    if (a->count != NULL)
      return sm90::gemm<L_NT, E_BF16, 256, false, 128, 1, true>(a, rows, sms(), 0, err);
    return sm90::gemm<L_NT, E_BF16, 256>(a, rows, sms(), 0, err);
  default:
    return sm90::gemm<L_NT, E_BF16, 128>(a, rows, sms(), 0, err);
  }
}

/* Median ms of a grouped NT GEMM shaped like the layer's forward: `groups`
 * experts of `rows` rows each, C[rows of g] = A[rows of g] B[g]^T with B
 * [groups, N, K]; 0 when it could not run. The single-block riding variants
 * take their tiles from a counter, as the layer's forward does; the others
 * in static order. */
extern "C" double gemm_core_time_grouped(int groups, int rows, int N, int K, int variant,
                                         int iters)
{
  char err[256];
  int64_t R = (int64_t)groups * rows;
  bf16 *A = rand_bf16(R * K, 41), *B = rand_bf16((int64_t)groups * N * K, 42);
  bf16 *C = (bf16 *)zeros(R * N * 2);
  const int n = 5 * (groups + 1) + 1; /* + 1: the tile counter, zero */
  int *h = (int *)calloc(n, sizeof(int)), *d = NULL;
  double *ms = (double *)calloc(iters, sizeof *ms), med = 0;
  cudaEvent_t e0, e1;
  gemm_args a;
  const int ride = mokk_ride_mtiles(rows);

  /* count, row_start, tile_off (128 rows), tile_off (256 rows), tile_off (128, riding) */
  for (int g = 0; g < groups; g++) {
    h[g] = rows;
    h[groups + g] = g * rows;
    h[2 * groups + g + 1] = h[2 * groups + g] + (rows + 127) / 128;
    h[3 * groups + 1 + g + 1] = h[3 * groups + 1 + g] + (rows + 255) / 256;
    h[4 * groups + 2 + g + 1] = h[4 * groups + 2 + g] + ride;
  }
  cudaMalloc(&d, n * sizeof(int));
  cudaMemcpy(d, h, n * sizeof(int), cudaMemcpyHostToDevice);
  memset(&a, 0, sizeof a);
  a.groups = groups, a.count = d, a.row_start = d + groups, a.tile_off = d + 2 * groups;
  a.tile_off_tall = d + 3 * groups + 1;
  a.tile_off_ride = d + 4 * groups + 2;
  a.A = A, a.lda = K, a.B = B, a.ldb = K, a.b_stride = (int64_t)N * K, a.N = N, a.K = K;
  a.C = C, a.ldc = N;
  if (variant == GEMM_WIDE1R || variant == GEMM_WIDE1W)
    a.sched = d + n - 1;
  a.ride_whole = variant == GEMM_WIDE1W;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (int i = -2; i < iters; i++) {
    cudaEventRecord(e0);
    int rc = nt_variant(&a, R, variant, err);
    cudaEventRecord(e1);
    if (rc != 0 || cudaEventSynchronize(e1) != cudaSuccess) {
      fprintf(stderr, "gemm_core_time_grouped: %s\n", rc ? err : "launch failed");
      iters = 0;
      break;
    }
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (i >= 0)
      ms[i] = t;
  }
  med = gemm_core_median(ms, iters);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cudaFree(A), cudaFree(B), cudaFree(C), cudaFree(d);
  free(h), free(ms);
  return med;
}

extern "C" double gemm_core_median(double *ms, int n)
{
  for (int i = 1; i < n; i++) /* insertion sort, n is small */
    for (int j = i; j > 0 && ms[j - 1] > ms[j]; j--) {
      double t = ms[j];
      ms[j] = ms[j - 1];
      ms[j - 1] = t;
    }
  return n > 0 ? ms[n / 2] : 0;
}

/* Median ms of a weight-gradient GEMM shaped like the layer's: groups of
 * `rows` rows, C[g] (M x N, bf16) = A[rows of g]^T B[rows of g], A [R, M] and
 * B [R, N] both MN-major, over iters runs after a warm-up; 0 when it could
 * not run. */
extern "C" double gemm_core_time_wgrad(int groups, int rows, int M, int N, int variant, int iters)
{
  char err[256];
  int64_t R = (int64_t)groups * rows;
  bf16 *A = rand_bf16(R * M, 21), *B = rand_bf16(R * N, 22);
  bf16 *C = (bf16 *)zeros((int64_t)groups * M * N * 2);
  int *cnt = (int *)malloc(groups * 4), *rs = (int *)malloc(groups * 4), *d_cnt, *d_rs;
  double *ms = (double *)calloc(iters, sizeof *ms), med = 0;
  cudaEvent_t e0, e1;
  gemm_args a;

  for (int g = 0; g < groups; g++)
    cnt[g] = rows, rs[g] = g * rows;
  void *maps = NULL;
  cudaMalloc(&d_cnt, groups * 4), cudaMalloc(&d_rs, groups * 4);
  cudaMalloc(&maps, (size_t)groups * GEMM_TN_MAP_BYTES);
  cudaMemcpy(d_cnt, cnt, groups * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(d_rs, rs, groups * 4, cudaMemcpyHostToDevice);
  memset(&a, 0, sizeof a);
  a.groups = groups, a.count = d_cnt, a.row_start = d_rs, a.maps = maps;
  a.A = A, a.lda = M, a.B = B, a.ldb = N, a.M = M, a.N = N, a.C = C, a.ldc = N;
  a.c_stride = (int64_t)M * N;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (int i = -2; i < iters; i++) {
    cudaEventRecord(e0);
    int rc = variant == GEMM_COOP256 ? sm90::gemm<L_TN, E_WGRAD, 256>(&a, R, sms(), 0, err)
             : variant == GEMM_PINGPONG ? sm90::gemm<L_TN, E_WGRAD, 128, true>(&a, R, sms(), 0, err)
                                        : sm90::gemm<L_TN, E_WGRAD, 128>(&a, R, sms(), 0, err);
    cudaEventRecord(e1);
    if (rc != 0 || cudaEventSynchronize(e1) != cudaSuccess) {
      fprintf(stderr, "gemm_core_time_wgrad: %s\n", rc ? err : "launch failed");
      iters = 0;
      break;
    }
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (i >= 0)
      ms[i] = t;
  }
  med = gemm_core_median(ms, iters);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cudaFree(A), cudaFree(B), cudaFree(C), cudaFree(d_cnt), cudaFree(d_rs), cudaFree(maps);
  free(cnt), free(rs), free(ms);
  return med;
}

/* Median ms of a dense NT GEMM C[M, N] = A[M, K] B[N, K]^T (bf16 out) over
 * iters timed runs after a warm-up; 0 when it could not run. Also checks a
 * sample of the result: *worst is its error / tolerance. */
extern "C" double gemm_core_time(int M, int N, int K, int variant, int iters, double *worst)
{
  char err[256];
  bf16 *A = rand_bf16((int64_t)M * K, 11), *B = rand_bf16((int64_t)N * K, 12);
  bf16 *C = (bf16 *)zeros((int64_t)M * N * 2);
  float *refc = (float *)zeros(64LL * N * 4);
  gemm_args a;
  cudaEvent_t e0, e1;
  double *ms = (double *)calloc(iters, sizeof *ms), med = 0;

  memset(&a, 0, sizeof a);
  a.groups = 1, a.M = M, a.A = A, a.lda = K, a.B = B, a.ldb = K, a.N = N, a.K = K;
  a.C = C, a.ldc = N;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (int i = -3; i < iters; i++) {
    cudaEventRecord(e0);
    int rc = nt_variant(&a, M, variant, err);
    cudaEventRecord(e1);
    if (rc != 0) {
      fprintf(stderr, "gemm_core_time: %s\n", err);
      iters = 0;
      break;
    }
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    if (i >= 0)
      ms[i] = t;
  }
  /* rows 0..63 of the result against the reference */
  ref(A, K, 1, B, K, 1, 64, N, K, refc, N, 0);
  if (cudaDeviceSynchronize() != cudaSuccess)
    iters = 0;
  else
    *worst = compare(C, 1, refc, 64LL * N, TOL_BF16);
  med = gemm_core_median(ms, iters);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cudaFree(A), cudaFree(B), cudaFree(C), cudaFree(refc);
  free(ms);
  return med;
}
