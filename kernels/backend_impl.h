/* backend_impl.h - what a backend implements: the table behind backend.h
 * (ggml-backend-impl.h's role). The step entries are required; the memory
 * and ordering entries are for device backends, and NULL means host memory
 * (kernels/cpu/hostmem.c) and steps that are done when they return. */
#ifndef MOKK_BACKEND_IMPL_H
#define MOKK_BACKEND_IMPL_H

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mokk_backend_iface {
  const char *name;
  int (*forward)(mokk_backend *b, const mokk_shape *s, int64_t T,
                 const mokk_fwd_rank *ranks, mokk_ctx **ctx, char *err);
  int (*backward)(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode, unsigned flags,
                  const mokk_bwd_rank *ranks, char *err);
  void (*ctx_free)(mokk_backend *b, mokk_ctx *ctx);
  size_t (*ctx_bytes)(const mokk_ctx *ctx);
  void (*destroy)(mokk_backend *b);

  /* device memory; host fds are always imported as host memory */
  int (*buffer_alloc)(mokk_backend *b, size_t bytes, mokk_buffer **out, int *fd, char *err);
  int (*buffer_import)(mokk_backend *b, const mokk_import *src, mokk_buffer **out, char *err);
  /* chunked imports of device memory; NULL = none */
  int (*import_begin)(mokk_backend *b, size_t bytes, mokk_buffer **out, char *err);
  int (*import_chunk)(mokk_backend *b, mokk_buffer *buf, int fd, size_t offset, size_t bytes,
                      char *err);
  int (*import_commit)(mokk_backend *b, mokk_buffer *buf, char *err);
  int (*buffer_release)(mokk_backend *b, mokk_buffer *buf, char *err);
  int (*reap)(mokk_backend *b, int wait);
  uint64_t (*mem_total)(const mokk_backend *b);
  /* ordering with a client process */
  int (*events_new)(mokk_backend *b, mokk_events **out, char *err);
  void (*events_free)(mokk_backend *b, mokk_events *ev);
  int (*step_begin)(mokk_backend *b, mokk_events *ev, const void *ready, char *err);
  int (*step_end)(mokk_backend *b, mokk_events *ev, int32_t *status, int last, void *done,
                  char *err);
  /* health, on the executor thread: a sticky device error, or 0; NULL = none */
  int (*check)(mokk_backend *b, char *err);
  /* the bound of mokk_backend_ctx_bound; NULL = mokk_ctx_bytes_bound */
  uint64_t (*ctx_bound)(const mokk_backend *b, const mokk_shape *s, int64_t T, int spans);
} mokk_backend_iface;

struct mokk_backend {
  const mokk_backend_iface *iface;
  int device; /* CUDA ordinal; -1 = host */
};

/* Host memory (kernels/cpu/hostmem.c): a sealed memfd mapped here. */
int mokk_host_alloc(size_t bytes, mokk_buffer **out, int *fd, char *err);
int mokk_host_import(int fd, size_t bytes, mokk_buffer **out, char *err);
/* A chunked import of memfds: an inaccessible reservation, then each memfd
 * mapped over its part; mokk_host_free unmaps it all. */
int mokk_host_reserve(size_t bytes, mokk_buffer **out, char *err);
int mokk_host_import_chunk(mokk_buffer *buf, int fd, size_t offset, size_t bytes, char *err);
void mokk_host_free(mokk_buffer *buf);

#ifdef __cplusplus
}
#endif

#endif
