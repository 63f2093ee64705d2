/* idmap.h - a map from the daemon's ids (nonzero uint64) to pointers: open
 * addressing, linear probing, deletion by backward shift. A session finds its
 * results through one, so that a request naming n of them costs O(n). */
#ifndef MOKD_IDMAP_H
#define MOKD_IDMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct mokd_idmap {
  uint64_t *keys; /* 0 = empty */
  void **vals;
  size_t cap, n;  /* cap: 0 or a power of two */
} mokd_idmap;

void mokd_idmap_init(mokd_idmap *m);
void mokd_idmap_free(mokd_idmap *m);
/* Adds or replaces; MOK_ENOMEM, or MOK_EINVAL for id 0. */
int mokd_idmap_put(mokd_idmap *m, uint64_t id, void *val);
void *mokd_idmap_get(const mokd_idmap *m, uint64_t id);
void mokd_idmap_del(mokd_idmap *m, uint64_t id);

#endif
