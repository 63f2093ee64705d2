/* backend.c - argument checks in front of every backend's entry points, and
 * the defaults of the optional ones: host memory, steps done on return. */
#include "backend_impl.h"

/* A rank runs on the step's backend or on another of its kind, which the
 * backend then accepts (linked GPUs) or refuses. */
static int rank_dev_check(const mokk_backend *b, int r, const mokk_backend *dev, char *err)
{
  if (dev != NULL && dev->iface != b->iface)
    return mokk_fail(err, MOK_EINVAL, "EP rank %d names a %s backend to run on; the step's "
                     "backend is %s", r, dev->iface->name, b->iface->name);
  return 0;
}

int mokk_forward(mokk_backend *b, const mokk_shape *s, int64_t T,
                 const mokk_fwd_rank *ranks, mokk_ctx **ctx, char *err)
{
  int rc;

  if (b == NULL)
    return mokk_fail(err, MOK_ENULL, "backend is NULL");
  if (ctx != NULL)
    *ctx = NULL;
  if ((rc = mokk_fwd_check(s, T, ranks, err)))
    return rc;
  for (int r = 0; r < s->P; r++)
    if ((rc = rank_dev_check(b, r, ranks[r].dev, err)))
      return rc;
  return b->iface->forward(b, s, T, ranks, ctx, err);
}

int mokk_backward(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode,
                  const mokk_bwd_rank *ranks, char *err)
{
  return mokk_backward_flags(b, ctx, mode, 0, ranks, err);
}

int mokk_backward_flags(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode, unsigned flags,
                        const mokk_bwd_rank *ranks, char *err)
{
  int rc;

  if (b == NULL || ctx == NULL)
    return mokk_fail(err, MOK_ENULL, "backend or forward context is NULL");
  if (flags & ~(unsigned)MOKK_BWD_LAST)
    return mokk_fail(err, MOK_EINVAL, "unknown backward flags 0x%x", flags);
  if (ctx->used)
    return mokk_fail(err, MOK_ECONTEXT, "the forward's saved state was used up by an earlier "
                     "backward that was its last; run the forward again");
  if ((rc = mokk_bwd_check(&ctx->shape, ctx->T, mode, ranks, err)))
    return rc;
  for (int r = 0; r < ctx->shape.P; r++)
    if ((rc = rank_dev_check(b, r, ranks[r].dev, err)))
      return rc;
  rc = b->iface->backward(b, ctx, mode, flags, ranks, err);
  /* even a failed one may have written over the saved state */
  if (flags & MOKK_BWD_LAST)
    ctx->used = 1;
  return rc;
}

uint64_t mokk_backend_ctx_bound(const mokk_backend *b, const mokk_shape *s, int64_t T,
                                int spans)
{
  if (b->iface->ctx_bound != NULL)
    return b->iface->ctx_bound(b, s, T, spans);
  return mokk_ctx_bytes_bound(s, T);
}

void mokk_ctx_free(mokk_backend *b, mokk_ctx *ctx)
{
  if (b != NULL && ctx != NULL)
    b->iface->ctx_free(b, ctx);
}

size_t mokk_ctx_bytes(const mokk_backend *b, const mokk_ctx *ctx)
{
  return b != NULL && ctx != NULL ? b->iface->ctx_bytes(ctx) : 0;
}

void mokk_backend_destroy(mokk_backend *b)
{
  if (b != NULL)
    b->iface->destroy(b);
}

const char *mokk_backend_name(const mokk_backend *b)
{
  return b != NULL ? b->iface->name : "none";
}

int mokk_backend_device(const mokk_backend *b)
{
  return b != NULL ? b->device : -1;
}

uint64_t mokk_backend_mem_total(const mokk_backend *b)
{
  return b != NULL && b->iface->mem_total != NULL ? b->iface->mem_total(b) : 0;
}

int mokk_buffer_alloc(mokk_backend *b, size_t bytes, mokk_buffer **out, int *fd, char *err)
{
  *out = NULL;
  *fd = -1;
  if (b->iface->buffer_alloc == NULL)
    return mokk_host_alloc(bytes, out, fd, err);
  return b->iface->buffer_alloc(b, bytes, out, fd, err);
}

int mokk_buffer_import(mokk_backend *b, const mokk_import *src, mokk_buffer **out, char *err)
{
  *out = NULL;
  if (src->kind == MOKK_IMPORT_HOST_FD)
    return mokk_host_import(src->fd, src->bytes, out, err);
  if (b->iface->buffer_import == NULL)
    return mokk_fail(err, MOK_ENOTSUP, "the %s backend imports no device memory",
                     b->iface->name);
  return b->iface->buffer_import(b, src, out, err);
}

int mokk_buffer_import_begin(mokk_backend *b, mokk_import_kind kind, size_t bytes,
                             mokk_buffer **out, char *err)
{
  *out = NULL;
  if (kind == MOKK_IMPORT_HOST_FD)
    return mokk_host_reserve(bytes, out, err);
  if (kind != MOKK_IMPORT_CUMEM_FD || b->iface->import_begin == NULL)
    return mokk_fail(err, MOK_ENOTSUP, "the %s backend imports no device memory made of "
                     "several allocations", b->iface->name);
  return b->iface->import_begin(b, bytes, out, err);
}

int mokk_buffer_import_chunk(mokk_backend *b, mokk_buffer *buf, int fd, size_t offset,
                             size_t bytes, char *err)
{
  if (buf->device < 0)
    return mokk_host_import_chunk(buf, fd, offset, bytes, err);
  return b->iface->import_chunk(b, buf, fd, offset, bytes, err);
}

int mokk_buffer_import_commit(mokk_backend *b, mokk_buffer *buf, char *err)
{
  if (buf->device < 0)
    return 0;
  return b->iface->import_commit(b, buf, err);
}

int mokk_buffer_release(mokk_backend *b, mokk_buffer *buf, char *err)
{
  if (buf == NULL)
    return 0;
  /* host memory is read by no queued work: steps on host memory have returned */
  if (buf->device < 0 || b->iface->buffer_release == NULL) {
    mokk_host_free(buf);
    return 0;
  }
  return b->iface->buffer_release(b, buf, err);
}

int mokk_backend_reap(mokk_backend *b, int wait)
{
  return b != NULL && b->iface->reap != NULL ? b->iface->reap(b, wait) : 0;
}

int mokk_backend_check(mokk_backend *b, char *err)
{
  return b->iface->check != NULL ? b->iface->check(b, err) : 0;
}

int mokk_events_make(mokk_backend *b, mokk_events **ev, char *err)
{
  if (b->iface->events_new == NULL || *ev != NULL)
    return 0;
  return b->iface->events_new(b, ev, err);
}

int mokk_step_begin(mokk_backend *b, mokk_events **ev, const void *ready, char *err)
{
  int rc;

  if (b->iface->step_begin == NULL)
    return 0;
  if ((rc = mokk_events_make(b, ev, err)) != 0)
    return rc;
  return b->iface->step_begin(b, *ev, ready, err);
}

int mokk_step_end(mokk_backend *b, mokk_events *ev, int32_t *status, int last, void *done,
                  char *err)
{
  if (ev == NULL || b->iface->step_end == NULL)
    return 0;
  return b->iface->step_end(b, ev, status, last, done, err);
}

void mokk_events_free(mokk_backend *b, mokk_events *ev)
{
  if (b != NULL && ev != NULL)
    b->iface->events_free(b, ev);
}
