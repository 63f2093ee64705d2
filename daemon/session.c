/* session.c - one client connection: reading frames (with their fds), the
 * queue of requests, one handler per body, and the lifetime of everything the
 * session owns. Requests of a session run strictly in order: while a compute
 * job is in flight the queue waits, so a reply never overtakes an earlier one. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "executor.h"
#include "fdpass.h"
#include "log.h"
#include "mokd.h"

#define MAX_PENDING 64
#define READ_CHUNK 65536

static void arm(mokd_session *s);
static void mokd_session_pump(mokd_session *s);

/* ---- output ------------------------------------------------------------- */

/* Writes what the socket takes now; -1 when the socket is broken. */
static int write_out(mokd_session *s)
{
  while (s->out_head != NULL) {
    mokd_outbuf *b = s->out_head;
    ssize_t n = mokw_send(s->fd, b->data + b->off, b->len - b->off, b->fds, b->nfds,
                          MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0)
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? 0 : -1;
    for (int i = 0; i < b->nfds; i++)
      close(b->fds[i]); /* the peer has its own copies now */
    b->nfds = 0;
    b->off += (size_t)n;
    if (b->off == b->len) {
      s->out_head = b->next;
      if (s->out_head == NULL)
        s->out_tail = NULL;
      free(b->data);
      free(b);
    }
  }
  return 0;
}

static void flush(mokd_session *s)
{
  if (write_out(s) != 0)
    mokd_session_close(s, strerror(errno));
  else
    arm(s);
}

/* fds are dup'ed: the caller keeps its own */
static int mokd_session_send(mokd_session *s, Mokd__Response *resp, const int *fds, int nfds)
{
  mokd_outbuf *b;
  int rc;

  if (s->closing)
    return MOK_ECONNRESET;
  b = calloc(1, sizeof *b);
  if (b == NULL)
    return MOK_ENOMEM;
  if ((rc = mokw_pack(&resp->base, &b->data, &b->len)) != 0) {
    free(b);
    return rc;
  }
  for (int i = 0; i < nfds && i < MOKW_MAX_FDS; i++)
    if ((b->fds[b->nfds] = fcntl(fds[i], F_DUPFD_CLOEXEC, 0)) >= 0)
      b->nfds++;
  if (s->out_tail != NULL)
    s->out_tail->next = b;
  else
    s->out_head = b;
  s->out_tail = b;
  flush(s);
  return 0;
}

static void reply_error(mokd_session *s, uint64_t id, int code, const char *msg)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  r.id = id;
  r.status = code;
  r.message = (char *)msg;
  s->usage.errors++;
  s->srv->usage.errors++;
  LOG_DEBUG(SESS, "session %llu request %llu: %s: %s", (unsigned long long)s->id,
            (unsigned long long)id, mok_err_name(code), msg);
  mokd_session_send(s, &r, NULL, 0);
}

/* ---- lifetime ----------------------------------------------------------- */

static void on_poll(uv_poll_t *h, int status, int events);

static void arm(mokd_session *s)
{
  int ev = 0;
  if (s->closing || !s->handle_open)
    return;
  if (s->npending < MAX_PENDING && !s->fatal)
    ev |= UV_READABLE;
  if (s->out_head != NULL)
    ev |= UV_WRITABLE;
  if (ev != s->poll_events) {
    s->poll_events = ev;
    if (ev == 0)
      uv_poll_stop(&s->poll);
    else
      uv_poll_start(&s->poll, ev, on_poll);
  }
}

static void mokd_result_free(mokd_session *s, mokd_result *r)
{
  mokd_result **pp = &s->results;
  while (*pp != NULL && *pp != r)
    pp = &(*pp)->next;
  if (*pp == r)
    *pp = r->next;
  if (r->ctx != NULL)
    mokk_ctx_free(s->backend, r->ctx);
  for (int i = 0; i < r->npinned; i++)
    r->pinned[i]->users--;
  mokd_quota_give(s, r->ctx_bytes, s->cuda_device > 0);
  if (r->is_context) {
    s->usage.contexts--, s->srv->usage.contexts--;
    s->usage.context_bytes -= r->ctx_bytes, s->srv->usage.context_bytes -= r->ctx_bytes;
  } else {
    s->usage.results--, s->srv->usage.results--;
  }
  mokd_out_release(s, r->out_arena, r->out);
  free(r);
}

static void layer_free(mokd_session *s, mokd_layer *l)
{
  mokd_layer **pp = &s->layers;
  while (*pp != NULL && *pp != l)
    pp = &(*pp)->next;
  if (*pp == l)
    *pp = l->next;
  for (int w = 0; w < MOKK_NWEIGHTS; w++)
    mokd_ref_free(l->w[w]);
  s->nlayers--;
  s->usage.layers--, s->srv->usage.layers--;
  free(l);
}

static void pending_free(mokd_pending *p)
{
  for (int i = 0; i < p->nfds; i++)
    close(p->fds[i]);
  if (p->req != NULL)
    mokd__request__free_unpacked(p->req, NULL);
  free(p);
}

/* Frees what the session owns; runs once the socket handle is closed and no
 * job is in flight. */
static void session_destroy(mokd_session *s)
{
  mokd_server *srv = s->srv;

  while (s->results != NULL)
    mokd_result_free(s, s->results);
  while (s->layers != NULL)
    layer_free(s, s->layers);
  while (s->arenas != NULL)
    mokd_arena_free(s, s->arenas);
  while (s->pend_head != NULL) {
    mokd_pending *p = s->pend_head;
    s->pend_head = p->next;
    pending_free(p);
  }
  while (s->out_head != NULL) {
    mokd_outbuf *b = s->out_head;
    s->out_head = b->next;
    for (int i = 0; i < b->nfds; i++)
      close(b->fds[i]);
    free(b->data);
    free(b);
  }
  for (int i = 0; i < s->nrxfds; i++)
    close(s->rxfds[i].fd);
  mokw_framer_free(&s->rx);
#ifdef MOKD_HAVE_CUDA
  mokk_cuda_events_free(s->events);
#endif
  if (s->gpu != NULL)
    s->gpu->sessions--;
  if (s->prev != NULL)
    s->prev->next = s->next;
  else
    srv->sessions = s->next;
  if (s->next != NULL)
    s->next->prev = s->prev;
  srv->nsessions--;
  srv->usage.sessions--;
  LOG_INFO(SESS, "session %llu (pid %d uid %u) closed; daemon holds %llu arenas, %llu "
           "bytes", (unsigned long long)s->id, (int)s->pid, (unsigned)s->uid,
           (unsigned long long)srv->usage.arenas, (unsigned long long)srv->usage.arena_bytes);
  free(s);
  mokd_server_maybe_stop(srv);
}

static void on_handle_closed(uv_handle_t *h)
{
  mokd_session *s = h->data;
  close(s->fd);
  s->fd = -1;
  s->handle_open = 0;
  if (s->busy == NULL)
    session_destroy(s);
}

void mokd_session_close(mokd_session *s, const char *why)
{
  if (s->closing)
    return;
  s->closing = 1;
  write_out(s); /* last replies, as far as the socket takes them now */
  LOG_DEBUG(SESS, "session %llu closing: %s", (unsigned long long)s->id, why);
  uv_poll_stop(&s->poll);
  uv_close((uv_handle_t *)&s->poll, on_handle_closed);
}

mokd_session *mokd_session_new(mokd_server *srv, int fd)
{
  mokd_session *s = calloc(1, sizeof *s);
  struct ucred cr;
  socklen_t len = sizeof cr;

  if (s == NULL)
    return NULL;
  s->srv = srv;
  s->fd = fd;
  s->id = ++srv->next_id;
  s->backend = srv->backend; /* the CPU backend, or placed on a GPU at Hello */
  s->exec = srv->exec;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0)
    s->pid = cr.pid, s->uid = cr.uid, s->gid = cr.gid;
  mokw_framer_init(&s->rx, (size_t)srv->cfg.max_frame_bytes);
  if (uv_poll_init(srv->loop, &s->poll, fd) != 0) {
    mokw_framer_free(&s->rx);
    free(s);
    return NULL;
  }
  s->poll.data = s;
  s->handle_open = 1;
  s->next = srv->sessions;
  if (srv->sessions != NULL)
    srv->sessions->prev = s;
  srv->sessions = s;
  srv->nsessions++;
  srv->usage.sessions++;
  s->usage.sessions = 1;
  arm(s);
  return s;
}

/* ---- input -------------------------------------------------------------- */

static void push_pending(mokd_session *s, mokd_pending *p)
{
  if (s->pend_tail != NULL)
    s->pend_tail->next = p;
  else
    s->pend_head = p;
  s->pend_tail = p;
  s->npending++;
}

static void take_rxfd(mokd_session *s, int i)
{
  memmove(&s->rxfds[i], &s->rxfds[i + 1], (size_t)(s->nrxfds - i - 1) * sizeof *s->rxfds);
  s->nrxfds--;
}

/* Gives the frame [at, end) its fds: those that came with the read holding its
 * first byte. fds whose read ended inside this frame belong to no later frame:
 * they were sent where none is expected. */
static void attach_fds(mokd_session *s, mokd_pending *p, uint64_t at, uint64_t end,
                       int expects)
{
  for (int i = 0; i < s->nrxfds;) {
    mokd_rxfd *r = &s->rxfds[i];
    if (expects > 0 && r->c0 <= at && at < r->c1) {
      p->fds[p->nfds++] = r->fd;
      expects--;
      take_rxfd(s, i);
    } else if (r->c1 <= end) {
      close(r->fd);
      take_rxfd(s, i);
      if (p->bad == 0) {
        p->bad = MOK_EINVAL;
        p->bad_id = p->req != NULL ? p->req->id : 0;
      }
    } else {
      i++;
    }
  }
}

static void parse_frames(mokd_session *s)
{
  for (;;) {
    const uint8_t *payload;
    size_t len;
    uint64_t at;
    int rc = mokw_framer_next(&s->rx, &payload, &len, &at);
    mokd_pending *p;

    if (rc == 0)
      return;
    if (rc == MOK_EMSGSIZE) {
      char msg[160];
      snprintf(msg, sizeof msg, "frame length prefix is over max_frame_bytes (%lld); "
               "closing the connection", (long long)s->srv->cfg.max_frame_bytes);
      reply_error(s, 0, MOK_EMSGSIZE, msg);
      s->fatal = 1; /* flush the reply, then close: see on_poll */
      arm(s);
      return;
    }
    p = calloc(1, sizeof *p);
    if (p == NULL) {
      mokd_session_close(s, "out of memory");
      return;
    }
    if (rc == MOK_EPROTO) {
      p->bad = MOK_EPROTO;
      push_pending(s, p);
      continue;
    }
    p->req = mokd__request__unpack(NULL, len, payload);
    if (p->req == NULL) {
      p->bad = MOK_EPROTO;
    }
    attach_fds(s, p, at, at + MOKW_PREFIX + len,
               p->req != NULL &&
                       p->req->body_case == MOKD__REQUEST__BODY_IMPORT_BUFFER
                   ? 1
                   : 0);
    push_pending(s, p);
  }
}

static int read_some(mokd_session *s)
{
  for (;;) {
    size_t avail;
    uint8_t *dst = mokw_framer_space(&s->rx, READ_CHUNK, &avail);
    int fds[MOKW_MAX_FDS], nfds = MOKW_MAX_FDS, ctrunc;
    ssize_t n;
    uint64_t c0 = mokw_framer_end(&s->rx);

    if (dst == NULL) {
      mokd_session_close(s, "out of memory for the read buffer");
      return -1;
    }
    n = mokw_recv(s->fd, dst, avail, MSG_DONTWAIT, fds, &nfds, &ctrunc);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK)
        return 0;
      if (errno == EINTR)
        continue;
      mokd_session_close(s, strerror(errno));
      return -1;
    }
    for (int i = 0; i < nfds; i++) {
      if (s->nrxfds == (int)(sizeof s->rxfds / sizeof s->rxfds[0])) {
        close(fds[i]);
        continue;
      }
      s->rxfds[s->nrxfds++] = (mokd_rxfd){fds[i], c0, c0 + (uint64_t)(n > 0 ? n : 1)};
    }
    if (ctrunc) {
      mokd_session_close(s, "too many file descriptors on one frame");
      return -1;
    }
    if (n == 0) {
      mokd_session_close(s, "peer closed the connection");
      return -1;
    }
    mokw_framer_commit(&s->rx, (size_t)n);
    if (s->npending >= MAX_PENDING)
      return 0;
    if ((size_t)n < avail)
      return 0;
  }
}

static void mokd_session_on_readable(mokd_session *s)
{
  if (read_some(s) != 0)
    return;
  parse_frames(s);
  mokd_session_pump(s);
  if (s->fatal && s->out_head == NULL && !s->closing)
    mokd_session_close(s, "framing error");
}

static void on_poll(uv_poll_t *h, int status, int events)
{
  mokd_session *s = h->data;

  if (status < 0) {
    mokd_session_close(s, uv_strerror(status));
    return;
  }
  if (events & UV_WRITABLE)
    flush(s);
  if (s->fatal) {
    if (s->out_head == NULL && !s->closing)
      mokd_session_close(s, "framing error");
    return;
  }
  if (!s->closing && (events & UV_READABLE))
    mokd_session_on_readable(s);
}

/* ---- handlers ----------------------------------------------------------- */

static mokd_layer *find_layer(mokd_session *s, uint64_t id)
{
  for (mokd_layer *l = s->layers; l != NULL; l = l->next)
    if (l->id == id)
      return l;
  return NULL;
}

static mokd_result *find_result(mokd_session *s, uint64_t id)
{
  for (mokd_result *r = s->results; r != NULL; r = r->next)
    if (r->id == id)
      return r;
  return NULL;
}

static void send_done(mokd_session *s, uint64_t id)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Empty e = MOKD__EMPTY__INIT;
  r.id = id;
  r.body_case = MOKD__RESPONSE__BODY_DONE;
  r.done = &e;
  mokd_session_send(s, &r, NULL, 0);
}

static int h_hello(mokd_session *s, const Mokd__Request *q, char *err)
{
  const Mokd__Hello *h = q->hello;
  mokd_server *srv = s->srv;
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Welcome w = MOKD__WELCOME__INIT;
  Mokd__Limits lim = MOKD__LIMITS__INIT;

  if (s->hello_done)
    return mokk_fail(err, MOK_EPROTO, "this session has said Hello already");
  if (h->protocol_version != MOK_PROTOCOL_VERSION)
    return mokk_fail(err, MOK_EPROTO, "client speaks protocol %u; this daemon speaks %d",
                     h->protocol_version, MOK_PROTOCOL_VERSION);
  if (srv->ngpus > 0) {
    /* the GPU the client asks for (ordinal + 1), else the least used */
    mokd_gpu *g = NULL;
    for (int i = 0; i < srv->ngpus; i++)
      if (h->device > 0 ? srv->gpus[i].ordinal == h->device - 1
                        : g == NULL || srv->gpus[i].sessions < g->sessions)
        g = &srv->gpus[i];
    if (g == NULL) {
      char list[128] = "";
      for (int i = 0; i < srv->ngpus; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? "," : "",
                 srv->gpus[i].ordinal);
      return mokk_fail(err, MOK_EDEVICE, "CUDA device %d is not one of this daemon's (%s)",
                       h->device - 1, list);
    }
    s->gpu = g;
    g->sessions++;
    s->backend = g->backend;
    s->exec = g->exec;
    s->cuda_device = g->ordinal + 1;
  } else if (h->device > 0) {
    return mokk_fail(err, MOK_EDEVICE, "this daemon runs the %s backend; it has no CUDA "
                     "device %d", mokk_backend_name(srv->backend), h->device - 1);
  }
  snprintf(s->name, sizeof s->name, "%s", h->client_name != NULL ? h->client_name : "");
  s->hello_done = 1;
  LOG_INFO(SESS, "session %llu: hello from \"%s\" (pid %d uid %u gid %u)",
           (unsigned long long)s->id, s->name, (int)s->pid, (unsigned)s->uid,
           (unsigned)s->gid);
  lim.max_frame_bytes = (uint32_t)srv->cfg.max_frame_bytes;
  lim.max_arena_bytes = (uint64_t)srv->cfg.max_arena_bytes;
  lim.session_quota_bytes = (uint64_t)srv->cfg.session_quota_bytes;
  lim.session_gpu_quota_bytes = (uint64_t)srv->cfg.session_gpu_quota_bytes;
  lim.max_layers = (uint32_t)srv->cfg.max_layers;
  w.protocol_version = MOK_PROTOCOL_VERSION;
  w.daemon_version = (char *)MOKD_VERSION;
  w.backend = (char *)mokk_backend_name(srv->backend);
  w.limits = &lim;
  w.session_id = s->id;
  Mokd__Device dev[MOKD_MAX_GPUS], *devp[MOKD_MAX_GPUS];
  for (int i = 0; i < srv->ngpus; i++) {
    mokd__device__init(&dev[i]);
    dev[i].index = (uint32_t)srv->gpus[i].ordinal;
    dev[i].name = (char *)"cuda";
    devp[i] = &dev[i];
  }
  w.n_devices = (size_t)srv->ngpus;
  w.devices = devp;
  w.session_device = s->cuda_device;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_WELCOME;
  r.welcome = &w;
  mokd_session_send(s, &r, NULL, 0);
  return 0;
}

static int h_create_arena(mokd_session *s, const Mokd__Request *q, char *err)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__ArenaCreated ac = MOKD__ARENA_CREATED__INIT;
  mokd_arena *a;
  int rc;

  if (q->create_arena->bytes > SIZE_MAX / 2)
    return mokk_fail(err, MOK_EOVERFLOW, "arena size %llu overflows",
                     (unsigned long long)q->create_arena->bytes);
  if ((rc = mokd_arena_new(s, (size_t)q->create_arena->bytes, ARENA_DAEMON, &a, err)))
    return rc;
  ac.arena = a->id;
  ac.bytes = a->bytes;
  ac.device = a->device;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_ARENA_CREATED;
  r.arena_created = &ac;
  mokd_session_send(s, &r, &a->fd, 1);
  close(a->fd); /* the client has it now; the mapping keeps the memory */
  a->fd = -1;
  LOG_DEBUG(SESS, "session %llu: arena %llu of %zu bytes", (unsigned long long)s->id,
            (unsigned long long)a->id, a->bytes);
  return 0;
}

static int h_import(mokd_session *s, const Mokd__Request *q, mokd_pending *p, char *err)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__BufferImported bi = MOKD__BUFFER_IMPORTED__INIT;
  mokd_arena *a;
  int rc;

  const Mokd__ImportBuffer *ib = q->import_buffer;
  int want_fd = ib->kind != MOKD__IMPORT_KIND__IMPORT_CUDA_IPC;

  if (ib->kind != MOKD__IMPORT_KIND__IMPORT_MEMFD && ib->kind != MOKD__IMPORT_KIND__IMPORT_CUDA_IPC &&
      ib->kind != MOKD__IMPORT_KIND__IMPORT_CUMEM_FD)
    return mokk_fail(err, MOK_EINVAL, "ImportBuffer kind %d is not one this daemon knows",
                     (int)ib->kind);
  if (want_fd && p->nfds != 1)
    return mokk_fail(err, MOK_EINVAL, "ImportBuffer needs exactly one fd (SCM_RIGHTS) on "
                     "its own frame");
  if (!want_fd && p->nfds != 0)
    return mokk_fail(err, MOK_EINVAL, "a CUDA IPC import takes no fd");
  if (!want_fd && ib->cuda_ipc_handle.len != MOKK_CUDA_IPC_BYTES)
    return mokk_fail(err, MOK_EINVAL, "cuda_ipc_handle holds %zu bytes; a cudaIpcMemHandle_t "
                     "has %d", ib->cuda_ipc_handle.len, MOKK_CUDA_IPC_BYTES);
  if (ib->bytes > SIZE_MAX / 2)
    return mokk_fail(err, MOK_EOVERFLOW, "buffer size overflows");
  if (ib->kind == MOKD__IMPORT_KIND__IMPORT_MEMFD)
    rc = mokd_arena_import(s, p->fds[0], (size_t)ib->bytes, &a, err);
  else
    rc = mokd_arena_import_gpu(s, want_fd ? NULL : ib->cuda_ipc_handle.data,
                               want_fd ? p->fds[0] : -1, (size_t)ib->bytes, &a, err);
  if (rc)
    return rc;
  bi.arena = a->id;
  bi.device = a->device;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_BUFFER_IMPORTED;
  r.buffer_imported = &bi;
  mokd_session_send(s, &r, NULL, 0);
  return 0;
}

static int h_destroy_arena(mokd_session *s, const Mokd__Request *q, char *err)
{
  mokd_arena *a = mokd_arena_find(s, q->destroy_arena->arena);

  if (a == NULL)
    return mokk_fail(err, MOK_ENOENT, "arena %llu is not an arena of this session",
                     (unsigned long long)q->destroy_arena->arena);
  if (a->kind == ARENA_OUTPUT)
    return mokk_fail(err, MOK_EPERM, "arena %llu holds daemon outputs; release their "
                     "contexts and results instead", (unsigned long long)a->id);
  if (a->users > 0)
    return mokk_fail(err, MOK_EBUSY, "arena %llu holds weights of %d live forward "
                     "contexts; release them first", (unsigned long long)a->id, a->users);
  mokd_arena_free(s, a);
  send_done(s, q->id);
  return 0;
}

static int h_create_layer(mokd_session *s, const Mokd__Request *q, char *err)
{
  const Mokd__CreateLayer *c = q->create_layer;
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__LayerCreated lc = MOKD__LAYER_CREATED__INIT;
  mokk_shape sh = {0};
  mokd_layer *l;
  int rc;

  if (c->ep != NULL && c->ep->size > 1)
    return mokk_fail(err, MOK_ENOTSUP, "EP groups of several clients (size %u) are not "
                     "served by this daemon yet; create the layer with ep.size 1",
                     c->ep->size);
  if (c->grad_mode != MOKD__GRAD_MODE__GRAD_BF16 &&
      c->grad_mode != MOKD__GRAD_MODE__GRAD_FP32_ACCUM)
    return mokk_fail(err, MOK_EINVAL, "gradient mode %d is unknown", (int)c->grad_mode);
  if (s->nlayers >= s->srv->cfg.max_layers)
    return mokk_fail(err, MOK_EDQUOT, "session already has %d layers (max_layers)",
                     s->nlayers);
  if (c->hidden > MOKK_DIM_MAX || c->intermediate > MOKK_DIM_MAX ||
      c->experts > MOKK_DIM_MAX || c->top_k > MOKK_DIM_MAX ||
      c->shared_intermediate > MOKK_DIM_MAX)
    return mokk_fail(err, MOK_EOVERFLOW, "a layer dimension is larger than %d",
                     MOKK_DIM_MAX);
  sh.H = (int64_t)c->hidden, sh.I = (int64_t)c->intermediate, sh.E = (int64_t)c->experts;
  sh.K = (int64_t)c->top_k, sh.I_s = (int64_t)c->shared_intermediate, sh.P = 1;
  sh.swiglu_limit = c->swiglu_limit;
  if ((rc = mokk_shape_check(&sh, err)))
    return rc;
  l = calloc(1, sizeof *l);
  if (l == NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  l->id = ++s->srv->next_id;
  l->shape = sh;
  l->mode = (mokk_grad_mode)c->grad_mode;
  l->next = s->layers;
  s->layers = l;
  s->nlayers++;
  s->usage.layers++, s->srv->usage.layers++;
  lc.layer = l->id;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_LAYER_CREATED;
  r.layer_created = &lc;
  mokd_session_send(s, &r, NULL, 0);
  return 0;
}

static const char *const wnames[MOKK_NWEIGHTS] = {"w_gate", "w_up", "w_down",
                                                  "s_gate", "s_up", "s_down"};

static void weight_shape(const mokk_shape *sh, int w, int64_t *d)
{
  switch (w) {
  case MOKK_W_GATE: case MOKK_W_UP: d[0] = sh->E / sh->P, d[1] = sh->I, d[2] = sh->H; break;
  case MOKK_W_DOWN: d[0] = sh->E / sh->P, d[1] = sh->H, d[2] = sh->I; break;
  case MOKK_S_GATE: case MOKK_S_UP: d[0] = sh->I_s, d[1] = sh->H; break;
  default: d[0] = sh->H, d[1] = sh->I_s; break;
  }
}

static int nweights(const mokk_shape *sh)
{
  return sh->I_s > 0 ? MOKK_NWEIGHTS : MOKK_S_GATE;
}

/* Resolves the layer's weights for one step; pins their arenas when asked. */
static int resolve_weights(mokd_session *s, mokd_layer *l, const uint16_t **w,
                           mokd_arena **arenas, char *err)
{
  for (int i = 0; i < nweights(&l->shape); i++) {
    int64_t d[3];
    void *p;
    int rc;
    weight_shape(&l->shape, i, d);
    if ((rc = mokd_ref_resolve(s, wnames[i], l->w[i], MOKD__DTYPE__DTYPE_BF16,
                               i < MOKK_S_GATE ? 3 : 2, d, &p, &arenas[i], err)))
      return rc;
    w[i] = p;
  }
  return 0;
}

static int h_set_weights(mokd_session *s, const Mokd__Request *q, char *err)
{
  const Mokd__SetWeights *sw = q->set_weights;
  const Mokd__TensorRef *in[MOKK_NWEIGHTS] = {sw->w_gate, sw->w_up, sw->w_down,
                                              sw->s_gate, sw->s_up, sw->s_down};
  Mokd__TensorRef *copy[MOKK_NWEIGHTS] = {0};
  mokd_layer *l = find_layer(s, sw->layer);
  int n, rc;

  if (l == NULL)
    return mokk_fail(err, MOK_ENOENT, "layer %llu does not exist in this session",
                     (unsigned long long)sw->layer);
  n = nweights(&l->shape);
  for (int i = 0; i < n; i++) {
    int64_t d[3];
    void *p;
    weight_shape(&l->shape, i, d);
    if ((rc = mokd_ref_resolve(s, wnames[i], in[i], MOKD__DTYPE__DTYPE_BF16,
                               i < MOKK_S_GATE ? 3 : 2, d, &p, NULL, err)))
      return rc;
  }
  for (int i = n; i < MOKK_NWEIGHTS; i++)
    if (in[i] != NULL)
      return mokk_fail(err, MOK_EINVAL, "%s given, but the layer has no shared expert",
                       wnames[i]);
  for (int i = 0; i < n; i++)
    if ((copy[i] = mokd_ref_copy(in[i])) == NULL) {
      for (int j = 0; j < i; j++)
        mokd_ref_free(copy[j]);
      return mokk_fail(err, MOK_ENOMEM, "out of memory");
    }
  for (int i = 0; i < MOKK_NWEIGHTS; i++) {
    mokd_ref_free(l->w[i]);
    l->w[i] = copy[i];
  }
  l->has_weights = 1;
  send_done(s, q->id);
  return 0;
}

static mokd_result *result_new(mokd_session *s, int is_context)
{
  mokd_result *r = calloc(1, sizeof *r);
  if (r == NULL)
    return NULL;
  r->id = ++s->srv->next_id;
  r->is_context = is_context;
  r->next = s->results;
  s->results = r;
  if (is_context)
    s->usage.contexts++, s->srv->usage.contexts++;
  else
    s->usage.results++, s->srv->usage.results++;
  return r;
}

static mokd_job *job_new(mokd_session *s, uint64_t id)
{
  mokd_job *j = calloc(1, sizeof *j);
  if (j != NULL) {
    j->sess = s;
    j->req_id = id;
    j->backend = s->backend;
    if (s->cuda_device > 0)
      j->events = &s->events;
  }
  return j;
}

static int check_ready(mokd_session *s, const ProtobufCBinaryData *ev, char *err)
{
  if (ev->len == 0)
    return 0;
  if (s->cuda_device <= 0)
    return mokk_fail(err, MOK_EINVAL, "ready_event is a CUDA event; this daemon runs the %s "
                     "backend", mokk_backend_name(s->backend));
  if (ev->len != MOKK_CUDA_IPC_BYTES)
    return mokk_fail(err, MOK_EINVAL, "ready_event holds %zu bytes; a cudaIpcEventHandle_t "
                     "has %d", ev->len, MOKK_CUDA_IPC_BYTES);
  return 0;
}

static void set_ready(mokd_job *j, const ProtobufCBinaryData *ev)
{
  if (ev->len == MOKK_CUDA_IPC_BYTES) {
    memcpy(j->ready, ev->data, MOKK_CUDA_IPC_BYTES);
    j->has_ready = 1;
  }
}

/* On the CUDA backend each step also returns a status word (i32 [1]), last
 * in its block of outputs. */
static int status_slot(mokd_session *s, mokd_job *j, mokd_result *r, size_t off, char *err)
{
  static const int64_t one[1] = {1};
  if (s->cuda_device <= 0)
    return 0;
  j->status = (int32_t *)((char *)r->out_arena->base + off);
  if ((j->status_ref = mokd_ref_new(r->out_arena->id, off, MOKD__DTYPE__DTYPE_I32, 1, one)) ==
      NULL)
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  return 0;
}

static void job_free(mokd_job *j)
{
  for (int i = 0; i < j->nrefs; i++)
    mokd_ref_free(j->refs[i]);
  mokd_ref_free(j->status_ref);
  free(j);
}

/* Output tensors of one request, laid out in one block: sizes in, offsets out. */
static int alloc_outputs(mokd_session *s, mokd_result *r, int n, const size_t *bytes,
                         size_t *offs, char *err)
{
  size_t total = 0;
  int rc;
  for (int i = 0; i < n; i++) {
    offs[i] = total;
    total += (bytes[i] + 255) / 256 * 256;
  }
  if ((rc = mokd_out_alloc(s, total, &r->out_arena, &r->out, err)))
    return rc;
  for (int i = 0; i < n; i++)
    offs[i] += r->out.off;
  return 0;
}

static int h_forward(mokd_session *s, const Mokd__Request *q, char *err)
{
  const Mokd__Forward *f = q->forward;
  mokd_layer *l = find_layer(s, f->layer);
  mokd_arena *warenas[MOKK_NWEIGHTS];
  int64_t dx[2], di[2];
  void *px, *pi, *pw;
  mokd_job *j;
  mokd_result *r;
  size_t bytes[2], off[2];
  int rc;

  if (l == NULL)
    return mokk_fail(err, MOK_ENOENT, "layer %llu does not exist in this session",
                     (unsigned long long)f->layer);
  if (!l->has_weights)
    return mokk_fail(err, MOK_EINVAL, "layer %llu has no weights; send SetWeights first",
                     (unsigned long long)l->id);
  dx[0] = -1, dx[1] = l->shape.H;
  if ((rc = mokd_ref_resolve(s, "x", f->x, MOKD__DTYPE__DTYPE_BF16, 2, dx, &px, NULL, err)))
    return rc;
  di[0] = dx[0], di[1] = l->shape.K;
  if ((rc = mokd_ref_resolve(s, "topk_ids", f->topk_ids, MOKD__DTYPE__DTYPE_I32, 2, di, &pi,
                             NULL, err)))
    return rc;
  if ((rc = mokd_ref_resolve(s, "topk_weights", f->topk_weights, MOKD__DTYPE__DTYPE_F32, 2,
                             di, &pw, NULL, err)))
    return rc;
  if ((rc = check_ready(s, &f->ready_event, err)))
    return rc;
  if ((j = job_new(s, q->id)) == NULL || (r = result_new(s, 1)) == NULL) {
    free(j);
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  j->res = r;
  j->shape = l->shape;
  j->T = dx[0];
  j->want_ctx = !f->inference;
  j->fr.x = px, j->fr.topk_ids = pi, j->fr.topk_weights = pw;
  r->layer = l->id;
  r->T = dx[0];
  if ((rc = resolve_weights(s, l, j->fr.w, warenas, err)))
    goto fail;
  bytes[0] = (size_t)(j->T * l->shape.H) * 2;
  bytes[1] = sizeof(int32_t);
  if ((rc = alloc_outputs(s, r, s->cuda_device > 0 ? 2 : 1, bytes, off, err)))
    goto fail;
  j->fr.out = (uint16_t *)((char *)r->out_arena->base + off[0]);
  j->refs[j->nrefs++] = mokd_ref_new(r->out_arena->id, off[0], MOKD__DTYPE__DTYPE_BF16, 2, dx);
  if (j->refs[0] == NULL) {
    rc = mokk_fail(err, MOK_ENOMEM, "out of memory");
    goto fail;
  }
  if ((rc = status_slot(s, j, r, off[1], err)))
    goto fail;
  set_ready(j, &f->ready_event);
  if (j->want_ctx)
    for (int i = 0; i < nweights(&l->shape); i++) {
      r->pinned[r->npinned++] = warenas[i];
      warenas[i]->users++;
    }
  s->busy = j;
  mokd_executor_submit(s->exec, j);
  return 0;

fail:
  mokd_result_free(s, r);
  job_free(j);
  return rc;
}

static int h_backward(mokd_session *s, const Mokd__Request *q, char *err)
{
  const Mokd__Backward *b = q->backward;
  mokd_result *c = find_result(s, b->context), *r;
  int64_t dx[2], dtw[2], gs[MOKK_NWEIGHTS][3];
  void *pd;
  size_t bytes[3 + MOKK_NWEIGHTS], offs[3 + MOKK_NWEIGHTS];
  mokd_job *j;
  const mokk_shape *sh;
  int nw, nout, rc;

  if (c == NULL || !c->is_context || c->ctx == NULL)
    return mokk_fail(err, MOK_ECONTEXT, "context %llu is unknown, released, or from an "
                     "inference forward", (unsigned long long)b->context);
  sh = &c->ctx->shape;
  nw = nweights(sh);
  dx[0] = c->T, dx[1] = sh->H;
  if ((rc = mokd_ref_resolve(s, "d_out", b->d_out, MOKD__DTYPE__DTYPE_BF16, 2, dx, &pd, NULL,
                             err)))
    return rc;
  if ((rc = check_ready(s, &b->ready_event, err)))
    return rc;
  mokd_layer *l = find_layer(s, c->layer);
  mokk_grad_mode mode = l != NULL ? l->mode : MOKK_GRAD_BF16;
  if (mode == MOKK_GRAD_FP32_ACCUM && (int)b->n_grads != nw)
    return mokk_fail(err, MOK_EINVAL, "the layer accumulates fp32 gradients: Backward "
                     "needs %d gradient buffers, got %zu", nw, b->n_grads);
  if (mode == MOKK_GRAD_BF16 && b->n_grads != 0 && (int)b->n_grads != nw)
    return mokk_fail(err, MOK_EINVAL, "Backward names %zu gradient buffers; the layer has "
                     "%d weights (or send none to get them back)", b->n_grads, nw);
  if ((j = job_new(s, q->id)) == NULL || (r = result_new(s, 0)) == NULL) {
    free(j);
    return mokk_fail(err, MOK_ENOMEM, "out of memory");
  }
  j->res = r;
  j->backward = 1;
  j->ctx = c->ctx;
  j->mode = mode;
  j->br.d_out = pd;
  r->layer = c->layer;
  r->T = c->T;
  for (int i = 0; i < (int)b->n_grads; i++) {
    void *pg;
    weight_shape(sh, i, gs[i]);
    rc = mokd_ref_resolve(s, wnames[i], b->grads[i],
                          mode == MOKK_GRAD_FP32_ACCUM ? MOKD__DTYPE__DTYPE_F32
                                                       : MOKD__DTYPE__DTYPE_BF16,
                          i < MOKK_S_GATE ? 3 : 2, gs[i], &pg, NULL, err);
    if (rc)
      goto fail;
    if (mode == MOKK_GRAD_FP32_ACCUM)
      j->br.g_f32[i] = pg;
    else
      j->br.g_bf16[i] = pg;
  }
  nout = 2;
  bytes[0] = (size_t)(c->T * sh->H) * 2;
  bytes[1] = (size_t)(c->T * sh->K) * 4;
  if (b->n_grads == 0)
    for (int i = 0; i < nw; i++) {
      weight_shape(sh, i, gs[i]);
      bytes[nout++] = (size_t)mokk_weight_elems(sh, i) * 2;
    }
  bytes[nout] = sizeof(int32_t);
  if ((rc = alloc_outputs(s, r, nout + (s->cuda_device > 0), bytes, offs, err)))
    goto fail;
  if ((rc = status_slot(s, j, r, offs[nout], err)))
    goto fail;
  set_ready(j, &b->ready_event);
  dtw[0] = c->T, dtw[1] = sh->K;
  j->br.d_x = (uint16_t *)((char *)r->out_arena->base + offs[0]);
  j->br.d_topk_weights = (float *)((char *)r->out_arena->base + offs[1]);
  j->refs[j->nrefs++] = mokd_ref_new(r->out_arena->id, offs[0], MOKD__DTYPE__DTYPE_BF16, 2, dx);
  j->refs[j->nrefs++] = mokd_ref_new(r->out_arena->id, offs[1], MOKD__DTYPE__DTYPE_F32, 2, dtw);
  for (int i = 0; i < nout - 2; i++) {
    j->br.g_bf16[i] = (uint16_t *)((char *)r->out_arena->base + offs[2 + i]);
    j->refs[j->nrefs++] = mokd_ref_new(r->out_arena->id, offs[2 + i], MOKD__DTYPE__DTYPE_BF16,
                                       i < MOKK_S_GATE ? 3 : 2, gs[i]);
  }
  for (int i = 0; i < j->nrefs; i++)
    if (j->refs[i] == NULL) {
      rc = mokk_fail(err, MOK_ENOMEM, "out of memory");
      goto fail;
    }
  s->busy = j;
  mokd_executor_submit(s->exec, j);
  return 0;

fail:
  mokd_result_free(s, r);
  job_free(j);
  return rc;
}

static int h_release(mokd_session *s, const Mokd__Request *q, char *err)
{
  const Mokd__Release *rl = q->release;
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Released done = MOKD__RELEASED__INIT;

  for (size_t i = 0; i < rl->n_ids; i++) {
    if (find_result(s, rl->ids[i]) == NULL)
      return mokk_fail(err, MOK_ECONTEXT, "id %llu is not a live context or result of this "
                       "session; nothing was released", (unsigned long long)rl->ids[i]);
    for (size_t k = 0; k < i; k++)
      if (rl->ids[k] == rl->ids[i])
        return mokk_fail(err, MOK_EINVAL, "id %llu is named twice; nothing was released",
                         (unsigned long long)rl->ids[i]);
  }
  for (size_t i = 0; i < rl->n_ids; i++)
    mokd_result_free(s, find_result(s, rl->ids[i]));
  done.count = (uint32_t)rl->n_ids;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_RELEASED;
  r.released = &done;
  mokd_session_send(s, &r, NULL, 0);
  return 0;
}

static int h_destroy_layer(mokd_session *s, const Mokd__Request *q, char *err)
{
  mokd_layer *l = find_layer(s, q->destroy_layer->layer);
  if (l == NULL)
    return mokk_fail(err, MOK_ENOENT, "layer %llu does not exist in this session",
                     (unsigned long long)q->destroy_layer->layer);
  layer_free(s, l); /* its contexts keep what they need */
  send_done(s, q->id);
  return 0;
}

static void fill_usage(Mokd__Usage *u, const mok_usage *m)
{
  u->sessions = m->sessions, u->arenas = m->arenas, u->arena_bytes = m->arena_bytes;
  u->layers = m->layers, u->contexts = m->contexts, u->context_bytes = m->context_bytes;
  u->results = m->results, u->requests = m->requests, u->forwards = m->forwards;
  u->backwards = m->backwards, u->errors = m->errors, u->gpu_bytes = m->gpu_bytes;
}

static int h_stats(mokd_session *s, const Mokd__Request *q)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__StatsReply st = MOKD__STATS_REPLY__INIT;
  Mokd__Usage d = MOKD__USAGE__INIT, m = MOKD__USAGE__INIT;

  fill_usage(&d, &s->srv->usage);
  fill_usage(&m, &s->usage);
  st.daemon = &d;
  st.session = &m;
  st.uptime_ns = mokd_now_ns() - s->srv->start_ns;
  st.backend = (char *)mokk_backend_name(s->backend);
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_STATS;
  r.stats = &st;
  mokd_session_send(s, &r, NULL, 0);
  return 0;
}

static int h_ping(mokd_session *s, const Mokd__Request *q)
{
  Mokd__Response r = MOKD__RESPONSE__INIT;
  Mokd__Pong p = MOKD__PONG__INIT;
  p.nonce = q->ping->nonce;
  r.id = q->id;
  r.body_case = MOKD__RESPONSE__BODY_PONG;
  r.pong = &p;
  mokd_session_send(s, &r, NULL, 0);
  return 0;
}

static int handle(mokd_session *s, mokd_pending *p, char *err)
{
  const Mokd__Request *q = p->req;
  uint32_t unknown;

  if (p->bad == MOK_EPROTO)
    return mokk_fail(err, MOK_EPROTO, q == NULL ? "frame is not a packed Request "
                     "(garbage or a zero-length frame)" : "malformed request");
  if (p->bad == MOK_EINVAL)
    return mokk_fail(err, MOK_EINVAL, "a file descriptor came with a request that takes "
                     "none; it was closed and the request not run");
  if ((unknown = mokw_unknown_field(&q->base)) != 0)
    return mokk_fail(err, MOK_EPROTO, "request carries unknown field %u; this daemon "
                     "speaks protocol %d", unknown, MOK_PROTOCOL_VERSION);
  if (q->body_case == MOKD__REQUEST__BODY__NOT_SET)
    return mokk_fail(err, MOK_EPROTO, "request has no body, or a body this daemon does "
                     "not know");
  if (!s->hello_done && q->body_case != MOKD__REQUEST__BODY_HELLO)
    return mokk_fail(err, MOK_EPROTO, "send Hello first");
  if (s->srv->draining && (q->body_case == MOKD__REQUEST__BODY_FORWARD ||
                           q->body_case == MOKD__REQUEST__BODY_BACKWARD ||
                           q->body_case == MOKD__REQUEST__BODY_CREATE_ARENA ||
                           q->body_case == MOKD__REQUEST__BODY_CREATE_LAYER))
    return mokk_fail(err, MOK_ESHUTDOWN, "mokd is shutting down; no new work is taken");
  switch (q->body_case) {
  case MOKD__REQUEST__BODY_HELLO: return h_hello(s, q, err);
  case MOKD__REQUEST__BODY_CREATE_ARENA: return h_create_arena(s, q, err);
  case MOKD__REQUEST__BODY_IMPORT_BUFFER: return h_import(s, q, p, err);
  case MOKD__REQUEST__BODY_DESTROY_ARENA: return h_destroy_arena(s, q, err);
  case MOKD__REQUEST__BODY_CREATE_LAYER: return h_create_layer(s, q, err);
  case MOKD__REQUEST__BODY_SET_WEIGHTS: return h_set_weights(s, q, err);
  case MOKD__REQUEST__BODY_FORWARD: return h_forward(s, q, err);
  case MOKD__REQUEST__BODY_BACKWARD: return h_backward(s, q, err);
  case MOKD__REQUEST__BODY_RELEASE: return h_release(s, q, err);
  case MOKD__REQUEST__BODY_DESTROY_LAYER: return h_destroy_layer(s, q, err);
  case MOKD__REQUEST__BODY_STATS: return h_stats(s, q);
  case MOKD__REQUEST__BODY_PING: return h_ping(s, q);
  default:
    return mokk_fail(err, MOK_EPROTO, "unknown request body %d", (int)q->body_case);
  }
}

static void mokd_session_pump(mokd_session *s)
{
  while (!s->closing && s->busy == NULL && s->pend_head != NULL) {
    mokd_pending *p = s->pend_head;
    char err[MOK_ERRLEN] = "";
    int rc;

    s->pend_head = p->next;
    if (s->pend_head == NULL)
      s->pend_tail = NULL;
    s->npending--;
    s->usage.requests++;
    s->srv->usage.requests++;
    rc = handle(s, p, err);
    if (rc != 0)
      reply_error(s, p->req != NULL ? p->req->id : p->bad_id, rc, err);
    pending_free(p);
  }
  arm(s);
}

void mokd_session_job_done(mokd_job *j)
{
  mokd_session *s = j->sess;
  mokd_result *r = j->res;
  Mokd__Response resp = MOKD__RESPONSE__INIT;
  Mokd__NewArena na = MOKD__NEW_ARENA__INIT, *nap = &na;
  Mokd__Timing tm = MOKD__TIMING__INIT;
  Mokd__ForwardDone fd = MOKD__FORWARD_DONE__INIT;
  Mokd__BackwardDone bd = MOKD__BACKWARD_DONE__INIT;
  int rc = j->rc;

  s->busy = NULL;
  if (rc == 0 && !j->backward && j->ctx != NULL) {
    r->ctx = j->ctx;
    r->ctx_bytes = mokk_ctx_bytes(s->backend, j->ctx);
    rc = mokd_quota_take(s, r->ctx_bytes, s->cuda_device > 0, j->err);
    if (rc != 0)
      r->ctx_bytes = 0;
    else
      s->usage.context_bytes += r->ctx_bytes, s->srv->usage.context_bytes += r->ctx_bytes;
  }
  if (j->backward)
    s->usage.backwards++, s->srv->usage.backwards++;
  else
    s->usage.forwards++, s->srv->usage.forwards++;
  if (s->closing) {
    mokd_result_free(s, r);
    job_free(j);
    if (!s->handle_open)
      session_destroy(s);
    else
      mokd_server_maybe_stop(s->srv);
    return;
  }
  if (rc != 0) {
    reply_error(s, j->req_id, rc, j->err);
    mokd_result_free(s, r);
  } else {
    tm.queued_ns = j->t_start - j->t_submit;
    tm.compute_ns = j->t_end - j->t_start;
    resp.id = j->req_id;
    if (r->out_arena->fd >= 0) { /* first reply naming this output arena */
      na.arena = r->out_arena->id;
      na.bytes = r->out_arena->bytes;
      na.device = r->out_arena->device;
      resp.n_new_arenas = 1;
      resp.new_arenas = &nap;
    }
    if (j->backward) {
      bd.result = r->id;
      bd.d_x = j->refs[0];
      bd.d_topk_weights = j->refs[1];
      bd.n_grads = (size_t)(j->nrefs - 2);
      bd.grads = j->refs + 2;
      bd.timing = &tm;
      bd.status = j->status_ref;
      if (j->has_done)
        bd.done_event = (ProtobufCBinaryData){MOKK_CUDA_IPC_BYTES, j->done};
      resp.body_case = MOKD__RESPONSE__BODY_BACKWARD_DONE;
      resp.backward_done = &bd;
    } else {
      fd.context = r->id;
      fd.out = j->refs[0];
      fd.timing = &tm;
      fd.status = j->status_ref;
      if (j->has_done)
        fd.done_event = (ProtobufCBinaryData){MOKK_CUDA_IPC_BYTES, j->done};
      resp.body_case = MOKD__RESPONSE__BODY_FORWARD_DONE;
      resp.forward_done = &fd;
    }
    if (resp.n_new_arenas > 0) {
      mokd_session_send(s, &resp, &r->out_arena->fd, 1);
      close(r->out_arena->fd);
      r->out_arena->fd = -1;
    } else {
      mokd_session_send(s, &resp, NULL, 0);
    }
  }
  job_free(j);
  mokd_session_pump(s);
  mokd_server_maybe_stop(s->srv);
}
