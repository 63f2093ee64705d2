/* backend.c - argument checks in front of every backend's entry points. */
#include "backend.h"

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
  return b->iface->forward(b, s, T, ranks, ctx, err);
}

int mokk_backward(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode,
                  const mokk_bwd_rank *ranks, char *err)
{
  int rc;

  if (b == NULL || ctx == NULL)
    return mokk_fail(err, MOK_ENULL, "backend or forward context is NULL");
  if ((rc = mokk_bwd_check(&ctx->shape, ctx->T, mode, ranks, err)))
    return rc;
  return b->iface->backward(b, ctx, mode, ranks, err);
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
