/* testbed.c - see testbed.h. */
#include "testbed.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t next(uint64_t *s)
{
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static float uniform(uint64_t *s)
{
  return (float)((double)(next(s) >> 11) * 0x1p-52 - 1.0);
}

static uint16_t to_bf16(float f)
{
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* bf16 tensors get uniform(-scale, scale), fp32 ones zeros */
static int fill_random(mok_client *c, const mok_tensor *t, float scale, uint64_t *s)
{
  size_t n = mok_tensor_bytes(t);
  void *p = calloc(1, n ? n : 1);
  int rc;

  if (p == NULL)
    return MOK_ENOMEM;
  if (t->dtype == MOK_DTYPE_BF16)
    for (size_t i = 0; i < n / 2; i++)
      ((uint16_t *)p)[i] = to_bf16(scale * uniform(s));
  rc = mok_tensor_write(c, t, p);
  free(p);
  return rc;
}

/* The next tensor, at *at of arena `arena`; *at moves past it, 256-byte
 * aligned. *ovf is set when a size passes 64 bits. */
static mok_tensor place(uint64_t arena, size_t *at, int *ovf, mok_dtype dt, int ndim, int64_t a,
                        int64_t b, int64_t c)
{
  int64_t sh[3] = {a, b, c};
  mok_tensor t = mok_tensor_make(arena, *at, dt, ndim, sh);
  size_t n = dt == MOK_DTYPE_BF16 ? 2 : 4;

  for (int i = 0; i < ndim; i++)
    *ovf |= __builtin_mul_overflow(n, (size_t)sh[i], &n);
  *ovf |= __builtin_add_overflow(n, (size_t)255, &n);
  *ovf |= __builtin_add_overflow(*at, n / 256 * 256, at);
  return t;
}

/* Places every tensor in arena `arena` from offset 0; returns the bytes taken
 * (meaningless when *ovf comes back set). Dimensions must be checked. */
static size_t layout(mok_testbed *tb, uint64_t arena, int *ovf)
{
  int64_t T = tb->T, H = tb->d.hidden, I = tb->d.intermediate, K = tb->d.top_k;
  int64_t Is = tb->d.shared_intermediate;
  /* an EP rank holds its E / P experts (the ids name all E) */
  int64_t E = tb->d.experts / (tb->d.ep_size > 1 ? (int64_t)tb->d.ep_size : 1);
  size_t at = 0;

  tb->x = place(arena, &at, ovf, MOK_DTYPE_BF16, 2, T, H, 0);
  tb->d_out = place(arena, &at, ovf, MOK_DTYPE_BF16, 2, T, H, 0);
  tb->ids = place(arena, &at, ovf, MOK_DTYPE_I32, 2, T, K, 0);
  tb->tw = place(arena, &at, ovf, MOK_DTYPE_F32, 2, T, K, 0);
  for (int g = 0; g < 2; g++) {
    mok_tensor *w = g ? tb->g32 : tb->w;
    mok_dtype dt = g ? MOK_DTYPE_F32 : MOK_DTYPE_BF16;
    w[MOK_W_GATE] = place(arena, &at, ovf, dt, 3, E, I, H);
    w[MOK_W_UP] = place(arena, &at, ovf, dt, 3, E, I, H);
    w[MOK_W_DOWN] = place(arena, &at, ovf, dt, 3, E, H, I);
    if (Is > 0) {
      w[MOK_S_GATE] = place(arena, &at, ovf, dt, 2, Is, H, 0);
      w[MOK_S_UP] = place(arena, &at, ovf, dt, 2, Is, H, 0);
      w[MOK_S_DOWN] = place(arena, &at, ovf, dt, 2, H, Is, 0);
    }
  }
  return at;
}

int mok_testbed_check(const mok_layer_desc *d, int64_t T, size_t *bytes, char *err,
                      size_t errlen)
{
  mok_testbed tb = {.d = *d, .T = T};
  char what[160];
  int ovf = 0;

  snprintf(what, sizeof what, "layer T=%lld H=%lld I=%lld E=%lld K=%lld I_s=%lld",
           (long long)T, (long long)d->hidden, (long long)d->intermediate,
           (long long)d->experts, (long long)d->top_k, (long long)d->shared_intermediate);
  if (T < 1 || d->hidden < 1 || d->intermediate < 1 || d->experts < 1 || d->top_k < 1 ||
      d->shared_intermediate < 0) {
    snprintf(err, errlen, "%s: T, H, I, E and K must be at least 1, I_s at least 0", what);
    return MOK_ESHAPE;
  }
  if (d->top_k > d->experts) {
    snprintf(err, errlen, "%s: K is larger than E; each token picks K distinct experts", what);
    return MOK_ESHAPE;
  }
  if (d->ep_size > 1 && d->experts % d->ep_size != 0) {
    snprintf(err, errlen, "%s: E does not divide by the EP group's %u ranks", what,
             d->ep_size);
    return MOK_EEPSIZE;
  }
  *bytes = layout(&tb, 0, &ovf);
  if (ovf) {
    snprintf(err, errlen, "%s: its tensors need more than 2^64 bytes", what);
    return MOK_EOVERFLOW;
  }
  return 0;
}

/* a libmok call failed: its message, after what was being done */
static int call_failed(mok_client *c, mok_testbed *tb, const char *doing, int rc)
{
  snprintf(tb->err, sizeof tb->err, "%s: %s", doing, mok_last_error(c));
  return rc;
}

/* fill_random failed: in its host buffer, or in the copy */
static int fill_failed(mok_client *c, mok_testbed *tb, const char *doing, int rc)
{
  if (rc != MOK_ENOMEM)
    return call_failed(c, tb, doing, rc);
  snprintf(tb->err, sizeof tb->err, "%s: out of host memory", doing);
  return rc;
}

int mok_testbed_setup(mok_client *c, const mok_layer_desc *d, int64_t T, uint64_t seed,
                      mok_testbed *tb)
{
  return mok_testbed_setup_tuned(c, d, NULL, T, seed, tb);
}

int mok_testbed_setup_tuned(mok_client *c, const mok_layer_desc *d, const mok_layer_tuning *tune,
                            int64_t T, uint64_t seed, mok_testbed *tb)
{
  int64_t H = d->hidden, I = d->intermediate, K = d->top_k, E = d->experts;
  int64_t Is = d->shared_intermediate;
  size_t bytes;
  int rc, ovf = 0;

  memset(tb, 0, sizeof *tb);
  tb->d = *d;
  tb->T = T;
  tb->nweights = Is > 0 ? MOK_NWEIGHTS : MOK_S_GATE;
  if ((rc = mok_testbed_check(d, T, &bytes, tb->err, sizeof tb->err)) != 0)
    return rc;
  if ((rc = mok_layer_create_tuned(c, d, tune, &tb->layer)) != 0)
    return call_failed(c, tb, "creating the layer", rc);
  if ((rc = mok_arena_create(c, bytes, &tb->arena)) != 0)
    return call_failed(c, tb, "creating its arena", rc);
  layout(tb, tb->arena.id, &ovf);
  /* filled on the host and copied in, so GPU arenas work the same */
  if ((rc = fill_random(c, &tb->x, 1.0f, &seed)) || (rc = fill_random(c, &tb->d_out, 1.0f, &seed)))
    return fill_failed(c, tb, "writing the inputs", rc);
  for (int w = 0; w < tb->nweights; w++) {
    int64_t fan_in = w == MOK_W_DOWN ? I : w == MOK_S_DOWN ? Is : H;
    if (w >= MOK_S_GATE && d->ep_size > 1) { /* the shared expert: the same on every rank */
      uint64_t shared_seed = 0x5eed + (uint64_t)w;
      if ((rc = fill_random(c, &tb->w[w], 2.0f / sqrtf((float)fan_in), &shared_seed)) ||
          (rc = fill_random(c, &tb->g32[w], 0.0f, &shared_seed)))
        return fill_failed(c, tb, "writing the weights", rc);
      continue;
    }
    if ((rc = fill_random(c, &tb->w[w], 2.0f / sqrtf((float)fan_in), &seed)) ||
        (rc = fill_random(c, &tb->g32[w], 0.0f, &seed)))
      return fill_failed(c, tb, "writing the weights", rc);
  }
  int32_t *ids = malloc((size_t)(T * K) * sizeof *ids);
  float *tw = malloc((size_t)(T * K) * sizeof *tw);
  if (ids == NULL || tw == NULL) {
    free(ids);
    free(tw);
    snprintf(tb->err, sizeof tb->err, "no memory for the routing of %lld tokens", (long long)T);
    return MOK_ENOMEM;
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k < K; k++) {
      int32_t e;
      int dup;
      do { /* K distinct experts per token: K <= E was checked */
        e = (int32_t)(next(&seed) % (uint64_t)E);
        dup = 0;
        for (int64_t j = 0; j < k; j++)
          dup |= ids[t * K + j] == e;
      } while (dup);
      ids[t * K + k] = e;
      tw[t * K + k] = 0.5f + 0.5f * uniform(&seed);
    }
  rc = mok_tensor_write(c, &tb->ids, ids);
  if (rc == 0)
    rc = mok_tensor_write(c, &tb->tw, tw);
  free(ids);
  free(tw);
  if (rc != 0)
    return call_failed(c, tb, "writing the routing", rc);
  if ((rc = mok_layer_set_weights(c, tb->layer, tb->w)) != 0)
    return call_failed(c, tb, "setting the weights", rc);
  return 0;
}

double mok_testbed_flops(const mok_testbed *tb)
{
  return 6.0 * (double)tb->T * (double)tb->d.top_k * (double)tb->d.hidden *
             (double)tb->d.intermediate +
         6.0 * (double)tb->T * (double)tb->d.hidden * (double)tb->d.shared_intermediate;
}
