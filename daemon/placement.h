/* placement.h - which sessions may hold the ranks of one EP group: a group's
 * step runs on one backend, whose ranks may sit on other GPUs only where the
 * daemon linked its GPUs. A pure rule, so that it is tested without a GPU. */
#ifndef MOKD_PLACEMENT_H
#define MOKD_PLACEMENT_H

#include "backend.h"

typedef enum {
  MOKD_PLACE_OK = 0,
  MOKD_PLACE_NOT_LINKED, /* two GPUs the daemon could not link */
  MOKD_PLACE_OTHER       /* not two GPUs: a CPU backend and another one */
} mokd_place;

/* Whether a session on backend b (device dev_b, -1 = host) may join a group
 * of which a session on backend a (dev_a) holds a rank. */
mokd_place mokd_place_ranks(const mokk_backend *a, int dev_a, const mokk_backend *b, int dev_b,
                            int gpus_linked);

#endif
