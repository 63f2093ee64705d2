/* impcache.h - libmok's cache of GPU memory imported into mokd (see
 * impcache.c): plain functions over chunk lists, so the decisions
 * mok_arena_import_cuda takes can be tested without a GPU. */
#ifndef MOK_IMPCACHE_H
#define MOK_IMPCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "cudamap.h"

/* GPU allocations of ours that the daemon has imported as one arena: one, or
 * several mapped back to back (chunks[0, n), ascending, from base). */
typedef struct mok_imp {
  uintptr_t base;
  size_t bytes;
  mok_cuda_alloc *chunks;
  int n;
  uint64_t arena;
  uint64_t used;  /* the client's epoch when the arena was last handed out */
  int retired;    /* a later import covers it: no longer handed out */
} mok_imp;

/* Whether chunks a and b are one allocation at one place. */
int mok_imp_same(const mok_cuda_alloc *a, const mok_cuda_alloc *b);
/* The index of m's chunk that holds address at, or -1. */
int mok_imp_chunk_at(const mok_imp *m, uintptr_t at);
/* Whether m still maps the allocations it was made of wherever they overlap
 * chunks w[0, n) of ours. */
int mok_imp_matches(const mok_imp *m, const mok_cuda_alloc *w, int n);
/* Whether m overlaps w[0, n) but no longer maps those allocations: they were
 * freed, and m keeps their memory from going back. */
int mok_imp_stale(const mok_imp *m, const mok_cuda_alloc *w, int n);
/* The live (not retired) entry that covers [ptr, end) and whose chunk at ptr
 * is `first`, or -1; *from and *to (inclusive) name its chunks that
 * [ptr, end) touches, all of which the caller still has to check. */
int mok_imp_lookup(const mok_imp *imps, int nimps, const mok_cuda_alloc *first, uintptr_t ptr,
                   uintptr_t end, int *from, int *to);
/* Grows [*lo, *hi) (the range of chunks w[0, n)) over every live entry that
 * overlaps it, directly or through another, leaving out those stale against
 * w. Returns whether it grew. */
int mok_imp_union(const mok_imp *imps, int nimps, const mok_cuda_alloc *w, int n,
                  uintptr_t *lo, uintptr_t *hi);
/* Whether chunks w[0, n) take m's place: m lies within them and maps the same
 * allocations. */
int mok_imp_covered(const mok_imp *m, const mok_cuda_alloc *w, int n);
/* Whether m's arena may be destroyed without pulling it from under a tensor
 * the caller is about to send: it has not been handed out since the last
 * request that uses tensors went to the daemon (epoch). */
int mok_imp_idle(const mok_imp *m, uint64_t epoch);

#endif
