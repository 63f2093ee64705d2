/* cuda_moe.cu - the CUDA backend's steps: the orchestration of schedule,
 * dispatch and combine (route.cu) and the grouped expert GEMMs (gemm_sm90.cuh
 * on Hopper, gemm.cuh elsewhere), forward and backward, on one stream. No host synchronisation and no
 * counts on the host: launches are sized for the worst case (every pair
 * routed) and read the schedule on the device. Every sum has one order: the
 * schedule is a stable counting sort (rows of an expert by token, then k), the
 * GEMMs reduce k in tile order inside one block, combines walk k ascending.
 * No floating-point atomics. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_priv.h"
#include "gemm.cuh"
#include "gemm_sm90.cuh"
#include "route.h"

/* the gathers' per-rank pointers hold every rank the backend runs */
static_assert(ROUTE_MAX_RANKS >= MOKK_DEVICE_MAX_RANKS, "route_rows holds too few ranks");

/* spread steps (below): EP ranks with a buffer set and a stream each */
static int spread_forward(cuda_backend *cb, const mokk_shape *s, int64_t T,
                          const mokk_fwd_rank *ranks, const int *dev, mokk_ctx **out_ctx,
                          char *err);
static int spread_backward(cuda_backend *cb, cuda_ctx *c, mokk_grad_mode mode,
                           const mokk_bwd_rank *ranks, const int *dev, char *err);

/* ---- launch helpers ------------------------------------------------------ */

static int grid_for(const cuda_backend *cb, int64_t work, int per_sm)
{
  int64_t g = (int64_t)cb->sms * per_sm;
  if (cb->max_blocks > 0 && g > cb->max_blocks)
    g = cb->max_blocks;
  if (g > work)
    g = work;
  return g < 1 ? 1 : (int)g;
}

static int64_t gemm_tiles(const gemm_args *a, int layout)
{
  int64_t ntn = (a->N + G_BN - 1) / G_BN, mtn = (a->M + G_BM - 1) / G_BM;
  if (layout == L_TN)
    return (int64_t)a->groups * mtn * ntn;
  if (a->count != NULL)
    return (int64_t)a->tiles_max * ntn;
  return mtn * ntn;
}

/* The compute capability of the backend's device, as 10 major + minor. */
static int device_arch(cuda_backend *cb, char *err, const char *what)
{
  cudaError_t e;
  if (cb->arch == 0) {
    int major = 0, minor = 0;
    if ((e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, cb->device)) !=
            cudaSuccess ||
        (e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, cb->device)) !=
            cudaSuccess)
      return cuda_fail(err, e, what);
    cb->arch = 10 * major + minor;
  }
  return 0;
}

/* Whether the step's gate/up GEMMs (forward, and the weight gradient) pick
 * each pair's row out of x themselves (gemm_args.gather) rather than read
 * the rows a gather pass copied (xr): with MOKD_GEMM_GATHER=1 (2, or a
 * layer's dispatch=gather: the forward's alone), on the Hopper core's tiles
 * of the auto or wide choice.
 * By default the forward's alone, and only on steps of many rows over
 * experts of small H x I (step_knobs): elsewhere the gather pass is the faster
 * (PERF.md v12, v34, v36), which the forward runs into y's place and the
 * backward again before the gate/up weight gradient. */
static int gathers(cuda_backend *cb, char *err, int *on)
{
  int rc = device_arch(cb, err, "device query");
  *on = 0;
  if (rc == 0 && cb->arch == 90 &&
      (cb->k.tiles == MOKK_TILES_AUTO || cb->k.tiles == MOKK_TILES_WIDE))
    *on = cb->k.gather;
  return rc;
}

/* Whether a weight gradient (k = an expert's rows) runs on ping-pong tiles,
 * which hide one warpgroup's stores behind the other's MMAs: where a tile is
 * one k-block long (gemm() says why), unless the step's tuning picks. */
static bool wgrad_pingpong(const cuda_backend *cb, int64_t rows_per_group)
{
  if (cb->k.wgrad_tiles != MOKK_TILES_AUTO)
    return cb->k.wgrad_tiles == MOKK_TILES_PINGPONG;
  return rows_per_group <= sm90::BK;
}

/* Rows an expert from which a weight gradient's 128 x 256 tiles store
 * through the stages of their last two k-blocks rather than their last
 * one and half a staging area (sm90/epilogue.cuh, kept_out). */
#define WGRAD_KEPT_ROWS 1024

/* The Hopper GEMMs that gather their rows: gate/up (A, 128 x 256 tiles,
 * riding tails as gemm() picks them) and the gate/up weight gradient (B). */
template <int LAYOUT, int EPI>
static int gemm_gathered(cuda_backend *cb, const gemm_args *a, int64_t a_rows, int grid,
                         int64_t rows_per_group, char *err, const char *what)
{
  if constexpr (LAYOUT == L_TN && EPI == E_WGRAD) {
    if (wgrad_pingpong(cb, rows_per_group))
      return sm90::gemm<LAYOUT, EPI, 128, true, 128, 1, false, true>(a, a_rows, grid,
                                                                      cb->stream, err);
    return sm90::gemm<LAYOUT, EPI, 256, false, 128, 1, false, true>(a, a_rows, grid, cb->stream,
                                                                     err);
  } else if constexpr (LAYOUT == L_NT && EPI == E_GATEUP) {
    if (cb->k.clusters && cb->k.ride && a->tile_off_ride != NULL && rows_per_group > 128 &&
        rows_per_group <= 512)
      return sm90::gemm<LAYOUT, EPI, 256, false, 128, 1, true, true>(a, a_rows, grid,
                                                                      cb->stream, err);
    return sm90::gemm<LAYOUT, EPI, 256, false, 128, 1, false, true>(a, a_rows, grid, cb->stream,
                                                                     err);
  } else {
    (void)cb, (void)a, (void)a_rows, (void)grid, (void)rows_per_group;
    return mokk_fail(err, MOK_EINVAL, "%s: no kernel of this GEMM gathers its rows", what);
  }
}

/* One GEMM of the layer: the Hopper core (gemm_sm90.cuh) on sm_90, the
 * portable tensor-core kernel elsewhere. a_rows: rows of A in memory (and of
 * B in TN), which the Hopper core's tensor maps need. */
template <int LAYOUT, int EPI>
static int gemm(cuda_backend *cb, const gemm_args *a, int64_t a_rows, char *err,
                const char *what)
{
  cudaError_t e;
  int rc = device_arch(cb, err, what);
  if (rc)
    return rc;
  /* Hopper. Grouped NT/NN GEMMs take 128 x 256 tiles. d_x runs on clusters
   * of two blocks where experts average more than one m-tile: the pair's
   * tiles then mostly share the expert's weight tile, loaded once for both
   * (sm90/scheduler.cuh, unit_at). On dsv3 (Nsight Compute) that took d_x from
   * 8.53 ms on 256 x 128 tiles to 7.04 (gate/up from 8.49 to 7.38, before
   * the forward moved to single blocks in counter order, below); the same
   * tall tiles on clusters ran 7.86. d_h stays on single blocks: its
   * dSwiGLU epilogue ran slower in lockstep (6.14 against 5.56 ms). Weight
   * gradients (k = an expert's rows) take 128 x 256 tiles, or ping-pong
   * tiles, which hide one warpgroup's stores behind the other's MMAs, where
   * a tile is one k-block long (bench-gemm, 256 groups, M 4096, N 7168: 64
   * rows 4.489 ms against 5.086, 128 rows 5.413 against 5.020). The
   * 128 x 256 tiles store through the stages of their last k-blocks, for a
   * fourth stage (kept_out): from 1024 rows per expert on (and the shared
   * expert's, dense), where ping-pong tiles had won too, through their last
   * two, which beats both; shorter ones through their last one and half a
   * staging area, so that the next tile starts with three free stages
   * (H100 backward ms, against the whole staging area: dsv3 29.957, 29.805,
   * 29.948 / 30.247, 30.223, 30.091; qwen3_4k 1.867, 1.867, 1.868 / 1.882,
   * 1.882, 1.881). A layer's tuning (mokk_tuning) or the backend's defaults
   * (MOKD_GEMM_TILES, MOKD_GEMM_WGRAD_TILES, MOKD_GEMM_WGRAD_KEEP,
   * MOKD_GEMM_CLUSTERS) force a choice, to measure them against each
   * other. */
  if (cb->arch == 90) {
    gemm_args order = *a; /* the tile order: the stream's counter, or static */
    order.sched = cb->k.dynamic ? cb->tile_ctr : NULL;
    order.store_regs = cb->k.store_regs;
    /* tails split where the two m-tiles run side by side: gate/up, and
     * the forward on pairs (sm90/scheduler.cuh, paired) */
    order.ride_whole = cb->k.ride == MOKK_RIDE_WHOLE ||
                       (cb->k.ride == MOKK_RIDE_AUTO &&
                        (LAYOUT != L_NT || (EPI != E_GATEUP && cb->k.clusters != 2)));
    a = &order;
    int grid = grid_for(cb, gemm_tiles(a, LAYOUT), 1);
    /* over the whole schedule, so that a rank's slice of the experts takes
     * the tiles that one rank running them all would (the same bits) */
    int64_t rows_per_group = a->count != NULL ? a_rows / a->groups_all : a->K;
    if (a->gather != NULL)
      return gemm_gathered<LAYOUT, EPI>(cb, a, a_rows, grid, rows_per_group, err, what);
    if constexpr (LAYOUT == L_TN) {
      if (wgrad_pingpong(cb, rows_per_group))
        return sm90::gemm<LAYOUT, EPI, 128, true>(a, a_rows, grid, cb->stream, err);
      int keep = cb->k.wgrad_keep >= 0 ? cb->k.wgrad_keep
                 : rows_per_group >= WGRAD_KEPT_ROWS ? 2 : 1;
      if (keep == 2)
        return sm90::gemm<LAYOUT, EPI, 256, false, 128, 1, false, false, 2>(a, a_rows, grid,
                                                                           cb->stream, err);
      if (keep == 1)
        return sm90::gemm<LAYOUT, EPI, 256, false, 128, 1, false, false, 1>(a, a_rows, grid,
                                                                           cb->stream, err);
      return sm90::gemm<LAYOUT, EPI, 256>(a, a_rows, grid, cb->stream, err);
    } else {
      /* d_h runs on cooperative tiles, in counter order, however long the
       * experts. Ping-pong tiles had hidden one warpgroup's dSwiGLU
       * epilogue under the other's MMAs where experts have 1024 rows or
       * more, or one 64-row block, while that epilogue took expf and two
       * divisions an element. With the special-function unit's
       * (swiglu_grads_sfu), Nsight Compute, d_h in ms, ping-pong /
       * cooperative: mid 3.130 / 2.859, qwen3_32k 2.025 / 1.789; bench_gpu,
       * mok's backward (32 rows an expert), two rounds: 27.702, 27.494 /
       * 27.184, 27.140. */
      if (a->count != NULL && cb->k.tiles == MOKK_TILES_PINGPONG)
        return sm90::gemm<LAYOUT, EPI, 128, true>(a, a_rows, grid, cb->stream, err);
      bool tall = a->count != NULL && cb->k.tiles == MOKK_TILES_TALL;
      bool cl = a->count != NULL && cb->k.clusters && rows_per_group > 128 && EPI != E_DH;
      if (tall && cl)
        return sm90::gemm<LAYOUT, EPI, 128, false, 256, 2>(a, a_rows, grid, cb->stream, err);
      if (tall)
        return sm90::gemm<LAYOUT, EPI, 128, false, 256>(a, a_rows, grid, cb->stream, err);
      /* An expert's tail of at most MOKK_RIDE_ROWS rows rides on its last
       * full m-tile (sm90/mma.cuh, riding tails) where experts average
       * 129-512 rows, and so a tail is a large part of an expert's work.
       * Nsight Compute, ms without / with rides: dsv3 (256 rows an expert)
       * gate/up 7.658 / 7.107, down 3.661 / 3.440, d_x 7.234 / 6.699; mid
       * (2048 rows) gate/up 5.291 / 5.802, d_x 4.891 / 5.115. d_h never:
       * its tail epilogue reads g and u one value at a time (dsv3 4.974 /
       * 6.234). MOKD_GEMM_RIDE=0: off. In gate/up the tail splits
       * between an expert's last two m-tiles (gemm_args.ride_whole;
       * sm90/mma.cuh, riding tails): dsv3's forward, H100, two rounds,
       * 14.079, 14.090 ms whole against 13.071, 13.108 split;
       * MOKD_GEMM_RIDE=split or whole: everywhere.
       * The forward's GEMMs then run on single blocks, which take their
       * tiles in order from the counter: bench_gpu, three rounds, forward ms
       * on clusters / single blocks, both with rides: dsv3 13.952, 13.853,
       * 13.907 / 13.381, 13.382, 13.377; qwen3_4k 1.107, 1.109, 1.115 /
       * 1.018, 1.028, 1.032. d_x keeps clusters: without them (static
       * order) dsv3's backward took 33.8-34.3 ms against 30.1-30.3. */
      if constexpr (EPI != E_DH) {
        if (cl && cb->k.ride && a->tile_off_ride != NULL && rows_per_group <= 512) {
          if constexpr (LAYOUT == L_NT) {
            if (cb->k.clusters == 2)
              return sm90::gemm<LAYOUT, EPI, 256, false, 128, 2, true>(a, a_rows, grid,
                                                                       cb->stream, err);
            return sm90::gemm<LAYOUT, EPI, 256, false, 128, 1, true>(a, a_rows, grid,
                                                                     cb->stream, err);
          }
          return sm90::gemm<LAYOUT, EPI, 256, false, 128, 2, true>(a, a_rows, grid, cb->stream,
                                                                   err);
        }
      }
      /* The forward's GEMMs without rides (experts of more than 512 rows)
       * run on single blocks too. Nsight Compute, ms on clusters / single
       * blocks: qwen3_32k gate/up 3.005 / 2.842, down 1.493 / 1.445; mid
       * gate/up 5.138 / 4.977, down 2.500 / 2.493. */
      if (cl && (LAYOUT == L_NN || cb->k.clusters == 2))
        return sm90::gemm<LAYOUT, EPI, 256, false, 128, 2>(a, a_rows, grid, cb->stream, err);
      return sm90::gemm<LAYOUT, EPI, 256>(a, a_rows, grid, cb->stream, err);
    }
  }
  if (a->gather != NULL)
    return mokk_fail(err, MOK_EINVAL, "%s: gathered rows need the Hopper core", what);
  if (a->gu_chunks)
    return mokk_fail(err, MOK_EINVAL, "%s: d_g | d_u in 64-column pairs need the Hopper core",
                     what);
  /* the opt-in belongs to the current device and is a host-side call: ask every time */
  e = cudaFuncSetAttribute(k_gemm<LAYOUT, EPI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           G_SMEM_BYTES);
  if (e != cudaSuccess)
    return cuda_fail(err, e, what);
  /* 256 threads and 66 KiB each: three blocks fit on an SM */
  int grid = grid_for(cb, gemm_tiles(a, LAYOUT), 3);
  k_gemm<LAYOUT, EPI><<<grid, G_THREADS, G_SMEM_BYTES, cb->stream>>>(*a);
  e = cudaGetLastError();
  return e == cudaSuccess ? 0 : cuda_fail(err, e, what);
}

static int launched(char *err, const char *what)
{
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : cuda_fail(err, e, what);
}

/* Grouped args over rank r's slice of a context's schedule: its E_local
 * experts, whose rows (absolute, rank 0's first) sit in the buffers of all
 * ranks' rows. TK: the rows of every rank together. */
static gemm_args routed(const cuda_ctx *c, int64_t TK, int r)
{
  const mokk_shape *s = &c->hdr.shape;
  int El = (int)(s->E / s->P), e0 = r * El;
  gemm_args a;
  memset(&a, 0, sizeof a);
  a.groups = El;
  a.groups_all = (int)s->E;
  a.count = c->count + e0;
  a.row_start = c->row_start + e0;
  a.tile_off = c->tile_off + route_tile_off_at((int)s->E, ROUTE_TILES_WIDE) + e0;
  a.tile_off_tall = c->tile_off + route_tile_off_at((int)s->E, ROUTE_TILES_TALL) + e0;
  a.tile_off_ride = c->tile_off + route_tile_off_at((int)s->E, ROUTE_TILES_RIDE) + e0;
  a.tiles_max = (int)(TK / G_BM + (TK < El ? TK : El));
  a.limit = s->swiglu_limit;
  return a;
}

static gemm_args dense(const cuda_ctx *c, int64_t T)
{
  gemm_args a;
  memset(&a, 0, sizeof a);
  a.groups = 1;
  a.groups_all = 1;
  a.M = (int)T;
  a.limit = c->hdr.shape.swiglu_limit;
  return a;
}

/* One set of experts: the routed ones, grouped over the schedule, or the
 * shared one, a single dense group of T rows. */
typedef struct mlp {
  gemm_args base;          /* routed() or dense() */
  int64_t rows;            /* rows of the activations in memory: T K or T */
  const bf16 *wg, *wu, *wd;
  int64_t Ie, stride;      /* intermediate size; elements per expert of each weight */
  float *g, *u;            /* gate and up saved by the forward */
  bf16 *h;
  const int *gather;       /* routed, without gathered rows (xr): each row's pair, whose
                            * token's row of x gate/up and its weight gradient read */
  int gather_div;          /* K: pair -> token */
  const int *ready;        /* the forward's gate/up: rows counted by the dispatch beside it
                            * (gemm_args.ready), NULL: gathered before it */
} mlp;

/* Rank r's experts over the rows of all ranks (TK of them). */
static mlp mlp_routed(const cuda_ctx *c, int64_t TK, int r)
{
  const mokk_shape *s = &c->hdr.shape;
  mlp m = {routed(c, TK, r), TK, c->w[r][MOKK_W_GATE], c->w[r][MOKK_W_UP],
           c->w[r][MOKK_W_DOWN], s->I, s->I * s->H, c->g, c->u, c->h,
           c->gather ? c->src : NULL, (int)s->K, NULL};
  return m;
}

/* The shared expert over rank r's T tokens, rows r T.. of the saved state. */
static mlp mlp_shared(const cuda_ctx *c, int64_t T, int r)
{
  const mokk_shape *s = &c->hdr.shape;
  int64_t at = (int64_t)r * T * s->I_s;
  mlp m = {dense(c, T), T, c->w[r][MOKK_S_GATE], c->w[r][MOKK_S_UP], c->w[r][MOKK_S_DOWN],
           s->I_s, 0, c->gs != NULL ? c->gs + at : NULL, c->us != NULL ? c->us + at : NULL,
           c->hs != NULL ? c->hs + at : NULL, NULL, 0, NULL};
  return m;
}

/* h = swiglu(x W_gate^T, x W_up^T) (saving g, u), then y = h W_down^T; x:
 * the rows (m->gather: the tokens, which the GEMM picks rows from) */
static int mlp_forward(cuda_backend *cb, const mlp *m, const bf16 *x, int64_t H, bf16 *y,
                       char *err)
{
  gemm_args a = m->base;
  int rc;

  a.A = x, a.lda = H;
  a.gather = m->gather, a.gather_div = m->gather_div;
  a.B = m->wg, a.B2 = m->wu, a.ldb = H, a.b_stride = m->stride;
  a.N = (int)(2 * m->Ie), a.K = (int)H;
  a.C = m->h, a.ldc = m->Ie;
  a.sg = m->g, a.su = m->u, a.lds = m->Ie;
  a.ready = m->ready;
  if ((rc = gemm<L_NT, E_GATEUP>(cb, &a, m->rows, err, "gate/up GEMM")))
    return rc;
  a = m->base;
  a.A = m->h, a.lda = m->Ie;
  a.B = m->wd, a.ldb = m->Ie, a.b_stride = m->stride;
  a.N = (int)H, a.K = (int)m->Ie;
  a.C = y, a.ldc = H;
  return gemm<L_NT, E_BF16>(cb, &a, m->rows, err, "down GEMM");
}

/* d_h = scale (d_out W_down) -> d_g | d_u (bf16, [rows, 2 Ie]; cb->gu_chunks):
 * the row's router weight (scale) and the dSwiGLU in the epilogue. dgu may
 * be m->g itself (in place), never anything else d_h reads. */
static int mlp_dh(cuda_backend *cb, const mlp *m, const bf16 *d_out, const float *scale,
                  int64_t H, bf16 *dgu, char *err)
{
  gemm_args a = m->base;
  a.A = d_out, a.lda = H;
  a.B = m->wd, a.ldb = m->Ie, a.b_stride = m->stride;
  a.N = (int)m->Ie, a.K = (int)H;
  a.C = dgu, a.ldc = 2 * m->Ie;
  a.sg = m->g, a.su = m->u, a.lds = m->Ie;
  a.scale = scale;
  a.gu_chunks = cb->gu_chunks;
  return gemm<L_NN, E_DH>(cb, &a, m->rows, err, "d_h GEMM");
}

/* dx = d_g W_gate + d_u W_up (fp32, per row): one sum over k = 2 Ie, for
 * columns n0 .. n0 + w - 1 of d_x: dx[row, 0 .. w), rows w apart. */
static int mlp_dx(cuda_backend *cb, const mlp *m, int64_t H, int64_t n0, int64_t w,
                  const bf16 *dgu, float *dx, char *err)
{
  gemm_args a = m->base;
  a.A = dgu, a.lda = 2 * m->Ie, a.gu_chunks = cb->gu_chunks;
  a.B = m->wg + n0, a.B2 = m->wu + n0, a.split = m->Ie, a.ldb = H, a.b_stride = m->stride;
  a.N = (int)w, a.K = (int)(2 * m->Ie);
  a.C = dx, a.ldc = w;
  return gemm<L_NN, E_F32>(cb, &a, m->rows, err, "d_x GEMM");
}

static int mlp_backward(cuda_backend *cb, const mlp *m, const bf16 *d_out, const float *scale,
                        int64_t H, bf16 *dgu, float *dx, char *err)
{
  int rc = mlp_dh(cb, m, d_out, scale, H, dgu, err);
  return rc ? rc : mlp_dx(cb, m, H, 0, H, dgu, dx, err);
}

/* A gather pass: rows [*lo, *hi) (lo NULL: from 0) of the schedule of the
 * `tokens` rows of x, xr[row] = x[token of row], by the rows it writes or
 * token by token (cb->k.gather_tokens); the same bytes either way. */
static void gather_pass(const cuda_backend *cb, cudaStream_t st, route_rows x, const int *src,
                        const int *slot, int64_t tokens, const int *lo, const int *hi, int K,
                        int64_t H, bf16 *xr)
{
  if (cb->k.gather_tokens)
    route_gather_tokens(st, grid_for(cb, tokens, 16), x, slot, tokens, lo, hi, K, H, xr);
  else
    route_gather(st, grid_for(cb, tokens * K, 16), x, src, lo, hi, K, H, xr);
}

/* ---- forward ------------------------------------------------------------- */

static int aligned16(const void *p)
{
  return ((uintptr_t)p & 15) == 0;
}

/* A rank's weights, the shared expert's too where there is one (I_s > 0):
 * the copy engine reads them in 16-byte units. */
static int weights_aligned(const uint16_t *const (&w)[MOKK_NWEIGHTS], int64_t Is, char *err)
{
  for (int i = 0; i < (Is ? MOKK_NWEIGHTS : MOKK_S_GATE); i++)
    if (!aligned16(w[i]))
      return mokk_fail(err, MOK_EINVAL, "weight %d is not 16-byte aligned", i);
  return 0;
}

static int check_shape(const mokk_shape *s, int64_t T, char *err)
{
  if (s->P > MOKK_DEVICE_MAX_RANKS)
    return mokk_fail(err, MOK_ENOTSUP, "the cuda backend runs at most %d EP ranks on one "
                     "GPU; P = %lld", MOKK_DEVICE_MAX_RANKS, (long long)s->P);
  if (s->H % 64 || s->I % 64 || s->I_s % 64)
    return mokk_fail(err, MOK_ESHAPE, "the cuda backend needs H, I and I_s to be "
                     "multiples of 64; H = %lld, I = %lld, I_s = %lld", (long long)s->H,
                     (long long)s->I, (long long)s->I_s);
  if (s->P * T * s->K >= (1ll << 30) || s->P * T * s->H >= (1ll << 40))
    return mokk_fail(err, MOK_EOVERFLOW, "P * T * K = %lld rows is more than the cuda "
                     "backend indexes", (long long)(s->P * T * s->K));
  return 0;
}

/* The rows of every pair (y and, in its place or beside it, xr), and before
 * them the schedule's scratch: at least one int an expert, which
 * ctx_bytes_bound's per-expert bytes cover. */
static size_t xr_bytes(int64_t TK, int64_t H, int64_t E)
{
  size_t rows = (size_t)(TK * H * 2), least = (size_t)E * sizeof(int);
  return rows > least ? rows : least;
}

/* Carves n bytes (256-aligned) off a running offset. */
static size_t carve(size_t *off, size_t n)
{
  size_t at = *off;
  *off += (n + 255) & ~(size_t)255;
  return at;
}

/* Rows of the P ranks' [T, H] tensors, as the gathers read them. */
static route_rows rows_of(const void *const *p, int P, int64_t T)
{
  route_rows x;
  memset(&x, 0, sizeof x);
  for (int r = 0; r < P; r++)
    x.p[r] = (const bf16 *)p[r];
  x.T = T > 0 ? T : 1;
  return x;
}

/* Every row of a schedule in one buffer. */
static route_owners one_owner(const void *p)
{
  route_owners o;
  memset(&o, 0, sizeof o);
  o.p[0] = p;
  o.n = 1;
  return o;
}

/* P ranks' [n] arrays of elem bytes each, back to back in dst (rank 0's first). */
static int concat(cuda_backend *cb, void *dst, const void *const *src, int P, size_t n,
                  char *err)
{
  for (int r = 0; r < P; r++) {
    cudaError_t e = cudaMemcpyAsync((char *)dst + (size_t)r * n, src[r], n,
                                    cudaMemcpyDeviceToDevice, cb->stream);
    if (e != cudaSuccess)
      return cuda_fail(err, e, "copy of the ranks' rows");
  }
  return 0;
}

/* The GPU of each rank (dev[r]: the step's own for a NULL or self rd[r]).
 * Ranks on other GPUs need every pair of the step's devices linked: each
 * rank reads every other rank's rows. *multi: some rank is elsewhere. */
static int rank_devices(const cuda_backend *cb, int P, const mokk_backend *const *rd, int *dev,
                        int *multi, char *err)
{
  *multi = 0;
  for (int r = 0; r < P; r++) {
    dev[r] = rd[r] != NULL ? rd[r]->device : cb->device;
    *multi |= dev[r] != cb->device;
  }
  for (int r = 0; r < P && *multi; r++) {
    const mokk_backend *a = rd[r] != NULL ? rd[r] : &cb->base;
    if (!mokk_cuda_linked(&cb->base, dev[r]))
      return mokk_fail(err, MOK_ENOTSUP, "EP rank %d is on CUDA device %d and the step runs "
                       "on device %d: their backends are not linked (mokk_cuda_link)", r,
                       dev[r], cb->device);
    for (int q = 0; q < P; q++)
      if (!mokk_cuda_linked(a, dev[q]))
        return mokk_fail(err, MOK_ENOTSUP, "EP ranks %d and %d are on CUDA devices %d and "
                         "%d, whose backends are not linked (mokk_cuda_link)", r, q, dev[r],
                         dev[q]);
  }
  return 0;
}

/* One step over P ranks of T tokens (virtual ranks: one device, one
 * stream). The ranks' pairs are scheduled together, as one rank with P T
 * tokens (rank 0's first) and all E experts would: rows of an expert by
 * global token, then k. Each rank's GEMMs run over its experts' slice of
 * that schedule, with its own weights, and the shared expert and the
 * combine over its own tokens; so every rank's bits are those of the one
 * rank running the concatenated batch. */
static int cuda_forward(mokk_backend *b, const mokk_shape *s, int64_t T,
                        const mokk_fwd_rank *ranks, mokk_ctx **out_ctx, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;
  const int P = (int)s->P;
  int64_t H = s->H, I = s->I, E = s->E, K = s->K, Is = s->I_s, TG = P * T, TK = TG * K;
  int train = out_ctx != NULL, gather, rc;
  int *ready = NULL;
  size_t off = 0, o_ids, o_count, o_rs, o_to, o_slot, o_src, o_rw, o_g = 0, o_u = 0, o_h, o_y,
         o_gs = 0, o_us = 0, o_hs = 0, o_ys = 0, o_in = 0, in_x = 0;
  const void *px[ROUTE_MAX_RANKS];
  const mokk_backend *rd[MOKK_DEVICE_MAX_RANKS] = {NULL};
  int dev[MOKK_DEVICE_MAX_RANKS] = {0}, multi;
  cuda_ctx *c;

  if ((rc = check_shape(s, T, err)))
    return rc;
  for (int r = 0; r < P; r++) {
    const mokk_fwd_rank *f = &ranks[r];
    if (!aligned16(f->x) || !aligned16(f->out))
      return mokk_fail(err, MOK_EINVAL, "x and out must be 16-byte aligned");
    if ((rc = weights_aligned(f->w, Is, err)))
      return rc;
    px[r] = f->x;
    rd[r] = f->dev;
  }
  if ((rc = rank_devices(cb, P, rd, dev, &multi, err)))
    return rc;
  CK(cudaSetDevice(cb->device));
  /* ranks on other GPUs: only the spread layout keeps each rank's rows on
   * its own device */
  if ((cb->spread && P > 1) || multi)
    return spread_forward(cb, s, T, ranks, dev, out_ctx, err);
  if ((rc = gathers(cb, err, &gather)))
    return rc;

  if ((c = (cuda_ctx *)calloc(1, sizeof *c)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  c->hdr.shape = *s;
  c->hdr.T = T;
  c->x = P == 1 ? (const bf16 *)ranks[0].x : NULL;
  for (int r = 0; r < P; r++)
    for (int w = 0; w < MOKK_NWEIGHTS; w++)
      c->w[r][w] = (const bf16 *)ranks[r].w[w];

  o_ids = carve(&off, TK * sizeof(int32_t));
  o_count = carve(&off, E * sizeof(int));
  o_rs = carve(&off, (E + 1) * sizeof(int));
  /* m-tiles of 128, 256, 128 riding; then the rows of each expert the
   * dispatch has moved, when it runs beside gate/up (route_gather_ahead) */
  o_to = carve(&off, route_tile_off_len((int)E) * sizeof(int));
  o_slot = carve(&off, TK * sizeof(int));
  o_src = carve(&off, TK * sizeof(int));
  o_rw = carve(&off, TK * sizeof(float));
  /* y, each pair's expert output, in one place with what comes before it:
   * the schedule's scratch, then the gathered rows (xr, unless the GEMMs
   * pick them out of x), which gate/up has read to the last before down
   * writes the first row of y. The backward gathers them again (the
   * context keeps x). g, y, u and h lie one after another: the span a
   * context's last backward reuses, g first, since d_h may write d_g | d_u
   * over it and leave y, u and h to d_x's rows (cuda_backward). */
  if (train)
    o_g = carve(&off, TK * I * 4);
  o_y = carve(&off, xr_bytes(TK, H, E));
  if (train)
    o_u = carve(&off, TK * I * 4);
  o_h = carve(&off, TK * I * 2);
  if (Is) {
    if (train) {
      o_gs = carve(&off, TG * Is * 4);
      o_us = carve(&off, TG * Is * 4);
    }
    o_hs = carve(&off, TG * Is * 2);
    o_ys = carve(&off, TG * H * 2);
  }
  if (P > 1) {
    /* the ranks' ids and router weights back to back, then (for the GEMMs
     * that gather rows, and the backward's gathers and shared weight
     * gradient) their x: one carve,
     * which keeps the context inside mokk_ctx_bytes_bound's alignment slop */
    in_x = (TK * (sizeof(int32_t) + sizeof(float)) + 15) & ~(size_t)15;
    o_in = carve(&off, in_x + (gather || train ? TG * H * 2 : 0));
  }
  cudaError_t e = cudaMallocAsync(&c->block, off, cb->stream);
  if (e != cudaSuccess) {
    free(c);
    return mokk_fail(err, MOK_ENOMEM, "cannot allocate %zu bytes of GPU memory for the "
                     "step: %s", off, cudaGetErrorString(e));
  }
  char *base = (char *)c->block;
  c->bytes = off;
  c->count = (int *)(base + o_count);
  c->row_start = (int *)(base + o_rs);
  c->tile_off = (int *)(base + o_to);
  c->slot = (int *)(base + o_slot);
  c->src = (int *)(base + o_src);
  c->row_w = (float *)(base + o_rw);
  c->gather = gather;
  bf16 *xr = gather ? NULL : (bf16 *)(base + o_y);
  c->g = train ? (float *)(base + o_g) : NULL;
  c->u = train ? (float *)(base + o_u) : NULL;
  c->h = (bf16 *)(base + o_h);
  c->y = (bf16 *)(base + o_y);
  if (Is) {
    c->gs = train ? (float *)(base + o_gs) : NULL;
    c->us = train ? (float *)(base + o_us) : NULL;
    c->hs = (bf16 *)(base + o_hs);
  }
  bf16 *ys = Is ? (bf16 *)(base + o_ys) : NULL;
  const int32_t *ids = ranks[0].topk_ids;
  const float *tw = ranks[0].topk_weights;
  if (P > 1) {
    const void *pi[ROUTE_MAX_RANKS], *pw[ROUTE_MAX_RANKS];
    for (int r = 0; r < P; r++)
      pi[r] = ranks[r].topk_ids, pw[r] = ranks[r].topk_weights;
    ids = (const int32_t *)(base + o_in);
    tw = (const float *)(base + o_in + TK * sizeof(int32_t));
    if ((rc = concat(cb, (void *)ids, pi, P, T * K * sizeof(int32_t), err)) ||
        (rc = concat(cb, (void *)tw, pw, P, T * K * sizeof(float), err)))
      goto fail;
    if (gather || train) {
      c->x = (const bf16 *)(base + o_in + in_x);
      if ((rc = concat(cb, (void *)c->x, px, P, T * H * 2, err)))
        goto fail;
    }
  }

  /* schedule of every rank's pairs */
  route_schedule(cb->stream, ids, tw, TK, (int)E, (int32_t *)(base + o_ids), c->count,
                 c->row_start, c->tile_off, c->slot, c->src, c->row_w, cb->status, c->y,
                 xr_bytes(TK, H, E));
  if ((rc = launched(err, "schedule")))
    goto fail;
  /* the dispatch beside the gate/up GEMM (Hopper core, single blocks). Not
   * over virtual ranks: their later GEMMs, which read rows the dispatch may
   * still be moving while the first one runs, must not start before the
   * kernel ahead of them has finished (the tile counter), so they could
   * not wait for the rows the way the first one does. */
  ready = !gather && cb->k.gather_ahead > 0 && P == 1 && cb->arch == 90 &&
                  cb->k.tiles != MOKK_TILES_TALL && route_gather_ahead_fits((int)E, H)
              ? c->tile_off + route_tile_off_at((int)E, ROUTE_READY)
              : NULL;
  if (ready != NULL) {
    /* ready: zeroed by the schedule */
    cudaError_t e = route_gather_ahead(cb->stream, grid_for(cb, cb->k.gather_ahead, 1),
                                       rows_of(px, P, T), c->src, c->row_start, (int)E,
                                       (int)K, H, xr, ready);
    if (e != cudaSuccess) {
      rc = cuda_fail(err, e, "dispatch");
      goto fail;
    }
  } else if (!gather) {
    gather_pass(cb, cb->stream, rows_of(px, P, T), c->src, c->slot, TG, NULL, c->row_start + E,
                (int)K, H, xr);
    if ((rc = launched(err, "dispatch")))
      goto fail;
  }
  for (int r = 0; r < P; r++) {
    mlp routed_mlp = mlp_routed(c, TK, r);
    routed_mlp.ready = ready;
    if ((rc = mlp_forward(cb, &routed_mlp, gather ? c->x : xr, H, c->y, err)))
      goto fail;
  }
  for (int r = 0; r < P; r++) {
    mlp shared_mlp = mlp_shared(c, T, r);
    bf16 *ys_r = Is ? ys + r * T * H : NULL;
    if (Is && (rc = mlp_forward(cb, &shared_mlp, (const bf16 *)ranks[r].x, H, ys_r, err)))
      goto fail;
    route_combine_out(cb->stream, grid_for(cb, T, 16), one_owner(c->y), c->slot + r * T * K,
                      tw + r * T * K, ys_r, T, (int)K, H, (bf16 *)ranks[r].out);
    if ((rc = launched(err, "combine")))
      goto fail;
  }
  if (train)
    *out_ctx = &c->hdr;
  else
    ctx_release(cb, c);
  return 0;
fail:
  /* the schedule may have flagged an id, and no step end reads (and clears)
   * the flag after a failed step: the next step would report it */
  cudaMemsetAsync(cb->status, 0, sizeof *cb->status, cb->stream);
  ctx_release(cb, c);
  return rc;
}

/* ---- backward ------------------------------------------------------------ */

/* Rank r's weights for the backward: where they are now if they moved. */
static void moved_weights(mlp *m, const mokk_bwd_rank *b, int first)
{
  if (b->w[MOKK_W_GATE] == NULL)
    return;
  m->wg = (const bf16 *)b->w[first];
  m->wu = (const bf16 *)b->w[first + 1];
  m->wd = (const bf16 *)b->w[first + 2];
}

/* The parts of weight_grads, one GEMM each: WG_GATE_UP the routed d_W_gate
 * and d_W_up, WG_DOWN the routed d_W_down, WG_SHARED the shared expert's
 * three (when the layer has one). */
enum { WG_GATE_UP = 1, WG_DOWN = 2, WG_SHARED = 4 };

/* The weight gradients of rank r (the parts named): its experts' over its
 * slice of the schedule, and the shared expert's over every rank's tokens in
 * global order (the same GEMM for every rank, so every rank gets the same
 * bits). dy, dgu, xr: per row (xr NULL: the GEMM picks rows out of x);
 * d_out, dgus: per token, [P T, ...]. */
static int weight_grads(cuda_backend *cb, const cuda_ctx *c, const mokk_bwd_rank *br, int r,
                        int parts, int accum, const bf16 *dy, const bf16 *dgu,
                        const bf16 *xr, const bf16 *d_out, const bf16 *dgus, void *maps,
                        char *err)
{
  const mokk_shape *s = &c->hdr.shape;
  int64_t H = s->H, I = s->I, Is = s->I_s, TG = s->P * c->hdr.T, TK = TG * s->K;
  int rc;

  for (int part = 0; part < (Is ? 4 : 2); part++) {
    int shared = part >= 2, down = part & 1;
    if (!(parts & (shared ? WG_SHARED : down ? WG_DOWN : WG_GATE_UP)))
      continue;
    int wa = shared ? (down ? MOKK_S_DOWN : MOKK_S_GATE) : (down ? MOKK_W_DOWN : MOKK_W_GATE);
    int64_t Ie = shared ? Is : I;
    gemm_args a = shared ? dense(c, TG) : routed(c, TK, r);
    if (shared) {
      a.M = 0;
      a.K = (int)TG;
    } else {
      a.maps = maps; /* one GEMM at a time on the stream: one room for all */
    }
    a.accum = accum;
    void *g1 = accum ? (void *)br->g_f32[wa] : (void *)br->g_bf16[wa];
    if (down) { /* d_W_down[H, Ie] = dy^T h */
      a.A = shared ? d_out : dy;
      a.lda = H;
      a.B = shared ? c->hs : c->h;
      a.ldb = Ie;
      a.M = (int)H;
      a.N = (int)Ie;
      a.C = g1;
      a.ldc = Ie;
      a.c_stride = H * Ie;
    } else {    /* d_W_gate | d_W_up [Ie, H] = (d_g | d_u)^T xr */
      a.A = shared ? dgus : dgu;
      a.lda = 2 * Ie;
      a.gu_chunks = cb->gu_chunks;
      a.B = shared || xr == NULL ? c->x : xr;
      a.ldb = H;
      if (!shared && xr == NULL) /* xr's rows picked out of x */
        a.gather = c->src, a.gather_div = (int)s->K;
      a.M = (int)(2 * Ie);
      a.N = (int)H;
      a.C = g1;
      a.C2 = accum ? (void *)br->g_f32[wa + 1] : (void *)br->g_bf16[wa + 1];
      a.split = Ie;
      a.ldc = H;
      a.c_stride = Ie * H;
    }
    if ((rc = gemm<L_TN, E_WGRAD>(cb, &a, shared ? TG : TK, err, "weight-gradient GEMM")))
      return rc;
  }
  return 0;
}

static int cuda_backward(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode, int last,
                         const mokk_bwd_rank *ranks, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;
  cuda_ctx *c = (cuda_ctx *)ctx;
  const mokk_shape *s = &ctx->shape;
  const int P = (int)s->P;
  int64_t T = ctx->T, H = s->H, I = s->I, K = s->K, Is = s->I_s, E = s->E, TG = P * T,
          TK = TG * K;
  int accum = mode == MOKK_GRAD_FP32_ACCUM, rc = 0;
  size_t off = 0, o_dy = 0, o_dgu = 0, o_dxr = 0, o_maps, o_dgus = 0, o_dxs = 0, o_dout = 0;
  const void *pd[ROUTE_MAX_RANKS];
  const mokk_backend *rd[MOKK_DEVICE_MAX_RANKS] = {NULL};
  int dev[MOKK_DEVICE_MAX_RANKS] = {0}, multi;
  void *block = NULL;

  if ((c->spread ? c->part[0].g : c->g) == NULL)
    return mokk_fail(err, MOK_ECONTEXT, "the forward kept no state for a backward");
  for (int r = 0; r < P; r++) {
    const mokk_bwd_rank *br = &ranks[r];
    if (!aligned16(br->d_out) || !aligned16(br->d_x))
      return mokk_fail(err, MOK_EINVAL, "d_out and d_x must be 16-byte aligned");
    if ((rc = weights_aligned(br->w, Is, err)))
      return rc;
    pd[r] = br->d_out;
    rd[r] = br->dev;
  }
  if ((rc = rank_devices(cb, P, rd, dev, &multi, err)))
    return rc;
  for (int r = 0; r < P; r++) { /* a rank's saved rows are on the GPU of its forward */
    int fwd = c->spread ? c->part[r].device : cb->device;
    if (dev[r] != fwd)
      return mokk_fail(err, MOK_EINVAL, "EP rank %d of the backward names CUDA device %d; "
                       "its forward ran on device %d, which holds its saved rows", r, dev[r],
                       fwd);
  }
  CK(cudaSetDevice(cb->device));
  if ((rc = device_arch(cb, err, "device query"))) /* d_g | d_u over g: Hopper only */
    return rc;
  memset(&cb->last_bwd, 0, sizeof cb->last_bwd);
  if (c->spread)
    return spread_backward(cb, c, mode, ranks, dev, err);

  /* One region holds, in turn: dy (bf16, TK x H, read by the d_h GEMMs and
   * the down weight gradients), then dxr (fp32, written by the d_x GEMMs,
   * which run after every rank's d_h and down weight gradient), then xr
   * (bf16, TK x H: the rows of x gathered again, once d_x's combine has
   * read dxr, for the gate/up weight gradient; the forward kept them only
   * until down wrote y in their place). d_x comes
   * in column slices of Hs (halves unless MOKD_DX_HALVES=0), and so dxr
   * takes TK x Hs fp32, no more than dy: TK x H x 2 bytes less at the peak
   * than whole rows (mid: 1.07 GB), for a second read of d_g | d_u and a
   * second combine. Every element is the same sum either way.
   * The context's last backward needs no region: dy takes y's place (the
   * dispatch reads each row of y, for d_topk_weights, before it writes the
   * row of dy there), and dxr, then xr, the span of g, y, u and h, carved
   * one after another and read by nothing once d_h and the down weight
   * gradient have run: whole rows of dxr where they fit (H <= 5 I), else
   * the widest slices. Where whole rows fit in y, u and h alone (H <= 3 I),
   * d_h writes d_g | d_u over g, in pairs of 64-column blocks (cb->gu_chunks),
   * each tile over the bytes of g it has read, and the backward allocates
   * none of its rows (qwen3_4k: 0.10 GB, mid 0.81). */
  int64_t Hs = cb->k.dx_halves ? (H / 2 + 63) / 64 * 64 : H;
  /* the last backward: the shared expert's d_g | d_u and d_x (written after
   * the down weight gradient too) at the span's end, where whole rows of
   * dxr leave room for them (dsv3: 0.30 GB of 0.40) */
  size_t span = 0, tail = 0;
  char *span_at = NULL;
  int in_place = 0;
  if (last) {
    size_t rest = (size_t)((char *)c->h - (char *)c->y) + TK * I * 2;
    in_place = cb->arch == 90 && (size_t)(TK * H * 4) <= rest;
    span_at = in_place ? (char *)c->y : (char *)c->g;
    span = in_place ? rest : (size_t)((char *)c->y - (char *)c->g) + rest;
    if (Is)
      tail = ((TG * 2 * Is * 2 + 255) & ~(int64_t)255) + ((TG * H * 4 + 255) & ~(int64_t)255);
    if ((size_t)(TK * H * 4) + tail > span)
      tail = 0; /* no room: they get memory of their own */
    int64_t fit = (int64_t)(span / ((size_t)TK * 4)) / 64 * 64;
    Hs = fit < H ? fit : H;
  } else {
    o_dy = o_dxr = carve(&off, TK * (H * 2 > Hs * 4 ? H * 2 : Hs * 4));
  }
  if (!in_place)
    o_dgu = carve(&off, TK * 2 * I * 2);
  o_maps = carve(&off, (size_t)(E / P) * GEMM_TN_MAP_BYTES);
  if (Is) {
    if (tail == 0) {
      o_dgus = carve(&off, TG * 2 * Is * 2);
      o_dxs = carve(&off, TG * H * 4);
    }
    if (P > 1) /* every rank's d_out back to back, for the shared weight gradient */
      o_dout = carve(&off, TG * H * 2);
  }
  cudaError_t e = cudaMallocAsync(&block, off, cb->stream);
  if (e != cudaSuccess)
    return mokk_fail(err, MOK_ENOMEM, "cannot allocate %zu bytes of GPU memory for the "
                     "backward: %s", off, cudaGetErrorString(e));
  char *base = (char *)block;
  cb->last_bwd.dgu_in_place = in_place;
  cb->gu_chunks = in_place; /* until out: */
  cb->last_bwd.bytes = off;
  bf16 *dy = last ? c->y : (bf16 *)(base + o_dy);
  bf16 *dgu = in_place ? (bf16 *)c->g : (bf16 *)(base + o_dgu);
  float *dxr = last ? (float *)span_at : (float *)(base + o_dxr);
  /* once dxr is read; a tail lies past it. gather 2: the forward's rows alone */
  bf16 *xr = c->gather == 1 ? NULL : (bf16 *)dxr;
  bf16 *dgus = Is ? (bf16 *)(base + o_dgus) : NULL;
  float *dxs = Is ? (float *)(base + o_dxs) : NULL;
  if (tail != 0) { /* 128-byte aligned: span_at is, span is TK I 2 past a multiple of 256 */
    char *at = span_at + (span - tail);
    dgus = (bf16 *)at;
    dxs = (float *)(at + ((TG * 2 * Is * 2 + 255) & ~(int64_t)255));
  }
  const bf16 *d_out = (const bf16 *)ranks[0].d_out;
  if (Is && P > 1) {
    d_out = (const bf16 *)(base + o_dout);
    if ((rc = concat(cb, (void *)d_out, pd, P, T * H * 2, err)))
      goto out;
  }

  /* d_out's rows, scaled (dy), and d_topk_weights in one pass over d_out
   * and y; a pair with no row keeps the zero set here */
  route_pairs dtw;
  memset(&dtw, 0, sizeof dtw);
  dtw.n = T * K;
  for (int r = 0; r < P; r++) {
    dtw.p[r] = ranks[r].d_topk_weights;
    cudaError_t e = cudaMemsetAsync(dtw.p[r], 0, (size_t)(T * K) * 4, cb->stream);
    if (e != cudaSuccess) {
      rc = cuda_fail(err, e, "zeroing d_topk_weights");
      goto out;
    }
  }
  route_gather_dy(cb->stream, grid_for(cb, TK, 16), rows_of(pd, P, T), c->src, NULL,
                  c->row_start + E, (int)K, H, c->row_w, dy, one_owner(c->y), dtw);
  if ((rc = launched(err, "backward dispatch")))
    goto out;
  for (int r = 0; r < P; r++) {
    mlp routed_mlp = mlp_routed(c, TK, r);
    moved_weights(&routed_mlp, &ranks[r], MOKK_W_GATE);
    if ((rc = mlp_dh(cb, &routed_mlp, dy, NULL, H, dgu, err)))
      goto out;
  }
  for (int r = 0; r < P; r++) /* the last reader of dy */
    if ((rc = weight_grads(cb, c, &ranks[r], r, WG_DOWN, accum, dy, dgu, NULL, d_out, dgus,
                           base + o_maps, err)))
      goto out;
  for (int r = 0; r < P && Is; r++) { /* the shared expert's d_x, whole rows */
    const mokk_bwd_rank *br = &ranks[r];
    mlp shared_mlp = mlp_shared(c, T, r);
    moved_weights(&shared_mlp, br, MOKK_S_GATE);
    if ((rc = mlp_backward(cb, &shared_mlp, (const bf16 *)br->d_out, NULL, H,
                           dgus + r * T * 2 * Is, dxs + r * T * H, err)))
      goto out;
  }
  for (int64_t n0 = 0; n0 < H; n0 += Hs) { /* dxr overwrites dy (last: the span) */
    const int64_t w = H - n0 < Hs ? H - n0 : Hs;
    for (int r = 0; r < P; r++) {
      mlp routed_mlp = mlp_routed(c, TK, r);
      moved_weights(&routed_mlp, &ranks[r], MOKK_W_GATE);
      if ((rc = mlp_dx(cb, &routed_mlp, H, n0, w, dgu, dxr, err)))
        goto out;
    }
    for (int r = 0; r < P; r++) {
      route_combine_dx(cb->stream, grid_for(cb, T, 16), one_owner(dxr), c->slot + r * T * K,
                       Is ? dxs + r * T * H + n0 : NULL, T, (int)K, w, w, H,
                       (bf16 *)ranks[r].d_x + n0);
      if ((rc = launched(err, "d_x combine")))
        goto out;
    }
  }

  if (xr != NULL) { /* the rows of x again */
    const void *px = c->x;
    gather_pass(cb, cb->stream, rows_of(&px, 1, TG), c->src, c->slot, TG, NULL,
                c->row_start + E, (int)K, H, xr);
    if ((rc = launched(err, "backward's gather of x")))
      goto out;
  }
  /* weight gradients: sums over rows, in row order, one block per tile */
  for (int r = 0; r < P; r++)
    if ((rc = weight_grads(cb, c, &ranks[r], r, WG_GATE_UP | WG_SHARED, accum, NULL, dgu, xr,
                           d_out, dgus, base + o_maps, err)))
      goto out;
out:
  cb->gu_chunks = 0;
  cudaFreeAsync(block, cb->stream);
  return rc;
}

/* ---- spread steps ---------------------------------------------------------
 * An EP step laid out as ranks on several GPUs run it: each rank has its own
 * buffer set and stream. Every rank computes the whole schedule from every
 * rank's ids (the same schedule everywhere), gathers the rows of its own
 * experts from every rank's x (or d_out), runs its experts' GEMMs, and
 * combines its own tokens from the rows that every rank's buffers hold
 * (route_owners); the ranks wait for each other only through events, never
 * for the host. The shared expert's weight gradient, a sum over every
 * rank's tokens, is computed by every rank from every rank's rows, in the
 * global order. On one device (mokk_cuda_set_spread) the ranks are virtual
 * and every number is the shared layout's, rank for rank. A rank on another
 * GPU (its `dev`) has its stream, buffers, tile counter and launches there:
 * its device is current while its work is queued, and the step's again
 * after. Its reads of the others' rows go over peer access (mokk_cuda_link).
 * The schedule's flag of a bad expert id is the backend's one word on the
 * step's GPU; since every rank's schedule reads every rank's ids, one rank
 * there sets it (flag_rank) and no rank elsewhere needs an atomic over
 * peer access, which PCIe peers may not offer. */

/* The rank whose schedule flags a bad expert id: the first on the step's
 * GPU, or rank 0 (over peer access) where none runs there. */
static int flag_rank(const cuda_backend *cb, const int *dev, int P)
{
  for (int r = 0; r < P; r++)
    if (dev[r] == cb->device)
      return r;
  return 0;
}

/* Rank r's stream and event: the backend's own, or those it keeps on r's GPU. */
static cudaStream_t rank_stream(const cuda_backend *cb, const int *dev, int r)
{
  return dev[r] == cb->device ? cb->part_st[r] : cb->peer[dev[r]].part_st[r];
}

static cudaEvent_t rank_event(const cuda_backend *cb, const int *dev, int r)
{
  return dev[r] == cb->device ? cb->part_ev[r] : cb->peer[dev[r]].part_ev[r];
}

/* Makes rank r's GPU current for its launches, the step's own GPU too: the
 * rank before may have left another one current, and a launch into a stream
 * of a device that is not current fails. */
static int rank_enter(const int *dev, int r, char *err)
{
  CK(cudaSetDevice(dev[r]));
  return 0;
}

/* The rank streams, their events and the fork event, made on first use,
 * each on its rank's GPU. */
static int spread_ready(cuda_backend *cb, int P, const int *dev, char *err)
{
  int rc = 0;

  if (cb->arch == 0) { /* gemm() caches it in the backend, not in a rank's view */
    int major = 0, minor = 0;
    CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, cb->device));
    CK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, cb->device));
    cb->arch = 10 * major + minor;
  }
  if (cb->fork_ev == NULL)
    CK(cudaEventCreateWithFlags(&cb->fork_ev, cudaEventDisableTiming));
  for (int r = 0; r < P; r++) {
    if (dev[r] == cb->device) {
      if (cb->part_st[r] == NULL)
        CK(cudaStreamCreateWithFlags(&cb->part_st[r], cudaStreamNonBlocking));
      if (cb->part_ev[r] == NULL)
        CK(cudaEventCreateWithFlags(&cb->part_ev[r], cudaEventDisableTiming));
      continue;
    }
    if ((rc = cuda_peer_ready(cb, dev[r], err)))
      return rc;
    cuda_peer *pr = &cb->peer[dev[r]];
    CK(cudaSetDevice(dev[r]));
    if (pr->part_st[r] == NULL)
      CUDA_CHECK_GOTO(cudaStreamCreateWithFlags(&pr->part_st[r], cudaStreamNonBlocking), rc,
                      out);
    if (pr->part_ev[r] == NULL)
      CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&pr->part_ev[r], cudaEventDisableTiming), rc,
                      out);
    CK(cudaSetDevice(cb->device));
  }
  return 0;
out:
  cudaSetDevice(cb->device);
  return rc;
}

/* The rank streams start after what the backend's stream holds (the
 * clients' ready events). */
static int spread_fork(cuda_backend *cb, int P, const int *dev, char *err)
{
  int rc;
  CK(cudaEventRecord(cb->fork_ev, cb->stream));
  for (int r = 0; r < P; r++) {
    if ((rc = rank_enter(dev, r, err)))
      return rc;
    CK(cudaStreamWaitEvent(rank_stream(cb, dev, r), cb->fork_ev, 0));
  }
  return 0;
}

/* Each rank stream goes on once every other one has reached this point. */
static int spread_barrier(cuda_backend *cb, int P, const int *dev, char *err)
{
  int rc;
  for (int q = 0; q < P; q++) {
    if ((rc = rank_enter(dev, q, err)))
      return rc;
    CK(cudaEventRecord(rank_event(cb, dev, q), rank_stream(cb, dev, q)));
  }
  for (int r = 0; r < P; r++) {
    if ((rc = rank_enter(dev, r, err)))
      return rc;
    for (int q = 0; q < P; q++)
      if (q != r)
        CK(cudaStreamWaitEvent(rank_stream(cb, dev, r), rank_event(cb, dev, q), 0));
  }
  return 0;
}

/* The backend's stream goes on once every rank stream is done: the done
 * events, and the frees queued on it, come after all of a step's work. Run
 * on failures too, so nothing is freed under a queued kernel; where a rank
 * stream cannot be joined by an event, the host waits for it. */
static int spread_join(cuda_backend *cb, int P, const int *dev, char *err)
{
  int rc = 0;
  for (int r = 0; r < P; r++) {
    cudaStream_t st = rank_stream(cb, dev, r);
    cudaError_t e = dev[r] != cb->device ? cudaSetDevice(dev[r]) : cudaSuccess;
    if (e == cudaSuccess)
      e = cudaEventRecord(rank_event(cb, dev, r), st);
    if (e == cudaSuccess)
      e = cudaStreamWaitEvent(cb->stream, rank_event(cb, dev, r), 0);
    if (e != cudaSuccess) {
      cudaStreamSynchronize(st);
      if (rc == 0)
        rc = cuda_fail(err, e, "join of the rank streams");
    }
  }
  /* the step's device is current again, for what follows on its stream */
  cudaError_t e = cudaSetDevice(cb->device);
  if (e != cudaSuccess && rc == 0)
    rc = cuda_fail(err, e, "cudaSetDevice after the rank streams");
  return rc;
}

/* After a failed step whose ranks span GPUs: the host waits for what was
 * queued. The members' own streams are ordered after a step at its end
 * (cuda_step_end), which a failed step never reaches: without the wait,
 * their next steps, or the frees behind their fences, could run under its
 * last kernels. Steps on one GPU need nothing: they share its stream. */
static void spread_settle(cuda_backend *cb, int P, const int *dev)
{
  for (int r = 0; r < P; r++)
    if (dev[r] != cb->device) {
      cudaStreamSynchronize(cb->stream);
      return;
    }
}

/* Rank r's view of the backend: its stream, its tile counter, its device
 * and that device's multiprocessors (grid_for); the GEMM launchers take it
 * where they take the backend. */
static cuda_backend rank_backend(const cuda_backend *cb, const int *dev, int r)
{
  cuda_backend on = *cb;
  on.stream = rank_stream(cb, dev, r);
  if (dev[r] == cb->device) {
    on.tile_ctr = cb->tile_ctr + 1 + r;
  } else {
    on.tile_ctr = cb->peer[dev[r]].tile_ctr + r;
    on.device = dev[r];
    on.arch = cb->peer[dev[r]].arch;
    on.sms = cb->peer[dev[r]].sms;
  }
  return on;
}

/* Rank r's view of a spread context, in the shape the shared layout's
 * helpers (routed, mlp_*, weight_grads) read. */
static cuda_ctx rank_view(const cuda_ctx *c, int r)
{
  const cuda_part *p = &c->part[r];
  cuda_ctx v = *c;
  v.spread = 0;
  memset(v.part, 0, sizeof v.part);
  v.x = p->x != NULL ? p->x : c->x;
  v.count = p->count, v.row_start = p->row_start, v.tile_off = p->tile_off;
  v.slot = p->slot, v.src = p->src, v.row_w = p->row_w;
  v.g = p->g, v.u = p->u, v.h = p->h, v.y = p->y;
  v.gs = p->gs, v.us = p->us, v.hs = p->hs;
  return v;
}

/* The rows of every rank's buffer pointed to by field (y or d_x rows), as
 * rank r finds them: through its own copy of the schedule. */
static route_owners spread_owners(const void *const *p, const cuda_part *mine, int P, int El)
{
  route_owners o;
  memset(&o, 0, sizeof o);
  for (int q = 0; q < P; q++)
    o.p[q] = p[q];
  o.row_start = mine->row_start;
  o.El = El;
  o.n = P;
  return o;
}

static int spread_forward(cuda_backend *cb, const mokk_shape *s, int64_t T,
                          const mokk_fwd_rank *ranks, const int *dev, mokk_ctx **out_ctx,
                          char *err)
{
  const int P = (int)s->P, El = (int)(s->E / s->P), flagger = flag_rank(cb, dev, P);
  int64_t H = s->H, I = s->I, E = s->E, K = s->K, Is = s->I_s, TG = P * T, TK = TG * K;
  int train = out_ctx != NULL, rc;
  const void *px[ROUTE_MAX_RANKS], *pi[ROUTE_MAX_RANKS], *pw[ROUTE_MAX_RANKS];
  const void *py[ROUTE_MAX_RANKS];
  bf16 *ys[ROUTE_MAX_RANKS];
  cuda_ctx *c;

  if ((rc = spread_ready(cb, P, dev, err)))
    return rc;
  if ((c = (cuda_ctx *)calloc(1, sizeof *c)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  c->hdr.shape = *s;
  c->hdr.T = T;
  c->spread = 1;
  for (int r = 0; r < P; r++) {
    px[r] = ranks[r].x, pi[r] = ranks[r].topk_ids, pw[r] = ranks[r].topk_weights;
    for (int w = 0; w < MOKK_NWEIGHTS; w++)
      c->w[r][w] = (const bf16 *)ranks[r].w[w];
    c->part[r].device = dev[r];
  }
  if ((rc = spread_fork(cb, P, dev, err)))
    goto fail;

  for (int r = 0; r < P; r++) {
    cuda_part *p = &c->part[r];
    if ((rc = rank_enter(dev, r, err)))
      goto fail;
    size_t off = 0, o_ids = carve(&off, 2 * TK * sizeof(int32_t)), o_tw = carve(&off, TK * 4),
           o_count = carve(&off, E * sizeof(int)), o_rs = carve(&off, (E + 1) * sizeof(int)),
           o_to = carve(&off, route_tile_off_len((int)E) * sizeof(int)),
           o_slot = carve(&off, TK * 4), o_src = carve(&off, TK * 4), o_rw = carve(&off, TK * 4),
           o_xr = carve(&off, xr_bytes(TK, H, E)),
           o_g = train ? carve(&off, TK * I * 4) : 0,
           o_u = train ? carve(&off, TK * I * 4) : 0, o_h = carve(&off, TK * I * 2),
           o_y = carve(&off, TK * H * 2), o_gs = train && Is ? carve(&off, TG * Is * 4) : 0,
           o_us = train && Is ? carve(&off, TG * Is * 4) : 0,
           o_hs = Is ? carve(&off, TG * Is * 2) : 0, o_ys = Is ? carve(&off, T * H * 2) : 0,
           o_x = train && Is ? carve(&off, TG * H * 2) : 0;
    cudaError_t e = cudaMallocAsync(&p->block, off, rank_stream(cb, dev, r));
    if (e != cudaSuccess) {
      p->block = NULL;
      rc = mokk_fail(err, MOK_ENOMEM, "cannot allocate %zu bytes of memory of CUDA device %d "
                     "for EP rank %d of the step: %s", off, dev[r], r, cudaGetErrorString(e));
      goto fail;
    }
    char *base = (char *)p->block;
    p->bytes = off;
    c->bytes += off;
    p->ids = (int32_t *)(base + o_ids);
    p->tw = (float *)(base + o_tw);
    p->count = (int *)(base + o_count);
    p->row_start = (int *)(base + o_rs);
    p->tile_off = (int *)(base + o_to);
    p->slot = (int *)(base + o_slot);
    p->src = (int *)(base + o_src);
    p->row_w = (float *)(base + o_rw);
    p->xr = (bf16 *)(base + o_xr);
    p->g = train ? (float *)(base + o_g) : NULL;
    p->u = train ? (float *)(base + o_u) : NULL;
    p->h = (bf16 *)(base + o_h);
    p->y = (bf16 *)(base + o_y);
    p->gs = train && Is ? (float *)(base + o_gs) : NULL;
    p->us = train && Is ? (float *)(base + o_us) : NULL;
    p->hs = Is ? (bf16 *)(base + o_hs) : NULL;
    ys[r] = Is ? (bf16 *)(base + o_ys) : NULL;
    p->x = train && Is ? (const bf16 *)(base + o_x) : NULL;
    py[r] = p->y;
  }

  /* each rank: the whole schedule, its experts' rows, their GEMMs, its
   * shared expert */
  for (int r = 0; r < P; r++) {
    cuda_part *p = &c->part[r];
    cuda_backend on = rank_backend(cb, dev, r);
    cuda_ctx v = rank_view(c, r);
    if ((rc = rank_enter(dev, r, err)))
      goto fail;
    if ((rc = concat(&on, p->ids, pi, P, T * K * sizeof(int32_t), err)) ||
        (rc = concat(&on, p->tw, pw, P, T * K * sizeof(float), err)) ||
        (p->x != NULL && (rc = concat(&on, (void *)p->x, px, P, T * H * 2, err))))
      goto fail;
    route_schedule(on.stream, p->ids, p->tw, TK, (int)E, p->ids + TK, p->count, p->row_start,
                   p->tile_off, p->slot, p->src, p->row_w, r == flagger ? cb->status : NULL,
                   p->xr, xr_bytes(TK, H, E));
    if ((rc = launched(err, "schedule")))
      goto fail;
    gather_pass(cb, on.stream, rows_of(px, P, T), p->src, p->slot, TG, p->row_start + r * El,
                p->row_start + (r + 1) * El, (int)K, H, p->xr);
    if ((rc = launched(err, "dispatch")))
      goto fail;
    mlp routed_mlp = mlp_routed(&v, TK, r);
    if ((rc = mlp_forward(&on, &routed_mlp, p->xr, H, p->y, err)))
      goto fail;
    mlp shared_mlp = mlp_shared(&v, T, r);
    if (Is && (rc = mlp_forward(&on, &shared_mlp, (const bf16 *)ranks[r].x, H, ys[r], err)))
      goto fail;
  }
  /* every rank's rows are out: each combines its tokens from all of them */
  if ((rc = spread_barrier(cb, P, dev, err)))
    goto fail;
  for (int r = 0; r < P; r++) {
    const cuda_part *p = &c->part[r];
    if ((rc = rank_enter(dev, r, err)))
      goto fail;
    route_combine_out(rank_stream(cb, dev, r), grid_for(cb, T, 16),
                      spread_owners(py, p, P, El), p->slot + r * T * K, p->tw + r * T * K,
                      ys[r], T, (int)K, H, (bf16 *)ranks[r].out);
    if ((rc = launched(err, "combine")))
      goto fail;
  }
  if ((rc = spread_join(cb, P, dev, err))) {
    cudaMemsetAsync(cb->status, 0, sizeof *cb->status, cb->stream);
    spread_settle(cb, P, dev);
    ctx_release(cb, c);
    return rc;
  }
  if (train)
    *out_ctx = &c->hdr;
  else
    ctx_release(cb, c);
  return 0;
fail: {
  char jerr[MOK_ERRLEN]; /* err keeps the first failure's message */
  spread_join(cb, P, dev, jerr);
  /* as in the shared layout: no step end reads (and clears) the flag */
  cudaMemsetAsync(cb->status, 0, sizeof *cb->status, cb->stream);
  spread_settle(cb, P, dev);
  ctx_release(cb, c);
  return rc;
}
}

static int spread_backward(cuda_backend *cb, cuda_ctx *c, mokk_grad_mode mode,
                           const mokk_bwd_rank *ranks, const int *dev, char *err)
{
  const mokk_shape *s = &c->hdr.shape;
  const int P = (int)s->P, El = (int)(s->E / s->P);
  int64_t T = c->hdr.T, H = s->H, I = s->I, K = s->K, Is = s->I_s, TG = P * T, TK = TG * K;
  int accum = mode == MOKK_GRAD_FP32_ACCUM, rc = 0;
  const void *pd[ROUTE_MAX_RANKS], *py[ROUTE_MAX_RANKS], *pdx[ROUTE_MAX_RANKS];
  void *block[ROUTE_MAX_RANKS] = {NULL};
  bf16 *dy[ROUTE_MAX_RANKS], *dgu[ROUTE_MAX_RANKS];
  bf16 *dgus[ROUTE_MAX_RANKS], *dout[ROUTE_MAX_RANKS];
  float *dxr[ROUTE_MAX_RANKS], *dxs[ROUTE_MAX_RANKS];
  void *maps[ROUTE_MAX_RANKS];

  if ((rc = spread_ready(cb, P, dev, err)))
    return rc;
  for (int r = 0; r < P; r++)
    pd[r] = ranks[r].d_out, py[r] = c->part[r].y;
  if ((rc = spread_fork(cb, P, dev, err)))
    goto out;
  for (int r = 0; r < P; r++) {
    if ((rc = rank_enter(dev, r, err)))
      goto out;
    /* dy is read by the weight gradients too, after the d_x GEMMs have
     * written dxr: a region each */
    size_t off = 0, o_dxr = carve(&off, TK * H * 4), o_dy = carve(&off, TK * H * 2),
           o_dgu = carve(&off, TK * 2 * I * 2),
           o_maps = carve(&off, (size_t)El * GEMM_TN_MAP_BYTES),
           o_dgus = Is ? carve(&off, TG * 2 * Is * 2) : 0,
           o_dxs = Is ? carve(&off, T * H * 4) : 0, o_dout = Is ? carve(&off, TG * H * 2) : 0;
    cudaError_t e = cudaMallocAsync(&block[r], off, rank_stream(cb, dev, r));
    if (e != cudaSuccess) {
      block[r] = NULL;
      rc = mokk_fail(err, MOK_ENOMEM, "cannot allocate %zu bytes of memory of CUDA device %d "
                     "for EP rank %d of the backward: %s", off, dev[r], r,
                     cudaGetErrorString(e));
      goto out;
    }
    char *base = (char *)block[r];
    dxr[r] = (float *)(base + o_dxr);
    dy[r] = (bf16 *)(base + o_dy);
    dgu[r] = (bf16 *)(base + o_dgu);
    maps[r] = base + o_maps;
    dgus[r] = Is ? (bf16 *)(base + o_dgus) : NULL;
    dxs[r] = Is ? (float *)(base + o_dxs) : NULL;
    dout[r] = Is ? (bf16 *)(base + o_dout) : NULL;
    pdx[r] = dxr[r];
  }

  /* each rank: its experts' rows of d_out, d_topk_weights of its pairs, d_h
   * and d_x of its experts' rows, its shared expert's backward */
  for (int r = 0; r < P; r++) {
    cuda_part *p = &c->part[r];
    const mokk_bwd_rank *br = &ranks[r];
    cuda_backend on = rank_backend(cb, dev, r);
    cuda_ctx v = rank_view(c, r);
    if ((rc = rank_enter(dev, r, err)))
      goto out;
    if (Is) { /* every rank's d_out and hs, for the shared weight gradient */
      if ((rc = concat(&on, dout[r], pd, P, T * H * 2, err)))
        goto out;
      for (int q = 0; q < P; q++) {
        size_t at = (size_t)q * T * Is;
        cudaError_t e = q == r ? cudaSuccess
                               : cudaMemcpyAsync(p->hs + at, c->part[q].hs + at, T * Is * 2,
                                                 cudaMemcpyDeviceToDevice, on.stream);
        if (e != cudaSuccess) {
          rc = cuda_fail(err, e, "copy of the ranks' shared h");
          goto out;
        }
      }
    }
    route_pairs none;
    memset(&none, 0, sizeof none);
    route_gather_dy(on.stream, grid_for(cb, TK, 16), rows_of(pd, P, T), p->src,
                    p->row_start + r * El, p->row_start + (r + 1) * El, (int)K, H, p->row_w,
                    dy[r], one_owner(NULL), none);
    if ((rc = launched(err, "backward dispatch")))
      goto out;
    route_dtw(on.stream, grid_for(cb, T * K, 16), (const bf16 *)br->d_out,
              spread_owners(py, p, P, El), p->slot + r * T * K, T * K, (int)K, H,
              br->d_topk_weights);
    if ((rc = launched(err, "d_topk_weights")))
      goto out;
    mlp routed_mlp = mlp_routed(&v, TK, r);
    moved_weights(&routed_mlp, br, MOKK_W_GATE);
    if ((rc = mlp_dh(&on, &routed_mlp, dy[r], NULL, H, dgu[r], err)) ||
        (rc = mlp_dx(&on, &routed_mlp, H, 0, H, dgu[r], dxr[r], err)))
      goto out;
    mlp shared_mlp = mlp_shared(&v, T, r);
    moved_weights(&shared_mlp, br, MOKK_S_GATE);
    if (Is && (rc = mlp_backward(&on, &shared_mlp, (const bf16 *)br->d_out, NULL, H,
                                 dgus[r] + r * T * 2 * Is, dxs[r], err)))
      goto out;
  }
  /* every rank's d_x rows and shared d_g | d_u are out */
  if ((rc = spread_barrier(cb, P, dev, err)))
    goto out;
  for (int r = 0; r < P; r++) {
    cuda_part *p = &c->part[r];
    const mokk_bwd_rank *br = &ranks[r];
    cuda_backend on = rank_backend(cb, dev, r);
    cuda_ctx v = rank_view(c, r);
    if ((rc = rank_enter(dev, r, err)))
      goto out;
    route_combine_dx(on.stream, grid_for(cb, T, 16), spread_owners(pdx, p, P, El),
                     p->slot + r * T * K, dxs[r], T, (int)K, H, H, H, (bf16 *)br->d_x);
    if ((rc = launched(err, "d_x combine")))
      goto out;
    for (int q = 0; Is && q < P; q++) {
      size_t at = (size_t)q * T * 2 * Is;
      cudaError_t e = q == r ? cudaSuccess
                             : cudaMemcpyAsync(dgus[r] + at, dgus[q] + at, T * 2 * Is * 2,
                                               cudaMemcpyDeviceToDevice, on.stream);
      if (e != cudaSuccess) {
        rc = cuda_fail(err, e, "copy of the ranks' shared d_g | d_u");
        goto out;
      }
    }
    if ((rc = weight_grads(&on, &v, br, r, WG_GATE_UP | WG_DOWN | WG_SHARED, accum, dy[r],
                           dgu[r], p->xr, dout[r], dgus[r], maps[r], err)))
      goto out;
  }
out: {
  char jerr[MOK_ERRLEN];
  /* err keeps the first failure's message */
  int jr = spread_join(cb, P, dev, rc ? jerr : err);
  if (rc == 0)
    rc = jr;
  if (rc != 0)
    spread_settle(cb, P, dev);
}
  for (int r = 0; r < P; r++)
    if (block[r] != NULL)
      cuda_free_after(cb, dev[r], block[r]);
  return rc;
}

/* ---- entries for the backend's table (cuda_backend.cu) ------------------ */

/* The step's kernel choices: the layer's tuning where it chooses, the
 * backend's defaults where it leaves them (0), an automatic default by the
 * step's shape (s, T tokens a rank). A step runs on one thread
 * from entry to return, and every launcher reads cb->k (rank views copy it). */
static void step_knobs(cuda_backend *cb, const mokk_shape *s, int64_t T)
{
  const mokk_tuning *t = &s->tune;
  cuda_knobs k = cb->dflt;
  /* the forward's rows gathered by gate/up where that measured faster than
   * the dispatch beside it: experts of small H x I (qwen3's 2048 x 768 to
   * 2048 x 1536 and 4096 x 768, not mid's 4096 x 1536 nor dsv3's), on
   * steps of as many rows as were measured (PERF.md v36) */
  if (k.gather == MOKK_GATHER_AUTO)
    k.gather = s->H * s->I <= MOKK_GATHER_AUTO_HI && T * s->K * s->P >= MOKK_GATHER_AUTO_ROWS
                   ? 2
                   : 0;
  if (t->tiles != MOKK_TILES_AUTO)
    k.tiles = t->tiles;
  if (t->wgrad_tiles != MOKK_TILES_AUTO)
    k.wgrad_tiles = t->wgrad_tiles;
  if (t->clusters != MOKK_CLUSTERS_AUTO)
    k.clusters = t->clusters - 1; /* none 0, dgrad 1, all 2 (cuda_priv.h) */
  if (t->order != MOKK_ORDER_AUTO)
    k.dynamic = t->order == MOKK_ORDER_DYNAMIC;
  if (t->tails != MOKK_TAILS_AUTO)
    k.ride = t->tails - 1; /* MOKK_RIDE_* (cuda_priv.h) */
  if (t->dx != MOKK_DX_AUTO)
    k.dx_halves = t->dx == MOKK_DX_HALVES;
  /* the layer's dispatch decides the forward's rows over MOKD_GEMM_GATHER
   * (a measuring knob): gathered by gate/up, or dispatched, and then the
   * backward gathers them again for its weight gradient */
  if (t->dispatch_blocks == MOKK_DISPATCH_GATHER) {
    k.gather = 2;
  } else if (t->dispatch_blocks != 0) {
    k.gather = 0;
    k.gather_ahead = t->dispatch_blocks == MOKK_DISPATCH_BEFORE ? 0 : t->dispatch_blocks;
  }
  cb->k = k;
}

int cuda_forward_entry(mokk_backend *b, const mokk_shape *s, int64_t T,
                       const mokk_fwd_rank *ranks, mokk_ctx **out_ctx, char *err)
{
  step_knobs((cuda_backend *)b, s, T);
  return cuda_forward(b, s, T, ranks, out_ctx, err);
}

int cuda_backward_entry(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode, unsigned flags,
                        const mokk_bwd_rank *ranks, char *err)
{
  step_knobs((cuda_backend *)b, &ctx->shape, ctx->T);
  return cuda_backward(b, ctx, mode, (flags & MOKK_BWD_LAST) != 0, ranks, err);
}
