/* backend.h - the one interface the daemon talks to (ggml-backend's model):
 * every backend computes the layer of layer.h, and device backends also own
 * the memory steps run on and the ordering with client processes. The table
 * of function pointers behind it is private (backend_impl.h); arguments are
 * validated here, once, before a backend sees them. */
#ifndef MOKK_BACKEND_H
#define MOKK_BACKEND_H

#include "layer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mokk_backend mokk_backend;
typedef struct mokk_ctx mokk_ctx;       /* what a forward saves for its backward */
typedef struct mokk_events mokk_events; /* one client's ordering state (device backends) */

/* Every backend's context starts with this header. */
struct mokk_ctx {
  mokk_shape shape;
  int64_t T;
  int used; /* a backward with MOKK_BWD_LAST ran on it: its saved state is gone */
};

/* Most EP ranks a device backend runs in one step, as virtual ranks on its
 * one device or on the devices of backends linked with it. */
#define MOKK_DEVICE_MAX_RANKS 8

/* An interprocess event or memory handle (cudaIpc*Handle_t), in bytes. */
#define MOKK_IPC_BYTES 64

/* Memory that steps read and write, shareable with a client process: host
 * memory (a memfd) or one device's. Backends' buffers start with this. */
typedef struct mokk_buffer {
  void *base;    /* mapped here: a device address for device memory */
  size_t bytes;  /* what it holds (device allocations are rounded up) */
  int device;    /* CUDA ordinal; -1 = host memory */
} mokk_buffer;

/* Client memory to map: a sealed memfd (host memory, any backend), or the
 * device memory of another process. */
typedef enum {
  MOKK_IMPORT_HOST_FD,   /* fd: a memfd sealed with F_SEAL_SHRINK */
  MOKK_IMPORT_CUDA_IPC,  /* ipc_handle: a cudaIpcMemHandle_t of a cudaMalloc allocation */
  MOKK_IMPORT_CUMEM_FD   /* fd: a cuMem allocation exported as a POSIX fd */
} mokk_import_kind;

typedef struct mokk_import {
  mokk_import_kind kind;
  int fd;
  const void *ipc_handle; /* MOKK_IPC_BYTES */
  size_t bytes;
} mokk_import;

/* threads <= 0 means one per online CPU. */
int mokk_cpu_create(int threads, mokk_backend **out, char *err);
int mokk_cpu_threads(const mokk_backend *b);

/* ---- compute -------------------------------------------------------------- */

/* One step over shape->P ranks of T tokens. ctx may be NULL (inference);
 * otherwise *ctx receives the saved state, which keeps pointers to the
 * weights and to x: they must stay valid and unchanged until the backward
 * (the weights unless the backward names where the same values are now,
 * mokk_bwd_rank.w). On a device backend the step is queued on the device
 * when these return. */
int mokk_forward(mokk_backend *b, const mokk_shape *s, int64_t T,
                 const mokk_fwd_rank *ranks, mokk_ctx **ctx, char *err);
int mokk_backward(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode,
                  const mokk_bwd_rank *ranks, char *err);
/* Flags of mokk_backward_flags. MOKK_BWD_LAST: the last backward of ctx,
 * as autograd's without retain_graph: it may overwrite what the forward
 * saved (a backend keeps its own buffers in those places, and so needs less
 * memory at the backward's peak), and a later backward of ctx fails with
 * MOK_ECONTEXT. The results are the same bits either way. */
enum { MOKK_BWD_LAST = 1 };
int mokk_backward_flags(mokk_backend *b, mokk_ctx *ctx, mokk_grad_mode mode, unsigned flags,
                        const mokk_bwd_rank *ranks, char *err);
void mokk_ctx_free(mokk_backend *b, mokk_ctx *ctx);
/* At least the bytes of the forward context b makes for a step of s->P
 * ranks of T tokens (mokk_ctx_bytes_bound, or more where the backend lays
 * the step out otherwise); spans != 0: the ranks are on several devices. */
uint64_t mokk_backend_ctx_bound(const mokk_backend *b, const mokk_shape *s, int64_t T,
                                int spans);
size_t mokk_ctx_bytes(const mokk_backend *b, const mokk_ctx *ctx);
void mokk_backend_destroy(mokk_backend *b);
const char *mokk_backend_name(const mokk_backend *b);
/* Where the backend computes and makes its memory: a CUDA ordinal, -1 = host. */
int mokk_backend_device(const mokk_backend *b);
/* Bytes of memory on that device; 0 for host memory. */
uint64_t mokk_backend_mem_total(const mokk_backend *b);

/* ---- memory --------------------------------------------------------------- */

/* A new buffer of at least bytes, and *fd, an exported handle to send to the
 * client (the caller closes it). */
int mokk_buffer_alloc(mokk_backend *b, size_t bytes, mokk_buffer **out, int *fd, char *err);
int mokk_buffer_import(mokk_backend *b, const mokk_import *src, mokk_buffer **out, char *err);
/* Client memory made of several allocations mapped back to back in one range
 * (PyTorch's expandable_segments), kind MOKK_IMPORT_HOST_FD or
 * MOKK_IMPORT_CUMEM_FD: _begin reserves bytes of address space, _chunk maps
 * bytes of the allocation behind fd at offset, _commit makes the range usable
 * once the chunks cover it. mokk_buffer_release undoes any part of it. */
int mokk_buffer_import_begin(mokk_backend *b, mokk_import_kind kind, size_t bytes,
                             mokk_buffer **out, char *err);
int mokk_buffer_import_chunk(mokk_backend *b, mokk_buffer *buf, int fd, size_t offset,
                             size_t bytes, char *err);
int mokk_buffer_import_commit(mokk_backend *b, mokk_buffer *buf, char *err);
/* Frees buf once the work queued on b so far has run (host memory: now); the
 * caller never waits. A nonzero return says the fence could not be made and
 * the buffer went after a wait for the device (err says why). */
int mokk_buffer_release(mokk_backend *b, mokk_buffer *buf, char *err);
/* Frees the released buffers whose work has run; wait != 0 waits for the
 * device first (shutdown). Returns how many still wait. */
int mokk_backend_reap(mokk_backend *b, int wait);
/* Whether the backend still works (no sticky device error), on the thread
 * that runs its steps: 0, or a MOK_* code with what broke in err. */
int mokk_backend_check(mokk_backend *b, char *err);

/* ---- ordering with a client process (no host waits) --------------------- */

/* Makes *ev, if it is NULL, for clients of b's device: the events of a
 * client are its GPU's, whichever backend then runs its steps (an EP rank
 * on another GPU of a linked step). Nothing on the CPU backend. */
int mokk_events_make(mokk_backend *b, mokk_events **ev, char *err);
/* Before a step: makes *ev on first use; on a device backend the step then
 * waits on the device for the client's ready event (ready: an IPC event
 * handle, or NULL). Nothing to do on the CPU backend, where *ev stays NULL. */
int mokk_step_begin(mokk_backend *b, mokk_events **ev, const void *ready, char *err);
/* After a step (ev from mokk_step_begin, not NULL): queues the write of the
 * step's status to status (a device int32: 0, or MOK_EEXPERT when an expert
 * id was out of range) and records the done event, whose IPC handle goes to
 * done (MOKK_IPC_BYTES). A step over several ranks calls it once per rank,
 * with each rank's ev, status and done, last != 0 on the last call only:
 * every rank reads the same status, which the last call then clears.
 * Reports launch errors only. */
int mokk_step_end(mokk_backend *b, mokk_events *ev, int32_t *status, int last, void *done,
                  char *err);
void mokk_events_free(mokk_backend *b, mokk_events *ev);

#ifdef __cplusplus
}
#endif

#endif
