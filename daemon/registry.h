/* registry.h - what one session holds in memory: its arenas (made by the
 * session's backend, imported from the client, or holding daemon outputs),
 * the quotas they are charged to, the best-fit allocator of output blocks and
 * the validation of every tensor a request names. It knows nothing of sockets
 * or the server, so tests drive it with the CPU backend alone. */
#ifndef MOKD_REGISTRY_H
#define MOKD_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "mok.h"
#include "proto/mokd.pb-c.h"
#include "wfq.h"

typedef enum { ARENA_DAEMON, ARENA_IMPORTED, ARENA_OUTPUT } mokd_arena_kind;

typedef struct mokd_span {
  size_t off, len;
} mokd_span;

typedef struct mokd_arena {
  uint64_t id;
  mokd_arena_kind kind;
  int fd;            /* the export to send the client, until sent; -1 after */
  mokk_buffer *buf;  /* the memory, the backend's */
  void *base;        /* buf's, for short */
  size_t bytes;
  int device;        /* CUDA ordinal; -1 = host memory */
  int users;         /* forward contexts reading weights in it */
  int maps;          /* mappings it holds: chunks of a chunked import, else 1 */
  size_t filled;     /* a chunked import under way: bytes of chunks mapped */
  uint64_t charged;  /* bytes charged to the quota `which` */
  int which;
  mokd_span *free;   /* output arenas: free ranges, sorted by offset */
  size_t nfree, capfree, used;
  struct mokd_arena *next;
} mokd_arena;

enum { MOKD_HOST, MOKD_DEVICE }; /* the two quotas */

/* A tenant ("job:ID", else "uid:N"), all its sessions together: what they
 * were served, their share of the executors, and the memory they hold
 * against tenant_quota_bytes. A record lives while the tenant has a session,
 * work queued or memory held; then it goes, counters and all (a daemon
 * serving one job after another would otherwise grow without bound). */
typedef struct mokd_tenant {
  char key[MOKD_TENANT_MAX];
  uint64_t steps;   /* steps served (each rank of a group step counts) */
  uint64_t queued;  /* steps queued for an executor or running, not yet done */
  unsigned weight;  /* tenant_weights for it: its share in the fair queue, >= 1 */
  uint64_t quota;   /* tenant_quota_bytes for it; 0 = no limit */
  uint64_t held;    /* host and GPU bytes its sessions' quotas are charged, together */
  int sessions;     /* sessions that point at it (mokd_tenant_get, mokd_tenant_put) */
  struct mokd_tenant *next;
} mokd_tenant;

/* The record of key in *list for one more session, made (with weight and
 * quota) when missing; NULL when out of memory. */
mokd_tenant *mokd_tenant_get(mokd_tenant **list, const char *key, unsigned weight,
                             uint64_t quota);
/* A session lets go of t: t and every other record with no session, no work
 * and no memory leave *list and are freed. */
void mokd_tenant_put(mokd_tenant **list, mokd_tenant *t);
void mokd_tenants_free(mokd_tenant **list);

typedef struct mokd_limits {
  uint64_t max_arena_bytes;
  uint64_t quota[2];          /* [MOKD_HOST], [MOKD_DEVICE]; 0 = no limit */
  uint64_t max_arenas;        /* arenas of one session, of every kind; 0 = no limit */
  /* arenas of all sessions together (each is a mapping of the daemon's, and
   * vm.max_map_count bounds them all); 0 = no limit */
  uint64_t daemon_max_arenas;
} mokd_limits;

typedef struct mokd_registry {
  mokk_backend *backend;   /* makes the memory of new arenas; steps run on it */
  int device;              /* the backend's device: CUDA ordinal, -1 = host */
  uint64_t *next_id;       /* ids come from the daemon's one counter */
  mokd_limits lim;
  uint64_t held[2];
  uint64_t narenas;
  mok_usage *usage[2];     /* counters kept up to date: the session's, the daemon's */
  mokd_tenant *tenant;     /* its session's tenant, from Hello; NULL before */
  mokd_arena *arenas;
  mokd_arena *pending;     /* a chunked import waiting for chunks; not in arenas */
  int pending_kind;        /* its mokk_import_kind: the continuations' must match */
  /* chunks mapped by the imports under way of every session (the daemon's
   * count, next to usage[1]'s arenas); NULL: this session's only */
  uint64_t *pending_all;
} mokd_registry;

void mokd_registry_init(mokd_registry *r, mokk_backend *b, uint64_t *next_id,
                        const mokd_limits *lim, mok_usage *session, mok_usage *daemon);
/* The backend (and so the device) new arenas are made on. */
void mokd_registry_place(mokd_registry *r, mokk_backend *b);
/* Frees every arena. */
void mokd_registry_clear(mokd_registry *r);

/* An arena of at least bytes on the registry's backend (GPU memory on a
 * device backend, a memfd on the CPU); its fd stays open until sent. */
int mokd_arena_new(mokd_registry *r, size_t bytes, mokd_arena_kind kind, mokd_arena **out,
                   char *err);
/* Client memory: a memfd on any backend, GPU memory on a device backend. A
 * memfd is charged to the host quota: the daemon's mapping keeps its pages
 * alive after the client lets go of them. */
int mokd_arena_import(mokd_registry *r, const mokk_import *src, mokd_arena **out, char *err);
/* Client memory made of several allocations, their chunks brought by
 * several requests: continues = 0 begins an import of bytes, otherwise it
 * names the import under way (at most one a session). *out is the arena,
 * in r->arenas once the chunks add up to bytes, r->pending until then. Any
 * error drops the import whole. */
int mokd_import_chunks(mokd_registry *r, mokk_import_kind kind, uint64_t continues,
                       size_t bytes, const int *fds, const size_t *sizes, int n,
                       mokd_arena **out, char *err);
/* Drops the import under way, if any: unmaps what it mapped. */
void mokd_import_drop(mokd_registry *r);
mokd_arena *mokd_arena_find(const mokd_registry *r, uint64_t id);
/* Device memory goes once the work queued before the call has run (the loop
 * never waits for the GPU: see mokk_buffer_release); host memory goes at once. */
void mokd_arena_free(mokd_registry *r, mokd_arena *a);

/* A block of len bytes in an output arena, best fit over all of them. A new
 * output arena keeps its fd open until the first reply that names it carries
 * the fd to the client. */
int mokd_out_alloc(mokd_registry *r, size_t len, mokd_arena **arena, mokd_span *span,
                   char *err);
void mokd_out_release(mokd_arena *a, mokd_span span);
/* Gives back n blocks of one output arena at once, in O((n + free ranges)
 * log n) where n single releases would cost O(n * free ranges); spans is
 * reordered. */
void mokd_out_release_many(mokd_arena *a, mokd_span *spans, size_t n);

/* Validates a wire tensor against the registry's arenas. shape entries < 0
 * are free (and filled in); *ptr gets the mapped address, *arena (may be
 * NULL) its arena. */
int mokd_ref_resolve(const mokd_registry *r, const char *what, const Mokd__TensorRef *t,
                     Mokd__DType dtype, int ndim, int64_t *shape, void **ptr,
                     mokd_arena **arena, char *err);
Mokd__TensorRef *mokd_ref_new(uint64_t arena, uint64_t offset, Mokd__DType dtype, int ndim,
                              const int64_t *shape);
Mokd__TensorRef *mokd_ref_copy(const Mokd__TensorRef *t);
void mokd_ref_free(Mokd__TensorRef *t);

/* Charges bytes of host (MOKD_HOST) or device memory to the quota. */
int mokd_quota_take(mokd_registry *r, uint64_t bytes, int which, char *err);
void mokd_quota_give(mokd_registry *r, uint64_t bytes, int which);

#endif
