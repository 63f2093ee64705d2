/* registry.c - see registry.h. */
#include "registry.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"

#define OUT_ALIGN 256
#define OUT_ARENA_MIN (64u << 20)

static const char *const quota_names[2] = {"session_quota_bytes", "session_gpu_quota_bytes"};

void mokd_registry_init(mokd_registry *r, mokk_backend *b, uint64_t *next_id,
                        const mokd_limits *lim, mok_usage *session, mok_usage *daemon)
{
  memset(r, 0, sizeof *r);
  r->next_id = next_id;
  r->lim = *lim;
  r->usage[0] = session;
  r->usage[1] = daemon;
  mokd_registry_place(r, b);
}

mokd_tenant *mokd_tenant_get(mokd_tenant **list, const char *key, unsigned weight,
                             uint64_t quota)
{
  mokd_tenant *t;

  for (t = *list; t != NULL; t = t->next)
    if (strcmp(t->key, key) == 0)
      break;
  if (t == NULL) {
    if ((t = calloc(1, sizeof *t)) == NULL)
      return NULL;
    snprintf(t->key, sizeof t->key, "%s", key);
    t->weight = weight;
    t->quota = quota;
    t->next = *list;
    *list = t;
  }
  t->sessions++;
  return t;
}

/* A session's steps keep it busy and its memory is given back before it
 * goes, so a record is normally idle when its last session lets go; the
 * sweep also takes any that were not. */
void mokd_tenant_put(mokd_tenant **list, mokd_tenant *t)
{
  t->sessions--;
  for (mokd_tenant **pp = list; *pp != NULL;) {
    mokd_tenant *u = *pp;
    if (u->sessions == 0 && u->queued == 0 && u->held == 0) {
      *pp = u->next;
      free(u);
    } else {
      pp = &u->next;
    }
  }
}

void mokd_tenants_free(mokd_tenant **list)
{
  while (*list != NULL) {
    mokd_tenant *t = *list;
    *list = t->next;
    free(t);
  }
}

void mokd_registry_place(mokd_registry *r, mokk_backend *b)
{
  r->backend = b;
  r->device = mokk_backend_device(b);
}

void mokd_registry_clear(mokd_registry *r)
{
  mokd_import_drop(r);
  while (r->arenas != NULL)
    mokd_arena_free(r, r->arenas);
}

int mokd_quota_take(mokd_registry *r, uint64_t bytes, int which, char *err)
{
  uint64_t q = r->lim.quota[which], *held = &r->held[which];
  mokd_tenant *t = r->tenant;
  if (q > 0 && (*held + bytes > q || *held + bytes < *held))
    return mokk_fail(err, MOK_EDQUOT, "session would hold %llu bytes of %s memory; its quota "
                     "is %llu (%s)", (unsigned long long)(*held + bytes),
                     which == MOKD_DEVICE ? "GPU" : "host", (unsigned long long)q,
                     quota_names[which]);
  if (t != NULL && t->quota > 0 && (t->held + bytes > t->quota || t->held + bytes < t->held))
    return mokk_fail(err, MOK_EDQUOT, "tenant %s would hold %llu bytes, host and GPU memory "
                     "of all its sessions together; its quota is %llu (tenant_quota_bytes)",
                     t->key, (unsigned long long)(t->held + bytes),
                     (unsigned long long)t->quota);
  *held += bytes;
  if (t != NULL)
    t->held += bytes;
  for (int i = 0; i < 2 && which == MOKD_DEVICE; i++)
    if (r->usage[i] != NULL)
      r->usage[i]->gpu_bytes += bytes;
  return 0;
}

void mokd_quota_give(mokd_registry *r, uint64_t bytes, int which)
{
  r->held[which] -= bytes;
  if (r->tenant != NULL)
    r->tenant->held -= bytes;
  for (int i = 0; i < 2 && which == MOKD_DEVICE; i++)
    if (r->usage[i] != NULL)
      r->usage[i]->gpu_bytes -= bytes;
}

/* An arena counts once per mapping: a chunked import once per chunk. */
static void account(mokd_registry *r, const mokd_arena *a, int sign)
{
  r->narenas += (uint64_t)((int64_t)sign * a->maps);
  for (int i = 0; i < 2; i++)
    if (r->usage[i] != NULL) {
      r->usage[i]->arenas += (uint64_t)((int64_t)sign * a->maps);
      r->usage[i]->arena_bytes += (uint64_t)((int64_t)sign * (int64_t)a->bytes);
    }
}

/* A new arena around buf, linked into the registry. */
static mokd_arena *arena_link(mokd_registry *r, mokk_buffer *buf, mokd_arena_kind kind, int fd)
{
  mokd_arena *a = calloc(1, sizeof *a);
  if (a == NULL)
    return NULL;
  if (kind == ARENA_OUTPUT) {
    if ((a->free = malloc(4 * sizeof *a->free)) == NULL) {
      free(a);
      return NULL;
    }
    a->free[0] = (mokd_span){0, buf->bytes};
    a->nfree = 1, a->capfree = 4;
  }
  a->id = ++*r->next_id;
  a->kind = kind;
  a->fd = fd;
  a->buf = buf;
  a->base = buf->base;
  a->bytes = buf->bytes;
  a->device = buf->device;
  a->maps = 1;
  a->next = r->arenas;
  r->arenas = a;
  account(r, a, +1);
  return a;
}

static int size_ok(const mokd_registry *r, size_t bytes, const char *what, char *err)
{
  if (bytes == 0)
    return mokk_fail(err, MOK_EZEROSIZE, "%s size is 0", what);
  if (bytes > r->lim.max_arena_bytes)
    return mokk_fail(err, MOK_EINVAL, "%s of %zu bytes is larger than max_arena_bytes (%llu)",
                     what, bytes, (unsigned long long)r->lim.max_arena_bytes);
  return 0;
}

/* Every arena, whatever its kind, is one more mapping in the daemon, and
 * each chunk of a chunked import one more: n more, with those of the import
 * under way. */
static int count_ok(const mokd_registry *r, uint64_t n, char *err)
{
  uint64_t pend = r->pending != NULL ? (uint64_t)r->pending->maps : 0;
  uint64_t own = r->narenas + pend, all = (r->usage[1] != NULL ? r->usage[1]->arenas
                                                                : r->narenas) +
                                          (r->pending_all != NULL ? *r->pending_all : pend);

  if (r->lim.max_arenas > 0 && own + n > r->lim.max_arenas)
    return mokk_fail(err, MOK_EDQUOT, "session already holds %llu arenas (max_arenas), "
                     "imported, created and of outputs together, each chunk of an import "
                     "made of several allocations counted; %llu more do not fit; destroy "
                     "some first", (unsigned long long)own, (unsigned long long)n);
  if (r->lim.daemon_max_arenas > 0 && all + n > r->lim.daemon_max_arenas)
    return mokk_fail(err, MOK_EDQUOT, "mokd holds %llu arenas for all sessions, the most "
                     "its mappings allow (half of vm.max_map_count); try again later",
                     (unsigned long long)all);
  return 0;
}

int mokd_arena_new(mokd_registry *r, size_t bytes, mokd_arena_kind kind, mokd_arena **out,
                   char *err)
{
  int which = r->device >= 0 ? MOKD_DEVICE : MOKD_HOST, fd = -1, rc;
  mokk_buffer *buf;
  char why[MOK_ERRLEN];

  if ((rc = size_ok(r, bytes, "arena", err)) || (rc = count_ok(r, 1, err)) ||
      (rc = mokd_quota_take(r, bytes, which, err)))
    return rc;
  if ((rc = mokk_buffer_alloc(r->backend, bytes, &buf, &fd, err))) {
    mokd_quota_give(r, bytes, which);
    return rc;
  }
  /* the quota counts what the device really holds: the size rounded up */
  if (buf->bytes > bytes && (rc = mokd_quota_take(r, buf->bytes - bytes, which, err)))
    goto fail;
  if ((*out = arena_link(r, buf, kind, fd)) == NULL) {
    mokd_quota_give(r, buf->bytes - bytes, which);
    rc = mokk_fail(err, MOK_ENOMEM, "out of memory");
    goto fail;
  }
  (*out)->charged = buf->bytes;
  (*out)->which = which;
  return 0;

fail:
  mokd_quota_give(r, bytes, which);
  if (fd >= 0)
    close(fd);
  mokk_buffer_release(r->backend, buf, why);
  return rc;
}

int mokd_arena_import(mokd_registry *r, const mokk_import *src, mokd_arena **out, char *err)
{
  mokk_buffer *buf;
  char why[MOK_ERRLEN];
  /* the GPU memory a client imports stays its own allocation: not charged */
  uint64_t charge = src->kind == MOKK_IMPORT_HOST_FD ? src->bytes : 0;
  int rc;

  if (src->kind != MOKK_IMPORT_HOST_FD && r->device < 0)
    return mokk_fail(err, MOK_ENOTSUP, "this daemon runs the %s backend; it imports GPU "
                     "memory only on the cuda backend", mokk_backend_name(r->backend));
  if ((rc = size_ok(r, src->bytes, "imported buffer", err)) || (rc = count_ok(r, 1, err)) ||
      (rc = mokd_quota_take(r, charge, MOKD_HOST, err)))
    return rc;
  if ((rc = mokk_buffer_import(r->backend, src, &buf, err))) {
    mokd_quota_give(r, charge, MOKD_HOST);
    return rc;
  }
  if ((*out = arena_link(r, buf, ARENA_IMPORTED, -1)) == NULL) {
    mokd_quota_give(r, charge, MOKD_HOST);
    mokk_buffer_release(r->backend, buf, why);
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  (*out)->charged = charge;
  (*out)->which = MOKD_HOST;
  return 0;
}

void mokd_import_drop(mokd_registry *r)
{
  mokd_arena *a = r->pending;
  char why[MOK_ERRLEN];

  if (a == NULL)
    return;
  r->pending = NULL;
  if (r->pending_all != NULL)
    *r->pending_all -= (uint64_t)a->maps;
  mokd_quota_give(r, a->charged, a->which);
  if (mokk_buffer_release(r->backend, a->buf, why) != 0)
    LOG_WARN(SESS, "%s; dropped import %llu after a device wait", why,
             (unsigned long long)a->id);
  free(a);
}

/* A new chunked import of bytes, waiting for its chunks as r->pending. */
static int import_begin(mokd_registry *r, mokk_import_kind kind, size_t bytes, char *err)
{
  uint64_t charge = kind == MOKK_IMPORT_HOST_FD ? bytes : 0;
  mokk_buffer *buf;
  mokd_arena *a;
  char why[MOK_ERRLEN];
  int rc;

  if (kind != MOKK_IMPORT_HOST_FD && r->device < 0)
    return mokk_fail(err, MOK_ENOTSUP, "this daemon runs the %s backend; it imports GPU "
                     "memory only on the cuda backend", mokk_backend_name(r->backend));
  if ((rc = size_ok(r, bytes, "imported buffer", err)) ||
      (rc = mokd_quota_take(r, charge, MOKD_HOST, err)))
    return rc;
  if ((rc = mokk_buffer_import_begin(r->backend, kind, bytes, &buf, err))) {
    mokd_quota_give(r, charge, MOKD_HOST);
    return rc;
  }
  if ((a = calloc(1, sizeof *a)) == NULL) {
    mokd_quota_give(r, charge, MOKD_HOST);
    mokk_buffer_release(r->backend, buf, why);
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  a->id = ++*r->next_id;
  a->kind = ARENA_IMPORTED;
  a->fd = -1;
  a->buf = buf;
  a->base = buf->base;
  a->bytes = buf->bytes;
  a->device = buf->device;
  a->charged = charge;
  a->which = MOKD_HOST;
  r->pending = a;
  r->pending_kind = (int)kind;
  return 0;
}

static const char *import_kind_name(mokk_import_kind kind)
{
  return kind == MOKK_IMPORT_HOST_FD ? "memfd" : kind == MOKK_IMPORT_CUMEM_FD ? "cuMem fd"
                                                                             : "CUDA IPC";
}

/* The chunks of one frame mapped after those before; 0 when all fit. */
static int import_fill(mokd_registry *r, const int *fds, const size_t *sizes, int n, char *err)
{
  mokd_arena *a = r->pending;
  int rc;

  if ((rc = count_ok(r, (uint64_t)n, err)))
    return rc;
  for (int i = 0; i < n; i++) {
    if (sizes[i] == 0)
      return mokk_fail(err, MOK_EZEROSIZE, "chunk %d of the import has size 0", a->maps);
    if (sizes[i] > a->bytes - a->filled)
      return mokk_fail(err, MOK_ERANGE, "the chunks add up to more than the %zu bytes of the "
                       "import: chunk %d of %zu bytes begins at %zu", a->bytes, a->maps,
                       sizes[i], a->filled);
    if ((rc = mokk_buffer_import_chunk(r->backend, a->buf, fds[i], a->filled, sizes[i], err)))
      return rc;
    a->filled += sizes[i];
    a->maps++;
    if (r->pending_all != NULL)
      ++*r->pending_all;
  }
  return 0;
}

int mokd_import_chunks(mokd_registry *r, mokk_import_kind kind, uint64_t continues,
                       size_t bytes, const int *fds, const size_t *sizes, int n,
                       mokd_arena **out, char *err)
{
  mokd_arena *a;
  int rc;

  *out = NULL;
  if (continues == 0) {
    mokd_import_drop(r);
    if ((rc = import_begin(r, kind, bytes, err)))
      return rc;
  } else if (r->pending == NULL || r->pending->id != continues) {
    mokd_import_drop(r);
    return mokk_fail(err, MOK_ENOENT, "no import %llu waits for chunks in this session (an "
                     "error, or another request in between, drops it)",
                     (unsigned long long)continues);
  } else if (bytes != r->pending->bytes) {
    rc = mokk_fail(err, MOK_EINVAL, "the import continued names %zu bytes; it began with %zu",
                   bytes, r->pending->bytes);
    mokd_import_drop(r);
    return rc;
  } else if ((int)kind != r->pending_kind) {
    rc = mokk_fail(err, MOK_EINVAL, "the import continued with chunks of another kind (%s) "
                   "than it began with (%s)", import_kind_name(kind),
                   import_kind_name((mokk_import_kind)r->pending_kind));
    mokd_import_drop(r);
    return rc;
  }
  a = r->pending;
  if ((rc = import_fill(r, fds, sizes, n, err)) ||
      (a->filled == a->bytes && (rc = mokk_buffer_import_commit(r->backend, a->buf, err)))) {
    mokd_import_drop(r);
    return rc;
  }
  if (a->filled == a->bytes) {
    r->pending = NULL;
    if (r->pending_all != NULL) /* from the imports under way to the arenas */
      *r->pending_all -= (uint64_t)a->maps;
    a->next = r->arenas;
    r->arenas = a;
    account(r, a, +1);
  }
  *out = a;
  return 0;
}

mokd_arena *mokd_arena_find(const mokd_registry *r, uint64_t id)
{
  for (mokd_arena *a = r->arenas; a != NULL; a = a->next)
    if (a->id == id)
      return a;
  return NULL;
}

void mokd_arena_free(mokd_registry *r, mokd_arena *a)
{
  mokd_arena **pp = &r->arenas;
  char err[MOK_ERRLEN];

  while (*pp != NULL && *pp != a)
    pp = &(*pp)->next;
  if (*pp == a)
    *pp = a->next;
  account(r, a, -1);
  mokd_quota_give(r, a->charged, a->which);
  if (a->fd >= 0)
    close(a->fd);
  if (mokk_buffer_release(r->backend, a->buf, err) != 0)
    LOG_WARN(SESS, "%s; freed arena %llu after a device wait", err, (unsigned long long)a->id);
  free(a->free);
  free(a);
}

/* len bytes from the front of free span i of a */
static void span_take(mokd_arena *a, size_t i, size_t len, mokd_span *out)
{
  *out = (mokd_span){a->free[i].off, len};
  a->free[i].off += len, a->free[i].len -= len;
  if (a->free[i].len == 0) {
    memmove(&a->free[i], &a->free[i + 1], (a->nfree - i - 1) * sizeof *a->free);
    a->nfree--;
  }
  a->used += len;
}

int mokd_out_alloc(mokd_registry *r, size_t len, mokd_arena **arena, mokd_span *span,
                   char *err)
{
  mokd_arena *a;
  int rc;

  mokd_arena *best = NULL;
  size_t besti = 0;

  len = (len + OUT_ALIGN - 1) / OUT_ALIGN * OUT_ALIGN;
  if (len == 0)
    len = OUT_ALIGN;
  /* best fit over every output arena: small outputs must not split the
   * room that a large one (weight gradients) comes back to each step */
  for (a = r->arenas; a != NULL; a = a->next)
    if (a->kind == ARENA_OUTPUT)
      for (size_t i = 0; i < a->nfree; i++)
        if (a->free[i].len >= len && (best == NULL || a->free[i].len < best->free[besti].len))
          best = a, besti = i;
  if (best == NULL) {
    /* room for many steps' outputs, as far as max_arena_bytes allows */
    size_t size = OUT_ARENA_MIN < r->lim.max_arena_bytes ? OUT_ARENA_MIN
                                                         : (size_t)r->lim.max_arena_bytes;
    if ((rc = mokd_arena_new(r, len > size ? len : size, ARENA_OUTPUT, &best, err)))
      return rc;
    besti = 0;
  }
  span_take(best, besti, len, span);
  *arena = best;
  return 0;
}

void mokd_out_release(mokd_arena *a, mokd_span sp)
{
  size_t i = 0;

  if (a == NULL || sp.len == 0)
    return;
  while (i < a->nfree && a->free[i].off < sp.off)
    i++;
  if (a->nfree == a->capfree) {
    mokd_span *f = realloc(a->free, 2 * a->capfree * sizeof *f);
    if (f == NULL) {
      LOG_WARN(SESS, "out of memory tracking a free block; %zu bytes stay used", sp.len);
      return;
    }
    a->free = f, a->capfree *= 2;
  }
  memmove(&a->free[i + 1], &a->free[i], (a->nfree - i) * sizeof *a->free);
  a->free[i] = sp;
  a->nfree++;
  a->used -= sp.len;
  if (i + 1 < a->nfree && a->free[i].off + a->free[i].len == a->free[i + 1].off) {
    a->free[i].len += a->free[i + 1].len;
    memmove(&a->free[i + 1], &a->free[i + 2], (a->nfree - i - 2) * sizeof *a->free);
    a->nfree--;
  }
  if (i > 0 && a->free[i - 1].off + a->free[i - 1].len == a->free[i].off) {
    a->free[i - 1].len += a->free[i].len;
    memmove(&a->free[i], &a->free[i + 1], (a->nfree - i - 1) * sizeof *a->free);
    a->nfree--;
  }
  /* output arenas stay until the session ends: the client keeps them mapped */
}

static int span_cmp(const void *a, const void *b)
{
  const mokd_span *x = a, *y = b;
  return x->off < y->off ? -1 : x->off > y->off;
}

void mokd_out_release_many(mokd_arena *a, mokd_span *spans, size_t n)
{
  mokd_span *merged;
  size_t i = 0, j = 0, m = 0, cap;

  if (a == NULL || n == 0)
    return;
  cap = a->nfree + n;
  merged = malloc(cap * sizeof *merged);
  if (merged == NULL) {
    for (size_t k = 0; k < n; k++)
      mokd_out_release(a, spans[k]);
    return;
  }
  qsort(spans, n, sizeof *spans, span_cmp);
  /* one merge of two sorted lists, joining neighbours as they meet */
  while (i < a->nfree || j < n) {
    mokd_span next;
    if (j == n || (i < a->nfree && a->free[i].off < spans[j].off)) {
      next = a->free[i++];
    } else {
      next = spans[j++];
      a->used -= next.len;
    }
    if (next.len == 0)
      continue;
    if (m > 0 && merged[m - 1].off + merged[m - 1].len == next.off)
      merged[m - 1].len += next.len;
    else
      merged[m++] = next;
  }
  free(a->free);
  a->free = merged;
  a->nfree = m;
  a->capfree = cap;
}

static size_t dtype_size(Mokd__DType d)
{
  switch (d) {
  case MOKD__DTYPE__DTYPE_BF16: return 2;
  case MOKD__DTYPE__DTYPE_F32:
  case MOKD__DTYPE__DTYPE_I32: return 4;
  default: return 0;
  }
}

static const char *dtype_name(Mokd__DType d)
{
  switch (d) {
  case MOKD__DTYPE__DTYPE_BF16: return "bf16";
  case MOKD__DTYPE__DTYPE_F32: return "f32";
  case MOKD__DTYPE__DTYPE_I32: return "i32";
  default: return "invalid";
  }
}

int mokd_ref_resolve(const mokd_registry *reg, const char *what, const Mokd__TensorRef *r,
                     Mokd__DType dtype, int ndim, int64_t *shape, void **ptr,
                     mokd_arena **arena_out, char *err)
{
  mokd_arena *a;
  uint64_t n = dtype_size(dtype), bytes;

  if (r == NULL)
    return mokk_fail(err, MOK_EINVAL, "%s: tensor is missing", what);
  if ((a = mokd_arena_find(reg, r->arena)) == NULL)
    return mokk_fail(err, MOK_ENOENT, "%s: arena %llu is not an arena of this session",
                     what, (unsigned long long)r->arena);
  if (reg->device >= 0 && a->device < 0)
    return mokk_fail(err, MOK_EDEVICE, "%s: arena %llu is host memory; the %s backend "
                     "reads tensors in GPU arenas (CreateArena on this daemon)", what,
                     (unsigned long long)r->arena, mokk_backend_name(reg->backend));
  if (r->dtype != dtype)
    return mokk_fail(err, MOK_EDTYPE, "%s: dtype is %s; it must be %s", what,
                     dtype_name(r->dtype), dtype_name(dtype));
  if ((int)r->n_shape != ndim)
    return mokk_fail(err, MOK_ESHAPE, "%s: %zu dimensions; it must have %d", what,
                     r->n_shape, ndim);
  bytes = n;
  for (int i = 0; i < ndim; i++) {
    int64_t d = r->shape[i];
    if (d <= 0 || d > MOKK_DIM_MAX)
      return mokk_fail(err, MOK_ESHAPE, "%s: dimension %d is %lld; it must be in [1, %d]",
                       what, i, (long long)d, MOKK_DIM_MAX);
    if (shape[i] >= 0 && shape[i] != d)
      return mokk_fail(err, MOK_ESHAPE, "%s: dimension %d is %lld; it must be %lld", what,
                       i, (long long)d, (long long)shape[i]);
    shape[i] = d;
    if (__builtin_mul_overflow(bytes, (uint64_t)d, &bytes))
      return mokk_fail(err, MOK_EOVERFLOW, "%s: size overflows", what);
  }
  if (r->offset % n != 0)
    return mokk_fail(err, MOK_EINVAL, "%s: offset %llu is not a multiple of %llu", what,
                     (unsigned long long)r->offset, (unsigned long long)n);
  if (r->offset > a->bytes || bytes > a->bytes - r->offset)
    return mokk_fail(err, MOK_ERANGE, "%s: bytes [%llu, %llu) lie outside arena %llu of "
                     "%zu bytes", what, (unsigned long long)r->offset,
                     (unsigned long long)(r->offset + bytes), (unsigned long long)a->id,
                     a->bytes);
  *ptr = (char *)a->base + r->offset;
  if (arena_out != NULL)
    *arena_out = a;
  return 0;
}

Mokd__TensorRef *mokd_ref_new(uint64_t arena, uint64_t offset, Mokd__DType dtype, int ndim,
                              const int64_t *shape)
{
  Mokd__TensorRef *r = malloc(sizeof *r);
  int64_t *sh = malloc((size_t)ndim * sizeof *sh);
  if (r == NULL || sh == NULL) {
    free(r);
    free(sh);
    return NULL;
  }
  mokd__tensor_ref__init(r);
  r->arena = arena, r->offset = offset, r->dtype = dtype;
  memcpy(sh, shape, (size_t)ndim * sizeof *sh);
  r->shape = sh;
  r->n_shape = (size_t)ndim;
  return r;
}

Mokd__TensorRef *mokd_ref_copy(const Mokd__TensorRef *r)
{
  return mokd_ref_new(r->arena, r->offset, r->dtype, (int)r->n_shape, r->shape);
}

void mokd_ref_free(Mokd__TensorRef *r)
{
  if (r != NULL) {
    free(r->shape);
    free(r);
  }
}
