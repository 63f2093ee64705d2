/* registry.c - a session's arenas: memfds the daemon creates and shares,
 * buffers clients import, output arenas with a best-fit block allocator, and
 * the validation of every tensor a request names. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "mokd.h"

#define OUT_ALIGN 256
#define OUT_ARENA_MIN (64u << 20)

int mokd_quota_take(mokd_session *s, uint64_t bytes, int gpu, char *err)
{
  uint64_t q = (uint64_t)(gpu ? s->srv->cfg.session_gpu_quota_bytes
                              : s->srv->cfg.session_quota_bytes);
  uint64_t *held = gpu ? &s->gpu_bytes : &s->bytes;
  if (q > 0 && (*held + bytes > q || *held + bytes < *held))
    return mokk_fail(err, MOK_EDQUOT, "session would hold %llu bytes of %s memory; its quota "
                     "is %llu (%s)", (unsigned long long)(*held + bytes), gpu ? "GPU" : "host",
                     (unsigned long long)q,
                     gpu ? "session_gpu_quota_bytes" : "session_quota_bytes");
  *held += bytes;
  if (gpu)
    s->usage.gpu_bytes += bytes, s->srv->usage.gpu_bytes += bytes;
  return 0;
}

void mokd_quota_give(mokd_session *s, uint64_t bytes, int gpu)
{
  if (gpu) {
    s->gpu_bytes -= bytes;
    s->usage.gpu_bytes -= bytes, s->srv->usage.gpu_bytes -= bytes;
  } else {
    s->bytes -= bytes;
  }
}

static void account(mokd_session *s, const mokd_arena *a, int sign)
{
  mok_usage *u[2] = {&s->usage, &s->srv->usage};
  for (int i = 0; i < 2; i++) {
    u[i]->arenas += (uint64_t)(int64_t)sign;
    u[i]->arena_bytes += (uint64_t)((int64_t)sign * (int64_t)a->bytes);
  }
}

static void link_arena(mokd_session *s, mokd_arena *a)
{
  a->id = ++s->srv->next_id;
  a->next = s->arenas;
  s->arenas = a;
  account(s, a, +1);
}

int mokd_arena_new_memfd(mokd_session *s, size_t bytes, mokd_arena_kind kind,
                         mokd_arena **out, char *err)
{
  mokd_arena *a;
  int fd, rc;

  if (bytes == 0)
    return mokk_fail(err, MOK_EZEROSIZE, "arena size is 0");
  if (bytes > (uint64_t)s->srv->cfg.max_arena_bytes)
    return mokk_fail(err, MOK_EINVAL, "arena of %zu bytes is larger than max_arena_bytes "
                     "(%lld)", bytes, (long long)s->srv->cfg.max_arena_bytes);
  if ((rc = mokd_quota_take(s, bytes, 0, err)))
    return rc;
  a = calloc(1, sizeof *a);
  fd = memfd_create("mokd-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (a == NULL || fd < 0 || ftruncate(fd, (off_t)bytes) != 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    rc = mokk_fail(err, MOK_ENOMEM, "cannot create a %zu-byte arena: %s", bytes,
                   strerror(errno));
    goto fail;
  }
  a->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (a->base == MAP_FAILED) {
    rc = mokk_fail(err, MOK_ENOMEM, "cannot map a %zu-byte arena: %s", bytes,
                   strerror(errno));
    goto fail;
  }
  a->fd = fd;
  a->bytes = bytes;
  a->kind = kind;
  if (kind == ARENA_OUTPUT) {
    a->free = malloc(4 * sizeof *a->free);
    if (a->free == NULL) {
      munmap(a->base, bytes);
      rc = mokk_fail(err, MOK_ENOMEM, "out of memory");
      goto fail;
    }
    a->free[0] = (mokd_span){0, bytes};
    a->nfree = 1, a->capfree = 4;
  }
  link_arena(s, a);
  *out = a;
  return 0;

fail:
  if (fd >= 0)
    close(fd);
  free(a);
  mokd_quota_give(s, bytes, 0);
  return rc;
}

#ifdef MOKD_HAVE_CUDA
static int arena_new_gpu(mokd_session *s, size_t bytes, mokd_arena_kind kind,
                         mokd_arena **out, char *err)
{
  mokd_arena *a;
  int fd = -1, rc;

  if (bytes == 0)
    return mokk_fail(err, MOK_EZEROSIZE, "arena size is 0");
  if (bytes > (uint64_t)s->srv->cfg.max_arena_bytes)
    return mokk_fail(err, MOK_EINVAL, "arena of %zu bytes is larger than max_arena_bytes "
                     "(%lld)", bytes, (long long)s->srv->cfg.max_arena_bytes);
  if ((a = calloc(1, sizeof *a)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  if ((rc = mokk_gpu_mem_create(s->cuda_device - 1, bytes, &a->gpu, &fd, err))) {
    free(a);
    return rc;
  }
  /* the quota counts what the GPU really holds: the size rounded up */
  if ((rc = mokd_quota_take(s, a->gpu.bytes, 1, err))) {
    mokk_gpu_mem_free(&a->gpu);
    close(fd);
    free(a);
    return rc;
  }
  a->base = a->gpu.ptr;
  a->bytes = a->gpu.bytes;
  a->device = s->cuda_device;
  a->fd = fd;
  a->kind = kind;
  if (kind == ARENA_OUTPUT) {
    if ((a->free = malloc(4 * sizeof *a->free)) == NULL) {
      mokd_quota_give(s, a->bytes, 1);
      mokk_gpu_mem_free(&a->gpu);
      close(fd);
      free(a);
      return mokk_fail(err, MOK_ENOMEM, "out of memory");
    }
    a->free[0] = (mokd_span){0, a->bytes};
    a->nfree = 1, a->capfree = 4;
  }
  link_arena(s, a);
  *out = a;
  return 0;
}
#endif

int mokd_arena_new(mokd_session *s, size_t bytes, mokd_arena_kind kind, mokd_arena **out,
                   char *err)
{
#ifdef MOKD_HAVE_CUDA
  if (s->cuda_device > 0)
    return arena_new_gpu(s, bytes, kind, out, err);
#endif
  return mokd_arena_new_memfd(s, bytes, kind, out, err);
}

int mokd_arena_import(mokd_session *s, int fd, size_t bytes, mokd_arena **out, char *err)
{
  struct stat st;
  int seals;
  mokd_arena *a;
  void *base;

  if (bytes == 0)
    return mokk_fail(err, MOK_EZEROSIZE, "imported buffer size is 0");
  if (bytes > (uint64_t)s->srv->cfg.max_arena_bytes)
    return mokk_fail(err, MOK_EINVAL, "buffer of %zu bytes is larger than max_arena_bytes",
                     bytes);
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    return mokk_fail(err, MOK_EINVAL, "the fd sent with ImportBuffer is not a memfd or "
                     "regular file");
  if ((uint64_t)st.st_size < bytes)
    return mokk_fail(err, MOK_ERANGE, "the fd holds %lld bytes, fewer than the %zu named",
                     (long long)st.st_size, bytes);
  /* a client that could shrink the file under us would fault the daemon */
  seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK))
    return mokk_fail(err, MOK_EINVAL, "imported buffers must be memfds sealed with "
                     "F_SEAL_SHRINK (memfd_create with MFD_ALLOW_SEALING, then F_ADD_SEALS)");
  base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    return mokk_fail(err, MOK_EINVAL, "cannot map the imported fd: %s", strerror(errno));
  a = calloc(1, sizeof *a);
  if (a == NULL) {
    munmap(base, bytes);
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  a->kind = ARENA_IMPORTED;
  a->fd = -1;
  a->base = base;
  a->bytes = bytes;
  link_arena(s, a);
  *out = a;
  return 0;
}

int mokd_arena_import_gpu(mokd_session *s, const void *ipc, int fd, size_t bytes,
                          mokd_arena **out, char *err)
{
#ifdef MOKD_HAVE_CUDA
  mokd_arena *a;
  int rc;

  if (s->cuda_device <= 0)
    return mokk_fail(err, MOK_ENOTSUP, "this daemon runs the %s backend; it imports GPU "
                     "memory only on the cuda backend", mokk_backend_name(s->backend));
  if (bytes == 0)
    return mokk_fail(err, MOK_EZEROSIZE, "imported buffer size is 0");
  if (bytes > (uint64_t)s->srv->cfg.max_arena_bytes)
    return mokk_fail(err, MOK_EINVAL, "buffer of %zu bytes is larger than max_arena_bytes",
                     bytes);
  if ((a = calloc(1, sizeof *a)) == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  rc = ipc != NULL ? mokk_gpu_import_ipc(s->cuda_device - 1, ipc, bytes, &a->imp, err)
                   : mokk_gpu_import_fd(s->cuda_device - 1, fd, bytes, &a->imp, err);
  if (rc) {
    free(a);
    return rc;
  }
  a->kind = ARENA_IMPORTED;
  a->fd = -1;
  a->base = a->imp.ptr;
  a->bytes = bytes;
  a->device = s->cuda_device;
  link_arena(s, a);
  *out = a;
  return 0;
#else
  (void)s, (void)ipc, (void)fd, (void)bytes, (void)out;
  return mokk_fail(err, MOK_ENOTSUP, "this mokd was built without CUDA; it cannot import "
                   "GPU memory");
#endif
}

mokd_arena *mokd_arena_find(mokd_session *s, uint64_t id)
{
  for (mokd_arena *a = s->arenas; a != NULL; a = a->next)
    if (a->id == id)
      return a;
  return NULL;
}

static void arena_release(mokd_arena *a)
{
#ifdef MOKD_HAVE_CUDA
  if (a->device > 0 && a->kind == ARENA_IMPORTED)
    mokk_gpu_import_free_now(&a->imp);
  else if (a->device > 0)
    mokk_gpu_mem_free_now(&a->gpu);
  else
#endif
    munmap(a->base, a->bytes);
  if (a->fd >= 0)
    close(a->fd);
  free(a->free);
  free(a);
}

#ifdef MOKD_HAVE_CUDA
static void on_reap(uv_timer_t *t)
{
  mokd_server *srv = t->data;
  mokd_arena **pp = &srv->retired;
  while (*pp != NULL) {
    mokd_arena *a = *pp;
    if (mokk_cuda_fence_passed(a->fence)) {
      *pp = a->next;
      mokk_cuda_fence_free(a->fence);
      arena_release(a);
    } else {
      pp = &a->next;
    }
  }
  if (srv->retired == NULL)
    uv_timer_stop(t);
}

/* Hands a GPU arena to the reaper; 0, or -1 when it must go now. */
static int retire(mokd_server *srv, mokk_backend *b, mokd_arena *a)
{
  char err[MOK_ERRLEN];
  if (mokk_cuda_fence(b, &a->fence, err) != 0) {
    LOG_WARN(SESS, "%s; freeing arena %llu after a device wait", err,
             (unsigned long long)a->id);
    return -1;
  }
  a->next = srv->retired;
  srv->retired = a;
  if (!srv->stopped) {
    if (!srv->reaper_on) {
      uv_timer_init(srv->loop, &srv->reaper);
      srv->reaper.data = srv;
      srv->reaper_on = 1;
    }
    uv_timer_start(&srv->reaper, on_reap, 1, 1);
  }
  return 0;
}
#endif

void mokd_retired_stop(mokd_server *srv)
{
  if (srv->reaper_on)
    uv_close((uv_handle_t *)&srv->reaper, NULL);
  srv->reaper_on = 0;
}

void mokd_retired_drain(mokd_server *srv)
{
#ifdef MOKD_HAVE_CUDA
  for (int i = 0; srv->retired != NULL && i < srv->ngpus; i++)
    mokk_cuda_sync(srv->gpus[i].backend, (char[MOK_ERRLEN]){0});
  while (srv->retired != NULL) {
    mokd_arena *a = srv->retired;
    srv->retired = a->next;
    mokk_cuda_fence_free(a->fence);
    arena_release(a);
  }
#else
  (void)srv;
#endif
}

void mokd_arena_free(mokd_session *s, mokd_arena *a)
{
  mokd_arena **pp = &s->arenas;
  while (*pp != NULL && *pp != a)
    pp = &(*pp)->next;
  if (*pp == a)
    *pp = a->next;
  account(s, a, -1);
  if (a->kind != ARENA_IMPORTED)
    mokd_quota_give(s, a->bytes, a->device > 0);
#ifdef MOKD_HAVE_CUDA
  if (a->device > 0 && retire(s->srv, s->backend, a) == 0)
    return;
  if (a->device > 0)
    mokk_cuda_sync(s->backend, (char[MOK_ERRLEN]){0});
#endif
  arena_release(a);
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

int mokd_out_alloc(mokd_session *s, size_t len, mokd_arena **arena, mokd_span *span,
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
  for (a = s->arenas; a != NULL; a = a->next)
    if (a->kind == ARENA_OUTPUT)
      for (size_t i = 0; i < a->nfree; i++)
        if (a->free[i].len >= len && (best == NULL || a->free[i].len < best->free[besti].len))
          best = a, besti = i;
  if (best == NULL) {
    if ((rc = mokd_arena_new(s, len > OUT_ARENA_MIN ? len : OUT_ARENA_MIN, ARENA_OUTPUT, &best,
                             err)))
      return rc;
    besti = 0;
  }
  span_take(best, besti, len, span);
  *arena = best;
  return 0;
}

void mokd_out_release(mokd_session *s, mokd_arena *a, mokd_span sp)
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
  (void)s;
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

int mokd_ref_resolve(mokd_session *s, const char *what, const Mokd__TensorRef *r,
                     Mokd__DType dtype, int ndim, int64_t *shape, void **ptr,
                     mokd_arena **arena_out, char *err)
{
  mokd_arena *a;
  uint64_t n = dtype_size(dtype), bytes;

  if (r == NULL)
    return mokk_fail(err, MOK_EINVAL, "%s: tensor is missing", what);
  if ((a = mokd_arena_find(s, r->arena)) == NULL)
    return mokk_fail(err, MOK_ENOENT, "%s: arena %llu is not an arena of this session",
                     what, (unsigned long long)r->arena);
  if (s->cuda_device > 0 && a->device == 0)
    return mokk_fail(err, MOK_EDEVICE, "%s: arena %llu is host memory; the cuda backend "
                     "reads tensors in GPU arenas (CreateArena on this daemon)", what,
                     (unsigned long long)r->arena);
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
    free(r), free(sh);
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
