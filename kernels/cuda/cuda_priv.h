/* cuda_priv.h - what the CUDA backend's files share: the backend and context
 * structs, and the helpers between the step code (cuda_moe.cu), the backend's
 * lifecycle (cuda_backend.cu), GPU memory (gpumem.cu) and events (ipc.cu). */
#ifndef MOKK_CUDA_PRIV_H
#define MOKK_CUDA_PRIV_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdlib.h>

#include "backend_impl.h"
#include "check.cuh"
#include "cuda_backend.h"

typedef struct cuda_buffer cuda_buffer;

/* The kernel choices of a step: the backend's defaults (MOKD_GEMM_* and
 * mokk_cuda_set_*, cuda_backend.dflt) with the layer's tuning over them
 * (cuda_backend.k, set as each step enters). None changes the bits. */
typedef struct cuda_knobs {
  int tiles;        /* MOKK_TILES_* of the grouped NT/NN GEMMs; auto = wide (MOKD_GEMM_TILES) */
  int wgrad_tiles;  /* MOKK_TILES_AUTO, _WIDE or _PINGPONG (MOKD_GEMM_WGRAD_TILES) */
  int clusters;     /* grouped NT/NN GEMMs on clusters of two (MOKD_GEMM_CLUSTERS): 0 none,
                     * 1 the data gradients, 2 the forward's too, as pairs (sm90/scheduler.cuh,
                     * paired) */
  int dynamic;      /* grouped NT GEMMs take tiles from a counter (MOKD_GEMM_ORDER) */
  int ride;         /* experts' short tails ride on full m-tiles: MOKK_RIDE_* (MOKD_GEMM_RIDE) */
  int gather;       /* gate/up GEMMs pick rows out of x (MOKD_GEMM_GATHER): 1 the forward's and
                     * the weight gradient's, 2 the forward's alone; a default of
                     * MOKK_GATHER_AUTO is 2 or 0 by the step's shape (step_knobs) */
  int gather_ahead; /* blocks of the forward's dispatch beside its gate/up GEMM; 0: the
                     * dispatch runs before it on the whole GPU (MOKD_GATHER_AHEAD) */
  int gather_tokens; /* the gather passes read x token by token (MOKD_GATHER_ORDER) */
  int store_regs;   /* the forward's and the weight gradients' epilogues store from registers
                     * (MOKD_GEMM_STORES=regs) */
  int dx_halves;    /* the backward's d_x in two column halves (MOKD_DX_HALVES; 1 default) */
  int wgrad_keep;   /* stages a 128 x 256 weight-gradient tile keeps for its stores, 0-2;
                     * -1: by the rows an expert (MOKD_GEMM_WGRAD_KEEP) */
} cuda_knobs;
/* A tuning's clusters and tails are these knobs' values plus one (0 there is
 * the default): step_knobs and mokk_cuda_step_tuning convert by it. */
static_assert(MOKK_CLUSTERS_NONE == 1 && MOKK_CLUSTERS_DGRAD == 2 && MOKK_CLUSTERS_ALL == 3 &&
                  MOKK_TAILS_OWN == MOKK_RIDE_OFF + 1 && MOKK_TAILS_RIDE == MOKK_RIDE_AUTO + 1 &&
                  MOKK_TAILS_SPLIT == MOKK_RIDE_SPLIT + 1 &&
                  MOKK_TAILS_WHOLE == MOKK_RIDE_WHOLE + 1,
              "tuning and knob numbers are one apart");

/* What a backend keeps on a linked GPU for the ranks of its steps that run
 * there (made on first use): the backend owns them, so that the executors of
 * two GPUs never share a stream or a tile counter. */
typedef struct cuda_peer {
  int linked;       /* peer access both ways, pools shared (mokk_cuda_link) */
  int arch;         /* its compute capability, as cuda_backend.arch */
  int sms;          /* its multiprocessors, as cuda_backend.sms */
  cudaStream_t part_st[MOKK_DEVICE_MAX_RANKS];
  cudaEvent_t part_ev[MOKK_DEVICE_MAX_RANKS];
  int *tile_ctr;    /* [MOKK_DEVICE_MAX_RANKS], on that device */
  /* the work of that device that follows a step on the backend's stream:
   * the done events of its clients and the frees of its rank buffers */
  cudaStream_t tail;
  cudaEvent_t tail_ev;
} cuda_peer;

typedef struct cuda_backend {
  mokk_backend base;
  int device, sms, max_blocks;
  int arch;             /* compute capability as 10 major + minor; 0 until asked */
  cuda_knobs dflt;      /* the defaults: the environment's, or mokk_cuda_set_*'s */
  cuda_knobs k;         /* the step's: dflt with its layer's tuning over them */
  int gu_chunks;        /* d_g | d_u in pairs of 64-column blocks (gemm_args.gu_chunks):
                         * set by cuda_backward for one call whose d_h writes them over the
                         * g it reads (Hopper, a last backward, H <= 3 I); 0 elsewhere and
                         * on every rank of a spread step */
  mokk_cuda_bwd_info last_bwd; /* mokk_cuda_last_backward */
  cudaStream_t stream;
  int *status;          /* device: bit 0 = an expert id out of range */
  /* device: the tile counter of the GEMMs on `stream` (dynamic order; each
   * launch zeroes it), then one for each rank stream */
  int *tile_ctr;
  cuda_buffer *retired; /* released, waiting for their fence (loop thread only) */
  /* EP steps spread over a buffer set and a stream per rank (cuda_moe.cu,
   * "spread steps"), as ranks on several GPUs will run; off by default,
   * where the virtual ranks of this one device share one buffer set, and on
   * with mokk_cuda_set_spread or MOKD_EP_SPREAD=1. The rank streams fork
   * from `stream` and join into it, which is all the client's events see. */
  int spread;
  cudaStream_t part_st[MOKK_DEVICE_MAX_RANKS];
  cudaEvent_t part_ev[MOKK_DEVICE_MAX_RANKS], fork_ev;
  /* ranks on other GPUs (indexed by ordinal; this one's entry stays unused)
   * and the event that hands the backend's stream over to their tails */
  cuda_peer peer[MOKK_CUDA_MAX_DEVICES];
  cudaEvent_t hop_ev;
} cuda_backend;

/* One rank's buffer set of a spread step (cuda_moe.cu): the whole schedule,
 * computed from every rank's ids, and the rows of its own experts, at their
 * rows of that schedule (the rest of each [TK, ...] buffer is not written). */
typedef struct cuda_part {
  int device;                /* where the rank ran: its buffers are that GPU's */
  void *block;               /* one allocation holding the rest */
  size_t bytes;
  int32_t *ids;              /* [TK] every rank's ids, rank 0's first, then own ids */
  float *tw;                 /* [TK] every rank's router weights */
  int *count, *row_start, *tile_off, *slot, *src;
  float *row_w;
  __nv_bfloat16 *xr, *h, *y; /* [TK, ...]: this rank's experts' rows */
  float *g, *u;
  float *gs, *us;            /* [P T, I_s]: this rank's tokens, r T.. (all ranks' hs
                              * once a backward has gathered them) */
  __nv_bfloat16 *hs;
  const __nv_bfloat16 *x;    /* [P T, H] every rank's x (train, shared expert) */
} cuda_part;

typedef struct cuda_ctx {
  mokk_ctx hdr;               /* T: tokens per rank; shape.P ranks (virtual, one device) */
  /* x of every rank's tokens, [P T, H], rank 0's first, for the backward's
   * gather of xr and the shared expert's weight gradient: the client's for
   * P = 1, a copy otherwise */
  const __nv_bfloat16 *x;
  const __nv_bfloat16 *w[MOKK_DEVICE_MAX_RANKS][MOKK_NWEIGHTS]; /* each rank's */
  int *count, *row_start, *tile_off, *slot, *src; /* over all ranks' pairs, TK = P T K */
  float *row_w;              /* [TK] router weight of each row */
  /* no gathered rows (xr): the forward writes them in y's place and the
   * backward gathers them again (a spread rank keeps its own, cuda_part) */
  int gather;                /* the GEMMs pick rows out of x (MOKD_GEMM_GATHER): 1 gate/up and
                              * its weight gradient, 2 gate/up alone */
  float *g, *u;              /* [TK, I] gate and up before the clamp */
  __nv_bfloat16 *h;          /* [TK, I] */
  __nv_bfloat16 *y;          /* [TK, H] expert output per row */
  float *gs, *us;            /* [P T, I_s] */
  __nv_bfloat16 *hs;         /* [P T, I_s] */
  void *block;               /* one allocation holding all of the above */
  size_t bytes;
  /* a spread step's buffer sets, one a rank; the pointers above then stay
   * NULL, but for x and w */
  int spread;
  cuda_part part[MOKK_DEVICE_MAX_RANKS];
} cuda_ctx;

/* the step code's names for the checks of check.cuh */
#define cuda_fail(err, e, what) mokk_cuda_fail_at((err), (e), (what), __FILE__, __LINE__)
#define CK(call) CUDA_CHECK(call)

/* The resources of rank streams on a linked GPU, made on first use. */
int cuda_peer_ready(cuda_backend *cb, int device, char *err);
/* Frees p, memory of `device`, after the work queued so far on the
 * backend's stream: on that stream for this GPU, else on the tail stream of
 * p's GPU. */
void cuda_free_after(cuda_backend *cb, int device, void *p);

static inline void ctx_release(cuda_backend *cb, cuda_ctx *c)
{
  /* stream-ordered: after the queued work (a spread step's rank streams have
   * joined the backend's stream) */
  if (c->block != NULL)
    cudaFreeAsync(c->block, cb->stream);
  for (int r = 0; r < MOKK_DEVICE_MAX_RANKS; r++)
    if (c->part[r].block != NULL)
      cuda_free_after(cb, c->part[r].device, c->part[r].block);
  free(c);
}

/* The iface's forward and backward entries: cuda_moe.cu's cuda_forward and
 * cuda_backward, reached from the table in cuda_backend.cu. */
int cuda_forward_entry(mokk_backend *b, const mokk_shape *s, int64_t T,
                       const mokk_fwd_rank *ranks, mokk_ctx **out_ctx, char *err);
int cuda_backward_entry(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode, unsigned flags,
                        const mokk_bwd_rank *ranks, char *err);

/* ---- GPU memory (gpumem.cu) --------------------------------------------- */

/* Client GPU memory opened in this process: a legacy IPC handle of a
 * cudaMalloc allocation, or a cuMem allocation's POSIX fd. */
typedef struct mokk_gpu_import {
  void *ptr;
  size_t bytes;
  unsigned long long handle; /* cuMem imports */
  int device;
  int legacy;                /* opened with cudaIpcOpenMemHandle */
  /* several cuMem allocations mapped back to back (an expandable segment):
   * handles[i] at offset sum(sizes[0, i)) of a reservation of `reserved` */
  int chunked, nchunks, capchunks;
  unsigned long long *handles;
  size_t *sizes;
  size_t reserved;
} mokk_gpu_import;

int mokk_gpu_import_ipc(int device, const void *ipc_handle, size_t bytes, mokk_gpu_import *m,
                        char *err);
int mokk_gpu_import_fd(int device, int fd, size_t bytes, mokk_gpu_import *m, char *err);
/* A chunked import: a reservation of bytes, each chunk mapped at its offset
 * (in order), then access set once over the whole range. */
int mokk_gpu_import_reserve(int device, size_t bytes, mokk_gpu_import *m, char *err);
int mokk_gpu_import_chunk(mokk_gpu_import *m, int fd, size_t offset, size_t bytes, char *err);
int mokk_gpu_import_commit(mokk_gpu_import *m, char *err);
/* The arenas and imports of device `owner` mapped from now on are readable
 * and writable by `peer` too (mokk_cuda_link). */
void mokk_gpu_mem_share(int owner, int peer);
/* Unmap and release now: the caller has made sure no queued work uses them. */
void mokk_gpu_mem_free_now(mokk_gpu_mem *m);
void mokk_gpu_import_free_now(mokk_gpu_import *m);

/* A buffer of the backend: a GPU arena it made, or client memory it opened. */
struct cuda_buffer {
  mokk_buffer base;
  int imported;
  mokk_gpu_mem mem;
  mokk_gpu_import imp;
  cudaEvent_t fence;    /* once released: the queued work it waits for */
  cuda_buffer *next;
};

/* ---- ordering with client processes (ipc.cu) ---------------------------- */

/* The done event the daemon records after each step of a session
 * (interprocess, exported once) and the client's ready events, opened once
 * each. Used from one thread at a time. */
int mokk_cuda_events_create(mokk_backend *b, mokk_events **out, char *err);
void mokk_cuda_events_free(mokk_events *ev);
/* The next step on b's stream waits for the client's event (its IPC handle). */
int mokk_cuda_wait(mokk_backend *b, mokk_events *ev, const void *handle, char *err);
/* The GPU whose clients ev serves: its events are that device's. */
int mokk_cuda_events_device(const mokk_events *ev);
/* The stream of the backend that made ev. */
cudaStream_t mokk_cuda_events_home(const mokk_events *ev);
/* Records the session's done event on stream; handle gets its IPC handle. */
int mokk_cuda_events_record(mokk_events *ev, cudaStream_t stream, void *handle,
                            char *err);

/* A fence marks all work queued so far on b's stream. */
int mokk_cuda_fence(mokk_backend *b, cudaEvent_t *fence, char *err);
/* 1 once passed (or broken: nothing will wait on it any more), 0 not yet. */
int mokk_cuda_fence_passed(cudaEvent_t fence);

#endif
