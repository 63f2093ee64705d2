/* cpu_moe.c - the CPU reference engine: DESIGN §1 computed exactly as
 * specified, for P virtual EP ranks in one process. Rows travel the way a real
 * dispatch/combine moves them (into the owner's receive buffer, back into the
 * source's per-pair buffer), so a P-rank step is bitwise the P = 1 step: every
 * value is a function of its own row and the weights, with the fixed orders of
 * ops.h. Work is cut into tiles that own their outputs; the pool may run them
 * in any order on any thread. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend_impl.h"
#include "bf16.h"
#include "ops.h"
#include "pool.h"
#include "swiglu.h"

#define ROW_BLOCK 32
#define COL_BLOCK 64
#define OUT_BLOCK 16
#define TOK_BLOCK 64

typedef struct cpu_backend {
  mokk_backend base;
  mokc_pool *pool;
} cpu_backend;

typedef struct cpu_ctx {
  mokk_ctx hdr;
  mokk_plan plan;
  const uint16_t *(*w)[MOKK_NWEIGHTS]; /* [P] */
  uint16_t *xr;   /* [rows, H] dispatched token rows, owners back to back */
  float *g, *u;   /* [rows, I] gate and up before the clamp */
  uint16_t *h;    /* [rows, I] */
  uint16_t *y;    /* [P*T*K, H] expert output of each pair (combine buffer) */
  float *tw;      /* [P*T*K] router weights */
  uint16_t *xs;   /* [P*T, H] tokens, for the shared expert */
  float *gs, *us; /* [P*T, I_s] */
  uint16_t *hs;   /* [P*T, I_s] */
  size_t bytes;
} cpu_ctx;

/* A tile: rows [q0, q0 + n) of one segment times columns [c0, c1). An expert
 * segment lives in the receive buffers (e >= 0); the shared expert's segment
 * is rank p's T tokens (e = -1). */
typedef struct tile {
  int64_t q0, n, c0, c1;
  int64_t e, p;
} tile;

typedef struct step {
  const mokk_shape *s;
  int64_t T, El, pairs, rows, tokens;
  cpu_ctx *c;
  const mokk_fwd_rank *fr;
  const mokk_bwd_rank *br;
  mokk_grad_mode mode;
  tile *tiles;
  int64_t ntiles;
  uint16_t *ys;    /* forward: [P*T, H] shared expert output */
  float *dy;       /* backward: [rows, H] */
  float *dg, *du;  /* backward: [rows, I] */
  float *dxp;      /* backward: [P*T*K, H] d_x part of each pair */
  float *dos;      /* backward: [P*T, H] d_out in fp32 */
  float *dgs, *dus;/* backward: [P*T, I_s] */
  float *dxs;      /* backward: [P*T, H] */
  atomic_int failed; /* a task could not get scratch memory */
} step;

static const mokk_backend_iface cpu_iface;

static void *xmalloc(size_t n, size_t size, size_t *acct)
{
  if (n == 0)
    n = 1;
  if (acct != NULL)
    *acct += n * size;
  return malloc(n * size);
}

/* ---- tiling -------------------------------------------------------------- */

static int tiles_for_experts(step *st, int64_t ncols, int64_t col_block)
{
  const mokk_plan *pl = &st->c->plan;
  int64_t n = 0, cb = (ncols + col_block - 1) / col_block;

  for (int pass = 0; pass < 2; pass++) {
    n = 0;
    for (int64_t e = 0; e < pl->E; e++) {
      int64_t p = e / pl->E_local, rows = pl->seg_rows[e];
      int64_t base = pl->recv_base[p] + pl->seg_start[e];
      for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK)
        for (int64_t j = 0; j < cb; j++, n++)
          if (pass == 1)
            st->tiles[n] = (tile){base + r0, rows - r0 < ROW_BLOCK ? rows - r0 : ROW_BLOCK,
                                  j * col_block,
                                  (j + 1) * col_block < ncols ? (j + 1) * col_block : ncols,
                                  e, p};
    }
    if (pass == 0) {
      free(st->tiles);
      st->tiles = malloc((size_t)(n ? n : 1) * sizeof(tile));
      if (st->tiles == NULL)
        return -1;
    }
  }
  st->ntiles = n;
  return 0;
}

static int tiles_for_shared(step *st, int64_t ncols, int64_t col_block)
{
  int64_t n = 0, cb = (ncols + col_block - 1) / col_block, P = st->s->P, T = st->T;

  free(st->tiles);
  st->tiles = malloc((size_t)(P * ((T + ROW_BLOCK - 1) / ROW_BLOCK) * cb) * sizeof(tile));
  if (st->tiles == NULL)
    return -1;
  for (int64_t p = 0; p < P; p++)
    for (int64_t r0 = 0; r0 < T; r0 += ROW_BLOCK)
      for (int64_t j = 0; j < cb; j++)
        st->tiles[n++] = (tile){p * T + r0, T - r0 < ROW_BLOCK ? T - r0 : ROW_BLOCK,
                                j * col_block,
                                (j + 1) * col_block < ncols ? (j + 1) * col_block : ncols,
                                -1, p};
  st->ntiles = n;
  return 0;
}

/* weight matrix `which` of the tile's expert (rows of out x in) */
/* The weight a tile reads: where the backward says it is now, else where
 * the forward read it. */
static const uint16_t *tile_weight(const step *st, const tile *t, int which)
{
  const mokk_shape *s = st->s;
  const uint16_t *w = st->br != NULL && st->br[t->p].w[which] != NULL
                          ? st->br[t->p].w[which]
                          : st->c->w[t->p][which];
  if (t->e < 0)
    return w;
  return w + (t->e - t->p * st->El) * s->I * s->H;
}

/* end of row block blk of TOK_BLOCK rows out of n */
static int64_t block_end(int64_t blk, int64_t n)
{
  return (blk + 1) * TOK_BLOCK < n ? (blk + 1) * TOK_BLOCK : n;
}

/* ---- forward ------------------------------------------------------------- */

static void fwd_dispatch(void *arg, int64_t blk)
{
  step *st = arg;
  cpu_ctx *c = st->c;
  int64_t H = st->s->H, K = st->s->K, TK = st->T * K;
  int64_t q1 = block_end(blk, st->rows);

  for (int64_t q = blk * TOK_BLOCK; q < q1; q++) {
    int64_t gp = c->plan.src[q], r = gp / TK, i = gp % TK;
    memcpy(c->xr + q * H, st->fr[r].x + (i / K) * H, (size_t)H * sizeof(uint16_t));
    c->tw[gp] = st->fr[r].topk_weights[i];
  }
}

/* g, u tiles and the SwiGLU epilogue: h = bf16(silu(g') * u') */
static void fwd_gate_up(void *arg, int64_t ti)
{
  step *st = arg;
  const tile *t = &st->tiles[ti];
  const mokk_shape *s = st->s;
  int shared = t->e < 0;
  int64_t I = shared ? s->I_s : s->I, H = s->H, nc = t->c1 - t->c0;
  const uint16_t *A = shared ? st->c->xs + t->q0 * H : st->c->xr + t->q0 * H;
  const uint16_t *wg = tile_weight(st, t, shared ? MOKK_S_GATE : MOKK_W_GATE) + t->c0 * H;
  const uint16_t *wu = tile_weight(st, t, shared ? MOKK_S_UP : MOKK_W_UP) + t->c0 * H;
  float *g = (shared ? st->c->gs : st->c->g) + t->q0 * I + t->c0;
  float *u = (shared ? st->c->us : st->c->u) + t->q0 * I + t->c0;
  uint16_t *h = (shared ? st->c->hs : st->c->h) + t->q0 * I + t->c0;
  float L = s->swiglu_limit;

  mokc_gemm_nt(A, H, wg, H, t->n, nc, H, g, I);
  mokc_gemm_nt(A, H, wu, H, t->n, nc, H, u, I);
  for (int64_t m = 0; m < t->n; m++)
    for (int64_t j = 0; j < nc; j++)
      h[m * I + j] = mokk_f32_to_bf16(mokk_swiglu(g[m * I + j], u[m * I + j], L));
}

/* y = bf16(h . w_down^T); expert rows go straight to their pair's slot */
static void fwd_down(void *arg, int64_t ti)
{
  step *st = arg;
  const tile *t = &st->tiles[ti];
  const mokk_shape *s = st->s;
  int shared = t->e < 0;
  int64_t I = shared ? s->I_s : s->I, H = s->H, nc = t->c1 - t->c0;
  const uint16_t *A = (shared ? st->c->hs : st->c->h) + t->q0 * I;
  const uint16_t *wd = tile_weight(st, t, shared ? MOKK_S_DOWN : MOKK_W_DOWN) + t->c0 * I;
  float acc[ROW_BLOCK * COL_BLOCK];

  mokc_gemm_nt(A, I, wd, I, t->n, nc, I, acc, nc);
  for (int64_t m = 0; m < t->n; m++) {
    uint16_t *dst = shared ? st->ys + (t->q0 + m) * H
                           : st->c->y + st->c->plan.src[t->q0 + m] * H;
    for (int64_t j = 0; j < nc; j++)
      dst[t->c0 + j] = mokk_f32_to_bf16(acc[m * nc + j]);
  }
}

/* out[t] = bf16(sum_k w * y[t, k] (k ascending, routed pairs only) + ys[t]).
 * A pair with no route gets a zero y row, which the backward's
 * d_topk_weights reads. */
static void fwd_combine(void *arg, int64_t blk)
{
  step *st = arg;
  const mokk_shape *s = st->s;
  const int64_t *slot = st->c->plan.slot;
  int64_t H = s->H, K = s->K, T = st->T;
  int64_t g1 = block_end(blk, st->tokens);

  for (int64_t gt = blk * TOK_BLOCK; gt < g1; gt++) {
    int64_t r = gt / T, t = gt % T;
    uint16_t *out = st->fr[r].out + t * H;
    for (int64_t k = 0; k < K; k++)
      if (slot[gt * K + k] < 0)
        memset(st->c->y + (gt * K + k) * H, 0, (size_t)H * sizeof(uint16_t));
    for (int64_t j = 0; j < H; j++) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; k++) {
        int64_t gp = gt * K + k;
        if (slot[gp] >= 0)
          acc += st->c->tw[gp] * mokk_bf16_to_f32(st->c->y[gp * H + j]);
      }
      if (s->I_s > 0)
        acc += mokk_bf16_to_f32(st->ys[gt * H + j]);
      out[j] = mokk_f32_to_bf16(acc);
    }
  }
}

static void copy_tokens(void *arg, int64_t r)
{
  step *st = arg;
  memcpy(st->c->xs + r * st->T * st->s->H, st->fr[r].x,
         (size_t)(st->T * st->s->H) * sizeof(uint16_t));
}

static void ctx_destroy(cpu_ctx *c)
{
  if (c == NULL)
    return;
  mokk_plan_free(&c->plan);
  free(c->w);
  free(c->xr);
  free(c->g);
  free(c->u);
  free(c->h);
  free(c->y);
  free(c->tw);
  free(c->xs);
  free(c->gs);
  free(c->us);
  free(c->hs);
  free(c);
}

static int64_t blocks(int64_t n, int64_t b)
{
  return (n + b - 1) / b;
}

/* Every rank of a step runs here: another backend of this kind holds no
 * part of it. */
static int cpu_rank_here(const mokk_backend *b, int64_t r, const mokk_backend *dev, char *err)
{
  if (dev != NULL && dev != b)
    return mokk_fail(err, MOK_ENOTSUP, "EP rank %lld names another backend to run on; the "
                     "cpu backend runs every rank of a step itself (leave dev NULL)",
                     (long long)r);
  return 0;
}

static int cpu_forward(mokk_backend *b, const mokk_shape *s, int64_t T,
                       const mokk_fwd_rank *ranks, mokk_ctx **ctx_out, char *err)
{
  cpu_backend *cb = (cpu_backend *)b;
  step st = {.s = s, .T = T, .El = s->E / s->P, .fr = ranks};
  const int32_t **ids;
  cpu_ctx *c;
  int rc;

  for (int64_t r = 0; r < s->P; r++)
    if ((rc = cpu_rank_here(b, r, ranks[r].dev, err)))
      return rc;
  c = calloc(1, sizeof *c);
  ids = malloc((size_t)s->P * sizeof *ids);
  if (c == NULL || ids == NULL) {
    free(c);
    free(ids);
    return mokk_fail(err, MOK_ENOMEM, "out of memory for a forward context");
  }
  for (int64_t r = 0; r < s->P; r++)
    ids[r] = ranks[r].topk_ids;
  rc = mokk_plan_build(&c->plan, s, T, ids, err);
  free(ids);
  if (rc) {
    free(c);
    return rc;
  }
  c->hdr.shape = *s;
  c->hdr.T = T;
  st.c = c;
  st.pairs = s->P * T * s->K;
  st.rows = c->plan.recv_base[s->P];
  st.tokens = s->P * T;

  c->w = xmalloc((size_t)s->P, sizeof *c->w, NULL);
  c->xr = xmalloc((size_t)(st.rows * s->H), sizeof(uint16_t), &c->bytes);
  c->g = xmalloc((size_t)(st.rows * s->I), sizeof(float), &c->bytes);
  c->u = xmalloc((size_t)(st.rows * s->I), sizeof(float), &c->bytes);
  c->h = xmalloc((size_t)(st.rows * s->I), sizeof(uint16_t), &c->bytes);
  c->y = xmalloc((size_t)(st.pairs * s->H), sizeof(uint16_t), &c->bytes);
  c->tw = xmalloc((size_t)st.pairs, sizeof(float), &c->bytes);
  if (s->I_s > 0) {
    c->xs = xmalloc((size_t)(st.tokens * s->H), sizeof(uint16_t), &c->bytes);
    c->gs = xmalloc((size_t)(st.tokens * s->I_s), sizeof(float), &c->bytes);
    c->us = xmalloc((size_t)(st.tokens * s->I_s), sizeof(float), &c->bytes);
    c->hs = xmalloc((size_t)(st.tokens * s->I_s), sizeof(uint16_t), &c->bytes);
    st.ys = xmalloc((size_t)(st.tokens * s->H), sizeof(uint16_t), NULL);
  }
  if (!c->w || !c->xr || !c->g || !c->u || !c->h || !c->y || !c->tw ||
      (s->I_s > 0 && (!c->xs || !c->gs || !c->us || !c->hs || !st.ys))) {
    rc = mokk_fail(err, MOK_ENOMEM, "out of memory for %lld routed rows of H = %lld",
                   (long long)st.rows, (long long)s->H);
    goto out;
  }
  for (int64_t r = 0; r < s->P; r++)
    memcpy(c->w[r], ranks[r].w, sizeof c->w[r]);

  mokc_pool_run(cb->pool, blocks(st.rows, TOK_BLOCK), fwd_dispatch, &st);
  if (tiles_for_experts(&st, s->I, COL_BLOCK)) goto nomem;
  mokc_pool_run(cb->pool, st.ntiles, fwd_gate_up, &st);
  if (tiles_for_experts(&st, s->H, COL_BLOCK)) goto nomem;
  mokc_pool_run(cb->pool, st.ntiles, fwd_down, &st);
  if (s->I_s > 0) {
    mokc_pool_run(cb->pool, s->P, copy_tokens, &st);
    if (tiles_for_shared(&st, s->I_s, COL_BLOCK)) goto nomem;
    mokc_pool_run(cb->pool, st.ntiles, fwd_gate_up, &st);
    if (tiles_for_shared(&st, s->H, COL_BLOCK)) goto nomem;
    mokc_pool_run(cb->pool, st.ntiles, fwd_down, &st);
  }
  mokc_pool_run(cb->pool, blocks(st.tokens, TOK_BLOCK), fwd_combine, &st);
  rc = 0;
  goto out;

nomem:
  rc = mokk_fail(err, MOK_ENOMEM, "out of memory for the forward's work list");
out:
  free(st.tiles);
  free(st.ys);
  if (rc == 0 && ctx_out != NULL)
    *ctx_out = &c->hdr;
  else
    ctx_destroy(c);
  return rc;
}

/* ---- backward ------------------------------------------------------------ */

/* d_topk_weights[t, k] = dot(d_out[t], y[t, k]); 0 for a pair with no route */
static void bwd_dtw(void *arg, int64_t blk)
{
  step *st = arg;
  int64_t H = st->s->H, K = st->s->K, T = st->T;
  int64_t g1 = block_end(blk, st->tokens);

  for (int64_t gt = blk * TOK_BLOCK; gt < g1; gt++) {
    int64_t r = gt / T, t = gt % T;
    float *dtw = st->br[r].d_topk_weights + t * K;
    mokc_gemm_nt(st->br[r].d_out + t * H, H, st->c->y + gt * K * H, H, 1, K, H, dtw, K);
    for (int64_t k = 0; k < K; k++)
      if (st->c->plan.slot[gt * K + k] < 0)
        dtw[k] = 0.0f;
  }
}

/* the dispatch of d_out: dy = w * d_out, per routed row */
static void bwd_dispatch(void *arg, int64_t blk)
{
  step *st = arg;
  const cpu_ctx *c = st->c;
  int64_t H = st->s->H, K = st->s->K, TK = st->T * K;
  int64_t q1 = block_end(blk, st->rows);

  for (int64_t q = blk * TOK_BLOCK; q < q1; q++) {
    int64_t gp = c->plan.src[q], r = gp / TK, t = (gp % TK) / K;
    const uint16_t *d = st->br[r].d_out + t * H;
    float w = c->tw[gp];
    for (int64_t j = 0; j < H; j++)
      st->dy[q * H + j] = w * mokk_bf16_to_f32(d[j]);
  }
}

/* d_h = dy . w_down, then the SwiGLU derivative into d_g, d_u */
static void bwd_swiglu(void *arg, int64_t ti)
{
  step *st = arg;
  const tile *t = &st->tiles[ti];
  const mokk_shape *s = st->s;
  const cpu_ctx *c = st->c;
  int shared = t->e < 0;
  int64_t I = shared ? s->I_s : s->I, H = s->H;
  const float *dy = (shared ? st->dos : st->dy) + t->q0 * H;
  const uint16_t *wd = tile_weight(st, t, shared ? MOKK_S_DOWN : MOKK_W_DOWN);
  const float *g = (shared ? c->gs : c->g) + t->q0 * I;
  const float *u = (shared ? c->us : c->u) + t->q0 * I;
  float *dg = (shared ? st->dgs : st->dg) + t->q0 * I;
  float *du = (shared ? st->dus : st->du) + t->q0 * I;
  float L = s->swiglu_limit;

  /* d_h lands in dg, then is turned into d_g / d_u in place */
  mokc_gemm_axpy(dy, H, wd, I, t->n, H, t->c0, t->c1, dg + t->c0, I);
  for (int64_t m = 0; m < t->n; m++)
    for (int64_t j = t->c0; j < t->c1; j++) {
      float gr = g[m * I + j], ur = u[m * I + j], dh = dg[m * I + j];
      mokk_swiglu_grads(gr, ur, dh, L, &dg[m * I + j], &du[m * I + j]);
    }
}

/* d_x part of a row: d_g . w_gate + d_u . w_up; expert rows go back to their
 * pair (the combine of the backward), shared rows to dxs */
static void bwd_dx(void *arg, int64_t ti)
{
  step *st = arg;
  const tile *t = &st->tiles[ti];
  const mokk_shape *s = st->s;
  int shared = t->e < 0;
  int64_t I = shared ? s->I_s : s->I, H = s->H, nc = t->c1 - t->c0;
  const float *dg = (shared ? st->dgs : st->dg) + t->q0 * I;
  const float *du = (shared ? st->dus : st->du) + t->q0 * I;
  const uint16_t *wg = tile_weight(st, t, shared ? MOKK_S_GATE : MOKK_W_GATE);
  const uint16_t *wu = tile_weight(st, t, shared ? MOKK_S_UP : MOKK_W_UP);
  float a[ROW_BLOCK * COL_BLOCK], b[ROW_BLOCK * COL_BLOCK];

  mokc_gemm_axpy(dg, I, wg, H, t->n, I, t->c0, t->c1, a, nc);
  mokc_gemm_axpy(du, I, wu, H, t->n, I, t->c0, t->c1, b, nc);
  for (int64_t m = 0; m < t->n; m++) {
    float *dst = shared ? st->dxs + (t->q0 + m) * H
                        : st->dxp + st->c->plan.src[t->q0 + m] * H;
    for (int64_t j = 0; j < nc; j++)
      dst[t->c0 + j] = a[m * nc + j] + b[m * nc + j];
  }
}

/* d_x[t] = bf16(sum_k dxp[t, k] (k ascending, routed pairs only) + dxs[t]) */
static void bwd_combine(void *arg, int64_t blk)
{
  step *st = arg;
  const mokk_shape *s = st->s;
  const int64_t *slot = st->c->plan.slot;
  int64_t H = s->H, K = s->K, T = st->T;
  int64_t g1 = block_end(blk, st->tokens);

  for (int64_t gt = blk * TOK_BLOCK; gt < g1; gt++) {
    uint16_t *dx = st->br[gt / T].d_x + (gt % T) * H;
    for (int64_t j = 0; j < H; j++) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; k++)
        if (slot[gt * K + k] >= 0)
          acc += st->dxp[(gt * K + k) * H + j];
      if (s->I_s > 0)
        acc += st->dxs[gt * H + j];
      dx[j] = mokk_f32_to_bf16(acc);
    }
  }
}

static void to_f32_rows(void *arg, int64_t blk)
{
  step *st = arg;
  int64_t H = st->s->H, T = st->T;
  int64_t g1 = block_end(blk, st->tokens);

  for (int64_t gt = blk * TOK_BLOCK; gt < g1; gt++) {
    const uint16_t *d = st->br[gt / T].d_out + (gt % T) * H;
    for (int64_t j = 0; j < H; j++)
      st->dos[gt * H + j] = mokk_bf16_to_f32(d[j]);
  }
}

/* One weight-gradient task: output rows [o0, o1) of gradient `which` of one
 * expert (e >= 0) or of the shared expert (e = -1, written for every rank). */
typedef struct wtask {
  int which;
  int64_t e, o0, o1;
} wtask;

typedef struct wjob {
  step *st;
  wtask *t;
} wjob;

static void store_grad(const step *st, int64_t p, int which, int64_t off, const float *G,
                       int64_t n)
{
  if (st->mode == MOKK_GRAD_BF16) {
    uint16_t *d = st->br[p].g_bf16[which] + off;
    for (int64_t i = 0; i < n; i++)
      d[i] = mokk_f32_to_bf16(G[i]);
  } else {
    float *d = st->br[p].g_f32[which] + off;
    for (int64_t i = 0; i < n; i++)
      d[i] += G[i];
  }
}

static void bwd_wgrad(void *arg, int64_t i)
{
  wjob *job = arg;
  step *st = job->st;
  const wtask *t = &job->t[i];
  const mokk_shape *s = st->s;
  const cpu_ctx *c = st->c;
  int64_t H = s->H, shared = t->e < 0;
  int64_t I = shared ? s->I_s : s->I;
  int64_t q0 = 0, R = st->tokens, p = 0, ld, Cn;
  const float *a;
  const uint16_t *b;
  float *G;

  if (!shared) {
    p = t->e / st->El;
    q0 = c->plan.recv_base[p] + c->plan.seg_start[t->e];
    R = c->plan.seg_rows[t->e];
  }
  switch (t->which) {
  case MOKK_W_GATE: case MOKK_S_GATE:
    a = (shared ? st->dgs : st->dg) + q0 * I, ld = I;
    b = (shared ? c->xs : c->xr) + q0 * H, Cn = H;
    break;
  case MOKK_W_UP: case MOKK_S_UP:
    a = (shared ? st->dus : st->du) + q0 * I, ld = I;
    b = (shared ? c->xs : c->xr) + q0 * H, Cn = H;
    break;
  default: /* down: [H, I] = dy^T h */
    a = (shared ? st->dos : st->dy) + q0 * H, ld = H;
    b = (shared ? c->hs : c->h) + q0 * I, Cn = I;
    break;
  }
  G = malloc((size_t)((t->o1 - t->o0) * Cn) * sizeof(float));
  if (G == NULL) {
    atomic_store(&st->failed, 1);
    return;
  }
  mokc_wgrad(a, ld, b, Cn, R, t->o0, t->o1, Cn, G, Cn);
  if (shared) {
    for (int64_t r = 0; r < s->P; r++)
      store_grad(st, r, t->which, t->o0 * Cn, G, (t->o1 - t->o0) * Cn);
  } else {
    int64_t el = t->e - p * st->El;
    store_grad(st, p, t->which, (el * (t->which == MOKK_W_DOWN ? H : I) + t->o0) * Cn,
               G, (t->o1 - t->o0) * Cn);
  }
  free(G);
}

static int run_wgrads(cpu_backend *cb, step *st)
{
  const mokk_shape *s = st->s;
  int64_t n = 0, cap;
  wtask *t;
  wjob job = {st, NULL};

  cap = s->E * (2 * blocks(s->I, OUT_BLOCK) + blocks(s->H, OUT_BLOCK)) +
        (s->I_s > 0 ? 2 * blocks(s->I_s, OUT_BLOCK) + blocks(s->H, OUT_BLOCK) : 0);
  t = malloc((size_t)cap * sizeof *t);
  if (t == NULL)
    return -1;
  for (int64_t e = -1; e < s->E; e++) {
    int64_t I = e < 0 ? s->I_s : s->I;
    int base = e < 0 ? MOKK_S_GATE : MOKK_W_GATE;
    if (e < 0 && s->I_s == 0)
      continue;
    for (int w = 0; w < 3; w++) {
      int64_t O = w == 2 ? s->H : I;
      for (int64_t o = 0; o < O; o += OUT_BLOCK)
        t[n++] = (wtask){base + w, e, o, o + OUT_BLOCK < O ? o + OUT_BLOCK : O};
    }
  }
  job.t = t;
  mokc_pool_run(cb->pool, n, bwd_wgrad, &job);
  free(t);
  return atomic_load(&st->failed) ? -1 : 0;
}

static int cpu_backward(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode, unsigned flags,
                        const mokk_bwd_rank *ranks, char *err)
{
  cpu_backend *cb = (cpu_backend *)b;
  cpu_ctx *c = (cpu_ctx *)ctx;
  const mokk_shape *s = &ctx->shape;
  step st = {.s = s, .T = ctx->T, .El = s->E / s->P, .c = c, .br = ranks, .mode = mode};
  int rc = 0;

  (void)flags; /* MOKK_BWD_LAST: the backward's own buffers are host memory */
  for (int64_t r = 0; r < s->P; r++)
    if ((rc = cpu_rank_here(b, r, ranks[r].dev, err)))
      return rc;

  st.pairs = s->P * ctx->T * s->K;
  st.rows = c->plan.recv_base[s->P];
  st.tokens = s->P * ctx->T;
  st.dy = xmalloc((size_t)(st.rows * s->H), sizeof(float), NULL);
  st.dg = xmalloc((size_t)(st.rows * s->I), sizeof(float), NULL);
  st.du = xmalloc((size_t)(st.rows * s->I), sizeof(float), NULL);
  st.dxp = xmalloc((size_t)(st.pairs * s->H), sizeof(float), NULL);
  if (s->I_s > 0) {
    st.dos = xmalloc((size_t)(st.tokens * s->H), sizeof(float), NULL);
    st.dgs = xmalloc((size_t)(st.tokens * s->I_s), sizeof(float), NULL);
    st.dus = xmalloc((size_t)(st.tokens * s->I_s), sizeof(float), NULL);
    st.dxs = xmalloc((size_t)(st.tokens * s->H), sizeof(float), NULL);
  }
  if (!st.dy || !st.dg || !st.du || !st.dxp ||
      (s->I_s > 0 && (!st.dos || !st.dgs || !st.dus || !st.dxs)))
    goto nomem;

  mokc_pool_run(cb->pool, blocks(st.tokens, TOK_BLOCK), bwd_dtw, &st);
  mokc_pool_run(cb->pool, blocks(st.rows, TOK_BLOCK), bwd_dispatch, &st);
  if (tiles_for_experts(&st, s->I, COL_BLOCK)) goto nomem;
  mokc_pool_run(cb->pool, st.ntiles, bwd_swiglu, &st);
  if (tiles_for_experts(&st, s->H, COL_BLOCK)) goto nomem;
  mokc_pool_run(cb->pool, st.ntiles, bwd_dx, &st);
  if (s->I_s > 0) {
    mokc_pool_run(cb->pool, blocks(st.tokens, TOK_BLOCK), to_f32_rows, &st);
    if (tiles_for_shared(&st, s->I_s, COL_BLOCK)) goto nomem;
    mokc_pool_run(cb->pool, st.ntiles, bwd_swiglu, &st);
    if (tiles_for_shared(&st, s->H, COL_BLOCK)) goto nomem;
    mokc_pool_run(cb->pool, st.ntiles, bwd_dx, &st);
  }
  mokc_pool_run(cb->pool, blocks(st.tokens, TOK_BLOCK), bwd_combine, &st);
  if (run_wgrads(cb, &st)) goto nomem;
  goto out;

nomem:
  rc = mokk_fail(err, MOK_ENOMEM, "out of memory for a backward of %lld routed rows",
                 (long long)st.rows);
out:
  free(st.tiles);
  free(st.dy);
  free(st.dg);
  free(st.du);
  free(st.dxp);
  free(st.dos);
  free(st.dgs);
  free(st.dus);
  free(st.dxs);
  return rc;
}

/* ---- backend ------------------------------------------------------------- */

static void cpu_ctx_free(mokk_backend *b, mokk_ctx *ctx)
{
  (void)b;
  ctx_destroy((cpu_ctx *)ctx);
}

static size_t cpu_ctx_bytes(const mokk_ctx *ctx)
{
  return ((const cpu_ctx *)ctx)->bytes;
}

static void cpu_destroy(mokk_backend *b)
{
  cpu_backend *cb = (cpu_backend *)b;
  mokc_pool_destroy(cb->pool);
  free(cb);
}

static const mokk_backend_iface cpu_iface = {
    .name = "cpu",
    .forward = cpu_forward,
    .backward = cpu_backward,
    .ctx_free = cpu_ctx_free,
    .ctx_bytes = cpu_ctx_bytes,
    .destroy = cpu_destroy,
};

int mokk_cpu_create(int threads, mokk_backend **out, char *err)
{
  cpu_backend *cb;

  if (out == NULL)
    return mokk_fail(err, MOK_ENULL, "backend out-pointer is NULL");
  *out = NULL;
  if (threads <= 0) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    threads = n > 0 ? (int)n : 1;
  }
  if (threads > 1024)
    return mokk_fail(err, MOK_EINVAL, "%d CPU threads asked; at most 1024", threads);
  cb = calloc(1, sizeof *cb);
  if (cb == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory for the CPU backend");
  cb->base.iface = &cpu_iface;
  cb->base.device = -1;
  if (mokc_pool_create(threads, &cb->pool) != 0) {
    free(cb);
    return mokk_fail(err, MOK_ENOMEM, "could not start %d CPU worker threads", threads);
  }
  *out = &cb->base;
  return 0;
}

int mokk_cpu_threads(const mokk_backend *b)
{
  return b->iface == &cpu_iface ? mokc_pool_threads(((const cpu_backend *)b)->pool) : 0;
}
