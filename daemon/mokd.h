/* mokd.h - the daemon's shared types (the server, its GPUs, sessions and what
 * they own) and the functions its files call in each other. Everything here
 * is touched on the loop thread only, except a step between its queueing on
 * an executor and its after_work callback (steps.c). */
#ifndef MOKD_H
#define MOKD_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "backend.h"
#include "config.h"
#include "executor.h"
#include "fdpass.h"
#include "frame.h"
#include "gpuid.h"
#include "idmap.h"
#include "metrics.h"
#include "mok.h"
#include "proto/mokd.pb-c.h"
#include "registry.h"

/* the wire's gradient modes are the kernels' ones, by value */
_Static_assert(MOKD__GRAD_MODE__GRAD_BF16 == (int)MOKK_GRAD_BF16 &&
                   MOKD__GRAD_MODE__GRAD_FP32_ACCUM == (int)MOKK_GRAD_FP32_ACCUM,
               "the wire's GradMode and mokk_grad_mode differ");
_Static_assert(MOKW_IPC_BYTES == MOKK_IPC_BYTES, "IPC handles differ in size");

#define MOKD_JOB_MAX 63 /* bytes of a job id */

typedef struct mokd_server mokd_server;
typedef struct mokd_refused mokd_refused; /* a refused peer told why (server.c) */
typedef struct mokd_session mokd_session;
typedef struct mokd_step mokd_step; /* a forward or backward in flight (steps.c) */
typedef struct mokd_group mokd_group; /* an EP group of layers in several sessions (groups.c) */

/* Ranks of one EP group at most. */
#define MOKD_MAX_EP 1024

/* One GPU of the daemon: its backend (stream) and its executor thread. */
typedef struct mokd_gpu {
  int ordinal;
  uint8_t uuid[MOKW_UUID_BYTES]; /* what clients name it by: ordinals differ per process */
  mokk_backend *backend;
  mokd_executor *exec;
  int sessions;         /* sessions placed on it */
} mokd_gpu;

typedef struct mokd_layer {
  uint64_t id;
  mokk_shape shape;      /* P: the EP group's size; 1 alone */
  mokk_grad_mode mode;
  int has_weights;
  Mokd__TensorRef *w[MOKK_NWEIGHTS]; /* validated when set, resolved per step */
  mokd_session *owner;
  mokd_group *group;     /* the group it is rank `rank` of; NULL alone or torn down */
  int rank;
  char *lost;            /* why its group was torn down; NULL while it stands */
  struct mokd_layer *next;
} mokd_layer;

/* The saved state of one group forward: the ranks' contexts share it. */
typedef struct mokd_gctx {
  mokk_ctx *ctx;
  mokk_backend *backend;
  uint64_t group;        /* serial of the group that ran it */
  int refs;              /* contexts that hold it */
  int P;
  int dropped;           /* a rank released its context: no backward can run */
} mokd_gctx;

/* A forward context (owns out and the saved state) or a backward result. */
typedef struct mokd_result {
  uint64_t id;
  int is_context;
  uint64_t layer;
  mokk_grad_mode mode;    /* the layer's at the forward: the layer may go first */
  mokk_ctx *ctx;
  mokd_gctx *gctx;        /* instead of ctx: a group forward's shared state */
  int64_t T;
  mokd_arena *out_arena;  /* block of daemon-allocated outputs */
  mokd_span out;
  /* arenas the saved state points into: the weights', and x's (the CUDA
   * backend's backward reads x again, for the shared expert's gradients) */
  mokd_arena *pinned[MOKK_NWEIGHTS + 1];
  int npinned;
  uint64_t ctx_bytes;      /* charged to the quota and counted in usage */
  int used;               /* a Backward with last set was accepted: no other may run */
  uint64_t mark;          /* Release: the request that named it last */
  struct mokd_result *next, *prev;
} mokd_result;

/* One request waiting in a session's queue, with the fds that came with it. */
typedef struct mokd_pending {
  Mokd__Request *req;
  int fds[MOKW_MAX_FDS];
  int nfds;
  int bad;                /* framing error to answer: MOK_* code */
  int extra_fds;          /* MOK_EINVAL: fds beyond those the request takes */
  int lost_fds;           /* MOK_EINVAL: the kernel dropped fds of this frame */
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
  int fd;          /* -1: fds of this read were dropped (more than MOKW_MAX_FDS) */
  uint64_t c0, c1; /* stream offsets of the read that brought it */
} mokd_rxfd;

struct mokd_session {
  mokd_server *srv;
  uint64_t id;
  int fd;
  /* where the session computes: the CPU backend, or one of the GPUs (placed
   * at Hello); its arenas live there */
  mokk_backend *backend;
  mokd_executor *exec;
  int device;           /* CUDA ordinal; -1 = the CPU backend */
  mokd_gpu *gpu;
  uv_poll_t poll;
  int poll_events;
  int closing;          /* socket gone or being closed */
  int fatal;            /* framing lost: flush the error reply, then close */
  int handle_open;
  int hello_done;
  uint64_t born_ns;     /* accepted at (mokd_now_ns) */
  pid_t pid;
  uid_t uid;
  gid_t gid;
  char name[4 * 63 + 1]; /* the client_name of Hello, escaped (mokd_log_escape) */
  char job[MOKD_JOB_MAX + 1]; /* the job_id of Hello (checked: no escaping needed); "" */
  char tenant[MOKD_TENANT_MAX]; /* "job:ID", else "uid:N": whose share its steps take */
  mokd_tenant *t;       /* its record (the server's: weight, quota), from Hello; NULL before */
  uint32_t proto;       /* the protocol version chosen at Hello */
  int op;               /* body of the request being handled (metrics); 0 = none */
  int probes;           /* Health probes on the executors: the queue waits for them */
  mokw_framer rx;
  mokd_rxfd rxfds[16];
  int nrxfds;
  mokd_pending *pend_head, *pend_tail;
  int npending;
  int pending_fds;      /* fds the pending frames hold */
  mokd_outbuf *out_head, *out_tail;
  size_t out_bytes;     /* replies queued here, not yet taken by the socket */
  int out_fds;          /* fds riding on them */
  mokd_step *busy;      /* the step in flight, at most one */
  int parked;           /* a request waits for the rest of its EP group (groups.c) */
  mokd_registry reg;    /* arenas, quotas, outputs */
  mokd_layer *layers;
  mokd_result *results;
  mokd_idmap result_ids;  /* id -> mokd_result */
  uint64_t release_marks; /* Release requests seen */
  int nlayers;
  mokk_events *events;  /* device backends: the done event, opened ready events */
  mok_usage usage; /* the counters Stats reports, as libmok spells them */
  struct mokd_session *next, *prev;
};

struct mokd_server {
  uv_loop_t *loop;
  mokd_config cfg;
  mokk_backend *backend;  /* the CPU backend, or the first GPU's */
  mokd_gpu gpus[MOKD_MAX_GPUS];
  int ngpus;
  int gpus_linked;        /* peer access between all of them: EP groups may span them */
  uv_pipe_t listener;
  int listening;
  uv_signal_t sig_term, sig_int, sig_hup;
  uv_timer_t watchdog;
  int watchdog_on;
  uv_timer_t hello_timer; /* closes sessions silent past hello_timeout_ms */
  int hello_timer_on;
  mokd_executor *exec;  /* the CPU backend's */
  mokd_session *sessions;
  mokd_tenant *tenants; /* tenants with a session, work queued or memory held */
  int nsessions;
  mokd_group *groups;   /* EP groups forming or formed */
  uint64_t next_id;     /* ids of sessions, arenas, layers, results: one counter */
  uint64_t pending_maps; /* chunks mapped by chunked imports under way, all sessions */
  mok_usage usage;
  uv_timer_t reaper;    /* polls the GPUs' released memory while any waits */
  int reaper_on;
  uint64_t start_ns;
  int draining;
  int stopped;
  mokd_refused *refused;     /* refused peers whose sockets linger */
  int nrefused;
  uv_timer_t refused_timer;  /* ends their linger */
  int refused_timer_on;
  uint64_t max_maps;         /* arenas of all sessions: half of vm.max_map_count */
  uint64_t accept_logged_ns; /* when a failed accept was last logged */
  uint64_t accept_failures;  /* since then */
  mokd_metrics metrics;
  struct mokd_http *http;    /* the --metrics listener */
  uint64_t stall_logged_ns;  /* when a stuck executor was last logged */
  uid_t allow_uids[MOKD_MAX_IDS];
  int nallow_uids;
  gid_t allow_gids[MOKD_MAX_IDS];
  int nallow_gids;
};

/* Every log line about a session names it and its job: LOG_INFO(SESS,
 * SESS_FMT "closed", SESS_ARGS(s)). */
#define SESS_FMT "session %llu job %s: "
#define SESS_ARGS(s) (unsigned long long)(s)->id, (s)->job[0] != 0 ? (s)->job : "-"

/* A request handler: 0 once it has replied (or queued a step that will),
 * else a MOK_* code with the message in err, which dispatch sends back. */
typedef int (*mokd_handler)(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                            char *err);

/* conn.c: the socket, frames and their fds, the output queue, close/destroy */
mokd_session *mokd_session_new(mokd_server *srv, int fd);
void mokd_session_close(mokd_session *s, const char *why);
/* Frees the session once its socket is closed and no step is in flight. */
void mokd_session_maybe_destroy(mokd_session *s);
void mokd_session_arm(mokd_session *s);
/* Whether the replies queued for a peer that does not read are over the bound:
 * then nothing more is read or run for the session until they drain. */
int mokd_session_out_full(const mokd_session *s);
/* Closes the fds a request came with and frees it. */
void mokd_pending_free(mokd_pending *p);
/* Queues a reply; fds are dup'ed (the caller keeps its own). */
int mokd_send(mokd_session *s, Mokd__Response *resp, const int *fds, int nfds);
void mokd_send_done(mokd_session *s, uint64_t id);
void mokd_reply_error(mokd_session *s, uint64_t id, int code, const char *msg);
/* Answers with an error, then closes the session once the answer is out. */
void mokd_session_fail(mokd_session *s, uint64_t id, int code, const char *msg);

/* dispatch.c: the table of request bodies */
/* How many fds the request takes (0 when the body is unknown). */
int mokd_dispatch_fds(const Mokd__Request *q);
/* Runs queued requests in order until one leaves a step in flight. */
void mokd_session_pump(mokd_session *s);

/* The op name of a request body ("Forward"), NULL for none. */
const char *mokd_dispatch_op_name(int body_case);

/* session.c: Hello (placement on a GPU), Stats, Ping */
int mokd_h_hello(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds, char *err);
int mokd_h_stats(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds, char *err);
int mokd_h_ping(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds, char *err);
/* SIGHUP: every tenant record takes its weight and quota from srv->cfg. A
 * quota below what a tenant holds frees nothing: it refuses new memory. */
void mokd_tenants_reconfigure(mokd_server *srv);

/* arenas.c: CreateArena, ImportBuffer, DestroyArena */
int mokd_h_create_arena(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                        char *err);
int mokd_h_import_buffer(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err);
int mokd_h_destroy_arena(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err);
int mokd_import_fds(const Mokd__Request *q);
/* Whether q brings the next chunks of the session's import under way; any
 * other request drops that import. */
int mokd_import_continues(const mokd_session *s, const Mokd__Request *q);

/* layers.c: CreateLayer, SetWeights, DestroyLayer, and a layer's weights */
int mokd_h_create_layer(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                        char *err);
int mokd_h_set_weights(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                       char *err);
int mokd_h_destroy_layer(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err);
mokd_layer *mokd_layer_find(mokd_session *s, uint64_t id);
void mokd_send_layer_created(mokd_session *s, uint64_t req_id, const mokd_layer *l);
void mokd_layer_free(mokd_session *s, mokd_layer *l);
const char *mokd_weight_name(int w);
/* Weights the shape has (3, or 6 with a shared expert), and one's dimensions. */
int mokd_weight_count(const mokk_shape *sh);
int mokd_weight_dims(const mokk_shape *sh, int w, int64_t *d);
/* Resolves the layer's weights for one step, and their arenas. */
int mokd_weights_resolve(mokd_session *s, const mokd_layer *l, const uint16_t **w,
                         mokd_arena **arenas, char *err);

/* steps.c: Forward, Backward (the step, its outputs and its reply), Release */
int mokd_h_forward(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                   char *err);
int mokd_h_backward(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                    char *err);
int mokd_h_release(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                   char *err);
/* groups.c: EP groups. A layer of a group is made by CreateLayer in each
 * rank's session; the reply waits until all P ranks have joined. A step
 * waits (parked) until every rank has sent its request, then runs once for
 * all. A rank that leaves or is late tears the group down. */
/* Joins l (just made, shape.P > 1) to its group; 0 once parked or replied,
 * else a MOK_* code (l is then the caller's to free). */
int mokd_group_join(mokd_session *s, mokd_layer *l, const Mokd__EpGroup *ep, uint64_t req_id,
                    char *err);
/* 0 when l's group stands and is formed, else a MOK_* code and why. */
int mokd_group_usable(const mokd_layer *l, char *err);
/* Parks step j of l's rank; the step runs once all ranks have parked one. */
void mokd_group_park(mokd_layer *l, mokd_step *j);
/* The step parked first in l's group, or NULL: what the others must match. */
mokd_step *mokd_group_first(const mokd_layer *l);
/* Fails the steps parked in l's group (the group stands). */
void mokd_group_fail_step(mokd_layer *l, int code, const char *msg);
/* Tears l's group down (l's rank leaves: destroyed, or its session closes). */
void mokd_group_leave(mokd_layer *l, const char *why);
/* The session closes: each group it is in is torn down. */
void mokd_groups_session_closing(mokd_session *s);
/* Draining: whatever waits for a group is refused. */
void mokd_groups_drain(mokd_server *srv);
uint64_t mokd_group_serial(const mokd_layer *l);
/* Whether l's group has ranks on other GPUs than l's (linked GPUs). */
int mokd_group_spans(const mokd_layer *l);

/* steps.c, for groups.c */
/* Answers a parked step with an error and frees it; its session runs on. */
void mokd_step_fail(mokd_step *j, int code, const char *msg);
/* Runs the group step of steps[0..P) (rank order) on the executor; the
 * array becomes the step's. */
void mokd_steps_run_group(mokd_step **steps, int P);
/* A rank's context c lets go of the group forward's state: no backward can
 * run on it any more (one parked on it fails now); the last one frees it. */
void mokd_gctx_drop(mokd_session *s, const mokd_result *c);
/* A Forward or Backward q of s was refused, before or in its handler: the
 * step parked in the group it was for fails now (the group stands). When q
 * names no layer or context of s, every group of s with a parked step is
 * taken to be that group. */
void mokd_steps_refused(mokd_session *s, const Mokd__Request *q, const char *why);

/* results.c: contexts and results (each function says what it does there) */
mokd_result *mokd_result_find(mokd_session *s, uint64_t id);
mokd_result *mokd_result_new(mokd_session *s, int is_context);
int mokd_result_charge(mokd_session *s, mokd_result *r, uint64_t bytes, char *err);
void mokd_result_pin(mokd_result *r, mokd_arena *a);
int mokd_result_outputs(mokd_session *s, mokd_result *r, int n, const size_t *bytes,
                        size_t *offs, char *err);
void mokd_result_free(mokd_session *s, mokd_result *r);

/* admin.c: ListSessions, Evict, Health (protocol 2) */
int mokd_h_list_sessions(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                         char *err);
int mokd_h_evict(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                 char *err);
int mokd_h_health(mokd_session *s, const Mokd__Request *q, const int *fds, int nfds,
                  char *err);

/* server.c */
/* 0 when every executor makes progress; else how long the worst one has not,
 * with a sentence saying which in why. */
uint64_t mokd_server_stuck(mokd_server *srv, char *why, size_t n);
int mokd_server_start(mokd_server *srv, char *err, size_t errlen);
void mokd_server_maybe_stop(mokd_server *srv);
/* Frees the GPUs' released memory whose work has run; polls for the rest. */
void mokd_server_reap(mokd_server *srv);
/* After the loop: waits for the GPUs and frees what is left. */
void mokd_server_reap_all(mokd_server *srv);

#endif
