/* ref.c - see ref.h. Deliberately naive: a loop per formula of DESIGN §1. */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

static double rb(int round, double v)
{
  return round ? (double)mokk_bf16_to_f32(mokk_f32_to_bf16((float)v)) : v;
}

double *dvec(int64_t n)
{
  double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
  if (p == NULL)
    abort();
  return p;
}

static double dsilu_ref(double g)
{
  double s = 1.0 / (1.0 + exp(-g));
  return s * (1.0 + g * (1.0 - s));
}

/* one SwiGLU expert on one row: fills g, u (pre-clamp), h, y */
static void expert_row(const ref_moe *m, const double *x, const double *wg,
                       const double *wu, const double *wd, int64_t I, double *g,
                       double *u, double *h, double *y)
{
  for (int64_t i = 0; i < I; i++) {
    double gv = 0, uv = 0;
    for (int64_t j = 0; j < m->H; j++) {
      gv += x[j] * wg[i * m->H + j];
      uv += x[j] * wu[i * m->H + j];
    }
    g[i] = gv, u[i] = uv;
    if (m->L > 0) {
      gv = fmin(gv, m->L);
      uv = fmin(fmax(uv, -m->L), m->L);
    }
    h[i] = rb(m->round, gv / (1.0 + exp(-gv)) * uv);
  }
  for (int64_t j = 0; j < m->H; j++) {
    double a = 0;
    for (int64_t i = 0; i < I; i++)
      a += h[i] * wd[j * I + i];
    y[j] = rb(m->round, a);
  }
}

void ref_forward(const ref_moe *m, double *out)
{
  int64_t H = m->H, I = m->I, Is = m->I_s, Imax = I > Is ? I : Is;
  double *g = dvec(Imax), *u = dvec(Imax), *h = dvec(Imax), *y = dvec(H);

  for (int64_t t = 0; t < m->T; t++) {
    const double *x = m->x + t * H;
    for (int64_t j = 0; j < H; j++)
      out[t * H + j] = 0;
    for (int64_t k = 0; k < m->K; k++) {
      int64_t e = m->ids[t * m->K + k];
      if (e == MOKK_NO_ROUTE)
        continue; /* the pair is absent */
      expert_row(m, x, m->w[MOKK_W_GATE] + e * I * H, m->w[MOKK_W_UP] + e * I * H,
                 m->w[MOKK_W_DOWN] + e * H * I, I, g, u, h, y);
      for (int64_t j = 0; j < H; j++)
        out[t * H + j] += m->tw[t * m->K + k] * y[j];
    }
    if (Is > 0) {
      expert_row(m, x, m->w[MOKK_S_GATE], m->w[MOKK_S_UP], m->w[MOKK_S_DOWN], Is, g, u,
                 h, y);
      for (int64_t j = 0; j < H; j++)
        out[t * H + j] += y[j];
    }
  }
  free(g), free(u), free(h), free(y);
}

/* backward of one expert on one row with upstream dy (already weighted) */
static void expert_row_bwd(const ref_moe *m, const double *x, const double *dy,
                           const double *wg, const double *wu, const double *wd,
                           int64_t I, double *gg, double *gu, double *gd, double *dx,
                           double *g, double *u, double *h, double *y)
{
  expert_row(m, x, wg, wu, wd, I, g, u, h, y);
  for (int64_t i = 0; i < I; i++) {
    double dh = 0, gv = g[i], uv = u[i], dg, du;
    for (int64_t j = 0; j < m->H; j++)
      dh += dy[j] * wd[j * I + i];
    int gclamp = m->L > 0 && gv > m->L, uclamp = m->L > 0 && fabs(uv) > m->L;
    if (m->L > 0) {
      gv = fmin(gv, m->L);
      uv = fmin(fmax(uv, -m->L), m->L);
    }
    dg = gclamp ? 0 : dh * uv * dsilu_ref(gv);
    du = uclamp ? 0 : dh * gv / (1.0 + exp(-gv));
    for (int64_t j = 0; j < m->H; j++) {
      dx[j] += dg * wg[i * m->H + j] + du * wu[i * m->H + j];
      gg[i * m->H + j] += dg * x[j];
      gu[i * m->H + j] += du * x[j];
    }
    for (int64_t j = 0; j < m->H; j++)
      gd[j * I + i] += dy[j] * h[i];
  }
}

void ref_backward(const ref_moe *m, const double *d_out, double *d_x, double *d_tw,
                  double *const gr[MOKK_NWEIGHTS])
{
  int64_t H = m->H, I = m->I, Is = m->I_s, Imax = I > Is ? I : Is;
  double *g = dvec(Imax), *u = dvec(Imax), *h = dvec(Imax), *y = dvec(H), *dy = dvec(H);

  memset(d_x, 0, (size_t)(m->T * H) * sizeof(double));
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = w < MOKK_S_GATE ? m->E * I * H : Is * H;
    if (gr[w] != NULL)
      memset(gr[w], 0, (size_t)n * sizeof(double));
  }
  for (int64_t t = 0; t < m->T; t++) {
    const double *x = m->x + t * H, *d = d_out + t * H;
    for (int64_t k = 0; k < m->K; k++) {
      int64_t e = m->ids[t * m->K + k];
      double wk = m->tw[t * m->K + k], dt = 0;
      if (e == MOKK_NO_ROUTE) {
        d_tw[t * m->K + k] = 0;
        continue;
      }
      expert_row(m, x, m->w[MOKK_W_GATE] + e * I * H, m->w[MOKK_W_UP] + e * I * H,
                 m->w[MOKK_W_DOWN] + e * H * I, I, g, u, h, y);
      for (int64_t j = 0; j < H; j++) {
        dt += d[j] * y[j];
        dy[j] = wk * d[j];
      }
      d_tw[t * m->K + k] = dt;
      expert_row_bwd(m, x, dy, m->w[MOKK_W_GATE] + e * I * H, m->w[MOKK_W_UP] + e * I * H,
                     m->w[MOKK_W_DOWN] + e * H * I, I, gr[MOKK_W_GATE] + e * I * H,
                     gr[MOKK_W_UP] + e * I * H, gr[MOKK_W_DOWN] + e * H * I, d_x + t * H,
                     g, u, h, y);
    }
    if (Is > 0)
      expert_row_bwd(m, x, d, m->w[MOKK_S_GATE], m->w[MOKK_S_UP], m->w[MOKK_S_DOWN], Is,
                     gr[MOKK_S_GATE], gr[MOKK_S_UP], gr[MOKK_S_DOWN], d_x + t * H, g, u,
                     h, y);
  }
  free(g), free(u), free(h), free(y), free(dy);
}

/* ---- cases ---------------------------------------------------------------- */

uint64_t rng_next(uint64_t *s)
{
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double rng_uniform(uint64_t *s)
{
  return (double)(rng_next(s) >> 11) * 0x1p-52 - 1.0;
}

static uint16_t *bf16_random(int64_t n, double scale, uint64_t *rng)
{
  uint16_t *p = malloc((size_t)(n > 0 ? n : 1) * sizeof(uint16_t));
  if (p == NULL)
    abort();
  for (int64_t i = 0; i < n; i++)
    p[i] = mokk_f32_to_bf16((float)(scale * rng_uniform(rng)));
  return p;
}

int64_t case_weight_elems(const moe_case *c, int which)
{
  return which < MOKK_S_GATE ? c->s.E * c->s.I * c->s.H : c->s.I_s * c->s.H;
}

void case_make(moe_case *c, const mokk_shape *s, int64_t T, uint64_t seed,
               route_kind route)
{
  uint64_t rng = seed;
  int64_t H = s->H, K = s->K, E = s->E;

  memset(c, 0, sizeof *c);
  c->s = *s;
  c->s.P = 1;
  c->T = T;
  c->x = bf16_random(T * H, 1.0, &rng);
  c->d_out = bf16_random(T * H, 1.0, &rng);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t fan_in = w == MOKK_W_DOWN ? s->I : w == MOKK_S_DOWN ? s->I_s : H;
    c->w[w] = bf16_random(case_weight_elems(c, w), 2.0 / sqrt((double)fan_in), &rng);
  }
  c->ids = malloc((size_t)(T * K) * sizeof(int32_t));
  c->tw = malloc((size_t)(T * K) * sizeof(float));
  if (c->ids == NULL || c->tw == NULL)
    abort();
  for (int64_t t = 0; t < T; t++) {
    for (int64_t k = 0; k < K; k++) {
      int32_t e;
      int dup;
      do {
        if (route == ROUTE_SAME)
          e = (int32_t)k;
        else if (route == ROUTE_HALF)
          e = (int32_t)(2 * (rng_next(&rng) % (uint64_t)((E + 1) / 2)));
        else
          e = (int32_t)(rng_next(&rng) % (uint64_t)E);
        dup = 0;
        for (int64_t j = 0; j < k; j++)
          dup |= c->ids[t * K + j] == e;
      } while (dup && route != ROUTE_SAME && (route != ROUTE_HALF || K <= (E + 1) / 2));
      c->ids[t * K + k] = e;
      c->tw[t * K + k] = (float)(0.5 + 0.5 * rng_uniform(&rng));
    }
  }
  if (route == ROUTE_DROPS)
    for (int64_t i = 0; i < T * K; i++)
      if (case_drops(i / K, i % K, K))
        c->ids[i] = MOKK_NO_ROUTE;
}

int case_drops(int64_t t, int64_t k, int64_t K)
{
  return t % 11 == 3 || (t % 5 == 1 && k == t % K);
}

void case_free(moe_case *c)
{
  free(c->x), free(c->ids), free(c->tw), free(c->d_out);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    free(c->w[w]);
  memset(c, 0, sizeof *c);
}

void out_free(moe_out *o)
{
  free(o->out), free(o->d_x), free(o->d_tw);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    free(o->g_bf16[w]), free(o->g_f32[w]);
    free(o->g_shared_copy[w]), free(o->g_shared_copy32[w]);
  }
  memset(o, 0, sizeof *o);
}

static void *xcalloc(int64_t n, size_t size)
{
  void *p = calloc((size_t)(n > 0 ? n : 1), size);
  if (p == NULL)
    abort();
  return p;
}

/* Between the forward and the backward, the weights move as FSDP moves them:
 * a copy is made elsewhere and the forward's memory is overwritten with NaN
 * until the backward, which is told where the copy is, has run. */
static int backward_moved(mokk_backend *b, const moe_case *c, mokk_ctx *ctx,
                          mokk_grad_mode mode, mokk_bwd_rank *br, int64_t P, char *err)
{
  uint16_t *moved[MOKK_NWEIGHTS] = {0};
  int64_t El = c->s.E / P;
  int rc;

  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = case_weight_elems(c, w), per = w < MOKK_S_GATE ? El * c->s.I * c->s.H : 0;
    if (n == 0)
      continue;
    moved[w] = xcalloc(n, sizeof(uint16_t));
    memcpy(moved[w], c->w[w], (size_t)n * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++)
      c->w[w][i] = 0x7fc0;
    for (int64_t r = 0; r < P; r++)
      br[r].w[w] = moved[w] + r * per;
  }
  rc = mokk_backward(b, ctx, mode, br, err);
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    if (moved[w] != NULL)
      memcpy(c->w[w], moved[w], (size_t)case_weight_elems(c, w) * sizeof(uint16_t));
    free(moved[w]);
  }
  return rc;
}

int case_run(mokk_backend *b, const moe_case *c, int64_t P, int bwd, mokk_grad_mode mode,
             float seed_grad, moe_out *o, char *err)
{
  return case_run_moved(b, c, P, bwd, mode, seed_grad, 0, o, err);
}

int case_run_moved(mokk_backend *b, const moe_case *c, int64_t P, int bwd,
                   mokk_grad_mode mode, float seed_grad, int move, moe_out *o, char *err)
{
  mokk_shape s = c->s;
  int64_t T = c->T / P, H = s.H, K = s.K, El, Ishared = s.I_s * H;
  mokk_fwd_rank *fr = xcalloc(P, sizeof *fr);
  mokk_bwd_rank *br = xcalloc(P, sizeof *br);
  mokk_ctx *ctx = NULL;
  int rc;

  s.P = P;
  El = s.E / P;
  memset(o, 0, sizeof *o);
  o->out = xcalloc(c->T * H, sizeof(uint16_t));
  o->d_x = xcalloc(c->T * H, sizeof(uint16_t));
  o->d_tw = xcalloc(c->T * K, sizeof(float));
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = case_weight_elems(c, w);
    o->g_bf16[w] = xcalloc(n, sizeof(uint16_t));
    o->g_f32[w] = xcalloc(n, sizeof(float));
    for (int64_t i = 0; i < n; i++)
      o->g_f32[w][i] = seed_grad;
    if (w >= MOKK_S_GATE) {
      o->g_shared_copy[w] = xcalloc(n * P, sizeof(uint16_t));
      o->g_shared_copy32[w] = xcalloc(n * P, sizeof(float));
      for (int64_t i = 0; i < n * P; i++)
        o->g_shared_copy32[w][i] = seed_grad;
    }
  }
  for (int64_t r = 0; r < P; r++) {
    fr[r].x = c->x + r * T * H;
    fr[r].topk_ids = c->ids + r * T * K;
    fr[r].topk_weights = c->tw + r * T * K;
    fr[r].out = o->out + r * T * H;
    br[r].d_out = c->d_out + r * T * H;
    br[r].d_x = o->d_x + r * T * H;
    br[r].d_topk_weights = o->d_tw + r * T * K;
    for (int w = 0; w < MOKK_NWEIGHTS; w++) {
      int64_t per = w < MOKK_S_GATE ? El * s.I * H : 0;
      if (w >= MOKK_S_GATE && s.I_s == 0)
        continue;
      fr[r].w[w] = c->w[w] + r * per;
      if (w < MOKK_S_GATE) {
        br[r].g_bf16[w] = o->g_bf16[w] + r * per;
        br[r].g_f32[w] = o->g_f32[w] + r * per;
      } else if (r == 0) {
        br[r].g_bf16[w] = o->g_bf16[w];
        br[r].g_f32[w] = o->g_f32[w];
      } else {
        br[r].g_bf16[w] = o->g_shared_copy[w] + r * Ishared;
        br[r].g_f32[w] = o->g_shared_copy32[w] + r * Ishared;
      }
    }
  }
  rc = mokk_forward(b, &s, T, fr, bwd ? &ctx : NULL, err);
  if (rc == 0 && bwd)
    rc = move ? backward_moved(b, c, ctx, mode, br, P, err)
              : mokk_backward(b, ctx, mode, br, err);
  mokk_ctx_free(b, ctx);
  free(fr);
  free(br);
  return rc;
}

void case_ref(const moe_case *c, int round, ref_moe *m)
{
  double *x = dvec(c->T * c->s.H), *tw = dvec(c->T * c->s.K);

  memset(m, 0, sizeof *m);
  m->T = c->T, m->H = c->s.H, m->I = c->s.I, m->E = c->s.E, m->K = c->s.K;
  m->I_s = c->s.I_s, m->L = c->s.swiglu_limit, m->round = round, m->ids = c->ids;
  for (int64_t i = 0; i < c->T * c->s.H; i++)
    x[i] = mokk_bf16_to_f32(c->x[i]);
  for (int64_t i = 0; i < c->T * c->s.K; i++)
    tw[i] = c->tw[i];
  m->x = x, m->tw = tw;
  for (int w = 0; w < MOKK_NWEIGHTS; w++) {
    int64_t n = case_weight_elems(c, w);
    double *d = dvec(n);
    for (int64_t i = 0; i < n; i++)
      d[i] = mokk_bf16_to_f32(c->w[w][i]);
    m->w[w] = d;
  }
}

void ref_free(ref_moe *m)
{
  free((void *)m->x), free((void *)m->tw);
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    free((void *)m->w[w]);
}

double close_ratio(const double *ref, const double *got, int64_t n, double rel,
                   double abs_rms)
{
  double ss = 0, worst = 0;
  for (int64_t i = 0; i < n; i++)
    ss += ref[i] * ref[i];
  double rms = n > 0 ? sqrt(ss / (double)n) : 0;
  for (int64_t i = 0; i < n; i++) {
    double tol = rel * fabs(ref[i]) + abs_rms * rms;
    double d = fabs(got[i] - ref[i]);
    double r = tol > 0 ? d / tol : (d > 0 ? INFINITY : 0);
    if (!(r <= worst)) /* NaN counts as the worst */
      worst = isnan(r) ? INFINITY : r;
  }
  return worst;
}

double *bf16_to_dvec(const uint16_t *p, int64_t n)
{
  double *d = dvec(n);
  for (int64_t i = 0; i < n; i++)
    d[i] = mokk_bf16_to_f32(p[i]);
  return d;
}

double *f32_to_dvec(const float *p, int64_t n)
{
  double *d = dvec(n);
  for (int64_t i = 0; i < n; i++)
    d[i] = p[i];
  return d;
}
