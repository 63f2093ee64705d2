/* testbed.c - see testbed.h. */
#include "testbed.h"

#include <math.h>
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

static mok_tensor place(uint64_t arena, size_t *at, mok_dtype dt, int ndim, int64_t a,
                        int64_t b, int64_t c)
{
  int64_t sh[3] = {a, b, c};
  mok_tensor t = mok_tensor_make(arena, *at, dt, ndim, sh);
  *at += (mok_tensor_bytes(&t) + 255) / 256 * 256;
  return t;
}

int mok_testbed_setup(mok_client *c, const mok_layer_desc *d, int64_t T, uint64_t seed,
                      mok_testbed *tb)
{
  int64_t H = d->hidden, I = d->intermediate, K = d->top_k, E = d->experts;
  int64_t Is = d->shared_intermediate;
  size_t at = 0;
  int rc;

  memset(tb, 0, sizeof *tb);
  tb->d = *d;
  tb->T = T;
  tb->nweights = Is > 0 ? MOK_NWEIGHTS : MOK_S_GATE;
  /* first pass sizes the arena, second places the tensors in it */
  for (int pass = 0; pass < 2; pass++) {
    uint64_t id = pass ? tb->arena.id : 0;
    at = 0;
    tb->x = place(id, &at, MOK_DTYPE_BF16, 2, T, H, 0);
    tb->d_out = place(id, &at, MOK_DTYPE_BF16, 2, T, H, 0);
    tb->ids = place(id, &at, MOK_DTYPE_I32, 2, T, K, 0);
    tb->tw = place(id, &at, MOK_DTYPE_F32, 2, T, K, 0);
    for (int g = 0; g < 2; g++) {
      mok_tensor *w = g ? tb->g32 : tb->w;
      mok_dtype dt = g ? MOK_DTYPE_F32 : MOK_DTYPE_BF16;
      w[MOK_W_GATE] = place(id, &at, dt, 3, E, I, H);
      w[MOK_W_UP] = place(id, &at, dt, 3, E, I, H);
      w[MOK_W_DOWN] = place(id, &at, dt, 3, E, H, I);
      if (Is > 0) {
        w[MOK_S_GATE] = place(id, &at, dt, 2, Is, H, 0);
        w[MOK_S_UP] = place(id, &at, dt, 2, Is, H, 0);
        w[MOK_S_DOWN] = place(id, &at, dt, 2, H, Is, 0);
      }
    }
    if (pass == 0 && (rc = mok_arena_create(c, at, &tb->arena)) != 0)
      return rc;
  }
  /* filled on the host and copied in, so GPU arenas work the same */
  if ((rc = fill_random(c, &tb->x, 1.0f, &seed)) || (rc = fill_random(c, &tb->d_out, 1.0f, &seed)))
    return rc;
  for (int w = 0; w < tb->nweights; w++) {
    int64_t fan_in = w == MOK_W_DOWN ? I : w == MOK_S_DOWN ? Is : H;
    if ((rc = fill_random(c, &tb->w[w], 2.0f / sqrtf((float)fan_in), &seed)) ||
        (rc = fill_random(c, &tb->g32[w], 0.0f, &seed)))
      return rc;
  }
  int32_t *ids = malloc((size_t)(T * K) * sizeof *ids);
  float *tw = malloc((size_t)(T * K) * sizeof *tw);
  if (ids == NULL || tw == NULL) {
    free(ids), free(tw);
    return MOK_ENOMEM;
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k < K; k++) {
      int32_t e;
      int dup;
      do { /* K distinct experts per token */
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
  free(ids), free(tw);
  if (rc != 0)
    return rc;
  if ((rc = mok_layer_create(c, d, &tb->layer)) != 0)
    return rc;
  return mok_layer_set_weights(c, tb->layer, tb->w);
}

double mok_testbed_flops(const mok_testbed *tb)
{
  return 6.0 * (double)tb->T * (double)tb->d.top_k * (double)tb->d.hidden *
             (double)tb->d.intermediate +
         6.0 * (double)tb->T * (double)tb->d.hidden * (double)tb->d.shared_intermediate;
}
