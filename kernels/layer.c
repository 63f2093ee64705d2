/* layer.c - shape and argument validation, and the routing plan every backend
 * follows: counting sort of (token, k) pairs into expert segments, stable in
 * global token order, laid out per owner rank the way a dispatch delivers it. */
#include "layer.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mok.h"

/* libmok's public weight order and gradient modes are these, by value */
_Static_assert(MOK_W_GATE == (int)MOKK_W_GATE && MOK_W_UP == (int)MOKK_W_UP &&
                   MOK_W_DOWN == (int)MOKK_W_DOWN && MOK_S_GATE == (int)MOKK_S_GATE &&
                   MOK_S_UP == (int)MOKK_S_UP && MOK_S_DOWN == (int)MOKK_S_DOWN &&
                   MOK_NWEIGHTS == (int)MOKK_NWEIGHTS,
               "mok.h and layer.h order the weights differently");
_Static_assert(MOK_GRAD_BF16 == (int)MOKK_GRAD_BF16 &&
                   MOK_GRAD_FP32_ACCUM == (int)MOKK_GRAD_FP32_ACCUM,
               "mok.h and layer.h number the gradient modes differently");
_Static_assert(MOK_TILES_COUNT == (int)MOKK_TILES_COUNT && MOK_TILES_TALL == (int)MOKK_TILES_TALL &&
                   MOK_TILES_PINGPONG == (int)MOKK_TILES_PINGPONG &&
                   MOK_CLUSTERS_COUNT == (int)MOKK_CLUSTERS_COUNT &&
                   MOK_CLUSTERS_ALL == (int)MOKK_CLUSTERS_ALL &&
                   MOK_ORDER_COUNT == (int)MOKK_ORDER_COUNT &&
                   MOK_ORDER_STATIC == (int)MOKK_ORDER_STATIC &&
                   MOK_TAILS_COUNT == (int)MOKK_TAILS_COUNT &&
                   MOK_TAILS_WHOLE == (int)MOKK_TAILS_WHOLE && MOK_DX_COUNT == (int)MOKK_DX_COUNT &&
                   MOK_DX_WHOLE == (int)MOKK_DX_WHOLE &&
                   MOK_DISPATCH_BEFORE == MOKK_DISPATCH_BEFORE &&
                   MOK_DISPATCH_GATHER == MOKK_DISPATCH_GATHER &&
                   MOK_DISPATCH_BLOCKS_MAX == MOKK_DISPATCH_BLOCKS_MAX,
               "mok.h and layer.h number the kernel options differently");

int mokk_fail(char *err, int code, const char *fmt, ...)
{
  if (err != NULL) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, MOK_ERRLEN, fmt, ap);
    va_end(ap);
  }
  return code;
}

/* a * b * c ... with overflow detection; every factor is already >= 0. */
static int mul3(int64_t a, int64_t b, int64_t c, int64_t *out)
{
  int64_t ab;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, out))
    return -1;
  return 0;
}

static int check_dim(const char *name, int64_t v, int64_t min, char *err)
{
  if (v < min) {
    if (min == 1 && v == 0)
      return mokk_fail(err, MOK_EZEROSIZE, "%s is 0; it must be at least 1", name);
    return mokk_fail(err, MOK_EINVAL, "%s is %lld; it must be at least %lld", name,
                     (long long)v, (long long)min);
  }
  if (v > MOKK_DIM_MAX)
    return mokk_fail(err, MOK_EOVERFLOW, "%s is %lld; the largest supported is %d",
                     name, (long long)v, MOKK_DIM_MAX);
  return 0;
}

static int check_choice(const char *name, int v, int count, char *err)
{
  if (v < 0 || v >= count)
    return mokk_fail(err, MOK_EINVAL, "tuning: %s is %d; it must be 0 (the default) to %d",
                     name, v, count - 1);
  return 0;
}

int mokk_tuning_check(const mokk_tuning *t, char *err)
{
  int rc;
  if (t == NULL)
    return mokk_fail(err, MOK_ENULL, "tuning is NULL");
  if ((rc = check_choice("tiles", t->tiles, MOKK_TILES_COUNT, err)) ||
      (rc = check_choice("wgrad_tiles", t->wgrad_tiles, MOKK_TILES_COUNT, err)) ||
      (rc = check_choice("clusters", t->clusters, MOKK_CLUSTERS_COUNT, err)) ||
      (rc = check_choice("order", t->order, MOKK_ORDER_COUNT, err)) ||
      (rc = check_choice("tails", t->tails, MOKK_TAILS_COUNT, err)) ||
      (rc = check_choice("dx", t->dx, MOKK_DX_COUNT, err)))
    return rc;
  if (t->wgrad_tiles == MOKK_TILES_TALL)
    return mokk_fail(err, MOK_EINVAL, "tuning: wgrad_tiles cannot be tall (%d): weight "
                     "gradients take wide or ping-pong tiles", MOKK_TILES_TALL);
  if (t->dispatch_blocks < MOKK_DISPATCH_GATHER || t->dispatch_blocks > MOKK_DISPATCH_BLOCKS_MAX)
    return mokk_fail(err, MOK_EINVAL, "tuning: dispatch_blocks is %d; it must be 0 (the "
                     "default), %d (before gate/up), %d (gate/up gathers its rows) or 1 to %d "
                     "blocks beside it", t->dispatch_blocks, MOKK_DISPATCH_BEFORE,
                     MOKK_DISPATCH_GATHER, MOKK_DISPATCH_BLOCKS_MAX);
  return 0;
}

int mokk_shape_check(const mokk_shape *s, char *err)
{
  int rc;
  int64_t n;

  if (s == NULL)
    return mokk_fail(err, MOK_ENULL, "layer shape is NULL");
  if ((rc = check_dim("H", s->H, 1, err)) || (rc = check_dim("I", s->I, 1, err)) ||
      (rc = check_dim("E", s->E, 1, err)) || (rc = check_dim("K", s->K, 1, err)) ||
      (rc = check_dim("P", s->P, 1, err)) || (rc = check_dim("I_s", s->I_s, 0, err)))
    return rc;
  if (s->K > s->E)
    return mokk_fail(err, MOK_ESHAPE, "K = %lld is larger than E = %lld",
                     (long long)s->K, (long long)s->E);
  if (s->E % s->P != 0)
    return mokk_fail(err, MOK_EEPSIZE,
                     "E = %lld experts do not divide over P = %lld EP ranks",
                     (long long)s->E, (long long)s->P);
  if (!isfinite(s->swiglu_limit) || s->swiglu_limit < 0.0f)
    return mokk_fail(err, MOK_EINVAL,
                     "swiglu_limit is %g; it must be finite and >= 0 (0 = off)",
                     (double)s->swiglu_limit);
  /* weights of one rank, in bytes, must be addressable */
  if (mul3(s->E / s->P, s->I, s->H, &n) || n > INT64_MAX / 8 ||
      mul3(s->I_s, s->H, 8, &n))
    return mokk_fail(err, MOK_EOVERFLOW,
                     "weight size E/P * I * H overflows the supported range");
  return mokk_tuning_check(&s->tune, err);
}

int64_t mokk_weight_elems(const mokk_shape *s, int which)
{
  switch (which) {
  case MOKK_W_GATE:
  case MOKK_W_UP:
  case MOKK_W_DOWN:
    return s->E / s->P * s->I * s->H;
  case MOKK_S_GATE:
  case MOKK_S_UP:
  case MOKK_S_DOWN:
    return s->I_s * s->H;
  }
  return 0;
}

uint64_t mokk_ctx_bytes_bound(const mokk_shape *s, int64_t T)
{
  typedef unsigned __int128 u128;
  /* the layouts of cpu_moe.c and cuda_moe.cu: bf16 x, h, y and fp32 g, u per
   * pair with at most 28 bytes of its routing; bf16 x, h, ys and fp32 gs, us
   * per token; int64 plan arrays per expert; 256-byte alignment slop */
  u128 tokens = (uint64_t)(s->P * T), pairs = tokens * (uint64_t)s->K;
  u128 b = pairs * (uint64_t)(4 * s->H + 10 * s->I + 28) +
           tokens * (uint64_t)(4 * s->H + 10 * s->I_s) +
           (u128)(uint64_t)((3 + s->P) * s->E + 2 * s->P + 2) * 8 + 16 * 256;
  return b > UINT64_MAX ? UINT64_MAX : (uint64_t)b;
}

uint64_t mokk_ctx_bytes_bound_spread(const mokk_shape *s, int64_t T)
{
  typedef unsigned __int128 u128;
  /* a rank's buffer set (cuda_moe.cu, spread_forward) holds what one rank
   * running the whole step would, but for ys and the copies of every rank's
   * x, which the slack of the shared bound covers (4 bytes a pair, 2 H a
   * token, 8 P + 16 a expert), and up to 19 carves of 256-byte alignment */
  uint64_t one = mokk_ctx_bytes_bound(s, T);
  u128 b = ((u128)one + 4 * 256) * (uint64_t)s->P;
  return one == UINT64_MAX || b > UINT64_MAX ? UINT64_MAX : (uint64_t)b;
}

static const char *const weight_names[MOKK_NWEIGHTS] = {
    "w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"};

/* Activation and scratch sizes of a step: P * T * K rows of max(H, I) fp32. */
static int check_tokens(const mokk_shape *s, int64_t T, char *err)
{
  int rc;
  int64_t pairs, n;

  if ((rc = check_dim("T", T, 1, err)))
    return rc;
  if (mul3(s->P, T, s->K, &pairs) ||
      mul3(pairs, s->H > s->I ? s->H : s->I, 8, &n) ||
      mul3(s->P * T, s->I_s > s->H ? s->I_s : s->H, 8, &n))
    return mokk_fail(err, MOK_EOVERFLOW,
                     "P * T * K * max(H, I) = %lld * %lld * %lld * %lld overflows "
                     "the supported range",
                     (long long)s->P, (long long)T, (long long)s->K,
                     (long long)(s->H > s->I ? s->H : s->I));
  return 0;
}

int mokk_fwd_check(const mokk_shape *s, int64_t T, const mokk_fwd_rank *ranks,
                   char *err)
{
  int rc;

  if ((rc = mokk_shape_check(s, err)) || (rc = check_tokens(s, T, err)))
    return rc;
  if (ranks == NULL)
    return mokk_fail(err, MOK_ENULL, "forward ranks array is NULL");
  for (int64_t r = 0; r < s->P; r++) {
    const mokk_fwd_rank *f = &ranks[r];
    if (f->x == NULL || f->topk_ids == NULL || f->topk_weights == NULL || f->out == NULL)
      return mokk_fail(err, MOK_ENULL, "rank %lld: x, topk_ids, topk_weights and out "
                       "must all be set", (long long)r);
    for (int w = 0; w < MOKK_NWEIGHTS; w++) {
      if (w >= MOKK_S_GATE && s->I_s == 0)
        break;
      if (f->w[w] == NULL)
        return mokk_fail(err, MOK_ENULL, "rank %lld: weight %s is NULL", (long long)r,
                         weight_names[w]);
    }
  }
  return 0;
}

int mokk_bwd_check(const mokk_shape *s, int64_t T, mokk_grad_mode mode,
                   const mokk_bwd_rank *ranks, char *err)
{
  int rc;

  if ((rc = mokk_shape_check(s, err)) || (rc = check_tokens(s, T, err)))
    return rc;
  if (mode != MOKK_GRAD_BF16 && mode != MOKK_GRAD_FP32_ACCUM)
    return mokk_fail(err, MOK_EINVAL, "gradient mode %d is neither bf16 (0) nor "
                     "fp32-accumulate (1)", (int)mode);
  if (ranks == NULL)
    return mokk_fail(err, MOK_ENULL, "backward ranks array is NULL");
  for (int64_t r = 0; r < s->P; r++) {
    const mokk_bwd_rank *b = &ranks[r];
    if (b->d_out == NULL || b->d_x == NULL || b->d_topk_weights == NULL)
      return mokk_fail(err, MOK_ENULL, "rank %lld: d_out, d_x and d_topk_weights must "
                       "all be set", (long long)r);
    for (int w = 0; w < MOKK_NWEIGHTS; w++) {
      if (w >= MOKK_S_GATE && s->I_s == 0)
        break;
      if ((mode == MOKK_GRAD_BF16 ? (void *)b->g_bf16[w] : (void *)b->g_f32[w]) == NULL)
        return mokk_fail(err, MOK_ENULL, "rank %lld: %s gradient of %s is NULL",
                         (long long)r, mode == MOKK_GRAD_BF16 ? "bf16" : "fp32",
                         weight_names[w]);
    }
    int nw = s->I_s > 0 ? MOKK_NWEIGHTS : MOKK_S_GATE;
    for (int w = 1; w < nw; w++)
      if ((b->w[w] == NULL) != (b->w[0] == NULL))
        return mokk_fail(err, MOK_ENULL, "rank %lld: weight %s is %s but %s is not; name "
                         "all of the weights the backward reads, or none",
                         (long long)r, weight_names[w], b->w[w] == NULL ? "NULL" : "set",
                         weight_names[0]);
    for (int w = nw; w < MOKK_NWEIGHTS; w++)
      if (b->w[w] != NULL)
        return mokk_fail(err, MOK_EINVAL, "rank %lld: weight %s is set, but the layer has "
                         "no shared expert", (long long)r, weight_names[w]);
  }
  return 0;
}

void mokk_plan_free(mokk_plan *plan)
{
  free(plan->count);
  free(plan->seg_rows);
  free(plan->seg_start);
  free(plan->recv_rows);
  free(plan->recv_base);
  free(plan->slot);
  free(plan->src);
  memset(plan, 0, sizeof *plan);
}

int mokk_plan_build(mokk_plan *plan, const mokk_shape *s, int64_t T,
                    const int32_t *const *topk_ids, char *err)
{
  int rc;
  int64_t P, K, E, El, pairs;
  int64_t *cursor;

  memset(plan, 0, sizeof *plan);
  if ((rc = mokk_shape_check(s, err)) || (rc = check_tokens(s, T, err)))
    return rc;
  if (topk_ids == NULL)
    return mokk_fail(err, MOK_ENULL, "topk_ids array is NULL");
  P = s->P, K = s->K, E = s->E, El = E / P, pairs = P * T * K;
  for (int64_t r = 0; r < P; r++)
    if (topk_ids[r] == NULL)
      return mokk_fail(err, MOK_ENULL, "rank %lld: topk_ids is NULL", (long long)r);

  plan->P = P, plan->T = T, plan->K = K, plan->E = E, plan->E_local = El;
  plan->count = calloc((size_t)(P * E), sizeof(int64_t));
  plan->seg_rows = calloc((size_t)E, sizeof(int64_t));
  plan->seg_start = calloc((size_t)E, sizeof(int64_t));
  plan->recv_rows = calloc((size_t)P, sizeof(int64_t));
  plan->recv_base = calloc((size_t)P + 1, sizeof(int64_t));
  plan->slot = malloc((size_t)pairs * sizeof(int64_t));
  plan->src = malloc((size_t)pairs * sizeof(int64_t));
  cursor = malloc((size_t)E * sizeof(int64_t));
  if (!plan->count || !plan->seg_rows || !plan->seg_start || !plan->recv_rows ||
      !plan->recv_base || !plan->slot || !plan->src || !cursor) {
    free(cursor);
    mokk_plan_free(plan);
    return mokk_fail(err, MOK_ENOMEM, "out of memory for a routing plan of %lld pairs",
                     (long long)pairs);
  }

  /* counts per (source rank, expert); the same exchange a real dispatch makes.
   * Each id is read once, into slot[]: the ids may lie in memory a client
   * shares and writes, and the id that was checked must be the one placed.
   * MOKK_NO_ROUTE drops its pair: no row, slot -1. */
  for (int64_t r = 0; r < P; r++) {
    const int32_t *ids = topk_ids[r];
    for (int64_t i = 0; i < T * K; i++) {
      int32_t e = ((const volatile int32_t *)ids)[i];
      if (e == MOKK_NO_ROUTE) {
        plan->slot[r * T * K + i] = -1;
        continue;
      }
      if (e < 0 || e >= E) {
        free(cursor);
        mokk_plan_free(plan);
        return mokk_fail(err, MOK_EEXPERT,
                         "rank %lld token %lld k %lld: expert id %d is outside [0, %lld) "
                         "(-1: no route)",
                         (long long)r, (long long)(i / K), (long long)(i % K), (int)e,
                         (long long)E);
      }
      plan->count[r * E + e]++;
      plan->slot[r * T * K + i] = e;
    }
  }
  for (int64_t e = 0; e < E; e++)
    for (int64_t r = 0; r < P; r++)
      plan->seg_rows[e] += plan->count[r * E + e];

  /* segments of an owner's experts lie back to back in its receive buffer */
  for (int64_t p = 0; p < P; p++) {
    int64_t at = 0;
    for (int64_t e = p * El; e < (p + 1) * El; e++) {
      plan->seg_start[e] = at;
      at += plan->seg_rows[e];
    }
    plan->recv_rows[p] = at;
    plan->recv_base[p + 1] = plan->recv_base[p] + at;
  }

  /* source rank r's rows of expert e follow those of ranks < r: global order */
  for (int64_t e = 0; e < E; e++)
    cursor[e] = plan->seg_start[e];
  for (int64_t r = 0; r < P; r++) {
    for (int64_t i = 0; i < T * K; i++) {
      int64_t e = plan->slot[r * T * K + i];
      if (e < 0)
        continue;
      int64_t owner = e / El, row = cursor[e]++;
      plan->slot[r * T * K + i] = row;
      plan->src[plan->recv_base[owner] + row] = r * T * K + i;
    }
  }
  free(cursor);
  return 0;
}
