/* backend.h - the one interface the daemon talks to: a small table of function
 * pointers per backend (cpu always exists; cuda when built). Arguments are
 * validated here, once, before a backend sees them. */
#ifndef MOKK_BACKEND_H
#define MOKK_BACKEND_H

#include "layer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mokk_backend mokk_backend;
typedef struct mokk_ctx mokk_ctx; /* what a forward saves for its backward */

typedef struct mokk_backend_iface {
  const char *name;
  /* One step over shape->P ranks of T tokens. ctx may be NULL (inference);
   * otherwise *ctx receives the saved state, which keeps pointers to the
   * weights: they must stay valid and unchanged until the backward. */
  int (*forward)(mokk_backend *b, const mokk_shape *s, int64_t T,
                 const mokk_fwd_rank *ranks, mokk_ctx **ctx, char *err);
  int (*backward)(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode,
                  const mokk_bwd_rank *ranks, char *err);
  void (*ctx_free)(mokk_backend *b, mokk_ctx *ctx);
  size_t (*ctx_bytes)(const mokk_ctx *ctx);
  void (*destroy)(mokk_backend *b);
} mokk_backend_iface;

struct mokk_backend {
  const mokk_backend_iface *iface;
};

/* Every backend's context starts with this header. */
struct mokk_ctx {
  mokk_shape shape;
  int64_t T;
};

/* threads <= 0 means one per online CPU. */
int mokk_cpu_create(int threads, mokk_backend **out, char *err);
int mokk_cpu_threads(const mokk_backend *b);

int mokk_forward(mokk_backend *b, const mokk_shape *s, int64_t T,
                 const mokk_fwd_rank *ranks, mokk_ctx **ctx, char *err);
int mokk_backward(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode,
                  const mokk_bwd_rank *ranks, char *err);
void mokk_ctx_free(mokk_backend *b, mokk_ctx *ctx);
size_t mokk_ctx_bytes(const mokk_backend *b, const mokk_ctx *ctx);
void mokk_backend_destroy(mokk_backend *b);
const char *mokk_backend_name(const mokk_backend *b);

#ifdef __cplusplus
}
#endif

#endif
