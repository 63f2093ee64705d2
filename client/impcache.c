/* impcache.c - the decisions of libmok's cache of imported GPU memory: which
 * entry a call finds, which ones its memory has outgrown, which to join into
 * one import and which may go. No driver or daemon calls here; mok.c makes
 * them. */
#include "impcache.h"

int mok_imp_same(const mok_cuda_alloc *a, const mok_cuda_alloc *b)
{
  return a->base == b->base && a->bytes == b->bytes && a->buffer_id == b->buffer_id;
}

int mok_imp_chunk_at(const mok_imp *m, uintptr_t at)
{
  int lo = 0, hi = m->n; /* chunks ascend by base: the last at or below at */
  if (m->n == 0 || at < m->base || at - m->base >= m->bytes)
    return -1;
  while (hi - lo > 1) {
    int mid = lo + (hi - lo) / 2;
    if (m->chunks[mid].base <= at)
      lo = mid;
    else
      hi = mid;
  }
  return at - m->chunks[lo].base < m->chunks[lo].bytes ? lo : -1;
}

static int overlaps(uintptr_t a, uintptr_t a_end, uintptr_t b, uintptr_t b_end)
{
  return a < b_end && b < a_end;
}

int mok_imp_matches(const mok_imp *m, const mok_cuda_alloc *w, int n)
{
  for (int i = 0; i < n; i++) {
    if (!overlaps(w[i].base, w[i].base + w[i].bytes, m->base, m->base + m->bytes))
      continue;
    int j = mok_imp_chunk_at(m, w[i].base);
    if (j < 0 || !mok_imp_same(&m->chunks[j], &w[i]))
      return 0;
  }
  return 1;
}

int mok_imp_stale(const mok_imp *m, const mok_cuda_alloc *w, int n)
{
  return n > 0 &&
         overlaps(m->base, m->base + m->bytes, w[0].base, w[n - 1].base + w[n - 1].bytes) &&
         !mok_imp_matches(m, w, n);
}

int mok_imp_lookup(const mok_imp *imps, int nimps, const mok_cuda_alloc *first, uintptr_t ptr,
                   uintptr_t end, int *from, int *to)
{
  for (int i = 0; i < nimps; i++) {
    const mok_imp *m = &imps[i];
    int j;
    if (m->retired || ptr < m->base || end <= ptr || end - m->base > m->bytes)
      continue;
    if ((j = mok_imp_chunk_at(m, ptr)) < 0 || !mok_imp_same(&m->chunks[j], first))
      continue;
    *from = j;
    *to = mok_imp_chunk_at(m, end - 1);
    return i;
  }
  return -1;
}

int mok_imp_union(const mok_imp *imps, int nimps, const mok_cuda_alloc *w, int n,
                  uintptr_t *lo, uintptr_t *hi)
{
  uintptr_t l = *lo, h = *hi;
  int grew = 0, more = 1;

  /* every pass that grows the range may reach further entries */
  while (more) {
    more = 0;
    for (int i = 0; i < nimps; i++) {
      const mok_imp *m = &imps[i];
      uintptr_t e = m->base + m->bytes;
      if (m->retired || !overlaps(m->base, e, l, h) || (l <= m->base && e <= h) ||
          mok_imp_stale(m, w, n))
        continue;
      l = m->base < l ? m->base : l;
      h = e > h ? e : h;
      grew = more = 1;
    }
  }
  *lo = l, *hi = h;
  return grew;
}

int mok_imp_covered(const mok_imp *m, const mok_cuda_alloc *w, int n)
{
  return n > 0 && w[0].base <= m->base &&
         m->base + m->bytes <= w[n - 1].base + w[n - 1].bytes && mok_imp_matches(m, w, n);
}

int mok_imp_idle(const mok_imp *m, uint64_t epoch)
{
  return m->used < epoch;
}
