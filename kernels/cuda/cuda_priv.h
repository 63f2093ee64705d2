/* cuda_priv.h - what the CUDA backend's files share: the backend and context
 * structs, and the helpers between the step code (cuda_moe.cu), the backend's
 * lifecycle (cuda_backend.cu), GPU memory (gpumem.cu) and events (ipc.cu). */
#ifndef MOKK_CUDA_PRIV_H
#define MOKK_CUDA_PRIV_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdlib.h>

#include "check.cuh"
#include "cuda_backend.h"

typedef struct cuda_backend {
  mokk_backend base;
  int device, sms, max_blocks;
  cudaStream_t stream;
  int *status;   /* device: bit 0 = an expert id out of range */
} cuda_backend;

typedef struct cuda_ctx {
  mokk_ctx hdr;
  const __nv_bfloat16 *x;
  const __nv_bfloat16 *w[MOKK_NWEIGHTS];
  int *count, *row_start, *tile_off, *slot, *src;
  float *row_w;              /* [TK] router weight of each row */
  __nv_bfloat16 *xr;         /* [TK, H] dispatched rows */
  float *g, *u;              /* [TK, I] gate and up before the clamp */
  __nv_bfloat16 *h;          /* [TK, I] */
  __nv_bfloat16 *y;          /* [TK, H] expert output per row */
  float *gs, *us;            /* [T, I_s] */
  __nv_bfloat16 *hs;         /* [T, I_s] */
  void *block;               /* one allocation holding all of the above */
  size_t bytes;
} cuda_ctx;

/* the step code's names for the checks of check.cuh */
#define cuda_fail(err, e, what) mokk_cuda_fail_at((err), (e), (what), __FILE__, __LINE__)
#define CK(call) CUDA_CHECK(call)

static inline void ctx_release(cuda_backend *cb, cuda_ctx *c)
{
  if (c->block != NULL)
    cudaFreeAsync(c->block, cb->stream); /* stream-ordered: after the queued work */
  free(c);
}

/* The iface's forward and backward entries: cuda_moe.cu's cuda_forward and
 * cuda_backward, reached from the table in cuda_backend.cu. */
int cuda_forward_entry(mokk_backend *b, const mokk_shape *s, int64_t T,
                       const mokk_fwd_rank *ranks, mokk_ctx **out_ctx, char *err);
int cuda_backward_entry(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode,
                        const mokk_bwd_rank *ranks, char *err);

/* ipc.cu: records the session's done event on stream; handle gets its IPC handle */
int mokk_cuda_events_record(mokk_cuda_events *ev, cudaStream_t stream, void *handle,
                            char *err);

#endif
