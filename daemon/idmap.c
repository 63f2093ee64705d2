/* idmap.c - see idmap.h. */
#include "idmap.h"

#include <stdlib.h>

#include "mok_errno.h"

static size_t slot_of(const mokd_idmap *m, uint64_t id)
{
  return (size_t)((id * 0x9e3779b97f4a7c15ull) >> 32) & (m->cap - 1);
}

void mokd_idmap_init(mokd_idmap *m)
{
  *m = (mokd_idmap){0};
}

void mokd_idmap_free(mokd_idmap *m)
{
  free(m->keys);
  free(m->vals);
  *m = (mokd_idmap){0};
}

static int grow(mokd_idmap *m)
{
  mokd_idmap big = {0};
  big.cap = m->cap ? 2 * m->cap : 16;
  big.keys = calloc(big.cap, sizeof *big.keys);
  big.vals = malloc(big.cap * sizeof *big.vals);
  if (big.keys == NULL || big.vals == NULL) {
    free(big.keys);
    free(big.vals);
    return MOK_ENOMEM;
  }
  for (size_t i = 0; i < m->cap; i++)
    if (m->keys[i] != 0)
      mokd_idmap_put(&big, m->keys[i], m->vals[i]); /* room is there: cannot fail */
  mokd_idmap_free(m);
  *m = big;
  return 0;
}

int mokd_idmap_put(mokd_idmap *m, uint64_t id, void *val)
{
  size_t i;

  if (id == 0)
    return MOK_EINVAL;
  /* at most half full: probes stay short */
  if (2 * (m->n + 1) > m->cap && grow(m) != 0)
    return MOK_ENOMEM;
  for (i = slot_of(m, id); m->keys[i] != 0 && m->keys[i] != id; i = (i + 1) & (m->cap - 1))
    ;
  if (m->keys[i] == 0)
    m->n++;
  m->keys[i] = id;
  m->vals[i] = val;
  return 0;
}

void *mokd_idmap_get(const mokd_idmap *m, uint64_t id)
{
  if (m->cap == 0 || id == 0)
    return NULL;
  for (size_t i = slot_of(m, id); m->keys[i] != 0; i = (i + 1) & (m->cap - 1))
    if (m->keys[i] == id)
      return m->vals[i];
  return NULL;
}

void mokd_idmap_del(mokd_idmap *m, uint64_t id)
{
  size_t i, j, mask = m->cap - 1;

  if (m->cap == 0 || id == 0)
    return;
  for (i = slot_of(m, id); m->keys[i] != id; i = (i + 1) & mask)
    if (m->keys[i] == 0)
      return;
  m->n--;
  /* shift back every later key of the run that may sit in the hole */
  for (j = (i + 1) & mask; m->keys[j] != 0; j = (j + 1) & mask) {
    size_t home = slot_of(m, m->keys[j]);
    /* j's key moves to the hole when the hole lies cyclically in [home, j) */
    if (home <= j ? home <= i && i < j : home <= i || i < j) {
      m->keys[i] = m->keys[j];
      m->vals[i] = m->vals[j];
      i = j;
    }
  }
  m->keys[i] = 0;
}
