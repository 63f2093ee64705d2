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

/* One GEMM of the layer: the Hopper core (gemm_sm90.cuh) on sm_90, the
 * portable tensor-core kernel elsewhere. a_rows: rows of A in memory (and of
 * B in TN), which the Hopper core's tensor maps need. */
template <int LAYOUT, int EPI>
static int gemm(cuda_backend *cb, const gemm_args *a, int64_t a_rows, char *err,
                const char *what)
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
  /* Hopper. Grouped NT/NN GEMMs take 128 x 256 tiles, on clusters of two
   * blocks where experts average more than one m-tile: the pair's tiles
   * then mostly share the expert's weight tile, loaded once for both
   * (gemm_sm90.cuh, unit_at). On dsv3 (Nsight Compute) that took gate/up
   * from 8.49 ms on 256 x 128 tiles to 7.38, and d_x from 8.53 to 7.04; the
   * same tall tiles on clusters ran 8.13 and 7.86. d_h stays on single blocks:
   * its dSwiGLU epilogue ran slower in lockstep (6.14 against 5.56 ms). Weight
   * gradients (k = an expert's rows) take 128 x 256 tiles, or ping-pong
   * tiles, which hide one warpgroup's stores behind the other's MMAs, from
   * 1024 rows per expert on (bench-gemm). MOKD_GEMM_TILES=wide or tall and
   * MOKD_GEMM_CLUSTERS=0 force a choice, to measure them against each other. */
  if (cb->arch == 90) {
    int grid = grid_for(cb, gemm_tiles(a, LAYOUT), 1);
    int64_t rows_per_group = a->count != NULL ? a_rows / a->groups : a->K;
    if constexpr (LAYOUT == L_TN) {
      if (rows_per_group >= 1024 || cb->tiles == MOKK_TILES_WIDE)
        return sm90::gemm<LAYOUT, EPI, 128, true>(a, a_rows, grid, cb->stream, err);
      return sm90::gemm<LAYOUT, EPI, 256>(a, a_rows, grid, cb->stream, err);
    } else {
      /* to measure: d_h on 128 x 256 tiles with its g and u prefetched into
       * the L2 (gemm_sm90.cuh, dh_prefetch) */
      if (EPI == E_DH && getenv("MOKD_GEMM_DH_PREFETCH") != NULL) {
        gemm_args b = *a;
        b.prefetch = 1;
        return sm90::gemm<LAYOUT, EPI, 256>(&b, a_rows, grid, cb->stream, err);
      }
      /* to measure: d_h on ping-pong tiles, whose warpgroups take turns so
       * one's dSwiGLU epilogue (fp32 g and u loads) overlaps the other's MMAs */
      if (EPI == E_DH && getenv("MOKD_GEMM_DH_PINGPONG") != NULL)
        return sm90::gemm<LAYOUT, EPI, 128, true>(a, a_rows, grid, cb->stream, err);
      bool tall = a->count != NULL && cb->tiles == MOKK_TILES_TALL;
      bool cl = a->count != NULL && cb->clusters && rows_per_group > 128 && EPI != E_DH;
      if (tall && cl)
        return sm90::gemm<LAYOUT, EPI, 128, false, 256, 2>(a, a_rows, grid, cb->stream, err);
      if (tall)
        return sm90::gemm<LAYOUT, EPI, 128, false, 256>(a, a_rows, grid, cb->stream, err);
      if (cl)
        return sm90::gemm<LAYOUT, EPI, 256, false, 128, 2>(a, a_rows, grid, cb->stream, err);
      return sm90::gemm<LAYOUT, EPI, 256>(a, a_rows, grid, cb->stream, err);
    }
  }
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

/* Grouped args over the schedule of a context (routed experts). */
static gemm_args routed(const cuda_ctx *c, int64_t TK)
{
  gemm_args a;
  memset(&a, 0, sizeof a);
  a.groups = (int)c->hdr.shape.E;
  a.count = c->count;
  a.row_start = c->row_start;
  a.tile_off = c->tile_off;
  a.tile_off_tall = c->tile_off + a.groups + 1;
  a.tiles_max = (int)(TK / G_BM + (TK < a.groups ? TK : a.groups));
  a.limit = c->hdr.shape.swiglu_limit;
  return a;
}

static gemm_args dense(const cuda_ctx *c, int64_t T)
{
  gemm_args a;
  memset(&a, 0, sizeof a);
  a.groups = 1;
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
} mlp;

static mlp mlp_routed(const cuda_ctx *c, int64_t TK)
{
  const mokk_shape *s = &c->hdr.shape;
  mlp m = {routed(c, TK), TK, c->w[MOKK_W_GATE], c->w[MOKK_W_UP], c->w[MOKK_W_DOWN],
           s->I, s->I * s->H, c->g, c->u, c->h};
  return m;
}

static mlp mlp_shared(const cuda_ctx *c, int64_t T)
{
  const mokk_shape *s = &c->hdr.shape;
  mlp m = {dense(c, T), T, c->w[MOKK_S_GATE], c->w[MOKK_S_UP], c->w[MOKK_S_DOWN],
           s->I_s, 0, c->gs, c->us, c->hs};
  return m;
}

/* h = swiglu(x W_gate^T, x W_up^T) (saving g, u), then y = h W_down^T */
static int mlp_forward(cuda_backend *cb, const mlp *m, const bf16 *x, int64_t H, bf16 *y,
                       char *err)
{
  gemm_args a = m->base;
  int rc;

  a.A = x, a.lda = H;
  a.B = m->wg, a.B2 = m->wu, a.ldb = H, a.b_stride = m->stride;
  a.N = (int)(2 * m->Ie), a.K = (int)H;
  a.C = m->h, a.ldc = m->Ie;
  a.sg = m->g, a.su = m->u, a.lds = m->Ie;
  if ((rc = gemm<L_NT, E_GATEUP>(cb, &a, m->rows, err, "gate/up GEMM")))
    return rc;
  a = m->base;
  a.A = m->h, a.lda = m->Ie;
  a.B = m->wd, a.ldb = m->Ie, a.b_stride = m->stride;
  a.N = (int)H, a.K = (int)m->Ie;
  a.C = y, a.ldc = H;
  return gemm<L_NT, E_BF16>(cb, &a, m->rows, err, "down GEMM");
}

/* d_h = scale (d_out W_down) -> d_g | d_u (bf16, [rows, 2 Ie]), then
 * dx = d_g W_gate + d_u W_up (fp32, per row) */
static int mlp_backward(cuda_backend *cb, const mlp *m, const bf16 *d_out, const float *scale,
                        int64_t H, bf16 *dgu, float *dx, char *err)
{
  gemm_args a = m->base;
  int rc;

  a.A = d_out, a.lda = H;
  a.B = m->wd, a.ldb = m->Ie, a.b_stride = m->stride;
  a.N = (int)m->Ie, a.K = (int)H;
  a.C = dgu, a.ldc = 2 * m->Ie;
  a.sg = m->g, a.su = m->u, a.lds = m->Ie;
  a.scale = scale;
  if ((rc = gemm<L_NN, E_DH>(cb, &a, m->rows, err, "d_h GEMM")))
    return rc;
  a = m->base;
  a.A = dgu, a.lda = 2 * m->Ie;
  a.B = m->wg, a.B2 = m->wu, a.split = m->Ie, a.ldb = H, a.b_stride = m->stride;
  a.N = (int)H, a.K = (int)(2 * m->Ie);
  a.C = dx, a.ldc = H;
  return gemm<L_NN, E_F32>(cb, &a, m->rows, err, "d_x GEMM");
}

/* ---- forward ------------------------------------------------------------- */

static int aligned16(const void *p)
{
  return ((uintptr_t)p & 15) == 0;
}

static int check_shape(const mokk_shape *s, int64_t T, char *err)
{
  if (s->P != 1)
    return mokk_fail(err, MOK_ENOTSUP, "the cuda backend runs one EP rank per step; "
                     "P = %lld", (long long)s->P);
  if (s->H % 64 || s->I % 64 || s->I_s % 64)
    return mokk_fail(err, MOK_ESHAPE, "the cuda backend needs H, I and I_s to be "
                     "multiples of 64; H = %lld, I = %lld, I_s = %lld", (long long)s->H,
                     (long long)s->I, (long long)s->I_s);
  if (T * s->K >= (1ll << 30) || T * s->H >= (1ll << 40))
    return mokk_fail(err, MOK_EOVERFLOW, "T * K = %lld rows is more than the cuda "
                     "backend indexes", (long long)(T * s->K));
  return 0;
}

/* Carves n bytes (256-aligned) off a running offset. */
static size_t carve(size_t *off, size_t n)
{
  size_t at = *off;
  *off += (n + 255) & ~(size_t)255;
  return at;
}

static int cuda_forward(mokk_backend *b, const mokk_shape *s, int64_t T,
                        const mokk_fwd_rank *ranks, mokk_ctx **out_ctx, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;
  const mokk_fwd_rank *f = &ranks[0];
  int64_t H = s->H, I = s->I, E = s->E, K = s->K, Is = s->I_s, TK = T * K;
  int train = out_ctx != NULL, rc;
  size_t off = 0, o_ids, o_count, o_rs, o_to, o_slot, o_src, o_rw, o_xr, o_g = 0, o_u = 0, o_h, o_y,
         o_gs = 0, o_us = 0, o_hs = 0, o_ys = 0;
  cuda_ctx *c;

  if ((rc = check_shape(s, T, err)))
    return rc;
  if (!aligned16(f->x) || !aligned16(f->out))
    return mokk_fail(err, MOK_EINVAL, "x and out must be 16-byte aligned");
  for (int w = 0; w < (Is ? MOKK_NWEIGHTS : MOKK_S_GATE); w++)
    if (!aligned16(f->w[w]))
      return mokk_fail(err, MOK_EINVAL, "weight %d is not 16-byte aligned", w);
  CK(cudaSetDevice(cb->device));

  if ((c = (cuda_ctx *)calloc(1, sizeof *c)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  c->hdr.shape = *s;
  c->hdr.T = T;
  c->x = (const bf16 *)f->x;
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    c->w[w] = (const bf16 *)f->w[w];

  o_ids = carve(&off, TK * sizeof(int32_t));
  o_count = carve(&off, E * sizeof(int));
  o_rs = carve(&off, (E + 1) * sizeof(int));
  o_to = carve(&off, 2 * (E + 1) * sizeof(int)); /* m-tiles of 128 and of 256 rows */
  o_slot = carve(&off, TK * sizeof(int));
  o_src = carve(&off, TK * sizeof(int));
  o_rw = carve(&off, TK * sizeof(float));
  o_xr = carve(&off, TK * H * 2);
  if (train) {
    o_g = carve(&off, TK * I * 4);
    o_u = carve(&off, TK * I * 4);
  }
  o_h = carve(&off, TK * I * 2);
  o_y = carve(&off, TK * H * 2);
  if (Is) {
    if (train) {
      o_gs = carve(&off, T * Is * 4);
      o_us = carve(&off, T * Is * 4);
    }
    o_hs = carve(&off, T * Is * 2);
    o_ys = carve(&off, T * H * 2);
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
  c->xr = (bf16 *)(base + o_xr);
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
  mlp routed_mlp = mlp_routed(c, TK), shared_mlp = mlp_shared(c, T);

  /* schedule */
  route_schedule(cb->stream, f->topk_ids, f->topk_weights, TK, (int)E,
                 (int32_t *)(base + o_ids), c->count, c->row_start,
                 c->tile_off, c->slot, c->src, c->row_w, cb->status);
  if ((rc = launched(err, "schedule")))
    goto fail;
  route_gather(cb->stream, grid_for(cb, TK, 16), c->x, c->src, c->row_start + E, (int)K, H,
               c->xr, NULL, NULL);
  if ((rc = launched(err, "dispatch")))
    goto fail;
  if ((rc = mlp_forward(cb, &routed_mlp, c->xr, H, c->y, err)))
    goto fail;
  if (Is && (rc = mlp_forward(cb, &shared_mlp, c->x, H, ys, err)))
    goto fail;
  route_combine_out(cb->stream, grid_for(cb, T, 16), c->y, c->slot, f->topk_weights, ys, T,
                    (int)K, H, (bf16 *)f->out);
  if ((rc = launched(err, "combine")))
    goto fail;
  if (train)
    *out_ctx = &c->hdr;
  else
    ctx_release(cb, c);
  return 0;
fail:
  ctx_release(cb, c);
  return rc;
}

/* ---- backward ------------------------------------------------------------ */

static int cuda_backward(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode,
                         const mokk_bwd_rank *ranks, char *err)
{
  cuda_backend *cb = (cuda_backend *)b;
  cuda_ctx *c = (cuda_ctx *)ctx;
  const mokk_shape *s = &ctx->shape;
  const mokk_bwd_rank *r = &ranks[0];
  int64_t T = ctx->T, H = s->H, I = s->I, K = s->K, Is = s->I_s, TK = T * K, E = s->E;
  int accum = mode == MOKK_GRAD_FP32_ACCUM, rc = 0;
  size_t off = 0, o_dor, o_dy, o_dgu, o_dxr, o_dgus = 0, o_dxs = 0;
  void *block = NULL;

  if (c->g == NULL)
    return mokk_fail(err, MOK_ECONTEXT, "the forward kept no state for a backward");
  if (!aligned16(r->d_out) || !aligned16(r->d_x))
    return mokk_fail(err, MOK_EINVAL, "d_out and d_x must be 16-byte aligned");
  for (int w = 0; w < (Is ? MOKK_NWEIGHTS : MOKK_S_GATE); w++)
    if (!aligned16(r->w[w]))
      return mokk_fail(err, MOK_EINVAL, "weight %d is not 16-byte aligned", w);
  CK(cudaSetDevice(cb->device));

  o_dor = carve(&off, TK * H * 2);
  o_dy = carve(&off, TK * H * 2);
  o_dgu = carve(&off, TK * 2 * I * 2);
  o_dxr = carve(&off, TK * H * 4);
  if (Is) {
    o_dgus = carve(&off, T * 2 * Is * 2);
    o_dxs = carve(&off, T * H * 4);
  }
  cudaError_t e = cudaMallocAsync(&block, off, cb->stream);
  if (e != cudaSuccess)
    return mokk_fail(err, MOK_ENOMEM, "cannot allocate %zu bytes of GPU memory for the "
                     "backward: %s", off, cudaGetErrorString(e));
  char *base = (char *)block;
  bf16 *dor = (bf16 *)(base + o_dor), *dy = (bf16 *)(base + o_dy);
  bf16 *dgu = (bf16 *)(base + o_dgu);
  float *dxr = (float *)(base + o_dxr);
  bf16 *dgus = Is ? (bf16 *)(base + o_dgus) : NULL;
  float *dxs = Is ? (float *)(base + o_dxs) : NULL;
  const bf16 *d_out = (const bf16 *)r->d_out;
  mlp routed_mlp = mlp_routed(c, TK), shared_mlp = mlp_shared(c, T);
  if (r->w[MOKK_W_GATE] != NULL) { /* the weights moved since the forward */
    routed_mlp.wg = (const bf16 *)r->w[MOKK_W_GATE];
    routed_mlp.wu = (const bf16 *)r->w[MOKK_W_UP];
    routed_mlp.wd = (const bf16 *)r->w[MOKK_W_DOWN];
    shared_mlp.wg = (const bf16 *)r->w[MOKK_S_GATE];
    shared_mlp.wu = (const bf16 *)r->w[MOKK_S_UP];
    shared_mlp.wd = (const bf16 *)r->w[MOKK_S_DOWN];
  }

  route_gather(cb->stream, grid_for(cb, TK, 16), d_out, c->src, c->row_start + E, (int)K, H,
               dor, c->row_w, dy);
  if ((rc = launched(err, "backward dispatch")))
    goto out;
  route_dtw(cb->stream, grid_for(cb, (TK + 7) / 8, 16), d_out, c->y, c->slot, TK, (int)K, H,
            r->d_topk_weights);
  if ((rc = launched(err, "d_topk_weights")))
    goto out;
  if ((rc = mlp_backward(cb, &routed_mlp, dor, c->row_w, H, dgu, dxr, err)))
    goto out;
  if (Is && (rc = mlp_backward(cb, &shared_mlp, d_out, NULL, H, dgus, dxs, err)))
    goto out;
  route_combine_dx(cb->stream, grid_for(cb, T, 16), dxr, c->slot, dxs, T, (int)K, H,
                   (bf16 *)r->d_x);
  if ((rc = launched(err, "d_x combine")))
    goto out;

  /* weight gradients: sums over rows, in row order, one block per tile */
  for (int part = 0; part < (Is ? 4 : 2); part++) {
    int shared = part >= 2, down = part & 1;
    int wa = shared ? (down ? MOKK_S_DOWN : MOKK_S_GATE) : (down ? MOKK_W_DOWN : MOKK_W_GATE);
    int64_t Ie = shared ? Is : I;
    gemm_args a = shared ? dense(c, T) : routed(c, TK);
    if (shared) {
      a.M = 0;
      a.K = (int)T;
    } else {
      a.count = c->count;
      a.row_start = c->row_start;
    }
    a.accum = accum;
    void *g1 = accum ? (void *)r->g_f32[wa] : (void *)r->g_bf16[wa];
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
      a.B = shared ? c->x : c->xr;
      a.ldb = H;
      a.M = (int)(2 * Ie);
      a.N = (int)H;
      a.C = g1;
      a.C2 = accum ? (void *)r->g_f32[wa + 1] : (void *)r->g_bf16[wa + 1];
      a.split = Ie;
      a.ldc = H;
      a.c_stride = Ie * H;
    }
    if ((rc = gemm<L_TN, E_WGRAD>(cb, &a, shared ? T : TK, err, "weight-gradient GEMM")))
      goto out;
  }
out:
  cudaFreeAsync(block, cb->stream);
  return rc;
}

/* ---- entries for the backend's table (cuda_backend.cu) ------------------ */

int cuda_forward_entry(mokk_backend *b, const mokk_shape *s, int64_t T,
                       const mokk_fwd_rank *ranks, mokk_ctx **out_ctx, char *err)
{
  return cuda_forward(b, s, T, ranks, out_ctx, err);
}

int cuda_backward_entry(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode,
                        const mokk_bwd_rank *ranks, char *err)
{
  return cuda_backward(b, ctx, mode, ranks, err);
}
