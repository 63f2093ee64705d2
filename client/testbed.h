/* testbed.h - a random MoE problem laid out in one daemon arena: weights,
 * inputs, d_out and fp32 gradient buffers, with the layer created and its
 * weights set. Shared by mokctl bench and the demo; not part of libmok. */
#ifndef MOK_TESTBED_H
#define MOK_TESTBED_H

#include "mok.h"

typedef struct mok_testbed {
  mok_layer_desc d;
  int64_t T;
  uint64_t layer;
  mok_arena_info arena;
  mok_tensor x, ids, tw, d_out, w[MOK_NWEIGHTS], g32[MOK_NWEIGHTS];
  int nweights;
  char err[MOK_ERRLEN]; /* why mok_testbed_setup failed */
} mok_testbed;

/* 0 and the bytes of the testbed's arena, or MOK_ESHAPE / MOK_EOVERFLOW and a
 * message: dimensions below 1 (I_s below 0), K > E (K distinct experts per
 * token could never be drawn) and sizes past 64 bits. */
int mok_testbed_check(const mok_layer_desc *d, int64_t T, size_t *bytes, char *err,
                      size_t errlen);
/* Checks, creates the layer (the daemon checks the shape), then the arena
 * (the daemon checks its size and the quota), and only then fills anything,
 * from seed; the layer's gradient mode comes from d. On failure tb->err says
 * why. */
int mok_testbed_setup(mok_client *c, const mok_layer_desc *d, int64_t T, uint64_t seed,
                      mok_testbed *tb);
/* The same, the layer created with kernel options (NULL: the defaults). */
int mok_testbed_setup_tuned(mok_client *c, const mok_layer_desc *d, const mok_layer_tuning *tune,
                            int64_t T, uint64_t seed, mok_testbed *tb);
/* FLOPs of one forward as DESIGN counts them: 6 (T K + T[shared]) H I. */
double mok_testbed_flops(const mok_testbed *tb);

#endif
