/* mokd.h - the daemon's shared types: server, sessions and what they own.
 * Everything here is touched on the loop thread only, except a job between
 * mokd_executor_submit() and its completion callback. */
#ifndef MOKD_H
#define MOKD_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "backend.h"
#include "cuda/cuda_backend.h"
#include "config.h"
#include "fdpass.h"
#include "frame.h"
#include "mok.h"
#include "proto/mokd.pb-c.h"

/* the wire's gradient modes are the kernels' ones, by value */
_Static_assert(MOKD__GRAD_MODE__GRAD_BF16 == (int)MOKK_GRAD_BF16 &&
                   MOKD__GRAD_MODE__GRAD_FP32_ACCUM == (int)MOKK_GRAD_FP32_ACCUM,
               "the wire's GradMode and mokk_grad_mode differ");
_Static_assert(MOKW_IPC_BYTES == MOKK_CUDA_IPC_BYTES, "IPC handles differ in size");

typedef struct mokd_server mokd_server;
typedef struct mokd_session mokd_session;

#define MOKD_MAX_GPUS 16

/* One GPU of the daemon: its backend (stream) and its executor thread. */
typedef struct mokd_gpu {
  int ordinal;
  mokk_backend *backend;
  struct mokd_executor *exec;
  int sessions;         /* sessions placed on it */
} mokd_gpu;

typedef enum { ARENA_DAEMON, ARENA_IMPORTED, ARENA_OUTPUT } mokd_arena_kind;

typedef struct mokd_span {
  size_t off, len;
} mokd_span;

typedef struct mokd_arena {
  uint64_t id;
  mokd_arena_kind kind;
  int fd;            /* kept for output arenas until sent; -1 after */
  void *base;
  size_t bytes;
  int device;        /* CUDA ordinal + 1 of a GPU arena; 0 = host memory */
  mokk_gpu_mem gpu;      /* daemon-made GPU arenas */
  mokk_gpu_import imp;   /* imported GPU memory (kind ARENA_IMPORTED, device > 0) */
  void *fence;           /* once retired: the queued work it waits for */
  int users;         /* contexts and results pointing into it */
  mokd_span *free;   /* output arenas: free ranges, sorted by offset */
  size_t nfree, capfree, used;
  struct mokd_arena *next;
} mokd_arena;

typedef struct mokd_layer {
  uint64_t id;
  mokk_shape shape;      /* P = 1 within one session */
  mokk_grad_mode mode;
  int has_weights;
  Mokd__TensorRef *w[MOKK_NWEIGHTS]; /* validated when set, resolved per step */
  struct mokd_layer *next;
} mokd_layer;

/* A forward context (owns out and the saved state) or a backward result. */
typedef struct mokd_result {
  uint64_t id;
  int is_context;
  uint64_t layer;
  mokk_ctx *ctx;
  int64_t T;
  mokd_arena *out_arena;  /* block of daemon-allocated outputs */
  mokd_span out;
  mokd_arena *pinned[MOKK_NWEIGHTS]; /* weight arenas the saved state points into */
  int npinned;
  size_t ctx_bytes;
  struct mokd_result *next;
} mokd_result;

/* One request waiting in a session's queue, with the fds that came with it. */
typedef struct mokd_pending {
  Mokd__Request *req;
  int fds[4];
  int nfds;
  int bad;                /* framing error to answer: MOK_* code */
  uint64_t bad_id;
  struct mokd_pending *next;
} mokd_pending;

typedef struct mokd_outbuf {
  uint8_t *data;
  size_t len, off;
  int fds[MOKW_MAX_FDS];
  int nfds;
  struct mokd_outbuf *next;
} mokd_outbuf;

typedef struct mokd_rxfd {
  int fd;
  uint64_t c0, c1; /* stream offsets of the read that brought it */
} mokd_rxfd;

typedef struct mokd_job mokd_job;

struct mokd_session {
  mokd_server *srv;
  uint64_t id;
  int fd;
  /* where the session computes: the CPU backend, or one of the GPUs (placed
   * at Hello); its arenas live there */
  mokk_backend *backend;
  struct mokd_executor *exec;
  int cuda_device;      /* ordinal + 1; 0 = the CPU backend */
  mokd_gpu *gpu;
  uv_poll_t poll;
  int poll_events;
  int closing;          /* socket gone or being closed */
  int fatal;            /* framing lost: flush the error reply, then close */
  int handle_open;
  int hello_done;
  pid_t pid;
  uid_t uid;
  gid_t gid;
  char name[64];
  mokw_framer rx;
  mokd_rxfd rxfds[16];
  int nrxfds;
  mokd_pending *pend_head, *pend_tail;
  int npending;
  mokd_outbuf *out_head, *out_tail;
  mokd_job *busy;       /* the job in flight, at most one */
  mokd_arena *arenas;
  mokd_layer *layers;
  mokd_result *results;
  int nlayers;
  uint64_t bytes;       /* host memory held against session_quota_bytes */
  uint64_t gpu_bytes;   /* GPU memory held against session_gpu_quota_bytes */
  mokk_cuda_events *events; /* CUDA backend: done event, opened ready events */
  mok_usage usage; /* the counters Stats reports, as libmok spells them */
  struct mokd_session *next, *prev;
};

struct mokd_job {
  mokd_session *sess;
  uint64_t req_id;
  int backward;
  mokk_backend *backend;
  mokk_shape shape;
  int64_t T;
  mokk_fwd_rank fr;
  mokk_bwd_rank br;
  mokk_grad_mode mode;
  mokk_ctx *ctx;
  int want_ctx;
  mokk_cuda_events **events;  /* the session's, made on first use by the executor */
  int has_ready;
  uint8_t ready[MOKK_CUDA_IPC_BYTES];  /* the client's ready event */
  uint8_t done[MOKK_CUDA_IPC_BYTES];   /* the done event, filled by the executor */
  int has_done;
  int32_t *status;                     /* device word the step's status goes to */
  Mokd__TensorRef *status_ref;
  mokd_result *res;
  Mokd__TensorRef *refs[2 + MOKK_NWEIGHTS]; /* output refs to send back */
  int nrefs;
  int rc;
  char err[MOK_ERRLEN];
  uint64_t t_submit, t_start, t_end;
  mokd_job *next;
};

struct mokd_server {
  uv_loop_t *loop;
  mokd_config cfg;
  mokk_backend *backend;  /* the CPU backend, or the first GPU's */
  mokd_gpu gpus[MOKD_MAX_GPUS];
  int ngpus;
  uv_pipe_t listener;
  int listening;
  uv_signal_t sig_term, sig_int, sig_hup;
  uv_timer_t watchdog;
  int watchdog_on;
  struct mokd_executor *exec;
  mokd_session *sessions;
  int nsessions;
  uint64_t next_id;     /* ids of sessions, arenas, layers, results: one counter */
  mok_usage usage;
  mokd_arena *retired;  /* freed GPU arenas waiting for their fence to pass */
  uv_timer_t reaper;    /* polls the fences while any wait */
  int reaper_on;
  uint64_t start_ns;
  int draining;
  int stopped;
  uid_t allow_uids[32];
  int nallow_uids;
  gid_t allow_gids[32];
  int nallow_gids;
};

uint64_t mokd_now_ns(void);

/* registry.c */
int mokd_arena_new_memfd(mokd_session *s, size_t bytes, mokd_arena_kind kind,
                         mokd_arena **out, char *err);
/* A GPU arena when the backend is CUDA, else a memfd. */
int mokd_arena_new(mokd_session *s, size_t bytes, mokd_arena_kind kind, mokd_arena **out,
                   char *err);
int mokd_arena_import(mokd_session *s, int fd, size_t bytes, mokd_arena **out, char *err);
/* Client GPU memory: a cudaIpcMemHandle_t (ipc != NULL) or a cuMem fd. */
int mokd_arena_import_gpu(mokd_session *s, const void *ipc, int fd, size_t bytes,
                          mokd_arena **out, char *err);
mokd_arena *mokd_arena_find(mokd_session *s, uint64_t id);
/* GPU memory goes once the work queued before the call has run (the loop
 * never waits for the GPU); host memory goes at once. */
void mokd_arena_free(mokd_session *s, mokd_arena *a);
/* Stops polling the retired arenas; mokd_retired_drain (after the loop has
 * stopped) waits for the device and frees what is left. */
void mokd_retired_stop(mokd_server *srv);
void mokd_retired_drain(mokd_server *srv);
/* A block of len bytes in an output arena. A new output arena keeps its fd
 * open until the first reply that names it carries the fd to the client. */
int mokd_out_alloc(mokd_session *s, size_t len, mokd_arena **arena, mokd_span *span,
                   char *err);
void mokd_out_release(mokd_session *s, mokd_arena *a, mokd_span span);
/* Validates a wire tensor against this session's arenas. shape entries < 0 are
 * free (and filled in); returns the mapped address in *ptr. */
int mokd_ref_resolve(mokd_session *s, const char *what, const Mokd__TensorRef *r,
                     Mokd__DType dtype, int ndim, int64_t *shape, void **ptr,
                     mokd_arena **arena, char *err);
Mokd__TensorRef *mokd_ref_new(uint64_t arena, uint64_t offset, Mokd__DType dtype, int ndim,
                              const int64_t *shape);
Mokd__TensorRef *mokd_ref_copy(const Mokd__TensorRef *r);
void mokd_ref_free(Mokd__TensorRef *r);
/* Charges host (gpu = 0) or GPU memory to the session's quota for it. */
int mokd_quota_take(mokd_session *s, uint64_t bytes, int gpu, char *err);
void mokd_quota_give(mokd_session *s, uint64_t bytes, int gpu);

/* session.c */
mokd_session *mokd_session_new(mokd_server *srv, int fd);
void mokd_session_close(mokd_session *s, const char *why);
void mokd_session_job_done(mokd_job *job);

/* server.c */
int mokd_server_start(mokd_server *srv, char *err, size_t errlen);
void mokd_server_maybe_stop(mokd_server *srv);

#endif
